"""The synthetic visual world the demo model is trained and scored on (fixed, so anyone can make
test sets for it from a seed).

- Colours: red, green, blue, yellow, white, black. Shapes: circle, square, triangle. Capital
  letters A–Z drawn with Pillow's bundled font (``ImageFont.load_default(size=…)``).
- A scene: 1–4 filled shapes, each 12–35 % of the shorter side, not overlapping, on a plain or
  gradient background of a colour no shape uses; some scenes hold one capital letter (15–30 % of
  the shorter side tall). Canvases from 224 px up to 4000×3000, any aspect ratio.
- A *detail* scene: one letter 30–60 px tall somewhere on a 2000–4000 px wide canvas, the shapes
  elsewhere.
- Questions (exact wording) and one-line answers: see :func:`questions`; :func:`describe` lists
  every shape left to right ("a red square, two blue circles and the letter K"). :func:`grade`
  compares answers after normalising case and punctuation.

Scenes are vector descriptions; :func:`render` draws any region of one at any size, so a training
loop can draw a view at the encoder's resolution without drawing a 4000-px canvas first.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field
from functools import lru_cache

from PIL import Image, ImageDraw, ImageFont

__all__ = [
    "COLOURS",
    "LETTERS",
    "QUESTION_TYPES",
    "SHAPES",
    "Letter",
    "Scene",
    "Shape",
    "describe",
    "grade",
    "letter_box",
    "make_scene",
    "normalize",
    "questions",
    "render",
]

COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 70, 220),
    "yellow": (240, 215, 40),
    "white": (248, 248, 248),
    "black": (18, 18, 18),
}
SHAPES = ("circle", "square", "triangle")
LETTERS = tuple("ABCDEFGHIJKLMNOPQRSTUVWXYZ")
NUMBER_WORDS = {1: "a", 2: "two", 3: "three", 4: "four"}
QUESTION_TYPES = ("colour", "shape", "count", "letter", "describe")
CAP_HEIGHT = 0.72  # cap height / font size of Pillow's bundled font


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    cx: float  # centre, canvas pixels
    cy: float
    size: float  # side of the bounding square


@dataclass(frozen=True)
class Letter:
    char: str
    colour: str
    x: float  # top-left of the glyph's box
    y: float
    height: float  # cap height in pixels


@dataclass(frozen=True)
class Scene:
    width: int
    height: int
    background: str
    gradient: bool
    shapes: tuple[Shape, ...]
    letter: Letter | None = None
    kind: str = "plain"  # "plain" | "detail"
    meta: dict = field(default_factory=dict, compare=False)


def _overlaps(box, boxes, gap) -> bool:
    x0, y0, x1, y1 = box
    return any(x0 < b[2] + gap and b[0] < x1 + gap and y0 < b[3] + gap and b[1] < y1 + gap for b in boxes)


def make_scene(
    rng: random.Random,
    kind: str = "plain",
    size: tuple[int, int] | None = None,
    letter_p: float = 0.4,
    n_shapes: int | None = None,
) -> Scene:
    """A random scene (``kind`` "plain" or "detail"); ``size`` fixes the canvas."""
    if size is None:
        if kind == "detail":
            w = rng.randint(2000, 4000)
            h = int(w * rng.uniform(0.5, 1.0))
        else:
            long = int(math.exp(rng.uniform(math.log(224), math.log(4000))))
            short_side = max(224, int(long * rng.uniform(0.5, 1.0)))
            w, h = (long, min(short_side, 3000)) if rng.random() < 0.6 else (short_side, long)
    else:
        w, h = size
    short = min(w, h)
    n = n_shapes if n_shapes is not None else rng.randint(1, 4)
    colours = list(COLOURS)
    background = rng.choice(colours)
    free = [c for c in colours if c != background]
    boxes: list[tuple[float, float, float, float]] = []
    letter = None
    if kind == "detail" or rng.random() < letter_p:
        lh = rng.uniform(30, 60) if kind == "detail" else rng.uniform(0.15, 0.30) * short
        lw = lh * 0.9
        for _ in range(100):
            x, y = rng.uniform(0.02 * w, w - lw - 0.02 * w), rng.uniform(0.02 * h, h - lh - 0.02 * h)
            if x >= 0 and y >= 0:
                break
        letter = Letter(rng.choice(LETTERS), rng.choice(free), x, y, lh)
        pad = 0.6 * lh if kind == "detail" else 0.15 * lh
        boxes.append((x - pad, y - pad, x + lw + pad, y + lh + pad))
    shapes: list[Shape] = []
    shape_colours = list(free)
    for _ in range(n):
        for _attempt in range(200):
            s = rng.uniform(0.12, 0.35) * short
            cx, cy = rng.uniform(s / 2, w - s / 2), rng.uniform(s / 2, h - s / 2)
            box = (cx - s / 2, cy - s / 2, cx + s / 2, cy + s / 2)
            if not _overlaps(box, boxes, 0.03 * short):
                boxes.append(box)
                shapes.append(Shape(rng.choice(SHAPES), rng.choice(shape_colours), cx, cy, s))
                break
    if not shapes:  # no room left: one small shape in a corner region guaranteed free of the letter
        s = 0.12 * short
        shapes.append(Shape(rng.choice(SHAPES), rng.choice(shape_colours), s, s, s))
    return Scene(w, h, background, rng.random() < 0.5, tuple(shapes), letter, kind)


@lru_cache(maxsize=64)
def _font(px: int) -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=max(1, px))


def letter_box(scene: Scene) -> tuple[float, float, float, float] | None:
    if scene.letter is None:
        return None
    lt = scene.letter
    return (lt.x, lt.y, lt.x + lt.height * 0.9, lt.y + lt.height)


def _shade(c: tuple[int, int, int], f: float) -> tuple[int, int, int]:
    if sum(c) > 600:  # white: shade towards grey
        return tuple(int(v * (1 - 0.25 * f)) for v in c)
    if sum(c) < 80:  # black: towards dark grey
        return tuple(int(v + 70 * f) for v in c)
    return tuple(int(min(255, v * (1 - 0.35 * f) + 60 * f * (v > 100))) for v in c)


def render(
    scene: Scene, box: tuple[float, float, float, float] | None = None, out: tuple[int, int] | None = None
) -> Image.Image:
    """Draw ``box`` (canvas pixels, default the whole canvas) of the scene at size ``out``
    (default: the box's own size)."""
    x0, y0, x1, y1 = box or (0, 0, scene.width, scene.height)
    ow, oh = out or (max(1, round(x1 - x0)), max(1, round(y1 - y0)))
    sx, sy = ow / (x1 - x0), oh / (y1 - y0)
    bg = COLOURS[scene.background]
    img = Image.new("RGB", (ow, oh), bg)
    d = ImageDraw.Draw(img)
    if scene.gradient:
        strip = Image.new("RGB", (1, 256))
        end = _shade(bg, 1.0)
        for i in range(256):
            t = i / 255
            strip.putpixel((0, i), tuple(int(a + (b - a) * t) for a, b in zip(bg, end, strict=True)))
        # the gradient runs top to bottom over the whole canvas; crop the visible part
        t0, t1 = y0 / scene.height, y1 / scene.height
        col = strip.resize((1, max(2, round(oh / max(t1 - t0, 1e-6)))), Image.Resampling.BILINEAR)
        top = round(t0 * col.height)
        col = col.crop((0, top, 1, top + oh))
        img = col.resize((ow, oh), Image.Resampling.NEAREST)
        d = ImageDraw.Draw(img)

    def tx(x, y):
        return ((x - x0) * sx, (y - y0) * sy)

    for s in scene.shapes:
        r = s.size / 2
        fill = COLOURS[s.colour]
        if s.kind == "circle":
            a, b = tx(s.cx - r, s.cy - r)
            c, e = tx(s.cx + r, s.cy + r)
            d.ellipse([a, b, c, e], fill=fill)
        elif s.kind == "square":
            a, b = tx(s.cx - r, s.cy - r)
            c, e = tx(s.cx + r, s.cy + r)
            d.rectangle([a, b, c, e], fill=fill)
        else:
            d.polygon([tx(s.cx, s.cy - r), tx(s.cx - r, s.cy + r), tx(s.cx + r, s.cy + r)], fill=fill)
    if scene.letter is not None:
        draw_letter(d, scene.letter, tx(scene.letter.x, scene.letter.y), sy)
    return img


def draw_letter(d: ImageDraw.ImageDraw, lt: Letter, at: tuple[float, float], scale: float) -> None:
    """Draw ``lt`` with its cap top-left at ``at`` (output pixels), ``scale`` output pixels per
    canvas pixel: the bundled font sized so the capital is ``lt.height`` canvas pixels tall."""
    px = lt.height * scale / CAP_HEIGHT
    if px >= 1:
        font = _font(round(px))
        d.text((at[0], at[1] - font.getbbox(lt.char)[1]), lt.char, fill=COLOURS[lt.colour], font=font)


def _plural(kind: str, n: int) -> str:
    return kind if n == 1 else kind + "s"


def groups(scene: Scene) -> list[tuple[tuple[str, str], list[Shape]]]:
    """The scene's shapes by (colour, kind), in the order :func:`describe` lists them: left to
    right by each group's leftmost member."""
    by: dict[tuple[str, str], list[Shape]] = {}
    for s in scene.shapes:
        by.setdefault((s.colour, s.kind), []).append(s)
    return sorted(by.items(), key=lambda kv: min(s.cx for s in kv[1]))


def describe(scene: Scene) -> str:
    """ "a red square, two blue circles and the letter K": groups of one colour and shape, left to
    right by their leftmost member, then the letter."""
    items = [f"{NUMBER_WORDS[len(v)]} {c} {_plural(k, len(v))}" for (c, k), v in groups(scene)]
    if scene.letter is not None:
        items.append(f"the letter {scene.letter.char}")
    if len(items) == 1:
        return items[0]
    return ", ".join(items[:-1]) + " and " + items[-1]


def questions(scene: Scene) -> list[tuple[str, str, str]]:
    """Every (type, question, answer) the scene supports."""
    out = []
    kinds = [s.kind for s in scene.shapes]
    colours = [s.colour for s in scene.shapes]
    for k in SHAPES:
        if kinds.count(k) == 1:
            out.append(("colour", f"What colour is the {k}?", colours[kinds.index(k)]))
    for c in COLOURS:
        if colours.count(c) == 1:
            out.append(("shape", f"What shape is {c}?", kinds[colours.index(c)]))
    for k in SHAPES:
        out.append(("count", f"How many {k}s are there?", str(kinds.count(k))))
    if scene.letter is not None:
        out.append(("letter", "What letter is in the image?", scene.letter.char))
    out.append(("describe", "Describe the image.", describe(scene)))
    return out


def normalize(text: str) -> str:
    """Case and punctuation folded, whitespace collapsed (what :func:`grade` compares)."""
    t = re.sub(r"[^a-z0-9 ]+", " ", text.lower())
    return " ".join(t.split())


def grade(answer: str, expected: str) -> bool:
    return normalize(answer) == normalize(expected)
