"""The planner against a real GPU: load a configuration with every layer and the vision encoder
on the first GPU, encode the largest admitted image, and compare the planner's per-device
prediction with llama.cpp's buffer log lines — and with the device's own free-memory readings
before and after load and after the first image, which show what lives outside those lines (the
CUDA context, cuBLAS workspaces, the memory pool). ``scripts/gpu_check.py`` runs it; on a
machine without a GPU (``gpu=False``) the same code measures the host, so the script itself can
be checked anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edgevlm.backend import logs
from edgevlm.backend.llama import Backend
from edgevlm.backend.system import ggml_devices
from edgevlm.model.gguf_info import read_gguf
from edgevlm.plan.devices import Device, Probe
from edgevlm.plan.footprint import Config as PlanConfig
from edgevlm.plan.footprint import Footprint, Wishes

from .measure import MIB, buffer_lines, largest_image

__all__ = ["DeviceRow", "measure_on_device"]


@dataclass(frozen=True)
class DeviceRow:
    label: str
    component: str
    predicted: int  # bytes
    logged: int  # bytes, from llama.cpp's log (None-like 0 when it logs nothing)

    @property
    def error(self) -> float:
        return (self.predicted - self.logged) / self.logged if self.logged else 0.0


def _gpu_free() -> tuple[str, int, int] | None:
    gpus = [d for d in ggml_devices() if d.kind in ("gpu", "igpu")]
    return (gpus[0].name, gpus[0].free, gpus[0].total) if gpus else None


def measure_on_device(
    model: str,
    mmproj: str,
    label: str,
    n_ctx: int,
    type_kv: str,
    n_ubatch: int,
    image_max_tokens: int | None,
    gpu: bool = True,
    n_threads: int = 4,
) -> list[DeviceRow]:
    """Rows of predicted vs logged bytes per buffer on the device, and (GPU) the memory the
    device lost that no log line accounts for, after load and after the first image."""
    text_gf, proj_gf = read_gguf(model), read_gguf(mmproj)
    dev = _gpu_free() if gpu else None
    if gpu and dev is None:
        raise RuntimeError("no GPU registered in ggml (is llama-cpp-python built with CUDA?)")
    name = dev[0] if dev else "CPU"
    devices = [Device(dev[0], "measured", "gpu", dev[1], dev[2], True, "ggml", 0)] if dev else []
    devices.append(Device("CPU", "host", "cpu", 64 * 2**30, 64 * 2**30, True, "what-if"))
    fp = Footprint(text_gf, proj_gf, Probe(tuple(devices)), Wishes(n_ubatch=n_ubatch))
    ngl = fp.text.n_layer + 1 if gpu else 0
    cfg = PlanConfig(
        ngl=ngl,
        n_ctx=n_ctx,
        type_k=type_kv,
        type_v=type_kv,
        flash_attn=True,
        mmproj_gpu=gpu,
        image_tokens=image_max_tokens or 0,
        n_batch=max(512, n_ubatch),
        n_ubatch=n_ubatch,
    )
    pred = fp.predict(cfg)[0 if gpu else -1]
    free0 = dev[1] if dev else 0
    with logs.capture() as lines:
        be = Backend(
            model,
            mmproj,
            n_ctx=n_ctx,
            n_batch=cfg.n_batch,
            n_ubatch=n_ubatch,
            n_gpu_layers=ngl,
            n_threads=n_threads,
            flash_attn=True,
            type_k=type_kv,
            type_v=type_kv,
            warmup=False,
            mmproj_use_gpu=gpu,
            image_max_tokens=image_max_tokens,
            op_offload=gpu,
        )
        try:
            loaded = _gpu_free()
            w, h = largest_image(fp.proj, image_max_tokens)
            rgb = (np.random.default_rng(0).random((h, w, 3)) * 255).astype(np.uint8)
            bm = be.bitmap_from_rgb(rgb)
            try:
                with be.tokenize(be.marker, [bm], add_special=False) as chunks:
                    img = next(c for c in chunks if c.kind == "image")
                    be.decode_image(img, be.encode_image(img), 0)
            finally:
                be.free_bitmap(bm)
            imaged = _gpu_free()
        finally:
            be.close()
    got = buffer_lines(lines)

    def logged(fn: str, what: str) -> int:
        return int(round(sum(v for k, v in got.items() if k.startswith(f"{fn}:{name}") and k.endswith(what)) * MIB))

    clip_model = int(round(got.get("clip:model", 0.0) * MIB))
    rows = [
        DeviceRow(label, f"weights on {name}", pred.weights, logged("load_tensors", "model buffer size")),
        DeviceRow(label, f"KV on {name}", pred.kv, logged("llama_kv_cache", "KV buffer size")),
        DeviceRow(label, f"compute on {name}", pred.compute, logged("sched_reserve", "compute buffer size")),
        DeviceRow(label, "encoder weights", pred.mmproj_weights, clip_model),
        DeviceRow(
            label,
            "encoder compute",
            pred.mmproj_compute,
            int(round(max([v for k, v in got.items() if k.startswith("reserve_compute_meta:")] or [0.0]) * MIB)),
        ),
    ]
    if gpu and loaded and imaged:
        in_logs = sum(r.logged for r in rows)
        rows += [
            DeviceRow(
                label,
                "outside the logs after load",
                0,
                (free0 - loaded[1]) - sum(r.logged for r in rows if not r.component.startswith("encoder compute")),
            ),
            DeviceRow(label, "outside the logs after 1st image", 0, (free0 - imaged[1]) - in_logs),
        ]
    return rows
