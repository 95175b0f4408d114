"""Full-size model pairs in seconds: random *quantized blocks* written straight into the GGUF,
with no quantizer in the way (``gguf.quants.quantize`` runs numpy over every weight and takes
minutes for a 7B model).

A block of a 4-bit type is its scale(s) in f16 and then packed nibbles, so random bytes are a
valid block once the f16 fields hold finite, small numbers: the nibbles (and Q4_K's packed 6-bit
sub-scales) stay random and the f16 fields are overwritten with a scale that keeps the weights
about N(0, 1/fan_in) in size. The metadata, vocabulary and projector are the test kit's own
(``llava``), so llama.cpp, mtmd and the planner read these pairs exactly as the small ones.

    write_big_llava(outdir, "llava7b")      # LLaVA-1.5-7B: 32 layers 4096 wide, Q4_K; CLIP-L/336, 23 blocks, f16
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from .llava import clip_mlp_header, llama_keys
from .shapes import TextShape, VisionShape
from .vocab import spm_vocab, write_vocab
from .writer import finish

__all__ = ["BIG_SHAPES", "BigPair", "cached_big_llava", "random_blocks", "write_big_llava"]

# (text, vision, text weight type). Widths that are multiples of 256 (Q4_K's super-block).
BIG_SHAPES = {
    # LLaVA-1.5-7B as published: Vicuna-7B (32 layers, 4096 wide, FFN 11008), CLIP ViT-L/14-336 with the 23
    # blocks the mmproj keeps; ≈ 3.8 GB of Q4_K text weights and 0.6 GB of f16 encoder
    "llava7b": (TextShape(32000, 4096, 32, 32, 32, 11008), VisionShape(336, 14, 1024, 23, 16, 4096), "q4_k"),
    # a laptop in miniature for the software device: 4 thin layers (≈ 3 MiB of Q4_K weights), 576 image tokens
    # from a narrow 2-block CLIP, (lavapipe takes seconds per layer and picture)
    "llava-mini": (TextShape(4096, 256, 4, 4, 4, 512), VisionShape(336, 14, 128, 2, 4, 512), "q4_k"),
}

# gguf type, bytes per block, weights per block, offsets of the f16 fields (d, dmin) in a block
_BLOCKS = {
    "q4_0": (gguf.GGMLQuantizationType.Q4_0, 18, 32, (0,)),
    "q4_k": (gguf.GGMLQuantizationType.Q4_K, 144, 256, (0, 2)),
    "q8_0": (gguf.GGMLQuantizationType.Q8_0, 34, 32, (0,)),
}
_FILE_TYPE = {
    "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "q4_k": gguf.LlamaFileType.MOSTLY_Q4_K_M,
    "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
}


def random_blocks(rng: np.random.Generator, rows: int, cols: int, qtype: str, std: float) -> np.ndarray:
    """``rows`` × ``cols`` weights of ``qtype`` as raw blocks (uint8, one row of blocks a row):
    random bytes, the f16 scale fields set so a weight's spread is about ``std``."""
    _, nbytes, per, f16_at = _BLOCKS[qtype]
    if cols % per:
        raise ValueError(f"a {qtype} row needs a multiple of {per} weights, not {cols}")
    blocks = rows * (cols // per)
    raw = rng.integers(0, 256, size=(blocks, nbytes), dtype=np.uint8)
    # the spread of one weight per unit of d: q4_0 (q-8)·d → ~4.6·d; q8_0 q·d → ~74·d; q4_k d·sc·q − dmin·m with
    # sc, m in 0..63 and q in 0..15 → ~170·d (dmin = 7.5·d centres it)
    d = std / {"q4_0": 4.6, "q8_0": 74.0, "q4_k": 170.0}[qtype]
    fields = [np.float16(d), np.float16(d * 7.5)]
    for k, at in enumerate(f16_at):
        raw[:, at : at + 2] = np.frombuffer(fields[k].tobytes(), dtype=np.uint8)
    return raw.reshape(rows, (cols // per) * nbytes)


class _Writer:
    """A GGUFWriter fed raw blocks or f16 (no numpy quantizer)."""

    def __init__(self, path: Path, arch: str, seed: int):
        self.path, self.tmp = path, path.with_name(path.name + ".part")
        self.w = gguf.GGUFWriter(str(self.tmp), arch)
        self.rng = np.random.default_rng(seed)

    def quant(self, name: str, rows: int, cols: int, qtype: str, std: float | None = None) -> None:
        data = random_blocks(self.rng, rows, cols, qtype, std if std is not None else cols**-0.5)
        self.w.add_tensor(name, data, raw_dtype=_BLOCKS[qtype][0])

    def f16(self, name: str, shape: tuple[int, ...], std: float | None = None) -> None:
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
        s = np.float32(std if std is not None else fan_in**-0.5)
        self.w.add_tensor(name, (self.rng.standard_normal(shape, dtype=np.float32) * s).astype(np.float16))

    def f32(self, name: str, value: np.ndarray) -> None:
        self.w.add_tensor(name, value.astype(np.float32))

    def write(self) -> Path:
        return finish(self.w, self.tmp, self.path)


def _text(path: Path, t: TextShape, qtype: str, seed: int, name: str) -> Path:
    g = _Writer(path, "llama", seed)
    g.w.add_name(name)
    g.w.add_file_type(_FILE_TYPE[qtype])
    g.w.add_context_length(t.n_ctx_train)
    g.w.add_embedding_length(t.n_embd)
    g.w.add_block_count(t.n_layer)
    g.w.add_feed_forward_length(t.n_ff)
    g.w.add_head_count(t.n_head)
    g.w.add_head_count_kv(t.n_head_kv)
    llama_keys(g.w, t)
    write_vocab(g.w, spm_vocab(t.n_vocab))
    kv = t.n_head_kv * t.head_dim
    g.quant("token_embd.weight", t.n_vocab, t.n_embd, qtype, std=1.0)
    for i in range(t.n_layer):
        p = f"blk.{i}"
        g.f32(f"{p}.attn_norm.weight", np.ones(t.n_embd))
        for proj, rows in (("attn_q", t.n_embd), ("attn_k", kv), ("attn_v", kv), ("attn_output", t.n_embd)):
            g.quant(f"{p}.{proj}.weight", rows, t.n_embd, qtype)
        g.f32(f"{p}.ffn_norm.weight", np.ones(t.n_embd))
        g.quant(f"{p}.ffn_gate.weight", t.n_ff, t.n_embd, qtype)
        g.quant(f"{p}.ffn_up.weight", t.n_ff, t.n_embd, qtype)
        g.quant(f"{p}.ffn_down.weight", t.n_embd, t.n_ff, qtype)
    g.f32("output_norm.weight", np.ones(t.n_embd))
    g.quant("output.weight", t.n_vocab, t.n_embd, qtype)
    return g.write()


def _clip(path: Path, v: VisionShape, n_text_embd: int, seed: int, name: str) -> Path:
    g = _Writer(path, "clip", seed)
    clip_mlp_header(g.w, v, name)
    E, n_patches = v.n_embd, (v.image_size // v.patch_size) ** 2
    zeros, ones = np.zeros, np.ones
    g.f32("v.class_embd", g.rng.standard_normal(E) * 0.02)
    g.f16("v.patch_embd.weight", (E, 3, v.patch_size, v.patch_size))
    g.f16("v.position_embd.weight", (n_patches + 1, E), std=0.02)
    g.f32("v.pre_ln.weight", ones(E))
    g.f32("v.pre_ln.bias", zeros(E))
    for i in range(v.n_layer):
        p = f"v.blk.{i}"
        for ln in ("ln1", "ln2"):
            g.f32(f"{p}.{ln}.weight", ones(E))
            g.f32(f"{p}.{ln}.bias", zeros(E))
        for proj in ("attn_q", "attn_k", "attn_v", "attn_out"):
            g.f16(f"{p}.{proj}.weight", (E, E))
            g.f32(f"{p}.{proj}.bias", zeros(E))
        g.f16(f"{p}.ffn_up.weight", (v.n_ff, E))
        g.f32(f"{p}.ffn_up.bias", zeros(v.n_ff))
        g.f16(f"{p}.ffn_down.weight", (E, v.n_ff))
        g.f32(f"{p}.ffn_down.bias", zeros(E))
    g.f16("mm.0.weight", (n_text_embd, E))
    g.f32("mm.0.bias", zeros(n_text_embd))
    g.f16("mm.2.weight", (n_text_embd, n_text_embd))
    g.f32("mm.2.bias", zeros(n_text_embd))
    return g.write()


@dataclass(frozen=True)
class BigPair:
    shape: str
    model: Path
    mmproj: Path
    seconds: float  # 0.0 when it came from the cache

    @property
    def nbytes(self) -> int:
        return self.model.stat().st_size + self.mmproj.stat().st_size


def write_big_llava(outdir: str | os.PathLike[str], shape: str = "llava7b", seed: int = 0) -> BigPair:
    """``outdir/model.gguf`` and ``outdir/mmproj.gguf`` of a ``BIG_SHAPES`` shape, timed."""
    text, vision, qtype = BIG_SHAPES[shape]
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model = _text(out / "model.gguf", text, qtype, seed, f"LLaVA-1.5 random blocks ({shape})")
    mmproj = _clip(out / "mmproj.gguf", vision, text.n_embd, seed + 1, f"LLaVA-1.5 CLIP random ({shape})")
    return BigPair(shape, model, mmproj, time.perf_counter() - t0)


def cached_big_llava(shape: str = "llava7b", cache_dir: str | os.PathLike[str] | None = None) -> BigPair:
    """``write_big_llava`` once per shape into the test kit's cache (atomic: a finished folder is renamed in)."""
    import shutil
    import tempfile

    from . import GENERATOR_VERSION, default_cache_dir

    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"big-{shape}-v{GENERATOR_VERSION}"
    if (final / "model.gguf").is_file() and (final / "mmproj.gguf").is_file():
        return BigPair(shape, final / "model.gguf", final / "mmproj.gguf", 0.0)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=final.name + ".", dir=root))
    try:
        made = write_big_llava(tmp, shape)
        try:
            os.rename(tmp, final)
        except OSError:  # another process won the race
            if not (final / "model.gguf").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return BigPair(shape, final / "model.gguf", final / "mmproj.gguf", made.seconds)
