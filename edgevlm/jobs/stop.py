"""Stopping a long run cleanly (Ctrl-C): a caption run, a batch file, their Ray versions."""

from __future__ import annotations

__all__ = ["StopToken"]


class StopToken:
    """Ctrl-C, the polite way. ``request()``: stop after the image(s) in progress. ``abandon()``:
    stop at the next safe point (between generated tokens, or while waiting for an image)
    without writing the image(s) in progress, which a rerun does. Flags only: a signal handler may call them
    at any moment (even inside a llama.cpp log callback, where an exception would be lost)."""

    def __init__(self) -> None:
        self.requested = False
        self.abandoned = False

    def request(self) -> None:
        self.requested = True

    def abandon(self) -> None:
        self.requested = self.abandoned = True

    def check(self) -> None:
        if self.abandoned:
            raise KeyboardInterrupt
