"""When not every layer fits on the GPU: which of fewer layers, the KV cache on the host and a
smaller KV type to take, by the decode speed each is predicted to reach (``prices.py``).

The planner tries each starting point (a KV type, the cache on the GPU or on the host) through its
own layer search; this module prices what each reached and says which wins and why. Only
options that fit are candidates. q4_0 costs quality the price table does not measure: it is
weighed and shown, but chosen only when no f16 or q8_0 option fits (as the last lever it was).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..model.kv_types import KV_Q4
from .prices import PriceTable, Traffic

__all__ = ["PlacementOption", "choose", "describe"]


@dataclass(frozen=True)
class PlacementOption:
    """One option the planner weighed: where it put layers and the cache, what it costs."""

    kv_type: str
    kv_on_gpu: bool  # llama.cpp's offload_kqv
    n_gpu_layers: int
    max_layers: int
    n_ctx: int
    fits: bool
    tokens_per_s: float  # predicted decode speed at the price table's representative fill
    gpu_bytes: int  # predicted on the first GPU
    host_bytes: int  # predicted on the host
    chosen: bool = False
    note: str = ""  # why it was not chosen (or why it was)

    @property
    def kv_place(self) -> str:
        """Where the cache really is: with no layer on the GPU it is on the host either way."""
        return "GPU" if self.kv_on_gpu and self.n_gpu_layers > 0 else "host"

    @property
    def label(self) -> str:
        return f"{self.n_gpu_layers}/{self.max_layers} layers on the GPU, KV {self.kv_type} on the {self.kv_place}"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def priced(
    kv_type: str, kv_on_gpu: bool, ngl: int, max_layers: int, n_ctx: int, fits: bool, t: Traffic,
    prices: PriceTable, gpu_bytes: int, host_bytes: int,
) -> PlacementOption:  # fmt: skip
    return PlacementOption(
        kv_type, kv_on_gpu, ngl, max_layers, n_ctx, fits, round(prices.tokens_per_s(t), 2), gpu_bytes, host_bytes
    )


def choose(options: list[PlacementOption]) -> tuple[list[PlacementOption], PlacementOption | None]:
    """The options with the winner marked and a note on each; the winner (None: none fits). The
    fastest that fits wins; q4_0 only when nothing else fits; a tie keeps the earlier option
    (the order tried: the cache on the GPU first, larger KV types first)."""
    fitting = [o for o in options if o.fits]
    eligible = [o for o in fitting if o.kv_type != KV_Q4] or fitting
    best = None
    for o in eligible:
        if best is None or o.tokens_per_s > best.tokens_per_s:
            best = o
    out = []
    for o in options:
        if o is best:
            note = "fastest" if len(eligible) > 1 else "the only one that fits"
            out.append(_with(o, chosen=True, note=note))
        elif not o.fits:
            out.append(_with(o, note="does not fit"))
        elif o not in eligible:
            out.append(_with(o, note=f"{KV_Q4}: only if nothing else fits (quality)"))
        else:
            out.append(_with(o, note="slower"))
    return out, next((o for o in out if o.chosen), None)


def _with(o: PlacementOption, **kw: Any) -> PlacementOption:
    return PlacementOption(**{**asdict(o), **kw})


def describe(options: list[PlacementOption], chosen: PlacementOption | None, prices: PriceTable, fill: int) -> str:
    """The plan's reason for its choice, in one line."""
    head = f"weighed {len(options)} placements by predicted decode speed at {fill} cells (prices: {prices.label})"
    if chosen is None:
        return head + ": none fits"
    others = [o for o in options if not o.chosen and o.fits]
    rest = "; over " + ", ".join(f"{o.label} ({o.tokens_per_s:,.1f})" for o in others) if others else ""
    return f"{head}: {chosen.label}, {chosen.tokens_per_s:,.1f} tokens/s{rest}"
