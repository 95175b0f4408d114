"""llama.cpp's shared libraries, loaded before anything that starts threads or brings its own
C++ runtime — numpy above all.

Seen on an NVIDIA H200 (llama-cpp-python 0.3.36 built with CUDA 13.0 and GGML_NATIVE, Python
3.12, numpy 2 with its bundled OpenBLAS): in a process that imported numpy before ``llama_cpp``,
every model load segfaulted inside ``llama_model_load_from_file`` — in ``llama_model::print_info``,
whose ``std::ostream << long`` ran a copy of libstdc++'s code inside ``libggml-cuda.so`` — while
the same load in a process that imported ``llama_cpp`` first (or numpy after it) ran, and so
did the whole device suite, chat, caption and serve (``scripts/gpu_check.py --loads`` and
docs/gpu.md have the table). ``import numpy`` alone was enough: PIL, psutil, yaml, jinja2, rich
and huggingface_hub first were harmless. The CPU and Vulkan builds never showed it.

So ``import edgevlm`` loads ``llama_cpp`` first of all (``preload``, ~0.1 s), before its own
modules import numpy; the CLI, the server, the captioner and Ray actors all start that way. A
program that imported numpy before edgevlm is told, once, how to avoid the crash
(``late_warning``).
"""

from __future__ import annotations

import importlib.util
import sys
import warnings
from pathlib import Path

__all__ = ["cuda_build", "late_warning", "preload"]

_RISKY = ("numpy",)  # imported before llama_cpp, it crashed a CUDA build's model load


def cuda_build() -> bool:
    """Whether the installed llama-cpp-python carries ggml's CUDA backend (looked up on disk,
    without loading it)."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.origin:
        return False
    lib = Path(spec.origin).parent / "lib"
    return any(lib.glob("libggml-cuda*")) or any(lib.glob("ggml-cuda*"))


def late_warning() -> str | None:
    """What to tell a process that imported numpy before llama.cpp's libraries, on a CUDA build;
    None when the order is safe (or llama_cpp is already loaded: too late to change)."""
    if "llama_cpp" in sys.modules:
        return None
    early = [m for m in _RISKY if m in sys.modules]
    if not early or not cuda_build():
        return None
    return (
        f"{', '.join(early)} was imported before llama.cpp's libraries; with llama-cpp-python's CUDA build "
        "that has crashed every model load (a segmentation fault in llama_model_load_from_file). "
        "Import edgevlm (or llama_cpp) before numpy."
    )


def preload() -> bool:
    """Load llama.cpp's shared libraries now (True), or nothing when llama-cpp-python is not
    installed (False). Warns once when it is already too late for a CUDA build."""
    msg = late_warning()
    if msg:
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
    try:
        import llama_cpp  # noqa: F401  (its import loads libllama, libggml*, libmtmd)
    except ImportError:
        return False
    return True
