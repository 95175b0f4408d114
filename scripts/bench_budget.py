#!/usr/bin/env python3
"""Image budgeting: what a token budget saves on a 4K image, side by side in one run.

For the tiled (LLaVA-1.6) and dynamic-resolution (Qwen2-VL) real-shape presets, a 4000×3000
image is sent at budgets 256 / 1024 / 4096 and unbudgeted; each configuration runs in a fresh
process (so peak memory is its own) and reports tokens, encode ms, prefill ms, TTFT and peak RSS.

    python scripts/bench_budget.py                  # real-shape presets (generated once)
    python scripts/bench_budget.py --preset tiny    # quick check of the script itself
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

BUDGETS = [256, 1024, 4096, None]


def make_image(path: Path) -> Path:
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    rng = np.random.default_rng(7)
    base = Image.fromarray((rng.random((60, 80, 3)) * 255).astype(np.uint8)).resize(
        (4000, 3000), Image.Resampling.BICUBIC
    )
    d = ImageDraw.Draw(base)
    font = ImageFont.load_default(size=40)
    for row in range(20):
        d.text((200, 200 + row * 55), "edgevlm budget benchmark — line of small text", fill=(0, 0, 0), font=font)
    base.save(path, quality=90)
    return path


def own_peak_rss_bytes() -> int:
    """This process's own peak RSS. Linux's ``ru_maxrss`` survives ``exec`` and so starts at the
    parent's RSS at the fork (a parent that has just generated a real-shaped pair gave every
    budget the same 1.5 GiB); ``VmHWM`` belongs to the process's own memory map."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    from edgevlm.runtime.stats import peak_rss_bytes

    return peak_rss_bytes()


def worker(args: argparse.Namespace) -> int:
    """One configuration in this process: load, one turn with one image, print JSON."""
    import edgevlm

    budget = None if args.budget == "none" else int(args.budget)
    # Unbudgeted = what mtmd does on its own: up to 4096 tokens for dynamic models, every tile.
    eng = edgevlm.load(
        args.model,
        args.mmproj,
        n_ctx=8192,
        n_threads=args.threads,
        image_tokens=budget or 4096,
        device="cpu",
        options=edgevlm.EngineOptions(image_tokens=budget),
    )
    ttfts, encs, prefills = [], [], []
    for _ in range(args.runs):
        eng.scheduler.clear()  # nothing cached: the KV cells ...
        eng.scheduler.images.clear()  # ... nor the picture (the cache would hide the encoder)
        r = eng.chat("Describe the image.", [args.image], max_tokens=1, temperature=0)
        st = r.stats
        ttfts.append(st.ttft_ms)
        encs.append(st.image_encode_ms)
        prefills.append(st.prompt_ms - st.image_encode_ms)
    print(
        json.dumps(
            {
                "tokens": st.image_tokens,
                "ttft_ms": statistics.median(ttfts),
                "encode_ms": statistics.median(encs),
                "prefill_ms": statistics.median(prefills),
                "peak_rss_bytes": own_peak_rss_bytes(),
            }
        )
    )
    eng.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="real")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="the JSON (default: a new file in docs/results/, scripts/resultfile.py)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--mmproj", help=argparse.SUPPRESS)
    ap.add_argument("--image", help=argparse.SUPPRESS)
    ap.add_argument("--budget", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)

    from resultfile import Run

    run = Run("bench_budget")
    from rich.console import Console
    from rich.table import Table

    from edgevlm_testkit import cached_model_pair

    out_dir = Path(os.environ.get("TMPDIR", "/tmp")) / "edgevlm-bench-budget"
    out_dir.mkdir(parents=True, exist_ok=True)
    image = make_image(out_dir / "photo4k.jpg")
    rows = []
    for fam in ("llava16", "qwen2vl"):
        pair = cached_model_pair(fam, args.preset)
        for b in BUDGETS:
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                "--model",
                str(pair.model),
                "--mmproj",
                str(pair.mmproj),
                "--image",
                str(image),
                "--budget",
                str(b or "none"),
                "--runs",
                str(args.runs),
                "--threads",
                str(args.threads),
            ]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                print(res.stderr, file=sys.stderr)
                return 1
            rows.append({"family": fam, "budget": b, **json.loads(res.stdout.strip().splitlines()[-1])})
    for fam in ("llava16", "qwen2vl"):
        base = next(r for r in rows if r["family"] == fam and r["budget"] is None)
        for r in rows:
            if r["family"] == fam:
                r["ttft_speedup_vs_unbudgeted"] = base["ttft_ms"] / r["ttft_ms"] if r["ttft_ms"] else 0.0
    t = Table(title=f"4000x3000 image, {args.preset} preset, median of {args.runs} (CPU, {args.threads} threads)")
    for col in ("family", "budget", "tokens", "encode ms", "prefill ms", "TTFT ms", "TTFT speed-up", "peak RSS MiB"):
        t.add_column(col, justify="left" if col == "family" else "right")
    for r in rows:
        t.add_row(
            r["family"],
            str(r["budget"] or "none"),
            str(r["tokens"]),
            f"{r['encode_ms']:.0f}",
            f"{r['prefill_ms']:.0f}",
            f"{r['ttft_ms']:.0f}",
            f"{r['ttft_speedup_vs_unbudgeted']:.1f}x",
            f"{r['peak_rss_bytes'] / 2**20:.0f}",
        )
    Console().print(t)
    q1024 = next(r for r in rows if r["family"] == "qwen2vl" and r["budget"] == 1024)
    target = q1024["ttft_speedup_vs_unbudgeted"] >= 4.0
    print(
        f"target: dynamic family TTFT at 1024 tokens ≥ 4x lower than unbudgeted: "
        f"{q1024['ttft_speedup_vs_unbudgeted']:.1f}x → {'met' if target else 'NOT met'}"
    )
    result = {"preset": args.preset, "runs": args.runs, "rows": rows, "target_ttft_1024_ge_4x": target}
    print(f"wrote {run.save(result, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
