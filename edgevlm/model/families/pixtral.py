"""Pixtral and Mistral Small 3.1 (``pixtral``): dynamic resolution with row breaks.

mtmd (``mtmd_image_preprocessor_dyn_size``) resizes the image, aspect kept, onto the grid of
``patch × merge`` pixels (28 px for Mistral Small 3.1: 14-px patches merged 2×2; 16 px for
Pixtral-12B, which has no merger) within ``image_min_tokens``..``image_max_tokens`` merged
tokens (clip.cpp: ``set_limit_image_tokens(8, 1024)``; the GGUF's 1540-px ``image_size`` is not
used). The encoder appends the ``[IMG_BREAK]`` embedding after every row of tokens but the last
(``models/pixtral.cpp``), so a grid of ``nx × ny`` tokens is one chunk of ``nx·ny + ny − 1``
embeddings; positions are 1-D (one per embedding). mtmd then adds the ``[IMG_END]`` text token.
"""

from __future__ import annotations

from ..gguf_info import ProjectorInfo
from ..tokens import ImageTokens, View, smart_resize

__all__ = ["PIXTRAL_MAX_TOKENS", "PIXTRAL_MIN_TOKENS", "grid", "image_tokens"]

# clip.cpp, PROJECTOR_TYPE_PIXTRAL: hparams.set_limit_image_tokens(8, 1024)
PIXTRAL_MIN_TOKENS, PIXTRAL_MAX_TOKENS = 8, 1024


def _merge(proj: ProjectorInfo) -> int:
    # clip.cpp: n_merge = 1, overridden by clip.vision.spatial_merge_size when present
    return int(proj.spatial_merge_size or 1)


def grid(
    proj: ProjectorInfo, width: int, height: int, min_tokens: int | None = None, max_tokens: int | None = None
) -> tuple[int, int, int, int]:
    """(resized width, height, nx, ny): the image as the encoder sees it and its token grid
    (merged tokens, [IMG_BREAK] not counted)."""
    align = proj.patch_size * _merge(proj)
    area = align * align
    lo = (min_tokens if min_tokens and min_tokens > 0 else PIXTRAL_MIN_TOKENS) * area
    hi = (max_tokens if max_tokens and max_tokens > 0 else PIXTRAL_MAX_TOKENS) * area
    w, h = smart_resize(width, height, align, lo, hi)
    return w, h, w // align, h // align


def image_tokens(
    proj: ProjectorInfo, width: int, height: int, min_tokens: int | None = None, max_tokens: int | None = None
) -> ImageTokens:
    w, h, nx, ny = grid(proj, width, height, min_tokens, max_tokens)
    n = nx * ny + ny - 1  # one [IMG_BREAK] per row except the last (clip_n_output_tokens)
    # View.nx/ny: the token grid without the breaks (mtmd itself reports nx = n, ny = 1 for
    # 1-D positions); the chunk holds nx*ny + ny - 1 embeddings.
    view = View(w, h, nx, ny, n, n)
    # mtmd adds "[IMG_END]" (one special token) after the image.
    return ImageTokens(n, n, [view], text_tokens=1)
