"""Visual token merging on real llama.cpp, for 1-D RoPE (LLaVA) and M-RoPE (Qwen2-VL) decoders."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

import edgevlm
from edgevlm.errors import InputError
from edgevlm.vision.images import from_rgb
from edgevlm.vision.merge import MergeSpec, merge_tokens, uniform_prune

from .conftest import run_cli

FLAT = from_rgb(np.full((448, 448, 3), 120, np.uint8), "flat.png")  # square: no letterbox bars
NOISE = from_rgb((np.random.default_rng(0).random((480, 640, 3)) * 255).astype(np.uint8), "noise.png")


@pytest.fixture(scope="module", params=["llava15", "qwen2vl"])
def eng(request, model_pair):
    pair = model_pair(request.param)
    e = edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, n_threads=2)
    yield e
    e.close()


def turn(e, spec, img, n=1):
    """One turn of a fresh conversation with merging ``spec``, over the same loaded model."""
    e.reset()
    r = e.with_options(merge=MergeSpec.parse(spec)).chat("Describe it.", [img], max_tokens=n, temperature=0.0)
    return r, e.backend.logits().copy()


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


def test_own_decode_path_equals_mtmd_path(eng):
    """ratio:1 merges nothing but feeds the tokens through our own batch and positions:
    the logits must equal mtmd's stock decode (positions are right for both RoPE kinds)."""
    _, stock = turn(eng, "off", NOISE)
    _, own = turn(eng, "ratio:1", NOISE)
    assert np.abs(stock - own).max() <= 1e-3 * np.abs(stock).max()


def test_merge_off_is_the_normal_path(eng):
    a, la = turn(eng, "off", NOISE, n=6)
    b, lb = turn(eng, "off", NOISE, n=6)
    assert a.text == b.text and a.stats.image_tokens_out == a.stats.image_tokens_in


@pytest.mark.parametrize("spec", ["ratio:0.5", "ratio:0.25", "tokens:37"])
def test_counts_and_generation(eng, spec):
    eng.reset()
    view = eng.with_options(merge=MergeSpec.parse(spec))
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
