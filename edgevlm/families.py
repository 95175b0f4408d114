"""Per-projector facts: how many tokens and positions mtmd makes of an image, position kind.

The arithmetic mirrors the vendored llama.cpp (``tools/mtmd/mtmd-image.cpp``, ``clip.cpp``) so
that it can be decided *before* the encoder runs. Tests compare it with mtmd's own counts
(``mtmd_input_chunk_get_n_tokens`` / ``_n_pos``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from .gguf_info import ProjectorInfo

# Projector types whose decoder uses M-RoPE (an image advances the position by max(nx, ny)).
MROPE_PROJECTORS = {"qwen2vl_merger", "qwen2.5vl_merger", "qwen3vl_merger"}
# mtmd's defaults for Qwen2/2.5-VL (clip.cpp: set_limit_image_tokens(8, 4096)).
QWEN_MIN_TOKENS, QWEN_MAX_TOKENS = 8, 4096


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


def position_kind(projector_type: str) -> str:
    return "mrope" if projector_type in MROPE_PROJECTORS else "1d"


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
    merge = int(proj.spatial_merge_size or 2)
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
        raise ValueError("image sides must be positive")
    ptype = proj.projector_type
    if ptype in ("qwen2vl_merger", "qwen2.5vl_merger"):
        return _dynamic_tokens(proj, width, height, min_tokens, max_tokens)
    if ptype in ("mlp", "mlp_norm") and proj.image_grid_pinpoints:
        return _tiled_tokens(proj, width, height)
    if ptype in ("mlp", "mlp_norm"):
        return _fixed_tokens(proj)
    raise NotImplementedError(f"token arithmetic for projector '{ptype}' is not implemented")
