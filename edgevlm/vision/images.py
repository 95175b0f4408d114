"""Loading any image safely into RGB: the one place every command reads pictures.

EXIF orientation is applied, alpha is flattened onto white, palette / CMYK / 16-bit / greyscale
become RGB, animated images give their first frame (with a note), formats are recognised by
content (not extension), and a pixel limit replaces Pillow's decompression-bomb warning.
Every failure is an ``ImageError`` with one line naming the file.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
from dataclasses import dataclass, field

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from ..errors import ImageError

__all__ = [
    "flatten",
    "DEFAULT_MAX_PIXELS",
    "IMAGE_EXTENSIONS",
    "LoadedImage",
    "decode_bytes",
    "from_rgb",
    "has_image_ext",
    "load_image",
    "resized",
]

DEFAULT_MAX_PIXELS = 100_000_000  # 100 MP: a 10000×10000 scan; a bomb is far larger
# What Pillow reads; files with these extensions are images for every command (chat attaches
# them, caption takes them from folders) even when their bytes look wrong.
IMAGE_EXTENSIONS = frozenset(
    {
        ".png",
        ".apng",
        ".jpg",
        ".jpeg",
        ".jpe",
        ".jfif",
        ".webp",
        ".gif",
        ".bmp",
        ".dib",
        ".tif",
        ".tiff",
        ".ppm",
        ".pgm",
        ".pbm",
        ".pnm",
        ".pfm",
        ".tga",
        ".ico",
        ".icns",
        ".heic",
        ".heif",
        ".avif",
        ".jp2",
        ".j2k",
        ".jpx",
        ".qoi",
        ".psd",
        ".dds",
        ".pcx",
        ".sgi",
        ".rgb",
        ".jxl",
    }
)


# Pillow's decompression-bomb check reads a module global at ``Image.open``; edgevlm enforces
# its own pixel limit instead, so it lifts that global for its own opens — under this lock, so
# that two threads decoding at once never restore each other's value mid-open.
_PIL_OPEN_LOCK = threading.Lock()


# Host memory a decode takes at its peak, per pixel: Pillow's own buffer (4 bytes a pixel for
# RGB) and the RGB array it is copied into strip by strip (3), with room for an EXIF rotation;
# modes that are flattened (alpha, palette) go through one or two more RGBA copies; 16-bit and
# float greys (2 or 4 bytes in Pillow, one more such copy for an EXIF rotation) are scaled a
# strip at a time straight into the RGB array (``_deep_grey``).
DECODE_BYTES_PER_PIXEL = 8
FLATTEN_BYTES_PER_PIXEL = 16
_STRIP = 256  # rows converted at a time (Pillow → numpy without a second full copy)
# 16-bit and float greys: at most this many pixels, and a quarter of the picture, scaled at a
# time (a strip's float64 copy is 8 bytes a pixel: bounded by the strip, never by the picture)
_DEEP_STRIP_PIXELS = 1 << 18
_DEEP_GREY = ("I;16", "I;16B", "I;16L", "I;16N", "I", "F")


def has_image_ext(path: str) -> bool:
    return os.path.splitext(path)[1].lower() in IMAGE_EXTENSIONS


@dataclass(frozen=True)
class LoadedImage:
    """Decoded RGB pixels plus where they came from. Two are equal when their content hash,
    source and notes are (the pixels are never compared element by element)."""

    rgb: np.ndarray = field(repr=False, compare=False)  # H×W×3 uint8
    source: str
    format: str
    sha256: str  # of the decoded pixels and size: the same picture in any file format matches
    notes: tuple[str, ...] = ()

    @property
    def width(self) -> int:
        return int(self.rgb.shape[1])

    @property
    def height(self) -> int:
        return int(self.rgb.shape[0])


def flatten(img: Image.Image) -> Image.Image:
    """``img`` as RGB (transparency over white, palettes expanded), without a copy when it is."""
    if img.mode == "RGB":
        return img  # (convert() would copy it: a full decode more at the peak)
    if img.mode in ("RGBA", "LA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        bg = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(bg, rgba).convert("RGB")
    if img.mode in _DEEP_GREY:
        return Image.fromarray(_deep_grey(img))
    return img.convert("RGB")


def _deep_boxes(w: int, h: int) -> list[tuple[int, int, int, int]]:
    """The boxes a 16-bit or float picture is scaled in: whole rows, at most
    ``_DEEP_STRIP_PIXELS`` and a quarter of the picture at a time (pieces of a row when one row
    is more than that)."""
    most = max(1, min(_DEEP_STRIP_PIXELS, (w * h) // 4))
    rows, cols = max(1, min(h, most // w)), min(w, most)
    return [(x, y, min(w, x + cols), min(h, y + rows)) for y in range(0, h, rows) for x in range(0, w, cols)]


def _deep_grey(img: Image.Image) -> np.ndarray:
    """A 16-bit or float grey picture (``I;16``, ``I;16B``, ``I``, ``F``) as H×W×3 uint8, a
    strip at a time: integers scaled from 0–65535 when any is over 255 (as ``v * 255 //
    65535``: what ``v * (255 / 65535)`` truncated gives for every 16-bit value), else taken as
    they are (clipped to 0–255 either way); floats stretched from their least to their largest value (0 when all
    are the same, or one is NaN). Nothing larger than a strip is copied: the peak is Pillow's
    buffer and the RGB array (``FLATTEN_BYTES_PER_PIXEL`` covers it)."""
    w, h = img.size
    boxes = _deep_boxes(w, h)
    out = np.empty((h, w, 3), dtype=np.uint8)
    if img.mode == "F":
        ends = np.array([(a.min(), a.max()) for a in (np.asarray(img.crop(b)) for b in boxes)], dtype=np.float64)
        lo, hi = float(ends[:, 0].min()), float(ends[:, 1].max())  # (a NaN anywhere is the answer, as before)
        for x0, y0, x1, y1 in boxes:
            if hi > lo:
                strip = np.asarray(img.crop((x0, y0, x1, y1)), dtype=np.float64)
                np.subtract(strip, lo, out=strip)
                np.divide(strip, hi - lo, out=strip)
                np.multiply(strip, 255, out=strip)
                grey = strip.astype(np.uint8)
            else:
                grey = np.zeros((y1 - y0, x1 - x0), dtype=np.uint8)
            out[y0:y1, x0:x1] = grey[:, :, None]
        return out
    top = max(int(np.asarray(img.crop(b)).max()) for b in boxes)
    for x0, y0, x1, y1 in boxes:
        strip = np.clip(np.asarray(img.crop((x0, y0, x1, y1))), 0, 65535 if top > 255 else 255).astype(np.int32)
        if top > 255:
            strip *= 255
            strip //= 65535
        out[y0:y1, x0:x1] = strip.astype(np.uint8)[:, :, None]
    return out


def load_image(
    source: str | os.PathLike[str] | bytes, max_pixels: int = DEFAULT_MAX_PIXELS, name: str | None = None
) -> LoadedImage:
    """Decode a file path or raw bytes into an RGB ``LoadedImage``."""
    label = name or (os.fspath(source) if not isinstance(source, bytes) else "<bytes>")
    if isinstance(source, bytes):
        data = source
    else:
        path = os.fspath(source)
        if not os.path.exists(path):
            raise ImageError(f"{label}: no such file")
        if os.path.isdir(path):
            raise ImageError(f"{label}: is a directory, not an image")
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError as exc:
            raise ImageError(f"{label}: cannot read ({exc.strerror or exc})") from None
    if not data:
        raise ImageError(f"{label}: empty file (0 bytes), not an image")
    notes: list[str] = []
    img = _open(data, label)
    try:
        fmt = img.format or "unknown"
        w, h = img.size
        if w * h > max_pixels:
            raise ImageError(
                f"{label}: {w}x{h} = {w * h:,} pixels exceeds the limit of {max_pixels:,} (raise it with --max-pixels)"
            )
        if getattr(img, "is_animated", False) and (n_frames := getattr(img, "n_frames", 1)) > 1:
            notes.append(f"animated {fmt} with {n_frames} frames: using the first")
            img.seek(0)
        try:
            img.load()
            img = ImageOps.exif_transpose(img) or img
            rgb = _deep_grey(img) if img.mode in _DEEP_GREY else _to_array(flatten(img))
        except ImageError:
            raise
        except Exception as exc:  # truncated / corrupt data surfaces at load time
            raise ImageError(f"{label}: corrupt or truncated {fmt} image ({exc})") from None
    finally:
        img.close()
    if rgb.ndim != 3 or rgb.shape[2] != 3 or rgb.size == 0:
        raise ImageError(f"{label}: could not convert to RGB")
    return from_rgb(rgb, label, fmt, tuple(notes))


def decode_bytes(data: bytes, label: str = "<bytes>") -> int:
    """Host memory decoding ``data`` takes at its peak, from its header alone (nothing decoded;
    an ``ImageError`` for what ``load_image`` would refuse as unreadable)."""
    img = _open(data, label)
    try:
        w, h = img.size
        per_pixel = DECODE_BYTES_PER_PIXEL if img.mode in ("RGB", "L", "CMYK", "YCbCr") else FLATTEN_BYTES_PER_PIXEL
        return w * h * per_pixel + len(data)
    finally:
        img.close()


def _to_array(img: Image.Image) -> np.ndarray:
    """An RGB image's pixels as an H×W×3 array, copied a strip at a time (``np.asarray`` of the
    whole image goes through a full ``tobytes()`` copy first)."""
    w, h = img.size
    out = np.empty((h, w, 3), dtype=np.uint8)
    for y in range(0, h, _STRIP):
        out[y : y + _STRIP] = np.asarray(img.crop((0, y, w, min(h, y + _STRIP))), dtype=np.uint8)
    return out


def _open(data: bytes, label: str) -> Image.Image:
    """``Image.open`` without Pillow's own pixel limit (ours is checked by the caller)."""
    with _PIL_OPEN_LOCK:
        saved = Image.MAX_IMAGE_PIXELS
        Image.MAX_IMAGE_PIXELS = None
        try:
            return Image.open(io.BytesIO(data))
        except UnidentifiedImageError:
            raise ImageError(f"{label}: not an image (format not recognised)") from None
        except Exception as exc:
            raise ImageError(f"{label}: unreadable image ({exc})") from None
        finally:
            Image.MAX_IMAGE_PIXELS = saved


def from_rgb(rgb: np.ndarray, source: str, fmt: str = "array", notes: tuple[str, ...] = ()) -> LoadedImage:
    """Wrap H×W×3 uint8 pixels; the hash covers size and pixels, not the file format."""
    rgb = np.ascontiguousarray(rgb, dtype=np.uint8)
    digest = hashlib.sha256()
    digest.update(f"{rgb.shape[1]}x{rgb.shape[0]}".encode())
    digest.update(rgb.data.cast("B"))  # the buffer itself (a memoryview): no copy of the pixels
    return LoadedImage(rgb, source, fmt, digest.hexdigest(), tuple(notes))


def resized(image: LoadedImage, width: int, height: int) -> LoadedImage:
    """The same picture at another size (bicubic), noted."""
    rgb = np.asarray(Image.fromarray(image.rgb).resize((width, height), Image.Resampling.BICUBIC))
    return from_rgb(rgb, image.source, image.format, image.notes + (f"resized to {width}x{height}",))
