"""Pixtral / Mistral Small 3.1 (``pixtral``): the generated pair loads in llama.cpp, edgevlm's
token arithmetic equals mtmd's chunks, the encoder graph replay equals clip's logged compute
buffer, and the CLI's budget agrees with what chat really spends."""

from __future__ import annotations

import hashlib
import json
from types import SimpleNamespace

import numpy as np
import pytest

from edgevlm.backend import logs
from edgevlm.backend.llama import Backend
from edgevlm.model.families.pixtral import grid
from edgevlm.model.gguf_info import load_projector
from edgevlm.model.projectors import encoder_patches, facts, image_tokens
from edgevlm.plan.encoders.pixtral import compute_bytes, grid_bytes
from edgevlm_testkit import make_model_pair
from edgevlm_testkit.measure import MIB, buffer_lines
from edgevlm_testkit.pixtral import (
    PRESETS,
    PixtralVision,
    write_mistral_text,
    write_pixtral_vision,
)

from .conftest import make_image, run_cli

SIZES = [
    (1, 1),
    (28, 28),
    (100, 50),
    (300, 200),
    (336, 336),
    (337, 336),
    (640, 480),
    (672, 672),
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
    (50, 5000),
    (333, 999),
    (29540, 28),
    (28, 30000),
    (55, 57),
    (1540, 1540),
    (800, 801),
]


def mtmd_counts(be: Backend, w: int, h: int):
    chunks = be.count_image(w, h)
    imgs = [c for c in chunks if c.kind == "image"]
    texts = [c for c in chunks if c.kind == "text"]
    return (sum(c.n_tokens for c in imgs), sum(c.n_pos for c in imgs), len(imgs), sum(c.n_tokens for c in texts))


def mine(proj, w, h, lo=None, hi=None):
    t = image_tokens(proj, w, h, lo, hi)
    return (t.n_tokens, t.n_pos, t.n_chunks, t.text_tokens)


@pytest.fixture(scope="module")
def tiny(model_pair):
    return model_pair("pixtral", "tiny")


def test_facts_row():
    f = facts("pixtral")
    assert f.kind == "dynamic" and f.positions == "1d" and f.family == "pixtral"
    assert f.encoder_graph == "pixtral"


@pytest.mark.parametrize("limits", [(None, None), (None, 256), (64, 2048), (100, 300)])
def test_tokens_equal_mtmd_tiny(tiny, limits):
    lo, hi = limits
    proj = load_projector(tiny.mmproj)
    with Backend(tiny.model, tiny.mmproj, n_ctx=512, n_threads=2, image_min_tokens=lo, image_max_tokens=hi) as be:
        for w, h in SIZES:
            assert mine(proj, w, h, lo, hi) == mtmd_counts(be, w, h), (w, h, limits)
        # the [IMG_END] text mtmd adds is one special token, as in Tekken
        texts = [c for c in be.count_image(640, 480) if c.kind == "text"]
        assert [c.tokens for c in texts] == [[13]]
        assert be.tokenize_text("[INST]hi[/INST]")[0] == 3


def test_tokens_equal_mtmd_real(model_pair):
    pair = model_pair("pixtral", "real")
    proj = load_projector(pair.mmproj)
    with Backend(pair.model, pair.mmproj, n_ctx=256, n_threads=2) as be:
        for w, h in SIZES:
            assert mine(proj, w, h) == mtmd_counts(be, w, h), (w, h)


def clip_compute_mib(pair, w: int, h: int, fa: bool) -> tuple[float, int]:
    """clip's logged compute buffer for encoding one w×h image (buffer reserved at the first
    encode: warmup off), and the chunk's n_tokens."""
    with logs.capture() as lines:
        be = Backend(pair.model, pair.mmproj, n_ctx=256, n_threads=2, flash_attn=fa, warmup=False)
        try:
            rgb = (np.random.default_rng(0).random((h, w, 3)) * 255).astype(np.uint8)
            bm = be.bitmap_from_rgb(rgb)
            try:
                with be.tokenize(be.marker, [bm], add_special=False) as chunks:
                    img = next(c for c in chunks if c.kind == "image")
                    be.encode_image(img)
                    n = img.n_tokens
            finally:
                be.free_bitmap(bm)
        finally:
            be.close()
    got = [v for k, v in buffer_lines(lines).items() if k.startswith("reserve_compute_meta:")]
    return max(got), n


