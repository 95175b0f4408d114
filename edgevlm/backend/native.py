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
(``late_warning``). The copy of libstdc++ is the build's (``backend.libstdcxx``): where a loaded
llama.cpp library carries one and libstdc++ came into the process first, ``require`` refuses
with one line naming both and the two fixes (``BUILD_PRIVATE_RUNTIME``) instead of crashing.

ggml's CPU threads meet at a barrier after every graph node; in an OpenMP build (the wheels
from PyPI) that is libgomp's barrier, whose waiting threads spin for ``GOMP_SPINCOUNT``
iterations (300,000 by default) before they sleep. On a machine with other busy processes the
spinning thread takes the time slice of the one it waits for: a one-shot chat on the tiny pair
beside three CPU-bound processes on 2 cores took 5-19 s instead of about 1 (and its tokens came
the same). ``preload`` sets ``GOMP_SPINCOUNT`` to ``SPIN_COUNT`` when the user set neither it
nor ``OMP_WAIT_POLICY``, before libgomp reads them: as fast as the default on a quiet machine
(decode of the LLaVA-1.5-7B-shaped pair within the noise), about as robust as the passive
policy on a busy one (which costs ~8 % of decode speed when quiet).

A library that does not load (a CUDA wheel without its runtime, a wrong architecture, a broken
build, ``LLAMA_CPP_LIB_PATH`` pointing elsewhere) must not break ``import edgevlm``: ``preload``
keeps the loader's words as a ``LoadFailure``, and every entry of the backend that needs
llama.cpp calls ``require``, which raises it as a ``LibraryError`` — one line naming the library,
the reason and the fix, the same for the CLI and for a library user.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from ..errors import LibraryError
from . import libstdcxx

__all__ = [
    "BUILD_PRIVATE_RUNTIME",
    "PINNED",
    "LoadFailure",
    "backends_on_disk",
    "conflict_line",
    "cuda_build",
    "failure",
    "failure_of",
    "install_line",
    "late_warning",
    "lib_dir",
    "preload",
    "require",
    "runtime_conflict",
]

SPIN_COUNT = "10000"  # libgomp's barrier spin before a thread sleeps (module doc); the default is 300,000
PINNED = "0.3.36"  # the llama-cpp-python edgevlm calls through (pyproject.toml pins it; a test holds them equal)
_RISKY = ("numpy",)  # imported before llama_cpp, it crashed a CUDA build's model load
# the CMake flag that keeps a static libstdc++ (or any static archive) private to the library it is
# linked into: docs/install.md's build line for a CUDA build that carries its own copy
BUILD_PRIVATE_RUNTIME = "-DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL"
# llama-cpp-python's modules that load a shared library, and the variable that moves each one's folder
_MODULES = ("llama_cpp", "llama_cpp.mtmd_cpp", "llama_cpp._ggml")
_OVERRIDES = {"llama": "LLAMA_CPP_LIB_PATH", "mtmd": "MTMD_CPP_LIB"}
_DRIVER_LIBS = ("libcuda.so", "nvcuda")  # NVIDIA's driver (what a machine without an NVIDIA GPU lacks)
_CUDA_LIBS = ("libcudart", "libcublas", "libnvrtc", "cudart64", "cublas64")  # the CUDA runtime a build links


def lib_dir() -> Path | None:
    """The folder of the shared libraries the installed llama-cpp-python ships (found on disk,
    nothing loaded); None when it is not installed."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or not spec.origin:
        return None
    return Path(spec.origin).parent / "lib"


def backends_on_disk(folder: Path | None = None) -> list[str]:
    """ggml's GPU backends whose libraries lie in ``folder`` (default: the wheel's own), by file
    name: ``["CUDA"]`` for a CUDA build, ``[]`` for a CPU one."""
    folder = folder or lib_dir()
    if folder is None or not folder.is_dir():
        return []
    names = {"cuda": "CUDA", "vulkan": "Vulkan", "metal": "Metal", "hip": "ROCm", "sycl": "SYCL", "opencl": "OpenCL"}
    found = set()
    for f in folder.iterdir():
        m = re.match(r"(?:lib)?ggml-([a-z]+)", f.name)
        if m and m.group(1) in names:
            found.add(names[m.group(1)])
    return sorted(found)


def cuda_build() -> bool:
    """Whether the installed llama-cpp-python carries ggml's CUDA backend (looked up on disk,
    without loading it)."""
    return "CUDA" in backends_on_disk()


def install_line(backend: str | None = None) -> str:
    """The pip line that (re)installs the pinned llama-cpp-python: a CPU build, or ``backend``'s
    (``"CUDA"``, ``"Vulkan"``, ``"Metal"``) as docs/install.md builds it; another one's flags are
    the user's to give."""
    known = {
        "CUDA": "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=native",
        "Vulkan": "-DGGML_VULKAN=on",
        "Metal": "-DGGML_METAL=on",
    }
    pip = f"pip install --force-reinstall --no-cache-dir --no-deps llama-cpp-python=={PINNED}"
    if not backend:
        return pip
    return f'CMAKE_ARGS="{known.get(backend, f"<the flags of its {backend} build>")}" {pip}'


