"""What a prompt is made of, as the KV cache sees it: *items* (a text token, or one mtmd image
chunk with its cells and positions), the *image units* behind image items (mtmd chunks and
their embeddings, encoded once), and the one *image cache* that keeps units for every caller.

The cache is keyed by the picture's content and the budget it is tokenized at: a view's hash
covers its pixels and size (``LoadedImage.sha256``), and mtmd's own image-token limits are part
of the key, so the same pixels sliced differently are never confused.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backend.llama import Backend, Chunk, Chunks
from ..errors import BackendError
from ..vision.images import LoadedImage
from ..vision.merge import MergeResult

__all__ = ["ImageCache", "ImageUnit", "Item", "Prompt", "shared_prefix", "text_items"]


@dataclass(frozen=True)
class Item:
    """One entry of a sequence: ``("t", token)`` or ``("i", unit key, chunk index[, MergeSpec])``."""

    key: tuple[Any, ...]  # its elements read by position, as the forms above say (text or image)
    n_tokens: int  # KV cells
    n_pos: int  # positions it advances (M-RoPE images: max(nx, ny))

    @property
    def is_text(self) -> bool:
        return bool(self.key[0] == "t")

    @property
    def merged(self) -> bool:
        return len(self.key) > 3


def shared_prefix(a: Sequence[Item], b: Sequence[Item]) -> int:
    """How many first items ``a`` and ``b`` have in common (by key)."""
    k, n = 0, min(len(a), len(b))
    while k < n and a[k].key == b[k].key:
        k += 1
    return k


def text_items(tokens: Iterable[int]) -> list[Item]:
    return [Item(("t", t), 1, 1) for t in tokens]


class ImageUnit:
    """The mtmd chunks of one picture (as ``<marker>`` tokenizes) and their embeddings.

    A unit stays alive while any rendered prompt refers to it (its *holders*: prompts register
    when rendered and let go once evaluated, or when they are dropped). The cache retires a unit
    it evicts; a retired unit is closed — its mtmd chunks freed — only when no prompt holds it.
    A closed unit raises instead of handing out freed memory."""

    def __init__(self, key: str, chunks: Chunks, cached: bool = True):
        self.key = key
        self.chunks = chunks
        self.cached = cached  # in the image cache; False: closed once no prompt holds it
        self.embeddings: dict[int, np.ndarray] = {}
        self.merged: dict[tuple[int, Any], MergeResult] = {}  # (chunk, MergeSpec) → result
        self.encode_ms: dict[int, float] = {}  # how long each chunk took to encode
        self.errors: dict[int, BaseException] = {}  # chunks the encoder failed on
        self.closed = False
        self.lock = threading.Lock()  # held while the encoder uses the chunks, and by close()
        self._holders: weakref.WeakSet[Prompt] = weakref.WeakSet()

    # --- who refers to it --------------------------------------------------------------------
    def hold(self, prompt: Prompt) -> None:
        self.check()
        self._holders.add(prompt)

    def release(self, prompt: Prompt) -> None:
        self._holders.discard(prompt)
        if not self.cached and not self._holders:
            self.close()

    @property
    def held(self) -> bool:
        return len(self._holders) > 0

    def check(self) -> None:
        if self.closed:
            raise BackendError(f"internal: image unit {self.key[:16]} was used after it was closed")

    # --- what it holds -----------------------------------------------------------------------
    def chunk(self, ci: int) -> Chunk:
        """Chunk ``ci`` (its mtmd handle valid: the unit is open)."""
        self.check()
        return self.chunks[ci]

    def embedding(self, ci: int, backend: Backend, c: dict[str, Any]) -> np.ndarray:
        """Chunk ``ci``'s embeddings: cached, or encoded now (counted in ``c``: encode_ms,
        encoded, reused)."""
        self.check()
        emb = self.embeddings.get(ci)
        if emb is None:
            emb = self.encode(ci, backend)
            c["encode_ms"] += self.encode_ms[ci]
            c["encoded"] += 1
        else:
            c["reused"] += 1
        return emb

    def encode(self, ci: int, backend: Backend) -> np.ndarray:
        """Run the vision encoder on chunk ``ci`` now (any thread: the unit stays open
        meanwhile) and keep its embeddings."""
        with self.lock:
            self.check()
            emb = self.embeddings.get(ci)
            if emb is None:
                t0 = time.perf_counter()
                emb = backend.encode_image(self.chunks[ci])
                self.encode_ms[ci] = (time.perf_counter() - t0) * 1000
                self.embeddings[ci] = emb
            return emb

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.embeddings.values()) + sum(r.embd.nbytes for r in self.merged.values())

    def close(self) -> None:
        with self.lock:  # (never while an encode is inside one of its chunks)
            self.closed = True
            self.chunks.close()
            self.embeddings.clear()
            self.merged.clear()


@dataclass(frozen=True, eq=False)
class Prompt:
    """A rendered prompt: its items in order and the image units they refer to (held from
    when it is made until ``release()``: once evaluated, or when it is dropped)."""

    items: tuple[Item, ...]
    units: dict[str, ImageUnit]

    def __post_init__(self) -> None:
        for unit in self.units.values():
            unit.hold(self)

    def release(self) -> None:
        """Let go of the image units (evaluated or dropped: their chunks are no longer needed
        by this prompt). Idempotent."""
        for unit in self.units.values():
            unit.release(self)

    @property
    def cells(self) -> int:
        return sum(it.n_tokens for it in self.items)

    @property
    def image_cells(self) -> int:
        return sum(it.n_tokens for it in self.items if not it.is_text)

    def audio_cells(self, units: frozenset[str] | None = None) -> int:
        """The cells its recordings' pieces take (only those of ``units``, when given)."""
        return sum(
            it.n_tokens
            for it in self.items
            if not it.is_text
            and (units is None or it.key[1] in units)
            and self.units[it.key[1]].chunks[it.key[2]].kind == "audio"
        )


