"""What a video frame costs at a size (memoised ``projectors.image_tokens``), the largest size that
keeps a frame within a cost, and a clip's default budget — the arithmetic ``video.plan_video``
searches with."""

from __future__ import annotations

import math
from typing import Any

from ..model.gguf_info import ProjectorInfo
from ..model.projectors import DEFAULT_DYNAMIC_IMAGE_TOKENS, facts, image_tokens, largest_image_tokens, view_tokens
from .budget import fit_size

__all__ = [
    "DEFAULT_VIDEO_PICTURES",
    "FrameCosts",
    "aspect_kept",
    "best_size",
    "compact_size",
    "default_video_tokens",
    "per_picture",
]

DEFAULT_VIDEO_PICTURES = 8  # no budget and no room known: a clip gets 8 pictures' worth of tokens


class FrameCosts:
    """Token counts for frame sizes (memoised: the searches ask many). ``tokens`` is what a frame
    takes of the context: its image tokens, the text mtmd puts around it and ``overhead`` (the
    timestamp label and the newline the prompt writes beside it); ``image`` its image tokens."""

    def __init__(self, proj: ProjectorInfo, mtmd_max_tokens: int | None, overhead: int = 0):
        self.proj = proj
        self.cap = mtmd_max_tokens
        self.overhead = overhead
        self._memo: dict[tuple[int, int], Any] = {}

    def of(self, w: int, h: int) -> Any:
        key = (w, h)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = image_tokens(self.proj, w, h, max_tokens=self.cap)
        return hit

    def tokens(self, w: int, h: int) -> int:
        it = self.of(w, h)
        return int(it.n_tokens + it.text_tokens + self.overhead)

    def image(self, w: int, h: int) -> int:
        return int(self.of(w, h).n_tokens)

    def shape(self, w: int, h: int) -> tuple:
        it = self.of(w, h)
        return it.n_tokens, it.n_pos, it.text_tokens, [(v.nx, v.ny, v.n_tokens, v.n_pos) for v in it.views]


def compact_size(costs: FrameCosts, w: int, h: int, max_pixels: int) -> tuple[int, int]:
    """(w, h) downscaled to ``max_pixels`` when mtmd makes exactly the same chunks of it."""
    if w * h <= max_pixels:
        return w, h
    s = math.sqrt(max_pixels / (w * h))
    sw, sh = max(1, int(w * s)), max(1, int(h * s))
    return (sw, sh) if costs.shape(w, h) == costs.shape(sw, sh) else (w, h)


def default_video_tokens(proj: ProjectorInfo, image_budget_tokens: int | None = None) -> int:
    """A clip's budget when neither a budget nor the room is known: ``DEFAULT_VIDEO_PICTURES``
    pictures at the per-picture budget (the plan's, else the projector's default)."""
    return DEFAULT_VIDEO_PICTURES * per_picture(proj, image_budget_tokens)


def per_picture(proj: ProjectorInfo, image_budget_tokens: int | None) -> int:
    """The per-picture budget: the one given (the plan's), else the projector's default — as
    ``plan.planner.image_budget`` gives it with no --image-tokens."""
    if image_budget_tokens:
        return int(image_budget_tokens)
    f = facts(proj)
    if f.dynamic:
        return DEFAULT_DYNAMIC_IMAGE_TOKENS
    return largest_image_tokens(proj, 10**6) if f.kind == "tiled" else view_tokens(proj)


def aspect_kept(w: int, h: int, a: int, b: int) -> bool:
    """a×b keeps w×h's aspect within 10% (tiny sizes round it away)."""
    return abs(a * h - b * w) <= 0.1 * b * w


def best_size(costs: FrameCosts, w: int, h: int, limit: int, per_frame: int) -> tuple[int, int] | None:
    """The largest size, aspect kept and never upscaled, whose chunk costs ≤ ``limit`` and the
    per-picture budget; None when not even the smallest does."""
    return fit_size(
        w, h, lambda a, b: aspect_kept(w, h, a, b) and costs.tokens(a, b) <= limit and costs.image(a, b) <= per_frame
    )
