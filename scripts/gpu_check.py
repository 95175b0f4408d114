#!/usr/bin/env python3
"""The planner on a GPU, unattended, in one table: predicted vs llama.cpp's logged buffers on the
device and on the host, and (where the device reports its free memory) what the GPU loses
outside those logs (CUDA context, cuBLAS, the pool).

    python scripts/gpu_check.py                      # NVIDIA: build llama-cpp-python with CUDA, then measure
    python scripts/gpu_check.py --wheel llama_cpp_python-0.3.36-...whl   # use a CUDA wheel instead
    python scripts/gpu_check.py --vulkan             # Vulkan (AMD, Intel, NVIDIA; Mesa's software device here)
    python scripts/gpu_check.py --vulkan --tests     # ... and the device tests (pytest -m vulkan) instead
    python scripts/gpu_check.py --cpu                # the same measurements on the CPU (checks the script)

CUDA: (1) a virtualenv ``.venv-gpucheck`` with edgevlm, its ``testkit/`` and llama-cpp-python
0.3.36 built with ``-DGGML_CUDA=on`` for this GPU's architecture only (about 5 minutes on 16
cores; skipped when the venv already has a CUDA build, or with ``--wheel``). Vulkan: (1) the
Vulkan headers, ``glslc`` and Mesa's drivers from apt when missing, llama-cpp-python built with
``-DGGML_VULKAN=on`` once per machine (``edgevlm_testkit.vulkan_build``: ~12 minutes on 2 cores,
then cached in ``~/.cache/edgevlm/vulkan``) into ``.venv-vulkan``, and
``GGML_VK_VISIBLE_DEVICES=0`` so that a CPU-type device (lavapipe) is used. (2) in it, generated
LLaVA-1.5-7B and Qwen2-VL-2B layer-shape pairs are loaded with every layer (one configuration:
part of them) and the vision encoder on GPU 0 at a few contexts, KV types and micro-batches, the
largest admitted picture is encoded, and each buffer llama.cpp logs is set against the planner's
prediction. Prints the table and writes JSON (``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv-gpucheck"
VULKAN_VENV = ROOT / ".venv-vulkan"
CONFIGS = [  # (family, n_ctx, KV type, n_ubatch, image budget, GPU layers: None = all)
    ("llava15", 4096, "f16", 512, None, None),
    ("llava15", 4096, "q8_0", 128, None, None),
    ("llava15", 16384, "q8_0", 512, None, None),
    ("llava15", 4096, "f16", 512, None, 2),
    ("qwen2vl", 4096, "f16", 512, 1024, None),
    ("qwen2vl", 8192, "q8_0", 128, 256, None),
]
GUARDS = [  # (family, what-if free memory on GPU 0): --ngl auto, the default 384 MiB overhead
    ("llava15", "2GiB"),
    ("llava15", "1GiB"),
    ("llava15", "768MiB"),
    ("qwen2vl", "1GiB"),
    ("qwen2vl", "640MiB"),
]
ROUNDING = 0.006 * 2**20  # llama.cpp logs sizes in MiB with two decimals
TARGET = 0.005  # per component, as on the CPU


def run(cmd: list[str], **kw) -> None:
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    subprocess.run(cmd, check=True, **kw)


def prepare_venv(wheel: str | None) -> Path:
    py = VENV / ("Scripts" if os.name == "nt" else "bin") / "python"
    if not py.exists():
        run([sys.executable, "-m", "venv", str(VENV)])
        run([str(py), "-m", "pip", "install", "-q", "--upgrade", "pip"])
    probe = "import llama_cpp, sys; sys.exit(0 if llama_cpp.llama_supports_gpu_offload() else 1)"
    if subprocess.run([str(py), "-c", probe], capture_output=True).returncode != 0:
        if wheel:
            run([str(py), "-m", "pip", "install", "-q", "--force-reinstall", "--no-deps", wheel])
        else:
            env = dict(
                os.environ,
                CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=native",
                CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count() or 8),
                FORCE_CMAKE="1",
            )
            run(
                [
                    str(py),
                    "-m",
                    "pip",
                    "install",
                    "--no-cache-dir",
                    "--no-binary",
                    "llama-cpp-python",
                    "--force-reinstall",
                    "--no-deps",
                    "llama-cpp-python==0.3.36",
                ],
                env=env,
            )
    # edgevlm, its test kit (the generated pairs, the measuring harness) and the rest (llama_cpp kept)
    run([str(py), "-m", "pip", "install", "-q", "-e", str(ROOT / "testkit"), "-e", str(ROOT)])
    return py


def _vulkan_build():
    """``edgevlm_testkit.vulkan_build``, loaded by path (stdlib only: runs before any venv)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "vulkan_build", ROOT / "testkit" / "edgevlm_testkit" / "vulkan_build.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def measure_one(index: int, gpu: bool, rows_file: Path) -> int:
    """One configuration, its rows written to ``rows_file`` before the model is freed."""
    sys.path.insert(0, str(ROOT))
    from edgevlm_testkit import cached_model_pair
    from edgevlm_testkit.gpu_measure import measure_on_device

    family, n_ctx, kv, ub, img, ngl = CONFIGS[index]
    pair = cached_model_pair(family, "real")
    label = f"{family} ctx{n_ctx} {kv} ub{ub}" + (f" img{img}" if img else "") + (f" ngl{ngl}" if ngl else "")

    def emit(rows) -> None:
        rows_file.write_text(json.dumps([vars(r) for r in rows]))

    measure_on_device(
        str(pair.model), str(pair.mmproj), label, n_ctx, kv, ub, img, gpu=gpu, n_gpu_layers=ngl, emit=emit
    )
    return 0


