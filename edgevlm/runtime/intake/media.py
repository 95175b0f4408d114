"""What a turn's pictures and clips are before the intake makes them ready: ``MediaRef`` (a
source not decoded yet, with its kind, ``detail`` and name), ``Clip`` (the library's "this is
a video"), the one "is this a video" rule (``media_kind``), and ``load_media`` (a caller's
inputs checked before a model is loaded)."""

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

__all__ = ["Clip", "MediaRef", "file_key", "load_media", "media_kind", "thumbnail_uri"]


@dataclass(frozen=True)
class MediaRef:
    """A picture or a clip a turn carries, not decoded yet (or decoded: a ``LoadedImage``)."""

    source: Any  # a path (a server's intake: a URL, data: URI), bytes, a LoadedImage, a PIL image, an array
    kind: str = "auto"  # image | video | auto (``media_kind``)
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


def media_kind(ref: MediaRef, data: bytes | None = None) -> str:
    """The one "is this a video" test: the kind the caller states (an API's part type), else a
    path's extension or content, else the bytes' content (``data``, or the source's own)."""
    if ref.kind in ("image", "video"):
        return ref.kind
    src = ref.source
    if data is None and isinstance(src, (bytes, bytearray)):
        data = bytes(src)
    if data is not None:  # (bytes read from a file: its name's extension counts too)
        return "video" if is_video_path(ref.name) or looks_like_video(data) else "image"
    if isinstance(src, (str, os.PathLike)):
        if os.path.isfile(src):
            return "video" if is_video_file(src) else "image"
        return "video" if is_video_path(src) else "image"
    return "image"


def load_media(media: Iterable[Any], max_pixels: int = DEFAULT_MAX_PIXELS) -> list[LoadedImage | MediaRef]:
    """A caller's pictures decoded (paths, bytes, PIL images, arrays: a ``LoadedImage`` each)
    and its clips checked (a ``Clip``, a ``MediaRef`` of kind video, or a file that is one: a
    ``MediaRef`` each); needs no model, so a command can check its inputs before one is
    downloaded or loaded. http(s) URLs and ``data:`` URIs stay ``MediaRef``s: the intake
    fetches them by its rules (``fetch.FetchRules``)."""
    out: list[LoadedImage | MediaRef] = []
    for m in media:
        if isinstance(m, Clip):
            m = MediaRef(m.source, "video", name=m.name)
        elif not isinstance(m, MediaRef):
            m = MediaRef(m)
        src = m.source
        if isinstance(src, str) and url_scheme(src.strip()) in ("http", "https", "data"):
            out.append(m)  # (the intake fetches it, by its rules: ``fetch``)
            continue
        if media_kind(m) == "video":
            if isinstance(src, (str, os.PathLike)) and not os.path.isfile(src):
                raise InputError(f"{os.fspath(src)}: no such video file")
            name = m.name or (os.fspath(src) if isinstance(src, (str, os.PathLike)) else "")
            out.append(replace(m, kind="video", name=name))
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
