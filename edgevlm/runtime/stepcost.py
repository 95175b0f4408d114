"""What a step of the scheduler costs, measured as it runs, and how many prompt rows the next
step takes: the slicing rule of chunked prefill, apart from the step loop.

- Beside running streams, a step takes about ``prefill_share`` times the work of the streams'
  own tokens in prompt rows (at least ``MIN_SLICE``): running streams slow down at most about
  that much while a new prompt or picture is evaluated.
- Alone, prompt work goes in steps of about ``PROMPT_STEP_MS`` (fewer rows than the batch holds on
  a slow device), so a request that arrives meanwhile — a follow-up's few rows — joins soon; on a
  GPU the whole batch fits in it.
"""

from __future__ import annotations

__all__ = ["MIN_SLICE", "PROMPT_STEP_MS", "StepCosts"]

MIN_SLICE = 4  # prompt rows a step takes at least beside running streams
PROMPT_STEP_MS = 1500.0


class StepCosts:
    """Moving averages of what one prompt row costs and what a step of ``n`` streams' tokens
    costs (per ``n``), and the rows the next step takes."""

    def __init__(self, prefill_share: float):
        self.prefill_share = prefill_share
        self.gen_ms: dict[int, float] = {}  # streams → what a step of their tokens takes
        self.row_ms = 0.0  # what one prompt row takes

    def rows(self, streams: int, room: int) -> int:
        """Prompt rows for a step with ``streams`` generating and ``room`` rows left in the batch."""
        if self.row_ms <= 0:
            return room if not streams else min(room, MIN_SLICE)
        if not streams:
            return max(MIN_SLICE, min(room, int(PROMPT_STEP_MS / self.row_ms)))
        return max(MIN_SLICE, min(room, int(self.prefill_share * self.gen_cost(streams) / self.row_ms)))

    def measured(self, streams: int, rows: int, ms: float) -> None:
        """A decode of ``streams`` tokens and ``rows`` prompt rows took ``ms``."""
        if streams and not rows:
            self._gen(streams, ms)
        elif not streams:
            self.measured_rows(rows, ms)
        elif self.row_ms > 0:  # both: the generation's part is what the rows did not take
            self._gen(streams, max(0.0, ms - rows * self.row_ms))

    def measured_rows(self, rows: int, ms: float) -> None:
        if rows > 0 and ms > 0:
            per = ms / rows
            self.row_ms = per if not self.row_ms else 0.8 * self.row_ms + 0.2 * per

    def gen_cost(self, n: int) -> float:
        """What a step of ``n`` streams' tokens takes: measured at n, else scaled from the
        nearest count measured, else (nothing measured yet) n prompt rows."""
        if n in self.gen_ms:
            return self.gen_ms[n]
        if self.gen_ms:
            k = min(self.gen_ms, key=lambda m: abs(m - n))
            return self.gen_ms[k] * n / k
        return n * self.row_ms

    def _gen(self, n: int, ms: float) -> None:
        old = self.gen_ms.get(n)
        self.gen_ms[n] = ms if old is None else 0.8 * old + 0.2 * ms

    def to_dict(self) -> dict[str, object]:
        return {"rows": round(self.row_ms, 2), "streams": {n: round(ms, 2) for n, ms in sorted(self.gen_ms.items())}}
