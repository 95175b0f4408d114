"""llama-cpp-python built with llama.cpp's Vulkan backend, in a virtualenv of its own, unattended.

    python -m edgevlm_testkit.vulkan_build [--venv .venv-vulkan] [--server]

Steps, each skipped when already done: (1) Debian's Vulkan loader headers, ``glslc``, SPIR-V
headers and Mesa's drivers (lavapipe, the software device) through apt when any is missing; (2) the
pinned llama-cpp-python sdist is built into a wheel with ``-DGGML_VULKAN=on`` once per machine and
cached in ``~/.cache/edgevlm/vulkan/`` (next to pip's cache, so CI reuses it) — when the installed
Vulkan headers predate ``VK_EXT_layer_settings`` (Debian 12 ships 1.3.239), the one block of
``ggml-vulkan.cpp`` that needs it (settings for the validation layer only) is taken out first;
(3) the venv gets that wheel, then edgevlm and its test kit. About 12 minutes on 2 cores the first
time, seconds afterwards.

``--server`` (or ``EDGEVLM_VULKAN_SERVER=1``, which ``scripts/gpu_check.py --vulkan`` passes on) adds
llama.cpp's ``llama-server`` to that same CMake build (``llama_server.cmake``: ggml is compiled once for
both) and keeps it, with the build's shared libraries, in the cache's ``server/`` folder (``cached_server``,
run with ``server_env``); a wheel cached without it is built again, once, with it, and the venv gets that
wheel (``edgevlm-wheel.sha256`` in the venv says which it has). The server's own sources are a small part
of the compile: ggml and the Vulkan shaders are most of it.

``device_env()`` gives the environment that shows a CPU-type Vulkan device (ggml skips those
unless ``GGML_VK_VISIBLE_DEVICES`` names them); a real GPU needs nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

VERSION = "0.3.36"  # the llama-cpp-python the project pins
ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("EDGEVLM_CACHE", Path.home() / ".cache" / "edgevlm")) / "vulkan"
APT = ["libvulkan-dev", "glslc", "spirv-headers", "mesa-vulkan-drivers", "vulkan-tools"]
HEADER = Path("/usr/include/vulkan/vulkan_core.h")
PATCH_FROM = "    VkBool32 enable_best_practice = layer_settings;"
PATCH_TO = "    vk::InstanceCreateInfo instance_create_info(vk::InstanceCreateFlags{}, &app_info, layers, extensions);"
PATCH_END = "&layer_setting_info);"
SERVER_CMAKE = Path(__file__).with_name("llama_server.cmake")
SERVER_ARGS = f"-DCMAKE_PROJECT_llama_cpp_INCLUDE={SERVER_CMAKE} -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF"


def say(msg: str) -> None:
    print(f"[vulkan-build] {msg}", file=sys.stderr, flush=True)


def run(cmd: list[str], **kw) -> None:
    say("+ " + " ".join(cmd))
    subprocess.run(cmd, check=True, **kw)


def missing_packages() -> list[str]:
    have = {
        "libvulkan-dev": HEADER.exists(),
        "glslc": shutil.which("glslc") is not None,
        "spirv-headers": Path("/usr/include/spirv").exists(),
        "mesa-vulkan-drivers": any(Path("/usr/share/vulkan/icd.d").glob("lvp_icd*.json"))
        or any(Path("/usr/share/vulkan/icd.d").glob("*.json")),
        "vulkan-tools": shutil.which("vulkaninfo") is not None,
    }
    return [p for p in APT if not have[p]]


def ensure_packages() -> None:
    need = missing_packages()
    if not need:
        return
    if shutil.which("apt-get") is None:
        raise SystemExit(f"missing {', '.join(need)} and no apt-get: install the Vulkan SDK by hand")
    sudo = [] if os.geteuid() == 0 else ["sudo", "-n"]
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    run([*sudo, "apt-get", "update", "-q"], env=env, stdout=subprocess.DEVNULL)
    run([*sudo, "apt-get", "install", "-y", "-q", *need], env=env, stdout=subprocess.DEVNULL)


def headers_have_layer_settings() -> bool:
    return HEADER.exists() and "VK_EXT_layer_settings" in HEADER.read_text(errors="replace")


def patch_layer_settings(src: Path) -> bool:
    """Take out the validation layer's settings block that needs VK_EXT_layer_settings."""
    f = src / "vendor" / "llama.cpp" / "ggml" / "src" / "ggml-vulkan" / "ggml-vulkan.cpp"
    text = f.read_text()
    start = text.find(PATCH_FROM)
    end = text.find(PATCH_END, start)
    if start < 0 or end < 0:
        raise SystemExit(f"{f}: the VK_EXT_layer_settings block was not found; cannot patch this version")
    f.write_text(text[:start] + PATCH_TO + text[end + len(PATCH_END) :])
    return True


def wheel_dir() -> Path:
    tag = "layer-settings" if headers_have_layer_settings() else "no-layer-settings"
    return CACHE / f"{VERSION}-{tag}"


def cached_wheel() -> Path | None:
    return next(iter(sorted(wheel_dir().glob("llama_cpp_python-*.whl"))), None)


def server_dir() -> Path:
    return wheel_dir() / "server"


def cached_server() -> Path | None:
    """The cached llama-server of the same build as the cached wheel (run it with ``server_env``)."""
    exe = server_dir() / "llama-server"
    return exe if exe.exists() and (server_dir() / "build.json").exists() else None


def server_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment that runs the cached llama-server on its own build's libraries and device 0."""
    env = device_env(env)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (str(server_dir()), env.get("LD_LIBRARY_PATH")) if p)
    return env


