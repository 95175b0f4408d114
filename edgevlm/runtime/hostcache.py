"""Idle conversations' KV cells kept in host RAM: when the scheduler needs the cells of an idle
conversation, its sequence is copied out (``llama_state_seq_get_data``) into this cache before
it is dropped, and a later request that continues it copies it back in (``set_data``) instead
of evaluating its prefix again — its picture included.

Bounded by bytes (``--cache-ram``, planned), least recently used out first; each entry is
matched by the items it holds (the same keys the KV slots are matched by).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from .items import Item
from .requests import Client

__all__ = ["HostKVCache", "Saved"]


@dataclass(eq=False)
class Saved:
    items: tuple[Item, ...]  # what the sequence held, in order
    data: bytes  # llama.cpp's copy of its cells
    owner: Client | None  # the client whose conversation it was

    @property
    def cells(self) -> int:
        return sum(it.n_tokens for it in self.items)

    def lcp(self, items: tuple[Item, ...] | list[Item]) -> int:
        k, n = 0, min(len(self.items), len(items))
        while k < n and self.items[k].key == items[k].key:
            k += 1
        return k


MAX_ENTRIES = 256  # conversations kept at most (each lookup compares the request with all of them)


class HostKVCache:
    """Saved sequences within ``max_bytes`` (0: nothing is kept) and ``MAX_ENTRIES``."""

    def __init__(self, max_bytes: int = 0):
        self.max_bytes = int(max_bytes)
        self._entries: list[Saved] = []
        self._bytes = 0
        self._lock = threading.Lock()
        self.saved = 0  # sequences copied in
        self.restored = 0  # ... and copied back to the KV cache
        self.dropped = 0  # ... dropped to make room for others

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def fits(self, nbytes: int) -> bool:
        return 0 < nbytes <= self.max_bytes

    def put(self, items: tuple[Item, ...], data: bytes, owner: Client | None = None) -> bool:
        """Keep a sequence's cells (dropping the least recently used entries to make room, and
        any entry this one continues: it holds all of that one)."""
        if not self.fits(len(data)):
            return False
        with self._lock:
            for e in [e for e in self._entries if len(e.items) <= len(items) and e.lcp(items) == len(e.items)]:
                self._remove(e)
            while self._entries and (self._bytes + len(data) > self.max_bytes or len(self._entries) >= MAX_ENTRIES):
                self._remove(self._entries[0])  # (kept in the order they came: the oldest first)
                self.dropped += 1
            self._entries.append(Saved(items, data, owner))
            self._bytes += len(data)
            self.saved += 1
            return True

    def _remove(self, entry: Saved) -> None:
        self._entries.remove(entry)
        self._bytes -= len(entry.data)

    def best(self, items: tuple[Item, ...] | list[Item]) -> tuple[Saved | None, int]:
        """The entry sharing the longest prefix with ``items``, and how long it is."""
        with self._lock:
            best, k = None, 0
            for e in self._entries:
                n = e.lcp(items)
                if n > k:
                    best, k = e, n
            return best, k

    def take(self, entry: Saved) -> None:
        """The entry went back into the KV cache: it is resident again."""
        with self._lock:
            if entry in self._entries:
                self._remove(entry)
                self.restored += 1

    def forget(self, owner: Client | None = None) -> None:
        """Drop ``owner``'s entries (None: every entry)."""
        with self._lock:
            self._entries = [e for e in self._entries if owner is not None and e.owner is not owner]
            self._bytes = sum(len(e.data) for e in self._entries)

    def to_dict(self) -> dict[str, int]:
        return {
            "max_bytes": self.max_bytes,
            "bytes": self.nbytes,
            "conversations": len(self._entries),
            "saved": self.saved,
            "restored": self.restored,
            "dropped": self.dropped,
        }
