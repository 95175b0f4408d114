#!/usr/bin/env python3
"""Visual token merging vs the baselines, side by side in one run (real-shape presets).

For LLaVA-1.5 (1-D RoPE) and Qwen2-VL (M-RoPE) shapes, one picture is sent with merging off,
at several similarity thresholds, at ratio 0.5 and 0.25 — and the same token counts are reached
by plain downscaling (budgeting; dynamic-resolution models only) and by uniform-stride pruning.
Reported: image tokens, prefill ms, TTFT, KV bytes, and an embedding-fidelity proxy (mean cosine
of each original token to the embedding that represents it).

Answer quality cannot be measured with random weights. With a real pair, compare answers:
    edgevlm chat -m model.gguf --mmproj mmproj.gguf -i photo.jpg --merge ratio:0.5 --temp 0 "Describe"

    python scripts/bench_merge.py [--preset real|tiny] [--runs 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SPECS = ["off", "threshold:0.98", "threshold:0.95", "threshold:0.9", "ratio:0.5", "ratio:0.25"]


def picture():
    import numpy as np
    from PIL import Image, ImageDraw, ImageFont

    rng = np.random.default_rng(5)
    img = Image.fromarray((rng.random((12, 16, 3)) * 255).astype(np.uint8)).resize(
        (1024, 768), Image.Resampling.BICUBIC
    )
    d = ImageDraw.Draw(img)
    d.rectangle([0, 0, 1024, 250], fill=(150, 190, 235))  # sky: flat
    font = ImageFont.load_default(size=28)
    for row in range(6):
        d.text((560, 420 + row * 40), "MENU  soup 4.50  tea 2.00", fill=(10, 10, 10), font=font)
    from edgevlm.vision.images import from_rgb

    return from_rgb(np.asarray(img), "bench.png")


def kv_per_token(eng) -> int:
    t = eng.backend.text_info
    return t.n_layer * 2 * t.n_head_kv * t.head_dim * 2  # f16 K and V


def measure(eng, img, spec: str, runs: int, image_tokens: int | None = None) -> dict:
    from edgevlm.vision.merge import MergeSpec

    view = eng.conversation(merge=MergeSpec.parse(spec), image_tokens=image_tokens)
    cache = eng.scheduler.images
    ttft, prefill, out, fid = [], [], None, [1.0]
    for _ in range(runs):
        view.reset()
        cache.clear()  # encode every run, like a new picture
        r = view.chat("Describe the picture.", [img], max_tokens=1, temperature=0.0)
        ttft.append(r.stats.ttft_ms)
        prefill.append(r.stats.prompt_ms - r.stats.image_encode_ms)
        out = r.stats
        unit = cache.get(view.messages[0].images[0])
        fid = [res.fidelity for res in unit.merged.values()] or [1.0]
    return {
        "spec": spec + (f" (budget {image_tokens})" if image_tokens else ""),
        "tokens": out.image_tokens_out or out.image_tokens,
        "tokens_in": out.image_tokens_in,
        "prefill_ms": statistics.median(prefill),
        "ttft_ms": statistics.median(ttft),
        "kv_bytes": (out.image_tokens_out or out.image_tokens) * kv_per_token(eng),
        "fidelity": float(statistics.mean(fid)),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="real")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="the JSON (default: a new file in docs/results/, scripts/resultfile.py)")
    args = ap.parse_args(argv)

    from resultfile import Run

    run = Run("bench_merge")
    from rich.console import Console
    from rich.table import Table

    import edgevlm
    from edgevlm_testkit import cached_model_pair

    img = picture()
    rows = []
    for fam in ("llava15", "qwen2vl"):
        pair = cached_model_pair(fam, args.preset)
        eng = edgevlm.load(
            pair.model,
            pair.mmproj,
            n_ctx=4096,
            n_threads=args.threads,
            device="cpu",
            image_tokens=1024 if fam == "qwen2vl" else None,
        )
        fam_rows = [measure(eng, img, s, args.runs) for s in SPECS]
        n_in = fam_rows[0]["tokens"]
        for target in (n_in // 2, n_in // 4):
            fam_rows.append(measure(eng, img, f"stride:{target / n_in:.4f}", args.runs))
            if fam == "qwen2vl":  # plain downscaling reaches the same count before the encoder
                fam_rows.append(measure(eng, img, "off", args.runs, image_tokens=target))
        eng.close()
        base = fam_rows[0]
        for r in fam_rows:
            r["family"] = fam
            r["ttft_speedup"] = base["ttft_ms"] / r["ttft_ms"] if r["ttft_ms"] else 0.0
        rows += fam_rows
    t = Table(title=f"token merging, 1024x768 picture, {args.preset} preset, median of {args.runs} (CPU)")
    for col in ("family", "method", "tokens", "prefill ms", "TTFT ms", "TTFT speed-up", "KV MiB", "fidelity"):
        t.add_column(col, justify="left" if col in ("family", "method") else "right")
    for r in rows:
        method = r["spec"].replace("stride:", "uniform prune ") if r["spec"].startswith("stride") else r["spec"]
        if "budget" in method:
            method = f"downscale to {r['tokens']}"
        r["method"] = method  # as the table shows it (docs/benchmarks.md renders it from the JSON)
        t.add_row(
            r["family"],
            method,
            str(r["tokens"]),
            f"{r['prefill_ms']:.0f}",
            f"{r['ttft_ms']:.0f}",
            f"{r['ttft_speedup']:.2f}x",
            f"{r['kv_bytes'] / 2**20:.1f}",
            f"{r['fidelity']:.3f}",
        )
    Console(width=140).print(t)
    print(
        "fidelity = mean cosine of each original token to its representative (1.0 = nothing lost); "
        "answer quality needs real weights (see the docstring)."
    )
    print(f"wrote {run.save({'preset': args.preset, 'runs': args.runs, 'rows': rows}, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
