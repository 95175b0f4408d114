"""A llama.cpp library that does not load is a message (#59, case 10): ``import edgevlm`` never
raises, every command that needs llama.cpp says in one line which library failed, why and what
fixes it, and exits 2; the commands that need no llama.cpp keep working; ``edgevlm doctor``
says what it can find without it.

Each library is broken for real, and the system's loader says why: ``LLAMA_CPP_LIB_PATH``
pointing at an empty folder, at a copy of the real ``libllama.so`` without its ``libggml``
libraries, or at a file that is no shared library (a wrong architecture, a broken build); and a
copy of the llama_cpp package whose own ``lib/`` is a CUDA build without the CUDA runtime: the
real libraries, with ``libggml``'s needed CPU backend renamed ``libggml-cuda.so`` and that
one's needed ``libggml-base.so.0`` renamed ``libcudart.so.12`` (the loader then looks for the
runtime, which is not on this machine). What the loader says is read through ctypes in a fresh interpreter,
the reference each message is held against.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgevlm.backend import native

LIB = Path(importlib.util.find_spec("llama_cpp").origin).parent / "lib"  # the wheel's own libraries
REPO = Path(__file__).resolve().parents[1]
DEMO = (str(REPO / "models" / "edgevlm-demo.gguf"), str(REPO / "models" / "mmproj-edgevlm-demo.gguf"))
PICTURE = str(REPO / "examples" / "shapes.png")

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the libraries are broken the ELF way")


def _patched(src: Path, dst: Path, needed: bytes, instead: bytes) -> None:
    """A copy of ``src`` whose dynamic section needs ``instead`` where it needed ``needed``
    (the name rewritten in place in the string table, padded with NULs)."""
    data = src.read_bytes()
    old = b"\0" + needed + b"\0"
    assert data.count(old) == 1, (src, needed)
    assert len(instead) <= len(needed)
    dst.write_bytes(data.replace(old, b"\0" + instead + b"\0" * (len(needed) - len(instead) + 1)))


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """name → (environment, the library that fails)."""
    root = tmp_path_factory.mktemp("libload")
    out = {}
    empty = root / "empty"
    empty.mkdir()
    out["empty"] = ({"LLAMA_CPP_LIB_PATH": str(empty)}, empty / "libllama.so")
    no_deps = root / "no_deps"
    no_deps.mkdir()
    shutil.copy(LIB / "libllama.so", no_deps / "libllama.so")
    out["no_deps"] = ({"LLAMA_CPP_LIB_PATH": str(no_deps)}, no_deps / "libllama.so")
    not_elf = root / "not_elf"
    not_elf.mkdir()
    (not_elf / "libllama.so").write_text("this is a text file, not a shared library for this machine\n" * 4)
    out["not_elf"] = ({"LLAMA_CPP_LIB_PATH": str(not_elf)}, not_elf / "libllama.so")
    # a CUDA wheel without its runtime, in a copy of the package that comes first on the path
    site = root / "site"
    shutil.copytree(LIB.parent, site / "llama_cpp", ignore=shutil.ignore_patterns("lib", "__pycache__", "server"))
    lib = site / "llama_cpp" / "lib"
    lib.mkdir()
    for f in ("libllama.so", "libggml-base.so.0", "libmtmd.so"):
        shutil.copy(LIB / f, lib / f)
    _patched(LIB / "libggml.so", lib / "libggml.so.0", b"libggml-cpu.so.0", b"libggml-cuda.so")
    _patched(LIB / "libggml-cpu.so", lib / "libggml-cuda.so", b"libggml-base.so.0", b"libcudart.so.12")
    path = os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])
    out["cuda_runtime"] = ({"PYTHONPATH": path}, lib / "libllama.so")
    return out


LOADER = "import ctypes, sys\ntry:\n    ctypes.CDLL(sys.argv[1])\nexcept OSError as exc:\n    print(exc)\n"


def loader_says(library: Path) -> str:
    """What the system's loader says of ``library`` (dlopen through ctypes, in a fresh
    interpreter that loaded no llama.cpp library yet): the reference."""
    if not library.exists():
        return "no such file"
    r = subprocess.run([sys.executable, "-c", LOADER, str(library)], capture_output=True, text=True, timeout=60)
    text = r.stdout.strip()
    assert text, f"{library} loaded"
    return text[len(f"{library}: ") :] if text.startswith(f"{library}: ") else text


def run(env: dict, *args: str, path_dirs: list[str] | None = None) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONWARNINGS="ignore", **env)
    if path_dirs is not None:
        full["PATH"] = os.pathsep.join(path_dirs)
    return subprocess.run(
        [sys.executable, "-m", "edgevlm", *args], capture_output=True, text=True, timeout=120, env=full
    )  # fmt: skip


def one_line(r: subprocess.CompletedProcess, library: Path) -> str:
    """The command's error: exit 2, one line on stderr naming the library and the loader's
    reason, nothing on stdout, no traceback."""
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    assert str(library) in lines[0], lines[0]
    assert loader_says(library) in lines[0], (lines[0], loader_says(library))
    return lines[0]


def test_import_edgevlm_does_not_raise_and_load_raises_a_library_error(broken):
    env, library = broken["no_deps"]
    code = (
        "import json, edgevlm\n"
        "try:\n"
        f"    edgevlm.load({DEMO[0]!r}, {DEMO[1]!r})\n"
        "except edgevlm.BackendError as exc:\n"
        "    print(json.dumps([type(exc).__name__, isinstance(exc, edgevlm.LibraryError), str(exc)]))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env={**os.environ, **env}
    )
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    name, is_library_error, message = json.loads(r.stdout)
    assert name == "LibraryError"
    assert is_library_error
    assert str(library) in message
    assert loader_says(library) in message
    assert "LLAMA_CPP_LIB_PATH" in message  # the fix: the variable chose that folder


NEEDS_LLAMA = {
    "chat": ["chat", "-m", DEMO[0], "--mmproj", DEMO[1], "-i", PICTURE, "What shape is red?"],
    "chat-by-name": ["chat", "-m", "demo", "-i", PICTURE, "What shape is red?"],  # no note before the line
    "serve": ["serve", "-m", "demo", "--port", "0"],
    "plan": ["plan", "-m", "demo"],
    "budget-with-model": ["budget", PICTURE, "--model", "demo"],
    "caption": ["caption", "-m", "demo", str(REPO / "examples"), "--out", "{tmp}/captions.jsonl"],
    "batch": ["batch", "{tmp}/requests.jsonl", "--out", "{tmp}/answers.jsonl", "-m", "demo"],
}


@pytest.mark.parametrize("command", sorted(NEEDS_LLAMA))
def test_a_command_that_needs_llama_cpp_says_which_library_in_one_line(broken, command, tmp_path):
    """The issue's case: ``LLAMA_CPP_LIB_PATH`` at an empty folder, every command."""
    request = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
               "body": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}}  # fmt: skip
    (tmp_path / "requests.jsonl").write_text(json.dumps(request) + "\n")
    env, library = broken["empty"]
    line = one_line(run(env, *(a.format(tmp=tmp_path) for a in NEEDS_LLAMA[command])), library)
    assert "unset it" in line
    assert "edgevlm doctor" in line
    for written in ("answers.jsonl", "captions.jsonl"):  # nothing answered
        assert not (tmp_path / written).exists() or not (tmp_path / written).read_text().strip()


