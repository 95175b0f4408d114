"""What an image costs in tokens, as data (``View``, ``ImageTokens``), and the arithmetic helpers
several projector families share (mtmd's float32 resize rule). The families' own arithmetic is
in ``model.families``; ``model.projectors`` says which family a projector type belongs to."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

__all__ = ["ImageTokens", "View", "round_half_away", "smart_resize"]


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


def round_half_away(x: float) -> int:
    """C's std::round (half away from zero); numpy rounds half to even."""
    return int(math.floor(float(x) + 0.5)) if x >= 0 else -int(math.floor(-float(x) + 0.5))


def smart_resize(width: int, height: int, align: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """mtmd's ``calc_size_preserved_ratio`` (Qwen's smart_resize), in float32 like the C++."""
    f = _f32(align)

    def ceil_by(x):
        return int(math.ceil(_f32(x) / f)) * align

    def floor_by(x):
        return int(math.floor(_f32(x) / f)) * align

    w_bar = max(align, round_half_away(_f32(width) / f) * align)
    h_bar = max(align, round_half_away(_f32(height) / f) * align)
    if max_pixels > 0 and h_bar * w_bar > max_pixels:
        beta = np.sqrt(_f32(height) * _f32(width) / _f32(max_pixels), dtype=np.float32)
        h_bar = max(align, floor_by(_f32(height) / beta))
        w_bar = max(align, floor_by(_f32(width) / beta))
    elif min_pixels > 0 and h_bar * w_bar < min_pixels:
        beta = np.sqrt(_f32(min_pixels) / (_f32(height) * _f32(width)), dtype=np.float32)
        h_bar = ceil_by(_f32(height) * beta)
        w_bar = ceil_by(_f32(width) * beta)
    return w_bar, h_bar
