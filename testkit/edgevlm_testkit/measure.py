"""Measure what llama.cpp really allocates for a configuration (from its own log lines), next to
what ``edgevlm.estimate`` predicts — the validation behind the planner's error bounds.

Used by the test suite (bounds asserted) and ``scripts/bench_planner.py`` (full error table).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

import numpy as np

from edgevlm.backend import logs
from edgevlm.backend.llama import Backend
from edgevlm.backend.system import cpu_repacks
from edgevlm.model.gguf_info import projector_info, read_gguf, text_model_info
from edgevlm.model.projectors import encoder_patches, facts, image_tokens
from edgevlm.plan.estimate import (
    TextTensors,
    clip_compute_bytes,
    kv_bytes,
    layer_devices,
    text_compute_bytes,
    weight_bytes,
)

MIB = 2**20
_LINE = re.compile(r"^(\w+):\s+(\S+)\s+(.*?)\s*=\s*([0-9.]+) MiB")
_CLIP_MODEL = re.compile(r"load_hparams: model size:\s+([0-9.]+) MiB")


@dataclass(frozen=True)
class Config:
    family: str
    n_ctx: int = 1024
    type_k: str = "f16"
    type_v: str = "f16"
    flash_attn: bool = True
    n_ubatch: int = 512
    n_batch: int = 512
    image_max_tokens: int | None = None  # dynamic families: the budget (largest admitted image)

    @property
    def label(self) -> str:
        fa = "fa" if self.flash_attn else "nofa"
        it = f" img{self.image_max_tokens}" if self.image_max_tokens else ""
        return f"{self.family} ctx{self.n_ctx} {self.type_k}/{self.type_v} {fa} ub{self.n_ubatch}{it}"


@dataclass(frozen=True)
class Component:
    name: str
    measured: int  # bytes, from llama.cpp's log (2-decimal MiB)
    predicted: int

    @property
    def error(self) -> float:
        """Relative error of the prediction (positive = over-estimate)."""
        return (self.predicted - self.measured) / self.measured if self.measured else 0.0

    def within(self, rel: float, abs_mib: float = 0.006) -> bool:
        """Inside ``rel`` relative error, or inside the log's own rounding (0.005 MiB)."""
        return abs(self.predicted - self.measured) <= max(rel * self.measured, abs_mib * MIB)


def buffer_lines(lines: list[str]) -> dict[str, float]:
    """``function:buffer:what`` → MiB for llama.cpp's buffer-size log lines (the largest seen;
    KV caches summed: an iSWA model logs one line for its global and one for its SWA cache)."""
    out: dict[str, float] = {}
    for line in lines:
        m = _LINE.match(line.strip())
        if m and ("buffer size" in m.group(3) or m.group(3).startswith("model buffer")):
            key = f"{m.group(1)}:{m.group(2)}:{m.group(3)}"
            val = float(m.group(4))
            out[key] = out.get(key, 0.0) + val if m.group(1) == "llama_kv_cache" else max(out.get(key, 0.0), val)
        m = _CLIP_MODEL.search(line)
        if m:
            out["clip:model"] = float(m.group(1))
    return out


def largest_image(proj, budget: int | None) -> tuple[int, int]:
    """Width and height of an image that reaches the budget (square, the worst case)."""
    f = facts(proj)
    if f.dynamic:
        side = proj.patch_size * f.merge * int(np.sqrt(budget or 4096))
        return side, side
    return proj.image_size, proj.image_size  # one view / tile


def measure(model: str, mmproj: str, cfg: Config, n_threads: int = 2) -> list[Component]:
    """Load ``cfg`` in llama.cpp, encode the largest admitted image, compare with the estimate."""
    text_gf = read_gguf(model)
    text = text_model_info(text_gf)
    proj_gf = read_gguf(mmproj)
    proj = projector_info(proj_gf)
    with logs.capture() as lines:
        be = Backend(
            model,
            mmproj,
            n_ctx=cfg.n_ctx,
            n_batch=cfg.n_batch,
            n_ubatch=cfg.n_ubatch,
            n_gpu_layers=0,
            n_threads=n_threads,
            flash_attn=cfg.flash_attn,
            type_k=cfg.type_k,
            type_v=cfg.type_v,
            warmup=False,
            image_max_tokens=cfg.image_max_tokens,
        )
        try:
            w, h = largest_image(proj, cfg.image_max_tokens)
            rgb = (np.random.default_rng(0).random((h, w, 3)) * 255).astype(np.uint8)
            bm = be.bitmap_from_rgb(rgb)
            try:
                with be.tokenize(be.marker, [bm], add_special=False) as chunks:
                    img = next(c for c in chunks if c.kind == "image")
                    be.encode_image(img)
                    n_patches = encoder_patches(proj, img.n_tokens)
                    view = max(
                        image_tokens(proj, w, h, max_tokens=cfg.image_max_tokens).views, key=lambda v: v.n_tokens
                    )
            finally:
                be.free_bitmap(bm)
        finally:
            be.close()
    got = buffer_lines(lines)

    def mib(*keys: str) -> int:
        return int(round(sum(got.get(k, 0.0) for k in keys) * MIB))

    tt = TextTensors.from_gguf(text_gf, text.n_layer)
    host, _ = weight_bytes(tt, layer_devices(text.n_layer, 0, []), repack=cpu_repacks())
    kv = kv_bytes(text.n_layer, text.n_head_kv, text.head_dim, cfg.n_ctx, cfg.type_k, cfg.type_v)
    clip_compute = [v for k, v in got.items() if k.startswith("reserve_compute_meta:")]
    return [
        Component("weights (mapped)", mib("load_tensors:CPU_Mapped:model buffer size"), host.mapped),
        Component("weights (repack)", mib("load_tensors:CPU_REPACK:model buffer size"), host.repack),
        Component("kv", mib("llama_kv_cache:CPU:KV buffer size"), kv[-1]),
        Component(
            "compute",
            mib("sched_reserve:CPU:compute buffer size"),
            text_compute_bytes(text, cfg.n_ctx, cfg.n_ubatch, cfg.n_batch, cfg.flash_attn, cfg.type_k, cfg.type_v),
        ),
        Component("mmproj weights", int(round(got.get("clip:model", 0.0) * MIB)), proj_gf.weight_bytes),
        Component(
            "mmproj compute",
            int(round(max(clip_compute or [0.0]) * MIB)),
            clip_compute_bytes(proj, n_patches, cfg.flash_attn, grid=(view.nx, view.ny)),
        ),
    ]


def naive_estimate(model: str, mmproj: str, cfg: Config) -> int:
    """What a file-size + f16-KV pre-flight (Ollama-style) predicts for the same config."""
    import os

    text = text_model_info(read_gguf(model))
    kv = 2 * text.n_layer * cfg.n_ctx * text.n_head_kv * text.head_dim * 2
    return os.path.getsize(model) + os.path.getsize(mmproj) + kv


def components_dict(comps: list[Component]) -> dict:
    return {c.name: {**asdict(c), "error": c.error} for c in comps}


__all__ = [
    "Config",
    "Component",
    "buffer_lines",
    "components_dict",
    "image_tokens",
    "largest_image",
    "measure",
    "naive_estimate",
]
