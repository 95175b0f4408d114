"""The synthetic world the demo VLM is trained and scored on (edgevlm_testkit.world)."""

from __future__ import annotations

import random

from edgevlm_testkit import world


def test_scenes_follow_the_spec_and_are_reproducible():
    for seed in range(200):
        kind = "detail" if seed % 4 == 0 else "plain"
        a = world.make_scene(random.Random(seed), kind)
        assert a == world.make_scene(random.Random(seed), kind)
        assert min(a.width, a.height) >= 224 and max(a.width, a.height) <= 4000
        assert 1 <= len(a.shapes) <= 4
        short = min(a.width, a.height)
        for s in a.shapes:
            assert s.colour != a.background and s.kind in world.SHAPES
            assert 0.12 * short - 1e-6 <= s.size <= 0.35 * short + 1e-6
        if kind == "detail":
            assert 2000 <= a.width <= 4000 and a.letter is not None and 30 <= a.letter.height <= 60


def test_questions_and_descriptions_are_exact():
    s = world.Scene(
        800,
        600,
        "white",
        False,
        (
            world.Shape("square", "red", 100, 300, 120),
            world.Shape("circle", "blue", 400, 200, 100),
            world.Shape("circle", "blue", 600, 400, 100),
        ),
        world.Letter("K", "black", 650, 50, 80),
    )
    assert world.describe(s) == "a red square, two blue circles and the letter K"
    qa = {q: a for _, q, a in world.questions(s)}
    assert qa["What colour is the square?"] == "red"
    assert "What colour is the circle?" not in qa  # two circles: not asked
    assert qa["What shape is red?"] == "square" and "What shape is blue?" not in qa
    assert qa["How many circles are there?"] == "2" and qa["How many triangles are there?"] == "0"
    assert qa["What letter is in the image?"] == "K"
    assert world.grade(" Two blue Circles.", "two blue circles") and not world.grade("blue", "red")


def test_the_letter_is_drawn_at_its_size_where_it_belongs():
    import numpy as np

    s = world.Scene(
        3000,
        2000,
        "white",
        False,
        (world.Shape("square", "red", 300, 300, 400),),
        world.Letter("H", "black", 2000, 1500, 48),
        kind="detail",
    )
    img = np.asarray(world.render(s))
    dark = np.argwhere(img.sum(-1) < 100)
    (y0, x0), (y1, _) = dark.min(0), dark.max(0)
    assert 1495 <= y0 <= 1505 and 44 <= y1 - y0 + 1 <= 52 and 1995 <= x0 <= 2010
    # a region drawn at another scale shows the same picture
    crop = np.asarray(world.render(s, (1900, 1400, 2200, 1600), (150, 100)))
    assert (crop.sum(-1) < 200).any()
