#!/usr/bin/env python3
"""Benchmark edgevlm's chat engine against llama-cpp-python's own multimodal chat path.

    python scripts/bench_chat.py                          # llava15/real, 3 runs, bench_chat.json
    python scripts/bench_chat.py --runs 5 --out /tmp/b.json
    python scripts/bench_chat.py --family qwen2vl --preset tiny

Both sides run in one process on the same generated model pair (random weights, real shapes),
the same two images, the same settings: greedy decoding, one n_ctx, one thread count, flash
attention on (text and vision), n_batch 512, the same system prompt and stop strings, repeat
penalty off. Each model is loaded once per side (not timed) and warmed up once.

1. One-shot: one user turn with one image, from a fresh state on both sides (edgevlm: its
   conversation reset and its image-embedding cache emptied, so it encodes the picture like the library does).
   TTFT = wall time from the request to the first streamed chunk with text.
2. Conversation: 5 turns, image A on turn 1, image B on turn 3, text-only otherwise. The library
   gets the whole history every turn (so it re-encodes every image and re-evaluates the whole
   prompt); edgevlm keeps its KV cache and image embeddings between turns. The two conversations
   run in lockstep (turn i on one side, then turn i on the other).

Runs alternate which side goes first, so slow drift (caches, clocks) hits both equally. On a
shared machine other processes skew wall times badly (ggml's threads wait on each other when one
is descheduled): every measurement records the share of CPU time others used meanwhile
(``busy_others``), and a one-shot pair (``--retries``) or a conversation pair
(``--conv-retries``) is measured again when that share exceeds ``--max-busy``. Medians are taken
over what was kept; the JSON holds every kept run.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
from PIL import Image, ImageDraw

from edgevlm_testkit import FAMILIES, PRESETS, cached_model_pair
from edgevlm_testkit.peers import same_kernels

SYSTEM = (
    "A chat between a curious human and an artificial intelligence assistant. "
    "The assistant gives helpful, detailed, and polite answers to the human's questions."
)
ONE_SHOT_PROMPT = "Describe this picture in detail."
# (text, image key or None) per conversation turn
CONVERSATION = [
    ("Describe this picture.", "A"),
    ("What colours dominate it?", None),
    ("Here is a second picture. How does it differ from the first?", "B"),
    ("Which of the two pictures is noisier?", None),
    ("Summarise our conversation in one sentence.", None),
]
ONE_SHOT_TARGET = 1.02  # edgevlm TTFT ÷ library TTFT, at most
TURN5_TARGET = 3.0  # library turn-5 time ÷ edgevlm turn-5 time, at least


# --- inputs -----------------------------------------------------------------------------
def make_images(outdir: Path) -> dict[str, Path]:
    """Two deterministic 640x480 pictures: a gradient with shapes, and colour noise."""
    w, h = 640, 480
    y, x = np.mgrid[0:h, 0:w]
    grad = np.stack([x * 255 // (w - 1), y * 255 // (h - 1), 255 - (x + y) * 255 // (w + h - 2)], axis=-1).astype(
        np.uint8
    )
    img = Image.fromarray(grad)
    draw = ImageDraw.Draw(img)
    draw.rectangle([60, 60, 260, 200], fill=(220, 30, 30), outline=(0, 0, 0), width=4)
    draw.ellipse([360, 120, 560, 320], fill=(30, 200, 60), outline=(255, 255, 255), width=4)
    draw.polygon([(120, 420), (240, 260), (360, 420)], fill=(30, 60, 220))
    draw.line([(0, 470), (639, 300)], fill=(250, 250, 0), width=6)
    a = outdir / "gradient_shapes.png"
    img.save(a)
    rng = np.random.default_rng(1234)
    b = outdir / "noise.png"
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(b)
    return {"A": a, "B": b}


# --- the two sides ----------------------------------------------------------------------
class EdgeSide:
    name = "edgevlm"

    def __init__(self, model: Path, mmproj: Path, n_ctx: int, n_threads: int, n_batch: int):
        import inspect

        import edgevlm

        # Pin what the library does: f16 KV, mtmd's own image-token limits, one n_batch.
        opts: dict[str, Any] = dict(
            flash_attn=True, n_batch=n_batch, n_ubatch=n_batch, type_k="f16", type_v="f16", image_max_tokens=None
        )
        if "kv" in inspect.signature(edgevlm.load).parameters:  # the planning load()
            opts["kv"] = "f16"
        self.vlm = edgevlm.load(
            model, mmproj, n_ctx=n_ctx, n_threads=n_threads, options=edgevlm.EngineOptions(system=SYSTEM), **opts
        )
        self.conv = self.vlm.conversation()  # the conversation the turns go on
        self.stops = list(self.vlm.default_stops)
        be = self.vlm.backend
        self.info = {
            "n_ctx": be.n_ctx,
            "n_batch": be.n_batch,
            "n_threads": be.n_threads,
            "guard": type(getattr(self.vlm, "guard", None)).__name__,
        }

    def fresh(self) -> None:
        """Empty conversation, empty KV cache and no cached image embeddings."""
        self.conv.reset()
        self.vlm.scheduler.images.clear()

    def turn(self, text: str, images: list[Path], max_tokens: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        ttft = None
        parts = []
        stats = None
        for r in self.conv.stream(text, images=[str(p) for p in images], max_tokens=max_tokens, temperature=0.0):
            if ttft is None and r.text:
                ttft = time.perf_counter()
            parts.append(r.text)
            if r.stats is not None:
                stats = r.stats
        t1 = time.perf_counter()
        assert stats is not None
        return {
            "ttft_ms": ((ttft or t1) - t0) * 1000,
            "total_ms": (t1 - t0) * 1000,
            "text": "".join(parts),
            "n_generated": stats.predicted_n,
            "prompt_tokens": stats.prompt_n + stats.cached_n,
            "evaluated_tokens": stats.prompt_n,
            "cached_tokens": stats.cached_n,
            "images_encoded": stats.images_encoded,
            "image_encode_ms": stats.image_encode_ms,
            "engine_ttft_ms": stats.ttft_ms,
            "engine_prompt_ms": stats.prompt_ms,
        }

    def close(self) -> None:
        self.vlm.close()


class LibrarySide:
    name = "library"

    def __init__(
        self, family: str, model: Path, mmproj: Path, n_ctx: int, n_threads: int, n_batch: int, stops: list[str]
    ):
        import llama_cpp
        from llama_cpp import llama_chat_format as lcf

        if family in ("llava15", "llava16"):
            handler_cls = lcf.Llava16ChatHandler if family == "llava16" else lcf.Llava15ChatHandler
        else:  # the generated Qwen pairs carry a chat template: the generic mtmd handler uses it
            handler_cls = lcf.MTMDChatHandler
        self.handler_name = handler_cls.__name__
        handler = handler_cls(clip_model_path=str(mmproj), verbose=False)
        same_kernels()  # as edgevlm loads (no AMX buffers where they crash)
        self.llm = llama_cpp.Llama(
            str(model),
            n_ctx=n_ctx,
            n_batch=n_batch,
            n_ubatch=n_batch,
            n_threads=n_threads,
            n_threads_batch=n_threads,
            flash_attn=True,
            chat_handler=handler,
            verbose=False,
        )
        self.stops = stops
        self.history: list[dict[str, Any]] = []
        self.info = {"n_ctx": self.llm.n_ctx(), "n_batch": self.llm.n_batch, "n_threads": self.llm.n_threads}

    def fresh(self) -> None:
        self.history = [{"role": "system", "content": SYSTEM}]

    def turn(self, text: str, images: list[Path], max_tokens: int) -> dict[str, Any]:
        if images:
            content: Any = [{"type": "image_url", "image_url": {"url": p.resolve().as_uri()}} for p in images] + [
                {"type": "text", "text": text}
            ]
        else:
            content = text
        self.history.append({"role": "user", "content": content})
        t0 = time.perf_counter()
        ttft = None
        parts = []
        n_chunks = 0
        # The handler evaluates the whole prompt (images included) inside this call.
        stream = self.llm.create_chat_completion(
            messages=self.history,
            max_tokens=max_tokens,
            temperature=0.0,
            repeat_penalty=1.0,
            stop=list(self.stops),
            stream=True,
        )
        t_prompt = time.perf_counter()
        prompt_tokens = int(self.llm.n_tokens)  # the prompt is in the KV cache by now
        for chunk in stream:
            piece = chunk["choices"][0]["delta"].get("content")
            if piece:
                if ttft is None:
                    ttft = time.perf_counter()
                parts.append(piece)
                n_chunks += 1
        t1 = time.perf_counter()
        reply = "".join(parts)
        self.history.append({"role": "assistant", "content": reply})
        return {
            "ttft_ms": ((ttft or t1) - t0) * 1000,
            "total_ms": (t1 - t0) * 1000,
            "text": reply,
            "n_chunks": n_chunks,
            "prompt_tokens": prompt_tokens,
            "prompt_ms": (t_prompt - t0) * 1000,  # request → prompt evaluated (images included)
            "n_ctx_used": int(self.llm.n_tokens),
        }

    def close(self) -> None:
        self.llm.close()


# --- measurement ------------------------------------------------------------------------
class CpuMeter:
    """Share of the machine's CPU time used by *other* processes (and hypervisor steal) while
    a block ran: 0 = we had the machine to ourselves. Linux only (None elsewhere)."""

    def __enter__(self):
        self.busy0, self.own0, self.t0 = _busy_seconds(), _own_seconds(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        busy1, own1, wall = _busy_seconds(), _own_seconds(), time.perf_counter() - self.t0
        if self.busy0 is None or busy1 is None or wall <= 0:
            self.others = None
        else:
            others = (busy1 - self.busy0) - (own1 - self.own0)
            self.others = round(max(0.0, others) / (wall * (os.cpu_count() or 1)), 3)


def _busy_seconds() -> float | None:
    try:
        with open("/proc/stat") as fh:
            vals = [int(v) for v in fh.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal
    return (sum(vals) - vals[3] - vals[4]) / os.sysconf("SC_CLK_TCK")


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


def one_shot(side, image: Path, max_tokens: int) -> dict[str, Any]:
    side.fresh()
    gc.collect()
    with CpuMeter() as m:
        out = side.turn(ONE_SHOT_PROMPT, [image], max_tokens)
    out["busy_others"] = m.others
    return out


def conversation(order: list, imgs: dict[str, Path], max_tokens: int) -> dict[str, list[dict]]:
    """Both sides' conversations in lockstep (turn i of one, then turn i of the other), so each
    turn's pair of measurements sees the same machine."""
    out: dict[str, list[dict]] = {}
    for side in order:
        side.fresh()
        out[side.name] = []
    gc.collect()
    for text, key in CONVERSATION:
        for side in order:
            with CpuMeter() as m:
                res = side.turn(text, [imgs[key]] if key else [], max_tokens)
            res["busy_others"] = m.others
            out[side.name].append(res)
    return out


