"""Training samples for the demo VLM: scenes of the synthetic world, drawn as mtmd would hand
them to the encoder, in the exact prompts edgevlm sends (its LLaVA-1.5 chat format, its AnyRes
view labels, its summary notes), tokenized by llama.cpp itself.

A sample is (views [n, S, S, 3] uint8, token ids, image-slot map, loss mask).
"""

from __future__ import annotations

import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from demo_model import PAD_COLOUR

from edgevlm.caption.text import DEFAULT_PROMPT as CAPTION_PROMPT
from edgevlm.runtime.chat_format import PromptFormatter
from edgevlm.runtime.session import DEFAULT_SUMMARY_PROMPT
from edgevlm.vision.budget import choose_tiles, tile_boxes
from edgevlm.vision.detail import score_boxes
from edgevlm_testkit import world

MARKER = "<__media__>"
NAMES = ("scene", "picture", "image", "photo", "img")


def summary_question(n: int, name: str) -> str:
    return DEFAULT_SUMMARY_PROMPT.format(n=n, name=name)


def about_image(question: str, n: int) -> str:
    """ "What colour is the circle?" → "What colour is the circle in image 1?" (the form the
    quality bench asks about a picture that may have been summarised)."""
    return question[:-1] + f" in image {n}?" if question.endswith("?") else question


@dataclass
class Sample:
    views: list[np.ndarray]
    ids: list[int]
    slots: list[int]  # per position: index into views*n_patches, or -1
    loss: list[bool]
    labels: list[np.ndarray] | None = None  # per view: [n_patches, len(N_AUX)] per image token (token_labels)
    scene_labels: list[np.ndarray] | None = None  # per view: what it shows in all (see view_labels)


COLOUR_IDS = {c: i for i, c in enumerate(world.COLOURS)}
SHAPE_IDS = {k: i for i, k in enumerate(world.SHAPES)}
MAX_GROUPS = 4  # a world scene holds at most 4 shapes, so "Describe the image." lists ≤ 4 groups
# per-token targets: colour, shape covering the patch, letter, shape whose centre is in the
# patch, and where the covering shape's group comes in the description (its rank)
N_AUX = (len(COLOUR_IDS) + 1, len(SHAPE_IDS) + 1, len(world.LETTERS) + 1, len(SHAPE_IDS) + 1, MAX_GROUPS + 1)
AUX_NAMES = ("colour", "shape", "letter", "centre", "rank")


