"""The planner against a real GPU: load a configuration with every layer and the vision encoder
on the first GPU, encode the largest admitted image, and compare the planner's per-device
prediction with llama.cpp's buffer log lines — and with the device's own free-memory readings
before and after load and after the first image, which show what lives outside those lines (the
CUDA context, cuBLAS workspaces, the memory pool). ``scripts/gpu_check.py`` runs it; on a
machine without a GPU (``gpu=False``) the same code measures the host, so the script itself can
be checked anywhere.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from edgevlm.backend import logs
from edgevlm.backend.dryrun import dry_run
from edgevlm.backend.llama import Backend
from edgevlm.backend.system import cpu_repacks, ggml_devices
from edgevlm.model.gguf_info import read_gguf
from edgevlm.plan.check import ROUNDING, compare, learn
from edgevlm.plan.devices import Device, Probe, probe
from edgevlm.plan.footprint import Config as PlanConfig
from edgevlm.plan.footprint import Footprint, Wishes

from .measure import MIB, buffer_lines, largest_image

__all__ = [
    "ROUNDING",
    "TARGET",
    "DeviceRow",
    "GuardRow",
    "audio_on_device",
    "clip_reserves",
    "guard_on_device",
    "logged_on_device",
    "measure_on_device",
]

TARGET = 0.005  # a buffer's plan within 0.5 % of the log, as on the CPU


@dataclass(frozen=True)
class DeviceRow:
    label: str
    component: str
    predicted: int  # bytes: what the plan counts (the replay, raised where llama.cpp's dry run reserved more)
    logged: int  # bytes, from llama.cpp's log (None-like 0 when it logs nothing)
    replayed: int = -1  # bytes the replay of llama.cpp's rules alone predicted, where that differs
    lines: int = 1  # log lines summed into ``logged`` (each rounded to 0.01 MiB)

    @property
    def error(self) -> float:
        return (self.predicted - self.logged) / self.logged if self.logged else 0.0

    @property
    def outside(self) -> bool:
        """A row of what the device lost outside every log line (nothing predicted)."""
        return self.component.startswith("outside")

    @property
    def under(self) -> bool:
        """The plan counted less than llama.cpp logged, beyond the log's rounding."""
        return not self.outside and self.logged - self.predicted > ROUNDING * self.lines

    def within(self, target: float = TARGET) -> bool:
        """Within ``target`` of the log (or its rounding) and never under."""
        close = abs(self.predicted - self.logged) <= max(target * self.logged, ROUNDING * self.lines)
        return self.outside or (close and not self.under)


def _gpu_free() -> tuple[str, int, int] | None:
    gpus = [d for d in ggml_devices() if d.kind in ("gpu", "igpu")]
    return (gpus[0].name, gpus[0].free, gpus[0].total) if gpus else None


