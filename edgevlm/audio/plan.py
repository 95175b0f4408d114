"""A recording under a token budget: decode it as a stream, drop its long silences, pack what is
kept into pieces of at most the encoder's window, and stop decoding as soon as the next piece
would not fit — so a one-hour file under a 2,000-token budget is decoded only as far as the two
pieces it can send, and never held whole.

Each piece is one bitmap for mtmd: its samples (float32 mono at ``rate``), the stretches of the
source it covers (``spans``: the silence between them was dropped; a quarter second of each
dropped silence stays in, so speech stays apart), its cost (``tokens_for(len(samples))``, the
model's own arithmetic, given by the caller) and a ``label`` (``[0:00.0–0:12.4, 0:31.0–0:48.2]``)
the prompt puts before it. ``sha256`` is of the rate and the samples: the same audio gives the
same digest from any file format.

The plan (``AudioPlan.to_dict()``, for ``edgevlm budget --json``) says what was decoded, kept,
dropped and left out, and why (``notes``, ``rule``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ContextExceeded, InputError
from .decode import SAMPLE_RATE, AudioLimits, iter_samples
from .silence import SilenceRule, SilenceSplitter

__all__ = ["AudioPiece", "AudioPlan", "mmss", "plan_audio", "span_text"]


def mmss(seconds: float) -> str:
    """``m:ss`` (``h:mm:ss`` from an hour), rounded to the second: lengths in notes."""
    whole = max(0, int(seconds + 0.5))
    h, rest = divmod(whole, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


def span_text(t: float) -> str:
    """``m:ss.s`` (``h:mm:ss.s`` from an hour): a timestamp in a piece's label."""
    tenths = max(0, int(t * 10 + 0.5))
    whole, frac = divmod(tenths, 10)
    h, rest = divmod(whole, 3600)
    if h:
        return f"{h}:{rest // 60:02d}:{rest % 60:02d}.{frac}"
    return f"{rest // 60}:{rest % 60:02d}.{frac}"


@dataclass(frozen=True)
class AudioPiece:
    """One piece of a recording sent to the encoder (at most one window)."""

    samples: np.ndarray = field(compare=False, repr=False)  # float32 mono at the plan's rate
    spans: tuple[tuple[float, float], ...]  # source-timeline seconds it covers, in order
    tokens: int
    sha256: str  # of the rate and the samples' bytes
    source: str  # the recording's name

    @property
    def label(self) -> str:
        return "[" + ", ".join(f"{span_text(a)}–{span_text(b)}" for a, b in self.spans) + "]"


@dataclass(frozen=True)
class AudioPlan:
    name: str
    rate: int
    window_samples: int
    duration_s: float | None  # decoded to the end, or the header's when decoding stopped early
    decoded_s: float  # how far decoding went
    speech_s: float  # kept (what the pieces hold)
    silence_dropped_s: float  # dropped before the cut
    pieces: tuple[dict[str, Any], ...]  # {start, end, spans, tokens, label}
    total_tokens: int
    budget_tokens: int | None
    cut: bool  # the budget stopped the recording
    left_out_s: float | None  # source seconds after the cut (None: length unknown)
    notes: tuple[str, ...]
    rule: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "rate": self.rate,
            "window_samples": self.window_samples,
            "duration_s": None if self.duration_s is None else round(self.duration_s, 3),
            "decoded_s": round(self.decoded_s, 3),
            "speech_s": round(self.speech_s, 3),
            "silence_dropped_s": round(self.silence_dropped_s, 3),
            "pieces": [dict(p) for p in self.pieces],
            "total_tokens": self.total_tokens,
            "budget_tokens": self.budget_tokens,
            "cut": self.cut,
            "left_out_s": None if self.left_out_s is None else round(self.left_out_s, 3),
            "notes": list(self.notes),
            "rule": self.rule,
        }