def keep_server(build: Path, whl: Path, seconds: float) -> Path:
    """Copy llama-server and the shared libraries it links from the build folder into the cache."""
    out = server_dir()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    shutil.copy2(build / "bin" / "llama-server", out / "llama-server")
    for lib in sorted(build.rglob("lib*.so*")):  # (the soname links stay links: lib.so -> lib.so.0 -> lib.so.0.x)
        if not os.path.lexists(out / lib.name):
            shutil.copy2(lib, out / lib.name, follow_symlinks=False)
    if (build / ".ninja_log").exists():  # each compile's start and end: what the server adds to the build
        shutil.copy2(build / ".ninja_log", out / "ninja_log.txt")
    stamp = {"wheel": whl.name, "wheel_sha256": sha256(whl), "build_s": round(seconds)}
    (out / "build.json").write_text(json.dumps(stamp, indent=1) + "\n")
    return out / "llama-server"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fetch_sdist(folder: Path, python: str = sys.executable) -> Path:
    """The pinned llama-cpp-python's source, unpacked into ``folder`` (the 77 MB archive is
    downloaded once and kept in the cache: pip takes most of a minute to hand it over again)."""
    keep = CACHE.parent / "sdist"
    tgz = keep / f"llama_cpp_python-{VERSION}.tar.gz"
    if not tgz.exists():
        keep.mkdir(parents=True, exist_ok=True)
        run([python, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:", "-d", str(keep),
             f"llama-cpp-python=={VERSION}"])  # fmt: skip
    with tarfile.open(tgz) as tar:
        tar.extractall(folder, filter="data")
    return folder / f"llama_cpp_python-{VERSION}"


def build_wheel(python: str = sys.executable, server: bool = False) -> Path:
    """The cached Vulkan wheel, built first when missing (with llama-server beside it when ``server``)."""
    whl = cached_wheel()
    if whl and (cached_server() or not server):
        return whl
    ensure_packages()
    out = wheel_dir()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llama-vk-") as tmp:
        src = fetch_sdist(Path(tmp), python)
        if not headers_have_layer_settings():
            say(f"{HEADER} lacks VK_EXT_layer_settings: building without the validation layer's settings")
            patch_layer_settings(src)
        build = Path(tmp) / "build"
        env = dict(
            os.environ,
            CMAKE_ARGS="-DGGML_VULKAN=on" + (f" {SERVER_ARGS}" if server else ""),
            CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 2),
            FORCE_CMAKE="1",
        )
        say(f"building llama-cpp-python {VERSION} with Vulkan{' and llama-server' * server} (once)")
        t0 = time.monotonic()
        run([python, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out),
             f"--config-settings=build-dir={build}", str(src)], env=env)  # fmt: skip
        whl = cached_wheel()
        if whl is None:
            raise SystemExit(f"no wheel in {out} after the build")
        if server:
            keep_server(build, whl, time.monotonic() - t0)
        say(f"built in {time.monotonic() - t0:.0f} s")
    return whl


def venv_python(venv: Path) -> Path:
    return venv / ("Scripts" if os.name == "nt" else "bin") / "python"


def has_vulkan(py: Path) -> bool:
    probe = (
        "import ctypes, llama_cpp, pathlib, sys;"
        "lib = pathlib.Path(llama_cpp.__file__).parent / 'lib';"
        "sys.exit(0 if any(lib.glob('*ggml-vulkan*')) else 1)"
    )
    return py.exists() and subprocess.run([str(py), "-c", probe], capture_output=True).returncode == 0


def prepare_venv(venv: Path, extras: str = "test", server: bool | None = None) -> Path:
    """A venv with the Vulkan llama-cpp-python, edgevlm (with ``extras``) and the test kit; with ``server``
    (default: ``EDGEVLM_VULKAN_SERVER=1`` in the environment), the wheel is the one built with the cached
    llama-server."""
    if server is None:
        server = os.environ.get("EDGEVLM_VULKAN_SERVER") == "1"
    py = venv_python(venv)
    if not py.exists():
        run([sys.executable, "-m", "venv", str(venv)])
        run([str(py), "-m", "pip", "install", "-q", "--upgrade", "pip"])
    stamp = venv / "edgevlm-wheel.sha256"
    if not has_vulkan(py) or server:
        whl = build_wheel(str(py), server=server)
        digest = sha256(whl)
        if not has_vulkan(py) or not stamp.exists() or stamp.read_text().strip() != digest:
            run([str(py), "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", str(whl)])
            run([str(py), "-m", "pip", "install", "-q", str(whl)])  # its own dependencies (numpy, jinja2)
            stamp.write_text(digest + "\n")
    target = f"{ROOT}[{extras}]" if extras else str(ROOT)
    run([str(py), "-m", "pip", "install", "-q", "-e", str(ROOT / "testkit"), "-e", target])
    if not has_vulkan(py):
        raise SystemExit(f"{venv}: llama_cpp has no Vulkan backend after the install")
    return py


def device_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment that shows Vulkan device 0 to ggml even when it is a CPU-type device."""
    env = dict(os.environ if env is None else env)
    env.setdefault("GGML_VK_VISIBLE_DEVICES", "0")
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venv", type=Path, default=ROOT / ".venv-vulkan")
    ap.add_argument("--wheel-only", action="store_true", help="build (or find) the cached wheel and print it")
    ap.add_argument("--server", action="store_true", default=None, help="also llama-server, from the same build")
    args = ap.parse_args(argv)
    if args.wheel_only:
        server = args.server or os.environ.get("EDGEVLM_VULKAN_SERVER") == "1"
        print(build_wheel(server=server))
        if server:
            print(cached_server())
        return 0
    print(prepare_venv(args.venv, server=args.server))
    return 0


if __name__ == "__main__":
    sys.exit(main())
