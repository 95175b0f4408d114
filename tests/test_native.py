"""llama.cpp's libraries before numpy's (``edgevlm.backend.native``), and what ``plan`` says
when the llama.cpp build cannot use the GPU the machine has.

On an NVIDIA H200 every model load of a CUDA build segfaulted in processes that had imported
numpy before ``llama_cpp`` (docs/gpu.md, "Loading on NVIDIA"); the CPU build cannot crash that
way, so these check the order itself — in fresh interpreters, as the CLI, the test kit and a
user's script start — and the warning a late order gets.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgevlm.backend import native

ORDER = "import sys, {mod}\nm = list(sys.modules)\nprint(m.index('llama_cpp.llama_cpp') < m.index('numpy'))\n"


@pytest.mark.parametrize("mod", ["edgevlm", "edgevlm.cli", "edgevlm_testkit", "edgevlm.plan.planner"])
def test_importing_edgevlm_loads_llama_cpp_before_numpy(mod):
    r = subprocess.run([sys.executable, "-c", ORDER.format(mod=mod)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"


def test_cuda_build_agrees_with_the_library_it_did_not_load():
    """``cuda_build`` looks at files, never loading them; llama.cpp's own answer must not
    contradict it (a CUDA build offloads; a build that cannot offload has no CUDA)."""
    import llama_cpp

    offloads = bool(llama_cpp.llama_supports_gpu_offload())
    assert not native.cuda_build() or offloads
    if not offloads:
        assert not native.cuda_build()


def test_a_late_order_on_a_cuda_build_is_warned(monkeypatch):
    monkeypatch.setattr(native, "cuda_build", lambda: True)
    monkeypatch.delitem(sys.modules, "llama_cpp")
    msg = native.late_warning()
    assert msg and "numpy was imported before llama.cpp's libraries" in msg and "Import edgevlm" in msg
    monkeypatch.setattr(native, "cuda_build", lambda: False)
    assert native.late_warning() is None  # the CPU and Vulkan builds never crashed that way


def test_no_warning_once_llama_cpp_is_loaded(monkeypatch):
    monkeypatch.setattr(native, "cuda_build", lambda: True)
    assert "llama_cpp" in sys.modules and native.late_warning() is None  # too late to matter, or in order


def _plan_demo(path_dirs: list[str], *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PATH=os.pathsep.join(path_dirs), PYTHONWARNINGS="ignore")
    return subprocess.run(
        [sys.executable, "-m", "edgevlm", "plan", "--model", "demo", *args],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip


def test_a_cpu_build_on_a_machine_with_an_nvidia_gpu_says_how_to_rebuild(tmp_path):
    """A stand-in ``nvidia-smi`` (the one thing that cannot exist here) names a laptop GPU; the
    plan's reasons then say the wheel is a CPU build and give the CUDA build line."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA GeForce RTX 4060 Laptop GPU, 8188 MiB'\n")
    smi.chmod(0o755)
    system = [d for d in os.environ["PATH"].split(os.pathsep) if not (Path(d) / "nvidia-smi").exists()]
    r = _plan_demo([str(tmp_path), *system])
    assert r.returncode == 0, r.stderr
    assert "no GPU support (a CPU wheel), but the machine has an NVIDIA GPU (NVIDIA GeForce RTX 4060" in r.stdout
    assert "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=native" in r.stdout
    assert "no GPU support" not in _plan_demo([str(tmp_path), *system], "--device", "cpu").stdout  # asked for
    assert "no GPU support" not in _plan_demo(system).stdout  # no NVIDIA GPU here


def test_doctor_reports_the_build_the_cpu_and_the_devices():
    import llama_cpp

    r = subprocess.run(
        [sys.executable, "-m", "edgevlm", "doctor", "--json"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    f = json.loads(r.stdout)
    assert f["llama_cpp_python"] == llama_cpp.__version__
    assert f["features"] == llama_cpp.llama_print_system_info().decode().strip()
    assert f["gpu_offload"] == bool(llama_cpp.llama_supports_gpu_offload())
    assert f["devices"][-1]["kind"] == "cpu" and f["devices"][-1]["total"] > 0
    if not f["gpu_offload"]:
        assert f["build"] == "CPU build (no GPU backend)"
    table = subprocess.run([sys.executable, "-m", "edgevlm", "doctor"], capture_output=True, text=True, timeout=120)
    assert table.returncode == 0 and f"llama-cpp-python {llama_cpp.__version__}: {f['build']}" in table.stdout
    assert "devices:" in table.stdout and "Traceback" not in table.stderr


def test_doctor_says_when_the_gpu_is_unused(tmp_path):
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA GeForce RTX 4060 Laptop GPU, 8188 MiB'\n")
    smi.chmod(0o755)
    system = [d for d in os.environ["PATH"].split(os.pathsep) if not (Path(d) / "nvidia-smi").exists()]
    env = dict(os.environ, PATH=os.pathsep.join([str(tmp_path), *system]))
    r = subprocess.run(
        [sys.executable, "-m", "edgevlm", "doctor"], capture_output=True, text=True, timeout=120, env=env
    )
    assert r.returncode == 0, r.stderr
    import llama_cpp

    if not llama_cpp.llama_supports_gpu_offload():
        assert "note: this llama-cpp-python build has no GPU support (a CPU wheel)" in r.stdout


@pytest.mark.parametrize(
    ("given", "seen"),
    [
        ({}, "10000"),  # a short spin: libgomp's 300,000 spins steal a busy machine's time slices
        ({"GOMP_SPINCOUNT": "5"}, "5"),  # the user's own choice stays
        ({"OMP_WAIT_POLICY": "ACTIVE"}, None),  # ... and so does a policy (which sets its own spin)
    ],
)
def test_importing_edgevlm_shortens_openmps_barrier_spin_unless_the_user_chose(given, seen):
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    code = "import os, edgevlm; print(os.environ.get('GOMP_SPINCOUNT'))"
    r = subprocess.run([sys.executable, "-c", code], env={**env, **given}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(seen)
