"""What a step of the scheduler costs, measured as it runs, and how many prompt rows the next
step takes: the slicing rule of chunked prefill, apart from the step loop.

- Beside running streams, a step may take about ``1 + prefill_share`` times what the streams'
  own tokens take alone: running streams slow down at most about that much while a new prompt
  or picture is evaluated.
- When the prompt rows go in the streams' batch (``mixed``: text, or a picture's rows with the
  tokens as embedding rows, ``backend.tokrows``), the rows of the next such step are steered by
  what the last one with as many streams took against that time (``STEER``; the rows keep their
  fraction, so moves of a few percent add up): on a CPU most of a small batch is the pass over
  the weights, so no per-row price predicts it well. Otherwise (a picture's rows in a
  batch of their own) the rows are their own share of it, at the measured price of a row.
- Alone — nobody generating — prompt work goes one micro-batch (``n_ubatch`` rows) a step, and
  a picture's rows in a batch of their own the same (``part``): the step loop looks for arrivals
  after each, and nothing measured decides the cut. A request that runs alone is computed in
  the same batches every run, so its greedy tokens are the same on a quiet machine or a busy
  one (llama.cpp's kernels sum in an order that depends on the batch's shape). Before #57 these
  cuts followed measured times (steps of about 1.5 s, parts of about 0.3 s), and the same
  request could answer differently.
"""

from __future__ import annotations

__all__ = ["MIN_SLICE", "StepCosts"]

MIN_SLICE = 4  # prompt rows a step takes at least beside running streams
GEN_SHARE = 0.7  # the tokens' part of a mixed step of a few rows, at least (CPU: most of it)
STEER = (0.7, 1.3)  # how far one mixed step moves the next one's rows, down and up


class StepCosts:
    """What steps take — a step of ``n`` streams' tokens (per ``n``), a prompt row on its own
    (``row_ms``) — and the rows the next step takes."""

    def __init__(self, prefill_share: float, unit: int):
        self.prefill_share = prefill_share
        self.unit = max(1, unit)  # a micro-batch: the prompt rows of a step alone
        self.gen_ms: dict[int, float] = {}  # streams → what a step of their tokens takes
        self.row_ms = 0.0  # what one prompt row takes
        self.mix_rows: dict[int, float] = {}  # streams → prompt rows of their next mixed step

    def rows(self, streams: int, room: int, mixed: bool = False) -> int:
        """Prompt rows for a step with ``streams`` generating and ``room`` rows left in the
        batch; ``mixed``: in the streams' batch (else in one of their own)."""
        if not streams:  # alone: a micro-batch, whatever the clock says (module doc)
            return min(room, self.unit)
        if self.row_ms <= 0:
            return min(room, MIN_SLICE)
        if mixed and self.mix_rows:
            return max(MIN_SLICE, min(room, int(self.mixed_rows(streams))))
        return max(MIN_SLICE, min(room, int(self.prefill_share * self.gen_cost(streams) / self.row_ms)))

    def part(self, n: int) -> int:
        """Of ``n`` prompt rows in a batch of their own, those of one part: a micro-batch (a
        request that arrives meanwhile waits at most that)."""
        return min(n, self.unit)

    def measured(self, streams: int, rows: int, ms: float, mixed: bool = False) -> None:
        """A step of ``streams`` tokens and ``rows`` prompt rows took ``ms`` (``mixed``: a
        picture's rows among them, in the same batch)."""
        if streams and not rows:
            self._gen(streams, ms)
        elif not streams:
            self.measured_rows(rows, ms)
        elif mixed:  # steer the next mixed step's rows to the time it may take
            if streams not in self.gen_ms:  # (first seen beside rows: what the rows did not take)
                self._gen(streams, max(GEN_SHARE * ms, ms - rows * self.row_ms))
            target = (1 + self.prefill_share) * self.gen_cost(streams)
            lo, hi = STEER
            f = min(hi, max(lo, target / ms)) if ms > 0 else hi
            last = self.mixed_rows(streams)
            if rows < int(last) and f > 1:  # (the picture had fewer left: no news)
                return
            base = last if rows == int(last) else rows  # (a step of 4 rows steered to 4.9 is not stuck)
            self.mix_rows[streams] = max(float(MIN_SLICE), base * f)
        elif self.row_ms > 0:  # both: the generation's part is what the rows did not take
            self._gen(streams, max(0.0, ms - rows * self.row_ms))

    def mixed_rows(self, streams: int) -> float:
        """The prompt rows steered for a mixed step of ``streams`` (a count not seen yet starts
        from the nearest one's; 0 while none is)."""
        if not self.mix_rows:
            return 0.0
        return self.mix_rows.get(streams) or self.mix_rows[min(self.mix_rows, key=lambda m: abs(m - streams))]

    def measured_rows(self, rows: int, ms: float) -> None:
        if rows > 0 and ms > 0:
            per = ms / rows
            self.row_ms = per if not self.row_ms else 0.8 * self.row_ms + 0.2 * per

    def gen_cost(self, n: int) -> float:
        """What a step of ``n`` streams' tokens takes: measured at n, else the nearest count
        measured (a token more or less costs about a prompt row), else (nothing measured yet)
        n prompt rows."""
        if n in self.gen_ms:
            return self.gen_ms[n]
        if self.gen_ms:
            k = min(self.gen_ms, key=lambda m: abs(m - n))
            return self.gen_ms[k] + max(0, n - k) * self.row_ms
        return n * self.row_ms

    def _gen(self, n: int, ms: float) -> None:
        old = self.gen_ms.get(n)
        self.gen_ms[n] = ms if old is None else 0.8 * old + 0.2 * ms

    def to_dict(self) -> dict[str, object]:
        return {
            "rows": round(self.row_ms, 2),
            "streams": {n: round(ms, 2) for n, ms in sorted(self.gen_ms.items())},
            "mixed_rows": {n: round(r, 1) for n, r in sorted(self.mix_rows.items())},
        }
