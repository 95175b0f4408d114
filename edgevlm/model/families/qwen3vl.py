"""Qwen3-VL (``qwen3vl_merger``): dynamic resolution like Qwen2-VL, with 16 px patches merged
2×2 (one token per 32×32 px). mtmd uses the same preprocessor as for Qwen2/2.5-VL
(``mtmd_image_preprocessor_dyn_size``: ``calc_size_preserved_ratio`` onto the patch × merge grid,
bicubic resize) and the same token limits (``clip.cpp``: ``set_limit_image_tokens(8, 4096)``; the
GGUF's ``clip.vision.image_{min,max}_pixels`` keys are not read for this projector), one image
chunk wrapped in ``<|vision_start|>`` … ``<|vision_end|>``, and M-RoPE positions (the text arch
``qwen3vl`` uses interleaved M-RoPE: an image advances the position by max(nx, ny)).

Deepstack does not change the token count: each image token's embedding is just wider
(n_embd × (1 + n_deepstack_layers)).
"""

from __future__ import annotations

from ..gguf_info import ProjectorInfo
from ..tokens import ImageTokens, View, smart_resize

__all__ = ["QWEN3VL_MAX_TOKENS", "QWEN3VL_MIN_TOKENS", "image_tokens"]

# clip.cpp (PROJECTOR_TYPE_QWEN3VL shares the Qwen2-VL branch): set_limit_image_tokens(8, 4096)
QWEN3VL_MIN_TOKENS, QWEN3VL_MAX_TOKENS = 8, 4096


def image_tokens(
    proj: ProjectorInfo, width: int, height: int, min_tokens: int | None = None, max_tokens: int | None = None
) -> ImageTokens:
    merge = int(proj.spatial_merge_size or 2)  # clip.cpp: n_merge = 2 unless the key says so
    align = proj.patch_size * merge
    area = align * align
    lo = (min_tokens if min_tokens and min_tokens > 0 else QWEN3VL_MIN_TOKENS) * area
    hi = (max_tokens if max_tokens and max_tokens > 0 else QWEN3VL_MAX_TOKENS) * area
    w, h = smart_resize(width, height, align, lo, hi)
    nx, ny = w // align, h // align
    view = View(w, h, nx, ny, nx * ny, max(nx, ny))
    # <|vision_start|> and <|vision_end|>: one text token each
    return ImageTokens(view.n_tokens, view.n_pos, [view], text_tokens=2)