def _busy(turns: list[dict[str, Any]]) -> float:
    """Time-weighted share of the CPUs other processes used over a conversation."""
    wall = sum(t["total_ms"] for t in turns)
    used = sum((t["busy_others"] or 0.0) * t["total_ms"] for t in turns)
    return used / wall if wall > 0 else 0.0


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def med(xs: list[float]) -> float:
    return round(float(statistics.median(xs)), 2)


def ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b > 0 else float("inf")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="llava15", choices=list(FAMILIES))
    ap.add_argument("--preset", default="real", choices=list(PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=max(1, min(os.cpu_count() or 1, 8)))
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--out", type=Path, help="the JSON (default: a new file in docs/results/, scripts/resultfile.py)")
    ap.add_argument("--skip-conversation", action="store_true", help="one-shot only")
    ap.add_argument(
        "--max-busy",
        type=float,
        default=0.15,
        help="redo a one-shot pair when other processes used more than this share of the CPUs during it (default 0.15)",
    )
    ap.add_argument("--retries", type=int, default=2, help="redos per one-shot pair (default 2)")
    ap.add_argument("--conv-retries", type=int, default=1, help="redos per conversation pair (default 1)")
    args = ap.parse_args(argv)

    from resultfile import Run

    run = Run("bench_chat")

    import llama_cpp
    from rich.console import Console
    from rich.table import Table

    con = Console(width=max(Console().width, 120))
    load_start = _loadavg()
    if load_start and load_start[0] > 0.5 * (os.cpu_count() or 1):
        con.print(
            f"[yellow]the machine is busy (load average {load_start[0]:.1f} on "
            f"{os.cpu_count()} CPUs): timings will be noisy[/yellow]"
        )
    t_gen = time.perf_counter()
    pair = cached_model_pair(args.family, args.preset, args.seed)
    con.print(f"[dim]model pair {pair.model.parent} ({time.perf_counter() - t_gen:.1f} s)[/dim]")

    with tempfile.TemporaryDirectory(prefix="bench_chat.") as tmp:
        imgs = make_images(Path(tmp))
        t0 = time.perf_counter()
        edge = EdgeSide(pair.model, pair.mmproj, args.n_ctx, args.threads, args.n_batch)
        t1 = time.perf_counter()
        lib = LibrarySide(args.family, pair.model, pair.mmproj, args.n_ctx, args.threads, args.n_batch, edge.stops)
        t2 = time.perf_counter()
        con.print(
            f"[dim]loaded: edgevlm {t1 - t0:.1f} s, library {t2 - t1:.1f} s "
            f"({lib.handler_name}); threads {args.threads}, n_ctx {args.n_ctx}[/dim]"
        )
        sides = [edge, lib]

        # warm-up (not timed): one one-shot turn per side
        warm = {s.name: one_shot(s, imgs["A"], args.max_tokens) for s in sides}
        con.print(
            f"[dim]warm-up TTFT: edgevlm {warm['edgevlm']['ttft_ms']:.0f} ms, "
            f"library {warm['library']['ttft_ms']:.0f} ms[/dim]"
        )

        shots: dict[str, list[dict]] = {"edgevlm": [], "library": []}
        retried = 0
        for r in range(args.runs):
            for attempt in range(args.retries + 1):
                pair_res = {
                    s.name: one_shot(s, imgs["A"], args.max_tokens)
                    for s in (sides if (r + attempt) % 2 == 0 else sides[::-1])
                }
                busy = max((x["busy_others"] or 0.0) for x in pair_res.values())
                note = f"other processes used {busy:.0%} of the CPUs"
                if busy <= args.max_busy or attempt == args.retries:
                    break
                retried += 1
                con.print(f"[yellow]one-shot run {r + 1}: {note}, measuring it again[/yellow]")
            for name, x in pair_res.items():
                shots[name].append(x)
            con.print(
                f"[dim]one-shot run {r + 1}/{args.runs}: "
                f"edgevlm {pair_res['edgevlm']['ttft_ms']:.0f} ms, "
                f"library {pair_res['library']['ttft_ms']:.0f} ms ({note})[/dim]"
            )

        convs: dict[str, list[list[dict]]] = {"edgevlm": [], "library": []}
        retried_conv = 0
        if not args.skip_conversation:
            for r in range(args.runs):
                for attempt in range(args.conv_retries + 1):
                    pair_conv = conversation(sides if (r + attempt) % 2 == 0 else sides[::-1], imgs, args.max_tokens)
                    busy = max(_busy(c) for c in pair_conv.values())
                    note = f"other processes used {busy:.0%} of the CPUs"
                    if busy <= args.max_busy or attempt == args.conv_retries:
                        break
                    retried_conv += 1
                    con.print(f"[yellow]conversation run {r + 1}: {note}, measuring it again[/yellow]")
                for name, c in pair_conv.items():
                    convs[name].append(c)
                secs = {n: sum(t["total_ms"] for t in c) / 1000 for n, c in pair_conv.items()}
                con.print(
                    f"[dim]conversation run {r + 1}/{args.runs}: "
                    f"edgevlm {secs['edgevlm']:.1f} s, library {secs['library']:.1f} s "
                    f"({note})[/dim]"
                )
        for s in sides:
            s.close()

    # --- results ---------------------------------------------------------------------
    e_ttft = [round(x["ttft_ms"], 2) for x in shots["edgevlm"]]
    l_ttft = [round(x["ttft_ms"], 2) for x in shots["library"]]
    one_ratio = ratio(med(e_ttft), med(l_ttft))
    # Each edgevlm run sits next to a library run in time: their ratio cancels slow drift and
    # other load on the machine better than the ratio of the medians.
    paired = [ratio(e, lb) for e, lb in zip(e_ttft, l_ttft, strict=True)]
    e0 = shots["edgevlm"][-1]
    result: dict[str, Any] = {
        "config": {
            "family": args.family,
            "preset": args.preset,
            "seed": args.seed,
            "runs": args.runs,
            "max_tokens": args.max_tokens,
            "n_threads": args.threads,
            "n_ctx": args.n_ctx,
            "n_batch": args.n_batch,
            "flash_attn": True,
            "temperature": 0.0,
            "repeat_penalty": 1.0,
            "stop": edge.stops,
            "system": SYSTEM,
            "model": str(pair.model),
            "mmproj": str(pair.mmproj),
            "library_handler": lib.handler_name,
            "edgevlm_effective": edge.info,
            "library_effective": lib.info,
            "llama_cpp_python": llama_cpp.__version__,
            "images": {"A": "640x480 gradient + shapes (PNG)", "B": "640x480 RGB noise (PNG)"},
            "machine": {
                "cpu_count": os.cpu_count(),
                "platform": platform.platform(),
                "python": platform.python_version(),
            },
            "ttft_definition": "wall time from the request to the first streamed chunk with text",
            "library_prompt_tokens_note": "the library's n_past after the prompt: tokens, except "
            "on M-RoPE models (qwen2vl) where an image advances it "
            "by max(nx, ny)",
            "loadavg_start": load_start,
            "loadavg_end": _loadavg(),
            "max_busy": args.max_busy,
            "retries": args.retries,
            "conv_retries": args.conv_retries,
        },
        "one_shot": {
            "edgevlm_ttft_ms": e_ttft,
            "library_ttft_ms": l_ttft,
            "edgevlm_median_ms": med(e_ttft),
            "library_median_ms": med(l_ttft),
            "median_ratio": one_ratio,
            "paired_ratios": paired,
            "paired_ratio_median": round(float(statistics.median(paired)), 3),
            "edgevlm_busy_others": [x["busy_others"] for x in shots["edgevlm"]],
            "library_busy_others": [x["busy_others"] for x in shots["library"]],
            "retried_pairs": retried,
            "edgevlm_total_ms": [round(x["total_ms"], 2) for x in shots["edgevlm"]],
            "library_total_ms": [round(x["total_ms"], 2) for x in shots["library"]],
            "edgevlm_image_encode_ms": [x["image_encode_ms"] for x in shots["edgevlm"]],
            # edgevlm's own stats (its clock starts after the images are decoded and hashed)
            "edgevlm_engine_prompt_ms": [x["engine_prompt_ms"] for x in shots["edgevlm"]],
            "edgevlm_engine_ttft_ms": [x["engine_ttft_ms"] for x in shots["edgevlm"]],
            "library_prompt_ms": [round(x["prompt_ms"], 2) for x in shots["library"]],
            "edgevlm_prompt_tokens": e0["prompt_tokens"],
            "library_prompt_tokens": shots["library"][-1]["prompt_tokens"],
            "edgevlm_text": e0["text"],
            "library_text": shots["library"][-1]["text"],
        },
        "conversation": {"turns": []},
    }
    result["conversation"]["retried_pairs"] = retried_conv
    result["conversation"]["busy_others"] = {name: [round(_busy(c), 3) for c in cs] for name, cs in convs.items()}
    turns = result["conversation"]["turns"]
    if convs["edgevlm"]:
        for i, (text, key) in enumerate(CONVERSATION):
            e = [c[i] for c in convs["edgevlm"]]
            lb = [c[i] for c in convs["library"]]
            e_ms, l_ms = med([x["total_ms"] for x in e]), med([x["total_ms"] for x in lb])
            turns.append(
                {
                    "turn": i + 1,
                    "image": key,
                    "text": text,
                    "edgevlm_ms": e_ms,
                    "library_ms": l_ms,
                    "ratio": ratio(l_ms, e_ms),
                    "edgevlm_ttft_ms": med([x["ttft_ms"] for x in e]),
                    "library_ttft_ms": med([x["ttft_ms"] for x in lb]),
                    "ttft_ratio": ratio(med([x["ttft_ms"] for x in lb]), med([x["ttft_ms"] for x in e])),
                    "paired_ratios": [ratio(b["total_ms"], a["total_ms"]) for a, b in zip(e, lb, strict=True)],
                    "edgevlm_runs_ms": [round(x["total_ms"], 2) for x in e],
                    "library_runs_ms": [round(x["total_ms"], 2) for x in lb],
                    "edgevlm_evaluated_tokens": e[-1]["evaluated_tokens"],
                    "edgevlm_cached_tokens": e[-1]["cached_tokens"],
                    "edgevlm_images_encoded": e[-1]["images_encoded"],
                    "library_prompt_tokens": lb[-1]["prompt_tokens"],
                    "edgevlm_busy_others": [x["busy_others"] for x in e],
                    "library_busy_others": [x["busy_others"] for x in lb],
                    "edgevlm_generated": e[-1]["n_generated"],
                    "library_chunks": lb[-1]["n_chunks"],
                }
            )
    result["targets"] = {
        "one_shot_ratio_le_1.02": bool(one_ratio <= ONE_SHOT_TARGET),
        "turn5_ratio_ge_3": bool(turns[-1]["ratio"] >= TURN5_TARGET) if turns else None,
    }
    out = run.save(result, args.out)
    print(f"JSON: {out}")

    # --- tables ----------------------------------------------------------------------
    t = Table(title=f"One-shot TTFT, 1 image ({args.family}/{args.preset}, {args.runs} runs, {args.threads} threads)")
    t.add_column("side")
    t.add_column("runs (ms)")
    t.add_column("median ms", justify="right")
    t.add_column("prompt tok", justify="right")
    t.add_column("others' CPU share", justify="right")
    for name, xs in (("edgevlm", e_ttft), ("library", l_ttft)):
        t.add_row(
            name,
            ", ".join(f"{x:.0f}" for x in xs),
            f"{med(xs):.0f}",
            str(result["one_shot"][f"{name}_prompt_tokens"]),
            ", ".join(f"{(b or 0):.0%}" for b in result["one_shot"][f"{name}_busy_others"]),
        )
    ok = result["targets"]["one_shot_ratio_le_1.02"]
    t.caption = (
        f"edgevlm ÷ library = {one_ratio:.3f} (paired runs: "
        f"{', '.join(f'{x:.3f}' for x in paired)}) "
        f"({'[green]meets' if ok else '[red]misses'} ≤ {ONE_SHOT_TARGET}[/])"
    )
    con.print(t)
    if turns:
        t = Table(title=f"5-turn conversation, medians of {args.runs} runs (ms)")
        for col in (
            "turn",
            "image",
            "TTFT edgevlm",
            "TTFT library",
            "TTFT lib÷edge",
            "turn edgevlm",
            "turn library",
            "turn lib÷edge",
            "edgevlm tok eval/cached",
        ):
            t.add_column(col, justify="right")
        for tr in turns:
            t.add_row(
                str(tr["turn"]),
                tr["image"] or "-",
                f"{tr['edgevlm_ttft_ms']:.0f}",
                f"{tr['library_ttft_ms']:.0f}",
                f"{tr['ttft_ratio']:.2f}x",
                f"{tr['edgevlm_ms']:.0f}",
                f"{tr['library_ms']:.0f}",
                f"{tr['ratio']:.2f}x",
                f"{tr['edgevlm_evaluated_tokens']}/{tr['edgevlm_cached_tokens']}",
            )
        ok = result["targets"]["turn5_ratio_ge_3"]
        busy = result["conversation"]["busy_others"]
        t.caption = (
            f"turn 5 library ÷ edgevlm = {turns[-1]['ratio']:.2f}x "
            f"({'[green]meets' if ok else '[red]misses'} ≥ {TURN5_TARGET:g}x[/]); "
            f"others' CPU share per run: edgevlm "
            f"{', '.join(f'{b:.0%}' for b in busy['edgevlm'])}, library "
            f"{', '.join(f'{b:.0%}' for b in busy['library'])}"
        )
        con.print(t)
    con.print(f"[dim]wrote {out}[/dim]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
