#!/usr/bin/env python3
"""The planner on a GPU, unattended, in one table: predicted vs llama.cpp's logged buffers on the
device and on the host, and (where the device reports its free memory) what the GPU loses
outside those logs (cuBLAS, the memory pool; the driver's context is taken before free memory is first read).

    python scripts/gpu_check.py                      # NVIDIA: build llama-cpp-python with CUDA, then measure
    python scripts/gpu_check.py --wheel llama_cpp_python-0.3.36-...whl   # use a CUDA wheel instead
    python scripts/gpu_check.py --vulkan             # Vulkan (AMD, Intel, NVIDIA; Mesa's software device here)
    python scripts/gpu_check.py --vulkan --tests     # ... and the device tests (pytest -m gpu) instead
    python scripts/gpu_check.py --tests              # the device tests on the CUDA build
    python scripts/gpu_check.py --loads [--vulkan]   # which of edgevlm's load steps the GPU build survives
    python scripts/gpu_check.py --cpu                # the same measurements on the CPU (checks the script)
    python scripts/gpu_check.py --laptop 4 6         # a laptop on a big GPU: a ballast leaves 4, then 6 GiB free
                                                     # (scripts/laptop_check.py; --vulkan: its miniature sizes)

CUDA: (1) a virtualenv ``.venv-gpucheck`` with edgevlm, its ``testkit/`` and llama-cpp-python
0.3.36 built with ``-DGGML_CUDA=on`` for this GPU's architecture only (minutes on an H200's 16
cores; skipped when the venv already has a CUDA build, or with ``--wheel``). Vulkan: (1) the
Vulkan headers, ``glslc`` and Mesa's drivers from apt when missing, llama-cpp-python built with
``-DGGML_VULKAN=on`` once per machine (``edgevlm_testkit.vulkan_build``, then cached in
``~/.cache/edgevlm/vulkan``) into ``.venv-vulkan``, and ``GGML_VK_VISIBLE_DEVICES=0`` so that a
CPU-type device (lavapipe) is used. (2) in it, generated LLaVA-1.5-7B and Qwen2-VL-2B layer-shape
pairs are loaded with every layer, part of them (the CPU's extra buffer types on and off) and none
of them on GPU 0, the vision encoder there, at a few contexts, KV types and micro-batches; the
largest admitted picture is encoded, and each buffer llama.cpp logs is set against the plan (the
planner's dry-run check included). Then the guard under what-if sizes. Prints the tables and
writes JSON (``--out``) naming the machine; ``scripts/render_docs.py`` renders docs/gpu.md
from the committed copies in docs/results/.
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
CONFIGS = [  # (family, n_ctx, KV type, n_ubatch, image budget, GPU layers: None = all, CPU extra buffer types
    #            [, KV on the device: False = llama.cpp's offload_kqv off, the cache and attention on the host])
    ("llava15", 4096, "f16", 512, None, None, None),
    ("llava15", 4096, "q8_0", 128, None, None, None),
    ("llava15", 16384, "q8_0", 512, None, None, None),
    ("qwen2vl", 4096, "f16", 512, 1024, None, None),
    ("qwen2vl", 8192, "q8_0", 128, 256, None, None),
    # part of the layers on the device (a 7B model on a 4-8 GiB laptop GPU), extra buffer types on and off
    ("llava15", 1024, "f16", 512, None, 1, True),
    ("llava15", 1024, "f16", 512, None, 1, False),
    ("llava15", 4096, "f16", 512, None, 2, True),
    ("llava15", 4096, "f16", 512, None, 2, False),
    ("qwen2vl", 4096, "q8_0", 256, 1024, 2, True),
    ("qwen2vl", 4096, "q8_0", 256, 1024, 2, False),
    ("llava15", 4096, "f16", 512, None, 0, None),  # no layer on the device, the encoder there
    # the KV cache on the host (a lever the planner weighs against fewer layers): all, part of the layers
    ("llava15", 4096, "f16", 512, None, None, None, False),
    ("llava15", 4096, "q8_0", 512, None, 2, None, False),
    ("qwen2vl", 4096, "f16", 512, 1024, 2, None, False),
]
GUARDS = [  # (family, what-if free memory on GPU 0): --ngl auto, the default 384 MiB overhead
    ("llava15", "2GiB"),
    ("llava15", "1GiB"),
    ("llava15", "768MiB"),
    ("qwen2vl", "1GiB"),
    ("qwen2vl", "640MiB"),
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


def _vulkan_build():
    """``edgevlm_testkit.vulkan_build``, loaded by path (stdlib only: runs before any venv)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "vulkan_build", ROOT / "testkit" / "edgevlm_testkit" / "vulkan_build.py"
    )
    assert spec is not None
    assert spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _label(family, n_ctx, kv, ub, img, ngl, extra, kqv=True) -> str:
    return (
        f"{family} ctx{n_ctx} {kv} ub{ub}"
        + (f" img{img}" if img else "")
        + (f" ngl{ngl}" if ngl is not None else "")
        + ("" if extra is None else f" extra {'on' if extra else 'off'}")
        + ("" if kqv else " KV on host")
    )


