"""Visual token merging after the projector: adjacent patches whose embeddings are nearly equal
(a clear sky, a blank page) become one token, so prefill (quadratic) and the KV cache (linear)
shrink before the language model sees the image.

Spatial agglomerative merging on the token grid: the most similar pair of *adjacent* clusters
(4-neighbourhood, cosine similarity of their size-weighted mean embeddings) is merged first,
until the mode's condition holds:

- ``threshold:T`` — while the best adjacent similarity is ≥ T;
- ``ratio:R`` — until ``ceil(R·n)`` tokens remain;
- ``tokens:N`` — until at most N tokens remain.

Each merged token is the size-weighted mean of its members, so a large flat region keeps its
weight; its position is that of the member nearest the region's centre (M-RoPE keeps that
member's (t, y, x); 1-D RoPE renumbers the survivors contiguously in raster order).
"""

from __future__ import annotations

import heapq
import math
import re
from dataclasses import dataclass

import numpy as np

from ..errors import InputError
from ..model.projectors import facts

__all__ = ["MergeResult", "MergeSpec", "grid_shape", "mergeable", "merge_tokens", "uniform_prune"]


def mergeable(projector_type: str) -> bool:
    """Whether the projector's output tokens lie on a spatial grid (learned resampler queries
    and the like do not: merging neighbours means nothing there)."""
    return facts(projector_type).grid


@dataclass(frozen=True)
class MergeSpec:
    mode: str = "off"  # off | threshold | ratio | tokens | stride (uniform pruning baseline)
    value: float = 0.0

    @classmethod
    def parse(cls, text: str | None) -> MergeSpec:
        if text is None or text == "off":
            return cls()
        m = re.fullmatch(r"(threshold|ratio|tokens|stride):([0-9.]+)", text.strip())
        if not m:
            raise InputError(f"--merge '{text}': use off, threshold:T, ratio:R or tokens:N")
        mode, v = m.group(1), float(m.group(2))
        if mode == "threshold" and not -1.0 <= v <= 1.0:
            raise InputError("--merge threshold:T needs -1 ≤ T ≤ 1 (a cosine similarity)")
        if mode in ("ratio", "stride") and not 0.0 < v <= 1.0:
            raise InputError(f"--merge {mode}:R needs 0 < R ≤ 1")
        if mode == "tokens" and v < 1:
            raise InputError("--merge tokens:N needs N ≥ 1")
        return cls(mode, v)

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    def __str__(self) -> str:
        return "off" if not self.enabled else f"{self.mode}:{self.value:g}"

    def target(self, n: int) -> int | None:
        """Tokens to keep when the count is known before merging (ratio/tokens), else None."""
        if self.mode in ("ratio", "stride"):
            return max(1, math.ceil(self.value * n))
        if self.mode == "tokens":
            return max(1, min(n, int(self.value)))
        if self.mode == "off":
            return n
        return None


@dataclass(frozen=True)
class MergeResult:
    embd: np.ndarray  # (m, d) merged embeddings, in output order
    representative: np.ndarray  # (m,) input index whose position each output token takes
    assignment: np.ndarray  # (n,) output token of every input token (the merge map)
    fidelity: float  # mean cosine of each input token to its representative embedding

    @property
    def n_in(self) -> int:
        return int(self.assignment.shape[0])

    @property
    def n_out(self) -> int:
        return int(self.embd.shape[0])


def grid_shape(n: int, nx: int, ny: int) -> tuple[int, int]:
    """(width, height) of the token grid: mtmd's nx×ny for M-RoPE images, else a square."""
    if nx * ny == n and ny > 1:
        return nx, ny
    side = int(round(math.sqrt(n)))
    if side * side == n:
        return side, side
    return n, 1  # no 2-D layout known: merge along the sequence


