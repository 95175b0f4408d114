"""Two copies of libstdc++ in one process (``edgevlm.backend.libstdcxx``, docs/gpu.md "Loading on
NVIDIA"): a llama.cpp library that exports libstdc++'s own code, and the system's brought in
first by numpy.

The CUDA library that carried the copy on the H200 cannot exist here; a real shared library
built here with g++ the same way (``-static-libstdc++``, exported) stands in for it, beside the
real CPU build's libraries (``LLAMA_CPP_LIB_PATH``, llama-cpp-python's own variable), with a real
numpy imported first in a real interpreter. The build line's fix (``-Wl,--exclude-libs,ALL``)
is checked on the same source; binutils' ``nm`` is the reference for the ELF reader.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from edgevlm.backend import libstdcxx, native

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ELF and libstdc++: Linux only")

SOURCE = """#include <sstream>
#include <string>
extern "C" int cuda_fn(long n) { std::ostringstream s; s << "n_embd = " << n; return (int)s.str().size(); }
"""
FIXED = "-Wl,--exclude-libs,ALL"  # what native.BUILD_PRIVATE_RUNTIME passes to the linker


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """{"private": a library carrying an exported static libstdc++, "fixed": the same built with
    the fix line} — compiled here."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("g++ is not installed: the stand-in libraries cannot be built")
    d = tmp_path_factory.mktemp("libstdcxx")
    (d / "cuda.cpp").write_text(SOURCE)
    out = {}
    for kind, extra in (("private", []), ("fixed", [FIXED])):
        lib = d / kind / "libggml-cuda.so"
        lib.parent.mkdir()
        cmd = [gxx, "-O1", "-shared", "-fPIC", "-static-libstdc++", "-static-libgcc", *extra, "-o", str(lib)]
        r = subprocess.run([*cmd, str(d / "cuda.cpp")], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            pytest.skip(f"g++ cannot link libstdc++ statically here: {r.stderr.strip()[-200:]}")
        out[kind] = lib
    return out


def _nm_defined(path: Path) -> set[str]:
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("binutils' nm (the reference) is not installed")
    lines = subprocess.run([nm, "-D", "--defined-only", str(path)], capture_output=True, text=True).stdout
    return {ln.split()[-1].split("@")[0] for ln in lines.splitlines() if ln.strip()}


def _shipped() -> list[Path]:
    folder = native.lib_dir()
    assert folder is not None
    return sorted(p for p in folder.iterdir() if p.suffix == ".so")


def test_the_elf_reader_lists_what_nm_lists(built):
    for lib in [built["private"], built["fixed"], *_shipped()]:
        assert libstdcxx.exported_definitions(str(lib)) == _nm_defined(lib), lib
    assert libstdcxx.exported_definitions(__file__) is None  # not an ELF file


def test_a_static_libstdcxx_is_exported_and_the_fix_line_hides_it(built):
    private, fixed = built["private"], built["fixed"]
    assert "std::ostream::_M_insert<long>" in libstdcxx.runtime_copy(str(private))  # the H200's crash site
    assert sum(s.startswith(("_ZNS", "_ZSt", "__cxa")) for s in _nm_defined(private)) > 100
    assert libstdcxx.runtime_copy(str(fixed)) == []
    assert _nm_defined(fixed) == {"cuda_fn"}  # its own function, nothing of libstdc++'s
    for lib in _shipped():  # the CPU build's libllama, libggml*, libmtmd: no copy
        assert libstdcxx.runtime_copy(str(lib)) == [], lib


@pytest.fixture(scope="module")
def folders(built, tmp_path_factory) -> dict[str, Path]:
    """The real CPU build's libraries, with the stand-in ``libggml-cuda.so`` beside them."""
    out = {}
    for kind, lib in built.items():
        d = tmp_path_factory.mktemp(f"lib-{kind}")
        shutil.copytree(native.lib_dir(), d, dirs_exist_ok=True)  # libllama.so, .so.0, ... as the wheel lays them
        shutil.copy2(lib, d / "libggml-cuda.so")
        out[kind] = d
    return out


LOAD = """import sys
{first}
import edgevlm
try:
    vlm = edgevlm.load(sys.argv[1], sys.argv[2], n_ctx=512, n_threads=1)
except edgevlm.EdgeVLMError as e:
    print(type(e).__name__, e.exit_code, e)
else:
    vlm.close()
    print("loaded")
"""


def _run(code: str, folder: Path, pair) -> subprocess.CompletedProcess:
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(folder), PYTHONWARNINGS="ignore")
    argv = [sys.executable, "-c", code, str(pair.model), str(pair.mmproj)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)


def _load(folder: Path, first: str, pair) -> str:
    r = _run(LOAD.format(first=first), folder, pair)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip().splitlines()[-1]


def test_numpy_first_with_a_private_copy_is_refused(folders, model_pair):
    out = _load(folders["private"], "import numpy", model_pair("llava15"))
    assert out.startswith("LibraryError 2 numpy was imported before llama.cpp's libraries"), out
    assert "libstdc++ came in with numpy/" in out
    assert f"{folders['private'] / 'libggml-cuda.so'} carries its own copy of libstdc++" in out
    assert "std::ostream::_M_insert<long>" in out
    assert "import edgevlm (or llama_cpp) before numpy" in out
    assert f"-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=native {native.BUILD_PRIVATE_RUNTIME}" in out


def test_llama_cpp_first_or_a_fixed_build_loads(folders, model_pair):
    pair = model_pair("llava15")
    assert _load(folders["private"], "import llama_cpp, numpy", pair) == "loaded"  # the safe order
    assert _load(folders["fixed"], "import numpy", pair) == "loaded"  # the copy kept private


def test_the_cli_refuses_with_one_line_and_exit_2(folders, model_pair):
    pair = model_pair("llava15")
    code = (
        "import numpy, runpy, sys\n"
        "sys.argv = ['edgevlm', 'chat', '--model', sys.argv[1], '--mmproj', sys.argv[2], 'Hi']\n"
        "runpy.run_module('edgevlm', run_name='__main__', alter_sys=True)\n"
    )
    r = _run(code, folders["private"], pair)
    assert r.returncode == 2, r.stderr[-2000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("Error: numpy was imported before")
    assert "its own copy of libstdc++" in lines[0]
    assert "Traceback" not in r.stderr


def test_this_process_has_no_conflict():
    """The test process (llama.cpp's libraries loaded first, by conftest's ``import edgevlm``) and
    the CPU build: nothing to refuse, and the link map is read in load order."""
    objects = libstdcxx.loaded_objects()
    names = [os.path.basename(p) for p in objects]
    llama = next(i for i, n in enumerate(names) if n.startswith("libllama.so"))
    assert all(i > llama for i, n in enumerate(names) if n.startswith("libstdc++.so"))
    assert native.runtime_conflict() is None
    native.require()
