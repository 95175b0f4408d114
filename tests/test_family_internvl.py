"""InternVL (``internvl``): the generated pair loads in llama.cpp/mtmd, edgevlm's tile arithmetic
equals mtmd's chunks, the InternViT graph replay equals clip's logged compute buffer, and the
budget the CLI reports is what a real chat run puts in the context."""

from __future__ import annotations

import json
import random

import pytest

from edgevlm.backend.counting import ImageCounter
from edgevlm.model.families.internvl import candidates, tile_grid
from edgevlm.model.gguf_info import load_projector, load_text_model, read_gguf
from edgevlm.model.projectors import facts, image_tokens
from edgevlm_testkit.measure import MIB, Config, measure

from .conftest import run_cli

FAMILY = "internvl"
SIZES = [
    (1, 1),
    (28, 28),
    (100, 50),
    (300, 200),
    (336, 336),
    (337, 336),
    (448, 448),
    (449, 448),
    (448, 449),
    (449, 1),
    (1, 449),
    (640, 480),
    (672, 672),
    (896, 448),
    (897, 449),
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
    (50, 5000),
    (333, 999),
]
_rng = random.Random(1234)
SWEEP = (
    SIZES
    + [(_rng.randint(1, 6000), _rng.randint(1, 6000)) for _ in range(120)]
    + [(_rng.randint(300, 1400), _rng.randint(300, 1400)) for _ in range(60)]
)


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
    assert text.arch == "qwen2" and text.file_type == "Q4_0"
    assert proj.projector_type == "internvl" and proj.file_type == "F16"
    assert proj.n_mmproj_embd == text.n_embd and (proj.image_size, proj.patch_size) == (448, 14)
    assert proj.meta["clip.vision.projector.scale_factor"] == 2
    gf = read_gguf(pair.model)
    assert gf.tensor("output.weight") is not None  # InternVL's lm_head is not tied
    row = facts(proj)
    assert (row.kind, row.positions, row.family, row.encoder_graph) == ("tiled", "1d", "internvl", "internvl")
    # 1..12 tiles: every a×b grid with a·b <= 12
    assert len(candidates(proj)) == sum(12 // a for a in range(1, 13))


@pytest.mark.parametrize("preset", ["tiny", "real"])
def test_image_tokens_equal_mtmd(model_pair, preset):
    pair = model_pair(FAMILY, preset)
    proj = load_projector(pair.mmproj)
    sizes = SWEEP if preset == "tiny" else SIZES
    with ImageCounter(pair.model, pair.mmproj) as counter:
        for w, h in sizes:
            mine = image_tokens(proj, w, h)
            got = mtmd_counts(counter, w, h)
            assert (mine.n_tokens, mine.n_pos, mine.n_chunks, mine.text_tokens) == got, (w, h)
    # known grids: a one-tile image is the thumbnail alone, 256 tokens a chunk
    assert image_tokens(proj, 448, 448).n_tokens == 256 and tile_grid(proj, 448, 448) == (0, 0)
    assert tile_grid(proj, 1000, 500) == (3, 2) and image_tokens(proj, 1000, 500).n_chunks == 7


def _mmproj_compute(pair, flash_attn: bool):
    comps = {
        c.name: c for c in measure(str(pair.model), str(pair.mmproj), Config(FAMILY, n_ctx=512, flash_attn=flash_attn))
    }
    return comps


@pytest.mark.parametrize("preset,flash_attn", [("tiny", True), ("tiny", False), ("real", True)])
def test_encoder_compute_equals_clip(model_pair, preset, flash_attn):
    comps = _mmproj_compute(model_pair(FAMILY, preset), flash_attn)
    c = comps["mmproj compute"]
    # exact replay: equal up to the log's 2-decimal MiB rounding, hence never under
    assert abs(c.predicted - c.measured) <= 0.005 * MIB + 1, (c.measured, c.predicted)
    assert c.within(0.05)
    for name in ("kv", "compute", "mmproj weights"):
        assert comps[name].within(0.005), comps[name]


def test_budget_cli_equals_chat_image_tokens(model_pair, images):
    pair = model_pair(FAMILY)
    img = images["gradient"]  # 640×400: a 2×1 grid + thumbnail = 3 × 256
    b = run_cli("budget", str(img), "--mmproj", str(pair.mmproj), "--json")
    assert b.returncode == 0, b.stderr
    total = json.loads(b.stdout)["total_tokens"]
    assert total == 3 * 256
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
    assert st["image_tokens"] == total and st["images_encoded"] == 3
