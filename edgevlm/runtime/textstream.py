"""Generated tokens → text that is safe to show: an incremental UTF-8 decoder (a character split
over two tokens waits for its second half) and stop strings (text that could still grow into a
stop string is held back; a stop string found ends the reply and is cut off, with the tokens
past it).

Text and tokens always agree: ``tokens`` detokenize to ``text``. When a stop string begins
inside a token, the part of that token before it is kept as text and stands in ``tokens`` as
its own tokenization (``tokenize``), so the history a client sends back matches what it saw."""

from __future__ import annotations

import codecs
from collections.abc import Callable

__all__ = ["TextStream"]


class TextStream:
    def __init__(self, stops: list[str] | tuple[str, ...] = (), tokenize: Callable[[str], list[int]] | None = None):
        self.stops = [s for s in stops if s]
        self.tokenize = tokenize
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.tokens: list[int] = []
        self.text = ""
        self.emitted = 0  # characters handed out so far
        self._ends: list[int] = []  # text length after each token

    def add(self, token: int, piece: bytes) -> tuple[str, bool]:
        """Take one generated token; returns (new text to show, whether a stop string ended the
        reply)."""
        before = len(self.text)
        self.tokens.append(token)
        self.text += self.decoder.decode(piece)
        self._ends.append(len(self.text))
        cut = self._find_stop(before)
        if cut is not None:
            out = self.text[self.emitted : cut]  # held-back text never contains a stop's start
            self.text = self.text[:cut]
            self.emitted = cut
            keep = sum(1 for e in self._ends if e <= cut)
            start = self._ends[keep - 1] if keep else 0
            del self.tokens[keep:]
            del self._ends[keep:]
            partial = self.text[start:cut]  # a token's text before the stop string began
            if partial and self.tokenize is not None:
                self.tokens += self.tokenize(partial)
                self._ends.append(cut)
            return out, True
        safe = len(self.text) - self._overlap()
        if safe > self.emitted:
            out = self.text[self.emitted : safe]
            self.emitted = safe
            return out, False
        return "", False

    def rest(self) -> str:
        """What is still held back (the reply ended: it can no longer become a stop string)."""
        out = self.text[self.emitted :]
        self.emitted = len(self.text)
        return out

    def _find_stop(self, before: int) -> int | None:
        best = None
        for s in self.stops:
            i = self.text.find(s, max(0, before - len(s)))
            if i >= 0 and (best is None or i < best):
                best = i
        return best

    def _overlap(self) -> int:
        """Length of the longest suffix of the text that could still grow into a stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if s.startswith(self.text[-n:]):
                    best = n
                    break
        return best
