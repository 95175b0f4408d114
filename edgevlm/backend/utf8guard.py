"""A reply under a grammar stays valid UTF-8: a sampler in the chain, after the grammar's.

llama.cpp's grammar reads a character that comes in byte tokens by its code point, and checks
that each later byte is a continuation byte, but not that the sequence is the shortest form
(below U+0080 it does): an overlong ``E0 82 A2`` is one "¢" to it, ``F0 80 A0 80`` one U+0800.
The reply's text then holds bytes the grammar never saw as such: three or four U+FFFD where the
grammar counted one character, so a string's ``maxLength`` no longer holds. What else is invalid
llama.cpp refuses itself (a lead byte C0/C1 or F5-FF, a byte that is no continuation, a code
point past U+10FFFF or a surrogate where no grammar class holds one), so this sampler only acts
after a lone ``E0`` or ``F0``: the next byte must be A0-BF, resp. 90-BF.

It keeps the reply's incomplete last character (``accept``) and, only then, looks at the
candidates the grammar left (a few), so a step without one costs one Python call. A guard lives
as long as llama.cpp holds its sampler: freeing the chain calls its ``free``."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

__all__ = ["Utf8Guard", "incomplete_tail"]

# the lone lead bytes whose shortest form needs more than a continuation byte next
NEXT = {b"\xe0": (0xA0, 0xBF), b"\xf0": (0x90, 0xBF)}


def incomplete_tail(data: bytes) -> bytes:
    """The last bytes of ``data`` that begin a UTF-8 character not finished yet (b"" if none)."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b >> 6 == 2:  # a continuation byte: look further back
            continue
        need = 2 if b >> 5 == 6 else 3 if b >> 4 == 14 else 4 if b >> 3 == 30 else 1
        return data[-back:] if need > back else b""
    return b""


class Utf8Guard:
    """One reply's guard (module doc): ``attach`` makes one and gives its llama.cpp sampler, for
    the chain after the grammar; the chain frees it."""

    _alive: ClassVar[set[Utf8Guard]] = set()  # guards whose sampler llama.cpp holds (their callbacks)
    _freed: ClassVar[list[Utf8Guard]] = []  # freed by llama.cpp: dropped at the next attach, not in their own call
    _lock = threading.Lock()

    @classmethod
    def attach(cls, lc: Any, token_bytes: Callable[[int], bytes]) -> Any:
        guard = cls(lc, token_bytes)
        with cls._lock:
            cls._freed.clear()
            cls._alive.add(guard)
        return guard.sampler

    @classmethod
    def held(cls) -> int:
        """How many guards llama.cpp holds now (each a reply under a grammar)."""
        with cls._lock:
            return len(cls._alive)

    def __init__(self, lc: Any, token_bytes: Callable[[int], bytes]):
        self.token_bytes = token_bytes
        self.tail = b""
        self._apply = lc.llama_sampler_i_apply(self.apply)
        self._accept = lc.llama_sampler_i_accept(self.accept)
        self._free = lc.llama_sampler_i_free(self.free)
        self.iface = lc.llama_sampler_i()  # (the rest NULL: no name, reset, clone or state)
        self.iface.apply = self._apply
        self.iface.accept = self._accept
        self.iface.free = self._free
        self.sampler = lc.llama_sampler_init(ctypes.pointer(self.iface), None)

    def free(self, _smpl: Any) -> None:
        with self._lock:
            self._alive.discard(self)
            self._freed.append(self)

    def accept(self, _smpl: Any, token: int) -> None:
        try:
            self.tail = incomplete_tail(self.tail + self.token_bytes(int(token)))
        except Exception:  # (a callback from C: nothing may escape)
            self.tail = b""

    def apply(self, _smpl: Any, cur_p: Any) -> None:
        span = NEXT.get(self.tail)
        if span is None:
            return
        try:
            arr = cur_p.contents
            cells = np.ctypeslib.as_array(arr.data, shape=(arr.size,))  # (a view: id, logit, p)
            live = np.flatnonzero(np.isfinite(cells["logit"]))
            first = [(self.token_bytes(int(t))[:1] or b"\0")[0] for t in cells["id"][live]]
            bad = live[[not span[0] <= b <= span[1] for b in first]]
            if len(bad) < len(live):  # (never leave nothing to sample)
                cells["logit"][bad] = -np.inf
        except Exception:
            return
