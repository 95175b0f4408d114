"""Recordings for tests: speech-like sound (voiced harmonics and noise under a syllable
envelope, about -16 dBFS), silence (a faint noise floor, about -70 dBFS) or a mix, written as
16-bit WAV with the standard library (other formats: PyAV, in the tests that need them).
The same arguments always give the same bytes."""

from __future__ import annotations

import wave
from pathlib import Path

import numpy as np

__all__ = ["speech_like", "write_wav"]


def speech_like(seconds: float, rate: int = 16000, seed: int = 0) -> np.ndarray:
    """Float samples in [-1, 1]: syllables of 120–300 ms with short gaps, a wandering pitch."""
    rng = np.random.default_rng(seed)
    n = int(round(seconds * rate))
    t = np.arange(n) / rate
    pitch = 140 + 40 * np.sin(2 * np.pi * 0.7 * t)
    phase = 2 * np.pi * np.cumsum(pitch) / rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 6))
    env = np.zeros(n)
    i = 0
    while i < n:
        syl = int(rate * rng.uniform(0.12, 0.30))
        gap = int(rate * rng.uniform(0.03, 0.12))
        env[i : i + syl] = np.hanning(min(syl, n - i) + 2)[1:-1] if i + syl <= n else np.hanning(n - i + 2)[1:-1]
        i += syl + gap
    out = 0.25 * env * (voiced / 2.3 + 0.15 * rng.standard_normal(n))
    return np.clip(out, -1, 1).astype(np.float32)


def write_wav(path: str | Path, parts: list[tuple[str, float]], rate: int = 16000, seed: int = 0) -> Path:
    """A mono 16-bit WAV of ``parts``: ("speech", seconds) or ("silence", seconds), in order."""
    rng = np.random.default_rng(seed + 1)
    pieces = []
    for i, (kind, seconds) in enumerate(parts):
        if kind == "speech":
            pieces.append(speech_like(seconds, rate, seed + i))
        elif kind == "silence":
            pieces.append((rng.standard_normal(int(round(seconds * rate))) * 3e-4).astype(np.float32))
        else:
            raise ValueError(f"unknown part {kind!r}")
    pcm = (np.concatenate(pieces) * 32767).astype("<i2")
    path = Path(path)
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm.tobytes())
    return path
