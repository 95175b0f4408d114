"""Reading clips for the video planner: what is a video (by extension, by its first bytes), and
a reader that gives small colour thumbnails of the frames shown at chosen times (a first, cheap pass)
and then the chosen frames at their planned size (a second pass) — with PyAV for containers
(MP4, WebM, MOV, MKV, AVI: seeking once the keyframe spacing is known) and Pillow for animated
GIF, WebP and PNG. Never all frames held; FFmpeg's errors become one ``InputError`` line."""

from __future__ import annotations

import io
import math
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..errors import InputError

__all__ = [
    "AVReader",
    "ClipReader",
    "PillowReader",
    "THUMB",
    "VIDEO_EXTS",
    "is_video_file",
    "is_video_path",
    "looks_like_video",
    "need_av",
    "one_line",
    "open_clip",
    "use_threads",
    "decode_bytes_of",
    "DECODE_THREADS",
]

VIDEO_EXTS = (".mp4", ".webm", ".mov", ".mkv", ".avi", ".m4v")
THUMB = 32  # side of the colour thumbnails compared (grey would miss a cut between colours of one luma)
ANIMATED_IMAGE_FORMATS = ("GIF", "WEBP", "PNG")  # read with Pillow when they have > 1 frame
IMAGE_BRANDS = (b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"mif1", b"msf1", b"avif", b"avis")


def is_video_path(path: str | os.PathLike[str]) -> bool:
    """A clip by its extension (animated GIF/WebP are pictures by name: ``looks_like_video``)."""
    return os.path.splitext(os.fspath(path))[1].lower() in VIDEO_EXTS


def container_magic(head: bytes) -> bool:
    if head[4:8] == b"ftyp":  # ISO BMFF: MP4, MOV, M4V, 3GP — but HEIF/AVIF stills too
        return head[8:12] not in IMAGE_BRANDS
    if head[4:8] in (b"moov", b"mdat", b"wide"):  # old QuickTime without ftyp
        return True
    if head[:4] == b"\x1a\x45\xdf\xa3":  # EBML: Matroska / WebM
        return True
    return head[:4] == b"RIFF" and head[8:12] == b"AVI "


def animated(fh: Any) -> bool:
    """An animated GIF/WebP/APNG with more than one frame (Pillow reads only the headers it needs)."""
    from PIL import Image

    try:
        with Image.open(fh) as img:
            return img.format in ANIMATED_IMAGE_FORMATS and getattr(img, "n_frames", 1) > 1
    except Exception:
        return False


def looks_like_video(data: bytes) -> bool:
    """A clip by its content: MP4/MOV (``ftyp``, not a HEIF/AVIF still), WebM/MKV (EBML), AVI
    (RIFF), or an animated GIF/WebP with more than one frame."""
    if container_magic(data[:16]):
        return True
    if data[:6] in (b"GIF87a", b"GIF89a") or (data[:4] == b"RIFF" and data[8:12] == b"WEBP"):
        return animated(io.BytesIO(data))
    return False


def is_video_file(path: str | os.PathLike[str]) -> bool:
    """``is_video_path`` or ``looks_like_video`` for a file, reading its header only (and, for a
    GIF/WebP, its frames' headers)."""
    if is_video_path(path):
        return True
    try:
        with open(path, "rb") as fh:
            head = fh.read(16)
            if container_magic(head):
                return True
            if head[:6] in (b"GIF87a", b"GIF89a") or (head[:4] == b"RIFF" and head[8:12] == b"WEBP"):
                fh.seek(0)
                return animated(fh)
    except OSError:
        return False
    return False


def need_av(name: str) -> Any:
    try:
        import av
    except ImportError:
        raise InputError(f"{name}: decoding video needs PyAV: pip install 'edgevlm[video]'") from None
    return av


