"""A ballast: device memory allocated and held by a process of its own, so that a big GPU shows
every other process (edgevlm's probe, its plan, llama.cpp) a laptop-sized one.

``fill`` is the logic, over any ``DeviceMemory`` (read free/total, allocate a chunk, release it):
allocate in chunks, read free memory again after each, give back the last chunk on an overshoot,
stop within ``tolerance`` of the target or at the deadline. Two devices implement it:

- ``CudaMemory``: libcudart through ctypes (``cudaMalloc``, ``cudaMemGetInfo``), found beside the
  CUDA build's ggml libraries, in the CUDA toolkit or in pip's ``nvidia`` packages;
- ``GgmlMemory``: ggml's own backend API through the llama_cpp package's library
  (``ggml_backend_buft_alloc_buffer`` on the device's buffer type, then cleared so that the pages
  are really committed), which works on whatever backend the build has: CUDA, Vulkan, Metal.

A device that cannot report its free memory (Mesa's lavapipe: free == total, and it stays so
while memory is held) is said so in the report (``free_known`` False): the ballast then holds
``total − target`` bytes, real memory, and the caller must tell the plan the size (``--free-memory
DEV=SIZE``) — never silently.

    python -m edgevlm_testkit.ballast --free 4GiB [--device CUDA0] [--backend cuda|ggml]

prints one JSON line (the report) when it holds, then holds until its standard input closes (the
parent ended or let go) or it gets SIGTERM. ``Ballast`` is the parent's side (a context manager).
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

__all__ = ["Ballast", "BallastReport", "CudaMemory", "DeviceMemory", "GgmlMemory", "fill", "find_cudart"]

MIB = 2**20
DEFAULT_TOLERANCE = 16 * MIB
DEFAULT_CHUNK = 1024 * MIB


class DeviceMemory(Protocol):
    name: str
    max_chunk: int  # the largest buffer allocated in one piece (0: no limit)

    def read(self) -> tuple[int, int]:
        """(free, total) bytes as the device reports them now."""
        ...

    def alloc(self, nbytes: int) -> Any:
        """A handle to ``nbytes`` of committed device memory, or None when the device refuses."""
        ...

    def release(self, handle: Any) -> None: ...


@dataclass
class BallastReport:
    device: str
    target_free: int
    free: int  # as read after filling (on a device that does not know: its constant report)
    total: int
    held: int  # bytes this process allocated and holds
    free_known: bool
    converged: bool  # |free − target| ≤ tolerance (a device that does not know: held what it should)
    chunks: int
    seconds: float
    note: str = ""
    backend: str = ""
    steps: list[tuple[int, int]] = field(default_factory=list)  # (held, free read) after each allocation

    def to_json(self) -> str:
        return json.dumps(asdict(self))


def fill(
    mem: DeviceMemory,
    target_free: int,
    tolerance: int = DEFAULT_TOLERANCE,
    deadline_s: float = 60.0,
    chunk: int = DEFAULT_CHUNK,
    clock=time.monotonic,
) -> tuple[BallastReport, list[tuple[Any, int]]]:
    """Allocate on ``mem`` until it reads ``target_free`` free (± ``tolerance``); the report and
    the held (handle, bytes) pairs, which the caller keeps alive."""
    t0 = clock()
    held: list[tuple[Any, int]] = []
    steps: list[tuple[int, int]] = []
    free, total = mem.read()
    stuck = 0
    if mem.max_chunk:
        chunk = min(chunk, mem.max_chunk)
    note, known = "", not (free == total and total > 0)

    def holding() -> int:
        return sum(n for _, n in held)

    if target_free > free:
        note = f"{mem.name} has only {free} bytes free, less than the {target_free} asked for: nothing held"
    while known and clock() - t0 < deadline_s:
        excess = free - target_free
        if abs(excess) <= tolerance:
            break
        if excess < 0:  # overshoot (allocation granularity, or another process): give the last chunk back
            if not held:
                break
            h, n = held.pop()
            mem.release(h)
            chunk = max(tolerance, n // 2)
        else:
            n = min(chunk, excess)
            h = mem.alloc(n)
            if h is None:
                chunk //= 2
                if chunk < tolerance:
                    note = f"{mem.name} refused allocations down to {chunk * 2} bytes at {free} free"
                    break
                continue
            held.append((h, n))
        before = free
        free, total = mem.read()
        steps.append((holding(), free))
        stuck = stuck + 1 if excess > 0 and free >= before else 0
        if stuck >= 2:  # two allocations in a row moved nothing: the device cannot say what is free
            known = False
    if not known:
        # the device reports free == total whatever is held: hold total − target of real memory anyway
        want = max(0, total - target_free) - holding()
        while want > 0 and clock() - t0 < deadline_s:
            n = min(chunk, want)
            h = mem.alloc(n)
            if h is None:
                chunk //= 2
                if chunk < tolerance:
                    break
                continue
            held.append((h, n))
            want -= n
            steps.append((holding(), mem.read()[0]))
        free, total = mem.read()
        note = (
            f"{mem.name} reports free == total ({total} bytes) whatever is allocated: its free memory is unknown, "
            f"so this ballast holds {holding()} bytes of real memory and the plan must be told the size "
            "(--free-memory DEV=SIZE)"
        )
    converged = abs(free - target_free) <= tolerance if known else holding() >= max(0, total - target_free) - tolerance
    if known and not converged and not note:
        note = f"stopped at {free} bytes free after {clock() - t0:.1f} s (deadline {deadline_s} s)"
    report = BallastReport(
        mem.name, target_free, free, total, holding(), known, converged, len(held), clock() - t0, note, steps=steps
    )
    return report, held


# ------------------------------------------------------------------------------------------------ CUDA runtime
def find_cudart() -> str | None:
    """libcudart: $EDGEVLM_CUDART, the one the CUDA build's ggml links (ldd), pip's nvidia package,
    the CUDA toolkit, then the loader's search path."""
    if os.environ.get("EDGEVLM_CUDART"):
        return os.environ["EDGEVLM_CUDART"]
    import importlib.util

    spec = importlib.util.find_spec("llama_cpp")
    libdirs = [Path(p) / "lib" for p in (spec.submodule_search_locations or [])] if spec else []
    for d in libdirs:
        for so in d.glob("libggml-cuda*.so*"):
            try:
                out = subprocess.run(["ldd", str(so)], capture_output=True, text=True, timeout=10).stdout
            except (OSError, subprocess.TimeoutExpired):
                continue
            for line in out.splitlines():
                if "libcudart" in line and "=>" in line and "not found" not in line:
                    return line.split("=>")[1].split("(")[0].strip()
    pats = [str(d / "libcudart.so*") for d in libdirs]
    pats += [p + "/nvidia/cuda_runtime/lib/libcudart.so*" for p in sys.path if p]
    pats += ["/usr/local/cuda/lib64/libcudart.so*", "/usr/local/cuda*/lib64/libcudart.so*"]
    pats += ["/usr/lib/x86_64-linux-gnu/libcudart.so*"]
    for pat in pats:
        hits = sorted(glob.glob(pat))
        if hits:
            return hits[-1]
    import ctypes.util

    return ctypes.util.find_library("cudart")


