"""KV-cache element types, in one table: ggml's type id, bytes per element, and the order the
planner degrades through (f16 → q8_0 → q4_0)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["KV_CHOICES", "KV_DEFAULT", "KV_Q4", "KV_Q8", "KV_TYPES", "KVType", "is_quantized"]


@dataclass(frozen=True)
class KVType:
    name: str
    ggml_id: int  # ggml_type
    bytes_per_element: float  # q8_0: 34 bytes per block of 32; q4_0: 18 per 32

    @property
    def quantized(self) -> bool:
        return self.name.startswith("q")


KV_TYPES: dict[str, KVType] = {
    t.name: t
    for t in (
        KVType("f32", 0, 4.0),
        KVType("f16", 1, 2.0),
        KVType("bf16", 30, 2.0),
        KVType("q8_0", 8, 34 / 32),
        KVType("q4_0", 2, 18 / 32),
        KVType("q4_1", 3, 20 / 32),
        KVType("q5_0", 6, 22 / 32),
        KVType("q5_1", 7, 24 / 32),
        KVType("iq4_nl", 20, 18 / 32),
    )
}
KV_CHOICES = ("f16", "q8_0", "q4_0")  # offered to users, in the planner's degradation order
KV_DEFAULT, KV_Q8, KV_Q4 = KV_CHOICES


def is_quantized(name: str) -> bool:
    """A block-quantized cache type (llama.cpp rotates such K/V and needs flash attention for V)."""
    t = KV_TYPES.get(name)
    return bool(t and t.quantized)
