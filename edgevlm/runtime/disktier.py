"""Idle conversations' KV cells on disk: the host cache's second tier (``serve --cache-dir DIR
--cache-disk SIZE``).

A conversation pushed out of host RAM is written to DIR as a saved-sequence file (the format of
``saved.fileformat``, kind ``sequence``: its items and llama.cpp's copy of its cells, bound to
the model pair and context), by a writer thread — the step loop never waits for the disk. The
write queue holds at most ``queue_bytes`` (a share of ``--cache-ram``, so the RAM the host cache
takes stays what was planned); past it, a new entry waits for the writer. The files are bounded
by ``max_bytes``, least recently used out (a file's mtime is its last use).

A server started on the same DIR with the same model indexes the files' headers (their items)
and answers a returning conversation from disk: the longest prefix any file holds is read
(checksum checked) and copied back into the KV cache. Files of another model or context are
ignored — neither deleted nor loaded. One server per DIR: a lock file, held while the server
runs; a second one is refused in one line naming the first one's process id.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from filelock import FileLock, Timeout

from ..errors import InputError, SavedStateError
from .items import Item, shared_prefix
from .saved import Binding, decode_items, encode_items, load_saved, read_header, write_saved

__all__ = ["DiskEntry", "DiskTier", "SEQUENCE"]

SEQUENCE = "sequence"  # the kind of file this tier writes (a chat's own files are "conversation")
SUFFIX = ".evlm"


@dataclass(eq=False)
class DiskEntry:
    path: str
    items: tuple[Item, ...]
    nbytes: int
    data: bytes | None = None  # while queued for writing: the cells themselves

    @property
    def cells(self) -> int:
        return sum(it.n_tokens for it in self.items)

    def lcp(self, items: tuple[Item, ...] | list[Item]) -> int:
        return shared_prefix(self.items, items)


class DiskTier:
    """Sequence files in one folder for one model pair and context (module doc)."""

    def __init__(self, folder: str, max_bytes: int, binding: Binding, version: str, queue_bytes: int = 0):
        self.folder = os.path.abspath(folder)
        self.max_bytes = int(max_bytes)
        self.queue_bytes = int(queue_bytes)
        self.binding = binding
        self.version = version
        try:
            os.makedirs(self.folder, exist_ok=True)
        except OSError as exc:
            raise InputError(f"--cache-dir {self.folder}: cannot make it ({exc.strerror or exc})") from None
        self._lock_file = FileLock(os.path.join(self.folder, ".edgevlm-serve.lock"))
        try:
            self._lock_file.acquire(timeout=0)
        except Timeout:
            raise InputError(f"--cache-dir {self.folder}: in use by another edgevlm serve ({self._holder()})") from None
        with open(os.path.join(self.folder, ".edgevlm-serve.pid"), "w") as f:
            f.write(str(os.getpid()))
        self._entries: dict[str, DiskEntry] = {}  # by path, least recently used first
        self._queue: deque[DiskEntry] = deque()
        self._queued = 0
        self._cond = threading.Condition()
        self._stop = False
        self.written = 0  # files written
        self.read = 0  # files read back into the KV cache
        self.dropped = 0  # files removed to stay within max_bytes (or superseded, or unreadable)
        self.ignored = 0  # files in the folder made with another model or context (left alone)
        self._scan()
        self._thread = threading.Thread(target=self._write_loop, name="edgevlm-disk-tier", daemon=True)
        self._thread.start()

    # --- the folder ---------------------------------------------------------------------------
    def _holder(self) -> str:
        try:
            with open(os.path.join(self.folder, ".edgevlm-serve.pid")) as f:
                return f"process {int(f.read().strip())}"
        except (OSError, ValueError):
            return "its lock file is held"

    def _scan(self) -> None:
        found = []
        for name in os.listdir(self.folder):
            if not name.endswith(SUFFIX) or name.startswith("."):
                continue
            path = os.path.join(self.folder, name)
            try:
                header = read_header(path)
                if header.get("kind") != SEQUENCE or Binding.from_dict(header["binding"]).differs(self.binding):
                    self.ignored += 1
                    continue
                items = decode_items(header["items"], path)
                st = os.stat(path)
            except (SavedStateError, OSError, KeyError, TypeError, ValueError):
                self.ignored += 1
                continue
            found.append((st.st_mtime_ns, DiskEntry(path, items, st.st_size)))
        for _, entry in sorted(found, key=lambda x: x[0]):
            self._entries[entry.path] = entry

    @property
    def nbytes(self) -> int:
        with self._cond:
            return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    # --- in and out ---------------------------------------------------------------------------
    def put(self, items: tuple[Item, ...], data: bytes, wait_s: float = 30.0) -> bool:
        """Queue a sequence's cells for writing (waiting, up to ``wait_s``, while the queue is
        full). False: it does not fit the tier, or the writer did not make room in time."""
        if not items or len(data) > self.max_bytes:
            return False
        key = hashlib.sha256(json.dumps(encode_items(items)).encode()).hexdigest()[:32]
        entry = DiskEntry(os.path.join(self.folder, key + SUFFIX), items, len(data), data)
        deadline = time.monotonic() + wait_s
        with self._cond:
            while self._queue and self._queued + len(data) > self.queue_bytes:
                left = deadline - time.monotonic()
                if left <= 0 or self._stop:
                    self.dropped += 1
                    return False
                self._cond.wait(min(left, 0.5))
            for e in [e for e in self._entries.values() if len(e.items) <= len(items) and e.lcp(items) == len(e.items)]:
                self._remove(e)  # (this one holds all of that one)
            self._entries.pop(entry.path, None)
            self._entries[entry.path] = entry
            self._queue.append(entry)
            self._queued += len(data)
            self._cond.notify_all()
        return True

    def best(self, items: tuple[Item, ...] | list[Item]) -> tuple[DiskEntry | None, int]:
        with self._cond:
            best, k = None, 0
            for e in self._entries.values():
                n = e.lcp(items)
                if n > k:
                    best, k = e, n
            return best, k

    def data(self, entry: DiskEntry) -> bytes | memoryview | None:
        """The cells of ``entry``: from the queue, or read back (checksum checked; an unreadable
        file is dropped). Its use makes it the most recently used."""
        with self._cond:
            if entry.data is not None:
                return entry.data
        try:
            got = load_saved(entry.path)
            kv = got.sections.get("kv")
        except SavedStateError:
            kv = None
        with self._cond:
            if kv is None:
                self._remove(entry)
                return None
            self.read += 1
            if entry.path in self._entries:
                self._entries[entry.path] = self._entries.pop(entry.path)
        try:
            os.utime(entry.path)
        except OSError:
            pass
        return kv

    def _remove(self, entry: DiskEntry) -> None:
        """(Under the condition's lock.) Forget ``entry`` and delete its file (once written)."""
        if self._entries.pop(entry.path, None) is None:
            return
        self.dropped += 1
        if entry.data is None:
            try:
                os.unlink(entry.path)
            except OSError:
                pass

    # --- the writer ---------------------------------------------------------------------------
    def _write_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stop:
                    self._cond.wait()
                if not self._queue:
                    return
                entry = self._queue[0]
                data = entry.data
            header = {
                "kind": SEQUENCE,
                "edgevlm": self.version,
                "binding": self.binding.to_dict(),
                "items": encode_items(entry.items),
                "cells": entry.cells,
            }
            ok = True
            try:
                if entry.path in self._entries:  # (superseded while it waited: not written)
                    entry.nbytes = write_saved(entry.path, header, [("kv", data or b"")])
            except Exception:  # a full disk, permissions: the entry is lost, the server goes on
                ok = False
            with self._cond:
                self._queue.popleft()
                self._queued -= len(data or b"")
                entry.data = None
                if not ok:
                    self._entries.pop(entry.path, None)
                    self.dropped += 1
                elif entry.path in self._entries:
                    self.written += 1
                    while sum(e.nbytes for e in self._entries.values()) > self.max_bytes and len(self._entries) > 1:
                        self._remove(next(iter(self._entries.values())))
                self._cond.notify_all()

    def flush(self, deadline: float) -> bool:
        """Wait (until ``deadline``, monotonic) for the queue to be written. True when it was."""
        with self._cond:
            while self._queue:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.5))
            return True

    def close(self, deadline: float | None = None) -> None:
        """Write what is queued (until ``deadline``), stop the writer, let the folder go."""
        self.flush(time.monotonic() + 30 if deadline is None else deadline)
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join(timeout=5)
        try:
            os.unlink(os.path.join(self.folder, ".edgevlm-serve.pid"))
        except OSError:
            pass
        self._lock_file.release()

    def to_dict(self) -> dict[str, Any]:
        with self._cond:
            return {
                "dir": self.folder,
                "max_bytes": self.max_bytes,
                "bytes": sum(e.nbytes for e in self._entries.values()),
                "conversations": len(self._entries),
                "queued_bytes": self._queued,
                "written": self.written,
                "read": self.read,
                "dropped": self.dropped,
                "ignored": self.ignored,
            }
