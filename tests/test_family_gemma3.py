"""Gemma 3 (``gemma3``) against real llama.cpp on the generated pairs: the token arithmetic equals
mtmd's chunks (one fixed 896² view → 256 tokens between <start_of_image> and <end_of_image>),
the vocabulary holds Gemma's special tokens at their real ids, the text model has the iSWA
layout (one sliding-window and one global layer, llama.cpp's KV caches), the encoder compute
replay equals clip's logged buffer (reserved at warmup and at the first encode), and the CLI's
budget equals what ``chat`` spends."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from edgevlm.backend import logs
from edgevlm.backend.llama import Backend
from edgevlm.model.gguf_info import load_projector, load_text_model
from edgevlm.model.projectors import (
    encoder_patches,
    facts,
    image_tokens,
    largest_image_tokens,
)
from edgevlm.plan.estimate import clip_compute_bytes, kv_bytes
from edgevlm_testkit import make_model_pair
from edgevlm_testkit.measure import Config, buffer_lines, measure

from .conftest import run_cli

FAMILY = "gemma3"
MIB = 2**20
SIZES = [
    (1, 1),
    (28, 28),
    (100, 50),
    (300, 200),
    (336, 336),
    (337, 336),
    (640, 480),
    (672, 672),
    (895, 896),
    (896, 896),
    (897, 896),
    (1000, 200),
    (200, 1000),
    (1024, 768),
    (1920, 1080),
    (2000, 1),
    (4000, 3000),
    (3840, 2160),
    (7680, 4320),
    (8192, 8192),
    (10000, 100),
    (10000, 1),
    (1, 10000),
    (50, 5000),
    (333, 999),
]
SIZES += [tuple(int(v) for v in np.random.default_rng(3).integers(1, 6000, 2)) for _ in range(15)]


def mtmd_count(be: Backend, w: int, h: int) -> tuple[int, int, int, int]:
    chunks = be.count_image(w, h)
    imgs = [c for c in chunks if c.kind == "image"]
    return (
        sum(c.n_tokens for c in imgs),
        sum(c.n_pos for c in imgs),
        len(imgs),
        sum(c.n_tokens for c in chunks if c.kind == "text"),
    )


def clip_logged(lines: list[str]) -> int:
    """clip's ``reserve_compute_meta: CPU compute buffer size`` in bytes (2-decimal MiB)."""
    sizes = [v for k, v in buffer_lines(lines).items() if k.startswith("reserve_compute_meta:")]
    assert sizes, "clip logged no compute buffer"
    return round(max(sizes) * MIB)


def assert_close(predicted: int, measured: int, rel: float = 0.05) -> None:
    """Within ``rel`` and never under (beyond the log's 0.005 MiB rounding)."""
    assert predicted >= measured - 0.006 * MIB, (predicted, measured)
    assert predicted <= measured * (1 + rel) + 0.006 * MIB, (predicted, measured)


@pytest.mark.parametrize("preset", ["tiny", "real"])
@pytest.mark.parametrize("fa", [True, False], ids=["fa", "nofa"])
def test_tokens_and_warmup_buffer_equal_llama_cpp(model_pair, preset, fa):
    """mtmd's counts over a size sweep, and the encoder buffer clip reserves at warmup (the warmup
    image of a fixed projector is its 896² view: the buffer every image needs)."""
    pair = model_pair(FAMILY, preset)
    proj = load_projector(pair.mmproj)
    with logs.capture() as lines:
        be = Backend(pair.model, pair.mmproj, n_ctx=512, n_threads=2, flash_attn=fa, warmup=True)
    with be:
        assert be.non_causal and not be.use_mrope
        for w, h in SIZES if fa else SIZES[:4]:
            it = image_tokens(proj, w, h)
            assert (it.n_tokens, it.n_pos, it.n_chunks, it.text_tokens) == mtmd_count(be, w, h), (w, h)
    n_patches = encoder_patches(proj, image_tokens(proj, 896, 896).n_tokens)
    assert n_patches == 64 * 64
    assert_close(clip_compute_bytes(proj, n_patches, fa), clip_logged(lines), rel=0.0)


