#!/usr/bin/env python3
"""Benchmark captioning on Ray against plain ``edgevlm caption``, side by side in one run.

    python scripts/bench_scale.py                       # llava15/real, 64 images, 16 tokens
    python scripts/bench_scale.py --preset tiny --images 40 --max-tokens 8

Every side is the real CLI in a subprocess on the same generated model pair (random weights,
real shapes), the same pictures, greedy decoding, a fresh output file:

- ``plain``: ``edgevlm caption DIR`` (one process, images in flight on its scheduler);
- ``ray 1 actor``: ``edgevlm caption DIR --ray local --actors 1`` (a Ray instance started by the
  command, the pictures read by Ray Data, one actor with every core);
- ``ray 2 actors``: the same with ``--actors 2`` (each actor half the cores).

Reported per side: wall time of the whole command (Ray's start, model loads, everything), images/s
over it, and the steady rate: images per second between the first records that reach the
output and the last (what a long run converges to, start-up left out). Ratios are against plain.
The per-image work measured here feeds the README's estimate for N GPU nodes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
from PIL import Image

from edgevlm_testkit import FAMILIES, PRESETS, cached_model_pair

SIZES = [(640, 480), (800, 600), (512, 512), (480, 640)]
RAY_TARGET = 0.9  # ray 1 actor images/s ÷ plain images/s, at least


def make_images(outdir: Path, n: int) -> None:
    for i in range(n):
        w, h = SIZES[i % len(SIZES)]
        rng = np.random.default_rng(200 + i)
        y, x = np.mgrid[0:h, 0:w]
        c = rng.integers(0, 255, 3)
        arr = np.stack(
            [(x * 255 // w + c[0]) % 256, (y * 255 // h + c[1]) % 256, np.full_like(x, c[2])], axis=-1
        ).astype(np.uint8)
        Image.fromarray(arr).save(outdir / f"pic{i:03d}.png")


def run_side(name: str, cmd: list[str], n: int, steady: bool = True) -> dict[str, Any]:
    """Run one side; time every image event as it reaches stderr (--progress json)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    arrivals: list[float] = []
    notes: list[str] = []
    summary: dict[str, Any] = {}

    def read() -> None:
        assert proc.stderr is not None
        for raw in proc.stderr:
            try:
                ev = json.loads(raw)
            except ValueError:
                notes.append(raw.rstrip())
                continue
            if ev.get("event") == "image" and ev.get("status") == "done":
                arrivals.append(time.perf_counter() - t0)
            elif ev.get("event") == "summary":
                summary.update(ev)
            elif ev.get("event") == "note":
                notes.append(ev["message"])

    reader = threading.Thread(target=read)
    reader.start()
    rc = proc.wait()
    reader.join()
    wall = time.perf_counter() - t0
    if rc != 0 or len(arrivals) != n:
        raise SystemExit(f"{name}: exit {rc}, {len(arrivals)} of {n} captions\n" + "\n".join(notes[-10:]))
    first = arrivals[0]
    k1 = sum(1 for a in arrivals if a - first < 1e-3 + 0.05)  # the first batch to arrive
    # one source of records: their arrival rate after the first is the steady rate (with two
    # actors, their first batches land at different times and the rate says nothing)
    steady = (n - k1) / (arrivals[-1] - first) if steady and arrivals[-1] > first and n > k1 else None
    return {
        "side": name,
        "wall_s": round(wall, 2),
        "images_per_s": round(n / wall, 4),
        "steady_images_per_s": round(steady, 4) if steady else None,
        "first_record_s": round(first, 2),
        "tokens": summary.get("generated_tokens"),
        "notes": notes[-3:],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="llava15", choices=sorted(FAMILIES))
    ap.add_argument("--preset", default="real", choices=PRESETS)
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--ray-batch", type=int, default=16, help="images per actor call (the CLI default)")
    ap.add_argument("--json", help="the JSON (default: a new file in docs/results/, scripts/resultfile.py)")
    args = ap.parse_args()

    from resultfile import Run

    run = Run("bench_scale")

    pair = cached_model_pair(args.family, args.preset)
    work = Path(tempfile.mkdtemp(prefix="edgevlm-scale-"))
    pics = work / "pics"
    pics.mkdir()
    make_images(pics, args.images)
    base = [
        sys.executable,
        "-m",
        "edgevlm",
        "caption",
        str(pics),
        "-m",
        str(pair.model),
        "--mmproj",
        str(pair.mmproj),
        "-n",
        str(args.max_tokens),
        "--progress",
        "json",
    ]
    ray = ["--ray", "local", "--ray-batch", str(args.ray_batch)]
    sides = [
        ("plain", base, True),
        ("ray 1 actor", base + ray + ["--actors", "1"], True),
        ("ray 2 actors", base + ray + ["--actors", "2"], False),
    ]
    rows = []
    for name, cmd, steady in sides:
        out = work / f"{name.replace(' ', '-')}.jsonl"
        rows.append(run_side(name, cmd + ["--out", str(out)], args.images, steady))
        print(f"  {name}: {rows[-1]['wall_s']} s", file=sys.stderr, flush=True)
    plain = rows[0]
    for r in rows:
        r["ratio"] = round(r["images_per_s"] / plain["images_per_s"], 3)
        if r["steady_images_per_s"] and plain["steady_images_per_s"]:
            r["steady_ratio"] = round(r["steady_images_per_s"] / plain["steady_images_per_s"], 3)
    print(
        f"\n{args.family}/{args.preset}, {args.images} images, {args.max_tokens} tokens, "
        f"{os.cpu_count()} CPUs, ray batch {args.ray_batch}"
    )
    print("| side | wall | images/s | ÷ plain | steady images/s | ÷ plain | first record |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        steady = f"{r['steady_images_per_s']:.3f}" if r["steady_images_per_s"] else "-"
        sr = f"{r['steady_ratio']:.2f}×" if "steady_ratio" in r else "-"
        print(
            f"| {r['side']} | {r['wall_s']:.1f} s | {r['images_per_s']:.3f} | {r['ratio']:.2f}× | {steady} | "
            f"{sr} | {r['first_record_s']:.1f} s |"
        )
    verdict = rows[1]["ratio"] >= RAY_TARGET
    print(
        f"\nray 1 actor ÷ plain = {rows[1]['ratio']:.2f}× (target ≥ {RAY_TARGET}: "
        f"{'met' if verdict else 'NOT met'}); steady {rows[1].get('steady_ratio', float('nan')):.2f}×"
    )
    result = {
        "family": args.family,
        "preset": args.preset,
        "images": args.images,
        "max_tokens": args.max_tokens,
        "ray_batch": args.ray_batch,
        "cpus": os.cpu_count(),
        "machine": platform.platform(),
        "sides": rows,
        "target": RAY_TARGET,
        "target_met": verdict,
    }
    print(f"results: {run.save(result, args.json)}")


if __name__ == "__main__":
    main()
