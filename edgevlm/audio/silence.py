"""Long silences found while the samples stream past, so a recording's pauses cost no tokens.

The rule (``SilenceRule``; ``describe()`` is the text a plan reports):

- The samples are cut into 20 ms frames at fixed positions of the recording (frame k covers
  samples ``k*F .. (k+1)*F``), whatever blocks the decoder delivers; the last frame may be
  shorter. A frame's level is its RMS in dBFS (full scale = 1.0).
- The noise floor at frame k is the quietest frame of the last ``noise_window_s`` (5 s) up to
  and including k: it only looks back, so the decision is made as the samples arrive.
- A frame is *silent* when its level is under ``max(floor_db, min(noise + margin_db, ceiling_db))``:
  under -45 dBFS always; in a noisy recording under its noise floor + 10 dB; but never counting
  anything over -30 dBFS as silence (loud background is kept, not guessed at).
- A run of silent frames lasting ``min_silence_s`` (1 s) or more is dropped except
  ``keep_gap_s`` (0.25 s): half of it after the sound before, half before the sound after, so
  words on either side stay apart. A run at the very start keeps only its end half, at the very
  end only its start half. Shorter runs are kept whole.

Same samples → same spans, whatever the block sizes (each frame's samples and each floor are
the same). Spans are ``(start_sample, end_sample)`` of the source timeline.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

__all__ = ["SilenceRule", "SilenceSplitter", "kept_spans"]


@dataclass(frozen=True)
class SilenceRule:
    """The energy rule's parameters (module doc)."""

    frame_s: float = 0.02
    floor_db: float = -45.0
    margin_db: float = 10.0
    ceiling_db: float = -30.0
    noise_window_s: float = 5.0
    min_silence_s: float = 1.0
    keep_gap_s: float = 0.25

    def describe(self) -> str:
        return (
            f"energy: {self.frame_s * 1000:g} ms frames under max({self.floor_db:g} dBFS, "
            f"min(noise floor + {self.margin_db:g} dB, {self.ceiling_db:g} dBFS)) are silent "
            f"(noise floor: the quietest frame of the last {self.noise_window_s:g} s); silences of "
            f"{self.min_silence_s:g} s or more dropped, {self.keep_gap_s:g} s of each kept"
        )


class SilenceSplitter:
    """Streams samples in (``feed``), gives kept spans out as soon as they are decided.

    ``feed(block)`` and ``finish()`` return the spans decided since the last call, in order;
    consecutive spans may touch (join them). ``decided`` is the sample up to which every sample's
    fate is known: a caller buffering samples needs to keep only those from ``decided`` on
    (at most about ``min_silence_s`` plus a frame)."""

    def __init__(self, rate: int, rule: SilenceRule = SilenceRule()):
        if rule.keep_gap_s > rule.min_silence_s:
            raise ValueError("keep_gap_s must not exceed min_silence_s")
        self.rule = rule
        self.rate = rate
        self.frame = max(1, round(rule.frame_s * rate))
        self.min_run = max(1, round(rule.min_silence_s * rate))
        self.half_gap = round(rule.keep_gap_s * rate / 2)
        self.window = max(1, round(rule.noise_window_s / rule.frame_s))
        self.decided = 0
        self.kept = 0  # samples kept so far
        self._pos = 0  # samples classified (a multiple of frame until finish)
        self._carry = np.zeros(0, dtype=np.float32)
        self._mins: deque[tuple[int, float]] = deque()  # (frame index, level) rising: the window's minimum first
        self._k = 0
        self._run: int | None = None  # start of the current silent run
        self._run_front = False  # its first half gap is given out already

    @staticmethod
    def levels_db(frames: np.ndarray) -> np.ndarray:
        """Each row's RMS in dBFS (-120 for digital silence); rows are frames."""
        ms = np.square(frames, dtype=np.float64).mean(axis=1)
        return np.where(ms > 1e-12, 10.0 * np.log10(np.maximum(ms, 1e-12)), -120.0)

    def _silent(self, db: float) -> bool:
        while self._mins and self._mins[-1][1] >= db:
            self._mins.pop()
        self._mins.append((self._k, db))
        while self._mins[0][0] <= self._k - self.window:
            self._mins.popleft()
        self._k += 1
        r = self.rule
        return db < max(r.floor_db, min(self._mins[0][1] + r.margin_db, r.ceiling_db))

    def _give(self, out: list[tuple[int, int]], a: int, b: int) -> None:
        if b > a:
            out.append((a, b))
            self.kept += b - a
        self.decided = max(self.decided, b)

    def _close_run(self, out: list[tuple[int, int]], end: int, last: bool) -> None:
        a = self._run
        assert a is not None
        self._run = None
        if end - a < self.min_run:
            self._give(out, max(a, self.decided), end)
            return
        if a > 0 and not self._run_front:
            self._give(out, a, a + self.half_gap)
        self._run_front = False
        if not last:
            self._give(out, max(self.decided, end - self.half_gap), end)
        self.decided = end

    def _frame(self, out: list[tuple[int, int]], size: int, db: float) -> None:
        a, b = self._pos, self._pos + size
        self._pos = b
        if self._silent(db):
            if self._run is None:
                self._run, self._run_front = a, False
            if b - self._run >= self.min_run:  # a long silence: its front gap is known, the rest waits
                if self._run > 0 and not self._run_front:
                    self._give(out, self._run, self._run + self.half_gap)
                    self._run_front = True
                self.decided = max(self.decided, b - self.half_gap)
            return
        if self._run is not None:
            self._close_run(out, a, last=False)
        self._give(out, a, b)

    def feed(self, block: np.ndarray) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        x = (
            np.concatenate([self._carry, np.asarray(block, dtype=np.float32).reshape(-1)])
            if self._carry.size
            else block
        )
        n = (x.size // self.frame) * self.frame
        for db in self.levels_db(x[:n].reshape(-1, self.frame)).tolist():
            self._frame(out, self.frame, db)
        self._carry = np.array(x[n:], dtype=np.float32)
        return out

    def finish(self) -> list[tuple[int, int]]:
        out: list[tuple[int, int]] = []
        if self._carry.size:
            self._frame(out, self._carry.size, float(self.levels_db(self._carry.reshape(1, -1))[0]))
            self._carry = np.zeros(0, dtype=np.float32)
        if self._run is not None:
            self._close_run(out, self._pos, last=True)
        return out


def kept_spans(
    samples: np.ndarray, rate: int, rule: SilenceRule = SilenceRule(), block: int = 0
) -> list[tuple[int, int]]:
    """The kept spans of a whole array (joined where they touch), fed in blocks of ``block``
    samples (0: at once)."""
    s = SilenceSplitter(rate, rule)
    raw: list[tuple[int, int]] = []
    step = block or max(1, samples.size)
    for i in range(0, samples.size, step):
        raw += s.feed(samples[i : i + step])
    raw += s.finish()
    joined: list[tuple[int, int]] = []
    for a, b in raw:
        if joined and joined[-1][1] == a:
            joined[-1] = (joined[-1][0], b)
        else:
            joined.append((a, b))
    return joined
