"""Visual token merging on real llama.cpp, for 1-D RoPE (LLaVA) and M-RoPE (Qwen2-VL) decoders."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import edgevlm
from edgevlm.backend.llama import Backend
from edgevlm.errors import InputError
from edgevlm.vision.images import from_rgb
from edgevlm.vision.merge import MergeSpec, merge_tokens, uniform_prune

from .conftest import run_cli
from .reference import stock_logits

FLAT = from_rgb(np.full((448, 448, 3), 120, np.uint8), "flat.png")  # square: no letterbox bars
NOISE = from_rgb((np.random.default_rng(0).random((480, 640, 3)) * 255).astype(np.uint8), "noise.png")


@pytest.fixture(scope="module", params=["llava15", "qwen2vl"])
def eng(request, model_pair):
    pair = model_pair(request.param)
    e = edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, n_threads=2, kv="f16")
    yield e
    e.close()


@pytest.fixture(scope="module")
def stock(eng):
    """The logits after ``eng``'s last turn's prompt, evaluated through mtmd's own stock path on
    a backend of its own (``tests.reference``)."""
    be = eng.backend
    with Backend(
        be.model_path,
        be.mmproj_path,
        n_ctx=4096,
        n_threads=2,
        type_k="f16",
        type_v="f16",
        image_max_tokens=be.image_max_tokens,
    ) as ref:

        def logits(conversation):
            prompt = eng.render(conversation.messages[:-1])  # its last turn's prompt, unmerged
            pics = {eng.scheduler.images.key(v): v for m in conversation.messages for v in m.images}
            try:
                return stock_logits(ref, prompt, pics)
            finally:
                prompt.release()

        yield logits


def turn(e, spec, img, n=1):
    """One turn of a fresh conversation with merging ``spec``, over the same loaded model."""
    r, logits, _ = turn_in(e, spec, img, n)
    return r, logits


def turn_in(e, spec, img, n=1):
    """``turn``, and the conversation it was."""
    view = e.conversation(merge=MergeSpec.parse(spec))
    r = view.chat("Describe it.", [img], max_tokens=n, temperature=0.0)
    return r, e.backend.logits().copy(), view


def close_to_stock(own, ref):
    """The same logits within the float rounding of another slicing of the picture (the stock
    path decodes it in n_batch pieces, the step loop in slices it sizes by measured step times):
    wrong positions or rows move them by the logits' own scale, this by under 1 %."""
    assert np.corrcoef(ref, own)[0, 1] > 0.999 and int(np.argmax(ref)) == int(np.argmax(own))
    assert np.abs(ref - own).max() <= 0.03 * np.abs(ref).max()


def test_spec_parsing():
    assert MergeSpec.parse("ratio:0.5").target(576) == 288
    assert MergeSpec.parse("tokens:100").target(50) == 50
    assert not MergeSpec.parse("off").enabled
    for bad in ("ratio:0", "ratio:2", "half", "threshold:3", "tokens:0"):
        with pytest.raises(InputError):
            MergeSpec.parse(bad)


def test_flat_merges_strongly_noise_hardly(eng):
    flat, _ = turn(eng, "threshold:0.9", FLAT)
    noise, _ = turn(eng, "threshold:0.9", NOISE)
    assert flat.stats.image_tokens_out <= 0.25 * flat.stats.image_tokens_in, flat.stats
    assert noise.stats.image_tokens_out >= 0.9 * noise.stats.image_tokens_in, noise.stats


def test_own_decode_path_equals_mtmd_path(eng, stock):
    """ratio:1 merges nothing but feeds the tokens through our own batch and positions:
    the logits must equal mtmd's stock decode — ``mtmd_helper_decode_image_chunk`` on a backend
    of its own — (positions are right for both RoPE kinds)."""
    r, own, view = turn_in(eng, "ratio:1", NOISE)
    assert r.stats.image_tokens_out == r.stats.image_tokens_in and r.stats.merge_map_size == r.stats.image_tokens_in
    close_to_stock(own, stock(view))


def test_merge_off_is_the_normal_path(eng, stock):
    """``off``: no merge map, every image token kept, and the logits mtmd's stock path gives."""
    r, own, view = turn_in(eng, "off", NOISE)
    assert r.stats.image_tokens_out == r.stats.image_tokens_in and r.stats.merge_map_size == 0
    close_to_stock(own, stock(view))


@pytest.mark.parametrize("spec", ["ratio:0.5", "ratio:0.25", "tokens:37"])
def test_counts_and_generation(eng, spec):
    view = eng.conversation(merge=MergeSpec.parse(spec))
    r = view.chat("Describe it.", [NOISE], max_tokens=4, temperature=0.0)
    logits = eng.backend.logits().copy()
    st = r.stats
    assert st.image_tokens_out == MergeSpec.parse(spec).target(st.image_tokens_in)
    assert st.image_tokens == st.image_tokens_out and st.merge_map_size == st.image_tokens_in
    assert st.predicted_n >= 1 and np.isfinite(logits).all()
    follow = view.chat("And?", max_tokens=2, temperature=0.0)  # KV kept with merged tokens
    assert follow.stats.cached_n >= st.image_tokens_out and follow.stats.images_encoded == 0


def test_merge_map_and_fidelity():
    rng = np.random.default_rng(1)
    e = rng.normal(size=(64, 16)).astype(np.float32)
    r = merge_tokens(e, 8, 8, MergeSpec.parse("ratio:0.5"))
    assert r.n_out == 32 and r.assignment.shape == (64,) and set(r.assignment) == set(range(32))
    assert 0 < r.fidelity < 1 and uniform_prune(e, 32).n_out == 32
    sizes = np.bincount(r.assignment)
    # weighted means: each output is the mean of its members
    k = int(np.argmax(sizes))
    assert np.allclose(r.embd[k], e[r.assignment == k].mean(axis=0), atol=1e-5)


@pytest.mark.parametrize("family", ["llava15", "qwen2vl"])
def test_cli_merge_ratio_halves_image_tokens(model_pair, images, family):
    pair = model_pair(family)
    r = run_cli(
        "chat",
        "-m",
        str(pair.model),
        "--mmproj",
        str(pair.mmproj),
        "-i",
        str(images["noise"]),
        "--merge",
        "ratio:0.5",
        "--json",
        "--temp",
        "0",
        "-n",
        "3",
        "Describe",
    )
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)["stats"]
    assert st["image_tokens_out"] == math.ceil(st["image_tokens_in"] / 2) and st["predicted_n"] >= 1
    bad = run_cli("chat", "-m", str(pair.model), "--mmproj", str(pair.mmproj), "--merge", "half", "x")
    assert bad.returncode == 2 and "--merge 'half'" in bad.stderr