def _in_child(what, target: str, notes: list[str], **kwargs):
    """``target``'s result from a process of its own (``edgevlm_testkit.child``): a driver that
    crashes while a model is freed — Mesa 22.3's lavapipe does after some q8_0 runs — loses
    nothing measured, and is noted."""
    from edgevlm_testkit.child import run_in_child

    got = run_in_child(target, timeout=1800, **kwargs)
    if got.result is None:
        if got.stderr.strip():
            print(got.tail(), file=sys.stderr)
        notes.append(f"{what}: failed before measuring ({got.died_after})")
    elif got.died_after is not None:
        notes.append(f"{what}: measured; the process then died freeing the model ({got.died_after}: the driver)")
    return got.result


def guards(notes: list[str]) -> list:
    """The guard under what-if sizes, each in a process of its own."""
    import tempfile

    import numpy as np
    from PIL import Image

    from edgevlm.plan.devices import probe
    from edgevlm_testkit import cached_model_pair
    from edgevlm_testkit.gpu_measure import GuardRow

    rows, name = [], probe().gpus[0].name
    with tempfile.TemporaryDirectory() as tmp:
        pic = Path(tmp) / "photo.png"
        Image.fromarray((np.random.default_rng(7).random((480, 640, 3)) * 255).astype(np.uint8)).save(pic)
        for family, size in GUARDS:
            print(f"guarding {(family, size)} ...", file=sys.stderr, flush=True)
            pair = cached_model_pair(family, "real")
            got = _in_child(
                f"guard {(family, size)}", "edgevlm_testkit.gpu_measure:guard_on_device", notes,
                model=str(pair.model), mmproj=str(pair.mmproj), label=family, free=f"{name}={size}", picture=str(pic),
            )  # fmt: skip
            if got is not None:
                rows.append(GuardRow(**got))
    return rows


