"""The host allowance: the RAM that requests in flight and waiting may hold, planned and
enforced.

A server's requests hold host memory the model's buffers do not: the body as read and parsed,
each picture's compressed bytes and — while it is decoded — its full decode, then its
budgeted views, mtmd's preprocessed copy of them and their embeddings. The plan states an
allowance for all of it (``Wishes.host_allowance``, ``--host-allowance``); ``HostAllowance``
hands it out in leases. A request takes what it will hold *before* it holds it (the full
decode before decoding, the body before reading it), gives back what it dropped, and returns
its lease when it ends. When the allowance is used up, a request waits for another to give
some back — up to a deadline, then ``MemoryBusy`` (a 503 with Retry-After); one that could
never fit the whole allowance is refused at once (``InputError``).
"""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import EdgeVLMError, InputError, MemoryBusy
from .devices import format_size

__all__ = ["HostAllowance", "Lease", "LeaseReleased", "return_freed_memory", "trim_freed_memory"]

MMAP_THRESHOLD = 256 * 1024  # buffers at least this large are their own mappings (glibc)
TRIM_AFTER = 32 * 1024 * 1024  # an allowance that empties after this much was given back trims


def return_freed_memory() -> bool:
    """Make what requests free go back to the operating system at once, so that the process's
    RSS follows the allowance: on glibc, buffers of ``MMAP_THRESHOLD`` and more become their own
    mappings, unmapped when freed. (glibc's default raises that threshold after each large free,
    up to 32 MiB, and keeps what is freed below it in its arenas: measured here, a server's RSS
    stayed 1.4 GiB after requests that held 0.45 GiB at their peak; with the fixed threshold it
    went back to 0.2 GiB.) Elsewhere, or when libc is not glibc, nothing changes. Returns whether
    it applied."""
    libc = _glibc()
    if libc is None:
        return False
    m_mmap_threshold = -3
    return bool(libc.mallopt(m_mmap_threshold, MMAP_THRESHOLD))


def trim_freed_memory() -> bool:
    """Give the operating system the free pages glibc still keeps in its arenas. Buffers below
    ``MMAP_THRESHOLD`` — a URL's or a body's chunks as they arrive, parsed JSON, Python's own
    objects — come from arenas (one per thread that allocates), and what is freed in the middle
    of one stays in the process. Measured on ``test_picture_urls_are_fetched_within_the_
    allowance_and_the_memory_comes_back`` (64 × 16 MiB URLs at once, 2 cores, 4 runs each):
    42–60 MiB over the idle RSS stayed without it, 38–45 MiB with it. A server calls it when its
    allowance empties (``HostAllowance``'s ``trim``). Elsewhere nothing happens. Returns whether
    it ran."""
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


