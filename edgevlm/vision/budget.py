"""Pre-encoder image budgeting: decide, before the vision encoder runs, which views of an image
the model sees and what they cost, so that the total stays within ``--image-tokens``.

- dynamic resolution (Qwen2/2.5-VL): resize, aspect kept, on the 28-px grid, until the tokens fit;
- tiled (LLaVA-1.6 pinpoints): choose the pinpoint grid whose cost fits and size the image so
  mtmd picks exactly that grid; tiled by size (SmolVLM, InternVL, MiniCPM-V): shrink the image
  until its tiles fit;
- fixed size (LLaVA-1.5, 336² → 576): our own AnyRes — a global view plus the most detailed
  tiles of a grid, each sent as its own image with a label (``global view``,
  ``tile row 1 col 2``), so a 4K screenshot is read at useful resolution. Tiles are chosen by a
  detail score on a low-resolution copy; flat tiles (sky, walls, margins) are skipped.

Every count comes from ``model.projectors.image_tokens`` (edgevlm's arithmetic checked against
mtmd, or mtmd's own count for a loaded projector edgevlm has no arithmetic for), so the plan is
exact. ``ImageBudget`` holds the options (budget, tiles, mtmd's cap) a caller plans with.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import cast

from ..model.gguf_info import ProjectorInfo
from ..model.projectors import facts, image_tokens
from .detail import DEFAULT_SCORER, score_boxes
from .images import LoadedImage, from_rgb, resized

__all__ = [
    "COMPACT_PIXELS",
    "ImageBudget",
    "ImagePlan",
    "PlannedView",
    "candidate_grid",
    "choose_tiles",
    "compact_view",
    "draw_overlay",
    "fit_size",
    "plan_image",
    "render_views",
    "tile_boxes",
]
FLAT_FRACTION = 0.25  # a tile scoring below this share of the best tile counts as flat
FLAT_ABSOLUTE = {"edges": 1.0, "entropy": 1.0, "compress": 0.02}


@dataclass(frozen=True)
class PlannedView:
    label: str  # "image", "global view", "tile row 1 col 2"
    box: tuple[int, int, int, int]  # region of the source image (x0, y0, x1, y1)
    size: tuple[int, int]  # pixels handed to mtmd for this view
    tokens: int
    score: float | None = None
    selected: bool = True


@dataclass(frozen=True)
class ImagePlan:
    kind: str  # "fixed" | "tiled" | "dynamic"
    source_size: tuple[int, int]
    budget: int | None
    total_tokens: int
    views: tuple[PlannedView, ...]
    grid: tuple[int, int] = (0, 0)  # candidate tile grid (cols, rows) for AnyRes
    scorer: str | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def selected(self) -> list[PlannedView]:
        return [v for v in self.views if v.selected]

    def to_dict(self) -> dict:
        d = asdict(self)
        d["views"] = [dict(asdict(v), box=list(v.box), size=list(v.size)) for v in self.views]
        return d


def fit_size(w: int, h: int, ok: Callable[[int, int], bool], steps: int = 30) -> tuple[int, int] | None:
    """The largest aspect-kept size (w, h scaled by one factor ≤ 1) for which ``ok`` holds,
    found by bisection; None when not even the smallest does."""
    if ok(w, h):
        return w, h
    lo, hi = 0.0, 1.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        if ok(max(1, int(w * mid)), max(1, int(h * mid))):
            lo = mid
        else:
            hi = mid
    return (max(1, int(w * lo)), max(1, int(h * lo))) if lo > 0 else None


def _plan_dynamic(proj: ProjectorInfo, w: int, h: int, budget: int | None, max_tokens: int | None) -> ImagePlan:
    notes = []
    sw, sh = w, h
    if budget is not None:
        fits = fit_size(w, h, lambda a, b: image_tokens(proj, a, b, max_tokens=max_tokens).n_tokens <= budget)
        sw, sh = fits or (1, 1)  # not even the smallest: mtmd makes its minimum
    if (sw, sh) != (w, h):
        notes.append(f"resized {w}x{h} → {sw}x{sh} to fit {budget} tokens")
    t = image_tokens(proj, sw, sh, max_tokens=max_tokens)
    if max_tokens is not None and (full := image_tokens(proj, sw, sh).n_tokens) > t.n_tokens:
        notes.append(f"resized by mtmd: {full} → {t.n_tokens} tokens (its image_max_tokens {max_tokens})")
    if budget is not None and t.n_tokens > budget:
        notes.append(f"even the smallest size needs {t.n_tokens} tokens (mtmd's minimum)")
    v = PlannedView("image", (0, 0, w, h), (sw, sh), t.n_tokens)
    return ImagePlan("dynamic", (w, h), budget, t.n_tokens, (v,), notes=tuple(notes))


def _plan_tiled(proj: ProjectorInfo, w: int, h: int, budget: int | None) -> ImagePlan:
    size = proj.image_size
    full = image_tokens(proj, w, h)
    if budget is None or full.n_tokens <= budget:
        v = PlannedView("image", (0, 0, w, h), (w, h), full.n_tokens)
        return ImagePlan("tiled", (w, h), budget, full.n_tokens, (v,))
    if not proj.image_grid_pinpoints:  # tiles follow the size (InternVL, MiniCPM-V): shrink
        sw, sh = fit_size(w, h, lambda a, b: image_tokens(proj, a, b).n_tokens <= budget) or (1, 1)
        t = image_tokens(proj, sw, sh)
        if t.n_tokens > budget:  # SmolVLM scales every picture to one size: its aspect sets the tiles
            if full.n_tokens <= t.n_tokens:
                t, (sw, sh) = full, (w, h)
            notes = [
                f"{t.n_tokens} tokens is this picture's minimum with {proj.projector_type} "
                f"(over the budget of {budget})"
            ]
        else:
            notes = [f"resized {w}x{h} → {sw}x{sh}: {t.n_chunks} view(s) fit {budget} tokens"]
        v = PlannedView("image", (0, 0, w, h), (sw, sh), t.n_tokens)
        return ImagePlan("tiled", (w, h), budget, t.n_tokens, (v,), notes=tuple(notes))
    best: tuple[int, int, int, tuple[int, int]] | None = None
    for cw, ch in sorted(proj.image_grid_pinpoints or [], key=lambda p: p[0] * p[1]):
        s = min(cw / w, ch / h)
        sw, sh = max(1, int(w * s)), max(1, int(h * s))
        if sw <= size and sh <= size:
            continue
        n = image_tokens(proj, sw, sh).n_tokens
        if n <= budget and (best is None or n > best[2]):
            best = (sw, sh, n, (cw, ch))
    notes = []
    if best is None:  # overview only: fit inside one tile
        s = min(size / w, size / h, 1.0)
        sw, sh = max(1, int(w * s)), max(1, int(h * s))
        n = image_tokens(proj, sw, sh).n_tokens
        notes.append(f"budget {budget} < one grid: overview only ({sw}x{sh})")
    else:
        sw, sh, n, pin = best
        notes.append(f"grid {pin[0] // size}x{pin[1] // size} tiles + overview fits {budget} tokens")
    v = PlannedView("image", (0, 0, w, h), (sw, sh), n)
    return ImagePlan("tiled", (w, h), budget, n, (v,), notes=tuple(notes))


def candidate_grid(w: int, h: int, native: int, k: int) -> tuple[int, int]:
    """AnyRes candidate grid: about 3× as many tiles as will be chosen, roughly square tiles,
    never finer than the encoder's native resolution (no upsampling)."""
    max_cols, max_rows = max(1, math.ceil(w / native)), max(1, math.ceil(h / native))
    want = min(max_cols * max_rows, max(k, 3 * k))
    side = math.sqrt(w * h / max(want, 1))
    cols = min(max_cols, max(1, round(w / side)))
    rows = min(max_rows, max(1, round(h / side)))
    while cols * rows < min(k, max_cols * max_rows):  # rounding left too few candidates
        if w / cols >= h / rows and cols < max_cols:
            cols += 1
        elif rows < max_rows:
            rows += 1
        else:
            cols += 1
    return cols, rows


