"""Bad files: one line naming the file and the problem, exit code 2, never a traceback."""

from __future__ import annotations

import json

import numpy as np
import pytest

from .conftest import run_cli


def assert_clean_error(r, *needles):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.fixture()
def bad_files(tmp_path, model_pair):
    pair = model_pair("llava15")
    data = pair.model.read_bytes()
    files = {
        "missing": tmp_path / "missing.gguf",
        "empty": tmp_path / "empty.gguf",
        "notgguf": tmp_path / "notgguf.gguf",
        "trunc_tensors": tmp_path / "trunc_tensors.gguf",
        "trunc_header": tmp_path / "trunc_header.gguf",
    }
    files["empty"].write_bytes(b"")
    files["notgguf"].write_bytes(b"PK\x03\x04 this is a zip, not a model" * 10)
    files["trunc_tensors"].write_bytes(data[: len(data) - 4096])
    files["trunc_header"].write_bytes(data[:200])
    return files


@pytest.mark.parametrize(
    "case,needle",
    [
        ("missing", "no such file"),
        ("empty", "empty file"),
        ("notgguf", "not a GGUF file"),
        ("trunc_tensors", "truncated"),
        ("trunc_header", "truncated or corrupt"),
    ],
)
def test_bad_model_file(bad_files, case, needle):
    path = str(bad_files[case])
    assert_clean_error(run_cli("inspect", path), path, needle)


def test_bad_mmproj_file(bad_files, model_pair):
    pair = model_pair("llava15")
    path = str(bad_files["trunc_tensors"])
    assert_clean_error(run_cli("inspect", str(pair.model), "--mmproj", path), path, "truncated")


def test_mmproj_passed_as_model(model_pair):
    pair = model_pair("llava15")
    r = run_cli("inspect", str(pair.mmproj), "--mmproj", str(pair.mmproj))
    assert_clean_error(r, str(pair.mmproj), "vision projector (mmproj), not a language model")


def test_model_passed_as_mmproj(model_pair):
    pair = model_pair("llava15")
    r = run_cli("inspect", str(pair.model), "--mmproj", str(pair.model))
    assert_clean_error(r, str(pair.model), "is a language model")


@pytest.fixture(scope="module")
def mismatched_mmproj(tmp_path_factory):
    """An mmproj whose output width (96) differs from the tiny text model's n_embd (128)."""
    from edgevlm_testkit.llava import write_clip_mlp
    from edgevlm_testkit.shapes import LLAVA_PRESETS

    out = tmp_path_factory.mktemp("mismatch") / "mmproj.gguf"
    return write_clip_mlp(out, LLAVA_PRESETS["tiny"][1], 96, 5, "mismatch")


def test_mismatched_pair(model_pair, mismatched_mmproj):
    pair = model_pair("llava15")
    r = run_cli("inspect", str(pair.model), "--mmproj", str(mismatched_mmproj))
    assert_clean_error(r, str(mismatched_mmproj), "output width 96", "n_embd 128", "not a pair")
    assert "pair: NOT compatible" in r.stdout


def test_mismatched_pair_json(model_pair, mismatched_mmproj):
    pair = model_pair("llava15")
    r = run_cli("inspect", str(pair.model), "--mmproj", str(mismatched_mmproj), "--json")
    assert r.returncode == 2
    rep = json.loads(r.stdout)
    assert rep["pair"]["compatible"] is False and "96" in rep["pair"]["reason"]


# --- errors from the library's public calls: EdgeVLMError subclasses, never a bare ValueError ----


@pytest.fixture(scope="module")
def unknown_mmproj(tmp_path_factory):
    """A projector that says it is ``cogvlm``: a type whose token counts edgevlm does not know
    (mtmd would count it once loaded; unloaded, nothing can)."""
    from edgevlm_testkit.llava import write_clip_mlp
    from edgevlm_testkit.shapes import LLAVA_PRESETS

    out = tmp_path_factory.mktemp("cogvlm") / "mmproj.gguf"
    return write_clip_mlp(out, LLAVA_PRESETS["tiny"][1], 128, 5, "cogvlm-labelled", projector_type="cogvlm")


def test_a_projector_without_token_arithmetic_is_a_clean_error(unknown_mmproj, images):
    import edgevlm
    from edgevlm.errors import UnsupportedModel
    from edgevlm.vision.budget import plan_image

    proj = edgevlm.load_projector(unknown_mmproj)
    with pytest.raises(UnsupportedModel, match="'cogvlm' are not known"):
        edgevlm.image_tokens(proj, 640, 480)
    with pytest.raises(UnsupportedModel):
        plan_image(edgevlm.load_image(images["noise"]), proj)
    r = run_cli("budget", str(images["noise"]), "--mmproj", str(unknown_mmproj))
    assert_clean_error(r, "cogvlm")
    r = run_cli("inspect", str(unknown_mmproj))  # still described, tokens marked unknown
    assert r.returncode == 0 and "cogvlm" in r.stdout and "not known" in r.stdout


def test_bad_values_in_library_calls_are_input_errors(model_pair, images, tmp_path):
    import edgevlm
    from edgevlm.caption import CaptionJob, CaptionSettings
    from edgevlm.errors import InputError
    from edgevlm.plan.planner import Wishes
    from edgevlm.vision.detail import score_boxes

    pair = model_pair("llava15")
    proj = edgevlm.load_projector(pair.mmproj)
    with pytest.raises(InputError):
        edgevlm.image_tokens(proj, 0, 480)
    for bad in (dict(kv="q5_1"), dict(n_ctx=0), dict(merge="half"), dict(reply_tokens=0)):
        with pytest.raises(InputError):
            Wishes(**bad)
    with pytest.raises(InputError):
        edgevlm.load(pair.model, pair.mmproj, kv="q5_1")
    with pytest.raises(InputError, match="--format xml"):
        CaptionJob([], CaptionSettings(), model=str(pair.model), mmproj=str(pair.mmproj), fmt="xml")
    with pytest.raises(InputError):
        CaptionSettings(merge="half").validate()
    with pytest.raises(InputError, match="unknown scorer"):
        score_boxes(np.zeros((8, 8, 3), np.uint8), [(0, 0, 8, 8)], "sharpness")
    with edgevlm.load(pair.model, pair.mmproj, n_threads=2) as eng:
        with pytest.raises(InputError, match="max_tokens 0"):
            eng.chat("hi", max_tokens=0)
        assert eng.messages == [] and eng.chat("hi", max_tokens=1).stats.predicted_n <= 1
