"""Cheap detail scores for image regions, computed on a low-resolution copy.

Three scorers, measured against each other by the test suite on synthetic images whose detailed
region is known (``tests/test_budget.py``) and by ``scripts/bench_budget.py``:

- ``edges``: mean gradient magnitude (Sobel-like differences) — text, texture, outlines;
- ``entropy``: Shannon entropy of the grey-level histogram — variety of tones;
- ``compress``: zlib bytes per pixel of the grey tile — what a codec finds hard to predict.

All are deterministic and return one float per box; higher means more detail.
"""

from __future__ import annotations

import zlib

import numpy as np
from PIL import Image

from ..errors import InputError

__all__ = ["DEFAULT_SCORER", "LOWRES_SIDE", "SCORERS", "grey_lowres", "score_boxes"]

SCORERS = ("edges", "entropy", "compress")
DEFAULT_SCORER = "edges"
LOWRES_SIDE = 768  # longest side of the copy the scores are computed on


def grey_lowres(rgb: np.ndarray, side: int = LOWRES_SIDE) -> tuple[np.ndarray, float]:
    """A float32 grey copy whose longest side is at most ``side``, and its scale factor."""
    h, w = rgb.shape[:2]
    scale = min(1.0, side / max(w, h))
    img = Image.fromarray(rgb).convert("L")
    if scale < 1.0:
        img = img.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.BOX)
    return np.asarray(img, dtype=np.float32), scale


def _edges(g: np.ndarray) -> float:
    if g.shape[0] < 2 or g.shape[1] < 2:
        return 0.0
    gx = np.abs(np.diff(g, axis=1))
    gy = np.abs(np.diff(g, axis=0))
    return float(gx.mean() + gy.mean())


def _entropy(g: np.ndarray) -> float:
    hist = np.bincount(g.astype(np.uint8).ravel(), minlength=256).astype(np.float64)
    p = hist[hist > 0] / hist.sum()
    return float(-(p * np.log2(p)).sum())


def _compress(g: np.ndarray) -> float:
    data = g.astype(np.uint8).tobytes()
    return len(zlib.compress(data, 6)) / max(1, len(data))


_FUNCS = {"edges": _edges, "entropy": _entropy, "compress": _compress}


def score_boxes(rgb: np.ndarray, boxes: list[tuple[int, int, int, int]], scorer: str = DEFAULT_SCORER) -> list[float]:
    """Detail score of each ``(x0, y0, x1, y1)`` box (source pixels)."""
    if scorer not in _FUNCS:
        raise InputError(f"unknown scorer '{scorer}' (choose from {', '.join(SCORERS)})")
    g, s = grey_lowres(rgb)
    fn = _FUNCS[scorer]
    out = []
    for x0, y0, x1, y1 in boxes:
        a = g[
            int(y0 * s) : max(int(y0 * s) + 1, int(round(y1 * s))),
            int(x0 * s) : max(int(x0 * s) + 1, int(round(x1 * s))),
        ]
        out.append(round(fn(a), 6))
    return out