class _Pending:
    """Samples decoded but not yet packed (those whose silence verdict waits), indexed by their
    position in the recording; compacted in place, so appending is amortised O(block)."""

    def __init__(self, capacity: int):
        self.data = np.empty(capacity, dtype=np.float32)
        self.start = 0  # recording position of data[lo]
        self.lo = self.hi = 0

    def append(self, block: np.ndarray) -> None:
        n = block.size
        if self.hi + n > self.data.size:
            live = self.hi - self.lo
            if live + n > self.data.size:
                grown = np.empty(max(2 * self.data.size, live + n), dtype=np.float32)
                grown[:live] = self.data[self.lo : self.hi]
                self.data = grown
            else:
                self.data[:live] = self.data[self.lo : self.hi]
            self.lo, self.hi = 0, live
        self.data[self.hi : self.hi + n] = block
        self.hi += n

    def get(self, a: int, b: int) -> np.ndarray:
        return self.data[self.lo + a - self.start : self.lo + b - self.start]

    def drop_before(self, pos: int) -> None:
        k = min(pos - self.start, self.hi - self.lo)
        if k > 0:
            self.lo += k
            self.start += k


def _largest_fitting(tokens_for: Callable[[int], int], window: int, room: int) -> int:
    """The most samples (≤ window) a piece may hold within ``room`` tokens (0: none);
    ``tokens_for`` is taken to grow with the length."""
    if tokens_for(window) <= room:
        return window
    lo, hi = 0, window  # tokens_for(lo) fits (or lo == 0), tokens_for(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tokens_for(mid) <= room:
            lo = mid
        else:
            hi = mid
    return lo


class _Packer:
    def __init__(self, name: str, rate: int, window: int, tokens_for: Callable[[int], int], budget: int | None):
        self.name, self.rate, self.window, self.tokens_for, self.budget = name, rate, window, tokens_for, budget
        self.pieces: list[AudioPiece] = []
        self.total = 0
        self.cut_at: int | None = None
        self.buf: np.ndarray | None = None
        self.n = self.cap = 0
        self.spans: list[list[int]] = []

    def _start(self, at: int) -> bool:
        room = self.window if self.budget is None else self.budget - self.total
        self.cap = self.window if self.budget is None else _largest_fitting(self.tokens_for, self.window, room)
        if self.cap == 0:
            self.cut_at = at
            return False
        self.buf, self.n, self.spans = np.empty(self.cap, dtype=np.float32), 0, []
        return True

    def full(self) -> bool:
        """No piece open and no room left for even one sample."""
        return self.buf is None and self.budget is not None and self.tokens_for(1) > self.budget - self.total

    def take(self, a: int, b: int, pending: _Pending) -> bool:
        """Pack samples [a, b); False once the budget has stopped the recording."""
        while a < b:
            if self.buf is None and not self._start(a):
                return False
            assert self.buf is not None
            m = min(b - a, self.cap - self.n)
            self.buf[self.n : self.n + m] = pending.get(a, a + m)
            self.n += m
            if self.spans and self.spans[-1][1] == a:
                self.spans[-1][1] = a + m
            else:
                self.spans.append([a, a + m])
            a += m
            if self.n == self.cap:
                self.close()
        return True

    def close(self) -> None:
        if self.buf is None or self.n == 0:
            self.buf = None
            return
        x = self.buf if self.n == self.buf.size else self.buf[: self.n].copy()
        self.buf = None
        h = hashlib.sha256(f"{self.rate}:".encode())
        h.update(x.data)  # the samples' bytes, not copied
        digest = h.hexdigest()
        tokens = int(self.tokens_for(x.size))
        spans = tuple((a / self.rate, b / self.rate) for a, b in self.spans)
        self.pieces.append(AudioPiece(x, spans, tokens, digest, self.name))
        self.total += tokens


