"""Typed per-turn statistics (names follow llama.cpp's ``timings`` where they overlap), and the
one place they are built from a finished request's counters and timings."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import psutil

__all__ = ["TurnStats", "build_stats", "peak_rss_bytes", "per_second"]


@dataclass(frozen=True)
class TurnStats:
    prompt_n: int  # tokens evaluated for this turn's prompt (text + image), cached ones excluded
    prompt_ms: float  # time to evaluate them, image encoding included
    prompt_per_second: float
    predicted_n: int  # tokens generated
    predicted_ms: float
    predicted_per_second: float
    ttft_ms: float  # turn start → first generated token
    itl_ms_mean: float  # mean time between generated tokens
    image_tokens: int  # image tokens in this turn's prompt (evaluated or reused)
    image_encode_ms: float  # vision encoder time this turn
    images_encoded: int  # image chunks run through the encoder this turn
    images_reused: int  # image chunks whose embeddings came from the cache
    cached_n: int  # prompt tokens reused from the KV cache
    n_ctx_used: int  # KV cells in use after the turn
    n_ctx: int
    peak_rss_bytes: int  # peak resident host memory of the process so far
    device_memory_used_bytes: int | None  # on GPU backends that report it, else None
    finish_reason: str  # "stop" (EOS / stop string), "length" (max tokens), "context", "interrupted"
    summarized_images: int = 0  # pictures replaced by their summary this turn to make room
    evicted_tokens: int = 0  # image tokens those pictures freed
    rebuild_tokens: int = 0  # tokens of earlier turns evaluated again after the replacement
    dropped_turns: int = 0  # text-only turns dropped to make room (text policy "drop")
    image_tokens_in: int = 0  # image tokens the projector produced (evaluated this turn)
    image_tokens_out: int = 0  # image tokens fed to the model after merging
    merge_map_size: int = 0  # entries of the input→output token map (0 when merging is off)
    audio_tokens: int = 0  # tokens of the recordings this turn sends (new ones; part of image_tokens)
    # where the cached prompt tokens were: "resident" (the KV cache), "host" (RAM), "disk"
    # (serve --cache-dir); "" when none were
    cache_source: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def footer(self) -> str:
        """``N tok · X tok/s · prompt Y tok/s · TTFT Z ms · image T tok``."""
        return (
            f"{self.predicted_n} tok · {self.predicted_per_second:.1f} tok/s · "
            f"prompt {self.prompt_per_second:.1f} tok/s · TTFT {self.ttft_ms:.0f} ms · "
            f"image {self.image_tokens} tok" + (f" · audio {self.audio_tokens} tok" if self.audio_tokens else "")
        )


def peak_rss_bytes() -> int:
    """Peak resident memory of this process: ``getrusage`` where the platform has it (Linux,
    macOS), else psutil (Windows reports the peak working set; elsewhere the current RSS)."""
    try:
        import resource  # POSIX only: imported here, never at module import
    except ImportError:
        mi = psutil.Process().memory_info()
        return int(getattr(mi, "peak_wset", 0) or mi.rss)
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(ru if sys.platform == "darwin" else ru * 1024)


def per_second(n: int, ms: float) -> float:
    return round(n * 1000.0 / ms, 2) if ms > 0 else 0.0


def build_stats(
    c: Mapping[str, Any],
    predicted_n: int,
    times: Sequence[float],
    t_start: float,
    prompt_ms: float,
    predicted_ms: float,
    n_ctx_used: int,
    n_ctx: int,
    finish: str,
) -> TurnStats:
    """TurnStats of a finished request. ``c``: its counters (prompt_n, cached_n, image_tokens,
    encode_ms, encoded, reused, and whatever a policy added: summarized_images, ...);
    ``times``: when each token was sampled."""
    ttft = (times[0] - t_start) * 1000 if times else prompt_ms
    itl = float(np.mean(np.diff(times)) * 1000) if len(times) > 1 else 0.0
    return TurnStats(
        prompt_n=c["prompt_n"],
        prompt_ms=round(prompt_ms, 2),
        prompt_per_second=per_second(c["prompt_n"], prompt_ms),
        predicted_n=predicted_n,
        predicted_ms=round(predicted_ms, 2),
        predicted_per_second=per_second(predicted_n, predicted_ms),
        ttft_ms=round(ttft, 2),
        itl_ms_mean=round(itl, 2),
        image_tokens=c["image_tokens"],
        image_encode_ms=round(c["encode_ms"], 2),
        images_encoded=c["encoded"],
        images_reused=c["reused"],
        cached_n=c["cached_n"],
        n_ctx_used=n_ctx_used,
        n_ctx=n_ctx,
        peak_rss_bytes=peak_rss_bytes(),
        device_memory_used_bytes=None,
        finish_reason=finish,
        summarized_images=c.get("summarized_images", 0),
        evicted_tokens=c.get("evicted_tokens", 0),
        rebuild_tokens=c.get("rebuild_tokens", 0),
        dropped_turns=c.get("dropped_turns", 0),
        image_tokens_in=c.get("image_tokens_in", 0),
        image_tokens_out=c.get("image_tokens_out", 0),
        cache_source=c.get("cache_source", "") if c["cached_n"] else "",
        merge_map_size=c.get("merge_map_size", 0),
        audio_tokens=c.get("audio_tokens", 0),
    )
