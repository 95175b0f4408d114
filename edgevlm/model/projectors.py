"""Projector facts, in one table: what each mtmd projector type does with an image.

For every projector type edgevlm knows: its *kind* (``fixed``: one square view; ``tiled``:
LLaVA-1.6 pinpoints, tiles + an overview; ``dynamic``: the size follows the image, Qwen-VL), its
*positions* (``1d``, or ``mrope``: an image advances the position by max(nx, ny)), whether its
output tokens lie on a spatial *grid* (visual token merging needs one), whether edgevlm's own
token *arithmetic* covers it, and which *encoder graph* the planner replays exactly (else a
conservative bound is used). Every other module asks this table (``facts``); nothing else keeps
a list of projector types.

The arithmetic mirrors the vendored llama.cpp (``tools/mtmd/mtmd-image.cpp``, ``clip.cpp``) so
that it can be decided *before* the encoder runs. Tests compare it with mtmd's own counts
(``mtmd_input_chunk_get_n_tokens`` / ``_n_pos``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from ..errors import UnsupportedModel
from .gguf_info import ProjectorInfo

__all__ = ["encoder_patches", "facts", "image_tokens", "ImageTokens", "largest_image_tokens",
           "position_kind", "ProjectorFacts", "select_best_resolution", "smart_resize", "View",
           "view_patches"]

# mtmd's defaults for Qwen2/2.5-VL (clip.cpp: set_limit_image_tokens(8, 4096)).
QWEN_MIN_TOKENS, QWEN_MAX_TOKENS = 8, 4096


@dataclass(frozen=True)
class ProjectorFacts:
    """What one projector type does with an image (see the module doc)."""

    kind: str  # "fixed" | "tiled" | "dynamic"
    positions: str = "1d"  # "1d" | "mrope"
    grid: bool = True  # output tokens on a 2-D grid (mergeable)
    arithmetic: bool = False  # edgevlm's Python token arithmetic covers it
    encoder_graph: str | None = None  # the clip graph the planner replays exactly (None: a bound)
    merge: int = 1  # spatial merge of the output grid (dynamic: from the GGUF, default 2)
    non_causal: bool = False  # image tokens attend both ways: a chunk must fit one micro-batch

    @property
    def dynamic(self) -> bool:
        return self.kind == "dynamic"


_MLP = ProjectorFacts("fixed", arithmetic=True, encoder_graph="mlp")
PROJECTORS: dict[str, ProjectorFacts] = {
    "mlp": _MLP,
    "mlp_norm": _MLP,
    "ldp": ProjectorFacts("fixed", grid=False),
    "ldpv2": ProjectorFacts("fixed", grid=False),
    "resampler": ProjectorFacts("fixed", grid=False),
    "minicpmv": ProjectorFacts("fixed", grid=False),
    "idefics3": ProjectorFacts("fixed", grid=False),
    "pixtral": ProjectorFacts("dynamic", grid=False),
    "llama4": ProjectorFacts("fixed", grid=False),
    "gemma3": ProjectorFacts("fixed", non_causal=True),
    "internvl": ProjectorFacts("fixed"),
    "qwen2vl_merger": ProjectorFacts("dynamic", "mrope", arithmetic=True,
                                     encoder_graph="qwen2vl_merger", merge=2),
    "qwen2.5vl_merger": ProjectorFacts("dynamic", "mrope", arithmetic=True,
                                       encoder_graph="qwen2.5vl_merger", merge=2),
    "qwen3vl_merger": ProjectorFacts("dynamic", "mrope", merge=2),
}


def facts(proj: ProjectorInfo | str) -> ProjectorFacts:
    """The table's row for a projector (a LLaVA ``mlp`` with pinpoints is ``tiled``); an
    unknown type gets a conservative row: fixed size, 1-D positions, no grid, no arithmetic."""
    ptype = proj if isinstance(proj, str) else proj.projector_type
    row = PROJECTORS.get(ptype, ProjectorFacts("fixed", grid=False))
    if not isinstance(proj, str):
        if row.kind == "fixed" and proj.image_grid_pinpoints and row.arithmetic:
            row = replace(row, kind="tiled")
        if row.dynamic and proj.spatial_merge_size:
            row = replace(row, merge=int(proj.spatial_merge_size))
    return row


def position_kind(projector_type: str) -> str:
    return facts(projector_type).positions


def view_patches(proj: ProjectorInfo) -> int:
    """Patches of one fixed-size view (336/14 → 576): what a fixed or tiled view costs."""
    return (proj.image_size // proj.patch_size) ** 2


def encoder_patches(proj: ProjectorInfo, tokens: int) -> int:
    """Patches the encoder sees for one chunk of ``tokens`` output tokens: a dynamic encoder
    sees merge² patches per token, a fixed one always its whole view."""
    f = facts(proj)
    return tokens * f.merge * f.merge if f.dynamic else view_patches(proj)


def largest_image_tokens(proj: ProjectorInfo, budget: int) -> int:
    """Tokens of the largest image a per-image ``budget`` admits (all chunks)."""
    f = facts(proj)
    if f.dynamic:
        return budget
    per = view_patches(proj)
    if f.kind == "tiled":
        return max(per, min(budget, image_tokens(proj, 10**4, 10**4).n_tokens) // per * per)
    return image_tokens(proj, proj.image_size, proj.image_size).n_tokens


@dataclass(frozen=True)
class View:
    """One image chunk mtmd produces: a resized view of (part of) the image."""

    width: int  # pixels fed to the encoder
    height: int
    nx: int  # output token grid
    ny: int
    n_tokens: int
    n_pos: int


@dataclass(frozen=True)
class ImageTokens:
    """What one image costs: total tokens (KV cells) and positions, split into mtmd chunks."""

    n_tokens: int
    n_pos: int
    views: list[View] = field(default_factory=list)
    text_tokens: int = 0  # text mtmd adds around the image (tile separators), not counted above

    @property
    def n_chunks(self) -> int:
        return len(self.views)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["n_chunks"] = self.n_chunks
        return d


def _f32(x: float) -> np.float32:
    return np.float32(x)


def smart_resize(width: int, height: int, align: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """mtmd's ``calc_size_preserved_ratio`` (Qwen's smart_resize), in float32 like the C++."""
    f = _f32(align)

    def ceil_by(x):
        return int(math.ceil(_f32(x) / f)) * align

    def floor_by(x):
        return int(math.floor(_f32(x) / f)) * align

    w_bar = max(align, _round_half_away(_f32(width) / f) * align)
    h_bar = max(align, _round_half_away(_f32(height) / f) * align)
    if max_pixels > 0 and h_bar * w_bar > max_pixels:
        beta = np.sqrt(_f32(height) * _f32(width) / _f32(max_pixels), dtype=np.float32)
        h_bar = max(align, floor_by(_f32(height) / beta))
        w_bar = max(align, floor_by(_f32(width) / beta))
    elif min_pixels > 0 and h_bar * w_bar < min_pixels:
        beta = np.sqrt(_f32(min_pixels) / (_f32(height) * _f32(width)), dtype=np.float32)
        h_bar = ceil_by(_f32(height) * beta)
        w_bar = ceil_by(_f32(width) * beta)
    return w_bar, h_bar


def _round_half_away(x: np.float32) -> int:
    """C's std::round (half away from zero); numpy rounds half to even."""
    return int(math.floor(float(x) + 0.5)) if x >= 0 else -int(math.floor(-float(x) + 0.5))


