"""One sink for llama.cpp's two loggers (llama/ggml and clip/mtmd).

``system.install_log_sink`` routes both loggers to ``on_text``. llama.cpp logs in fragments
(``GGML_LOG_LEVEL_CONT``); lines are re-joined on newlines here so
listeners see whole lines. By default nothing is printed (edgevlm is silent unless ``--verbose``);
``capture()`` collects the lines of a block of code so callers can parse buffer sizes and timings.
"""

from __future__ import annotations

import contextlib
import re
import sys
import threading
from collections.abc import Iterator
from typing import TypedDict


class _State(TypedDict):
    echo: bool  # print llama.cpp's log to stderr
    partial: str  # the last line, until its newline comes


_lock = threading.Lock()
_state: _State = {"echo": False, "partial": ""}
_listeners: list[list[str]] = []

__all__ = ["buffer_sizes", "capture", "on_text", "set_echo"]


def on_text(level: int, text: bytes, _user) -> None:
    """The callback llama.cpp's loggers call (never raises into C)."""
    try:
        s = text.decode("utf-8", errors="replace") if text else ""
    except Exception:  # never raise into C
        return
    with _lock:
        if _state["echo"]:
            sys.stderr.write(s)
            sys.stderr.flush()
        buf = _state["partial"] + s
        *lines, rest = buf.split("\n")
        _state["partial"] = rest
        if lines:
            for sink in _listeners:
                sink.extend(lines)


def set_echo(echo: bool) -> None:
    """Print llama.cpp's own log to stderr (``--verbose``)."""
    _state["echo"] = echo


@contextlib.contextmanager
def capture() -> Iterator[list[str]]:
    """Collect the whole log lines emitted inside the block."""
    lines: list[str] = []
    with _lock:
        _listeners.append(lines)
    try:
        yield lines
    finally:
        with _lock:  # by identity: nested captures may hold equal lists
            for i, sink in enumerate(_listeners):
                if sink is lines:
                    del _listeners[i]
                    break


_MIB = re.compile(r"([A-Za-z_]+):\s+(\S+)\s+(.*?)\s*=\s*([0-9.]+)\s*MiB")


def buffer_sizes(lines: list[str]) -> list[tuple[str, str, str, float]]:
    """``(function, buffer, what, MiB)`` for llama.cpp's ``... buffer size = X MiB`` lines."""
    out = []
    for line in lines:
        if "buffer size" not in line and "model size" not in line:
            continue
        m = _MIB.search(line)
        if m:
            out.append((m.group(1), m.group(2), m.group(3), float(m.group(4))))
    return out
