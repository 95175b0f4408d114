"""Ollama's ``images`` arrays → the refs a request carries: base64 strings (no ``data:`` prefix,
as Ollama's) or ``data:`` URIs, pictures by their type, and recordings by their first bytes (WAV,
FLAC, MP3, Ogg, M4A: ``looks_like_audio``) — Ollama takes audio in ``images`` too and tells it
by its content."""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

from ..runtime.intake.media import looks_like_audio
from .request import ImageRef, bad

__all__ = ["media_refs"]

_SPACE = re.compile(r"\s")
_MIME = (("/9j/", "image/jpeg"), ("iVBOR", "image/png"), ("R0lGOD", "image/gif"), ("UklGR", "image/webp"))


def _head(b64: str) -> bytes:
    """The first bytes a base64 string holds (enough for a file's magic), b"" when it holds none."""
    n = min(len(b64), 96) // 4 * 4
    try:
        return base64.b64decode(b64[:n])
    except (binascii.Error, ValueError):
        return b""


def media_refs(raw: Any, where: str) -> tuple[ImageRef, ...]:
    """``images``: base64 strings (no ``data:`` prefix, as Ollama's) or ``data:`` URIs. An entry
    whose bytes are a recording (WAV, FLAC, MP3, Ogg, M4A by their magic: ``looks_like_audio``)
    is audio, as Ollama tells audio sent in ``images`` by its content."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise bad(f"'{where}' must be a list of base64 strings", where)
    out = []
    for j, s in enumerate(raw):
        if not isinstance(s, str) or not s:
            raise bad(f"{where}[{j}] must be a base64 string", f"{where}[{j}]")
        if not s.startswith("data:"):
            if _SPACE.search(s):  # (line-wrapped base64, as Go's decoder takes it)
                s = "".join(s.split())
            if looks_like_audio(_head(s)):
                out.append(ImageRef(f"data:application/octet-stream;base64,{s}", kind="audio"))
                continue
            mime = next((m for head, m in _MIME if s.startswith(head)), "application/octet-stream")
            s = f"data:{mime};base64,{s}"
        elif s[5:11].lower() == "audio/":
            out.append(ImageRef(s, kind="audio"))
            continue
        out.append(ImageRef(s))
    return tuple(out)
