#!/usr/bin/env python3
"""Planner accuracy: edgevlm's per-component estimate vs what llama.cpp really allocates, and a
naive "file size + f16 KV" pre-flight (what Ollama-style estimators do), side by side in one run.

    python scripts/bench_planner.py                 # tiny + real-shape presets, prints a table
    python scripts/bench_planner.py --presets tiny  # quick
    python scripts/bench_planner.py --families gemma3,pixtral
    python scripts/bench_planner.py --out planner.json

Every configuration is loaded in llama.cpp (CPU), the largest admitted image is encoded, and the
buffer sizes llama.cpp logs are compared with the prediction.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console
from rich.table import Table

from edgevlm_testkit import FAMILIES, cached_model_pair
from edgevlm_testkit.measure import Config, components_dict, measure, naive_estimate

MIB = 2**20


DYNAMIC = {"qwen2vl", "qwen25vl", "qwen3vl", "pixtral"}  # image budgets apply to these
# real presets: one per distinct text/vision shape (llava16 and qwen25vl share their siblings')
REAL_SKIP = {"llava16", "qwen25vl"}


def matrix(presets: list[str], families: list[str]) -> list[tuple[str, Config]]:
    out = []
    for preset in presets:
        ctxs = (512, 2048, 8192) if preset == "tiny" else (1024, 4096)
        for fam in families:
            if preset == "real" and fam in REAL_SKIP:
                continue
            dyn = fam in DYNAMIC
            for ctx in ctxs:
                for kv, fa in (("f16", False), ("f16", True), ("q8_0", True), ("q4_0", True)):
                    for ub in (512,) if preset == "real" else (128, 512):
                        img = (256 if ctx <= 1024 else 1024) if dyn else None
                        out.append(
                            (
                                preset,
                                Config(
                                    fam,
                                    n_ctx=ctx,
                                    type_k=kv,
                                    type_v=kv,
                                    flash_attn=fa,
                                    n_ubatch=ub,
                                    image_max_tokens=img,
                                ),
                            )
                        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny,real")
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (default: every family)")
    ap.add_argument("--out", help="the JSON (default: a new file in docs/results/, scripts/resultfile.py)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)

    from resultfile import Run

    run = Run("bench_planner")
    presets = [p for p in args.presets.split(",") if p]
    console = Console(stderr=False, width=160)
    rows = []
    t0 = time.perf_counter()
    for preset, cfg in matrix(presets, [f for f in args.families.split(",") if f]):
        pair = cached_model_pair(cfg.family, preset)
        comps = measure(str(pair.model), str(pair.mmproj), cfg, n_threads=args.threads)
        measured_total = sum(c.measured for c in comps)
        predicted_total = sum(c.predicted for c in comps)
        naive = naive_estimate(str(pair.model), str(pair.mmproj), cfg)
        rows.append(
            {
                "preset": preset,
                "config": cfg.label,
                "components": components_dict(comps),
                "measured_total": measured_total,
                "predicted_total": predicted_total,
                "naive_total": naive,
                "predicted_error": (predicted_total - measured_total) / measured_total,
                "naive_error": (naive - measured_total) / measured_total,
            }
        )
    elapsed = time.perf_counter() - t0

    table = Table(title=f"estimate vs llama.cpp ({len(rows)} configurations, CPU)")
    for col in (
        "preset",
        "config",
        "measured MiB",
        "edgevlm MiB",
        "edgevlm err",
        "naive MiB",
        "naive err",
        "worst component",
    ):
        table.add_column(col, justify="left" if col in ("preset", "config", "worst component") else "right")
    for r in rows:
        worst = max(r["components"].values(), key=lambda c: abs(c["error"]))
        table.add_row(
            r["preset"],
            r["config"],
            f"{r['measured_total'] / MIB:.1f}",
            f"{r['predicted_total'] / MIB:.1f}",
            f"{r['predicted_error']:+.1%}",
            f"{r['naive_total'] / MIB:.1f}",
            f"{r['naive_error']:+.1%}",
            f"{worst['name']} {worst['error']:+.1%}",
        )
    console.print(table)

    # llama.cpp logs MiB with 2 decimals: a 0.12 MiB buffer is ±4 % by rounding alone, so the
    # relative error is taken over buffers of at least 1 MiB, and every buffer is also checked
    # against the rounding (±0.005 MiB).
    summary = Table(title="max |error| per component (buffers ≥ 1 MiB; all within log rounding?)")
    summary.add_column("component")
    summary.add_column("max |error|", justify="right")
    summary.add_column("max under-estimate", justify="right")
    summary.add_column("max |error| MiB", justify="right")
    summary.add_column("n", justify="right")
    per: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        for name, c in r["components"].items():
            if c["measured"] > 0:
                per.setdefault(name, []).append((c["error"], (c["predicted"] - c["measured"]) / MIB, c["measured"]))
    stats = {}
    for name, vals in per.items():
        big = [e for e, _, m in vals if m >= MIB] or [0.0]
        stats[name] = {
            "max_abs_error": max(abs(e) for e in big),
            "min_error": min(big),
            "max_abs_error_mib": max(abs(d) for _, d, _ in vals),
            "n": len(vals),
        }
        summary.add_row(
            name,
            f"{stats[name]['max_abs_error']:.2%}",
            f"{min(0.0, stats[name]['min_error']):+.2%}",
            f"{stats[name]['max_abs_error_mib']:.3f}",
            str(len(vals)),
        )
    tot_ours = max(abs(r["predicted_error"]) for r in rows)
    tot_naive = max(abs(r["naive_error"]) for r in rows)
    summary.add_row("total (edgevlm)", f"{tot_ours:.2%}", "")
    summary.add_row("total (naive file + f16 KV)", f"{tot_naive:.2%}", "")
    console.print(summary)
    console.print(f"{len(rows)} configurations in {elapsed:.0f} s")
    result = {
        "presets": presets,
        "rows": rows,
        "per_component": stats,
        "total_max_abs_error": tot_ours,
        "naive_max_abs_error": tot_naive,
    }
    console.print(f"wrote {run.save(result, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
