"""Gemma 3 (``gemma3``): one fixed view. mtmd's ``mtmd_image_preprocessor_fixed_size`` resizes any
image (bilinear, aspect not kept) to image_size² (896²); SigLIP makes (896/14)² = 64×64 patches,
average-pooled n_merge×n_merge (clip.cpp's default 4, or ``clip.vision.projector.scale_factor``)
into a 16×16 grid: 256 tokens, 1-D positions (n_pos = n_tokens), attended non-causally.
mtmd wraps the chunk in ``<start_of_image>`` … ``<end_of_image>`` (one text token each)."""

from __future__ import annotations

from ..gguf_info import ProjectorInfo
from ..tokens import ImageTokens, View

__all__ = ["image_tokens"]

GEMMA3_POOL = 4  # clip.cpp: hparams.n_merge for PROJECTOR_TYPE_GEMMA3


def image_tokens(
    proj: ProjectorInfo, width: int, height: int, min_tokens: int | None = None, max_tokens: int | None = None
) -> ImageTokens:
    """Always the same: the size, min_tokens and max_tokens do not change a fixed view."""
    merge = int(proj.meta.get("clip.vision.projector.scale_factor") or GEMMA3_POOL)
    patches = proj.image_size // proj.patch_size
    side = patches // merge  # the pool's output grid
    n = patches * patches // (merge * merge)  # clip_n_output_tokens
    view = View(proj.image_size, proj.image_size, side, side, n, n)
    return ImageTokens(n, n, [view], text_tokens=2)