def test_geometry_vocabulary_and_swa_layout(model_pair):
    pair = model_pair(FAMILY, "real")
    proj = load_projector(pair.mmproj)
    f = facts(proj)
    assert (f.kind, f.positions, f.grid, f.non_causal) == ("fixed", "1d", True, True)
    it = image_tokens(proj, 1920, 1080)
    assert (it.n_tokens, it.n_pos, it.text_tokens) == (256, 256, 2)
    assert (it.views[0].width, it.views[0].nx, it.views[0].ny) == (896, 16, 16)
    assert largest_image_tokens(proj, 10**6) == 256
    assert proj.n_mmproj_embd == 2560
    text = load_text_model(pair.model)
    assert (text.n_embd, text.n_head, text.n_head_kv, text.head_dim, text.n_ff, text.n_vocab, text.n_swa) == (
        2560,
        8,
        4,
        256,
        10240,
        262144,
        1024,
    )
    with logs.capture() as lines:
        be = Backend(pair.model, pair.mmproj, n_ctx=2048, n_threads=2)
    with be:
        assert be.n_vocab == 262144 and be.add_bos
        assert be.bos_id == 2 and be.eos_id == 1 and be.is_eog(106)
        ids = {
            t: be.tokenize_text(t)
            for t in ("<start_of_turn>", "<end_of_turn>", "<start_of_image>", "<end_of_image>", "<image_soft_token>")
        }
        assert ids == {
            "<start_of_turn>": [105],
            "<end_of_turn>": [106],
            "<start_of_image>": [255999],
            "<end_of_image>": [256000],
            "<image_soft_token>": [262143],
        }
        chunks = be.count_image(640, 480)
        assert [c.tokens for c in chunks if c.kind == "text"] == [[255999], [256000]]
    # iSWA: layer 0 sliding-window, layer 1 global; edgevlm keeps llama.cpp's default
    # swa_full = true, so both caches hold every cell and the planner's one-cache sum is exact
    log = "\n".join(lines)
    assert "using full-size SWA cache" in log
    cells = [int(c) for c in re.findall(r"creating (?:non-SWA|    SWA) KV cache, size = (\d+) cells", log)]
    assert cells == [2048, 2048]
    kv = sum(float(m) for m in re.findall(r"llama_kv_cache:\s+CPU KV buffer size =\s+([0-9.]+) MiB", log))
    assert abs(kv * MIB - kv_bytes(2, 4, 256, 2048, "f16", "f16")[-1]) < 0.01 * MIB


@pytest.mark.parametrize("fa", [True, False], ids=["fa", "nofa"])
def test_encode_buffer_and_weights_equal_llama_cpp(model_pair, fa):
    """An image really encoded (warmup off: clip reserves at the first encode) and decoded."""
    pair = model_pair(FAMILY, "tiny")
    comps = {c.name: c for c in measure(str(pair.model), str(pair.mmproj), Config(FAMILY, flash_attn=fa))}
    mm = comps["mmproj compute"]
    assert_close(mm.predicted, mm.measured, rel=0.0)
    for name in ("weights (mapped)", "weights (repack)", "mmproj weights"):
        assert comps[name].within(0.005), comps[name]


def test_writer_is_deterministic(tmp_path):
    a = make_model_pair(tmp_path / "a", FAMILY, "tiny", 7)
    b = make_model_pair(tmp_path / "b", FAMILY, "tiny", 7)
    assert a.model.read_bytes() == b.model.read_bytes()
    assert a.mmproj.read_bytes() == b.mmproj.read_bytes()


def test_budget_equals_chat(model_pair, images):
    pair = model_pair(FAMILY, "tiny")
    img = str(images["gradient"])
    r = run_cli("budget", img, "--mmproj", str(pair.mmproj), "--json")
    assert r.returncode == 0, r.stderr
    budget = json.loads(r.stdout)
    assert budget["projector_type"] == "gemma3" and budget["kind"] == "fixed"
    r = run_cli(
        "chat",
        "-m",
        str(pair.model),
        "--mmproj",
        str(pair.mmproj),
        "-i",
        img,
        "--json",
        "-n",
        "4",
        "--temp",
        "0",
        "Describe",
    )
    assert r.returncode == 0, r.stderr
    stats = json.loads(r.stdout)["stats"]
    assert budget["total_tokens"] == stats["image_tokens"] == 256
    assert stats["images_encoded"] == 1 and stats["predicted_n"] >= 1