def _first_gpu() -> Device | None:
    gpus = probe().gpus
    return gpus[0] if gpus else None


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
    n_gpu_layers: int | None = None,
    emit: Callable[[list[DeviceRow]], None] | None = None,
    extra_buffers: bool | None = None,
    offload_kqv: bool = True,
) -> list[DeviceRow]:
    """Rows of predicted vs logged bytes per buffer — on the device and on the host — and (GPU
    with a known free memory) what the device lost that no log line accounts for, after load and
    after the first image. ``n_gpu_layers``: None puts every layer (and the encoder) on the GPU;
    ``emit`` gets the rows before the model is freed; ``extra_buffers``: the CPU's extra buffer
    types on or off for both the plan and the load (None: edgevlm's default for this CPU);
    ``offload_kqv``: False keeps the KV cache on the host (attention there) for all three."""
    text_gf, proj_gf = read_gguf(model), read_gguf(mmproj)
    g0 = _first_gpu() if gpu else None
    if gpu and g0 is None:
        raise RuntimeError("no GPU registered in ggml (a CUDA or Vulkan build, GGML_VK_VISIBLE_DEVICES=0 for lavapipe)")
    name = g0.name if g0 is not None else "CPU"
    host = Device("CPU", "host", "cpu", 64 * 2**30, 64 * 2**30, True, "what-if")
    devices = (replace(g0, overhead_bytes=0), host) if g0 is not None else (host,)
    fp = Footprint(text_gf, proj_gf, Probe(devices), Wishes(n_ubatch=n_ubatch), repack=cpu_repacks(extra_buffers))
    ngl = (fp.text.n_layer + 1 if n_gpu_layers is None else n_gpu_layers) if gpu else 0
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
        offload_kqv=offload_kqv,
    )
    *gpu_pred, host_pred = fp.predict(cfg)
    replayed = [b.compute for b in (*gpu_pred, host_pred)]
    if gpu and ngl > 0:  # what the planner does with a plan: set it against llama.cpp's dry run
        got = dry_run(
            model, n_ctx=n_ctx, n_batch=cfg.n_batch, n_ubatch=n_ubatch, n_gpu_layers=ngl, flash_attn=True,
            type_k=type_kv, type_v=type_kv, op_offload=True, extra_buffers=extra_buffers, offload_kqv=offload_kqv,
        )  # fmt: skip
        if learn(fp.compute_scale, compare(got, [(name, gpu_pred[0])], ("CPU", host_pred))):
            *gpu_pred, host_pred = fp.predict(cfg)
    dev = _gpu_free() if gpu else None
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
            op_offload=ngl > 0,
            extra_buffers=extra_buffers,
            offload_kqv=offload_kqv,
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
            rows = _rows(buffer_lines(lines), label, name, g0, gpu_pred, host_pred, gpu, free0, dev, loaded, imaged)
            rows = [_with_replay(r, name, replayed) for r in rows]
            if emit is not None:  # before teardown, which a driver may not survive
                emit(rows)
        finally:
            be.close()
    return rows


def _rows(got, label, name, g0, gpu_pred, host_pred, gpu, free0, dev, loaded, imaged) -> list[DeviceRow]:

    def logged(fn: str, bufs: tuple[str, ...], what: str) -> int:
        return int(
            round(
                sum(v for k, v in got.items() if k.split(":")[0] == fn and k.split(":")[1] in bufs and k.endswith(what))
                * MIB
            )
        )

    host_bufs = ("CPU", "CPU_Mapped", "CPU_REPACK") + ((g0.host_buffer,) if g0 is not None and g0.host_buffer else ())
    clip = {k.split(":")[1]: v for k, v in got.items() if k.startswith("reserve_compute_meta:")}
    rows = []
    if gpu:
        p = gpu_pred[0]
        rows += [
            DeviceRow(label, f"weights on {name}", p.weights, logged("load_tensors", (name,), "model buffer size")),
            DeviceRow(label, f"KV on {name}", p.kv, logged("llama_kv_cache", (name,), "KV buffer size")),
            DeviceRow(label, f"compute on {name}", p.compute, logged("sched_reserve", (name,), "compute buffer size")),
            DeviceRow(
                label, f"encoder weights on {name}", p.mmproj_weights, int(round(got.get("clip:model", 0.0) * MIB))
            ),
            DeviceRow(label, f"encoder compute on {name}", p.mmproj_compute, int(round(clip.get(name, 0.0) * MIB))),
        ]
    h = host_pred
    rows += [
        DeviceRow(
            label,
            "weights on the host",
            h.weights,
            logged("load_tensors", host_bufs, "model buffer size"),
            lines=max(1, sum(1 for k in got if k.startswith("load_tensors:") and k.split(":")[1] in host_bufs)),
        ),
        DeviceRow(label, "KV on the host", h.kv, logged("llama_kv_cache", host_bufs, "KV buffer size")),
        DeviceRow(label, "compute on the host", h.compute, logged("sched_reserve", host_bufs, "compute buffer size")),
        DeviceRow(label, "output buffer (host)", h.other, logged("llama_context", host_bufs, "output buffer size")),
        DeviceRow(
            label,
            "encoder on the host",
            h.mmproj_compute + h.mmproj_weights,
            int(round((clip.get("CPU", 0.0) + (0.0 if gpu else got.get("clip:model", 0.0))) * MIB)),
            lines=1 if gpu else 2,
        ),
    ]
    if gpu and dev and loaded and imaged and g0 is not None and g0.free_known:
        on_dev = [r for r in rows if r.component.endswith(f"on {name}")]
        rows += [
            DeviceRow(
                label,
                "outside the logs after load",
                0,
                (free0 - loaded[1]) - sum(r.logged for r in on_dev if not r.component.startswith("encoder compute")),
            ),
            DeviceRow(
                label, "outside the logs after 1st image", 0, (free0 - imaged[1]) - sum(r.logged for r in on_dev)
            ),
        ]
    return rows


