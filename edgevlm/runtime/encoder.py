"""Where a picture is encoded, and with which threads: as a step of its own in the step loop
(``run_here``, all the cores), or by the encoder thread beside the streams (``start_beside``,
a part of the cores while the decoder keeps the rest).

llama.cpp's context is driven by the scheduler's thread; mtmd's by whichever encodes (under the
backend's mtmd lock, which counting and tokenizing share). The step loop alone decides when an
encode starts, so it always knows how many threads the other team has:

- ``split_threads(cores)``: the encoder's and the decoder's counts while both run — about half
  each, never more than the cores together (two ggml teams as wide as the cores oversubscribe
  them: ggml's threads wait for each other at every op, and a thread that is not running holds
  up its whole team).
  Where mtmd's count cannot be set per encode (``backend.encoder_threads.settable``), or with
  one core, nothing is encoded beside the streams.
- The scheduler's ``step`` encodes a queued picture as a step of its own when nobody generates,
  when the encode is no longer than one micro-batch of prompt rows (``cost_ms``: the streams wait
  no longer than a batch would make them), or in the throughput profile (batch work: nobody
  watches a stream); otherwise it starts the thread on it and decodes with ``decoder_beside``
  threads until the thread is done (``beside``).
"""

from __future__ import annotations

import threading
from collections import deque

from ..backend.llama import Backend
from .items import ImageUnit

__all__ = ["Encoder", "split_threads"]


def split_threads(cores: int) -> tuple[int, int]:
    """(encoder, decoder) threads while a picture is encoded beside running streams on ``cores``
    threads: the decoder keeps the larger half (the streams' steps slow down at most about
    twofold), the encoder the rest; (0, cores) with one core (nothing runs beside)."""
    if cores < 2:
        return 0, max(cores, 1)
    enc = cores // 2
    return enc, cores - enc


class Encoder:
    def __init__(self, backend: Backend):
        self.backend = backend
        self.cores = backend.n_threads
        enc, dec = split_threads(self.cores)
        if not backend.encoder_threads.settable:
            enc, dec = 0, self.cores
        self.threads_beside, self.decoder_beside = enc, dec
        self._queue: deque[tuple[ImageUnit, int]] = deque()
        self._busy: tuple[ImageUnit, int] | None = None
        self._beside: tuple[ImageUnit, int] | None = None  # handed to the thread, not done yet
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.cost_ms = 0.0  # what an encode takes on all the cores (moving average; 0 until one is done)
        self.counts = {"here": 0, "beside": 0}  # encodes done in the step loop / by the thread

    def ready(self, unit: ImageUnit, ci: int) -> bool:
        return ci in unit.embeddings or ci in unit.errors

    def request(self, unit: ImageUnit, ci: int) -> bool:
        """Encode chunk ``ci`` of ``unit`` soon (the step loop decides where); False if it is
        ready or already asked for."""
        with self._cond:
            job = (unit, ci)
            if self.ready(unit, ci) or self._busy == job or self._beside == job or job in self._queue:
                return False
            self._queue.append(job)
            return True

    @property
    def can_go_beside(self) -> bool:
        return self.threads_beside > 0

    def wait(self, timeout: float) -> None:
        """Until an encode finishes (or ``timeout`` seconds)."""
        with self._cond:
            if self._queue or self._busy is not None or self._beside is not None:
                self._cond.wait(timeout)

    @property
    def busy(self) -> bool:
        """An encode is running (in the thread, or in the step loop)."""
        return self._busy is not None or self._beside is not None

    @property
    def beside(self) -> bool:
        """The thread has an encode it has not finished: the decoder has ``decoder_beside``."""
        return self._beside is not None

    @property
    def pending(self) -> int:
        return len(self._queue) + self.busy

    def place(self, generating: bool, throughput: bool, batch_ms: float) -> bool:
        """Where the next queued picture is encoded (module doc): True when the caller's thread
        has just encoded it (a step of its own, on all the cores); otherwise the thread may have
        been started on it. ``batch_ms``: what a micro-batch of prompt rows takes."""
        if not self._queue:
            return False
        short = 0 < self.cost_ms <= batch_ms
        if (throughput or not generating or short or not self.can_go_beside) and self.run_here():
            return True
        if generating:
            self.start_beside()
        return False

    @property
    def decoder_threads(self) -> int:
        """The decoder's threads now: what the thread leaves while it encodes, else all."""
        return self.decoder_beside if self.beside else self.cores

    def run_here(self) -> bool:
        """Encode the next queued chunk in the caller's thread, with all the cores; False when
        none is queued or the thread is on one (its part of the cores is taken)."""
        with self._cond:
            if self.busy or not self._queue:
                return False
            job = self._busy = self._queue.popleft()
        self._encode(job, "here")
        return True

    def start_beside(self) -> bool:
        """Hand the next queued chunk to the thread (``threads_beside`` threads); False when
        none is queued, the thread is on one, or nothing may run beside."""
        with self._cond:
            if self.busy or not self._queue or not self.can_go_beside:
                return False
            self._beside = self._queue.popleft()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="edgevlm-encoder", daemon=True)
                self._thread.start()
            self._cond.notify_all()
            return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._beside is None and not self._stop:
                    self._cond.wait()
                job = self._beside
                if self._stop or job is None:
                    return
            self._encode(job, "beside")

    def _encode(self, job: tuple[ImageUnit, int], where: str) -> None:
        """Encode ``job`` ``where`` ("here": all the cores; "beside": the thread's part), then
        give its place back and wake whoever waits."""
        unit, ci = job
        threads = self.cores if where == "here" else self.threads_beside
        try:
            unit.encode(ci, self.backend, threads)  # (a closed unit raises: its request ends with that)
            ms = unit.encode_ms.get(ci, 0.0) * threads / self.cores  # (as if on all the cores)
            self.cost_ms = ms if not self.cost_ms else 0.7 * self.cost_ms + 0.3 * ms
        except Exception as exc:  # this picture's request ends with it; the encoder goes on
            unit.errors[ci] = exc
        finally:
            with self._cond:
                if where == "here":
                    self._busy = None
                else:
                    self._beside = None
                self.counts[where] += 1
                self._cond.notify_all()

    def to_dict(self) -> dict[str, object]:
        """The threads of each team and where the encodes ran, for ``/status``."""
        return {
            "cores": self.cores,
            "encoder_alone": self.cores,
            "encoder_beside": self.threads_beside,
            "decoder_beside": self.decoder_beside,
            "decoder_now": self.backend.decode_threads,
            "encoder_now": self.threads_beside if self.beside else (self.cores if self._busy else 0),
            "encodes_here": self.counts["here"],
            "encodes_beside": self.counts["beside"],
            "encode_ms": round(self.cost_ms, 1),
        }

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._queue.clear()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)
