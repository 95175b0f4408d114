"""Ctrl-C and SIGTERM for long runs (``caption``, ``batch``): stop politely, then less so."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

__all__ = ["StopSignals"]


class StopSignals:
    """Ctrl-C / SIGTERM. First: finish the images in progress (one, or up to --parallel), then
    stop (exit 130, summary). Second: abandon them at the next token. Third, or second while the model loads: exit
    at once — safe, since every record on disk is complete (the kernel drops the lock)."""

    def __init__(self, token, ui, what: str = "image(s)"):
        self.token = token
        self.ui = ui
        self.what = what
        self.saved: dict[int, Any] = {}
        self.closing = False
        self.running = False  # the caption loop has started (it checks the token)
        self.count = 0

    def _handler(self, signum, frame):
        if self.closing:
            return
        self.count += 1
        if self.count == 1:
            self.token.request()
            self.ui.note(
                f"finishing the {self.what} in progress, then stopping (Ctrl-C again to stop now)"
                if self.running
                else "stopping once the model has loaded (Ctrl-C again to quit now)"
            )
        elif self.count == 2 and self.running:
            self.token.abandon()
            self.ui.note(f"stopping now: the {self.what} in progress are left for the next run")
        else:
            self.ui.stop()
            print("stopped", file=sys.stderr, flush=True)
            os._exit(130)

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.saved[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc):
        # We are exiting anyway: a late Ctrl-C must not turn exit code 130 into a traceback.
        self.closing = True
        for sig in self.saved:
            signal.signal(sig, signal.SIG_IGN)