@pytest.mark.parametrize("case", ["no_deps", "not_elf", "cuda_runtime"])
def test_each_way_a_library_fails_is_one_line_with_its_fix(broken, case):
    env, library = broken[case]
    line = one_line(run(env, "chat", "-m", DEMO[0], "--mmproj", DEMO[1], "-i", PICTURE, "hi"), library)
    if case == "cuda_runtime":  # the wheel's own folder: no variable to blame; the runtime is what lacks
        assert "libcudart.so.12" in line
        assert "CUDA" in line
        assert "LLAMA_CPP_LIB_PATH" not in line
        assert native.install_line("CUDA") in line
        assert native.install_line() in line
    else:
        assert "LLAMA_CPP_LIB_PATH" in line


def test_inspect_and_budget_without_a_text_model_keep_working(broken):
    env, _ = broken["no_deps"]
    r = run(env, "inspect", DEMO[0], "--mmproj", DEMO[1], "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["model"]
    r = run(env, "budget", PICTURE, "--mmproj", DEMO[1], "--json")  # the projector's own arithmetic
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["total_tokens"] > 0


def test_the_models_listing_and_a_dry_run_keep_working(broken, tmp_path):
    env, _ = broken["no_deps"]
    r = run(dict(env, HF_HUB_CACHE=str(tmp_path)), "models", "--json")  # the listing, without a verdict
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)
    assert rows
    assert all(row["fits"] is None and row["fit"] == "? no llama.cpp" for row in rows)
    assert r.stderr.startswith("note: no model is planned: llama.cpp's library")
    assert "Traceback" not in r.stderr
    r = run(env, "caption", "-m", DEMO[0], "--mmproj", DEMO[1], str(REPO / "examples"), "--dry-run")
    assert r.returncode == 0, r.stderr
    assert "shapes.png" in r.stdout


NVIDIA_SMI = "#!/bin/sh\necho 'NVIDIA GeForce RTX 4060 Laptop GPU, 8188 MiB, 7901 MiB, 550.54.14'\n"
VULKANINFO = """#!/bin/sh
cat <<'EOF'
==========
VULKANINFO
==========

Vulkan Instance Version: 1.3.239


Devices:
========
GPU0:
\tapiVersion         = 1.3.277
\tvendorID           = 0x10de
\tdeviceType         = PHYSICAL_DEVICE_TYPE_DISCRETE_GPU
\tdeviceName         = NVIDIA GeForce RTX 4060 Laptop GPU
\tdriverName         = NVIDIA
\tdriverInfo         = 550.54.14
GPU1:
\tapiVersion         = 1.3.230
\tdeviceType         = PHYSICAL_DEVICE_TYPE_CPU
\tdeviceName         = llvmpipe (LLVM 15.0.6, 256 bits)
\tdriverName         = llvmpipe
\tdriverInfo         = Mesa 22.3.6 (LLVM 15.0.6)
EOF
"""


