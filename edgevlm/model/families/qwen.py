"""Qwen2-VL and Qwen2.5-VL (``qwen2vl_merger``, ``qwen2.5vl_merger``): dynamic resolution, the
image resized (aspect kept) onto the grid of patch × merge pixels within mtmd's token limits."""

from __future__ import annotations

from ..gguf_info import ProjectorInfo
from ..tokens import ImageTokens, View, smart_resize

__all__ = ["QWEN_MAX_TOKENS", "QWEN_MIN_TOKENS", "image_tokens"]

# mtmd's defaults for Qwen2/2.5-VL (clip.cpp: set_limit_image_tokens(8, 4096)).
QWEN_MIN_TOKENS, QWEN_MAX_TOKENS = 8, 4096


def image_tokens(
    proj: ProjectorInfo, width: int, height: int, min_tokens: int | None = None, max_tokens: int | None = None
) -> ImageTokens:
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
