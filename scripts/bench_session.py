#!/usr/bin/env python3
"""A 20-turn conversation with 10 images on a small context, three ways, in one run:

(a) edgevlm: KV kept across turns, old images replaced by their summaries when the context fills;
(b) re-prefill: the whole history evaluated from scratch every turn (images re-encoded), no
    eviction — what a stateless wrapper does;
(c) llama-cpp-python's own ``Llava15ChatHandler`` with the same context.

Per turn: latency and peak RSS; the table shows latency ratios and how many turns each
completes without error.

    python scripts/bench_session.py                   # tiny preset (fast)
    python scripts/bench_session.py --preset real     # LLaVA-1.5-7B shapes, 2 layers
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TURNS = 20
IMAGES_AT = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18}  # 10 images, one every other turn


def make_images(n: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(11)
    out = []
    for i in range(n):
        arr = (rng.random((240 + 8 * i, 320, 3)) * 255).astype(np.uint8)
        out.append(Image.fromarray(arr))
    return out


def script():
    return [
        (f"Turn {t + 1}: what do you see?" if t in IMAGES_AT else f"Turn {t + 1}: tell me more.", t in IMAGES_AT)
        for t in range(TURNS)
    ]


def rss() -> int:
    """Resident memory now (the three runs share a process, so its peak would be cumulative)."""
    import psutil

    return psutil.Process().memory_info().rss


def run_edgevlm(pair, images, n_ctx, max_tokens, threads, reprefill: bool):
    import edgevlm
    from edgevlm.vision.images import from_rgb

    eng = edgevlm.load(
        pair.model,
        pair.mmproj,
        n_ctx=n_ctx,
        n_threads=threads,
        device="cpu",
        options=edgevlm.EngineOptions(session=edgevlm.SessionOptions(enabled=not reprefill)),
    )
    conv = eng.conversation()
    pics = [from_rgb(__import__("numpy").asarray(im), f"img{i + 1}.png") for i, im in enumerate(images)]
    rows, k = [], 0
    for t, (text, has_image) in enumerate(script()):
        imgs = [pics[k]] if has_image else []
        k += has_image
        if reprefill:  # stateless: everything again, images encoded again
            eng.scheduler.clear()
            eng.scheduler.images.clear()
        t0 = time.perf_counter()
        try:
            r = conv.chat(text, imgs, max_tokens=max_tokens, temperature=0.0)
            rows.append(
                {
                    "turn": t + 1,
                    "ok": True,
                    "ms": (time.perf_counter() - t0) * 1000,
                    "prompt_n": r.stats.prompt_n,
                    "n_ctx_used": r.stats.n_ctx_used,
                    "summarized": r.stats.summarized_images,
                    "rss": rss(),
                }
            )
        except Exception as exc:  # a failed turn is a result here, not a crash of the benchmark
            rows.append({"turn": t + 1, "ok": False, "error": str(exc).splitlines()[0][:100], "rss": rss()})
    eng.close()
    return rows


def run_library(pair, images, n_ctx, max_tokens, threads):
    import llama_cpp
    from llama_cpp.llama_chat_format import Llava15ChatHandler

    from edgevlm_testkit.peers import same_kernels

    same_kernels()  # as edgevlm loads (no AMX buffers where they crash)
    llm = llama_cpp.Llama(
        str(pair.model),
        n_ctx=n_ctx,
        n_threads=threads,
        flash_attn=True,
        verbose=False,
        chat_handler=Llava15ChatHandler(clip_model_path=str(pair.mmproj), verbose=False),
    )
    uris = []
    for im in images:
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        uris.append("data:image/png;base64," + base64.b64encode(buf.getvalue()).decode())
    messages, rows, k = [], [], 0
    for t, (text, has_image) in enumerate(script()):
        content = [{"type": "text", "text": text}]
        if has_image:
            content.insert(0, {"type": "image_url", "image_url": {"url": uris[k]}})
            k += 1
        messages.append({"role": "user", "content": content})
        t0 = time.perf_counter()
        try:
            out = llm.create_chat_completion(messages=messages, max_tokens=max_tokens, temperature=0.0)
            reply = out["choices"][0]["message"]["content"] or ""
            messages.append({"role": "assistant", "content": reply})
            rows.append({"turn": t + 1, "ok": True, "ms": (time.perf_counter() - t0) * 1000, "rss": rss()})
        except Exception as exc:
            messages.pop()
            rows.append({"turn": t + 1, "ok": False, "error": str(exc).splitlines()[0][:100], "rss": rss()})
    llm.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--ctx", type=int, default=1536, help="small: holds 2 images of 576 tokens")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", help="the JSON (default: a new file in docs/results/, scripts/resultfile.py)")
    args = ap.parse_args(argv)

    from resultfile import Run

    run = Run("bench_session")
    from rich.console import Console
    from rich.table import Table

    from edgevlm_testkit import cached_model_pair

    pair = cached_model_pair("llava15", args.preset)
    images = make_images(len(IMAGES_AT))
    runs = {
        "edgevlm": run_edgevlm(pair, images, args.ctx, args.max_tokens, args.threads, reprefill=False),
        "re-prefill": run_edgevlm(pair, images, args.ctx, args.max_tokens, args.threads, reprefill=True),
        "llama-cpp-python": run_library(pair, images, args.ctx, args.max_tokens, args.threads),
    }
    t = Table(title=f"20 turns, 10 images, n_ctx {args.ctx} ({args.preset} preset, CPU {args.threads} threads)")
    for col in ("turn", "edgevlm ms", "re-prefill ms", "ratio", "library ms", "ratio", "edgevlm note"):
        t.add_column(col, justify="right" if col != "edgevlm note" else "left")
    for i in range(TURNS):
        a, b, c = (runs[k][i] for k in ("edgevlm", "re-prefill", "llama-cpp-python"))

        def ms(r):
            return f"{r['ms']:.0f}" if r["ok"] else "FAIL"

        def ratio(r, a=a):
            return f"{r['ms'] / a['ms']:.1f}x" if (r["ok"] and a["ok"]) else "-"

        note = f"{a['summarized']} summarised, ctx {a['n_ctx_used']}" if a["ok"] else a["error"][:40]
        t.add_row(str(i + 1), ms(a), ms(b), ratio(b), ms(c), ratio(c), note)
    Console(width=140).print(t)
    summary = {}
    for k, rows in runs.items():
        ok = [r for r in rows if r["ok"]]
        first_fail = next((r for r in rows if not r["ok"]), None)
        summary[k] = {
            "turns_ok": len(ok),
            "median_ms": statistics.median([r["ms"] for r in ok]) if ok else None,
            "max_rss_mib": max(r["rss"] for r in rows) / 2**20,
            "first_error": first_fail and {"turn": first_fail["turn"], "error": first_fail["error"]},
        }
        print(
            f"{k:17s} turns completed {len(ok)}/{TURNS}, median {summary[k]['median_ms'] or 0:.0f} ms/turn, "
            f"max RSS {summary[k]['max_rss_mib']:.0f} MiB"
            + (f", first error at turn {first_fail['turn']}: {first_fail['error']}" if first_fail else "")
        )
    print(f"wrote {run.save({'runs': runs, 'summary': summary, 'config': vars(args)}, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