def plan_audio(
    source: str | bytes | os.PathLike[str],
    name: str,
    *,
    window_samples: int,
    tokens_for: Callable[[int], int],
    budget_tokens: int | None,
    keep_silence: bool = False,
    limits: AudioLimits = AudioLimits(),
    rate: int = SAMPLE_RATE,
    hold: Callable[[int], None] | None = None,
    rule: SilenceRule = SilenceRule(),
) -> tuple[AudioPlan, list[AudioPiece]]:
    """Plan and cut ``source`` (a path or the file's bytes) into pieces of at most
    ``window_samples`` samples costing ``tokens_for(n)`` tokens each, within ``budget_tokens``
    (None: no limit), long silences dropped unless ``keep_silence``. ``hold(nbytes)`` is told,
    once and before the first sample is decoded, the most host memory this holds: the decoder's
    peak, the samples awaiting a silence verdict and the pieces the budget lets it keep.

    A budget smaller than the shortest piece is ``ContextExceeded``; every problem with the file
    an ``InputError`` naming ``name`` (``decode.iter_samples``)."""
    if window_samples < 1:
        raise InputError(f"{name}: the audio window must be at least one sample (got {window_samples})")
    if budget_tokens is not None and tokens_for(1) > budget_tokens:
        whole = tokens_for(window_samples)
        what = (
            f"one {window_samples / rate:g} s piece costs {whole:,} tokens"
            if whole == tokens_for(1)
            else f"the shortest piece of audio costs {tokens_for(1):,} tokens"
        )
        raise ContextExceeded(f"{name}: {what} but only {max(0, budget_tokens):,} are left")
    splitter = None if keep_silence else SilenceSplitter(rate, rule)
    pending = _Pending(round((rule.min_silence_s + 1.0) * rate))
    packer = _Packer(name, rate, window_samples, tokens_for, budget_tokens)

    def leased(nbytes: int) -> None:
        if hold is None:
            return
        seconds = limits.max_seconds
        if stream.info.duration_s is not None:  # the bomb rule stops decoding past this
            seconds = min(seconds, stream.info.duration_s * limits.slack + limits.slack_s)
        most = int(seconds * rate)
        if budget_tokens is not None:
            per = max(1, tokens_for(window_samples))
            full = budget_tokens // per
            most = min(
                most, full * window_samples + _largest_fitting(tokens_for, window_samples, budget_tokens - full * per)
            )
        hold(nbytes + pending.data.nbytes + most * 4)

    pos = 0
    with iter_samples(source, name, rate=rate, limits=limits, hold=leased) as stream:  # (leased reads stream)
        going = True
        for block in stream:
            if packer.full():  # the budget is spent and the recording goes on: stop decoding here
                packer.cut_at = pos
                going = False
                break
            pending.append(block)
            a, pos = pos, pos + block.size
            spans = [(a, pos)] if splitter is None else splitter.feed(block)
            going = all(packer.take(s, e, pending) for s, e in spans)
            if not going:
                break
            pending.drop_before(pos if splitter is None else splitter.decided)
        if going and splitter is not None:
            going = all(packer.take(s, e, pending) for s, e in splitter.finish())
        if going:
            packer.close()
        notes = list(stream.notes)
        declared = stream.info.duration_s
    return _summary(name, rate, window_samples, budget_tokens, packer, pos, declared, notes, splitter, rule)


def _summary(
    name: str,
    rate: int,
    window: int,
    budget: int | None,
    packer: _Packer,
    decoded: int,
    declared: float | None,
    notes: list[str],
    splitter: SilenceSplitter | None,
    rule: SilenceRule,
) -> tuple[AudioPlan, list[AudioPiece]]:
    pieces = packer.pieces
    cut = packer.cut_at is not None
    # the cut: the end of the last audio sent (what lies after it was not sent, silence or not)
    end = (round(pieces[-1].spans[-1][1] * rate) if pieces else 0) if cut else decoded
    speech = sum(p.samples.size for p in pieces) / rate
    dropped = max(0.0, end / rate - speech)
    duration = declared if cut else decoded / rate
    left_out = None if duration is None else (max(0.0, duration - end / rate) if cut else 0.0)
    if splitter is not None:
        if not pieces and not cut:
            notes.append(f"{name}: nothing but silence under the rule below: no audio to send")
        elif dropped > 0:
            whole = f" from {mmss(end / rate)}" + (" before the cut" if cut else "")
            notes.append(f"kept {mmss(speech)} of speech{whole} ({mmss(dropped)} silence dropped)")
    if cut:
        rest = f"{mmss(left_out)} not sent" if left_out is not None else "the rest not sent"
        notes.append(f"cut to the {budget:,}-token budget: {rest} (0:00–{mmss(end / rate)} kept)")
    plan = AudioPlan(
        name=name,
        rate=rate,
        window_samples=window,
        duration_s=duration,
        decoded_s=decoded / rate,
        speech_s=speech,
        silence_dropped_s=dropped,
        pieces=tuple(
            {
                "start": p.spans[0][0],
                "end": p.spans[-1][1],
                "spans": [list(s) for s in p.spans],
                "tokens": p.tokens,
                "label": p.label,
            }
            for p in pieces
        ),
        total_tokens=packer.total,
        budget_tokens=budget,
        cut=cut,
        left_out_s=left_out,
        notes=tuple(notes),
        rule="none: silence kept" if splitter is None else rule.describe(),
    )
    return plan, pieces
