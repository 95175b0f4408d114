"""A picture on its way into the KV cache: its embedding rows (merged, when the request merges
tokens), their positions (M-RoPE as mtmd counts them), and what they add to the request's stats
once fed. The scheduler feeds a slice of rows per step."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backend.llama import Backend
from ..vision.merge import grid_shape, merge_tokens
from .items import ImageUnit, Item

__all__ = ["Feed", "make_feed"]


@dataclass
class Feed:
    """A picture chunk on its way into the KV cache, a slice of rows per step."""

    rows: np.ndarray  # embeddings to feed (merged ones, when merging)
    positions: np.ndarray  # (n,) or (n, 4) M-RoPE positions
    non_causal: bool
    final: Item  # the item as it will stand in the KV cache
    counters: dict[str, int]  # what it adds to the request's stats once fed
    done: int = 0

    @property
    def left(self) -> int:
        return len(self.rows) - self.done


def make_feed(be: Backend, pos: int, it: Item, unit: ImageUnit, emb: np.ndarray, new_images: frozenset[str]) -> Feed:
    """The feed of picture item ``it`` (its chunk's embeddings ``emb``) at position ``pos``;
    ``new_images``: the request's pictures that are new in this turn (they count in its stats)."""
    chunk = unit.chunk(it.key[2])
    if not it.merged:
        rows = range(chunk.n_tokens)
        positions = be.image_positions(chunk, pos, rows) if be.use_mrope else pos + np.arange(chunk.n_tokens)
        counts = {"image_tokens_in": it.n_tokens, "image_tokens_out": it.n_tokens}
        if chunk.kind == "audio":
            counts["audio_tokens_in"] = it.n_tokens
        return Feed(emb, positions, be.non_causal and chunk.kind == "image", it, counts)
    ci, spec = it.key[2], it.key[3]
    res = unit.merged.get((ci, spec))
    if res is None:
        w, h = grid_shape(chunk.n_tokens, chunk.nx, chunk.ny)
        res = merge_tokens(emb, w, h, spec)
        unit.merged[(ci, spec)] = res
    if be.use_mrope:
        positions = be.image_positions(chunk, pos, res.representative)
    else:
        positions = pos + np.arange(res.n_out)
    final = Item(it.key, res.n_out, it.n_pos if be.use_mrope else res.n_out)
    counters = {"image_tokens_in": res.n_in, "image_tokens_out": res.n_out, "merge_map_size": res.n_in}
    if it.key[1] in new_images:
        counters["image_tokens"] = res.n_out - it.n_tokens
    return Feed(res.embd, positions, be.non_causal, final, counters)
