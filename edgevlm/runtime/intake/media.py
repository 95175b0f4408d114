"""What a turn's pictures, clips and recordings are before the intake makes them ready:
``MediaRef`` (a source not decoded yet, with its kind, ``detail`` and name), ``Clip`` and
``Sound`` (the library's "this is a video" / "this is audio"), the one "what is this file" rule
(``media_kind``), and ``load_media`` (a caller's inputs checked before a model is loaded)."""

from __future__ import annotations

import base64
import hashlib
import io
import os
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from PIL import Image as PILImage

from ...errors import InputError
from ...vision.images import DEFAULT_MAX_PIXELS, LoadedImage, load_image
from ...vision.video import is_video_file, is_video_path, looks_like_video
from .fetch import url_scheme

__all__ = [
    "AUDIO_EXTS",
    "Clip",
    "MediaRef",
    "Sound",
    "file_key",
    "load_media",
    "looks_like_audio",
    "media_kind",
    "thumbnail_uri",
]

AUDIO_EXTS = (".wav", ".flac", ".mp3", ".ogg", ".oga", ".opus", ".m4a", ".aac", ".weba")


@dataclass(frozen=True)
class MediaRef:
    """A picture or a clip a turn carries, not decoded yet (or decoded: a ``LoadedImage``)."""

    source: Any  # a path (a server's intake: a URL, data: URI), bytes, a LoadedImage, a PIL image, an array
    kind: str = "auto"  # image | video | audio | auto (``media_kind``)
    detail: str = "auto"  # auto | high | low (``LOW_DETAIL_TOKENS``, no tiles)
    name: str = ""  # what notices and summaries call it (default: "image 2", "video 1")
    # its bytes (``source``) are held on the caller's lease already (a server's fetched URL): the
    # intake takes nothing more for them, and the caller gives them back
    leased: bool = False


@dataclass(frozen=True)
class Clip:
    """The library's way to say "this is a video" (a path or the file's bytes)."""

    source: str | bytes
    name: str = "video"


@dataclass(frozen=True)
class Sound:
    """The library's way to say "this is audio" (a path or the file's bytes; a video file's
    audio track)."""

    source: str | bytes
    name: str = "audio"


def looks_like_audio(head: bytes) -> bool:
    """A recording by its first bytes: WAV (RIFF/WAVE), FLAC, MP3 (an ID3 tag or an MPEG audio
    frame), Ogg (Opus, Vorbis), M4A (ISO BMFF with an audio brand)."""
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return True
    if head[:4] in (b"fLaC", b"OggS") or head[:3] == b"ID3":
        return True
    if len(head) > 1 and head[0] == 0xFF and (head[1] & 0xE0) == 0xE0 and (head[1] & 0x06):
        return True  # an MPEG audio frame header (layer I-III; 0xFFF1/9 is AAC's ADTS)
    return head[4:8] == b"ftyp" and head[8:11] in (b"M4A", b"M4B")


def _is_audio_path(path: Any) -> bool:
    return os.path.splitext(os.fspath(path))[1].lower() in AUDIO_EXTS


def media_kind(ref: MediaRef, data: bytes | None = None) -> str:
    """The one "what is this" test: the kind the caller states (an API's part type), else a
    path's extension or content, else the bytes' content (``data``, or the source's own)."""
    if ref.kind in ("image", "video", "audio"):
        return ref.kind
    src = ref.source
    if data is None and isinstance(src, (bytes, bytearray)):
        data = bytes(src)
    if data is not None:  # (bytes read from a file: its name's extension counts too)
        if (ref.name and _is_audio_path(ref.name)) or looks_like_audio(data[:16]):
            return "audio"
        return "video" if is_video_path(ref.name) or looks_like_video(data) else "image"
    if isinstance(src, (str, os.PathLike)):
        if _is_audio_path(src):
            return "audio"
        if os.path.isfile(src):
            with open(src, "rb") as fh:
                if looks_like_audio(fh.read(16)):
                    return "audio"
            return "video" if is_video_file(src) else "image"
        return "video" if is_video_path(src) else "image"
    return "image"


def load_media(media: Iterable[Any], max_pixels: int = DEFAULT_MAX_PIXELS) -> list[LoadedImage | MediaRef]:
    """A caller's pictures decoded (paths, bytes, PIL images, arrays: a ``LoadedImage`` each)
    and its clips and recordings checked (a ``Clip`` or ``Sound``, a ``MediaRef`` of kind video
    or audio, or a file that is one: a ``MediaRef`` each); needs no model, so a command can
    check its inputs before one is downloaded or loaded. http(s) URLs and ``data:`` URIs stay ``MediaRef``s: the intake
    fetches them by its rules (``fetch.FetchRules``)."""
    out: list[LoadedImage | MediaRef] = []
    for m in media:
        if isinstance(m, Clip):
            m = MediaRef(m.source, "video", name=m.name)
        elif isinstance(m, Sound):
            m = MediaRef(m.source, "audio", name=m.name)
        elif not isinstance(m, MediaRef):
            m = MediaRef(m)
        src = m.source
        if isinstance(src, str) and url_scheme(src.strip()) in ("http", "https", "data"):
            out.append(m)  # (the intake fetches it, by its rules: ``fetch``)
            continue
        kind = media_kind(m)
        if kind in ("video", "audio"):
            if isinstance(src, (str, os.PathLike)) and not os.path.isfile(src):
                raise InputError(f"{os.fspath(src)}: no such {kind} file")
            name = m.name or (os.fspath(src) if isinstance(src, (str, os.PathLike)) else "")
            out.append(replace(m, kind=kind, name=name))
            continue
        out.append(src if isinstance(src, LoadedImage) else load_image(src, max_pixels))
    return out


def file_key(source: str | bytes | os.PathLike[str]) -> str:
    """A clip's summary key: the hash of its file (the same clip in any caller matches)."""
    digest = hashlib.sha256()
    if isinstance(source, bytes):
        digest.update(source)
        return digest.hexdigest()
    with open(source, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def thumbnail_uri(rgb: Any, height: int = 72) -> str:
    """A small JPEG of a frame as a data: URI (for the page)."""
    img = PILImage.fromarray(rgb)
    img.thumbnail((height * 4, height))
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=80)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()
