"""Idle conversations' KV cells kept in host RAM: when the scheduler needs the cells of an idle
conversation, its sequence is copied out (``llama_state_seq_get_data``) into this cache before
it is dropped, and a later request that continues it copies it back in (``set_data``) instead
of evaluating its prefix again — its picture included.

Bounded by bytes (``--cache-ram``, planned), least recently used out first; each entry is
matched by the items it holds (the same keys the KV slots are matched by). With a disk tier
(``--cache-dir``, ``disktier``) what leaves RAM goes to disk instead of being dropped, and a
lookup finds the longest prefix in either tier.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from ..backend.llama import Backend
from .disktier import DiskEntry, DiskTier
from .items import Item, shared_prefix
from .requests import Client
from .saved import binding_of
from .sched_options import SchedulerOptions

__all__ = ["HostKVCache", "Saved", "make_host_cache"]


@dataclass(eq=False)
class Saved:
    items: tuple[Item, ...]  # what the sequence held, in order
    data: bytes  # llama.cpp's copy of its cells (b"" for an entry on disk: ``HostKVCache.data``)
    owner: Client | None  # the client whose conversation it was
    disk: DiskEntry | None = None  # an entry of the disk tier

    @property
    def source(self) -> str:
        return "disk" if self.disk is not None else "host"

    @property
    def cells(self) -> int:
        return sum(it.n_tokens for it in self.items)

    def lcp(self, items: tuple[Item, ...] | list[Item]) -> int:
        return shared_prefix(self.items, items)


MAX_ENTRIES = 256  # conversations kept at most (each lookup compares the request with all of them)


class HostKVCache:
    """Saved sequences within ``max_bytes`` (0: nothing is kept) and ``MAX_ENTRIES``."""

    def __init__(self, max_bytes: int = 0, disk: DiskTier | None = None):
        self.max_bytes = int(max_bytes)
        self.disk = disk
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

    @property
    def keeps(self) -> bool:
        """Whether anything is kept (RAM or disk)."""
        return self.max_bytes > 0 or self.disk is not None

    @property
    def largest(self) -> int:
        """The largest sequence a tier takes."""
        return max(self.max_bytes, self.disk.max_bytes if self.disk is not None else 0)

    def put(self, items: tuple[Item, ...], data: bytes, owner: Client | None = None) -> bool:
        """Keep a sequence's cells (moving the least recently used entries out to make room —
        to disk when there is a disk tier —, and dropping any entry this one continues: it
        holds all of that one)."""
        if not self.fits(len(data)):
            return self.disk is not None and self.disk.put(items, data, wait_s=0.0)  # (the step loop never waits)
        leaving = []
        with self._lock:
            for e in [e for e in self._entries if len(e.items) <= len(items) and e.lcp(items) == len(e.items)]:
                self._remove(e)
            while self._entries and (self._bytes + len(data) > self.max_bytes or len(self._entries) >= MAX_ENTRIES):
                e = self._entries[0]  # (kept in the order they came: the oldest first)
                self._remove(e)
                leaving.append(e)
            self._entries.append(Saved(items, data, owner))
            self._bytes += len(data)
            self.saved += 1
        for e in leaving:
            if self.disk is None or not self.disk.put(e.items, e.data, wait_s=0.0):
                self.dropped += 1
        return True

    def data(self, entry: Saved) -> bytes | memoryview | None:
        """An entry's cells: in RAM, or read back from disk (None: the file could not be read)."""
        return self.disk.data(entry.disk) if entry.disk is not None and self.disk is not None else entry.data

    def entries(self) -> list[Saved]:
        """The entries in RAM (oldest first)."""
        with self._lock:
            return list(self._entries)

    def _remove(self, entry: Saved) -> None:
        self._entries.remove(entry)
        self._bytes -= len(entry.data)

    def best(self, items: tuple[Item, ...] | list[Item]) -> tuple[Saved | None, int]:
        """The entry sharing the longest prefix with ``items`` (in RAM, else on disk when that
        holds a longer one), and how long it is."""
        with self._lock:
            best, k = None, 0
            for e in self._entries:
                n = e.lcp(items)
                if n > k:
                    best, k = e, n
        if self.disk is not None:
            on_disk, dk = self.disk.best(items)
            if on_disk is not None and dk > k:
                return Saved(on_disk.items, b"", None, on_disk), dk
        return best, k

    def take(self, entry: Saved) -> None:
        """The entry went back into the KV cache: it is resident again."""
        with self._lock:
            if entry.disk is not None:
                self.restored += 1  # (its file stays: a later save of the conversation supersedes it)
            elif entry in self._entries:
                self._remove(entry)
                self.restored += 1

    def forget(self, owner: Client | None = None) -> None:
        """Drop ``owner``'s entries (None: every entry)."""
        with self._lock:
            self._entries = [e for e in self._entries if owner is not None and e.owner is not owner]
            self._bytes = sum(len(e.data) for e in self._entries)

    def close(self, deadline: float | None = None) -> None:
        """Let the disk tier write what it has queued and go (RAM entries are just dropped)."""
        self.forget()
        if self.disk is not None:
            self.disk.close(deadline)

    def to_dict(self) -> dict[str, Any]:
        return {
            "max_bytes": self.max_bytes,
            "bytes": self.nbytes,
            "conversations": len(self._entries),
            "saved": self.saved,
            "restored": self.restored,
            "dropped": self.dropped,
            "disk": self.disk.to_dict() if self.disk is not None else None,
        }


def make_host_cache(backend: Backend, options: SchedulerOptions) -> HostKVCache:
    """The host cache ``options`` ask for: RAM, and a disk tier with ``cache_dir`` (bound to
    ``backend``'s model pair and context; a quarter of the RAM holds what is on its way to disk)."""
    if not options.cache_dir:
        return HostKVCache(options.cache_ram)
    from .. import __version__

    queue = options.cache_ram // 4
    disk = DiskTier(options.cache_dir, options.cache_disk, binding_of(backend), __version__, queue)
    return HostKVCache(options.cache_ram - queue, disk)
