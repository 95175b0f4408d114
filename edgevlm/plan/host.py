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
import sys
import threading
import time
from collections.abc import Callable

from ..errors import EdgeVLMError, InputError, MemoryBusy
from .devices import format_size

__all__ = ["HostAllowance", "Lease", "LeaseReleased", "return_freed_memory"]

MMAP_THRESHOLD = 256 * 1024  # buffers at least this large are their own mappings (glibc)


def return_freed_memory() -> bool:
    """Make what requests free go back to the operating system at once, so that the process's
    RSS follows the allowance: on glibc, buffers of ``MMAP_THRESHOLD`` and more become their own
    mappings, unmapped when freed. (glibc's default raises that threshold after each large free,
    up to 32 MiB, and keeps what is freed below it in its arenas: measured here, a server's RSS
    stayed 1.4 GiB after requests that held 0.45 GiB at their peak; with the fixed threshold it
    went back to 0.2 GiB.) Elsewhere, or when libc is not glibc, nothing changes. Returns whether
    it applied."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_mmap_threshold = -3
    return bool(mallopt(m_mmap_threshold, MMAP_THRESHOLD))


class LeaseReleased(EdgeVLMError):
    """A released lease was asked for more: the request it belonged to has ended."""

    code = "request_ended"


class HostAllowance:
    """``total`` bytes, handed out in leases (thread-safe)."""

    def __init__(self, total: int):
        self.total = int(total)
        self.in_use = 0
        self.peak = 0
        self.waits = 0  # acquisitions that had to wait
        self.refused = 0  # ... that gave up at their deadline
        self._cond = threading.Condition()

    def lease(self, what: str = "this request", on_release: Callable[[], None] | None = None) -> Lease:
        return Lease(self, what, on_release)

    @property
    def free(self) -> int:
        return self.total - self.in_use

    def _take(self, n: int, deadline: float | None, what: str) -> None:
        if n <= 0:
            return
        if n > self.total:
            raise InputError(
                f"{what} needs {format_size(n)} of host memory, more than the whole "
                f"allowance for requests ({format_size(self.total)}; --host-allowance)"
            )
        with self._cond:
            waited = False
            while self.in_use + n > self.total:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self.refused += 1
                    raise MemoryBusy(
                        f"{what} needs {format_size(n)} of host memory and the allowance for "
                        f"requests is taken ({format_size(self.in_use)} of "
                        f"{format_size(self.total)} in use); retry shortly"
                    )
                waited = True
                self._cond.wait(left if left is not None else 1.0)
            self.waits += waited
            self.in_use += n
            self.peak = max(self.peak, self.in_use)

    def count_wait(self) -> None:
        """An acquisition that waited outside ``_take`` (an event loop's polling) got its bytes."""
        with self._cond:
            self.waits += 1

    def _try_take(self, n: int) -> bool:
        with self._cond:
            if n > 0 and self.in_use + n > self.total:
                return False
            self.in_use += max(0, n)
            self.peak = max(self.peak, self.in_use)
            return True

    def _give(self, n: int) -> None:
        if n <= 0:
            return
        with self._cond:
            self.in_use -= n
            self._cond.notify_all()

    def to_dict(self) -> dict[str, int]:
        return {
            "allowance_bytes": self.total,
            "in_use_bytes": self.in_use,
            "peak_in_use_bytes": self.peak,
            "waits": self.waits,
            "refused": self.refused,
        }


class Lease:
    """What one request holds of the allowance; ``release()`` gives all of it back (and calls
    ``on_release``: a server gives the request's place back with it). Safe from any thread: a
    request's lease is released by whichever of the worker and the event loop ends it first, and
    only that first release gives anything back; a released lease takes nothing more (``grow``
    raises ``LeaseReleased``, ``try_grow`` is False), so a step still running for a request that
    ended cannot take bytes nobody will return."""

    def __init__(self, allowance: HostAllowance, what: str, on_release: Callable[[], None] | None = None):
        self.allowance = allowance
        self.what = what
        self.held = 0
        self.released = False
        self._on_release = [on_release] if on_release is not None else []
        self._lock = threading.Lock()

    def grow(self, n: int, deadline: float | None = None) -> None:
        """Take ``n`` more bytes (waiting until ``deadline``, a ``time.monotonic()`` value)."""
        n = max(0, int(n))
        if self.released:
            raise LeaseReleased(f"{self.what} has ended; its memory is given back")
        self.allowance._take(n, deadline, self.what)  # (may wait: outside the lock)
        with self._lock:
            if not self.released:
                self.held += n
                return
        self.allowance._give(n)  # released while it waited: nothing is kept
        raise LeaseReleased(f"{self.what} has ended; its memory is given back")

    def try_grow(self, n: int) -> bool:
        """Take ``n`` more bytes if they are free now (never waits)."""
        n = max(0, int(n))
        with self._lock:
            if self.released or not self.allowance._try_take(n):
                return False
            self.held += n
            return True

    def shrink(self, n: int) -> None:
        """Give back ``n`` bytes (at most what is held)."""
        with self._lock:
            n = max(0, min(int(n), self.held))
            self.held -= n
        self.allowance._give(n)

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
        self.allowance._give(n)
        for call in done:
            call()

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