def _inside(s: world.Shape, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    r = s.size / 2
    dx, dy = x - s.cx, y - s.cy
    if s.kind == "circle":
        return dx * dx + dy * dy <= r * r
    if s.kind == "square":
        return (np.abs(dx) <= r) & (np.abs(dy) <= r)
    return (dy >= -r) & (dy <= r) & (np.abs(dx) <= (dy + r) / 2)


COVER_SAMPLES = 6  # sample points per patch side when measuring what covers a patch
N_GROUPS = len(COLOUR_IDS) * len(SHAPE_IDS)  # (colour, shape) pairs counted per view


def view_labels(scene: world.Scene, box) -> np.ndarray:
    """What a whole view shows (an auxiliary target for its class token, the last image token
    mtmd hands over): how many shapes of each colour and kind have their centre in it (0-4),
    and its letter (or none)."""
    x0, y0, x1, y1 = box
    out = np.zeros(N_GROUPS + 1, np.int32)
    for sh in scene.shapes:
        if x0 <= sh.cx < x1 and y0 <= sh.cy < y1:
            out[COLOUR_IDS[sh.colour] * len(SHAPE_IDS) + SHAPE_IDS[sh.kind]] += 1
    np.minimum(out, 4, out=out)
    out[N_GROUPS] = len(world.LETTERS)
    lb = world.letter_box(scene)
    if lb is not None:
        cx, cy = (lb[0] + lb[2]) / 2, (lb[1] + lb[3]) / 2
        if x0 <= cx < x1 and y0 <= cy < y1:
            out[N_GROUPS] = world.LETTERS.index(scene.letter.char)
    return out


INK_SUPERSAMPLE = 4  # the glyph's ink is measured on a drawing 4x finer than the view
LETTER_INK = 0.15  # a patch shows the letter when it holds this share of its ink


def _runs(first: int, n: int, edges: np.ndarray) -> tuple[slice, np.ndarray, np.ndarray]:
    """Pixels first..first+n-1 along one axis, against patch boundaries ``edges``: the slice of
    them inside the view, where each patch's run starts in that slice, and the patches."""
    idx = np.searchsorted(edges, first + np.arange(n), "right") - 1
    inside = np.flatnonzero((idx >= 0) & (idx < len(edges) - 1))
    if not len(inside):
        return slice(0, 0), np.zeros(0, int), np.zeros(0, int)
    lo, hi = inside[0], inside[-1] + 1
    starts = np.concatenate([[0], np.flatnonzero(np.diff(idx[lo:hi])) + 1])
    return slice(lo, hi), starts, idx[lo:hi][starts]


def letter_ink(lt: world.Letter, origin, offset, scale, size: int, grid: int) -> np.ndarray:
    """[grid, grid]: the share of the letter's ink (its drawn glyph, not its box) in each
    patch of the view — canvas point (x, y) lands at ``offset + (x - origin) * scale``. Boxes
    labelled the empty sides of an "I" or the space under a "Y"'s arms as that letter. Only the
    glyph's surroundings are drawn (at the same pixel phase as a whole-view drawing)."""
    from PIL import ImageDraw

    k = INK_SUPERSAMPLE
    at = ((offset[0] + (lt.x - origin[0]) * scale[0]) * k, (offset[1] + (lt.y - origin[1]) * scale[1]) * k)
    cap = lt.height * scale[1] * k
    margin = math.ceil(cap) + 2  # wider than any glyph, descenders included
    x0, y0 = math.floor(at[0]) - margin, math.floor(at[1]) - margin
    side = 3 * margin
    crop = Image.new("RGB", (side, side))
    world.draw_letter(
        ImageDraw.Draw(crop),
        world.Letter(lt.char, "white", lt.x, lt.y, lt.height),
        (at[0] - x0, at[1] - y0),
        scale[1] * k,
    )
    ink = np.asarray(crop)[..., 0].astype(np.float64) / 255.0
    edges = np.round(np.arange(grid + 1) * size * k / grid).astype(int)
    rows, row_starts, row_patches = _runs(y0, side, edges)
    cols, col_starts, col_patches = _runs(x0, side, edges)
    per = np.zeros((grid, grid))
    if len(row_patches) and len(col_patches):
        sums = np.add.reduceat(np.add.reduceat(ink[rows, cols], row_starts, axis=0), col_starts, axis=1)
        per[np.ix_(row_patches, col_patches)] = sums
    total = per.sum()
    if total <= 0:  # too small to draw at all: the patch holding its centre
        cx = offset[0] + (lt.x + lt.height * 0.45 - origin[0]) * scale[0]
        cy = offset[1] + (lt.y + lt.height * 0.5 - origin[1]) * scale[1]
        gx, gy = int(cx * grid // size), int(cy * grid // size)
        if 0 <= gx < grid and 0 <= gy < grid:
            per[gy, gx] = 1.0
        return per
    return per / total


def patch_labels(scene: world.Scene, box, size: int, grid: int) -> np.ndarray:
    """What each encoder patch shows (an auxiliary training target, never exported): the
    colour and kind of the shape covering most of it, the letter when the patch covers a
    fair part of its glyph, the kind of the shape whose centre lies in it, and the place of the
    covering shape's group in the scene's description (``world.groups``: what "Describe the
    image." lists next is then a lookup, not a comparison of positions; -1 past MAX_GROUPS);
    ``len(...)`` of each table means "none"."""
    x0, y0, x1, y1 = box
    bw, bh = x1 - x0, y1 - y0
    s = min(size / bw, size / bh)
    nw, nh = min(math.ceil(bw * s), size), min(math.ceil(bh * s), size)
    ox, oy = (size - nw) // 2, (size - nh) // 2
    sx, sy = nw / bw, nh / bh
    P = size / grid
    g = (np.arange(grid) + 0.5) * P
    cx, cy = np.meshgrid(g, g)  # [gy, gx]
    X, Y = x0 + (cx - ox) / sx, y0 + (cy - oy) / sy
    inside_view = (cx >= ox) & (cx < ox + nw) & (cy >= oy) & (cy < oy + nh)
    lab = np.empty((grid, grid, len(N_AUX)), np.int32)
    for i, n in enumerate(N_AUX):
        lab[..., i] = n - 1
    # a patch shows the shape covering most of it, when that is a fair part (≥ 20 %): edge
    # patches — where circle, square and triangle differ — are labelled, not only interiors
    sub = (np.arange(COVER_SAMPLES) + 0.5) / COVER_SAMPLES - 0.5
    ux, uy = np.meshgrid(sub, sub)
    SX = X[..., None, None] + ux * (P / sx)  # [gy, gx, k, k] canvas x of each sample point
    SY = Y[..., None, None] + uy * (P / sy)
    best = np.zeros((grid, grid))
    rank = {key: i for i, (key, _) in enumerate(world.groups(scene))}
    for sh in scene.shapes:
        cover = _inside(sh, SX, SY).mean(axis=(-1, -2))
        m = (cover >= 0.2) & (cover > best) & inside_view
        best = np.where(m, cover, best)
        lab[..., 0][m] = COLOUR_IDS[sh.colour]
        lab[..., 1][m] = SHAPE_IDS[sh.kind]
        r = rank[(sh.colour, sh.kind)]
        lab[..., 4][m] = r if r < MAX_GROUPS else -1
        # the one patch holding the shape's centre (objects, not area: what counting needs)
        gx = math.floor(((sh.cx - x0) * sx + ox) / P)
        gy = math.floor(((sh.cy - y0) * sy + oy) / P)
        if 0 <= gx < grid and 0 <= gy < grid and inside_view[gy, gx]:
            lab[gy, gx, 3] = SHAPE_IDS[sh.kind]
    if scene.letter is not None:
        frac = letter_ink(scene.letter, (x0, y0), (ox, oy), (sx, sy), size, grid)
        lab[..., 2][(frac >= LETTER_INK) & inside_view] = world.LETTERS.index(scene.letter.char)
    return lab.reshape(grid * grid, len(N_AUX))


def token_labels(scene: world.Scene, box, size: int, grid: int) -> np.ndarray:
    """:func:`patch_labels` per *image token*: mtmd's LLaVA graph concatenates the class token
    after the patches and hands over rows 1..n_patches, so token j shows patch j+1 and the last
    token is the class token (no patch label: -1). Labelling token j with patch j (as the first
    model was) asks each token for its left neighbour's content."""
    return as_tokens(patch_labels(scene, box, size, grid))


def as_tokens(patch_lab: np.ndarray) -> np.ndarray:
    """Per-patch labels in the order of the image tokens mtmd hands over (see token_labels)."""
    return np.concatenate([patch_lab[1:], np.full((1, len(N_AUX)), -1, np.int32)])


DRILLS = {  # (letters, letter cap heights in px, shapes) per view
    "drill": ((2, 6), (14, 68), (4, 9)),
    # letters at the sizes a scene's letter takes in one view (15-30 % of 224 px), a few shapes
    "letters": ((5, 9), (30, 70), (0, 3)),
}


def drill_view(rng: random.Random, size: int, grid: int, kind: str = "drill") -> tuple[np.ndarray, np.ndarray]:
    """A training-only picture, denser than the world's scenes: ("drill") 4-9 shapes and 2-6
    letters at the sizes a whole scene's shapes and letter take in one encoder view, or
    ("letters") 5-9 letters at a scene letter's size and a few shapes, on a background none of
    them uses. A scene holds one letter, so a letter class would be seen once in ~60 views; here
    each view labels a dozen shape and letter patches. Returns (pixels, token labels)."""
    from PIL import ImageDraw

    bg = rng.choice(list(world.COLOURS))
    free = [c for c in world.COLOURS if c != bg]
    boxes: list[tuple[float, float, float, float]] = []

    def place(w: float, h: float):
        for _ in range(60):
            x, y = rng.uniform(2, size - w - 2), rng.uniform(2, size - h - 2)
            b = (x, y, x + w, y + h)
            if not any(b[0] < o[2] + 4 and o[0] < b[2] + 4 and b[1] < o[3] + 4 and o[1] < b[3] + 4 for o in boxes):
                boxes.append(b)
                return x, y
        return None

    (l_lo, l_hi), (h_lo, h_hi), (s_lo, s_hi) = DRILLS[kind]
    letters = []
    for _ in range(rng.randint(l_lo, l_hi)):
        lh = rng.uniform(h_lo, h_hi)
        at = place(lh * 0.9, lh)
        if at:
            letters.append(world.Letter(rng.choice(world.LETTERS), rng.choice(free), at[0], at[1], lh))
    shapes = []
    for _ in range(rng.randint(s_lo, s_hi)):
        sz = rng.uniform(12, 80)
        at = place(sz, sz)
        if at:
            shapes.append(world.Shape(rng.choice(world.SHAPES), rng.choice(free), at[0] + sz / 2, at[1] + sz / 2, sz))
    scene = world.Scene(size, size, bg, rng.random() < 0.5, tuple(shapes))
    ss = 2
    img = world.render(scene, out=(size * ss, size * ss))
    d = ImageDraw.Draw(img)
    for lt in letters:
        world.draw_letter(d, lt, (lt.x * ss, lt.y * ss), ss)
    pix = np.asarray(img.resize((size, size), Image.Resampling.BICUBIC))
    box = (0, 0, size, size)
    lab = patch_labels(scene, box, size, grid)
    for lt in letters:
        one = patch_labels(world.Scene(size, size, bg, False, (), lt), box, size, grid)[:, 2]
        lab[:, 2] = np.where(one != N_AUX[2] - 1, one, lab[:, 2])
    return pix, as_tokens(lab)


class Tokens:
    """llama.cpp's tokenizer for the demo vocabulary (vocab-only load), cached per string."""

    def __init__(self, gguf_path: str):
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=gguf_path, vocab_only=True, verbose=False)
        self.cache: dict[str, list[int]] = {}

    def __call__(self, text: str) -> list[int]:
        ids = self.cache.get(text)
        if ids is None:
            ids = self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
            if len(self.cache) < 200_000:
                self.cache[text] = ids
        return ids


def view_pixels(scene: world.Scene, box, size: int, rng: random.Random) -> np.ndarray:
    """The S×S uint8 picture mtmd makes of ``box``: aspect kept (ceil), bicubic, centred on its
    pad colour. Drawn supersampled, then reduced with the same bicubic filter."""
    x0, y0, x1, y1 = box
    bw, bh = x1 - x0, y1 - y0
    s = min(size / bw, size / bh)
    nw, nh = min(math.ceil(bw * s), size), min(math.ceil(bh * s), size)
    ss = rng.choice((2, 2, 3)) if max(bw, bh) > size else 1
    img = world.render(scene, box, (nw * ss, nh * ss))
    if ss > 1:
        img = img.resize((nw, nh), Image.Resampling.BICUBIC)
    canvas = Image.new("RGB", (size, size), PAD_COLOUR)
    canvas.paste(img, ((size - nw) // 2, (size - nh) // 2))
    return np.asarray(canvas)


def anyres_views(scene: world.Scene, size: int, per_view: int, budget: int) -> list[tuple[str, tuple]]:
    """edgevlm's AnyRes choice for a fixed-size encoder (``vision.budget._plan_fixed``), scored
    on a low-resolution drawing: [(label, box)] in prompt order."""
    w, h = scene.width, scene.height
    k = budget // per_view - 1
    whole = (0, 0, w, h)
    if k < 1 or (w <= size and h <= size):
        return [("image", whole)]
    cols, _, boxes = tile_boxes(w, h, size, k)
    scale = min(1.0, 768 / max(w, h))
    low = np.asarray(world.render(scene, out=(max(1, round(w * scale)), max(1, round(h * scale)))))
    chosen, _, _ = choose_tiles(score_boxes(low, [tuple(v * scale for v in b) for b in boxes]), k)
    out = [("global view", whole)]
    for i, b in enumerate(boxes):
        if i in chosen:
            r, c = divmod(i, cols)
            out.append((f"tile row {r + 1} col {c + 1}", b))
    if len(out) == 1:
        out = [("image", whole)]
    return out


QUESTION_WEIGHTS = {"colour": 1.0, "shape": 1.0, "count": 1.0, "letter": 1.2, "describe": 1.2}


class SampleMaker:
    def __init__(
        self, tok: Tokens, size: int, n_patches: int, seed: int, question_weights: dict[str, float] | None = None
    ):
        self.question_weights = {**QUESTION_WEIGHTS, **(question_weights or {})}
        self.tok = tok
        self.size = size
        self.n_patches = n_patches
        self.grid = int(round(n_patches**0.5))
        self.rng = random.Random(seed)
        self.fmt = PromptFormatter(None, "llama", "mlp", MARKER, bos_token="<s>", eos_token="</s>", strip_bos=True)

    # --- question choice -----------------------------------------------------------------
    def pick_question(self, scene: world.Scene, letter_bias: float = 0.0) -> tuple[str, str, str]:
        qs = world.questions(scene)
        rng = self.rng
        if letter_bias and scene.letter is not None and rng.random() < letter_bias:
            return next(q for q in qs if q[0] == "letter")
        weights = self.question_weights
        kinds = sorted({q[0] for q in qs})
        kind = rng.choices(kinds, [weights[k] for k in kinds])[0]
        q = rng.choice([q for q in qs if q[0] == kind])
        if kind == "describe":
            r = rng.random()
            if r < 0.2:
                return ("describe", CAPTION_PROMPT, q[2])
        return q

    # --- assembling ------------------------------------------------------------------------
    def assemble(
        self, msgs: list[tuple[str, str, list]], views: list[np.ndarray], answers: list[str], final: str
    ) -> Sample:
        """``msgs`` as PromptFormatter takes them (assistant texts are the history answers)."""
        ids: list[int] = [1]
        slots: list[int] = [-1]
        loss: list[bool] = [False]
        for piece in self.fmt.render(msgs):
            if piece.kind == "text":
                t = self.tok(piece.text)
                ids += t
                slots += [-1] * len(t)
                loss += [False] * len(t)
            elif piece.kind == "assistant":
                t = self.tok(answers[piece.index])
                ids += t
                slots += [-1] * len(t)
                loss += [True] * len(t)
            else:
                base = piece.index * self.n_patches
                ids += [0] * self.n_patches
                slots += list(range(base, base + self.n_patches))
                loss += [False] * self.n_patches
        t = self.tok(final) + [2]
        ids += t
        slots += [-1] * len(t)
        loss += [True] * len(t)
        return Sample(views, ids, slots, loss)

    def name(self) -> str:
        return f"{self.rng.choice(NAMES)}-{self.rng.randint(1, 999)}.{self.rng.choice(('png', 'jpg'))}"

    # --- kinds -----------------------------------------------------------------------------
    def single(self, max_tokens: int | None = None) -> Sample:
        """One picture and a question; with ``max_tokens``, more questions about the same picture
        as later turns while they fit (every answer is a target: more signal per encoded view)."""
        rng = self.rng
        scene = world.make_scene(rng, "plain", letter_p=0.45)
        box = (0, 0, scene.width, scene.height)
        view = view_pixels(scene, box, self.size, rng)
        asked: list[tuple[str, str]] = []
        out = None
        for _ in range(6 if max_tokens else 1):
            _, q, a = self.pick_question(scene)
            if (q, a) in asked:
                continue
            msgs: list[tuple[str, str, list]] = []
            for i, (pq, pa) in enumerate(asked):  # earlier turns: question, answer
                msgs += [("user", pq, [None] if i == 0 else []), ("assistant", pa, [])]
            msgs.append(("user", q, [] if asked else [None]))
            cand = self.assemble(msgs, [view], [pa for _, pa in asked], a)
            if out is not None and len(cand.ids) > max_tokens:
                break
            out = cand
            asked.append((q, a))
        out.labels = [token_labels(scene, box, self.size, self.grid)]
        out.scene_labels = [view_labels(scene, box)]
        return out

    def tiled(self, per_view: int) -> Sample:
        rng = self.rng
        detail = rng.random() < 0.6
        scene = world.make_scene(rng, "detail" if detail else "plain", letter_p=0.45)
        if not detail and max(scene.width, scene.height) < 2 * self.size:
            scene = world.make_scene(rng, "plain", size=(rng.randint(900, 4000), rng.randint(700, 3000)))
        budget = rng.choice((2, 3, 5, 9, 9, 9)) * per_view
        vs = anyres_views(scene, self.size, per_view, budget)
        views = [view_pixels(scene, b, self.size, rng) for _, b in vs]
        labels = [lb if len(vs) > 1 else None for lb, _ in vs]
        _, q, a = self.pick_question(scene, letter_bias=0.5 if detail else 0.0)
        out = self.assemble([("user", q, labels)], views, [], a)
        out.labels = [token_labels(scene, b, self.size, self.grid) for _, b in vs]
        out.scene_labels = [view_labels(scene, b) for _, b in vs]
        return out

    def conversation(self) -> Sample:
        """Two pictures over turns; then either the summary question about one of them, or a
        question about image 1 — as a picture or as the note a summary left behind."""
        rng = self.rng
        scenes = [world.make_scene(rng, "plain", letter_p=0.45) for _ in range(2)]
        names = [self.name(), self.name()]
        n_pics = rng.choice((1, 2))
        summarised = rng.random() < 0.6
        msgs, views, answers = [], [], []
        for i in range(n_pics):
            _, q, a = self.pick_question(scenes[i])
            if i == 0 and summarised:
                note = f"[image 1 ({names[0]}): {world.describe(scenes[0])}]"
                msgs.append(("user", note + "\n" + q, []))
            else:
                views.append(view_pixels(scenes[i], (0, 0, scenes[i].width, scenes[i].height), self.size, rng))
                msgs.append(("user", q, [None]))
            msgs.append(("assistant", a, []))
            answers.append(a)
        r = rng.random()
        if r < 0.3 and not (summarised and n_pics == 1):
            n = rng.randint(2 if summarised else 1, n_pics) if n_pics > 1 else 1
            msgs.append(("user", summary_question(n, names[n - 1]), []))
            final = world.describe(scenes[n - 1])
        else:
            kind, q, final = self.pick_question(scenes[0])
            if kind == "describe":
                q = "Describe image 1."
            msgs.append(("user", about_image(q, 1) if (n_pics > 1 or rng.random() < 0.7) else q, []))
        return self.assemble(msgs, views, answers, final)

    def note(self) -> Sample:
        """Text only: questions about pictures the session replaced by notes, answered from the
        notes alone — the skill the summary row of the quality bench measures, apart from
        seeing. A conversation's picture is only sometimes summarised, so ``conversation`` gives
        it few steps and mostly simple scenes; here each sample is one to three notes of busier
        scenes (1-4 shapes, 2-4 twice as often), then one to three questions about one of them
        as later turns (every answer a target), with "in image N" as the bench asks. Each
        question's answer is in its note: the colour of the only square, the letter to copy, the
        whole description to repeat. No picture is encoded: a step costs a fraction of one
        with pictures."""
        rng = self.rng
        n_notes = rng.choice((1, 1, 2, 2, 3))
        scenes = [
            world.make_scene(rng, "plain", letter_p=0.5, n_shapes=rng.choice((1, 2, 2, 3, 3, 4, 4)))
            for _ in range(n_notes)
        ]
        notes = [f"[image {i + 1} ({self.name()}): {world.describe(s)}]" for i, s in enumerate(scenes)]
        n = rng.randint(1, n_notes)
        asked: list[tuple[str, str]] = []
        for _ in range(rng.randint(1, 3)):
            kind, q, a = self.pick_question(scenes[n - 1])
            q = f"Describe image {n}." if kind == "describe" else about_image(q, n)
            if (q, a) not in asked:
                asked.append((q, a))
        msgs: list[tuple[str, str, list]] = []
        for i, (q, a) in enumerate(asked):
            msgs.append(("user", "\n".join(notes + [q]) if i == 0 else q, []))
            if i < len(asked) - 1:
                msgs.append(("assistant", a, []))
        return self.assemble(msgs, [], [a for _, a in asked[:-1]], asked[-1][1])
