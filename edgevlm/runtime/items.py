"""What a prompt is made of, as the KV cache sees it: *items* (a text token, or one mtmd image
chunk with its cells and positions), the *image units* behind image items (mtmd chunks and
their embeddings, encoded once), and the one *image cache* that keeps units for every caller.

The cache is keyed by the picture's content and the budget it is tokenized at: a view's hash
covers its pixels and size (``LoadedImage.sha256``), and mtmd's own image-token limits are part
of the key, so the same pixels sliced differently are never confused.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backend.llama import Backend, Chunks
from ..vision.images import LoadedImage
from ..vision.merge import MergeResult

__all__ = ["ImageCache", "ImageUnit", "Item", "Prompt", "text_items"]


@dataclass(frozen=True)
class Item:
    """One entry of a sequence: ``("t", token)`` or ``("i", unit key, chunk index[, MergeSpec])``."""

    key: tuple
    n_tokens: int  # KV cells
    n_pos: int  # positions it advances (M-RoPE images: max(nx, ny))

    @property
    def is_text(self) -> bool:
        return self.key[0] == "t"

    @property
    def merged(self) -> bool:
        return len(self.key) > 3


def text_items(tokens: Iterable[int]) -> list[Item]:
    return [Item(("t", t), 1, 1) for t in tokens]


class ImageUnit:
    """The mtmd chunks of one picture (as ``<marker>`` tokenizes) and their embeddings."""

    def __init__(self, key: str, chunks: Chunks, transient: bool = False):
        self.key = key
        self.chunks = chunks
        self.transient = transient  # not kept in the cache: closed once its prompt is evaluated
        self.embeddings: dict[int, np.ndarray] = {}
        self.merged: dict[tuple[int, Any], MergeResult] = {}  # (chunk, MergeSpec) → result

    def embedding(self, ci: int, backend: Backend, c: dict[str, Any]) -> np.ndarray:
        """Chunk ``ci``'s embeddings: cached, or encoded now (counted in ``c``: encode_ms,
        encoded, reused)."""
        emb = self.embeddings.get(ci)
        if emb is None:
            t0 = time.perf_counter()
            emb = backend.encode_image(self.chunks[ci])
            c["encode_ms"] += (time.perf_counter() - t0) * 1000
            c["encoded"] += 1
            self.embeddings[ci] = emb
        else:
            c["reused"] += 1
        return emb

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.embeddings.values()) + \
            sum(r.embd.nbytes for r in self.merged.values())

    def close(self) -> None:
        self.chunks.close()
        self.embeddings.clear()
        self.merged.clear()


@dataclass(frozen=True)
class Prompt:
    """A rendered prompt: its items in order and the image units they refer to."""

    items: tuple[Item, ...]
    units: dict[str, ImageUnit]

    @property
    def cells(self) -> int:
        return sum(it.n_tokens for it in self.items)

    @property
    def image_cells(self) -> int:
        return sum(it.n_tokens for it in self.items if not it.is_text)


class ImageCache:
    """LRU of image units shared by every caller of one model, bounded by count and by bytes."""

    def __init__(self, backend: Backend, max_units: int = 32, max_bytes: int = 512 * 2**20):
        self.backend = backend
        self.max_units = max_units
        self.max_bytes = max_bytes
        self.budget_key = f"{backend.image_min_tokens or 0}-{backend.image_max_tokens or 0}"
        self._units: OrderedDict[str, ImageUnit] = OrderedDict()

    def key(self, image: LoadedImage) -> str:
        return f"{image.sha256}@{self.budget_key}"

    def get(self, image: LoadedImage, keep: bool = True) -> ImageUnit:
        """The unit of ``image``: cached, or tokenized now (kept in the cache unless ``keep`` is
        False: a picture that will not be seen again, e.g. in captioning)."""
        key = self.key(image)
        unit = self._units.get(key)
        if unit is not None:
            self._units.move_to_end(key)
            return unit
        bm = self.backend.bitmap_from_rgb(image.rgb, image.sha256[:16])
        try:
            chunks = self.backend.tokenize(self.backend.marker, [bm], add_special=False)
        finally:
            self.backend.free_bitmap(bm)
        unit = ImageUnit(key, chunks, transient=not keep)
        if keep:
            self._units[key] = unit
        return unit

    def trim(self, keep: Iterable[str] = ()) -> None:
        """Evict least-recently-used units beyond the bounds, never those in ``keep``."""
        keep = set(keep)
        while len(self._units) > self.max_units or self.nbytes > self.max_bytes:
            victim = next((k for k in self._units if k not in keep), None)
            if victim is None:
                return
            self._units.pop(victim).close()

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes for u in self._units.values())

    def __len__(self) -> int:
        return len(self._units)

    def clear(self) -> None:
        """Forget every unit (the next use of a picture encodes it again)."""
        for unit in self._units.values():
            unit.close()
        self._units.clear()

    close = clear