@functools.cache
def _glibc() -> Any:
    """glibc with ``mallopt`` and ``malloc_trim`` (looked up once), or None elsewhere."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (both there, or it is not glibc)
    except (OSError, AttributeError):
        return None
    return libc


class LeaseReleased(EdgeVLMError):
    """A released lease was asked for more: the request it belonged to has ended."""

    code = "request_ended"


SMALL_LANE = 8  # the last 1/SMALL_LANE of an allowance is kept for small takes ...
SMALL_TAKE = 4  # ... those of at most 1/SMALL_TAKE of that part
STUCK_S = 0.5  # requests holding memory have waited this long on each other alone: one gives way
LOOK_S = 0.1  # a waiting take looks again this often (for its deadline, and for a standstill)


class HostAllowance:
    """``total`` bytes, handed out in leases (thread-safe).

    - Its last ``small_lane`` bytes go only to takes of at most ``small_take`` bytes: large
      pictures and bodies filling the allowance never make a text request or a small picture
      wait for them (as the scheduler's short lane lets follow-ups past long pictures).
    - While a request that holds memory waits for more, a request that holds none takes
      nothing large: what is given back goes to the requests already under way first.
    - A request waits at most to its deadline (``MemoryBusy``: a 503). But when the requests
      that hold memory and wait for more could not get it even if every other request gave back
      all it holds — each waits for what only the others waiting hold — and that has lasted
      ``STUCK_S``, the youngest of them gives way at once (``MemoryBusy``, counted in
      ``gave_way``), and the others go on with what it gave back."""

    def __init__(self, total: int, trim: Callable[[], object] | None = None):
        self.total = int(total)
        self.trim = trim  # called, outside the lock, when it empties after TRIM_AFTER came back
        self.trims = 0
        self._given = 0  # bytes given back since the last trim
        self.small_lane = self.total // SMALL_LANE
        self.small_take = self.small_lane // SMALL_TAKE
        self.in_use = 0
        self.peak = 0
        self.waits = 0  # acquisitions that had to wait
        self.refused = 0  # ... that gave up at their deadline, or gave way
        self.gave_way = 0  # ... that gave way: every holder was waiting
        self._cond = threading.Condition()
        self._next = 0  # the next lease's number (its age: a larger one is younger)
        self._holding: dict[int, int] = {}  # lease number -> bytes it holds (> 0)
        self._waiting: dict[int, list[int]] = {}  # lease number -> the takes it waits for now
        self._stuck_since: float | None = None  # since when waiting holders could only wait on each other

    def lease(self, what: str = "this request", on_release: Callable[[], None] | None = None) -> Lease:
        with self._cond:
            self._next += 1
            number = self._next
        return Lease(self, what, on_release, number)

    @property
    def free(self) -> int:
        return self.total - self.in_use

    @property
    def waiting(self) -> int:
        """Takes waiting for memory now."""
        with self._cond:
            return sum(map(len, self._waiting.values()))

    def _room(self, n: int, number: int) -> int:
        """What a take of ``n`` bytes by lease ``number`` may fill: all of it when small; else
        all but the small lane — and nothing while holders wait, when it holds nothing itself."""
        if n <= self.small_take:
            return self.total
        if number not in self._holding and any(w in self._holding for w in self._waiting):
            return 0  # (what comes back goes to the requests under way)
        return self.total - self.small_lane

    def _take(self, n: int, deadline: float | None, what: str, number: int = 0) -> None:
        """Take ``n`` bytes for lease ``number`` (``what``): at once when they are free, else
        waiting until ``deadline`` (then ``MemoryBusy``) or until it gives way (class doc). What
        could never fit — more than the whole allowance, with what it holds — is refused at once
        (``InputError``): waiting would only wait for itself."""
        if n <= 0:
            return
        with self._cond:
            held = self._holding.get(number, 0)
            if held + n > self.total:
                raise InputError(
                    f"{what} needs {format_size(held + n)} of host memory, more than the whole "
                    f"allowance for requests ({format_size(self.total)}; --host-allowance)"
                )
            waited = False
            self._waiting.setdefault(number, []).append(n)
            try:
                while self.in_use + n > self._room(n, number):
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        self.refused += 1
                        raise MemoryBusy(
                            f"{what} needs {format_size(n)} of host memory and the allowance for "
                            f"requests is taken ({format_size(self.in_use)} of "
                            f"{format_size(self.total)} in use); retry shortly"
                        )
                    if self._gives_way(number):
                        self.refused += 1
                        self.gave_way += 1
                        raise MemoryBusy(
                            f"{what} needs {format_size(n)} of host memory while every request "
                            f"holding the allowance for requests ({format_size(self.in_use)} of "
                            f"{format_size(self.total)}) waits for more; the youngest gives way: "
                            "retry shortly"
                        )
                    waited = True
                    self._cond.wait(LOOK_S if left is None else min(left, LOOK_S))
            finally:
                self._waiting[number].remove(n)
                if not self._waiting[number]:
                    del self._waiting[number]
            self.waits += waited
            self._add(number, n)

    def _gives_way(self, number: int) -> bool:
        """Whether lease ``number``, waiting, gives way now: the leases that hold memory and wait
        for more could not get it even if every other lease gave back all it holds — each waits
        for what only the others waiting hold — and have been so for ``STUCK_S``; it is the
        youngest of them. (Requests that come and go beside them — text, small pictures in the
        small lane — change nothing of that.)"""
        stuck = [k for k in self._waiting if k in self._holding]
        held = sum(self._holding[k] for k in stuck)
        now = time.monotonic()
        if number not in stuck or any(
            min(self._waiting[k]) + held <= self._room(min(self._waiting[k]), k) for k in stuck
        ):
            self._stuck_since = None
            return False
        if self._stuck_since is None:
            self._stuck_since = now
        return now - self._stuck_since >= STUCK_S and number == max(stuck)

    def _add(self, number: int, n: int) -> None:
        self.in_use += n
        self.peak = max(self.peak, self.in_use)
        self._holding[number] = self._holding.get(number, 0) + n

    def count_wait(self) -> None:
        """An acquisition that waited outside ``_take`` (an event loop's polling) got its bytes."""
        with self._cond:
            self.waits += 1

    def _try_take(self, n: int, number: int = 0) -> bool:
        if n <= 0:
            return True
        with self._cond:
            if self.in_use + n > self._room(n, number):
                return False
            self._add(number, n)
            return True

    def _give(self, n: int, number: int = 0) -> None:
        if n <= 0:
            return
        with self._cond:
            self.in_use -= n
            left = self._holding.get(number, 0) - n
            if left > 0:
                self._holding[number] = left
            else:
                self._holding.pop(number, None)
            self._cond.notify_all()
            self._given += n
            trim = self.trim is not None and self.in_use == 0 and self._given >= TRIM_AFTER
            if trim:
                self._given = 0
                self.trims += 1
        if trim and self.trim is not None:
            self.trim()  # (nothing is held: the freed pages go back to the system)

    def to_dict(self) -> dict[str, int]:
        return {
            "allowance_bytes": self.total,
            "in_use_bytes": self.in_use,
            "peak_in_use_bytes": self.peak,
            "waits": self.waits,
            "refused": self.refused,
            "gave_way": self.gave_way,
            "waiting": self.waiting,
            "trims": self.trims,
        }


class Lease:
    """What one request holds of the allowance; ``release()`` gives all of it back (and calls
    ``on_release``: a server gives the request's place back with it). Safe from any thread: a
    request's lease is released by whichever of the worker and the event loop ends it first, and
    only that first release gives anything back; a released lease takes nothing more (``grow``
    raises ``LeaseReleased``, ``try_grow`` is False), so a step still running for a request that
    ended cannot take bytes nobody will return."""

    def __init__(
        self, allowance: HostAllowance, what: str, on_release: Callable[[], None] | None = None, number: int = 0
    ):
        self.allowance = allowance
        self.what = what
        self.number = number  # its age among the allowance's leases (HostAllowance.lease)
        self.held = 0
        self.released = False
        self._on_release = [on_release] if on_release is not None else []
        self._lock = threading.Lock()

    def grow(self, n: int, deadline: float | None = None) -> None:
        """Take ``n`` more bytes (waiting until ``deadline``, a ``time.monotonic()`` value)."""
        n = max(0, int(n))
        if self.released:
            raise LeaseReleased(f"{self.what} has ended; its memory is given back")
        self.allowance._take(n, deadline, self.what, self.number)  # (may wait: outside the lock)
        with self._lock:
            if not self.released:
                self.held += n
                return
        self.allowance._give(n, self.number)  # released while it waited: nothing is kept
        raise LeaseReleased(f"{self.what} has ended; its memory is given back")

    def try_grow(self, n: int) -> bool:
        """Take ``n`` more bytes if they are free now (never waits)."""
        n = max(0, int(n))
        with self._lock:
            if self.released or not self.allowance._try_take(n, self.number):
                return False
            self.held += n
            return True

    def shrink(self, n: int) -> None:
        """Give back ``n`` bytes (at most what is held)."""
        with self._lock:
            n = max(0, min(int(n), self.held))
            self.held -= n
        self.allowance._give(n, self.number)

    def resize(self, n: int, deadline: float | None = None) -> None:
        """Hold exactly ``n`` bytes from now on."""
        with self._lock:
            more = int(n) - self.held
        if more > 0:
            self.grow(more, deadline)
        else:
            self.shrink(-more)

    def on_release(self, done: Callable[[], None]) -> None:
        """Call ``done`` when the lease is released (at once if it is already): what a place
        taken after the lease (a server's, once the body is in) gives back with it."""
        with self._lock:
            if not self.released:
                self._on_release.append(done)
                return
        done()

    def release(self) -> None:
        """Give everything back, once: later calls (from any thread) do nothing."""
        with self._lock:
            if self.released:
                return
            self.released = True
            n, self.held = self.held, 0
            done, self._on_release = self._on_release, []
        self.allowance._give(n, self.number)
        for call in done:
            call()

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
