#!/usr/bin/env python3
"""The planner on an NVIDIA GPU, unattended, in one table: predicted vs llama.cpp's logged buffers
per device, and what the GPU loses outside those logs (CUDA context, cuBLAS, the pool).

    python scripts/gpu_check.py                      # build llama-cpp-python with CUDA, then measure
    python scripts/gpu_check.py --wheel llama_cpp_python-0.3.36-...whl   # use a CUDA wheel instead
    python scripts/gpu_check.py --cpu                # the same measurements on the CPU (checks the script)

Steps: (1) a virtualenv ``.venv-gpucheck`` with edgevlm, its ``testkit/`` and llama-cpp-python
0.3.36 built with ``-DGGML_CUDA=on`` for this GPU's architecture only (about 5 minutes on 16
cores; skipped when the venv already has a CUDA build, or with ``--wheel``); (2) in it, generated
LLaVA-1.5-7B and Qwen2-VL-2B layer-shape pairs are loaded with every layer and the vision encoder
on GPU 0 at a few contexts, KV types and micro-batches, the largest admitted picture is encoded,
and each buffer llama.cpp logs is set against the planner's prediction for that device; the
device's free memory before and after load and after the first picture gives what no log line
shows. Prints the table and writes JSON (``--out``). Runs within ten minutes on one GPU.
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
CONFIGS = [  # (family, n_ctx, KV type, n_ubatch, image budget)
    ("llava15", 4096, "f16", 512, None),
    ("llava15", 4096, "q8_0", 128, None),
    ("llava15", 16384, "q8_0", 512, None),
    ("qwen2vl", 4096, "f16", 512, 1024),
    ("qwen2vl", 8192, "q8_0", 128, 256),
]


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


def measure(gpu: bool, out: Path) -> int:
    sys.path.insert(0, str(ROOT))
    from edgevlm_testkit import cached_model_pair
    from edgevlm_testkit.gpu_measure import measure_on_device

    rows, t0 = [], time.perf_counter()
    for family, n_ctx, kv, ub, img in CONFIGS:
        pair = cached_model_pair(family, "real")
        label = f"{family} ctx{n_ctx} {kv} ub{ub}" + (f" img{img}" if img else "")
        print(f"measuring {label} ...", file=sys.stderr, flush=True)
        rows += measure_on_device(str(pair.model), str(pair.mmproj), label, n_ctx, kv, ub, img, gpu=gpu)
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=f"planner vs llama.cpp on {'GPU 0' if gpu else 'the CPU'} ({time.perf_counter() - t0:.0f} s)",
        title_justify="left",
    )
    for col in ("configuration", "buffer", "predicted MiB", "logged MiB", "error"):
        t.add_column(col, justify="left" if col in ("configuration", "buffer") else "right")
    for r in rows:
        outside = r.component.startswith("outside")
        t.add_row(
            r.label,
            r.component,
            "" if outside else f"{r.predicted / 2**20:,.2f}",
            f"{r.logged / 2**20:,.2f}",
            "" if outside or not r.logged else f"{r.error:+.2%}",
        )
    Console(width=140).print(t)
    out.write_text(json.dumps([dict(vars(r), error=r.error) for r in rows], indent=2))
    print(f"wrote {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel", help="a llama-cpp-python 0.3.36 CUDA wheel to install instead of building")
    ap.add_argument("--cpu", action="store_true", help="measure the CPU instead (no build): checks the script")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    args = ap.parse_args(argv)
    if args.cpu or args.inner:
        return measure(gpu=not args.cpu, out=args.out)
    if shutil.which("nvidia-smi") is None:
        print("no nvidia-smi: this machine has no NVIDIA GPU (use --cpu to check the script)", file=sys.stderr)
        return 2
    run(["nvidia-smi", "--query-gpu=name,memory.total,memory.free,driver_version", "--format=csv"])
    py = prepare_venv(args.wheel)
    return subprocess.run([str(py), __file__, "--inner", "--out", str(args.out.resolve())]).returncode


if __name__ == "__main__":
    sys.exit(main())
