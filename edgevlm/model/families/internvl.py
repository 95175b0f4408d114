"""InternVL 2.5 / 3 (``internvl``): dynamic tiling into ``image_size`` (448) tiles plus a
thumbnail, each tile pixel-shuffled to (448/14/2)² = 256 tokens.

mtmd (``mtmd_image_preprocessor_internvl`` on top of the LLaVA-UHD slicer): an image that fits in
one tile (both sides <= image_size) is the thumbnail alone; a larger one is resized to the best
of the tile grids ``a×b`` with ``min_tiles <= a·b <= max_tiles`` (``clip.vision.preproc_{min,max}
_tiles``, default 1 and 12; ``set_internvl_dhr_res_candidates``) chosen by LLaVA-1.6's rule
(``select_best_resolution``: most effective pixels, then least waste, float32 scale), cut into
its ``a·b`` tiles, row-major, each its own chunk, followed by the thumbnail (``ov_img_first =
false``). The whole image is wrapped in ``<img>`` ... ``</img>`` (one text token each in
InternVL's vocabulary); no text between tiles. ``image_min/max_tokens`` do not apply.
"""

from __future__ import annotations

import numpy as np

from ..gguf_info import ProjectorInfo
from ..tokens import ImageTokens, View

__all__ = ["candidates", "image_tokens", "select_best_resolution", "tile_grid"]

_INT_MAX = 2**31 - 1


def _meta_int(proj: ProjectorInfo, key: str, default: int) -> int:
    v = (proj.meta or {}).get(key)
    return int(v) if v is not None else default


def candidates(proj: ProjectorInfo) -> list[tuple[int, int]]:
    """clip.cpp ``set_internvl_dhr_res_candidates``: (width, height) of every a×b tile grid."""
    size = proj.image_size
    lo = _meta_int(proj, "clip.vision.preproc_min_tiles", 1)
    hi = _meta_int(proj, "clip.vision.preproc_max_tiles", 12)
    out: list[tuple[int, int]] = []
    if lo < 1:
        return out
    for a in range(lo, hi + 1):
        b_lo = max((lo + a - 1) // a, lo)
        b_hi = min(hi // a, hi)
        for b in range(b_lo, b_hi + 1):
            out.append((a * size, b * size))
    return out


def select_best_resolution(width: int, height: int, cands: list[tuple[int, int]]) -> tuple[int, int]:
    """``mtmd_image_preprocessor_llava_uhd::select_best_resolution`` to the letter (float32
    scale, truncating casts, strict comparisons, waste compared from INT_MAX)."""
    best = (0, 0)
    min_waste, max_eff = _INT_MAX, 0
    w32, h32 = np.float32(width), np.float32(height)
    for cw, ch in cands:
        scale = min(np.float32(cw) / w32, np.float32(ch) / h32)
        tw, th = int(w32 * scale), int(h32 * scale)
        eff = min(tw * th, width * height)
        waste = cw * ch - eff
        if eff > max_eff or (eff == max_eff and waste < min_waste):
            max_eff, min_waste, best = eff, waste, (cw, ch)
    return best


def tile_grid(proj: ProjectorInfo, width: int, height: int) -> tuple[int, int]:
    """(columns, rows) of tiles mtmd cuts (0, 0: the thumbnail alone)."""
    size = proj.image_size
    if width <= size and height <= size:
        return 0, 0
    cw, ch = select_best_resolution(width, height, candidates(proj))
    return cw // size, ch // size


def image_tokens(
    proj: ProjectorInfo, width: int, height: int, min_tokens: int | None = None, max_tokens: int | None = None
) -> ImageTokens:
    size, patch = proj.image_size, proj.patch_size
    merge = _meta_int(proj, "clip.vision.projector.scale_factor", 1)  # clip's n_merge default
    side = size // patch
    n = (side * side) // (merge * merge)  # clip_n_output_tokens for one 448² view
    g = side // merge
    view = View(size, size, g, g, n, n)
    nx, ny = tile_grid(proj, width, height)
    views = [view] * (nx * ny) + [view]  # tiles row-major, then the thumbnail
    return ImageTokens(n * len(views), n * len(views), views, text_tokens=2)  # <img> ... </img>