class CudaMemory:
    """One CUDA device through libcudart (``cudaMalloc`` commits device memory at once)."""

    def __init__(self, index: int = 0, lib: str | None = None):
        path = lib or find_cudart()
        if not path:
            raise RuntimeError("no libcudart found (set EDGEVLM_CUDART to its path)")
        self.lib = ctypes.CDLL(path)
        self.name = f"CUDA{index}"
        self.max_chunk = 0
        self._check(self.lib.cudaSetDevice(index), "cudaSetDevice")

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what} failed: CUDA error {rc}")

    def read(self) -> tuple[int, int]:
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self._check(self.lib.cudaMemGetInfo(ctypes.byref(free), ctypes.byref(total)), "cudaMemGetInfo")
        return int(free.value), int(total.value)

    def alloc(self, nbytes: int) -> Any:
        p = ctypes.c_void_p()
        if self.lib.cudaMalloc(ctypes.byref(p), ctypes.c_size_t(nbytes)) != 0:
            self.lib.cudaGetLastError()  # clear the sticky-free error state of a failed allocation
            return None
        return p

    def release(self, handle: Any) -> None:
        self.lib.cudaFree(handle)


# ------------------------------------------------------------------------------------------------ ggml backend
class GgmlMemory:
    """One ggml device (``CUDA0``, ``Vulkan0``, ...) through the llama_cpp package's ggml."""

    def __init__(self, device: str | None = None):
        import llama_cpp
        from llama_cpp import _ggml

        llama_cpp.llama_backend_init()
        lib = self.lib = _ggml.libggml
        vp, sz = ctypes.c_void_p, ctypes.c_size_t
        for fn, res, args in (
            ("ggml_backend_dev_count", sz, []),
            ("ggml_backend_dev_get", vp, [sz]),
            ("ggml_backend_dev_name", ctypes.c_char_p, [vp]),
            ("ggml_backend_dev_type", ctypes.c_int, [vp]),
            ("ggml_backend_dev_memory", None, [vp, ctypes.POINTER(sz), ctypes.POINTER(sz)]),
            ("ggml_backend_dev_buffer_type", vp, [vp]),
            ("ggml_backend_buft_get_max_size", sz, [vp]),
            ("ggml_backend_buft_alloc_buffer", vp, [vp, sz]),
            ("ggml_backend_buffer_clear", None, [vp, ctypes.c_uint8]),
            ("ggml_backend_buffer_free", None, [vp]),
        ):
            f = getattr(lib, fn)
            f.restype, f.argtypes = res, args
        devs = [lib.ggml_backend_dev_get(i) for i in range(lib.ggml_backend_dev_count())]
        named = {(lib.ggml_backend_dev_name(d) or b"").decode(): d for d in devs}
        gpus = [n for n, d in named.items() if lib.ggml_backend_dev_type(d) in (1, 2)]  # GPU, iGPU
        if device is None and not gpus:
            raise RuntimeError("ggml registered no GPU in this llama.cpp build")
        self.name = device or gpus[0]
        if self.name not in named:
            raise RuntimeError(f"no ggml device {self.name} (devices: {', '.join(named)})")
        self.dev = named[self.name]
        self.buft = lib.ggml_backend_dev_buffer_type(self.dev)
        limit = int(lib.ggml_backend_buft_get_max_size(self.buft))
        self.max_chunk = 0 if limit >= 1 << 48 else limit

    def read(self) -> tuple[int, int]:
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        self.lib.ggml_backend_dev_memory(self.dev, ctypes.byref(free), ctypes.byref(total))
        return int(free.value), int(total.value)

    def alloc(self, nbytes: int) -> Any:
        buf = self.lib.ggml_backend_buft_alloc_buffer(self.buft, nbytes)
        if not buf:
            return None
        self.lib.ggml_backend_buffer_clear(buf, 0)  # touch it: a driver may commit pages lazily (lavapipe does)
        return buf

    def release(self, handle: Any) -> None:
        self.lib.ggml_backend_buffer_free(handle)


