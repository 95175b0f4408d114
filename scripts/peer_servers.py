"""The servers benchmarks start beside edgevlm (``scripts/bench_serve.py``, ``scripts/bench_caption.py``):
``llama-server`` built once from the sdist of the pinned llama-cpp-python (the llama.cpp it vendors:
the same kernels as ours), its command line, a process started on a free port of 127.0.0.1 and
waited for, and the CPU time a server process has used (its children included)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from edgevlm.backend.system import cpu_extra_buffers

__all__ = [
    "EXTRA_BUFFERS",
    "LLAMA_CPP_PYTHON",
    "Server",
    "build_llama_server",
    "cpu_seconds",
    "find_llama_server",
    "free_port",
    "launch",
    "llama_server_cmd",
]

LLAMA_CPP_PYTHON = "0.3.36"  # the pinned version whose vendored llama.cpp llama-server is built from
# The same kernels on every side: where edgevlm loads without the CPU's extra buffer types (an AMX
# build, whose matmul segfaults in this llama.cpp: docs/install.md), llama-server gets --no-repack.
EXTRA_BUFFERS = cpu_extra_buffers()
DEFAULT_CACHE = Path(os.environ.get("EDGEVLM_CACHE", Path.home() / ".cache" / "edgevlm")) / "llama-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_llama_server(cache: Path = DEFAULT_CACHE) -> Path:
    """llama-server from the sdist of the pinned llama-cpp-python, built once (static)."""
    build = cache / LLAMA_CPP_PYTHON / "build"
    exe = build / "bin" / "llama-server"
    if exe.exists():
        return exe
    src = Path(tempfile.mkdtemp(prefix="llama-src-"))
    print(
        f"building llama-server from llama-cpp-python {LLAMA_CPP_PYTHON}'s sdist into {build} (once; ~20 min "
        f"on 2 cores)",
        file=sys.stderr,
    )
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(src)]
    subprocess.run([*pip, f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], check=True)
    tar = next(src.glob("llama_cpp_python-*.tar.gz"))
    shutil.unpack_archive(tar, src)
    root = next(p for p in src.glob("llama_cpp_python-*") if p.is_dir()) / "vendor" / "llama.cpp"
    flags = ["-DCMAKE_BUILD_TYPE=Release", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF"]
    flags += ["-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
    subprocess.run(["cmake", "-S", str(root), "-B", str(build), *flags], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    shutil.rmtree(src, ignore_errors=True)
    return exe


def find_llama_server(given: Path | None, cache: Path = DEFAULT_CACHE) -> Path | str:
    """The binary given, else the one built into ``cache`` (building it if needed) — or why there
    is none (a benchmark then reports that side as skipped)."""
    if given is not None:
        return given if given.is_file() and os.access(given, os.X_OK) else f"{given}: not an executable file"
    try:
        return build_llama_server(cache)
    except (OSError, subprocess.CalledProcessError, StopIteration) as exc:
        return f"could not build llama-server ({type(exc).__name__}: {exc}); pass --llama-server PATH"


def llama_server_cmd(
    exe: Path, model: Path, mmproj: Path, port: int, parallel: int, ctx: int, threads: int
) -> list[str]:
    t = str(threads)
    cmd = [str(exe), "-m", str(model), "--mmproj", str(mmproj), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-np", str(parallel), "-c", str(ctx), "-t", t, "-tb", t, "-fa", "on", "--no-webui"]
    return cmd + ([] if EXTRA_BUFFERS else ["--no-repack"])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a process and all its children have used so far (children that
    already exited and were waited for are in the parent's own count only on some systems: read
    it while they run)."""
    p = psutil.Process(pid)
    procs = [p, *p.children(recursive=True)]
    total = 0.0
    for q in procs:
        try:
            t = q.cpu_times()
        except psutil.Error:  # a child that ended in between
            continue
        total += t.user + t.system
    return total


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    url: str
    log: Path

    def cpu_s(self) -> float:
        """CPU seconds the server and its children have used so far."""
        return cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def launch(
    name: str,
    cmd: list[str],
    port: int,
    logdir: Path,
    health: str = "/health",
    wait_s: float = 300,
    env: dict[str, str] | None = None,
) -> Server | str:
    """``cmd`` (a server on ``port`` of 127.0.0.1, in ``env``: default this process's) started and
    ready (``health`` answers 200) — or why it could not start."""
    log = logdir / f"{name}-{port}.log"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "w"), env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited at start: {log.read_text()[-400:]}"
        try:
            if httpx.get(url + health, timeout=2).status_code == 200:
                return Server(name, proc, url, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    proc.wait()
    return f"not ready in {wait_s:.0f} s"
