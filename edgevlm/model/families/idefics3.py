"""SmolVLM / Idefics3 (``idefics3``): tiles of ``image_size`` pixels cut from the image resized so
that its longest edge is ``clip.vision.preproc_image_size``, plus a global view, each tile its own
chunk of (image_size / patch / scale_factor)² tokens (512 / 16 / 4 → 64 for SmolVLM-256M/500M).

Mirrors ``mtmd_image_preprocessor_idefics3`` (``tools/mtmd/mtmd-image.cpp``) and the
``MTMD_SLICE_TMPL_IDEFICS3`` text mtmd inserts (``tools/mtmd/mtmd.cpp``):

- default (a preproc size in the GGUF, no custom token limits): the longest edge becomes exactly
  ``L`` (up- or down-scaled), the other ``(int)(L / aspect)`` (double) rounded up to even; the
  grid is the ceiling of each side over the tile size;
- with ``image_min_tokens`` / ``image_max_tokens`` set in ``mtmd_context_params`` (or an old GGUF
  without the preproc size): ``calc_size_preserved_ratio`` on the tile grid (float32), scaling the
  longest edge to ``L`` first and then clamping the area to ``tokens × (patch × scale)²`` pixels.

Chunks, in order: for each tile ``<fake_token_around_image><row_R_col_C>`` then the tile, ``\\n``
after every row but the last; then ``\\n\\n<fake_token_around_image><global-img>``, the global
view, ``<fake_token_around_image>``. The row/col tokens exist for R, C <= 6 (SmolVLM's tokenizer);
beyond that (only reachable with custom token limits) the text is split by the byte-level BPE:
``<`` ``row`` ``_`` digits ``_`` ``col`` ``_`` digits ``>`` (digits one token each, SmolLM2's
pre-tokenizer).
"""

from __future__ import annotations

import math

import numpy as np

from ..gguf_info import ProjectorInfo
from ..tokens import ImageTokens, View, round_half_away

__all__ = ["grid", "image_tokens", "refined_size", "separator_tokens", "tile_tokens"]

KEY_SCALE = "clip.vision.projector.scale_factor"
KEY_LONGEST = "clip.vision.preproc_image_size"
ROW_COL_TOKENS = 6  # <row_1_col_1> .. <row_6_col_6> in SmolVLM's vocabulary


def _f32(x: float) -> np.float32:
    return np.float32(x)


def scale_factor(proj: ProjectorInfo) -> int:
    return int(proj.meta.get(KEY_SCALE, 1) or 1)


def tile_tokens(proj: ProjectorInfo) -> int:
    """Tokens of one tile (clip_n_output_tokens: patches / scale²)."""
    side = proj.image_size // proj.patch_size
    s = scale_factor(proj)
    return (side * side) // (s * s)


def _calc_size_preserved_ratio(
    width: int, height: int, align: int, min_pixels: int, max_pixels: int, longest_edge: int
) -> tuple[int, int]:
    """mtmd-image.cpp ``img_tool::calc_size_preserved_ratio`` in float32 like the C++."""
    if width <= 0 or height <= 0:
        return 0, 0
    f = _f32(align)

    def round_by(x):
        return round_half_away(_f32(x) / f) * align

    def ceil_by(x):
        return math.ceil(_f32(x) / f) * align

    def floor_by(x):
        return math.floor(_f32(x) / f) * align

    if longest_edge > 0:
        scale = min(_f32(longest_edge) / _f32(width), _f32(longest_edge) / _f32(height))
        w_bar = ceil_by(_f32(width) * scale)
        h_bar = ceil_by(_f32(height) * scale)
    else:
        w_bar = max(align, round_by(width))
        h_bar = max(align, round_by(height))
    if max_pixels > 0 and h_bar * w_bar > max_pixels:
        beta = np.sqrt(_f32(height) * _f32(width) / _f32(max_pixels), dtype=np.float32)
        h_bar = max(align, floor_by(_f32(height) / beta))
        w_bar = max(align, floor_by(_f32(width) / beta))
    elif min_pixels > 0 and h_bar * w_bar < min_pixels:
        beta = np.sqrt(_f32(min_pixels) / (_f32(height) * _f32(width)), dtype=np.float32)
        h_bar = ceil_by(_f32(height) * beta)
        w_bar = ceil_by(_f32(width) * beta)
    return w_bar, h_bar


def refined_size(
    proj: ProjectorInfo, width: int, height: int, min_tokens: int | None = None, max_tokens: int | None = None
) -> tuple[int, int]:
    """Size of the image the tiles are cut from (a multiple of the tile size, or 0)."""
    tile = proj.image_size
    longest = int(proj.meta.get(KEY_LONGEST, 0) or 0)
    # hparams.set_limit_image_tokens(): only custom values set min/max pixels for idefics3
    area = (proj.patch_size * scale_factor(proj)) ** 2
    min_pixels = min_tokens * area if min_tokens and min_tokens > 0 else -1
    max_pixels = max_tokens * area if max_tokens and max_tokens > 0 else -1
    if longest > 0 and min_pixels <= 0 and max_pixels <= 0:
        aspect = width / height  # double
        if width >= height:
            rw = longest
            rh = int(longest / aspect)
            rh += rh % 2
        else:
            rh = longest
            rw = int(longest * aspect)
            rw += rw % 2
        return -(-rw // tile) * tile, -(-rh // tile) * tile
    return _calc_size_preserved_ratio(width, height, tile, max(0, min_pixels), max(0, max_pixels), longest)


def grid(
    proj: ProjectorInfo, width: int, height: int, min_tokens: int | None = None, max_tokens: int | None = None
) -> tuple[int, int]:
    """(columns, rows) of tiles."""
    rw, rh = refined_size(proj, width, height, min_tokens, max_tokens)
    tile = proj.image_size
    return -(-rw // tile), -(-rh // tile)


def _row_col_tokens(r: int, c: int) -> int:
    """Tokens of ``<row_R_col_C>`` (parsed as one special token when the vocabulary has it)."""
    if r <= ROW_COL_TOKENS and c <= ROW_COL_TOKENS:
        return 1
    return 7 + len(str(r)) + len(str(c))  # < row _ R _ col _ C >


def separator_tokens(nx: int, ny: int) -> int:
    """Text tokens mtmd adds for a grid of nx × ny tiles and the global view."""
    n = 4  # "\n\n" <fake_token_around_image> <global-img> ... <fake_token_around_image>
    if nx > 0 and ny > 0:
        n += ny - 1  # "\n" between rows
        for r in range(1, ny + 1):
            for c in range(1, nx + 1):
                n += 1 + _row_col_tokens(r, c)  # <fake_token_around_image><row_r_col_c>
    return n


def image_tokens(
    proj: ProjectorInfo, width: int, height: int, min_tokens: int | None = None, max_tokens: int | None = None
) -> ImageTokens:
    tile = proj.image_size
    side = tile // proj.patch_size // scale_factor(proj)
    per = tile_tokens(proj)
    view = View(tile, tile, side, side, per, per)
    nx, ny = grid(proj, width, height, min_tokens, max_tokens)
    n_tiles = nx * ny if nx > 0 and ny > 0 else 0
    views = [view] * (n_tiles + 1)  # tiles row-major, then the global view
    return ImageTokens(
        per * len(views),
        per * len(views),
        views,
        text_tokens=separator_tokens(nx, ny) if n_tiles else separator_tokens(0, 0),
    )