# ------------------------------------------------------------------------------------------------ the process
def open_device(backend: str, device: str | None) -> DeviceMemory:
    if backend == "cuda":
        idx = int(device[4:]) if device and device.upper().startswith("CUDA") else 0
        return CudaMemory(idx)
    return GgmlMemory(device)


def _serve(args: argparse.Namespace) -> int:
    from edgevlm.plan.devices import parse_size  # the project's size syntax (8GiB, 512MiB)

    mem = open_device(args.backend, args.device)
    report, held = fill(mem, parse_size(args.free), parse_size(args.tolerance), args.deadline)
    report.backend = args.backend
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    threading.Thread(target=lambda: (sys.stdin.read(), done.set()), daemon=True).start()  # EOF: the parent let go
    print(report.to_json(), flush=True)
    while not done.wait(1.0):
        if os.getppid() == 1:  # the parent died without closing our stdin (it was inherited elsewhere)
            break
    for h, _ in reversed(held):
        mem.release(h)
    return 0


class Ballast:
    """The parent's side: start the ballast process, wait (with a deadline) for its report, and
    end it on leaving the block (stdin closed, then SIGTERM, then SIGKILL, each with a deadline)."""

    def __init__(
        self,
        free: str | int,
        backend: str = "ggml",
        device: str | None = None,
        python: str = sys.executable,
        env: dict[str, str] | None = None,
        tolerance: str = "16MiB",
        timeout: float = 120.0,
    ):
        self.cmd = [python, "-m", "edgevlm_testkit.ballast", "--free", str(free), "--backend", backend,
                    "--tolerance", tolerance, "--deadline", str(max(5.0, timeout - 30))]  # fmt: skip
        if device:
            self.cmd += ["--device", device]
        self.env, self.timeout = env, timeout
        self.proc: subprocess.Popen | None = None
        self.report: BallastReport | None = None

    def __enter__(self) -> Ballast:
        self.proc = subprocess.Popen(
            self.cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env
        )
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(self.timeout)
        if not line or not line[0].strip():
            self.stop()
            err = self.proc.stderr.read()[-2000:] if self.proc.stderr else ""
            raise RuntimeError(f"the ballast gave no report within {self.timeout:.0f} s: {err.strip()}")
        self.report = BallastReport(**{**json.loads(line[0]), "steps": []})
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> int | None:
        p = self.proc
        if p is None or p.poll() is not None:
            return None if p is None else p.returncode
        try:
            p.stdin.close()  # type: ignore[union-attr]
            return p.wait(timeout=30)
        except (subprocess.TimeoutExpired, OSError):
            p.terminate()
            try:
                return p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                return p.wait(timeout=10)

    def __exit__(self, *exc: object) -> None:
        self.stop()
        for f in (self.proc.stdout, self.proc.stderr) if self.proc is not None else ():
            if f is not None:
                f.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--free", required=True, help="free memory to leave (8GiB, 512MiB)")
    ap.add_argument("--backend", choices=("ggml", "cuda"), default="ggml")
    ap.add_argument("--device", help="ggml device name (CUDA0, Vulkan0); default: the first GPU")
    ap.add_argument("--tolerance", default="16MiB")
    ap.add_argument("--deadline", type=float, default=90.0, help="seconds to converge")
    return _serve(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
