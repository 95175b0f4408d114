"""``edgevlm doctor``: what this installation can run on — the llama.cpp build and its features,
the devices it registered with their free memory, the CPU's kernels, and what is wrong with the
setup when something is (a CPU-only wheel on a machine with an NVIDIA GPU, numpy loaded before a
CUDA build's libraries). Nothing is loaded or downloaded.

When llama.cpp's libraries did not load, it says what it can find without them — the package's
version, which shared library failed and which dependencies it lacks, the GPUs ``nvidia-smi`` and
``vulkaninfo`` see — and the line that fixes it, and exits 2."""

from __future__ import annotations

import json
import os
import platform
import sys

import click

from .common import CLIError, handle_errors

__all__ = ["doctor"]


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as fh:
            return set(next((ln.split(":", 1)[1].split() for ln in fh if ln.startswith("flags")), []))
    except OSError:
        return set()


def facts() -> dict:
    """The report as data (``--json``)."""
    from ..backend import native

    lib = native.failure()
    return _facts() if lib is None else _facts_without_llama(lib)


def _facts_without_llama(lib) -> dict:
    """What can be found when llama.cpp's libraries did not load: the package on disk, the
    failed library and what it lacks, the host, and the GPUs the drivers' tools report."""
    import importlib.metadata

    import psutil

    from .. import __version__
    from ..backend import native
    from ..backend.system import default_threads
    from ..plan.gputools import tool_gpus

    try:
        version: str | None = importlib.metadata.version("llama-cpp-python")
    except importlib.metadata.PackageNotFoundError:
        version = None
    flags = _cpu_flags()
    gpus, absent = tool_gpus()
    vm = psutil.virtual_memory()
    backends = lib.backends
    return {
        "edgevlm": __version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "llama_cpp_python": version,
        "build": ", ".join(backends) + " build" if backends else "CPU build (no GPU backend)",
        "library_error": {
            "library": lib.library,
            "reason": lib.reason,
            "missing": lib.unresolved(),
            "folder": lib.folder,
            "chosen_by": lib.chosen_by,
            "package_libs": str(native.lib_dir() or ""),
            "fix": lib.fix(),
            "line": lib.line(),
        },
        "gpu_offload": None,
        "features": "",
        "cpu": {
            "threads": default_threads(),
            "avx2": "avx2" in flags,
            "avx512": "avx512f" in flags,
            "amx": "amx_int8" in flags,
        },
        "devices": [
            {
                "name": "CPU",
                "kind": "cpu",
                "description": "host memory",
                "free": int(vm.available),
                "total": int(vm.total),
                "free_known": True,
                "source": "psutil",
            },
            *(
                {
                    "name": g.name,
                    "kind": g.kind,
                    "description": g.driver,
                    "free": g.free_bytes,
                    "total": g.total_bytes,
                    "free_known": g.free_bytes is not None,
                    "source": g.source,
                }
                for g in gpus
            ),
        ],  # fmt: skip
        "tools_absent": absent,
        "notes": [],
    }


def _facts() -> dict:
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
    flags = _cpu_flags()
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
    lib = f.get("library_error")
    if as_json:
        click.echo(json.dumps(f, indent=2))
    elif lib:
        click.echo(_without_llama(f))
    if lib:  # the report said it all; the line and the exit status tell a script
        raise CLIError(lib["line"], 2)
    if as_json:
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


def _without_llama(f: dict) -> str:
    """The report when llama.cpp's libraries did not load."""
    from ..plan.devices import format_size

    lib, c = f["library_error"], f["cpu"]
    kernels = " ".join(k for k in ("avx2", "avx512", "amx") if c[k]).upper().replace("AVX512", "AVX-512") or "none"
    chosen = f" (that folder chosen by {lib['chosen_by']}; the wheel's own: {lib['package_libs']})"
    lines = [
        f"edgevlm {f['edgevlm']} · Python {f['python']} · {f['platform']}",
        f"llama-cpp-python {f['llama_cpp_python'] or 'not installed'}: its libraries did not load",
        f"  library:  {lib['library']}" + (chosen if lib["chosen_by"] else ""),
    ]
    if lib["folder"]:
        lines.append(f"  build:    {f['build']}, by the files in {lib['folder']}")
    lines.append(f"  reason:   {lib['reason']}")
    if lib["missing"]:
        lines.append(f"  lacks:    {', '.join(lib['missing'])} (not found by the system's loader)")
    lines += [f"CPU: {kernels}; {c['threads']} threads", "devices (without llama.cpp):"]
    for d in f["devices"]:
        mem = f"{format_size(d['free'])} free of " if d["free"] is not None else ""
        mem += format_size(d["total"]) if d["total"] is not None else "memory not reported"
        by = d["source"] + (f", driver {d['description']}" if d["description"] and d["source"] != "psutil" else "")
        lines.append(f"  {d['name']} · {d['kind']} · {mem} ({by})")
    if f["tools_absent"]:
        lines.append(f"  ({' and '.join(f['tools_absent'])} not on PATH)")
    lines.append(f"fix: {lib['fix']}")
    return "\n".join(lines)
