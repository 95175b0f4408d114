"""``edgevlm doctor``: what this installation can run on — the llama.cpp build and its features,
the devices it registered with their free memory, the CPU's kernels, and what is wrong with the
setup when something is (a CPU-only wheel on a machine with an NVIDIA GPU, numpy loaded before a
CUDA build's libraries). Nothing is loaded or downloaded."""

from __future__ import annotations

import json
import os
import platform
import sys

import click

from .common import handle_errors

__all__ = ["doctor"]


def facts() -> dict:
    """The report as data (``--json``)."""
    from .. import __version__
    from ..backend import native
    from ..backend.system import (
        EXTRA_BUFFERS_ENV,
        build_info,
        cpu_extra_buffers,
        cpu_repacks,
        default_threads,
    )
    from ..plan.devices import probe

    version, features, offload = build_info()
    p = probe()
    backends = sorted({d.name.rstrip("0123456789") for d in p.gpus})
    flags = set()
    try:
        with open("/proc/cpuinfo") as fh:
            flags = set(next((ln.split(":", 1)[1].split() for ln in fh if ln.startswith("flags")), []))
    except OSError:
        pass
    return {
        "edgevlm": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "llama_cpp_python": version,
        "build": ", ".join(backends) + " build" if backends else "CPU build (no GPU backend)",
        "gpu_offload": offload,
        "features": features,
        "cpu": {
            "threads": default_threads(),
            "avx2": "avx2" in flags or "AVX2 = 1" in features,
            "avx512": "avx512f" in flags or "AVX512 = 1" in features,
            "amx": "amx_int8" in flags or "AMX_INT8 = 1" in features,
            "extra_buffers": cpu_extra_buffers(),
            "extra_buffers_from": EXTRA_BUFFERS_ENV if os.environ.get(EXTRA_BUFFERS_ENV) else "default",
            "repacks": cpu_repacks(),
        },
        "devices": [
            {
                "name": d.name,
                "kind": d.kind,
                "description": d.description,
                "free": d.free_bytes,
                "total": d.total_bytes,
                "free_known": d.free_known,
                "overhead": d.overhead_bytes,
            }
            for d in p.devices
        ],  # fmt: skip
        "notes": list(p.notes) + ([native.late_warning()] if native.late_warning() else []),
    }


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
@handle_errors
def doctor(as_json) -> None:
    """What this installation runs on: llama.cpp's build, its devices and their free memory.

    \b
    edgevlm doctor
    edgevlm doctor --json
    """
    from ..plan.devices import format_size

    f = facts()
    if as_json:
        click.echo(json.dumps(f, indent=2))
        return
    c = f["cpu"]
    kernels = " ".join(k for k in ("avx2", "avx512", "amx") if c[k]).upper().replace("AVX512", "AVX-512") or "none"
    lines = [
        f"edgevlm {f['edgevlm']} · Python {f['python']} · {f['platform']}",
        f"llama-cpp-python {f['llama_cpp_python'] or 'not installed'}: {f['build']}",
        f"  features: {f['features'] or '-'}",
        f"CPU: {kernels}; {c['threads']} threads; extra buffer types "
        + ("on" if c["extra_buffers"] else "off")
        + f" ({c['extra_buffers_from']}); host weights repacked with no GPU layer: {'yes' if c['repacks'] else 'no'}",
        "devices:",
    ]
    for d in f["devices"]:
        free = f"{format_size(d['free'])} free" if d["free_known"] else "free memory unknown"
        over = f", {format_size(d['overhead'])} kept for the driver" if d["kind"] != "cpu" else ""
        lines.append(f"  {d['name']:<9} {d['kind']:<4} {free} of {format_size(d['total'])}{over} · {d['description']}")
    for n in f["notes"]:
        lines.append(f"note: {n}")
    click.echo("\n".join(lines))
    sys.stdout.flush()
