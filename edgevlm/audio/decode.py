"""Audio files to mono float32 samples at the encoder's rate, streamed: PyAV (FFmpeg) opens WAV,
FLAC, MP3, OGG/Opus/Vorbis, M4A/AAC and the audio track of a video (MP4, MKV, WebM, MOV); each
decoded frame goes through ``av.AudioResampler(format="fltp", rate=rate)`` and its channels are
averaged into one — as miniaudio, llama.cpp's own decoder, mixes down; FFmpeg's own stereo → mono
matrix would add the two at 0.707 each, 3 dB louder — and each block is given away before the
next frame is decoded, so a recording of any length costs one frame's memory.

Limits (``AudioLimits``), all checked while streaming:

- **Too long.** A file whose header declares more than ``max_seconds`` is refused before anything
  is decoded; one without a declared length stops with the same error once its decoded samples
  pass it.
- **Audio bomb.** A header that declares D seconds while the data decodes longer than
  ``D * slack + slack_s`` (FLAC's STREAMINFO, an Ogg page's granule, an MP3's Xing frame count
  can all lie) stops there with an error. (FFmpeg's WAV reader already never reads past the
  ``data`` size its header gives.)
- **Corrupt or truncated.** FFmpeg raising while decoding (a cut FLAC frame, junk in the middle)
  is an ``InputError`` that says where: nothing decoded from a broken file is used. A file cut
  cleanly between frames (a truncated MP3 usually is) decodes without an error up to the cut;
  its audio is used, and ``AudioStream.notes`` says it ended early.

Every problem is one ``InputError`` line naming the file. PyAV is the ``video`` extra: it is
imported inside the functions, never when this module is.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InputError

__all__ = [
    "AUDIO_EXTS",
    "AudioInfo",
    "AudioLimits",
    "AudioStream",
    "SAMPLE_RATE",
    "clock",
    "iter_samples",
    "probe",
]

SAMPLE_RATE = 16000  # every audio input encoder mtmd has (Whisper family, conformers) takes 16 kHz
AUDIO_EXTS = (".wav", ".flac", ".mp3", ".ogg", ".oga", ".opus", ".m4a", ".aac", ".wma", ".aiff", ".aif")
FRAME_SAMPLES_MAX = 65536  # samples per channel a decoded frame may hold when the codec does not say
# (FLAC's largest block is 65535; MP3 1152, AAC 1024/2048, Opus 5760, Vorbis 8192, PCM ~1024)
DECODER_OVERHEAD = 256 * 1024  # FFmpeg's I/O buffer, one packet and the resampler's state


@dataclass(frozen=True)
class AudioLimits:
    """What a caller accepts: the longest recording (seconds), and how much longer than its
    header says a file may decode before it is an audio bomb (``declared * slack + slack_s``)."""

    max_seconds: float = 3 * 3600.0
    slack: float = 1.05
    slack_s: float = 1.0


@dataclass(frozen=True)
class AudioInfo:
    """A file's audio as its header describes it (nothing decoded)."""

    name: str
    container: str  # FFmpeg's demuxer name ("wav", "mov,mp4,m4a,3gp,3g2,mj2")
    codec: str  # the audio stream's decoder ("mp3float", "flac", "opus"); "" without audio
    duration_s: float | None  # declared by the header (None: not said)
    rate: int  # the stream's own sample rate (0 without audio)
    channels: int
    has_audio: bool


def clock(seconds: float, tenths: bool = False) -> str:
    """``h:mm:ss`` (``h:mm:ss.s`` with ``tenths``): how the error lines and notes say a length."""
    if tenths:
        t = max(0, int(seconds * 10 + 0.5))
        whole, frac = divmod(t, 10)
        h, rest = divmod(whole, 3600)
        return f"{h}:{rest // 60:02d}:{rest % 60:02d}.{frac}"
    whole = max(0, int(seconds + 0.5))
    h, rest = divmod(whole, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}"


