"""The peers benchmarks measure edgevlm against (llama-cpp-python's own ``Llama``, its server),
loaded on the same kernels as edgevlm: where edgevlm loads without the CPU's extra buffer types
(an AMX build, whose matmul segfaults in the pinned llama.cpp: ``edgevlm.backend.system``), so
does the peer."""

from __future__ import annotations

import os

from edgevlm.backend.system import cpu_extra_buffers

__all__ = ["machine", "machine_busy_s", "same_kernels"]

_done = False


def same_kernels() -> bool:
    """Make every ``llama_cpp.Llama`` this process loads from now on use the CPU's extra buffer
    types exactly when edgevlm does; returns whether they are used."""
    global _done
    extra = cpu_extra_buffers()
    if not _done:
        import llama_cpp.llama_cpp as lc

        default = lc.llama_model_default_params

        def params():
            p = default()
            p.use_extra_bufts = extra
            return p

        lc.llama_model_default_params = params
        _done = True
    return extra


def machine_busy_s() -> float | None:
    """CPU seconds the whole machine has been busy (Linux ``/proc/stat``), or None elsewhere:
    benchmarks subtract their own to report what other processes took meanwhile."""
    try:
        with open("/proc/stat") as fh:
            v = [int(x) for x in fh.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def machine() -> dict:
    """What a benchmark's numbers depend on: the CPU (model, cores, AVX2 / AVX-512 / AMX), the
    platform and the llama.cpp build (its features line and llama-cpp-python's version)."""
    import platform

    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, val = line.partition(":")
                if key.strip() == "model name":
                    model = val.strip()
                elif key.strip() == "flags" and not flags:
                    flags = set(val.split())
    except OSError:
        pass
    try:
        import llama_cpp

        build, version = llama_cpp.llama_print_system_info().decode().strip(), llama_cpp.__version__
    except Exception:  # pragma: no cover - no llama_cpp
        build, version = "", ""
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "avx2": "avx2" in flags,
        "avx512": "avx512f" in flags,
        "amx": "amx_int8" in flags or "amx_tile" in flags,
        "platform": platform.platform(),
        "llama_cpp_python": version,
        "llama_cpp_build": build,
    }
