"""The vision encoder in a thread of its own: the scheduler asks for a picture's chunk to be
encoded and goes on stepping the requests that generate; the chunk's embeddings appear on its
image unit when they are ready (or the error, for the request that waits on it alone).

llama.cpp's context is driven by the scheduler's thread; mtmd's by this one (under the
backend's mtmd lock, which counting and tokenizing share), so a long encode of a new picture
holds up nobody's tokens but its own request's.

An encode beside the step loop makes both share the cores: on a CPU, two teams of threads on
the same cores spend much of it waiting for each other (20 % more CPU time per request,
measured with scripts/bench_serve.py). So the step loop encodes the next chunk itself
(``run_here``), as a step of its own between token steps, when nobody generates (there is
nobody to keep going) or when an encode takes no longer than one micro-batch of prompt rows
(``cost_ms``, measured: the streams wait no longer than one micro-batch would make them); the
thread takes the encodes that are longer than that (``set_inline``: otherwise it leaves them).
"""

from __future__ import annotations

import threading
from collections import deque

from ..backend.llama import Backend
from .items import ImageUnit

__all__ = ["Encoder"]


class Encoder:
    def __init__(self, backend: Backend):
        self.backend = backend
        self._queue: deque[tuple[ImageUnit, int]] = deque()
        self._busy: tuple[ImageUnit, int] | None = None
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.cost_ms = 0.0  # what an encode takes (moving average; 0 until one is done)
        self._inline = False  # the step loop takes the encodes (set_inline), not the thread

    def ready(self, unit: ImageUnit, ci: int) -> bool:
        return ci in unit.embeddings or ci in unit.errors

    def request(self, unit: ImageUnit, ci: int) -> bool:
        """Encode chunk ``ci`` of ``unit`` soon; False if it is ready or already asked for."""
        with self._cond:
            job = (unit, ci)
            if self.ready(unit, ci) or self._busy == job or job in self._queue:
                return False
            self._queue.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="edgevlm-encoder", daemon=True)
                self._thread.start()
            self._cond.notify_all()
            return True

    def set_inline(self, inline: bool) -> None:
        """Whether the step loop takes the encodes (``run_here``) and the thread leaves them."""
        if inline != self._inline:
            with self._cond:
                self._inline = inline
                self._cond.notify_all()

    def wait(self, timeout: float) -> None:
        """Until an encode finishes (or ``timeout`` seconds)."""
        with self._cond:
            if self._queue or self._busy is not None:
                self._cond.wait(timeout)

    @property
    def busy(self) -> bool:
        """An encode is running (in the thread, or in the step loop)."""
        return self._busy is not None

    def run_here(self) -> bool:
        """Encode the next queued chunk in the caller's thread; False when none is queued or the
        encoder thread is on one already."""
        with self._cond:
            if self._busy is not None or not self._queue:
                return False
            job = self._busy = self._queue.popleft()
        self._encode(job)
        return True

    @property
    def pending(self) -> int:
        return len(self._queue) + (self._busy is not None)

    def _run(self) -> None:
        while True:
            with self._cond:
                while (not self._queue or self._inline) and not self._stop:
                    self._cond.wait()
                if self._stop:
                    return
                job = self._busy = self._queue.popleft()
            self._encode(job)

    def _encode(self, job: tuple[ImageUnit, int]) -> None:
        unit, ci = job
        try:
            unit.encode(ci, self.backend)  # (a closed unit raises: its request ends with that)
            ms = unit.encode_ms.get(ci, 0.0)
            self.cost_ms = ms if not self.cost_ms else 0.7 * self.cost_ms + 0.3 * ms
        except Exception as exc:  # this picture's request ends with it; the encoder goes on
            unit.errors[ci] = exc
        finally:
            with self._cond:
                self._busy = None
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._queue.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)
