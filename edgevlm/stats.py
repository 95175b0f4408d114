"""Typed per-turn statistics (names follow llama.cpp's ``timings`` where they overlap)."""

from __future__ import annotations

import resource
import sys
from dataclasses import asdict, dataclass


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

    def to_dict(self) -> dict:
        return asdict(self)

    def footer(self) -> str:
        """``N tok · X tok/s · prompt Y tok/s · TTFT Z ms · image T tok``."""
        return (
            f"{self.predicted_n} tok · {self.predicted_per_second:.1f} tok/s · "
            f"prompt {self.prompt_per_second:.1f} tok/s · TTFT {self.ttft_ms:.0f} ms · "
            f"image {self.image_tokens} tok"
        )


def peak_rss_bytes() -> int:
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(ru if sys.platform == "darwin" else ru * 1024)


def per_second(n: int, ms: float) -> float:
    return round(n * 1000.0 / ms, 2) if ms > 0 else 0.0
