"""LLaVA's projectors: one fixed square view (LLaVA-1.5 ``mlp``), or LLaVA-1.6's pinpoint
tiles plus an overview (``mlp`` with ``image_grid_pinpoints``)."""

from __future__ import annotations

import numpy as np

from ..gguf_info import ProjectorInfo
from ..tokens import ImageTokens, View

__all__ = ["fixed_tokens", "image_tokens", "select_best_resolution"]


def fixed_tokens(proj: ProjectorInfo) -> ImageTokens:
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


def tiled_tokens(proj: ProjectorInfo, width: int, height: int) -> ImageTokens:
    """LLaVA-1.6 in mtmd: images larger than one tile become tiles (row-major, each its own
    chunk) followed by the overview; smaller images are the overview alone."""
    ov = fixed_tokens(proj).views[0]
    size = proj.image_size
    if width <= size and height <= size:
        return ImageTokens(ov.n_tokens, ov.n_pos, [ov])
    cw, ch = select_best_resolution(width, height, proj.image_grid_pinpoints or [])
    views = []
    for _y in range(0, ch, size):
        for _x in range(0, cw, size):
            views.append(ov)
    views.append(ov)
    return ImageTokens(sum(v.n_tokens for v in views), sum(v.n_pos for v in views), views)


def image_tokens(
    proj: ProjectorInfo, width: int, height: int, min_tokens: int | None = None, max_tokens: int | None = None
) -> ImageTokens:
    if proj.image_grid_pinpoints:
        return tiled_tokens(proj, width, height)
    return fixed_tokens(proj)