def one_line(exc: BaseException) -> str:
    # FFmpeg's errors carry the file name and errno in str(); their reason is strerror
    reason = getattr(exc, "strerror", None)
    text = " ".join(str(reason or exc).split()) or type(exc).__name__
    return text[:300]


class ClipReader:
    """A clip opened for reading: its size, duration, rate, and the two passes."""

    name: str
    width: int  # display size (sample aspect ratio applied)
    height: int
    duration: float
    fps: float

    def scan(self, times: list[float]) -> Iterator[tuple[float, Any, np.ndarray]]:
        """(frame time, key for ``frames``, 32×32×3 colour float32 thumbnail in 0..1) of the frame
        shown at each of ``times`` (sorted); a frame shown at several is given once."""
        raise NotImplementedError

    def frames(self, keys: list[Any], size: tuple[int, int]) -> Iterator[np.ndarray]:
        """The frames ``scan`` gave these keys (in order) as H×W×3 uint8 at ``size``."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class AVReader(ClipReader):
    def __init__(self, source: str | bytes, name: str):
        av = need_av(name)
        self._av = av
        self.name = name
        self._source = source
        self._read = False
        self._container = self._open()
        try:
            self._read_header()
        except BaseException:
            self.close()
            raise

    def _open(self) -> Any:
        src = io.BytesIO(self._source) if isinstance(self._source, bytes) else self._source
        try:
            return self._av.open(src, "r")
        except self._av.FFmpegError as exc:
            raise InputError(f"{self.name}: not a readable video ({one_line(exc)})") from None
        except (OSError, ValueError) as exc:
            raise InputError(f"{self.name}: cannot open as a video ({one_line(exc)})") from None

    def _read_header(self) -> None:
        c = self._container
        if not c.streams.video:
            raise InputError(f"{self.name}: no video stream in this file")
        s = c.streams.video[0]
        use_threads(s)
        self._stream = s
        self._tb = s.time_base or 0
        cc = s.codec_context
        w, h = int(cc.width or 0), int(cc.height or 0)
        if w <= 0 or h <= 0:
            raise InputError(f"{self.name}: the video stream has no picture size (unsupported codec?)")
        sar = cc.sample_aspect_ratio or s.sample_aspect_ratio
        if sar and sar > 0 and sar != 1:  # anamorphic: the picture is shown wider or narrower
            w = max(1, round(w * float(sar)))
        self.width, self.height = w, h
        rate = s.average_rate or s.guessed_rate or s.base_rate
        self.fps = float(rate) if rate else 0.0
        self._start = float(s.start_time * self._tb) if s.start_time is not None and self._tb else 0.0
        if s.duration and self._tb:
            dur = float(s.duration * self._tb)
        elif c.duration:
            dur = c.duration / self._av.time_base - self._start
        else:
            dur = self._demux_duration()
        if self.fps <= 0:
            self.fps = (s.frames / dur) if s.frames and dur > 0 else 25.0
        if dur <= 0 and s.frames:
            dur = s.frames / self.fps
        self.duration = dur
        if dur <= 0 or (s.frames == 0 and dur <= 0):
            raise InputError(f"{self.name}: zero-length clip (no frames)")

    def _demux_duration(self) -> float:
        """The end of the last packet (a stream whose header has no duration), then rewind."""
        end = 0.0
        try:
            for p in self._container.demux(self._stream):
                if p.pts is not None and self._tb:
                    end = max(end, float((p.pts + (p.duration or 0)) * self._tb) - self._start)
        except self._av.FFmpegError as exc:
            raise InputError(f"{self.name}: corrupt video ({one_line(exc)})") from None
        self._container.close()
        self._container = self._open()
        self._stream = self._container.streams.video[0]
        use_threads(self._stream)
        return end

    def _time(self, frame: Any, count: int) -> float:
        t = frame.time
        return (float(t) - self._start) if t is not None else count / self.fps

    def _walk(self, targets: list[float], tol: float, key_tol: float = 0.0) -> Iterator[tuple[float, Any]]:
        """(time, frame) of the first frame at or after each target (− ``tol``), reading
        forward and seeking ahead when a target lies further than the keyframe spacing; the
        keyframe a seek lands on stands for its target when it is at most ``key_tol`` before it
        (sparse candidates of a long clip then cost one decoded frame each)."""
        if self._read:  # a second pass starts from a freshly opened container
            self._container.close()
            self._container = self._open()
            self._stream = self._container.streams.video[0]
            use_threads(self._stream)
        self._read = True
        c, s, av = self._container, self._stream, self._av
        it = c.decode(s)
        pos = -math.inf
        gop: float | None = None
        last_key: float | None = None
        count = 0
        j = 0
        sought = -1  # the target last sought (never twice: a longer keyframe interval than seen)
        landed = False  # the next frame is the one a seek landed on
        given = -math.inf  # the last frame yielded (a seek landing before it gives nothing again)
        while j < len(targets):
            t = targets[j]
            if gop is not None and self._tb and t - pos > gop + tol and sought != j:
                sought = j
                c.seek(int((t + self._start) / self._tb), stream=s, backward=True)
                it = c.decode(s)
                last_key = None  # the spacing is measured between keyframes read in a row
                landed = True
            try:
                frame = next(it, None)
            except av.FFmpegError as exc:
                raise InputError(f"{self.name}: corrupt video near {t:.1f} s ({one_line(exc)})") from None
            if frame is None:
                return  # the clip ends before the header said (noted by the caller)
            ft = self._time(frame, count)
            count += 1
            if frame.key_frame:
                if last_key is not None and ft > last_key:
                    gop = max(gop or 0.0, ft - last_key)
                last_key = ft
            pos = ft
            if ft <= given:
                landed = False
                continue
            if landed and t - key_tol <= ft < t - tol:  # the keyframe is near enough: it stands for t
                j += 1
            elif ft + tol < t:
                landed = False
                continue
            landed = False
            while j < len(targets) and ft + tol >= targets[j]:
                j += 1
            given = ft
            yield ft, frame

    def scan(self, times: list[float]) -> Iterator[tuple[float, Any, np.ndarray]]:
        tol = 0.5 / self.fps
        spacing = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
        for ft, frame in self._walk(times, tol, key_tol=spacing / 2):
            g = frame.to_ndarray(format="rgb24", width=THUMB, height=THUMB, interpolation="AREA")
            yield ft, ft, g.astype(np.float32) / 255.0

    def frames(self, keys: list[Any], size: tuple[int, int]) -> Iterator[np.ndarray]:
        interp = "AREA" if size[0] * size[1] < self.width * self.height else "BICUBIC"
        got = 0
        for _, frame in self._walk([float(k) for k in keys], 1e-6):
            yield frame.to_ndarray(format="rgb24", width=size[0], height=size[1], interpolation=interp)
            got += 1
        if got < len(keys):
            raise InputError(f"{self.name}: the video could not be read again at {keys[got]:.1f} s")

    def close(self) -> None:
        c = getattr(self, "_container", None)
        if c is not None:
            c.close()
            self._container = None


class PillowReader(ClipReader):
    """An animated GIF/WebP/APNG: frames and their durations through Pillow (one frame held)."""

    def __init__(self, source: str | bytes, name: str):
        from PIL import Image

        self.name = name
        try:
            self._img = Image.open(io.BytesIO(source) if isinstance(source, bytes) else source)
            starts = []
            t, shortest = 0.0, math.inf
            for i in range(int(getattr(self._img, "n_frames", 1))):
                self._img.seek(i)
                if self._img.format == "WEBP":  # its frame's duration is read when it is loaded
                    self._img.load()
                starts.append(t)
                d = self._img.info.get("duration") or 0
                d = (d if d > 10 else 100) / 1000.0  # browsers show 0–10 ms frames for 100 ms
                t += d
                shortest = min(shortest, d)
        except Exception as exc:
            raise InputError(f"{name}: unreadable animation ({one_line(exc)})") from None
        self._starts = starts
        self.width, self.height = self._img.size
        self.duration = t
        self.fps = 1.0 / shortest if starts else 10.0  # its fastest rate: no frame falls between candidates

    def _frame(self, i: int) -> Any:
        from .images import flatten

        try:
            self._img.seek(i)
            self._img.load()
            return flatten(self._img)
        except Exception as exc:
            raise InputError(f"{self.name}: corrupt animation at frame {i} ({one_line(exc)})") from None

    def scan(self, times: list[float]) -> Iterator[tuple[float, Any, np.ndarray]]:
        from PIL import Image

        last = -1
        i = 0
        for t in times:
            while i + 1 < len(self._starts) and self._starts[i + 1] <= t + 1e-9:
                i += 1
            if i == last:
                continue
            last = i
            g = self._frame(i).convert("RGB").resize((THUMB, THUMB), Image.Resampling.BOX)
            yield self._starts[i], i, np.asarray(g, dtype=np.float32) / 255.0

    def frames(self, keys: list[Any], size: tuple[int, int]) -> Iterator[np.ndarray]:
        from PIL import Image

        for i in keys:
            rgb = self._frame(int(i))
            if rgb.size != size:
                rgb = rgb.resize(size, Image.Resampling.BICUBIC)
            yield np.asarray(rgb, dtype=np.uint8)

    def close(self) -> None:
        self._img.close()


DECODE_THREADS = 2  # FFmpeg's decoder threads: each may hold a frame (the decode's memory grows with them)
DECODE_FRAMES = DECODE_THREADS + 4  # full-size frames a decode holds at most (threads, references, ours)


def use_threads(stream: Any) -> None:
    """Frame and slice threads for a stream, at most ``DECODE_THREADS`` of them."""
    stream.thread_type = "AUTO"
    stream.thread_count = DECODE_THREADS


def decode_bytes_of(clip: ClipReader) -> int:
    """The host memory a clip's decoding takes at its peak: a few full-size frames in FFmpeg's
    planes and ours (RGB), whatever the clip's length."""
    return clip.width * clip.height * 3 * DECODE_FRAMES


