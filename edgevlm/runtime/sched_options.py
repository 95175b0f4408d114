"""The scheduler's settings (``SchedulerOptions``) and its two profiles: ``latency`` for chat and
serve, ``throughput`` for batch work (``THROUGHPUT``: caption, batch files, Ray actors, ``serve
--profile throughput``)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PROFILES", "THROUGHPUT", "SchedulerOptions"]

PROFILES = ("latency", "throughput")


@dataclass(frozen=True)
class SchedulerOptions:
    image_cache_units: int = 32  # pictures whose embeddings are kept for reuse
    image_cache_bytes: int = 512 * 2**20
    max_running: int | None = None  # requests generating at once (None: one per sequence id)
    cache_ram: int = 0  # host RAM for idle conversations moved out of the KV cache (0: drop them)
    # a folder for those pushed out of RAM (None: dropped), bounded by cache_disk bytes; a quarter
    # of cache_ram holds the ones on their way there (``disktier``)
    cache_dir: str | None = None
    cache_disk: int = 0
    prefill_share: float = 0.6  # prompt work per step beside running streams, as a share of their own
    # (steps are steered to 1.6x on average; their p95, jitter included, ~1.2x that: within 2x. 0.7: 1.5-2.05x)
    # "latency" (chat, serve): running streams keep their pace — prompt work in slices beside them
    # (prefill_share), a long encode beside them on part of the cores (encoder). "throughput"
    # (caption, batch files, Ray; serve --profile throughput): nobody watches a stream — every
    # step fills the batch with prompt rows, and every picture is encoded as a step of its own
    # on all the cores: the least CPU per request.
    profile: str = "latency"

    def __post_init__(self) -> None:
        if self.profile not in PROFILES:
            raise ValueError(f"scheduler profile {self.profile!r}: use one of {', '.join(PROFILES)}")


THROUGHPUT = SchedulerOptions(profile="throughput")  # what batch work loads with