def _with_replay(r: DeviceRow, name: str, replayed: list[int]) -> DeviceRow:
    """``r`` with the replay's own compute where the dry run raised the plan's."""
    which = {f"compute on {name}": 0, "compute on the host": len(replayed) - 1}.get(r.component)
    if which is None or replayed[which] == r.predicted:
        return r
    return replace(r, replayed=replayed[which])


_SIZE = re.compile(r"^(\w+):\s+(\S+)\s+(.*?)\s*=\s*([0-9.]+) MiB")


def logged_on_device(lines: list[str], name: str) -> int:
    """Every buffer llama.cpp and mtmd logged on device ``name`` (the largest of each kind), in
    bytes: weights, KV, compute, the encoder's weights (when clip runs there) and compute."""
    sizes: dict[tuple[str, str], float] = {}
    for line in lines:
        m = _SIZE.match(line.strip())
        if m and m.group(2) == name and "buffer size" in m.group(3):
            key = (m.group(1), m.group(3))
            sizes[key] = max(sizes.get(key, 0.0), float(m.group(4)))
    clip_here = any(f"CLIP using {name} backend" in ln for ln in lines)
    clip_model = next((float(m.group(1)) for ln in lines if (m := re.search(r"model size:\s+([0-9.]+) MiB", ln))), 0.0)
    return int(round((sum(sizes.values()) + (clip_model if clip_here else 0.0)) * MIB))


@dataclass(frozen=True)
class GuardRow:
    label: str
    free: int  # the what-if size given for the device
    overhead: int  # kept free for the driver (--gpu-overhead)
    plan: str  # what the plan chose
    predicted: int  # the plan's bytes on the device
    logged: int  # what llama.cpp and mtmd logged there after load and one picture
    answered: bool  # the picture was answered (else refused by the guard, cleanly)

    @property
    def ok(self) -> bool:
        return self.logged <= self.free - self.overhead


def guard_on_device(
    model: str,
    mmproj: str,
    label: str,
    free: str,
    picture: str,
    n_threads: int = 4,
    emit: Callable[[GuardRow], None] | None = None,
    gpu_overhead: int | None = None,
) -> GuardRow:
    """``--free-memory DEV=SIZE --ngl auto`` as a user runs it: plan, load, one picture; what
    llama.cpp then holds on the device against SIZE less the GPU overhead (``--gpu-overhead``,
    bytes; None: the device's default). ``emit`` gets the row before the model is freed."""
    import edgevlm
    from edgevlm.errors import ContextExceeded, MemoryBusy
    from edgevlm.plan.devices import gpu_overhead_for, parse_size
    from edgevlm.plan.planner import make_plan

    name, _, size = free.rpartition("=")
    over = gpu_overhead_for(name) if gpu_overhead is None else gpu_overhead
    plan = make_plan(model, mmproj, probe(free_memory=[free], gpu_overhead=over))
    dev = next(d for d in plan.devices if d.name == name)
    chose = (
        f"ngl {plan.n_gpu_layers}, ctx {plan.n_ctx}, KV {plan.type_k}, ub {plan.n_ubatch}, "
        f"encoder on {'GPU' if plan.mmproj_on_gpu else 'CPU'}, img {plan.image_max_tokens}"
    )
    answered = True
    with logs.capture() as lines:
        vlm = edgevlm.load(model, mmproj, free_memory=[free], gpu_overhead=over, n_threads=n_threads)
        try:
            try:
                vlm.chat("What is this?", images=[picture], max_tokens=2)
            except (MemoryBusy, ContextExceeded):
                answered = False
            logged = logged_on_device(lines, name)
            row = GuardRow(label, parse_size(size), over, chose, dev.predicted.total, logged, answered)
            if emit is not None:
                emit(row)
        finally:
            vlm.close()
    return row


