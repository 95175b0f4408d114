"""A reply's text as it streams → answer text, reasoning and tool calls (``Delta``s).

Reasoning: a reply that starts inside ``<think>`` (the template opened it) or with it is
reasoning up to ``</think>``. Tool calls (when the request offered tools): from the format's
marker on (``<tool_call>``, ``[TOOL_CALLS]``, ``<|python_tag|>``), or a reply whose answer
starts with ``{``/``[``, the text is held back until the reply ends, then parsed
(``runtime.toolformat.parse_calls``); what is not a call after all is sent as text then. Text
that could still grow into a marker is held back too, so a client never sees half a marker.

A reply cut off (max_tokens, the deadline) inside a call, or a forced call (the grammar's) that
does not parse, never reaches the client as text: its calls come out as far as they got
(``runtime.toolformat.parse_cut``; the last one ``partial``, its arguments the JSON text as
generated), a marker begun at its end is dropped, and a call whose function cannot be told is
left out. Only a reply that is no call after all (a JSON answer cut off) is still text.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..runtime.toolformat import markers, parse_calls, parse_cut
from .request import Delta, ToolCall, new_id

__all__ = ["ReplySplitter", "call_id"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def call_id(fmt: str, given: str = "") -> str:
    """A tool call's id: the one the model wrote, else a new one (Mistral's templates want nine
    letters and digits)."""
    if given:
        return given
    return new_id("")[:9] if fmt == "mistral" else new_id("call_")


def _partial(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReplySplitter:
    def __init__(
        self,
        fmt: str = "hermes",
        tools: Sequence[str] = (),
        thinking: bool = False,
        may_think: bool = False,
        forced: str | None = None,
    ):
        """``tools``: the names offered (none: no tool parsing); ``thinking``: the reply starts
        inside ``<think>``; ``may_think``: it may open one itself; ``forced``: "any" or the
        function's name when a grammar makes the reply a call."""
        self.fmt, self.names, self.forced = fmt, list(tools), forced
        self.phase = "reasoning" if thinking else ("start" if may_think else "content")
        self.buf = ""  # text not sent yet
        self.held = ""  # tool phase: everything from the marker on
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ToolCall] = []

    # --- streaming -----------------------------------------------------------------------------
    def feed(self, text: str) -> list[Delta]:
        self.buf += text
        out: list[Delta] = []
        while True:
            before = (self.phase, len(self.buf))
            if self.phase == "start":
                self._start()
            elif self.phase == "reasoning":
                self._reasoning(out)
            elif self.phase == "content":
                self._content(out)
            else:  # tools: hold everything
                self.held += self.buf
                self.buf = ""
            if (self.phase, len(self.buf)) == before:
                return out

    def _start(self) -> None:
        s = self.buf.lstrip()
        if s.startswith(THINK_OPEN):
            self.buf = s[len(THINK_OPEN) :]
            self.phase = "reasoning"
        elif not (THINK_OPEN.startswith(s)):  # (all blank, or a prefix of <think>: wait)
            self.phase = "content"

    def _reasoning(self, out: list[Delta]) -> None:
        i = self.buf.find(THINK_CLOSE)
        if i >= 0:
            self._say(out, "reasoning", self.buf[:i].rstrip())
            self.buf = self.buf[i + len(THINK_CLOSE) :].lstrip()
            self.phase = "content"
            return
        keep = _partial(self.buf, THINK_CLOSE)
        keep += len(self.buf[: len(self.buf) - keep]) - len(self.buf[: len(self.buf) - keep].rstrip())
        self._say(out, "reasoning", self.buf[: len(self.buf) - keep])  # (blanks wait: they may end it)
        self.buf = self.buf[len(self.buf) - keep :]

    def _content(self, out: list[Delta]) -> None:
        if not self.names:
            self._say(out, "text", self.buf)
            self.buf = ""
            return
        if not self.content:  # (the answer has not started: a call may be all of it)
            s = self.buf.lstrip()
            if not s:
                return
            if s[0] in "{[":  # perhaps the whole answer is a call (the JSON fallback)
                self.phase, self.held, self.buf = "tools", s, ""
                return
        hits = [(self.buf.find(m), m) for m in markers(self.fmt)]
        hits = [(i, m) for i, m in hits if i >= 0]
        if hits:
            i = min(hits)[0]
            self._say(out, "text", self.buf[:i])
            self.phase, self.held, self.buf = "tools", self.buf[i:], ""
            return
        keep = max(_partial(self.buf, m) for m in markers(self.fmt))
        self._say(out, "text", self.buf[: len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep :]

    def _say(self, out: list[Delta], kind: str, text: str) -> None:
        if not text:
            return
        if kind == "text":
            if not self.content:
                text = text.lstrip()
                if not text:
                    return
            self.content.append(text)
        else:
            if not self.reasoning:
                text = text.lstrip()
                if not text:
                    return
            self.reasoning.append(text)
        out.append(Delta(kind, text))

    # --- the end -------------------------------------------------------------------------------
    def finish(self, cut: bool = False) -> list[Delta]:
        """The reply ended (``cut``: by max_tokens or the deadline): what was held back, as text
        or as tool calls — a call cut off as far as it got, never as text (see the module doc)."""
        out: list[Delta] = []
        if self.phase in ("start", "content"):
            begun = max(_partial(self.buf, m) for m in markers(self.fmt)) if cut and self.names else 0
            self._say(out, "text", self.buf[: len(self.buf) - begun])  # (a marker begun is no text)
        elif self.phase == "reasoning":  # never closed (cut by max_tokens): all of it was reasoning
            self._say(out, "reasoning", self.buf.rstrip())
        else:
            held = self.held + self.buf
            text, calls = parse_calls(held, self.fmt, self.names)  # (no calls: text is all of it)
            if cut or (self.forced and not calls):
                text, calls = parse_cut(held, self.fmt, self.names, self.forced) or (held, [])
            self._say(out, "text", text)
            for c in calls:
                call = ToolCall(call_id(self.fmt, c.id), c.name, c.arguments, c.partial)
                out.append(Delta("tool_call", call=call, index=len(self.calls)))
                self.calls.append(call)
        self.buf = self.held = ""
        return out

    @property
    def text(self) -> str:
        return "".join(self.content).rstrip()

    @property
    def thought(self) -> str:
        return "".join(self.reasoning)  # (what was streamed: no blanks at either end)
