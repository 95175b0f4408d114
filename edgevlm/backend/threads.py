"""The threads of llama.cpp's two ggml teams: the decoder's (``llama_set_n_threads``, any time)
and the vision encoder's (mtmd reads its context's thread count at every encode, but has no call
to change it).

On a CPU the two teams share the cores. When a picture is encoded beside running streams, two
teams as wide as the cores oversubscribe them (ggml's threads wait for each other at every op).
So the scheduler gives the encoder a part of the cores and the decoder the rest while both run,
and all of them to whichever runs alone; that needs the encoder's count per encode.

``EncoderThreads`` sets mtmd's count through the field mtmd keeps it in: ``mtmd_context::n_threads``
at ``MTMD_THREADS_OFFSET`` in the pinned llama.cpp (llama-cpp-python ``LAYOUT_VERSION``). It is
used only with that version, and checked when the context is made — the field must hold the
count the context was made with, next to its ``print_timings`` flag; elsewhere the count stays
what it was made with and ``settable`` is False: the scheduler then never runs the two teams
at once.
"""

from __future__ import annotations

import ctypes
from typing import Any

__all__ = ["LAYOUT_VERSION", "MTMD_THREADS_OFFSET", "EncoderThreads"]

LAYOUT_VERSION = "0.3.36"  # the llama-cpp-python whose vendored mtmd has this layout

# offsetof(mtmd_context, n_threads): 2 clip pointers, the output vector, the audio-generation clip
# pointer and its 5 vectors (8 + 8 + 24 + 8 + 5 * 24 = 168), then ``bool print_timings``; then it
MTMD_THREADS_OFFSET = 172
_PRINT_TIMINGS_OFFSET = 168


class EncoderThreads:
    """The thread count mtmd's context encodes with (module doc)."""

    def __init__(self, mctx: Any, made_with: int, print_timings: bool, version: str):
        self.made_with = made_with
        self._field: Any = None
        addr = ctypes.cast(mctx, ctypes.c_void_p).value
        if addr and version == LAYOUT_VERSION:
            field = ctypes.c_int32.from_address(addr + MTMD_THREADS_OFFSET)
            flag = ctypes.c_uint8.from_address(addr + _PRINT_TIMINGS_OFFSET).value
            if field.value == made_with and flag == int(print_timings):
                self._field = field

    @property
    def settable(self) -> bool:
        return self._field is not None

    @property
    def value(self) -> int:
        """The count the next encode uses."""
        return int(self._field.value) if self._field is not None else self.made_with

    def release(self) -> None:
        """The context is about to be freed: the field is never written again."""
        self._field = None

    def set(self, n: int) -> None:
        """Encode with ``n`` threads from now on (the caller holds the mtmd lock; a no-op where
        the field was not found)."""
        if self._field is not None and n >= 1:
            self._field.value = n
