"""Measured memory per device: ggml's own backend API (one call for CUDA, Metal, Vulkan, ROCm and
CPU, through the libraries the llama_cpp package ships) plus host RAM through psutil.

Nothing here decides anything. What-if overrides (``--device cpu``, ``--free-memory 8GiB``,
``--gpu-overhead``) go through the same ``Device`` objects the real probe fills, so the planner
cannot tell a measured device from an injected one.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, replace
from typing import Any

import psutil

from ..backend.native import install_line
from ..backend.system import ggml_devices
from ..errors import InputError

__all__ = [
    "CPU_BUILD_NOTE",
    "DEFAULT_GPU_OVERHEAD",
    "GPU_OVERHEAD",
    "UNKNOWN_FREE_MARGIN",
    "Device",
    "format_size",
    "gpu_overhead_for",
    "gpu_without_build",
    "parse_size",
    "Probe",
    "probe",
]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}


def parse_size(text: str) -> int:
    """``8GiB``, ``8G`` (binary), ``8GB`` (decimal), ``512MiB``, ``1.5g``, ``123456`` → bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise InputError(f"'{text}' is not a size (try 8GiB, 512MiB, 6G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: int | float) -> str:
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"  # pragma: no cover


@dataclass(frozen=True)
class Device:
    name: str  # ggml's name: "CPU", "CUDA0", "Vulkan0", "MTL0", ...
    description: str
    kind: str  # "cpu" | "gpu" | "igpu" | "accel"
    free_bytes: int
    total_bytes: int
    free_known: bool = True  # False when the driver reports free == total (Vulkan w/o budget)
    source: str = "ggml"  # "ggml", "psutil", or "what-if"
    overhead_bytes: int = 0  # reserved for the driver/context before anything is allocated
    # what ggml's scheduler and allocator need to place a graph on it (read from the backend by
    # the probe; a what-if device gets CUDA-like defaults): its buffer alignment, the largest
    # buffer it allocates in one piece (0: no limit), the largest tensor one op may touch (0: no
    # limit; Vulkan's maxStorageBufferRange), and its pinned host buffer type, where the CPU's
    # compute buffer then lives ("" when it has none)
    align: int = 128
    max_alloc: int = 0
    max_tensor: int = 0
    host_buffer: str = ""
    host_align: int = 32

    @property
    def is_gpu(self) -> bool:
        return self.kind in ("gpu", "igpu")

    @property
    def usable_bytes(self) -> int:
        return max(0, self.free_bytes - self.overhead_bytes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Probe:
    devices: tuple[Device, ...]  # GPUs first (in ggml order), the host last
    notes: tuple[str, ...] = ()

    @property
    def gpus(self) -> list[Device]:
        return [d for d in self.devices if d.is_gpu]

    @property
    def host(self) -> Device:
        return next(d for d in self.devices if d.kind == "cpu")

    def to_dict(self) -> dict[str, Any]:
        return {"devices": [d.to_dict() for d in self.devices], "notes": list(self.notes)}


# What a GPU loses outside every buffer llama.cpp logs, after the probe read its free memory (in
# the same process, so the driver's context is already counted out): cuBLAS workspaces, the
# memory pool. Measured per backend by scripts/gpu_check.py — the largest "outside the logs after
# the 1st image" row of docs/results/gpu-check-*.json, rounded up to 32 MiB (tests/test_gpu_results.py
# holds the two together); backends not measured yet keep DEFAULT_GPU_OVERHEAD.
GPU_OVERHEAD = {"CUDA": 256 * 2**20}  # H200, CUDA 13.0: 233.4 MiB at most (Qwen2-VL-2B widths, a 1024-token picture)
DEFAULT_GPU_OVERHEAD = 384 * 2**20  # Vulkan, Metal, ROCm: not measured on a real device yet
UNKNOWN_FREE_MARGIN = 0.15  # the margin on a device whose free memory is unknown


def gpu_overhead_for(name: str) -> int:
    """The overhead kept free on GPU ``name`` ("CUDA0", "Vulkan1", ...) when none is given."""
    return next((v for k, v in GPU_OVERHEAD.items() if name.startswith(k)), DEFAULT_GPU_OVERHEAD)


def gpu_without_build() -> str | None:
    """An NVIDIA GPU's name and memory when the machine has one (``nvidia-smi`` answers) — asked
    only when llama.cpp registered no GPU, so that ``plan`` can say the build is a CPU-only one."""
    from .gputools import nvidia_gpus

    first = nvidia_gpus()[:1]
    if not first:
        return None
    total = first[0].total_bytes
    return first[0].name + (f", {total // 2**20} MiB" if total else "")


CPU_BUILD_NOTE = (
    "this llama-cpp-python build has no GPU support (a CPU wheel), but the machine has an NVIDIA GPU ({gpu}): "
    f"everything runs on the CPU. Rebuild it for the GPU: {install_line('CUDA')} (docs/install.md)"
)


def probe(device: str | None = None, free_memory: list[str] | None = None, gpu_overhead: int | None = None) -> Probe:
    """Measure the devices, then apply what-if overrides.

    ``device``: ``"cpu"`` plans for the host alone; a ggml device name (``CUDA0``) keeps that GPU
    only. ``free_memory``: sizes, in GPU order (``8GiB``) or by name (``CUDA0=8GiB``); on a
    machine without a GPU a size adds a what-if GPU so a laptop can be planned for from here.
    """
    notes: list[str] = []
    vm = psutil.virtual_memory()
    gpus: list[Device] = []
    host = Device("CPU", "host memory", "cpu", int(vm.available), int(vm.total), True, "psutil")
    for d in ggml_devices():
        if d.kind == "cpu":
            host = replace(host, name=d.name, description=d.description or host.description)
            continue
        if d.kind not in ("gpu", "igpu"):
            continue
        known = not (d.free == d.total and d.total > 0)
        if not known:
            notes.append(
                f"{d.name} reports free == total ({format_size(d.total)}): free memory unknown, so the plan "
                f"assumes all of it is free and keeps a {UNKNOWN_FREE_MARGIN:.0%} margin "
                f"(--free-memory {d.name}=SIZE says how much is)"
            )
        gpus.append(
            Device(
                d.name,
                d.description,
                d.kind,
                d.free,
                d.total,
                known,
                "ggml",
                align=d.align,
                max_alloc=d.max_alloc,
                max_tensor=d.max_tensor,
                host_buffer=d.host_buffer,
                host_align=d.host_align,
            )
        )
    if device:
        want = device.lower()
        if want == "cpu":
            gpus = []
        elif want not in ("gpu", "auto"):
            keep = [g for g in gpus if g.name.lower() == want]
            if not keep and not free_memory:
                names = ", ".join(g.name for g in gpus) or "none"
                raise InputError(f"no device '{device}' (devices here: CPU, {names})")
            gpus = keep
    for i, spec in enumerate(free_memory or []):
        name, _, size = spec.rpartition("=")
        nbytes = parse_size(size)
        idx = (
            next((j for j, g in enumerate(gpus) if g.name.lower() == name.lower()), None)
            if name
            else (i if i < len(gpus) else None)
        )
        if name.lower() == "cpu":
            host = replace(host, free_bytes=nbytes, total_bytes=max(host.total_bytes, nbytes), source="what-if")
        elif idx is None:
            label = name or f"GPU{len(gpus)}"
            gpus.append(Device(label, "what-if GPU", "gpu", nbytes, nbytes, True, "what-if"))
            notes.append(f"{label}: what-if device with {format_size(nbytes)} free")
        else:
            g = gpus[idx]
            gpus[idx] = replace(
                g, free_bytes=nbytes, total_bytes=max(g.total_bytes, nbytes), free_known=True, source="what-if"
            )
    if not gpus and not free_memory and (device or "").lower() != "cpu":
        unused = gpu_without_build()
        if unused:
            notes.append(CPU_BUILD_NOTE.format(gpu=unused))
    gpus = [replace(g, overhead_bytes=gpu_overhead_for(g.name) if gpu_overhead is None else gpu_overhead) for g in gpus]
    return Probe(tuple(gpus) + (host,), tuple(notes))