@dataclass(frozen=True)
class LoadFailure:
    """Why llama.cpp's libraries did not load: the file, the loader's own words, the shared
    library it lacks when the loader names one, and the environment variable that chose the
    folder, if one did."""

    library: str  # the file that failed or was looked for ("llama-cpp-python": the package itself)
    reason: str
    missing: str = ""  # a dependency the loader could not find (libggml.so.0, libcudart.so.12)
    chosen_by: str = ""  # LLAMA_CPP_LIB_PATH / MTMD_CPP_LIB when it picked the library's folder
    installed: bool = True

    @property
    def folder(self) -> str:
        """The folder the library was loaded from or looked for in ("" when unknown)."""
        return os.path.dirname(self.library) if os.path.isabs(self.library) else ""

    @property
    def backends(self) -> list[str]:
        """The GPU backends whose libraries lie beside the failed one (what a reinstall keeps)."""
        return backends_on_disk(Path(self.folder)) if self.folder else []

    def fix(self) -> str:
        """What to do about it, with the install line when one fixes it."""
        if not self.installed:
            return f"install it: pip install llama-cpp-python=={PINNED}"
        if self.chosen_by:
            folder = os.environ.get(self.chosen_by, "")
            return (
                f"{self.chosen_by}={folder} chose that folder: unset it to use the wheel's own libraries, "
                "or point it at a folder holding a complete llama.cpp build"
            )
        build = "CUDA" if "CUDA" in self.backends else next(iter(self.backends), None)
        if self.missing.startswith(_DRIVER_LIBS):
            return f"no NVIDIA driver is installed ({self.missing}): install one, or the CPU build: {install_line()}"
        if self.missing.startswith(_CUDA_LIBS):
            return (
                f"the CUDA runtime this build was compiled against ({self.missing}) is not installed or not on the "
                f"loader's path (LD_LIBRARY_PATH): install that CUDA version's runtime, or rebuild for this machine: "
                f"{install_line('CUDA')} (or the CPU build: {install_line()})"
            )
        return f"reinstall it: {install_line(build)}"

    def line(self) -> str:
        """One line: the library, the reason, the fix."""
        if not self.installed:
            return f"llama-cpp-python is not installed ({self.reason}); {self.fix()}"
        lacks = f" (it lacks {self.missing})" if self.missing and self.missing not in self.reason else ""
        return (
            f"llama.cpp's library {self.library} did not load: {self.reason}{lacks}; {self.fix()} "
            "('edgevlm doctor' says more)"
        )

    def unresolved(self) -> list[str]:
        """Every dependency of the library the system's loader cannot find (``ldd``'s "not
        found"; the loader itself names only the first); empty where there is no ``ldd``."""
        import shutil
        import subprocess

        ldd = shutil.which("ldd")
        if ldd is None or not os.path.isfile(self.library):
            return [self.missing] if self.missing else []
        try:
            out = subprocess.run([ldd, self.library], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            return [self.missing] if self.missing else []
        return [ln.split("=>")[0].strip() for ln in out.splitlines() if "=> not found" in ln]


def _lib_name(base: str) -> str:
    if sys.platform == "win32":
        return f"{base}.dll"
    return f"lib{base}.dylib" if sys.platform == "darwin" else f"lib{base}.so"


def _chosen_by(path: str) -> str:
    for var in _OVERRIDES.values():
        folder = os.environ.get(var)
        if folder and os.path.abspath(os.path.dirname(path)) == os.path.abspath(folder):
            return var
    return ""


def failure_of(exc: BaseException) -> LoadFailure:
    """A ``LoadFailure`` from what importing llama-cpp-python raised: its loader's
    ``RuntimeError("Failed to load shared library 'PATH': REASON")``, its
    ``FileNotFoundError("Shared library with base name 'llama' not found")``, ctypes' own
    ``AttributeError`` for a symbol the library lacks, or the package missing altogether."""
    text = str(exc).strip()
    if isinstance(exc, ModuleNotFoundError) and exc.name == "llama_cpp":
        return LoadFailure("llama-cpp-python", text, installed=False)
    m = re.match(r"Failed to load shared library '(.+?)': (.*)", text, re.S)
    if m:
        path, reason = m.group(1), m.group(2).strip()
        if reason.startswith(path + ": "):  # dlerror repeats the file's name for its own faults
            reason = reason[len(path) + 2 :]
        dep = re.match(r"([^\s:]+): cannot open shared object file", reason) or re.search(
            r"Library not loaded: (\S+)", reason
        )
        missing = os.path.basename(dep.group(1)) if dep else ""
        return LoadFailure(path, reason, "" if missing == os.path.basename(path) else missing, _chosen_by(path))
    m = re.match(r"Shared library with base name '(.+?)' not found", text)
    if m:
        base = m.group(1)
        var = _OVERRIDES.get(base, "")
        folder = os.environ.get(var) if var else None
        where = Path(folder) if folder else (lib_dir() or Path("."))
        path = str(where / _lib_name(base))
        return LoadFailure(path, f"no such file (in {where})", "", var if folder else "")
    m = re.search(r"(\S+\.(?:so|dylib|dll)[\w.]*): (.*)", text)  # "PATH: undefined symbol: llama_..."
    if m:
        return LoadFailure(m.group(1), m.group(2).strip(), "", _chosen_by(m.group(1)))
    return LoadFailure("llama-cpp-python", f"{type(exc).__name__}: {text}")


_failure: LoadFailure | None = None


def failure() -> LoadFailure | None:
    """Why llama.cpp's libraries did not load at import, or None when they did."""
    return _failure


_conflict: list[libstdcxx.Conflict | None] = []  # runtime_conflict's answer, once known


def runtime_conflict() -> libstdcxx.Conflict | None:
    """Whether a loaded llama.cpp library carries its own libstdc++ in a process that loaded
    libstdc++ before llama.cpp's libraries (``libstdcxx.conflict``; looked up once, after
    llama.cpp loaded — the order cannot change later). None off Linux or without llama.cpp."""
    if _failure is not None or "llama_cpp" not in sys.modules:
        return None
    if not _conflict:
        _conflict.append(libstdcxx.conflict(modules=tuple(m for m in _RISKY if m in sys.modules)))
    return _conflict[0]


def conflict_line(found: libstdcxx.Conflict) -> str:
    """One line: the two copies of libstdc++ (which library, what came first) and both fixes."""
    build = next(iter(backends_on_disk(Path(found.library).parent)), None)
    line = install_line(build)
    if line.startswith('CMAKE_ARGS="'):
        line = line.replace('" pip install', f' {BUILD_PRIVATE_RUNTIME}" pip install', 1)
    else:
        line = f'CMAKE_ARGS="{BUILD_PRIVATE_RUNTIME}" {line}'
    return (
        f"{found.cause()}; import edgevlm (or llama_cpp) before numpy, or rebuild llama-cpp-python with its "
        f"libstdc++ kept private: {line} (docs/install.md)"
    )


def require() -> None:
    """Raise ``LibraryError`` (one line) when llama.cpp's libraries did not load, or when a model
    load would crash on two copies of libstdc++ (``runtime_conflict``); every backend entry that
    calls into llama.cpp starts with this."""
    if _failure is not None:
        raise LibraryError(_failure.line())
    found = runtime_conflict()
    if found is not None:
        raise LibraryError(conflict_line(found))


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
        "that has crashed every model load (a segmentation fault in llama_model_load_from_file), and a build "
        "that carries its own libstdc++ is refused. Import edgevlm (or llama_cpp) before numpy."
    )


def preload() -> bool:
    """Load llama.cpp's shared libraries now — libllama and libggml*, libmtmd — (True), or keep
    why they did not load (False; ``failure``), never raising. Warns once when it is already too
    late for a CUDA build."""
    global _failure
    if "OMP_WAIT_POLICY" not in os.environ and "llama_cpp" not in sys.modules:
        os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)  # (read once, when libgomp loads)
    msg = late_warning()
    if msg:
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
    try:
        for name in _MODULES:
            importlib.import_module(name)
    except Exception as exc:  # the loader raises RuntimeError / FileNotFoundError / AttributeError, not ImportError
        _failure = failure_of(exc)
        return False
    _failure = None
    _conflict.clear()  # (looked up when first needed)
    return True