def _need_av(name: str) -> Any:
    try:
        import av
    except ImportError:
        raise InputError(f"{name}: decoding audio needs PyAV: pip install 'edgevlm[video]'") from None
    return av


def _reason(exc: BaseException) -> str:
    # FFmpeg's errors carry the file name and errno in str(); their reason is strerror
    text = " ".join(str(getattr(exc, "strerror", None) or exc).split()) or type(exc).__name__
    return text[:200]


def _open(av: Any, source: str | bytes | os.PathLike[str], name: str) -> Any:
    if isinstance(source, (bytes, bytearray, memoryview)):
        if not len(source):
            raise InputError(f"{name}: empty file (0 bytes), not an audio file")
        src: Any = io.BytesIO(bytes(source))
    else:
        src = os.fspath(source)
        if not os.path.isfile(src):
            raise InputError(f"{name}: no such file")
        if os.path.getsize(src) == 0:
            raise InputError(f"{name}: empty file (0 bytes), not an audio file")
    try:
        return av.open(src, "r")
    except av.FFmpegError as exc:
        raise InputError(f"{name}: not an audio file PyAV can read ({_reason(exc)})") from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"{name}: cannot open ({_reason(exc)})") from None


def _declared(av: Any, container: Any, stream: Any) -> float | None:
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        return float(container.duration / av.time_base)
    return None


def _info(av: Any, container: Any, name: str) -> AudioInfo:
    fmt = container.format.name if container.format else ""
    if not container.streams.audio:
        dur = float(container.duration / av.time_base) if container.duration else None
        return AudioInfo(name, fmt, "", dur, 0, 0, False)
    s = container.streams.audio[0]
    cc = s.codec_context
    rate = int(s.rate or cc.sample_rate or 0)
    return AudioInfo(name, fmt, cc.name or "", _declared(av, container, s), rate, int(cc.channels or 0), True)


NOT_MEDIA = ("tty", "image2", "txt", "srt", "ass", "webvtt")  # FFmpeg readers that open text and pictures


def _no_audio(container: Any, name: str) -> str:
    """A video without sound, or something that is not media at all (FFmpeg's ``tty`` reader
    opens any ``.txt``; its picture readers any image)."""
    fmt = container.format.name if container.format else ""
    if container.streams.video and not (fmt in NOT_MEDIA or fmt.endswith("_pipe")):
        return f"{name}: has no audio track"
    return f"{name}: not an audio file PyAV can read (it reads as {fmt or 'unknown'}, with no audio stream)"


def probe(source: str | bytes | os.PathLike[str], name: str) -> AudioInfo:
    """The header's description of ``source`` (a path or the file's bytes); nothing decoded.
    A file FFmpeg cannot open is an ``InputError``; one without audio has ``has_audio`` False."""
    av = _need_av(name)
    with _open(av, source, name) as container:
        return _info(av, container, name)


