"""The GPUs the drivers' own tools report — ``nvidia-smi`` and ``vulkaninfo --summary`` —
for what llama.cpp cannot say: a CPU wheel on a machine with a GPU (``plan``'s note), and the
devices ``edgevlm doctor`` lists when llama.cpp's libraries did not load. Asked only when
called, each tool only when it is on ``PATH``; nothing is loaded."""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["ToolGPU", "nvidia_gpus", "parse_nvidia_smi", "parse_vulkaninfo", "tool_gpus", "vulkan_gpus"]

_TIMEOUT_S = 10
NVIDIA_QUERY = ["--query-gpu=name,memory.total,memory.free,driver_version", "--format=csv,noheader"]
_VK_KINDS = {
    "PHYSICAL_DEVICE_TYPE_DISCRETE_GPU": "gpu",
    "PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU": "igpu",
    "PHYSICAL_DEVICE_TYPE_VIRTUAL_GPU": "gpu",
    "PHYSICAL_DEVICE_TYPE_CPU": "cpu",
}


@dataclass(frozen=True)
class ToolGPU:
    name: str
    kind: str  # gpu | igpu | cpu (a software Vulkan device) | other
    source: str  # the tool that reported it: nvidia-smi | vulkaninfo
    total_bytes: int | None = None  # None: the tool does not say
    free_bytes: int | None = None
    driver: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _run(tool: str, args: list[str]) -> str | None:
    """The tool's standard output, or None when it is not on PATH, fails or hangs."""
    exe = shutil.which(tool)
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def _mib(field: str) -> int | None:
    m = re.fullmatch(r"\s*(\d+)\s*MiB\s*", field)
    return int(m.group(1)) * 2**20 if m else None


def parse_nvidia_smi(text: str) -> list[ToolGPU]:
    """``nvidia-smi --query-gpu=name,memory.total,memory.free,driver_version --format=csv,noheader``:
    one GPU a line, ``NVIDIA H200, 143771 MiB, 143199 MiB, 570.124.06`` (a field it cannot read
    is ``[N/A]``)."""
    gpus = []
    for line in text.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if not fields[0]:
            continue
        total, free = (_mib(fields[i]) if len(fields) > i else None for i in (1, 2))
        driver = fields[3] if len(fields) > 3 and not fields[3].startswith("[") else ""
        gpus.append(ToolGPU(fields[0], "gpu", "nvidia-smi", total, free, driver))
    return gpus


def parse_vulkaninfo(text: str) -> list[ToolGPU]:
    """``vulkaninfo --summary``'s ``Devices`` section: a ``GPU0:`` line per device, then its
    ``deviceType = ...`` and ``deviceName = ...``, ``driverInfo = ...`` (no memory sizes)."""
    gpus: list[ToolGPU] = []
    fields: dict[str, str] | None = None

    def close() -> None:
        if fields and fields.get("deviceName"):
            kind = _VK_KINDS.get(fields.get("deviceType", ""), "other")
            gpus.append(ToolGPU(fields["deviceName"], kind, "vulkaninfo", driver=fields.get("driverInfo", "")))

    for line in text.splitlines():
        if re.fullmatch(r"GPU\d+:", line.strip()):
            close()
            fields = {}
        elif fields is not None and "=" in line:
            key, _, value = line.partition("=")
            fields[key.strip()] = value.strip()
        elif fields is not None and line.strip() and not line[:1].isspace():
            close()  # the next section
            fields = None
    close()
    return gpus


def nvidia_gpus() -> list[ToolGPU]:
    """The NVIDIA GPUs ``nvidia-smi`` lists, with their memory; [] without it."""
    out = _run("nvidia-smi", NVIDIA_QUERY)
    return parse_nvidia_smi(out) if out else []


def vulkan_gpus() -> list[ToolGPU]:
    """The devices the Vulkan loader sees (``vulkaninfo --summary``); [] without it."""
    out = _run("vulkaninfo", ["--summary"])
    return parse_vulkaninfo(out) if out else []


def tool_gpus() -> tuple[list[ToolGPU], list[str]]:
    """Every GPU the tools report, and which tools were not found on PATH."""
    absent = [t for t in ("nvidia-smi", "vulkaninfo") if shutil.which(t) is None]
    return nvidia_gpus() + vulkan_gpus(), absent
