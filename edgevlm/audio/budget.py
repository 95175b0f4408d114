"""What a caller allows a recording: its tokens (None: the room the context has left, as a
clip's), whether long silences stay, and the longest recording it takes. The one place these
defaults live: the CLI's ``--audio-tokens`` / ``--keep-silence`` / ``--max-audio-seconds`` and
the server's per-request limit read them here."""

from __future__ import annotations

from dataclasses import dataclass

from .decode import AudioLimits

__all__ = ["AudioBudget"]


@dataclass(frozen=True)
class AudioBudget:
    tokens: int | None = None  # a recording's tokens at most (None: the room the context has left)
    keep_silence: bool = False  # long silences are dropped unless this is set
    max_seconds: float = AudioLimits().max_seconds  # a longer recording is refused before decoding

    @property
    def limits(self) -> AudioLimits:
        return AudioLimits(max_seconds=self.max_seconds)

    def within(self, room: int | None) -> int | None:
        """The tokens a recording may take with ``room`` left in the context (None: no limit)."""
        if room is None:
            return self.tokens
        return min(self.tokens, room) if self.tokens is not None else room
