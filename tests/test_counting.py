"""Projector types without edgevlm arithmetic are counted by mtmd itself: a loaded projector's
``counter`` tokenizes a placeholder bitmap (nothing encoded). Tested by taking the arithmetic away
from generated families (the facts table's family) and checking that budgets, the guard and chat
see exactly what the arithmetic says — and that ``edgevlm budget --model`` (mtmd's count) equals
``edgevlm budget`` (the arithmetic)."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

import edgevlm
from edgevlm.backend.counting import ImageCounter
from edgevlm.errors import UnsupportedModel
from edgevlm.model import projectors
from edgevlm.model.gguf_info import load_projector
from edgevlm.vision.budget import plan_image

from .conftest import ALL_FAMILIES, run_cli
from .test_inspect import SIZES


def without_arithmetic(monkeypatch, ptype: str) -> None:
    row = projectors.PROJECTORS[ptype]
    monkeypatch.setitem(projectors.PROJECTORS, ptype, replace(row, family=None))


@pytest.mark.parametrize("family", ["llava16", "qwen2vl"])
def test_a_loaded_projector_is_counted_by_mtmd(model_pair, images, monkeypatch, family):
    pair = model_pair(family)
    proj = load_projector(pair.mmproj)
    vlm = edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, image_tokens=1000)
    cap = vlm.backend.image_max_tokens  # mtmd counts with its context's token limits
    want = {s: projectors.image_tokens(proj, *s, max_tokens=cap) for s in SIZES}
    plans = {k: plan_image(edgevlm.load_image(p), proj, 1000, max_tokens=cap) for k, p in images.items()}
    without_arithmetic(monkeypatch, proj.projector_type)
    assert not projectors.facts(proj).arithmetic
    with pytest.raises(UnsupportedModel, match="once the projector is loaded"):
        projectors.image_tokens(proj, 640, 480)
    try:
        loaded = vlm.backend.proj_info
        for s, it in want.items():
            got = projectors.image_tokens(loaded, *s)
            assert (got.n_tokens, got.n_pos, got.n_chunks, got.text_tokens) == (
                it.n_tokens,
                it.n_pos,
                it.n_chunks,
                it.text_tokens,
            ), s
        for k, p in images.items():
            assert plan_image(edgevlm.load_image(p), loaded, 1000, max_tokens=cap) == plans[k], k
        r = vlm.chat("Describe.", [images["gradient"]], max_tokens=2, temperature=0)
        assert r.stats.image_tokens == vlm.image_budget.plan(edgevlm.load_image(images["gradient"])).total_tokens
    finally:
        vlm.close()


def test_the_counter_needs_no_weights(model_pair):
    pair = model_pair("qwen2vl")
    with ImageCounter(pair.model, pair.mmproj) as c:
        a = c.proj_info.counter(1920, 1080)
        assert a.n_tokens == projectors.image_tokens(load_projector(pair.mmproj), 1920, 1080).n_tokens


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_budget_with_the_model_counts_as_the_arithmetic(model_pair, images, family):
    pair = model_pair(family)
    for tokens in ([], ["--image-tokens", "700"]):
        a = run_cli("budget", str(images["gradient"]), "--mmproj", str(pair.mmproj), "--json", *tokens)
        b = run_cli(
            "budget",
            str(images["gradient"]),
            "--mmproj",
            str(pair.mmproj),
            "--model",
            str(pair.model),
            "--json",
            *tokens,
        )
        assert a.returncode == 0 and b.returncode == 0, (a.stderr, b.stderr)
        pa, pb = json.loads(a.stdout), json.loads(b.stdout)
        # the notes say where the default budget came from (the projector, or the plan): the rest is equal
        source = lambda p: {**p, "notes": [n for n in p["notes"] if "--image-tokens changes it" not in n]}
        assert source(pa) == source(pb)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_the_bound_before_loading_is_never_under(model_pair, family):
    """What plan and inspect assume for a projector type without arithmetic, checked on the
    types that have it: never below what mtmd makes for any size."""
    proj = load_projector(model_pair(family).mmproj)
    worst = max(projectors.image_tokens(proj, *s).n_tokens for s in SIZES)
    assert projectors.token_bound(proj) >= worst, (projectors.token_bound(proj), worst)