def guard_one(index: int, rows_file: Path) -> int:
    """One what-if size: plan, load, a 640×480 picture; the logged device bytes."""
    import tempfile

    import numpy as np
    from PIL import Image

    sys.path.insert(0, str(ROOT))
    from edgevlm.plan.devices import probe
    from edgevlm_testkit import cached_model_pair
    from edgevlm_testkit.gpu_measure import guard_on_device

    family, size = GUARDS[index]
    pair = cached_model_pair(family, "real")
    with tempfile.TemporaryDirectory() as tmp:
        pic = Path(tmp) / "photo.png"
        Image.fromarray((np.random.default_rng(7).random((480, 640, 3)) * 255).astype(np.uint8)).save(pic)
        guard_on_device(
            str(pair.model),
            str(pair.mmproj),
            family,
            f"{probe().gpus[0].name}={size}",
            str(pic),
            emit=lambda row: rows_file.write_text(json.dumps(vars(row))),
        )
    return 0


def guards() -> tuple[list, list[str]]:
    """The guard under what-if sizes, each in a process of its own."""
    import tempfile

    from edgevlm_testkit.gpu_measure import GuardRow

    rows, notes = [], []
    for i, g in enumerate(GUARDS):
        print(f"guarding {g} ...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            f = Path(tmp) / "row.json"
            rc = subprocess.run([sys.executable, __file__, "--guard", str(i), "--rows", str(f)]).returncode
            if f.exists():
                rows.append(GuardRow(**json.loads(f.read_text())))
                if rc != 0:
                    notes.append(
                        f"guard {g}: measured; the process then died freeing the model (exit {rc}: the driver)"
                    )
            else:
                notes.append(f"guard {g}: failed (exit {rc})")
    return rows, notes


def measure(gpu: bool, out: Path, only: str | None = None) -> int:
    """Every configuration, each in a process of its own (a driver that crashes while a model
    is freed — Mesa 22.3's lavapipe does after some q8_0 runs — loses nothing measured)."""
    import tempfile

    sys.path.insert(0, str(ROOT))
    from edgevlm.plan.devices import probe
    from edgevlm_testkit.gpu_measure import DeviceRow

    rows, notes, t0 = [], [], time.perf_counter()
    gpus = probe().gpus if gpu else []
    dev = gpus[0] if gpus else None
    for i, cfg in enumerate(CONFIGS if only != "guard" else []):
        print(f"measuring {cfg} ...", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            f = Path(tmp) / "rows.json"
            cmd = [sys.executable, __file__, "--one", str(i), "--rows", str(f)] + (["--cpu"] if not gpu else [])
            rc = subprocess.run(cmd).returncode
            if not f.exists():
                notes.append(f"{cfg}: failed before measuring (exit {rc})")
                continue
            rows += [DeviceRow(**r) for r in json.loads(f.read_text())]
            if rc != 0:
                notes.append(f"{cfg}: measured; the process then died freeing the model (exit {rc}: the driver)")
    from rich.console import Console
    from rich.table import Table

    where = f"{dev.name} ({dev.description})" if dev else "the CPU"
    t = Table(title=f"planner vs llama.cpp on {where} ({time.perf_counter() - t0:.0f} s)", title_justify="left")
    for col in ("configuration", "buffer", "predicted MiB", "logged MiB", "error"):
        t.add_column(col, justify="left" if col in ("configuration", "buffer") else "right")
    bad = []
    for r in rows:
        outside = r.component.startswith("outside")
        within = outside or abs(r.predicted - r.logged) <= max(TARGET * r.logged, ROUNDING)
        under = not outside and r.logged - r.predicted > ROUNDING
        if not within or under:
            bad.append(r)
        t.add_row(
            r.label,
            r.component,
            "" if outside else f"{r.predicted / 2**20:,.2f}",
            f"{r.logged / 2**20:,.2f}",
            "" if outside or not r.logged else f"{r.error:+.2%}" + ("" if within and not under else " !"),
        )
    if rows:
        Console(width=140).print(t)
    if rows and dev is not None and not dev.free_known:
        print(f"{dev.name} reports free == total (free memory unknown): no 'outside the logs' rows")
    if rows:
        print(
            f"{len(rows) - len(bad)}/{len(rows)} buffers within {TARGET:.1%} (or the log's rounding) and never under"
            + ("" if not bad else ": off — " + "; ".join(f"{r.label} {r.component}" for r in bad))
        )
    grows: list = []
    if gpu and only != "buffers":
        grows, gnotes = guards()
        notes += gnotes
        g = Table(title="the guard: --free-memory SIZE --ngl auto, one picture", title_justify="left")
        for col in ("model", "free", "plan chose", "predicted MiB", "logged MiB", "free − overhead", "picture"):
            g.add_column(col, justify="left" if col in ("model", "plan chose", "picture") else "right")
        for r in grows:
            g.add_row(
                r.label,
                f"{r.free / 2**20:,.0f} MiB",
                r.plan,
                f"{r.predicted / 2**20:,.1f}",
                f"{r.logged / 2**20:,.1f}" + ("" if r.ok else " !"),
                f"{(r.free - r.overhead) / 2**20:,.0f}",
                "answered" if r.answered else "refused (guard)",
            )
        Console(width=160).print(g)
        print(f"{sum(r.ok for r in grows)}/{len(grows)} what-if sizes held (logged device buffers ≤ free − overhead)")
    for n in notes:
        print("note:", n)
    out.write_text(
        json.dumps(
            {"buffers": [dict(vars(r), error=r.error) for r in rows], "guard": [dict(vars(r), ok=r.ok) for r in grows]},
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 1 if bad or any("failed" in n for n in notes) or not all(r.ok for r in grows) else 0


def vulkan(args: argparse.Namespace) -> int:
    vb = _vulkan_build()
    t0 = time.perf_counter()
    py = vb.prepare_venv(VULKAN_VENV)
    print(f"Vulkan build ready in {time.perf_counter() - t0:.0f} s ({vb.cached_wheel()})", file=sys.stderr)
    env = vb.device_env()
    if subprocess.run(["vulkaninfo", "--summary"], capture_output=True).returncode != 0:
        print("vulkaninfo finds no Vulkan device", file=sys.stderr)
        return 2
    if args.tests:
        cmd = [str(py), "-m", "pytest", "-q", "-m", "vulkan", "-p", "no:cacheprovider", *args.pytest_args]
        return subprocess.run(cmd, cwd=ROOT, env=env).returncode
    inner = [str(py), __file__, "--inner", "--out", str(args.out.resolve())] + (
        ["--only", args.only] if args.only else []
    )
    return subprocess.run(inner, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--wheel", help="a llama-cpp-python 0.3.36 CUDA wheel to install instead of building")
    ap.add_argument("--vulkan", action="store_true", help="llama.cpp's Vulkan backend (builds it once)")
    ap.add_argument("--tests", action="store_true", help="with --vulkan: run the device tests instead of the table")
    ap.add_argument("--cpu", action="store_true", help="measure the CPU instead (no build): checks the script")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--one", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--guard", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rows", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--only", choices=("buffers", "guard"), help="one of the two tables")
    ap.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    ap.add_argument("pytest_args", nargs="*", help="with --tests: extra pytest arguments")
    args = ap.parse_args(argv)
    if args.guard is not None:
        return guard_one(args.guard, args.rows)
    if args.one is not None:
        return measure_one(args.one, not args.cpu, args.rows)
    if args.cpu or args.inner:
        return measure(gpu=not args.cpu, out=args.out, only=args.only)
    if args.vulkan:
        return vulkan(args)
    if shutil.which("nvidia-smi") is None:
        print(
            "no nvidia-smi: this machine has no NVIDIA GPU (try --vulkan, or --cpu to check the script)",
            file=sys.stderr,
        )
        return 2
    run(["nvidia-smi", "--query-gpu=name,memory.total,memory.free,driver_version", "--format=csv"])
    py = prepare_venv(args.wheel)
    inner = [str(py), __file__, "--inner", "--out", str(args.out.resolve())] + (
        ["--only", args.only] if args.only else []
    )
    return subprocess.run(inner).returncode


if __name__ == "__main__":
    sys.exit(main())
