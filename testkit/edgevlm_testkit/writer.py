"""A thin, deterministic layer over ``gguf.GGUFWriter`` for random-weight models.

Shapes are given in PyTorch layout (Linear = (out, in)); gguf-py reverses them into ggml order.
Quantized tensors are written as the raw bytes of ``gguf.quants.quantize`` with ``raw_dtype``
and no ``raw_shape`` (an element ``raw_shape`` errors or silently doubles rows).
"""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np

QTYPES = {
    "f32": gguf.GGMLQuantizationType.F32,
    "f16": gguf.GGMLQuantizationType.F16,
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
}
FILE_TYPES = {
    "f32": gguf.LlamaFileType.ALL_F32,
    "f16": gguf.LlamaFileType.MOSTLY_F16,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
}


class RandomGGUF:
    """Collects metadata and random tensors, then writes one GGUF file atomically."""

    def __init__(self, path: str | os.PathLike[str], arch: str, seed: int, weight_type: str = "f16"):
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".part")
        self.writer = gguf.GGUFWriter(str(self.tmp), arch)
        self.rng = np.random.default_rng(seed)
        self.weight_type = weight_type

    # --- tensors -------------------------------------------------------------------------
    def _add(self, name: str, data: np.ndarray, qtype: str) -> None:
        add_tensor(self.writer, name, data, qtype)

    def weight(self, name: str, shape: tuple[int, ...], scale: float | None = None, qtype: str | None = None) -> None:
        """A random matrix (or conv kernel) ~ N(0, scale²); scale defaults to 1/sqrt(fan_in)."""
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
        s = scale if scale is not None else 1.0 / np.sqrt(max(fan_in, 1))
        data = self.rng.standard_normal(shape, dtype=np.float32) * np.float32(s)
        self._add(name, data, qtype or self.weight_type)

    def bias(self, name: str, n: int, scale: float = 0.02) -> None:
        self._add(name, self.rng.standard_normal((n,), dtype=np.float32) * np.float32(scale), "f32")

    def ones(self, name: str, n: int) -> None:
        self._add(name, np.ones((n,), dtype=np.float32), "f32")

    def zeros(self, name: str, n: int) -> None:
        self._add(name, np.zeros((n,), dtype=np.float32), "f32")

    def norm(self, name: str, n: int, bias: bool = True) -> None:
        self.ones(f"{name}.weight", n)
        if bias:
            self.zeros(f"{name}.bias", n)

    def linear(self, name: str, n_out: int, n_in: int, bias: bool = True, qtype: str | None = None) -> None:
        self.weight(f"{name}.weight", (n_out, n_in), qtype=qtype)
        if bias:
            self.bias(f"{name}.bias", n_out)

    # --- output --------------------------------------------------------------------------
    def write(self) -> Path:
        return finish(self.writer, self.tmp, self.path)


def add_tensor(w: gguf.GGUFWriter, name: str, data: np.ndarray, qtype: str) -> None:
    """One tensor in ``qtype`` (f32, f16, or a quantization written as raw bytes)."""
    q = QTYPES[qtype]
    if qtype == "f32":
        w.add_tensor(name, data.astype(np.float32))
    elif qtype == "f16":
        w.add_tensor(name, data.astype(np.float16))
    else:
        if data.shape[-1] % 32:
            raise ValueError(f"{name}: row length {data.shape[-1]} is not a multiple of 32")
        w.add_tensor(name, gguf.quants.quantize(data.astype(np.float32), q), raw_dtype=q)


def finish(w: gguf.GGUFWriter, tmp: Path, path: Path) -> Path:
    """Write header, metadata and tensors to ``tmp``, then move it to ``path`` (atomic)."""
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


def text_header(g: RandomGGUF, t, name: str) -> None:
    """Metadata every generated decoder shares (shapes from a TextShape)."""
    write_text_header(g.writer, t, name, g.weight_type)


def write_text_header(w: gguf.GGUFWriter, t, name: str, weight_type: str) -> None:
    """``text_header`` on a bare writer (for files whose weights are not random: the demo)."""
    w.add_name(name)
    w.add_file_type(FILE_TYPES[weight_type])
    w.add_context_length(t.n_ctx_train)
    w.add_embedding_length(t.n_embd)
    w.add_block_count(t.n_layer)
    w.add_feed_forward_length(t.n_ff)
    w.add_head_count(t.n_head)
    w.add_head_count_kv(t.n_head_kv)


def decoder_tensors(g: RandomGGUF, t, qkv_bias: bool) -> None:
    """Token embedding, LLaMA-style blocks (RMS norms, GQA attention, SwiGLU FFN), output."""
    kv = t.n_head_kv * t.head_dim
    g.weight("token_embd.weight", (t.n_vocab, t.n_embd), scale=1.0)
    for i in range(t.n_layer):
        p = f"blk.{i}"
        g.ones(f"{p}.attn_norm.weight", t.n_embd)
        g.linear(f"{p}.attn_q", t.n_embd, t.n_embd, bias=qkv_bias)
        g.linear(f"{p}.attn_k", kv, t.n_embd, bias=qkv_bias)
        g.linear(f"{p}.attn_v", kv, t.n_embd, bias=qkv_bias)
        g.linear(f"{p}.attn_output", t.n_embd, t.n_embd, bias=False)
        g.ones(f"{p}.ffn_norm.weight", t.n_embd)
        g.linear(f"{p}.ffn_gate", t.n_ff, t.n_embd, bias=False)
        g.linear(f"{p}.ffn_up", t.n_ff, t.n_embd, bias=False)
        g.linear(f"{p}.ffn_down", t.n_embd, t.n_ff, bias=False)
    g.ones("output_norm.weight", t.n_embd)
    if not getattr(t, "tied", False):
        g.weight("output.weight", (t.n_vocab, t.n_embd))
