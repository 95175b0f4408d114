#!/usr/bin/env python3
"""What a smaller micro-batch costs in speed, and what it saves in memory: the numbers behind the
planner's degradation order.

    python scripts/bench_ubatch.py                     # llava15 + qwen2vl, real shapes, 3 runs
    python scripts/bench_ubatch.py --preset tiny --runs 1

For each model pair and n_ubatch (= n_batch) of 512, 256, 128 and 64, in one process on this
machine's CPU: prefill speed of a 1,024-token text prompt and of one picture's image chunk
(576 tokens for LLaVA-1.5, 1,024 for Qwen2-VL; embeddings encoded once, so only the decode is
timed), medians of ``--runs``; and the text compute buffer the planner predicts at that
micro-batch (exact, by allocator replay). Generation (one token per step) does not depend on the
micro-batch. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np

from edgevlm_testkit import cached_model_pair

UBATCHES = (512, 256, 128, 64)
TEXT_TOKENS = 1024


def measure(family: str, preset: str, runs: int, threads: int) -> list[dict]:
    from edgevlm.backend.llama import Backend
    from edgevlm.model.gguf_info import load_text_model
    from edgevlm.plan.estimate import text_compute_bytes

    pair = cached_model_pair(family, preset)
    text = load_text_model(pair.model)
    rng = np.random.default_rng(0)
    side = 336 if family.startswith("llava") else 28 * 32  # 576 tokens / 1,024 tokens
    rgb = (rng.random((side, side, 3)) * 255).astype(np.uint8)
    rows = []
    for ub in UBATCHES:
        be = Backend(
            pair.model,
            pair.mmproj,
            n_ctx=4096,
            n_batch=ub,
            n_ubatch=ub,
            n_threads=threads,
            flash_attn=True,
            image_max_tokens=1024 if family.startswith("qwen") else None,
        )
        try:
            tokens = [int(t) for t in rng.integers(100, text.n_vocab - 1, TEXT_TOKENS)]
            bm = be.bitmap_from_rgb(rgb)
            chunks = be.tokenize(be.marker, [bm], add_special=False)
            be.free_bitmap(bm)
            chunk = next(c for c in chunks if c.kind == "image")
            emb = be.encode_image(chunk)
            text_s, image_s = [], []
            for _ in range(runs):
                be.kv_clear()
                t0 = time.perf_counter()
                be.decode_tokens(tokens, 0)
                text_s.append(time.perf_counter() - t0)
                be.kv_clear()
                t0 = time.perf_counter()
                be.decode_image(chunk, emb, 0)
                image_s.append(time.perf_counter() - t0)
            chunks.close()
        finally:
            be.close()
        compute = text_compute_bytes(text, 4096, ub, ub, True, "f16", "f16")
        rows.append(
            {
                "family": family,
                "preset": preset,
                "n_ubatch": ub,
                "text_tok_s": round(TEXT_TOKENS / statistics.median(text_s), 1),
                "image_tok_s": round(chunk.n_tokens / statistics.median(image_s), 1),
                "image_tokens": chunk.n_tokens,
                "text_compute_mib": round(compute / 2**20, 1),
            }
        )
        print(
            f"{family} n_ubatch {ub}: text {rows[-1]['text_tok_s']} tok/s, image {rows[-1]['image_tok_s']} tok/s,"
            f" text compute {rows[-1]['text_compute_mib']} MiB",
            file=sys.stderr,
            flush=True,
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default="llava15,qwen2vl")
    ap.add_argument("--preset", default="real")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=max(1, min(os.cpu_count() or 1, 8)))
    ap.add_argument("--out", help="the JSON (default: a new file in docs/results/, scripts/resultfile.py)")
    args = ap.parse_args(argv)

    from resultfile import Run

    run = Run("bench_ubatch")
    rows = []
    for fam in args.families.split(","):
        rows += measure(fam, args.preset, args.runs, args.threads)
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=f"prefill speed and text compute buffer by micro-batch ({args.preset} shapes, "
        f"{args.threads} threads, median of {args.runs})",
        title_justify="left",
    )
    for col in ("model", "n_ubatch", "text tok/s", "vs 512", "image tok/s", "vs 512", "text compute MiB"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for r in rows:
        base = next(x for x in rows if x["family"] == r["family"] and x["n_ubatch"] == UBATCHES[0])
        t.add_row(
            r["family"],
            str(r["n_ubatch"]),
            f"{r['text_tok_s']:.0f}",
            f"{r['text_tok_s'] / base['text_tok_s']:.2f}",
            f"{r['image_tok_s']:.0f}",
            f"{r['image_tok_s'] / base['image_tok_s']:.2f}",
            f"{r['text_compute_mib']:.1f}",
        )
    Console().print(t)
    result = {"rows": rows, "preset": args.preset, "threads": args.threads, "runs": args.runs}
    print(f"wrote {run.save(result, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