_RESERVE = re.compile(r"reserve_compute_meta:\s+(\S+) compute buffer size =\s+([0-9.]+) MiB")


def clip_reserves(lines: list[str]) -> list[tuple[str, float]]:
    """The (buffer, MiB) of each ``reserve_compute_meta`` line, in order: what a clip context
    reserved (mtmd with the warm-up off logs it at the context's first encode)."""
    return [(m.group(1), float(m.group(2))) for ln in lines if (m := _RESERVE.search(ln))]


def audio_on_device(
    model: str,
    mmproj: str,
    flash_attn: bool,
    n_threads: int = 2,
    emit: Callable[[dict], None] | None = None,
) -> dict:
    """Every layer and the projector on the first GPU, mtmd's warm-up off (as edgevlm loads it):
    what the clip contexts reserved at load, and at the first encode of one 20 s recording,
    beside the planner's audio buffer on that GPU and its host-side part (the mel frames)."""
    text_gf, proj_gf = read_gguf(model), read_gguf(mmproj)
    g0 = _first_gpu()
    if g0 is None:
        raise RuntimeError("no GPU registered in ggml (a CUDA or Vulkan build, GGML_VK_VISIBLE_DEVICES=0 for lavapipe)")
    host = Device("CPU", "host", "cpu", 64 * 2**30, 64 * 2**30, True, "what-if")
    fp = Footprint(text_gf, proj_gf, Probe((replace(g0, overhead_bytes=0), host)), Wishes())
    ngl = fp.text.n_layer + 1
    cfg = PlanConfig(
        ngl=ngl, n_ctx=1024, type_k="f16", type_v="f16", flash_attn=flash_attn, mmproj_gpu=True,
        image_tokens=0, n_batch=512, n_ubatch=512,
    )  # fmt: skip
    with logs.capture() as lines:
        be = Backend(
            model, mmproj, n_ctx=1024, n_gpu_layers=ngl, n_threads=n_threads, flash_attn=flash_attn,
            warmup=False, mmproj_use_gpu=True,
        )  # fmt: skip
        try:
            loaded = len(lines)
            samples = (np.random.default_rng(0).standard_normal(16000 * 20) * 0.1).astype(np.float32)
            bm = be.bitmap_from_audio(samples)
            try:
                with be.tokenize(be.marker, [bm], add_special=False) as chunks:
                    be.encode_image(next(c for c in chunks if c.kind == "audio"))
            finally:
                be.free_bitmap(bm)
            got = {
                "gpu": g0.name,
                "predicted_gpu": fp.audio_bytes(cfg),
                "predicted_host": fp.audio_bytes(cfg, host=True),
                "clip_on": [ln.split("CLIP using ")[1].split()[0] for ln in lines if "CLIP using " in ln],
                "at_load": clip_reserves(lines[:loaded]),
                "at_first_encode": clip_reserves(lines[loaded:]),
            }
            if emit is not None:  # before teardown, which a driver may not survive
                emit(got)
        finally:
            be.close()
    return got