@pytest.fixture()
def gpu_tools(tmp_path):
    """Stand-ins for ``nvidia-smi`` and ``vulkaninfo`` (the one thing that cannot exist here),
    printing those tools' formats, first on PATH."""
    for name, text in (("nvidia-smi", NVIDIA_SMI), ("vulkaninfo", VULKANINFO)):
        (tmp_path / name).write_text(text)
        (tmp_path / name).chmod(0o755)
    system = [d for d in os.environ["PATH"].split(os.pathsep) if not (Path(d) / "nvidia-smi").exists()]
    return [str(tmp_path), *system]


@pytest.mark.parametrize("case", ["empty", "no_deps", "not_elf", "cuda_runtime"])
def test_doctor_says_what_it_finds_without_the_library(broken, case, gpu_tools):
    import importlib.metadata

    env, library = broken[case]
    r = run(env, "doctor", path_dirs=gpu_tools)
    line = one_line(r, library)  # its stderr: the same one line, exit 2
    out = r.stdout
    assert f"llama-cpp-python {importlib.metadata.version('llama-cpp-python')}: its libraries did not load" in out
    assert f"library:  {library}" in out
    assert f"reason:   {loader_says(library)}" in out
    assert "NVIDIA GeForce RTX 4060 Laptop GPU" in out
    assert "NVIDIA GeForce RTX 4060 Laptop GPU · gpu · 7.72 GiB free of 8.00 GiB (nvidia-smi, driver 550.54.14)" in out
    assert (
        "llvmpipe (LLVM 15.0.6, 256 bits) · cpu · memory not reported (vulkaninfo, driver Mesa 22.3.6 (LLVM 15.0.6))"
        in out
    )
    fix = out.splitlines()[-1]
    assert fix.startswith("fix: ")
    assert fix[5:] in line
    if case == "no_deps" and shutil.which("ldd"):  # every lacking dependency, not the loader's first alone
        assert "lacks:    libggml.so.0, libggml-base.so.0" in out
    if case == "cuda_runtime":
        assert f"build:    CUDA build, by the files in {library.parent}" in out
        assert "lacks:    libcudart.so.12" in out
        assert native.install_line("CUDA") in fix


def test_doctor_json_without_the_library(broken, gpu_tools):
    env, library = broken["cuda_runtime"]
    line = one_line(run(env, "chat", "-m", DEMO[0], "--mmproj", DEMO[1], "-i", PICTURE, "hi"), library)
    r = run(env, "doctor", "--json", path_dirs=gpu_tools)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    f = json.loads(r.stdout)
    assert f["library_error"]["library"] == str(library)
    assert f["library_error"]["line"] == line.removeprefix("Error: ")  # the one line every command says
    if shutil.which("ldd"):
        assert f["library_error"]["missing"] == ["libcudart.so.12"]
    assert f["build"] == "CUDA build"
    by_tool = [(d["source"], d["name"], d["kind"], d["total"], d["free"]) for d in f["devices"]]
    assert ("nvidia-smi", "NVIDIA GeForce RTX 4060 Laptop GPU", "gpu", 8188 * 2**20, 7901 * 2**20) in by_tool
    assert ("vulkaninfo", "llvmpipe (LLVM 15.0.6, 256 bits)", "cpu", None, None) in by_tool


def test_the_pinned_version_is_the_one_pyproject_pins():
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    assert re.search(r'"llama-cpp-python==([0-9.]+)"', text).group(1) == native.PINNED


def test_what_the_loader_says_of_a_missing_driver_or_package_is_read_too():
    """The two failures this machine cannot produce for real, in the loader's and Python's own
    words: a CUDA build on a machine without NVIDIA's driver, and no llama-cpp-python at all."""
    driver = native.failure_of(
        RuntimeError(
            "Failed to load shared library '/venv/llama_cpp/lib/libllama.so': "
            "libcuda.so.1: cannot open shared object file: No such file or directory"
        )
    )
    assert driver.library == "/venv/llama_cpp/lib/libllama.so"
    assert driver.missing == "libcuda.so.1"
    assert "no NVIDIA driver" in driver.line()
    assert native.install_line() in driver.line()
    absent = native.failure_of(ModuleNotFoundError("No module named 'llama_cpp'", name="llama_cpp"))
    assert absent.line() == (
        f"llama-cpp-python is not installed (No module named 'llama_cpp'); "
        f"install it: pip install llama-cpp-python=={native.PINNED}"
    )
