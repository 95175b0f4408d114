"""Qwen3-VL (``qwen3vl_merger``): the generated pair loads in llama.cpp/mtmd, edgevlm's token
arithmetic equals mtmd's chunks, the ViT graph replay (deepstack mergers included) equals clip's
logged compute buffer, the ``qwen3vl`` text graph replay equals llama.cpp's, and the budget the
CLI reports is what a real chat run puts in the context."""

from __future__ import annotations

import json
import random
import re

import llama_cpp
import pytest

from edgevlm.backend import logs
from edgevlm.backend.counting import ImageCounter
from edgevlm.backend.llama import Backend
from edgevlm.model.gguf_info import load_projector, load_text_model, read_gguf
from edgevlm.model.projectors import facts, image_tokens
from edgevlm.plan.compute import text_compute_bytes
from edgevlm.plan.encoders.qwen3vl_merger import deepstack_layers
from edgevlm.plan.estimate import clip_compute_bytes
from edgevlm_testkit.measure import MIB, Config, measure

from .conftest import run_cli

FAMILY = "qwen3vl"
SIZES = [
    (1, 1),
    (28, 28),
    (31, 33),
    (32, 32),
    (33, 31),
    (48, 48),
    (100, 50),
    (300, 200),
    (336, 336),
    (337, 336),
    (640, 480),
    (672, 672),
    (768, 768),
    (1000, 200),
    (200, 1000),
    (1024, 768),
    (1920, 1080),
    (2000, 1),
    (2048, 2048),
    (2049, 2047),
    (4000, 3000),
    (3840, 2160),
    (7680, 4320),
    (8192, 8192),
    (10000, 100),
    (10000, 1),
    (50, 5000),
    (333, 999),
    (16, 5000),
]
_rng = random.Random(3)
SWEEP = (
    SIZES
    + [(_rng.randint(1, 6000), _rng.randint(1, 6000)) for _ in range(150)]
    + [(_rng.randint(1, 400), _rng.randint(1, 400)) for _ in range(60)]
)
# (image_min_tokens, image_max_tokens) given to mtmd; None = its default (8, 4096). (mtmd refuses
# to load with min > max: "image_max_pixels ... is less than image_min_pixels".)
LIMITS = [(None, None), (None, 256), (64, None), (1024, 1024), (4, 16)]
_CLIP_LINE = re.compile(r"reserve_compute_meta:\s+CPU compute buffer size =\s+([0-9.]+) MiB")
EXACT = 0.005 * MIB + 1  # llama.cpp logs MiB with 2 decimals


def mtmd_counts(counter: ImageCounter, w: int, h: int) -> tuple[int, int, int, int]:
    chunks = counter.count_image(w, h)
    imgs = [c for c in chunks if c.kind == "image"]
    return (
        sum(c.n_tokens for c in imgs),
        sum(c.n_pos for c in imgs),
        len(imgs),
        sum(c.n_tokens for c in chunks if c.kind == "text"),
    )


def test_pair_format(model_pair):
    pair = model_pair(FAMILY)
    text, proj = load_text_model(pair.model), load_projector(pair.mmproj)
    gf, pf = read_gguf(pair.model), read_gguf(pair.mmproj)
    assert text.arch == "qwen3vl" and text.file_type == "Q4_0"
    assert proj.projector_type == "qwen3vl_merger" and proj.file_type == "F16"
    assert (proj.image_size, proj.patch_size, proj.spatial_merge_size) == (768, 16, 2)
    assert gf.tensor("output.weight") is None  # tied, like Qwen3-VL-2B
    n_ds = gf.metadata["qwen3vl.n_deepstack_layers"]
    ds = deepstack_layers(proj)
    assert n_ds == len(ds) == 1 and n_ds < text.n_layer
    assert {t.name.split(".")[2] for t in pf.tensors if t.name.startswith("v.deepstack.")} == {str(i) for i in ds}
    assert proj.n_mmproj_embd == text.n_embd  # mm.2 rows; each token carries (1 + n_ds) of them
    row = facts(proj)
    assert (row.kind, row.positions, row.grid, row.family, row.encoder_graph, row.merge, row.non_causal) == (
        "dynamic",
        "mrope",
        True,
        "qwen3vl",
        "qwen3vl_merger",
        2,
        False,
    )
    with Backend(pair.model, pair.mmproj, n_ctx=256, n_threads=2) as be:
        # what mtmd checked at load: the text model takes n_embd × (1 + n_deepstack) per token
        assert llama_cpp.llama_model_n_embd_inp(be.llama.model) == text.n_embd * (1 + n_ds)
        assert be.use_mrope and not be.non_causal


@pytest.mark.parametrize("preset", ["tiny", "real"])
def test_image_tokens_equal_mtmd(model_pair, preset):
    pair = model_pair(FAMILY, preset)
    proj = load_projector(pair.mmproj)
    limits = LIMITS if preset == "tiny" else LIMITS[:2]
    for lo, hi in limits:
        sizes = SWEEP if (preset, lo, hi) == ("tiny", None, None) else SIZES
        with ImageCounter(pair.model, pair.mmproj, image_min_tokens=lo, image_max_tokens=hi) as counter:
            for w, h in sizes:
                mine = image_tokens(proj, w, h, lo, hi)
                got = mtmd_counts(counter, w, h)
                assert (mine.n_tokens, mine.n_pos, mine.n_chunks, mine.text_tokens) == got, (w, h, lo, hi)
                if (w, h) == (640, 480):
                    imgs = [c for c in counter.count_image(w, h) if c.kind == "image"]
                    assert (mine.views[0].nx, mine.views[0].ny) == (imgs[0].nx, imgs[0].ny)
    # one token per 32×32 px, positions advance by max(nx, ny), clamped to 8..4096 tokens
    assert (image_tokens(proj, 640, 480).n_tokens, image_tokens(proj, 640, 480).n_pos) == (300, 20)
    assert image_tokens(proj, 1, 1).n_tokens == 9
    assert image_tokens(proj, 8192, 8192).n_tokens == 4096