def merge_tokens(embd: np.ndarray, width: int, height: int, spec: MergeSpec) -> MergeResult:
    n, d = embd.shape
    if not spec.enabled or n <= 1:
        ident = np.arange(n)
        return MergeResult(embd, ident, ident, 1.0)
    if spec.mode == "stride":  # baseline: keep every k-th token, no averaging
        keep = spec.target(n)
        assert keep is not None  # stride always has a target
        return uniform_prune(embd, keep)
    assert width * height == n, (width, height, n)
    x = embd.astype(np.float64)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    unit = x / np.maximum(norms, 1e-12)
    sums = x.copy()  # raw sums (for the weighted mean)
    usum = unit.copy()  # sums of unit vectors (direction of the cluster)
    size = np.ones(n, dtype=np.int64)
    parent = np.arange(n)
    alive = np.ones(n, dtype=bool)
    nbrs: list[set[int]] = [set() for _ in range(n)]
    for i in range(n):
        cx, cy = i % width, i // width
        if cx + 1 < width:
            nbrs[i].add(i + 1)
            nbrs[i + 1].add(i)
        if cy + 1 < height:
            nbrs[i].add(i + width)
            nbrs[i + width].add(i)
    version = np.zeros(n, dtype=np.int64)
    unorm = np.linalg.norm(usum, axis=1)
    heap = []
    right = np.arange(n)[(np.arange(n) % width) + 1 < width]
    down = np.arange(n - width) if height > 1 else np.array([], dtype=int)
    for a_idx, off in ((right, 1), (down, width)):
        if len(a_idx):
            s_ab = np.sum(unit[a_idx] * unit[a_idx + off], axis=1)
            heap += [(-float(v), int(a), int(a) + off, 0, 0) for a, v in zip(a_idx, s_ab, strict=True)]
    heapq.heapify(heap)
    target = spec.target(n)
    count = n
    while heap:
        if target is not None and count <= target:
            break
        neg, a, b, va, vb = heapq.heappop(heap)
        if not (alive[a] and alive[b]) or version[a] != va or version[b] != vb:
            continue
        if spec.mode == "threshold" and -neg < spec.value:
            break
        if size[b] > size[a]:
            a, b = b, a
        sums[a] += sums[b]
        usum[a] += usum[b]
        size[a] += size[b]
        alive[b] = False
        parent[b] = a
        nbrs[a] |= nbrs[b]
        nbrs[a].discard(a)
        nbrs[a].discard(b)
        for c in nbrs[b]:
            if c != a:
                nbrs[c].discard(b)
                nbrs[c].add(a)
        nbrs[b] = set()
        version[a] += 1
        unorm[a] = np.linalg.norm(usum[a])
        count -= 1
        if spec.mode == "threshold" or count > (target or 0):
            cs = np.fromiter(nbrs[a], dtype=np.int64, count=len(nbrs[a]))
            if len(cs):
                sims = (usum[cs] @ usum[a]) / (unorm[cs] * unorm[a] + 1e-12)
                for c, v in zip(cs.tolist(), sims.tolist(), strict=True):
                    lo, hi = (a, c) if a < c else (c, a)
                    heapq.heappush(heap, (-v, lo, hi, int(version[lo]), int(version[hi])))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    roots = np.array([root(i) for i in range(n)])
    members: dict[int, list[int]] = {}
    for i, r in enumerate(roots):
        members.setdefault(int(r), []).append(i)
    reps = []
    for r, mem in members.items():
        mx = np.array([i % width for i in mem], dtype=np.float64)
        my = np.array([i // width for i in mem], dtype=np.float64)
        dist = (mx - mx.mean()) ** 2 + (my - my.mean()) ** 2
        reps.append((mem[int(np.argmin(dist))], r))
    reps.sort()  # raster order of the representatives
    out_index = {r: k for k, (_, r) in enumerate(reps)}
    assignment = np.array([out_index[int(r)] for r in roots])
    merged = np.stack([sums[r] / size[r] for _, r in reps]).astype(np.float32)
    rep_idx = np.array([i for i, _ in reps])
    mu = merged / np.maximum(np.linalg.norm(merged, axis=1, keepdims=True), 1e-12)
    fidelity = float(np.mean(np.sum(unit * mu[assignment], axis=1)))
    return MergeResult(merged, rep_idx, assignment, fidelity)


def uniform_prune(embd: np.ndarray, keep: int) -> MergeResult:
    """Baseline: keep every k-th token (uniform stride), no averaging."""
    n = embd.shape[0]
    idx = np.unique(np.linspace(0, n - 1, num=max(1, keep)).round().astype(int))
    assignment = np.searchsorted(idx, np.arange(n), side="right") - 1
    assignment = np.clip(assignment, 0, len(idx) - 1)
    unit = embd / np.maximum(np.linalg.norm(embd, axis=1, keepdims=True), 1e-12)
    kept = unit[idx]
    fidelity = float(np.mean(np.sum(unit * kept[assignment], axis=1)))
    return MergeResult(embd[idx], idx, assignment, fidelity)
