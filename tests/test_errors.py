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
    with edgevlm.load(pair.model, pair.mmproj, n_threads=2) as vlm:
        eng = vlm.conversation()
        with pytest.raises(InputError, match="max_tokens 0"):
            eng.chat("hi", max_tokens=0)
        assert eng.messages == [] and eng.chat("hi", max_tokens=1).stats.predicted_n <= 1


# The error table at the HTTP edge (serve.api_errors): one status per exception class for
# every API, whatever shape each puts it in.


def _example(cls: type[BaseException]) -> BaseException:
    return cls("something went wrong")  # type: ignore[call-arg]


def test_every_class_in_the_error_table_has_one_status_in_every_api():
    from edgevlm.serve import anthropic_reply as anthropic
    from edgevlm.serve import ollama
    from edgevlm.serve import openai_reply as openai
    from edgevlm.serve.api_errors import TABLE

    for cls, kind in TABLE.items():
        exc = _example(cls)
        o_status, o_body, o_headers = openai.error_for(exc, 7)
        a_status, a_body, a_headers = anthropic.error_for(exc, 7)
        l_status, l_body, l_headers = ollama.error_for(exc, 7)
        assert o_status == a_status == l_status == kind.status, cls
        assert o_headers == a_headers == l_headers, cls
        assert o_body["error"]["type"] == kind.openai and set(o_body["error"]) == {"message", "type", "param", "code"}
        assert a_body["type"] == "error" and a_body["error"]["type"] == kind.anthropic, cls
        assert set(l_body) == {"error"} and l_body["error"] == o_body["error"]["message"] == a_body["error"]["message"]
        if kind.retry:
            assert o_headers == {"retry-after": "7"}, cls
        elif kind.retry is False:
            assert o_headers == {"x-should-retry": "false"} and kind.status < 500, cls


def test_an_api_error_is_not_bad_input_but_its_4xx_still_exits_2():
    from edgevlm.errors import EdgeVLMError, InputError
    from edgevlm.serve.api_errors import TABLE, APIError, ServerBusy, kind_of
    from edgevlm.serve.openai_reply import error_for

    assert not issubclass(APIError, InputError) and issubclass(APIError, EdgeVLMError)
    for cls in TABLE:
        if isinstance(cls, type) and issubclass(cls, APIError):
            assert cls.exit_code == (2 if kind_of(_example(cls)).status < 500 else 1), cls
    assert ServerBusy("x").exit_code == 1
    # bad input from the engine is still a 400 in OpenAI's shape
    status, body, _ = error_for(InputError("no such picture"))
    assert status == 400 and body["error"]["type"] == "invalid_request_error"


def test_a_memory_busy_retry_after_is_the_servers_retry_after():
    from edgevlm.errors import MemoryBusy
    from edgevlm.serve import anthropic_reply as anthropic
    from edgevlm.serve import ollama
    from edgevlm.serve import openai_reply as openai
    from edgevlm.serve.options import ServeOptions

    for api in (openai, anthropic, ollama):
        assert api.error_for(MemoryBusy("busy"))[2] == {"retry-after": str(ServeOptions().retry_after_s)}
        assert api.error_for(MemoryBusy("busy"), 11)[2] == {"retry-after": "11"}


def test_the_server_answers_a_503_with_its_own_retry_after():
    from starlette.testclient import TestClient

    from edgevlm.errors import MemoryBusy
    from edgevlm.serve.app import create_app
    from edgevlm.serve.options import ServeOptions

    def load():
        raise MemoryBusy("not now")

    app = create_app(load, ServeOptions(retry_after_s=9))
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 503 and r.headers["retry-after"] == "9"


def test_no_api_error_in_serve_spells_a_status():
    """The table owns statuses: no ``APIError(...)`` (or a named subclass) in edgevlm/serve
    passes a number, and no call builds a ``retry-after`` header by hand."""
    import ast
    from pathlib import Path

    from edgevlm.serve import api_errors

    names = {c.__name__ for c in api_errors.TABLE if c.__module__ == api_errors.__name__}
    assert {"APIError", "ServerBusy", "WorkerStopped"} <= names
    bad = []
    for p in sorted((Path(api_errors.__file__).parent).glob("*.py")):
        for n in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(n, ast.Constant) and n.value == "retry-after" and p.name != "api_errors.py":
                bad.append(f"{p.name}:{n.lineno} a retry-after header")
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in names:
                args = [*n.args, *(k.value for k in n.keywords)]
                if any(isinstance(a, ast.Constant) and isinstance(a.value, int) for a in args):
                    bad.append(f"{p.name}:{n.lineno} {n.func.id}(... a status ...)")
                if any(k.arg in ("status", "headers", "type_") for k in n.keywords):
                    bad.append(f"{p.name}:{n.lineno} {n.func.id}(... by hand ...)")
    assert not bad, bad
