"""Where a picture is encoded: in the step loop, as a step of its own, on all the cores.

The scheduler asks for a picture chunk's embeddings (``request``) when a request that holds it
reaches it, or while it waits for cells (its pictures are encoded meanwhile); the step loop
encodes the next one queued as the whole of a step (``place``), with the decoder's threads —
mtmd's context is made with ``n_threads`` and keeps them. Running streams wait for that step
like for any other: the encode is one step among theirs.

An encode never runs beside a decode. Until #57 a part of the cores encoded on a thread of its
own while the decoder kept the rest, which needed a write into mtmd's private context struct
(its thread count, at a fixed offset) and a choice made from measured times (encode against a
micro-batch of rows): two runs of the same request could encode a picture with different
thread counts and cut its rows differently, and their greedy tokens differed. The last
measurement (``bench_serve``, 2 cores) found no gain from the split; no machine with 8 or more
cores was at hand to measure it where it could pay, so the split and the struct write went.
"""

from __future__ import annotations

import threading
from collections import deque

from ..backend.llama import Backend
from .items import ImageUnit

__all__ = ["Encoder"]


class Encoder:
    """The queue of picture chunks to encode, encoded one per step by the step loop."""

    def __init__(self, backend: Backend):
        self.backend = backend
        self.cores = backend.n_threads
        self._queue: deque[tuple[ImageUnit, int]] = deque()
        self._busy: tuple[ImageUnit, int] | None = None
        self._lock = threading.Lock()
        self.cost_ms = 0.0  # what an encode takes (moving average; 0 until one is done: /status)
        self.total_ms = 0.0  # every encode's time, summed (/status: kv.encode_ms, beside llama_ms)
        self.encodes = 0

    def ready(self, unit: ImageUnit, ci: int) -> bool:
        return ci in unit.embeddings or ci in unit.errors

    def request(self, unit: ImageUnit, ci: int) -> bool:
        """Encode chunk ``ci`` of ``unit`` at the next step; False if it is ready or already
        asked for."""
        with self._lock:
            job = (unit, ci)
            if self.ready(unit, ci) or self._busy == job or job in self._queue:
                return False
            self._queue.append(job)
            return True

    @property
    def busy(self) -> bool:
        """An encode is running."""
        return self._busy is not None

    @property
    def pending(self) -> int:
        return len(self._queue) + self.busy

    def place(self) -> bool:
        """Encode the next queued chunk now, on the caller's thread (the step loop's) with all
        the cores: True when it did (the encode was the step's work), False when none is queued."""
        with self._lock:
            if self._busy is not None or not self._queue:
                return False
            job = self._busy = self._queue.popleft()
        unit, ci = job
        try:
            unit.encode(ci, self.backend)  # (a closed unit raises: its request ends with that)
            ms = unit.encode_ms.get(ci, 0.0)
            self.cost_ms = ms if not self.cost_ms else 0.7 * self.cost_ms + 0.3 * ms
            self.total_ms += ms
        except Exception as exc:  # this picture's request ends with it; the encoder goes on
            unit.errors[ci] = exc
        finally:
            with self._lock:
                self._busy = None
                self.encodes += 1
        return True

    def to_dict(self) -> dict[str, object]:
        """The threads and the encodes done, for ``/status``."""
        return {"cores": self.cores, "encodes": self.encodes, "encode_ms": round(self.cost_ms, 1)}

    def close(self) -> None:
        with self._lock:
            self._queue.clear()
