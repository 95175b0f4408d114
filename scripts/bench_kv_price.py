#!/usr/bin/env python3
"""The price of each placement on this GPU: decode tokens/s with every layer, part of them and
none on the device, the KV cache on the device or on the host (llama.cpp's ``offload_kqv``), and
f16 / q8_0 / q4_0 caches — the measurements ``edgevlm/plan/prices.py`` fits its cost model to.

    python scripts/bench_kv_price.py                       # on the GPU of this llama.cpp build
    python scripts/bench_kv_price.py --update-table        # ... and refresh its entry in edgevlm/data/kv_prices.json
    GGML_VK_VISIBLE_DEVICES=0 .venv-vulkan/bin/python scripts/bench_kv_price.py --update-table   # lavapipe

A generated LLaVA-shaped pair (``--shape``: widths small enough for a software device, with as
many KV heads as query heads so that the cache weighs as much as the weights) is loaded at each
configuration in a process of its own (a driver that crashes loses one row). The cache is filled
to the larger ``--fills`` from a copy of a prefill done once per KV type on the CPU (the state of
one sequence, loaded into the configuration's own context: no slow prefill on the device), one
warm-up run is decoded, then ``--repeats`` runs of ``--tokens`` tokens, one at a time through
llama.cpp's decode; the median run gives tokens/s. The cache is then cut to the smaller fill and
measured again. The rows, the bytes each token reads per device class (``prices.traffic``) and
the fitted prices are printed and written to docs/results/ with the machine they ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "testkit"))

SHAPES = {  # text: (n_vocab, n_embd, n_layer, n_head, n_head_kv, n_ff)
    "medium": (4096, 512, 6, 8, 8, 1024),
    "large": (32000, 2048, 8, 16, 16, 5504),  # for a real GPU
}
KV_TYPES = ("f16", "q8_0", "q4_0")
N_CTX = 2048
TABLE = ROOT / "edgevlm" / "data" / "kv_prices.json"


def make_pair(shape: str, out: Path) -> tuple[Path, Path]:
    from edgevlm_testkit.llava import write_llava
    from edgevlm_testkit.shapes import TextShape, VisionShape

    if not (out / "model.gguf").is_file():
        out.mkdir(parents=True, exist_ok=True)
        write_llava(out, TextShape(*SHAPES[shape]), VisionShape(336, 14, 64, 2, 4, 128), 0, "llava15")
    return out / "model.gguf", out / "mmproj.gguf"


def _backend(model: Path, ngl: int, kqv: bool, kv: str):
    from edgevlm.backend.llama import Backend

    return Backend(
        model, model.parent / "mmproj.gguf", n_ctx=N_CTX, n_batch=512, n_ubatch=512, n_gpu_layers=ngl,
        n_threads=int(os.environ.get("KV_PRICE_THREADS", "0")) or None, type_k=kv, type_v=kv,
        offload_kqv=kqv, mmproj_use_gpu=False, op_offload=ngl > 0,
    )  # fmt: skip


def prefill(model: Path, kv: str, fill: int, out: Path) -> None:
    """One sequence filled to ``fill`` cells on the CPU, saved for the configurations to load."""
    be = _backend(model, 0, True, kv)
    try:
        n = 0
        while n < fill:
            k = min(512, fill - n)
            be.decode_tokens([5 + (i * 7 + n) % 1000 for i in range(k)], n, logits_last=True)
            n += k
        data = be.state_save(0)
        assert data is not None
        out.write_bytes(data)
    finally:
        be.close()


def one(cfg: dict) -> dict:
    """Tokens/s of one configuration at each fill (largest first), in this process."""
    be = _backend(Path(cfg["model"]), cfg["ngl"], cfg["offload_kqv"], cfg["kv"])
    try:
        if not be.state_load(Path(cfg["state"]).read_bytes(), 0):
            raise RuntimeError("the prefilled state did not load")
        out = {}
        for fill in sorted(cfg["fills"], reverse=True):
            be.kv_remove(fill, -1)
            runs = []
            for r in range(cfg["repeats"] + 1):  # the first run warms the device up; not counted
                t0 = time.perf_counter()
                for j in range(cfg["tokens"]):
                    be.decode_tokens([7 + j], fill + j)
                dt = time.perf_counter() - t0
                be.kv_remove(fill, -1)
                if r:
                    runs.append(cfg["tokens"] / dt)
            out[str(fill)] = runs
        return out
    finally:
        be.close()


def _child(args: list[str], timeout: float) -> dict | None:
    r = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, timeout=timeout)
    line = next((ln for ln in reversed(r.stdout.splitlines()) if ln.startswith("{")), None)
    if r.returncode != 0 and line is None:
        print(r.stderr[-2000:], file=sys.stderr)
        return None
    return json.loads(line) if line else {}


def configurations(n_layer: int) -> list[tuple[int, bool, str]]:
    """(GPU layers, KV on the device, KV type): all, half and only the output layer on the device
    with the cache there and on the host; none on the device."""
    out = []
    for kv in KV_TYPES:
        for ngl in (n_layer + 1, n_layer // 2 + 1, 1):
            out += [(ngl, True, kv), (ngl, False, kv)]
        out.append((0, True, kv))
    return out


def measure(args: argparse.Namespace) -> dict:
    from edgevlm.model.gguf_info import read_gguf, text_model_info
    from edgevlm.plan.devices import probe
    from edgevlm.plan.estimate import TextTensors
    from edgevlm.plan.prices import fit, traffic

    gpus = probe().gpus
    if not gpus:
        raise SystemExit(
            "no GPU in this llama.cpp build (a CUDA or Vulkan one; GGML_VK_VISIBLE_DEVICES=0 for lavapipe)"
        )
    work = Path(tempfile.mkdtemp(prefix="kvprice-"))
    model, _ = make_pair(args.shape, work / args.shape)
    gf = read_gguf(str(model))
    t = text_model_info(gf)
    tensors = TextTensors.from_gguf(gf, t.n_layer)
    states = {}
    for kv in KV_TYPES:
        states[kv] = work / f"state-{kv}.bin"
        print(f"prefilling {max(args.fills)} cells, KV {kv}, on the CPU ...", file=sys.stderr, flush=True)
        _child(["--prefill", json.dumps({"model": str(model), "kv": kv, "fill": max(args.fills),
                                         "out": str(states[kv])})], 900)  # fmt: skip
    rows = []
    for ngl, kqv, kv in configurations(t.n_layer):
        cfg = dict(model=str(model), ngl=ngl, offload_kqv=kqv, kv=kv, state=str(states[kv]), fills=args.fills,
                   tokens=args.tokens, repeats=args.repeats)  # fmt: skip
        print(f"ngl {ngl}, KV {'device' if kqv else 'host'}, {kv} ...", file=sys.stderr, flush=True)
        got = _child(["--one", json.dumps(cfg)], 900)
        for fill, runs in (got or {}).items():
            tr = traffic(tensors, t.n_layer, t.n_head_kv, t.head_dim, gpus, ngl, kv, kv, kqv, int(fill))
            rows.append(dict(ngl=ngl, offload_kqv=kqv, kv=kv, fill=int(fill), runs=[round(x, 3) for x in runs],
                             tokens_per_s=round(statistics.median(runs), 3), **vars(tr)))  # fmt: skip
    params = fit(rows)
    for r in rows:
        tr = {k: r[k] for k in ("dev_weights", "host_weights", "dev_kv", "host_kv", "hops")}
        s = sum(params[k] * x for k, x in zip(params, [1.0, *tr.values()], strict=True))
        r["predicted_tokens_per_s"] = round(1 / s, 3) if s > 0 else None
    g = gpus[0]
    return dict(
        gpu=g.description or g.name,
        device=g.name,
        shape=dict(
            zip(("n_vocab", "n_embd", "n_layer", "n_head", "n_head_kv", "n_ff"), SHAPES[args.shape], strict=True),
            name=args.shape,
            weights="q4_0",
        ),  # fmt: skip
        n_ctx=N_CTX,
        tokens=args.tokens,
        repeats=args.repeats,
        rows=rows,
        params=params,
    )


def table_key(gpu: str) -> str:
    """The part of the probe's description a price entry is keyed by: lavapipe's name, else all of it."""
    return "llvmpipe" if gpu.startswith("llvmpipe") else gpu


def update_table(result: dict, machine: dict, source: str) -> str:
    table = json.loads(TABLE.read_text())
    key = table_key(result["gpu"])
    table["entries"][key] = dict(
        gpu=result["gpu"],
        machine={
            k: machine.get(k)
            for k in ("cpu", "cores", "avx2", "avx512", "amx", "platform", "llama_cpp_python", "llama_cpp_build")
        },  # fmt: skip
        source=source,
        about=f"fitted by scripts/bench_kv_price.py on {result['device']} ({result['shape']['name']} pair)",
        params=result["params"],
        rows=[{k: r[k] for k in ("ngl", "offload_kqv", "kv", "fill", "tokens_per_s")} for r in result["rows"]],
    )
    TABLE.write_text(json.dumps(table, indent=2) + "\n")
    return key


def show(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"decode tokens/s on {result['device']} ({result['gpu']})", title_justify="left")
    cols = ("GPU layers", "KV", "type", "fill", "tokens/s", "fitted", "weights dev/host MiB", "KV dev/host MiB", "hops")
    for col in cols:
        t.add_column(col, justify="right")
    for r in result["rows"]:
        t.add_row(
            str(r["ngl"]), "device" if r["offload_kqv"] else "host", r["kv"], str(r["fill"]),
            f"{r['tokens_per_s']:.1f}", f"{r['predicted_tokens_per_s']:.1f}",
            f"{r['dev_weights'] / 2**20:.1f}/{r['host_weights'] / 2**20:.1f}",
            f"{r['dev_kv'] / 2**20:.1f}/{r['host_kv'] / 2**20:.1f}", str(r["hops"]),
        )  # fmt: skip
    Console(width=160).print(t)
    print("fitted:", ", ".join(f"{k} {v:.3g}" for k, v in result["params"].items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="medium")
    ap.add_argument("--fills", type=lambda s: [int(x) for x in s.split(",")], default=[64, 1536])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", help="the JSON file (default: a new one in docs/results/)")
    ap.add_argument(
        "--update-table", action="store_true", help="refresh this GPU's entry in edgevlm/data/kv_prices.json"
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--prefill", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(json.loads(args.one))))
        return 0
    if args.prefill:
        p = json.loads(args.prefill)
        prefill(Path(p["model"]), p["kv"], p["fill"], Path(p["out"]))
        return 0
    from resultfile import Run

    run = Run("bench_kv_price")
    result = measure(args)
    show(result)
    env = run.envelope(result)
    path = run.save(result, args.out)
    print(f"wrote {path}")
    if args.update_table:
        print(f"updated {TABLE.relative_to(ROOT)}: {update_table(result, env['machine'], path.name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
