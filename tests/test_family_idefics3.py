"""SmolVLM / Idefics3 (``idefics3``) against real llama.cpp on the generated pairs: the token
arithmetic equals mtmd's chunks (default longest-edge tiling and the custom-token-limit path),
the vocabulary holds SmolVLM's image tokens where the real model has them, the encoder compute
replay equals clip's logged buffer, and the CLI's budget equals what ``chat`` spends."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from edgevlm.backend.llama import Backend
from edgevlm.model.gguf_info import load_projector
from edgevlm.model.projectors import (
    encoder_patches,
    facts,
    image_tokens,
    largest_image_tokens,
)
from edgevlm.plan.estimate import clip_compute_bytes
from edgevlm_testkit.measure import Config, measure

from .conftest import run_cli

FAMILY = "idefics3"
SIZES = [
    (1, 1),
    (28, 28),
    (100, 50),
    (300, 200),
    (336, 336),
    (337, 336),
    (512, 512),
    (513, 512),
    (640, 480),
    (672, 672),
    (1000, 200),
    (200, 1000),
    (1024, 768),
    (1920, 1080),
    (2000, 1),
    (2048, 2049),
    (2049, 2048),
    (4000, 3000),
    (3840, 2160),
    (7680, 4320),
    (8192, 8192),
    (10000, 100),
    (10000, 1),
    (1, 10000),
    (50, 5000),
    (333, 999),
    (1025, 4096),
]
SIZES += [tuple(int(v) for v in np.random.default_rng(3).integers(1, 6000, 2)) for _ in range(40)]


def mtmd_count(be: Backend, w: int, h: int) -> tuple[int, int, int, int]:
    chunks = be.count_image(w, h)
    imgs = [c for c in chunks if c.kind == "image"]
    return (
        sum(c.n_tokens for c in imgs),
        sum(c.n_pos for c in imgs),
        len(imgs),
        sum(c.n_tokens for c in chunks if c.kind == "text"),
    )


def mine(proj, w, h, lo=None, hi=None) -> tuple[int, int, int, int]:
    it = image_tokens(proj, w, h, lo, hi)
    return it.n_tokens, it.n_pos, it.n_chunks, it.text_tokens


# (min, max) image tokens in mtmd_context_params: the defaults keep mtmd's longest-edge tiling;
# any custom limit switches it to calc_size_preserved_ratio (the planner passes a max); a large
# min gives grids beyond SmolVLM's <row_6_col_6> token, so the row/col text is split by BPE
LIMITS = {"tiny": [(None, None), (None, 1088), (None, 64), (4096, 8192)], "real": [(None, None), (None, 1088)]}


@pytest.mark.parametrize("preset", ["tiny", "real"])
def test_tokens_equal_mtmd(model_pair, preset):
    pair = model_pair(FAMILY, preset)
    proj = load_projector(pair.mmproj)
    sizes = SIZES if preset == "tiny" else SIZES[:27]
    for lo, hi in LIMITS[preset]:
        with Backend(pair.model, pair.mmproj, n_ctx=512, n_threads=2, image_min_tokens=lo, image_max_tokens=hi) as be:
            for w, h in sizes:
                assert mine(proj, w, h, lo, hi) == mtmd_count(be, w, h), (preset, lo, hi, w, h)


def test_tokens_equal_mtmd_without_preproc_size(model_pair, tmp_path):
    """Older SmolVLM GGUFs have no clip.vision.preproc_image_size: mtmd rounds each side to tiles."""
    from edgevlm_testkit.idefics3 import IDEFICS3_PRESETS, write_siglip_idefics3

    pair = model_pair(FAMILY)
    text, vision = IDEFICS3_PRESETS["tiny"]
    mmproj = write_siglip_idefics3(tmp_path / "old.gguf", vision, text.n_embd, 1, "old", longest_edge=0)
    proj = load_projector(mmproj)
    assert "clip.vision.preproc_image_size" not in proj.meta
    with Backend(pair.model, mmproj, n_ctx=512, n_threads=2) as be:
        for w, h in SIZES[:27]:
            assert mine(proj, w, h) == mtmd_count(be, w, h), (w, h)


def test_geometry_and_vocabulary_are_smolvlm(model_pair):
    pair = model_pair(FAMILY, "real")
    proj = load_projector(pair.mmproj)
    f = facts(proj)
    assert (f.kind, f.positions, f.non_causal) == ("tiled", "1d", False)
    # 512-px tiles, pixel shuffle 4 → 64 tokens; longest edge 2048 → at most 4×4 tiles + global
    it = image_tokens(proj, 1920, 1080)
    assert [v.n_tokens for v in it.views] == [64] * 13  # 4×3 tiles + global view
    assert it.text_tokens == 2 * 12 + 2 + 4
    assert largest_image_tokens(proj, 10**6) == 17 * 64
    assert encoder_patches(proj, 64) == 1024
    with Backend(pair.model, pair.mmproj, n_ctx=512, n_threads=2) as be:
        assert be.n_vocab == 49280 and not be.add_bos
        ids = {
            t: be.tokenize_text(t)
            for t in (
                "<global-img>",
                "<row_1_col_1>",
                "<row_6_col_6>",
                "<fake_token_around_image>",
                "<image>",
                "<end_of_utterance>",
                "<|im_start|>",
            )
        }
        assert ids == {
            "<global-img>": [49152],
            "<row_1_col_1>": [49153],
            "<row_6_col_6>": [49188],
            "<fake_token_around_image>": [49189],
            "<image>": [49190],
            "<end_of_utterance>": [49279],
            "<|im_start|>": [1],
        }
        assert be.eos_id == 49279 and be.bos_id == 1
        # what mtmd inserts for 1000×2000 (→ 1024×2048: 2 columns × 4 rows): <fake><row_R_col_C>
        # before each tile, "\n" after each row but the last, "\n\n"<fake><global-img> ... <fake>
        text = [c.tokens for c in be.count_image(1000, 2000) if c.kind == "text"]
        nl, nlnl = be.tokenize_text("\n"), be.tokenize_text("\n\n")
        assert len(nl) == 1 and len(nlnl) == 1
        want = [
            (nl if r > 1 and c == 1 else []) + [49189, 49153 + 6 * (r - 1) + (c - 1)]
            for r in range(1, 5)
            for c in range(1, 3)
        ]
        assert text == want + [nlnl + [49189, 49152], [49189]]


@pytest.mark.parametrize("preset,fa", [("tiny", True), ("tiny", False), ("real", True), ("real", False)])
def test_encoder_compute_equals_clip_buffer(model_pair, preset, fa):
    pair = model_pair(FAMILY, preset)
    comps = {c.name: c for c in measure(str(pair.model), str(pair.mmproj), Config(FAMILY, n_ctx=1024, flash_attn=fa))}
    enc = comps["mmproj compute"]
    assert enc.predicted >= enc.measured - 0.006 * 2**20, enc  # never under
    assert enc.within(0.05), enc
    assert enc.within(0.0, abs_mib=0.006), enc  # exact to the log's rounding
    for name in ("weights (mapped)", "weights (repack)", "kv", "mmproj weights"):
        assert comps[name].within(0.005), (name, comps[name])
    assert comps["compute"].within(0.05), comps["compute"]


def test_encoder_compute_is_one_tile_whatever_the_image(model_pair):
    proj = load_projector(model_pair(FAMILY, "real").mmproj)
    per_tile = {
        clip_compute_bytes(proj, encoder_patches(proj, v.n_tokens), True)
        for w, h in ((1, 1), (1920, 1080), (8192, 8192))
        for v in image_tokens(proj, w, h).views
    }
    assert per_tile == {21 * 2**20}  # measured: 21.00 MiB with flash attention (60.00 without)


@pytest.mark.parametrize(
    "size,tokens",
    [
        ((640, 120), 5 * 64),  # → 2048×384: 4×1 tiles + global view
        # the plan used to hand its image budget to mtmd, which then tiled idefics3 another way (2×4)
        # than the budget counted (1×4): mtmd gets that limit for dynamic projectors only now
        ((261, 1043), 5 * 64),
    ],
    ids=["wide", "tall-edge"],
)
def test_cli_budget_equals_chat_image_tokens(model_pair, tmp_path, size, tokens):
    pair = model_pair(FAMILY)
    w, h = size
    path = tmp_path / "pic.png"
    Image.fromarray((np.random.default_rng(4).random((h, w, 3)) * 255).astype(np.uint8)).save(path)
    r = run_cli("budget", str(path), "--mmproj", str(pair.mmproj), "--json")
    assert r.returncode == 0, r.stderr
    budget = json.loads(r.stdout)
    assert budget["total_tokens"] == tokens
    r = run_cli(
        "chat",
        "-m",
        str(pair.model),
        "--mmproj",
        str(pair.mmproj),
        "-i",
        str(path),
        "--json",
        "-n",
        "4",
        "--temp",
        "0",
        "Describe",
    )
    assert r.returncode == 0, r.stderr
    st = json.loads(r.stdout)["stats"]
    assert st["predicted_n"] == 4
    assert st["image_tokens"] == budget["total_tokens"]


def test_the_image_changes_what_the_model_predicts(model_pair):
    pair = model_pair(FAMILY)
    prompt = "<|im_start|>User:{m}What is in the picture?<end_of_utterance>\nAssistant:"
    firsts = []
    with Backend(pair.model, pair.mmproj, n_ctx=1024, n_threads=2) as be:
        for seed in (1, 2):
            rgb = (np.random.default_rng(seed).random((100, 300, 3)) * 255).astype(np.uint8)
            bm = be.bitmap_from_rgb(rgb)
            try:
                with be.tokenize(prompt.format(m=be.marker), [bm]) as chunks:
                    n_past = 0
                    for c in chunks:
                        if c.kind == "text":
                            n_past = be.decode_tokens(c.tokens, n_past)
                        else:
                            n_past = be.decode_image(c, be.encode_image(c), n_past)
            finally:
                be.free_bitmap(bm)
            logits = be.logits().copy()
            assert np.isfinite(logits).all()
            firsts.append(logits)
            be.kv_clear()
    assert np.abs(firsts[0] - firsts[1]).max() > 1e-2