_MEASURED: dict = {}


def _measure(pair, preset: str, flash_attn: bool):
    key = (preset, flash_attn)
    if key not in _MEASURED:
        comps = measure(
            str(pair.model), str(pair.mmproj), Config(FAMILY, n_ctx=1024, flash_attn=flash_attn, image_max_tokens=256)
        )
        _MEASURED[key] = {c.name: c for c in comps}
    return _MEASURED[key]


@pytest.mark.parametrize("preset,flash_attn", [("tiny", True), ("tiny", False), ("real", True)])
def test_encoder_compute_equals_clip(model_pair, preset, flash_attn):
    pair = model_pair(FAMILY, preset)
    comps = _measure(pair, preset, flash_attn)
    c = comps["mmproj compute"]  # a 512×512 image: 256 tokens, 1024 patches
    # exact replay: equal up to the log's 2-decimal MiB rounding, hence never under
    assert abs(c.predicted - c.measured) <= EXACT, (c.measured, c.predicted)
    for name in ("weights (mapped)", "weights (repack)", "kv", "mmproj weights"):
        assert comps[name].within(0.005), comps[name]


@pytest.mark.parametrize("preset,flash_attn", [("tiny", True), ("tiny", False), ("real", True)])
def test_encoder_compute_at_warmup_size(model_pair, preset, flash_attn):
    """mtmd's warmup reserves for a 1472×1472 image (46×46 tokens, 92×92 patches): a large,
    interpolated position table, without encoding anything."""
    pair = model_pair(FAMILY, preset)
    proj = load_projector(pair.mmproj)
    with logs.capture() as lines:
        Backend(pair.model, pair.mmproj, n_ctx=256, n_threads=2, flash_attn=flash_attn, warmup=True).close()
    assert any("warmup with image size = 1472 x 1472" in ln for ln in lines)
    measured = max(float(m.group(1)) for ln in lines if (m := _CLIP_LINE.search(ln))) * MIB
    predicted = clip_compute_bytes(proj, 46 * 46 * 4, flash_attn)
    assert abs(predicted - measured) <= EXACT, (measured / MIB, predicted / MIB)


@pytest.mark.parametrize("preset,flash_attn", [("tiny", True), ("tiny", False), ("real", True)])
def test_text_graph_replay_equals_llama_cpp(model_pair, preset, flash_attn):
    """The ``qwen3vl`` decoder reserve graph (deepstack input, Q/K norms) replayed exactly."""
    pair = model_pair(FAMILY, preset)
    t = load_text_model(pair.model)
    n_ds = int(read_gguf(pair.model).metadata["qwen3vl.n_deepstack_layers"])
    c = _measure(pair, preset, flash_attn)["compute"]
    mine = text_compute_bytes(
        "qwen3vl",
        t.n_embd,
        t.n_head,
        t.n_head_kv,
        t.head_dim,
        t.n_ff,
        t.n_vocab,
        1024,
        512,
        512,
        flash_attn,
        "f16",
        "f16",
        t.n_layer,
        n_deepstack=n_ds,
    )
    assert abs(mine - c.measured) <= EXACT, (c.measured / MIB, mine / MIB)


def test_planner_text_compute_not_under(model_pair):
    c = _measure(model_pair(FAMILY, "tiny"), "tiny", True)["compute"]
    assert c.predicted >= c.measured - EXACT and c.within(0.05), (c.measured / MIB, c.predicted / MIB)


def test_encode_image_returns_the_full_embedding_width(model_pair):
    pair = model_pair(FAMILY)
    with Backend(pair.model, pair.mmproj, n_ctx=512, n_threads=2) as be:
        import numpy as np

        bm = be.bitmap_from_rgb(np.zeros((64, 96, 3), np.uint8))
        try:
            with be.tokenize(be.marker, [bm], add_special=False) as chunks:
                img = next(c for c in chunks if c.kind == "image")
                emb = be.encode_image(img)
        finally:
            be.free_bitmap(bm)
        assert emb.shape == (img.n_tokens, llama_cpp.llama_model_n_embd_inp(be.llama.model))


def test_budget_cli_equals_chat_image_tokens(model_pair, images):
    pair = model_pair(FAMILY)
    img = images["gradient"]  # 640×400 → 20 × 13 tokens (12.5 rounds away from zero)
    b = run_cli("budget", str(img), "--mmproj", str(pair.mmproj), "--json")
    assert b.returncode == 0, b.stderr
    total = json.loads(b.stdout)["total_tokens"]
    assert total == image_tokens(load_projector(pair.mmproj), 640, 400).n_tokens == 260
    r = run_cli(
        "chat",
        "-m",
        str(pair.model),
        "--mmproj",
        str(pair.mmproj),
        "-i",
        str(img),
        "--json",
        "-n",
        "4",
        "--temp",
        "0",
        "Describe",
    )
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)["stats"]
    assert st["image_tokens"] == total and st["images_encoded"] == 1