@pytest.mark.parametrize("size", [(640, 400), (28, 1500), (100, 50), (1000, 200)])
@pytest.mark.parametrize("fa", [True, False])
def test_encoder_compute_equals_clip(tiny, size, fa):
    proj = load_projector(tiny.mmproj)
    measured, n_tokens = clip_compute_mib(tiny, *size, fa)
    _, _, px, py = grid(proj, *size)
    exact = grid_bytes(proj, px, py, fa)
    assert abs(exact / MIB - measured) <= 0.006, (size, fa, exact / MIB, measured)
    assert compute_bytes(proj, 1, fa, grid=(px, py)) == exact
    # without the grid (what the planner passes today): a bound, never under
    bound = compute_bytes(proj, encoder_patches(proj, n_tokens), fa)
    assert bound / MIB >= measured - 0.006


def test_encoder_compute_equals_clip_real(model_pair):
    pair = model_pair("pixtral", "real")
    proj = load_projector(pair.mmproj)
    measured, _ = clip_compute_mib(pair, 640, 400, True)
    assert abs(grid_bytes(proj, 23, 14, True) / MIB - measured) <= 0.006


def test_pixtral12b_variant(tmp_path):
    """Pixtral-12B's layout (16-px patches, no merger, projector biases): same arithmetic with
    merge 1, same graph without the merger; both equal llama.cpp."""
    text, _ = PRESETS["tiny"]
    model = write_mistral_text(tmp_path / "model.gguf", text, 0, "Pixtral-12B-shaped")
    mmproj = write_pixtral_vision(
        tmp_path / "mmproj.gguf", PixtralVision(1024, 16, 64, 2, 4, 128, merge=1), text.n_embd, 1, "Pixtral-12B ViT"
    )
    pair = SimpleNamespace(model=model, mmproj=mmproj)
    proj = load_projector(mmproj)
    assert proj.spatial_merge_size is None and facts(proj).merge == 1
    with Backend(model, mmproj, n_ctx=256, n_threads=2) as be:
        for w, h in SIZES[::3]:
            assert mine(proj, w, h) == mtmd_counts(be, w, h), (w, h)
    for fa in (True, False):
        measured, _ = clip_compute_mib(pair, 640, 400, fa)
        _, _, px, py = grid(proj, 640, 400)
        assert (px, py) == (40, 25)
        assert abs(grid_bytes(proj, px, py, fa) / MIB - measured) <= 0.006


@pytest.mark.slow
def test_budget_equals_chat_spend(tiny, tmp_path):
    for w, h in [(640, 400), (1600, 1200)]:
        path = make_image(tmp_path / f"img{w}.png", w, h, seed=w)
        b = run_cli("budget", str(path), "--mmproj", str(tiny.mmproj), "--json")
        assert b.returncode == 0, b.stderr
        total = json.loads(b.stdout)["total_tokens"]
        c = run_cli(
            "chat",
            "-m",
            str(tiny.model),
            "--mmproj",
            str(tiny.mmproj),
            "-i",
            str(path),
            "--json",
            "-n",
            "4",
            "Describe",
        )
        assert c.returncode == 0, c.stderr
        st = json.loads(c.stdout)["stats"]
        assert st["image_tokens"] == total == image_tokens(load_projector(tiny.mmproj), w, h).n_tokens


def test_writer_is_deterministic(tmp_path, tiny):
    a = make_model_pair(tmp_path / "a", "pixtral", "tiny", 0)

    def digest(p):
        return hashlib.sha256(p.read_bytes()).hexdigest()

    assert digest(a.model) == digest(tiny.model) and digest(a.mmproj) == digest(tiny.mmproj)