def _dynamic_tokens(proj: ProjectorInfo, width: int, height: int,
                    min_tokens: int | None, max_tokens: int | None) -> ImageTokens:
    merge = facts(proj).merge
    align = proj.patch_size * merge
    area = align * align
    lo = (min_tokens if min_tokens and min_tokens > 0 else QWEN_MIN_TOKENS) * area
    hi = (max_tokens if max_tokens and max_tokens > 0 else QWEN_MAX_TOKENS) * area
    w, h = smart_resize(width, height, align, lo, hi)
    nx, ny = w // align, h // align
    view = View(w, h, nx, ny, nx * ny, max(nx, ny))
    # mtmd wraps the image in <|vision_start|> ... <|vision_end|> (one text token each).
    return ImageTokens(view.n_tokens, view.n_pos, [view], text_tokens=2)


def _fixed_tokens(proj: ProjectorInfo) -> ImageTokens:
    side = proj.image_size // proj.patch_size
    view = View(proj.image_size, proj.image_size, side, side, side * side, side * side)
    return ImageTokens(view.n_tokens, view.n_pos, [view])


def select_best_resolution(width: int, height: int, candidates: list[tuple[int, int]]) -> tuple[int, int]:
    """LLaVA-1.6's choice among pinpoints: most effective pixels, then least waste.

    Mirrors ``mtmd_image_preprocessor_llava_uhd::select_best_resolution`` (float32 scale,
    truncating casts, first candidate wins ties).
    """
    best = candidates[0]
    best_eff, best_waste = 0, None
    for cw, ch in candidates:
        scale = min(np.float32(cw) / np.float32(width), np.float32(ch) / np.float32(height))
        tw, th = int(np.float32(width) * scale), int(np.float32(height) * scale)
        eff = min(tw * th, width * height)
        waste = cw * ch - eff
        if eff > best_eff or (eff == best_eff and best_waste is not None and waste < best_waste):
            best, best_eff, best_waste = (cw, ch), eff, waste
    return best


def _tiled_tokens(proj: ProjectorInfo, width: int, height: int) -> ImageTokens:
    """LLaVA-1.6 in mtmd: images larger than one tile become tiles (row-major, each its own
    chunk) followed by the overview; smaller images are the overview alone."""
    ov = _fixed_tokens(proj).views[0]
    size = proj.image_size
    if width <= size and height <= size:
        return ImageTokens(ov.n_tokens, ov.n_pos, [ov])
    cw, ch = select_best_resolution(width, height, proj.image_grid_pinpoints or [])
    views = []
    for y in range(0, ch, size):
        for x in range(0, cw, size):
            views.append(ov)
    views.append(ov)
    return ImageTokens(sum(v.n_tokens for v in views), sum(v.n_pos for v in views), views)


def image_tokens(proj: ProjectorInfo, width: int, height: int,
                 min_tokens: int | None = None, max_tokens: int | None = None) -> ImageTokens:
    """Tokens and positions mtmd will produce for a ``width``×``height`` image."""
    if width <= 0 or height <= 0:
        raise UnsupportedModel(f"an image of {width}x{height} pixels has no tokens (sides must be positive)")
    f = facts(proj)
    if not f.arithmetic:
        raise UnsupportedModel(
            f"{proj.path or 'projector'}: image token counts for projector type "
            f"'{proj.projector_type}' are not known to edgevlm yet")
    if f.dynamic:
        return _dynamic_tokens(proj, width, height, min_tokens, max_tokens)
    if f.kind == "tiled":
        return _tiled_tokens(proj, width, height)
    return _fixed_tokens(proj)