class AudioStream(Iterator[np.ndarray]):
    """The decoded samples of one file, block by block (float32, mono, ``rate``), as the decoder
    gives them; ``info`` is the header, ``decoded`` the samples given so far, ``notes`` what the
    caller should tell the user (a file that ended before its header said), ``hold_bytes`` the
    decoder's peak memory. Close it (or use ``with``) when stopping early."""

    def __init__(self, info: AudioInfo, rate: int, hold_bytes: int, blocks: Iterator[np.ndarray]):
        self.info = info
        self.rate = rate
        self.hold_bytes = hold_bytes
        self.decoded = 0
        self.notes: list[str] = []
        self._blocks = blocks
        self._container: Any = None

    def __iter__(self) -> AudioStream:
        return self

    def __next__(self) -> np.ndarray:
        return next(self._blocks)

    def close(self) -> None:
        close = getattr(self._blocks, "close", None)
        if close is not None:
            close()
        if self._container is not None:  # a stream never iterated: its generator never ran
            self._container.close()
            self._container = None

    def __enter__(self) -> AudioStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _hold_bytes(stream: Any, rate: int) -> int:
    cc = stream.codec_context
    per_channel = int(cc.frame_size or 0) or FRAME_SAMPLES_MAX
    width = int(cc.format.bytes) if cc.format is not None else 8
    src_rate = int(stream.rate or cc.sample_rate or rate)
    channels = max(1, int(cc.channels or 1))
    out = -(-per_channel * rate // max(1, src_rate)) * 4 * (channels + 1)  # the planes and their mean
    return per_channel * channels * width + out + DECODER_OVERHEAD


def iter_samples(
    source: str | bytes | os.PathLike[str],
    name: str,
    *,
    rate: int = SAMPLE_RATE,
    limits: AudioLimits = AudioLimits(),
    hold: Callable[[int], None] | None = None,
) -> AudioStream:
    """Decode ``source``'s first audio stream to mono float32 at ``rate``, frame by frame, under
    ``limits`` (see the module doc). ``hold(nbytes)`` is told once, before the first block, the
    memory the decoder holds at its peak (one decoded frame, its resampled copy, FFmpeg's
    buffers). Every problem is an ``InputError`` naming ``name``."""
    av = _need_av(name)
    container = _open(av, source, name)
    try:
        info = _info(av, container, name)
        if not info.has_audio:
            raise InputError(_no_audio(container, name))
        if info.duration_s is not None and info.duration_s > limits.max_seconds:
            raise InputError(
                f"{name}: lasts {clock(info.duration_s)}, more than the {clock(limits.max_seconds)} "
                "this accepts (--max-audio-seconds)"
            )
        stream = container.streams.audio[0]
        hold_bytes = _hold_bytes(stream, rate)
    except BaseException:
        container.close()
        raise
    out = AudioStream(info, rate, hold_bytes, iter(()))
    out._blocks = _blocks(av, container, stream, out, limits, hold)
    out._container = container
    return out


def _blocks(
    av: Any,
    container: Any,
    stream: Any,
    out: AudioStream,
    limits: AudioLimits,
    hold: Callable[[int], None] | None,
) -> Iterator[np.ndarray]:
    name, rate, declared = out.info.name, out.rate, out.info.duration_s
    most = int(limits.max_seconds * rate)
    bomb = int((declared * limits.slack + limits.slack_s) * rate) if declared is not None else None
    try:
        if hold is not None:
            hold(out.hold_bytes)
        # to the rate in float planes, the channels kept; then their mean (module doc)
        resampler = av.AudioResampler(format="fltp", rate=rate)

        def check(n: int) -> None:
            if bomb is not None and n > bomb:
                raise InputError(
                    f"{name}: decodes to more than its header's {clock(declared or 0.0)} "
                    f"(stopped at {clock(n / rate, tenths=True)})"
                )
            if n > most:
                raise InputError(
                    f"{name}: lasts more than the {clock(limits.max_seconds)} this accepts "
                    f"(--max-audio-seconds; stopped at {clock(n / rate, tenths=True)})"
                )

        frames: Iterator[Any] = container.decode(stream)
        while True:
            try:
                frame = next(frames, None)
                got = resampler.resample(frame)
            except av.FFmpegError as exc:
                where = clock(out.decoded / rate, tenths=True)
                raise InputError(f"{name}: corrupt or truncated audio at {where} ({_reason(exc)})") from None
            except (OSError, MemoryError) as exc:
                raise InputError(
                    f"{name}: reading stopped at {clock(out.decoded / rate, tenths=True)} ({_reason(exc)})"
                ) from None
            for f in got:
                planes = f.to_ndarray()
                block = planes[0] if planes.shape[0] == 1 else planes.mean(axis=0, dtype=np.float32)
                if not block.size:
                    continue
                check(out.decoded + block.size)
                out.decoded += block.size
                yield block
            if frame is None:
                break
        if declared is not None and out.decoded < (declared - max(1.0, 0.02 * declared)) * rate:
            out.notes.append(
                f"{name}: ends at {clock(out.decoded / rate, tenths=True)}, before the "
                f"{clock(declared)} its header says (truncated?): the audio up to there is used"
            )
    finally:
        container.close()