def open_clip(source: str | bytes, name: str, max_pixels: int | None = None) -> ClipReader:
    """A clip opened for reading (its header read). ``max_pixels``: a frame larger than this is
    refused, as a picture that large is (a decompression bomb in a small file)."""
    clip = _open_clip(source, name)
    if max_pixels is not None and clip.width * clip.height > max_pixels:
        clip.close()
        raise InputError(
            f"{name}: frames of {clip.width}x{clip.height} are over the {max_pixels:,}-pixel limit (--max-pixels)"
        )
    return clip


def _open_clip(source: str | bytes, name: str) -> ClipReader:
    if isinstance(source, bytes):
        head = source[:16]
        if not source:
            raise InputError(f"{name}: empty file (0 bytes), not a video")
    else:
        if not os.path.exists(source):
            raise InputError(f"{name}: no such file")
        if os.path.isdir(source):
            raise InputError(f"{name}: is a directory, not a video")
        try:
            with open(source, "rb") as fh:
                head = fh.read(16)
        except OSError as exc:
            raise InputError(f"{name}: cannot read ({exc.strerror or exc})") from None
        if not head:
            raise InputError(f"{name}: empty file (0 bytes), not a video")
    animated = head[:6] in (b"GIF87a", b"GIF89a") or (head[:4] == b"RIFF" and head[8:12] == b"WEBP")
    animated = animated or head[:8] == b"\x89PNG\r\n\x1a\n"
    if animated:
        clip = PillowReader(source, name)
        if len(clip._starts) < 2:
            clip.close()
            raise InputError(f"{name}: a still picture, not an animation or a clip")
        return clip
    return AVReader(source, name)