def measure(gpu: bool, out: Path, only: str | None = None) -> int:
    """Every configuration, each in a process of its own (``_in_child``)."""
    sys.path.insert(0, str(ROOT))
    from edgevlm.plan.devices import probe
    from edgevlm_testkit import cached_model_pair
    from edgevlm_testkit.gpu_measure import TARGET, DeviceRow

    rows: list = []
    notes: list[str] = []
    t0 = time.perf_counter()
    gpus = probe().gpus if gpu else []
    dev = gpus[0] if gpus else None
    for cfg in CONFIGS if only != "guard" else []:
        print(f"measuring {cfg} ...", file=sys.stderr, flush=True)
        family, n_ctx, kv, ub, img, ngl, extra, *rest = cfg
        kqv = rest[0] if rest else True
        pair = cached_model_pair(family, "real")
        got = _in_child(
            cfg, "edgevlm_testkit.gpu_measure:measure_on_device", notes,
            model=str(pair.model), mmproj=str(pair.mmproj), label=_label(*cfg), n_ctx=n_ctx, type_kv=kv,
            n_ubatch=ub, image_max_tokens=img, gpu=gpu, n_gpu_layers=ngl if gpu else None, extra_buffers=extra,
            offload_kqv=kqv,
        )  # fmt: skip
        rows += [DeviceRow(**r) for r in got or []]
    from rich.console import Console
    from rich.table import Table

    where = f"{dev.name} ({dev.description})" if dev else "the CPU"
    t = Table(title=f"planner vs llama.cpp on {where} ({time.perf_counter() - t0:.0f} s)", title_justify="left")
    for col in ("configuration", "buffer", "planned MiB", "logged MiB", "error", "replay alone"):
        t.add_column(col, justify="left" if col in ("configuration", "buffer") else "right")
    bad = []
    for r in rows:
        outside, within = r.outside, r.within()
        if not within:
            bad.append(r)
        t.add_row(
            r.label,
            r.component,
            "" if outside else f"{r.predicted / 2**20:,.2f}",
            f"{r.logged / 2**20:,.2f}",
            "" if outside or not r.logged else f"{r.error:+.2%}" + ("" if within else " !"),
            "" if r.replayed < 0 or not r.logged else f"{(r.replayed - r.logged) / r.logged:+.2%}",
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
        grows = guards(notes)
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
    from edgevlm_testkit.peers import machine

    out.write_text(
        json.dumps(
            {
                "machine": machine(),
                "device": None if dev is None else {"name": dev.name, "description": dev.description},
                "buffers": [dict(vars(r), error=r.error) for r in rows],
                "guard": [dict(vars(r), ok=r.ok) for r in grows],
                "notes": notes,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")
    return 1 if bad or any("failed" in n for n in notes) or not all(r.ok for r in grows) else 0


LOADS = [  # (name, what the variant does before / how it loads the demo pair with every layer on GPU 0)
    ("numpy imported first, then llama_cpp.Llama", "numpy plain"),
    ("numpy imported first, then edgevlm.load", "numpy load"),
    ("llama_cpp.Llama, verbose", "plain"),
    ("llama_cpp.Llama, quiet (fds 1 and 2 to /dev/null)", "plain quiet"),
    ("llama_cpp.Llama, use_extra_bufts off", "plain noextra"),
    ("llama_cpp.Llama after edgevlm's log sink", "sink plain quiet"),
    ("llama_cpp.Llama after edgevlm's device probe", "probe plain"),
    ("edgevlm Backend, extra buffer types on", "backend extra"),
    ("edgevlm Backend, extra buffer types off", "backend noextra"),
    ("edgevlm Backend (defaults), verbose", "backend verbose"),
    ("edgevlm Backend (defaults)", "backend"),
    ("edgevlm Backend, --ngl 0", "backend ngl0"),
    ("edgevlm.load (plan, probe, guard) and a picture", "load"),
]


def load_variant(index: int) -> int:
    """One of ``LOADS``, in this process (``loads`` runs each in its own)."""
    import faulthandler

    faulthandler.enable()
    sys.path.insert(0, str(ROOT))
    steps = LOADS[index][1].split()
    if "numpy" in steps:  # what a script that imports numpy before llama.cpp does (edgevlm.backend.native)
        import numpy  # noqa: F401
    import llama_cpp

    from edgevlm.backend.system import install_log_sink
    from edgevlm.plan.devices import probe

    model, mmproj = ROOT / "models" / "edgevlm-demo.gguf", ROOT / "models" / "mmproj-edgevlm-demo.gguf"
    ngl = 0 if "ngl0" in steps else -1
    if "sink" in steps:
        install_log_sink()
    if "probe" in steps:
        print(probe().gpus, flush=True)
    if "plain" in steps:
        saved = llama_cpp.llama_model_default_params

        def params():
            p = saved()
            if "noextra" in steps:
                p.use_extra_bufts = False
            return p

        llama_cpp.llama_model_default_params = params
        import llama_cpp.llama as llama_mod

        llama_mod.llama_cpp.llama_model_default_params = params
        llm = llama_cpp.Llama(str(model), n_gpu_layers=ngl, verbose="quiet" not in steps)
        print("loaded; n_vocab", llm.n_vocab(), flush=True)
        llm.close()
    elif "backend" in steps:
        from edgevlm.backend.llama import Backend

        extra = True if "extra" in steps else False if "noextra" in steps else None
        be = Backend(model, mmproj, n_gpu_layers=ngl, verbose="verbose" in steps, extra_buffers=extra)
        print("loaded; n_ctx", be.n_ctx, flush=True)
        be.close()
    elif "load" in steps:
        import tempfile

        from PIL import Image

        import edgevlm

        with tempfile.TemporaryDirectory() as tmp:
            pic = Path(tmp) / "red.png"
            Image.new("RGB", (224, 224), "red").save(pic)
            vlm = edgevlm.load(model, mmproj, n_gpu_layers=-1)
            try:
                print("answer:", vlm.chat("What colour is it?", images=[str(pic)], max_tokens=4).text, flush=True)
            finally:
                vlm.close()
    return 0


def loads() -> int:
    """Each of edgevlm's load steps in a process of its own, on the demo pair with every layer on
    GPU 0: which one a GPU build does not survive, and (where cuda-gdb or gdb is at hand) the
    native stack of the first crash."""
    import signal

    rows, first_crash = [], None
    for i, (name, _) in enumerate(LOADS):
        t0 = time.perf_counter()
        try:
            p = subprocess.run(
                [sys.executable, __file__, "--load-variant", str(i)], capture_output=True, text=True, timeout=25
            )
            rc, tail = p.returncode, (p.stdout + p.stderr).strip().splitlines()[-3:]
        except subprocess.TimeoutExpired:
            rc, tail = None, ["(no end within 25 s)"]
        what = "ok" if rc == 0 else "hung" if rc is None else (
            f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"
        )  # fmt: skip
        if rc != 0 and first_crash is None:
            first_crash = i
        rows.append((name, what, time.perf_counter() - t0, " | ".join(tail)[-240:]))
        print(f"{name:52s} {what:18s} {rows[-1][2]:5.1f} s  {rows[-1][3]}", flush=True)
    dbg = shutil.which("cuda-gdb") or shutil.which("gdb")
    if first_crash is not None and dbg:
        print(f"native stack of '{LOADS[first_crash][0]}' ({Path(dbg).name}):", flush=True)
        cmd = [dbg, "-batch", "-ex", "run", "-ex", "bt 40", "-ex", "info threads", "--args", sys.executable,
               __file__, "--load-variant", str(first_crash)]  # fmt: skip
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=90).stdout
            keep = ("#", "Thread", "  ", "*")
            print("\n".join(ln for ln in out.splitlines() if ln.startswith(keep) or "signal" in ln))
        except subprocess.TimeoutExpired:
            print("(the debugger did not finish within 90 s)")
    return 0 if first_crash is None else 1


def device_tests(py: Path, extra: list[str], env: dict | None = None) -> int:
    """The device tests (``pytest -m gpu``) with the given interpreter, on the first GPU."""
    cmd = [str(py), "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "-rs", *extra]
    return subprocess.run(cmd, cwd=ROOT, env=env).returncode


def laptop(py: Path | str, sizes: list[str], env: dict | None = None) -> int:
    """``scripts/laptop_check.py`` with the GPU build's interpreter (sizes: its defaults when none)."""
    return subprocess.run([str(py), str(ROOT / "scripts" / "laptop_check.py"), *sizes], env=env).returncode


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
        return device_tests(py, args.pytest_args, env)
    if args.laptop is not None:
        return laptop(py, args.laptop, env)
    if args.loads:
        return subprocess.run([str(py), __file__, "--loads", "--inner"], env=env).returncode
    inner = [str(py), __file__, "--inner", "--out", str(args.out.resolve())] + (
        ["--only", args.only] if args.only else []
    )
    return subprocess.run(inner, env=env).returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--wheel", help="a llama-cpp-python 0.3.36 CUDA wheel to install instead of building")
    ap.add_argument("--vulkan", action="store_true", help="llama.cpp's Vulkan backend (builds it once)")
    ap.add_argument("--tests", action="store_true", help="run the device tests (pytest -m gpu) instead of the table")
    ap.add_argument("--loads", action="store_true", help="which of edgevlm's load steps the GPU build survives")
    ap.add_argument("--load-variant", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--cpu", action="store_true", help="measure the CPU instead (no build): checks the script")
    ap.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--only", choices=("buffers", "guard"), help="one of the two tables")
    ap.add_argument("--out", type=Path, default=Path("gpu_check.json"))
    ap.add_argument("--laptop", nargs="*", metavar="S", help="a laptop on this GPU: sizes left free (4 6 = GiB)")
    ap.add_argument("pytest_args", nargs="*", help="with --tests: extra pytest arguments")
    args = ap.parse_args(argv)
    if args.load_variant is not None:
        return load_variant(args.load_variant)
    if args.loads and (args.inner or args.cpu):
        return loads()
    if args.laptop is not None and args.inner:
        return laptop(sys.executable, args.laptop)
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
    if args.tests:
        return device_tests(py, args.pytest_args)
    if args.laptop is not None:
        return laptop(py, args.laptop)
    if args.loads:
        return subprocess.run([str(py), __file__, "--loads", "--inner"]).returncode
    inner = [str(py), __file__, "--inner", "--out", str(args.out.resolve())] + (
        ["--only", args.only] if args.only else []
    )
    return subprocess.run(inner).returncode


if __name__ == "__main__":
    sys.exit(main())
