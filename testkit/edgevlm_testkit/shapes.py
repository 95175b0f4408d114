"""Shapes of the generated models: one text shape and one vision shape per (family, preset)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TextShape:
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    n_ctx_train: int = 4096
    rope_theta: float = 10000.0
    tied: bool = False  # no output.weight: the output reuses token_embd (Qwen2-VL-2B, Gemma 3)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


@dataclass(frozen=True)
class VisionShape:
    image_size: int
    patch_size: int
    n_embd: int
    n_layer: int
    n_head: int
    n_ff: int
    merge: int = 1  # spatial merge (Qwen2-VL: 2)


# LLaVA: real CLIP geometry (336 px, 14 px patches → 576 tokens) even in the tiny preset, so the
# token arithmetic the budgeter and planner see is the real one; only widths and depths shrink.
LLAVA_PRESETS = {
    "tiny": (TextShape(1024, 128, 2, 4, 2, 256), VisionShape(336, 14, 64, 2, 4, 128)),
    # LLaVA-1.5-7B text shapes (Vicuna-7B) with 2 layers; CLIP ViT-L/14-336 with 2 blocks.
    "real": (TextShape(32000, 4096, 2, 32, 32, 11008), VisionShape(336, 14, 1024, 2, 16, 4096)),
}

# LLaVA-1.6 pinpoints (336-px tiles) as in the llava-v1.6 mmproj files.
LLAVA16_PINPOINTS = [336, 672, 672, 336, 672, 672, 1008, 336, 336, 1008]

# Qwen2-VL: 14 px patches merged 2×2 → one token per 28×28 px.
QWEN_PRESETS = {
    "tiny": (
        TextShape(1024, 128, 2, 4, 2, 256, n_ctx_train=32768, rope_theta=1e6),
        VisionShape(560, 14, 64, 2, 4, 128, merge=2),
    ),
    # Qwen2-VL-2B text shapes with 2 layers; its 675M ViT (1280 wide) with 2 blocks.
    "real": (
        TextShape(151936, 1536, 2, 12, 2, 8960, n_ctx_train=32768, rope_theta=1e6),
        VisionShape(560, 14, 1280, 2, 16, 5120, merge=2),
    ),
}