def tile_boxes(w: int, h: int, native: int, k: int) -> tuple[int, int, list[tuple[int, int, int, int]]]:
    """The AnyRes candidate grid for ``k`` tiles: (cols, rows, boxes row by row)."""
    cols, rows = candidate_grid(w, h, native, k)
    boxes = [
        (c * w // cols, r * h // rows, (c + 1) * w // cols, (r + 1) * h // rows)
        for r in range(rows)
        for c in range(cols)
    ]
    return cols, rows, boxes


def choose_tiles(scores: list[float], k: int, scorer: str = DEFAULT_SCORER) -> tuple[set[int], float, list[int]]:
    """The ``k`` most detailed tiles, flat ones left out: (chosen indexes, the flat floor, all
    indexes by score)."""
    best = max(scores) if scores else 0.0
    floor = max(FLAT_FRACTION * best, FLAT_ABSOLUTE[scorer])
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    return {i for i in order[:k] if scores[i] >= floor}, floor, order


def _plan_fixed(img: LoadedImage, proj: ProjectorInfo, budget: int | None, tiles: str | int, scorer: str) -> ImagePlan:
    w, h = img.width, img.height
    per_view = image_tokens(proj, w, h).n_tokens
    glob = PlannedView("global view" if budget and budget >= 2 * per_view else "image", (0, 0, w, h), (w, h), per_view)
    if tiles == "off" or budget is None or budget < 2 * per_view:
        return ImagePlan("fixed", (w, h), budget, per_view, (glob,))
    k = (budget // per_view) - 1
    if isinstance(tiles, int):
        k = min(k, tiles)
    native = proj.image_size
    if w <= native and h <= native:
        return ImagePlan(
            "fixed", (w, h), budget, per_view, (glob,), notes=("image is not larger than the encoder's view: no tiles",)
        )
    cols, rows, boxes = tile_boxes(w, h, native, k)
    scores = score_boxes(img.rgb, boxes, scorer)
    chosen, floor, order = choose_tiles(scores, k, scorer)
    views = [glob]
    notes = []
    skipped = [i for i in order[:k] if i not in chosen]
    rest = len(boxes) - min(k, len(boxes))
    if skipped or rest:
        notes.append(
            f"the budget holds {min(k, len(boxes))} of {len(boxes)} tiles beside the global view: {len(chosen)} sent"
            + (f", {len(skipped)} skipped as flat (score < {floor:.2f})" if skipped else "")
            + (f"; the other {rest} scored lower" if rest else "")
        )
    for i, box in enumerate(boxes):
        r, c = divmod(i, cols)
        views.append(
            PlannedView(
                f"tile row {r + 1} col {c + 1}",
                box,
                (box[2] - box[0], box[3] - box[1]),
                per_view,
                scores[i],
                i in chosen,
            )
        )
    total = per_view * (1 + len(chosen))
    return ImagePlan("fixed", (w, h), budget, total, tuple(views), (cols, rows), scorer, tuple(notes))


def plan_image(
    img: LoadedImage,
    proj: ProjectorInfo,
    budget: int | None = None,
    tiles: str | int = "auto",
    max_tokens: int | None = None,
    scorer: str = DEFAULT_SCORER,
) -> ImagePlan:
    """The views of ``img`` the model will see, and their exact token cost (≤ budget)."""
    w, h = img.width, img.height
    kind = facts(proj).kind
    if kind == "dynamic":
        return _plan_dynamic(proj, w, h, budget, max_tokens)
    if kind == "tiled":
        return _plan_tiled(proj, w, h, budget)
    return _plan_fixed(img, proj, budget, tiles, scorer)


@dataclass(frozen=True)
class ImageBudget:
    """How a caller plans its pictures: the projector, the per-picture token budget (None: no
    limit), AnyRes tiles for fixed-size encoders, and mtmd's own cap for dynamic ones."""

    proj: ProjectorInfo
    tokens: int | None = None
    tiles: str | int = "auto"
    mtmd_max_tokens: int | None = None
    scorer: str = DEFAULT_SCORER

    def plan(self, img: LoadedImage) -> ImagePlan:
        return plan_image(img, self.proj, self.tokens, self.tiles, self.mtmd_max_tokens, self.scorer)


def render_views(img: LoadedImage, plan: ImagePlan) -> list[tuple[str | None, LoadedImage]]:
    """(label, pixels) per selected view, in the order they go into the prompt. A plain
    single view has no label (the prompt stays as the model's format expects)."""
    out: list[tuple[str | None, LoadedImage]] = []
    sel = plan.selected
    for v in sel:
        label = v.label if len(sel) > 1 else None
        if v.box == (0, 0, img.width, img.height):
            pix = img if v.size == (img.width, img.height) else resized(img, *v.size)
        else:
            x0, y0, x1, y1 = v.box
            pix = from_rgb(img.rgb[y0:y1, x0:x1], f"{img.source} [{v.label}]", img.format)
        out.append((label, pix))
    return out


COMPACT_PIXELS = 2_000_000  # a view larger than this is kept smaller when mtmd's count allows


def compact_view(view: LoadedImage, proj: ProjectorInfo, max_pixels: int = COMPACT_PIXELS) -> LoadedImage:
    """``view``, downscaled to at most ``max_pixels`` when mtmd makes exactly the same chunks,
    tokens and positions of the smaller one (a fixed 336² encoder from a 24-megapixel photo): what
    waits for the encoder then holds a few megabytes instead of the full decode. Otherwise the
    view itself."""
    w, h = view.width, view.height
    if w * h <= max_pixels:
        return view
    scale = math.sqrt(max_pixels / (w * h))
    sw, sh = max(1, int(w * scale)), max(1, int(h * scale))

    def shape(it):
        return it.n_tokens, it.n_pos, it.text_tokens, [(v.nx, v.ny, v.n_tokens, v.n_pos) for v in it.views]

    if shape(image_tokens(proj, w, h)) != shape(image_tokens(proj, sw, sh)):
        return view
    return resized(view, sw, sh)


def draw_overlay(img: LoadedImage, plan: ImagePlan, path: str, max_side: int = 2048) -> None:
    """Draw the grid, each tile's score and the chosen views onto (a copy of) the image."""
    from PIL import Image, ImageDraw, ImageFont

    scale = min(1.0, max_side / max(img.width, img.height))
    canvas = Image.fromarray(img.rgb).convert("RGB")
    if scale < 1.0:
        canvas = canvas.resize((max(1, int(img.width * scale)), max(1, int(img.height * scale))))
    draw = ImageDraw.Draw(canvas, "RGBA")
    lw = max(2, int(min(canvas.size) / 200))
    # given a size, load_default always returns a FreeTypeFont (its bitmap fallback is for size=None)
    font = cast(ImageFont.FreeTypeFont, ImageFont.load_default(size=max(12, min(canvas.size) // 30)))
    for v in plan.views:
        x0, y0, x1, y1 = (int(c * scale) for c in v.box)
        if v.label in ("global view", "image"):
            draw.rectangle([x0, y0, x1 - 1, y1 - 1], outline=(40, 120, 255, 255), width=lw)
            draw.text(
                (x0 + 2 * lw, y1 - 4 * lw - font.size),
                f"{v.label} · {v.tokens} tok",
                fill=(120, 180, 255, 255),
                font=font,
                stroke_width=2,
                stroke_fill=(0, 0, 0, 255),
            )
            continue
        if v.selected:
            draw.rectangle([x0, y0, x1 - 1, y1 - 1], fill=(0, 200, 80, 40), outline=(0, 200, 80, 255), width=lw * 2)
        else:
            draw.rectangle([x0, y0, x1 - 1, y1 - 1], fill=(0, 0, 0, 60), outline=(160, 160, 160, 255), width=lw)
        mark = "* " if v.selected else ""
        draw.text(
            (x0 + 3 * lw, y0 + 3 * lw),
            f"{mark}{v.score:.2f}" if v.score is not None else "",
            fill=(255, 255, 255, 255),
            font=font,
            stroke_width=2,
            stroke_fill=(0, 0, 0, 255),
        )
    draw.text(
        (lw * 3, lw * 3 if plan.grid == (0, 0) else canvas.size[1] // 2),
        f"{plan.kind} · total {plan.total_tokens} tokens" + (f" of {plan.budget}" if plan.budget else ""),
        fill=(255, 255, 0, 255),
        font=font,
        stroke_width=2,
        stroke_fill=(0, 0, 0, 255),
    )
    canvas.save(path)