class ImageCache:
    """LRU of image units shared by every caller of one model, bounded by count and by bytes.
    Evicted units that rendered prompts still hold are retired, and closed once released."""

    def __init__(self, backend: Backend, max_units: int = 32, max_bytes: int = 512 * 2**20):
        self.backend = backend
        self.max_units = max_units
        self.max_bytes = max_bytes
        self.budget_key = backend.image_budget
        self._units: OrderedDict[str, ImageUnit] = OrderedDict()
        self._retired: list[ImageUnit] = []  # out of the cache, not closed yet (held, or transient)
        self._lock = threading.RLock()

    def key(self, image: Any) -> str:
        return f"{image.sha256}@{self.budget_key}"

    def get(self, image: Any, keep: bool = True) -> ImageUnit:
        """The unit of ``image``: cached, or tokenized now (kept in the cache unless ``keep`` is
        False: a picture that will not be seen again, e.g. in captioning)."""
        key = self.key(image)
        with self._lock:
            unit = self._units.get(key)
            if unit is not None and unit.closed:  # (closed by force: made again below)
                del self._units[key]
            elif unit is not None:
                self._units.move_to_end(key)
                return unit
        if isinstance(image, LoadedImage):
            bm = self.backend.bitmap_from_rgb(image.rgb, image.sha256[:16])
        else:  # a recording's piece (``audio.AudioPiece``): its samples
            bm = self.backend.bitmap_from_audio(image.samples, image.sha256[:16])
        try:
            chunks = self.backend.tokenize(self.backend.marker, [bm], add_special=False)
        finally:
            self.backend.free_bitmap(bm)
        unit = ImageUnit(key, chunks, cached=keep)
        with self._lock:
            if keep:
                self._units[key] = unit
            else:
                self._retired.append(unit)
        return unit

    def trim(self, keep: Iterable[str] = ()) -> None:
        """Evict least-recently-used units beyond the bounds, never those in ``keep``; close
        the retired units no prompt holds any more."""
        keep = set(keep)
        with self._lock:
            while len(self._units) > self.max_units or self.nbytes > self.max_bytes:
                victim = next((k for k in self._units if k not in keep), None)
                if victim is None:
                    break
                unit = self._units.pop(victim)
                unit.cached = False
                self._retired.append(unit)
            still = []
            for unit in self._retired:
                if unit.held:
                    still.append(unit)
                elif not unit.closed:
                    unit.close()
            self._retired = still

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes for u in self._units.values())

    @property
    def retired(self) -> int:
        """Units out of the cache that prompts still hold."""
        return sum(1 for u in self._retired if not u.closed)

    def __len__(self) -> int:
        return len(self._units)

    def clear(self) -> None:
        """Forget every unit no prompt holds (the next use of a picture encodes it again);
        held ones are retired and closed once released."""
        with self._lock:
            for unit in self._units.values():
                unit.cached = False
                self._retired.append(unit)
            self._units.clear()
        self.trim()

    def close(self) -> None:
        """Close every unit, held or not (the model is going away)."""
        with self._lock:
            for unit in list(self._units.values()) + self._retired:
                unit.close()
            self._units.clear()
            self._retired = []
