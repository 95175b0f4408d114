#!/usr/bin/env python3
"""Benchmark ``edgevlm caption`` against the loop people write around llama-cpp-python.

    python scripts/bench_caption.py --runs 3                 # llava15/real, 8 images, 16 and 48 tokens
    python scripts/bench_caption.py --images 4 --max-tokens 8 --runs 1
    python scripts/bench_caption.py --family qwen2vl --preset tiny --shell-loop 2

Side by side in one process, on the same generated model pair (random weights, real shapes),
the same N pictures, the same system prompt and instruction, greedy decoding, one n_ctx (4096:
what the planner picks for LLaVA-1.5), one thread count, flash attention, n_batch 512, f16 KV,
for each caption length in ``--max-tokens`` (the random weights never stop early):

- ``edgevlm``: a ``CaptionJob`` over the folder, exactly what ``edgevlm caption`` runs (record
  log with fsync, resume index, background decoding, KV prefix shared, ``--parallel auto``
  images in flight with their tokens generated in one batch);
- ``library``: ``Llama`` + the family's mtmd chat handler loaded once, then one
  ``create_chat_completion`` per image (system + image + instruction), captions appended to a
  JSONL file — the loop in most captioning scripts;
- ``shell loop`` (``--shell-loop K``, off by default): ``edgevlm chat --json`` as a new process
  per image, so the model loads for every picture (the shell-script way), timed on K images.

Each side captions one warm-up image first (not timed). With ``--runs`` > 1 the order of the
sides alternates. Reported per caption length: images/s, generated tok/s, the ratio edgevlm ÷
library (median of the paired runs), the share of edgevlm's wall time spent inside encode +
prefill + decode (llama.cpp time, attributed to the images in flight by their tokens in each
batch), where the rest went, and the prompt tokens the KV prefix saved per image. Other processes on a
shared machine skew wall times: each timed block records the share of CPU time they used.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
from PIL import Image, ImageDraw

from edgevlm_testkit import FAMILIES, PRESETS, cached_model_pair
from edgevlm_testkit.peers import machine_busy_s, same_kernels

SYSTEM = (
    "You are an image captioning assistant for a text-to-image training dataset. Describe "
    "the main subject, the setting, the colours, the lighting and the composition in one "
    "factual sentence. Do not start with 'The image shows' and do not mention the camera."
)
# A detailed captioning guide in the system prompt, as dataset-captioning setups often have.
LONG_SYSTEM = SYSTEM + (
    " Guidelines: name the subject first, then what it is doing, then where it is. Give the number of"
    " people or objects when it is small. Name colours plainly (red, dark blue) and materials when"
    " they are clear (wood, glass, brick). Describe the lighting (soft daylight, harsh noon sun,"
    " warm indoor light, neon at night) and the weather if outdoors. Mention the style when the"
    " picture is not a photograph (oil painting, line drawing, 3D render, pixel art, screenshot)."
    " Describe the composition: close-up, wide shot, from above, centred, rule of thirds. Do not"
    " guess names of people, brands or places unless the text in the picture states them; quote"
    " visible text exactly. Do not judge (beautiful, stunning, amazing) and do not speculate about"
    " feelings or stories. Use plain present tense, no lists, no line breaks, at most 40 words."
)
PROMPT = "Write a one-sentence caption for this image."
SPEED_TARGET = 1.2  # edgevlm images/s ÷ library images/s, at least
SHARE_TARGET = 0.95  # share of edgevlm's wall time inside encode + prefill + decode, at least
SIZES = [(640, 480), (800, 600), (512, 512), (480, 640)]


def make_images(outdir: Path, n: int, seed: int = 100) -> list[Path]:
    """N deterministic pictures: gradients with shapes, PNG and JPEG, four sizes."""
    paths = []
    for i in range(n):
        w, h = SIZES[i % len(SIZES)]
        rng = np.random.default_rng(seed + i)
        y, x = np.mgrid[0:h, 0:w]
        c = rng.integers(0, 255, 3)
        arr = np.stack(
            [(x * 255 // w + c[0]) % 256, (y * 255 // h + c[1]) % 256, np.full_like(x, c[2])], axis=-1
        ).astype(np.uint8)
        img = Image.fromarray(arr)
        draw = ImageDraw.Draw(img)
        for _ in range(6):
            x0, y0 = int(rng.integers(0, w - 60)), int(rng.integers(0, h - 60))
            box = [x0, y0, x0 + int(rng.integers(30, w // 2)), y0 + int(rng.integers(30, h // 2))]
            fill = tuple(int(v) for v in rng.integers(0, 255, 3))
            (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(box, fill=fill)
        p = outdir / (f"img{i:03d}.png" if i % 2 == 0 else f"img{i:03d}.jpg")
        img.save(p, quality=90) if p.suffix == ".jpg" else img.save(p)
        paths.append(p)
    return paths


class CpuMeter:
    """Share of the machine's CPU time other processes used while a block ran (Linux)."""

    def __enter__(self):
        self.b0, self.o0, self.t0 = machine_busy_s(), _own(), time.perf_counter()
        return self

    def __exit__(self, *exc):
        b1, o1, wall = machine_busy_s(), _own(), time.perf_counter() - self.t0
        self.others = (
            None
            if self.b0 is None or b1 is None or wall <= 0
            else round(max(0.0, (b1 - self.b0) - (o1 - self.o0)) / (wall * (os.cpu_count() or 1)), 3)
        )


def _own() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system  # the shell loop's processes too


# --- the sides ------------------------------------------------------------------------------
class EdgeSide:
    name = "edgevlm"

    def __init__(self, model: Path, mmproj: Path, args):
        import edgevlm

        self.model, self.mmproj, self.args = model, mmproj, args
        self.system = LONG_SYSTEM if args.long_system else SYSTEM
        from edgevlm.caption import CaptionSettings, caption_slots

        want = None if args.parallel == "auto" else int(args.parallel)
        settings = CaptionSettings(prompt=PROMPT, system=self.system, max_tokens=max(args.lengths))
        self.vlm = edgevlm.load(
            model,
            mmproj,
            n_ctx=args.n_ctx,
            n_threads=args.threads,
            kv="f16",
            flash_attn=True,
            n_batch=args.n_batch,
            n_ubatch=args.n_batch,
            type_k="f16",
            type_v="f16",
            image_max_tokens=None,
            n_seq_max=lambda plan: caption_slots(plan.n_ctx, plan.image_max_tokens, settings, want),
        )
        self.slots = self.vlm.scheduler.n_slots
        self.stops = list(self.vlm.default_stops)

    def run(self, images: list[Path], out: Path, max_tokens: int) -> dict[str, Any]:
        from edgevlm.caption import CaptionSettings
        from edgevlm.caption.inputs import discover
        from edgevlm.caption.job import CaptionJob

        settings = CaptionSettings(prompt=PROMPT, system=self.system, max_tokens=max_tokens)
        t0 = time.perf_counter()
        items = discover([str(p) for p in images]).items
        with CaptionJob(items, settings, model=str(self.model), mmproj=str(self.mmproj), out=str(out)) as job:
            s = job.run(self.vlm, prefetch=2)
        wall = time.perf_counter() - t0
        recs = [json.loads(ln) for ln in out.read_text().splitlines()]
        assert s.done == len(images), recs
        assert all(r["error"] is None for r in recs), recs
        return {
            "wall_s": wall,
            "captions": {Path(r["path"]).name: r["caption"] for r in recs},
            "generated": s.generated_tokens,
            "prompt_evaluated": s.prompt_tokens,
            "cached_per_image": s.cached_per_image,
            "engine_ms": s.engine_ms + s.encode_ms,  # encode + prefill + decode
            "engine_share": (s.engine_ms + s.encode_ms) / (wall * 1000),
            "wait_ms": s.wait_ms,
            "write_ms": s.write_ms,
            "load_ms_background": s.load_ms,
        }

    def close(self):
        self.vlm.close()


class LibrarySide:
    name = "library"

    def __init__(self, family: str, model: Path, mmproj: Path, args, stops: list[str]):
        import llama_cpp
        from llama_cpp import llama_chat_format as lcf

        if family in ("llava15", "llava16"):
            cls = lcf.Llava16ChatHandler if family == "llava16" else lcf.Llava15ChatHandler
        else:  # the generated Qwen pairs carry a chat template: the generic mtmd handler uses it
            cls = lcf.MTMDChatHandler
        self.handler_name = cls.__name__
        same_kernels()  # as edgevlm loads (no AMX buffers where they crash)
        self.llm = llama_cpp.Llama(
            str(model),
            n_ctx=args.n_ctx,
            n_batch=args.n_batch,
            n_ubatch=args.n_batch,
            n_threads=args.threads,
            n_threads_batch=args.threads,
            flash_attn=True,
            chat_handler=cls(clip_model_path=str(mmproj), verbose=False),
            verbose=False,
        )
        self.args, self.stops = args, stops
        self.system = LONG_SYSTEM if args.long_system else SYSTEM

    def run(self, images: list[Path], out: Path, max_tokens: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        captions, generated, prompt = {}, 0, 0
        with out.open("w") as fh:
            for p in images:
                r = self.llm.create_chat_completion(
                    messages=[
                        {"role": "system", "content": self.system},
                        {
                            "role": "user",
                            "content": [
                                {"type": "image_url", "image_url": {"url": p.resolve().as_uri()}},
                                {"type": "text", "text": PROMPT},
                            ],
                        },
                    ],
                    max_tokens=max_tokens,
                    temperature=0.0,
                    repeat_penalty=1.0,
                    stop=list(self.stops),
                )
                text = r["choices"][0]["message"]["content"].strip()
                generated += r["usage"]["completion_tokens"]
                prompt += r["usage"]["prompt_tokens"]
                captions[p.name] = text
                fh.write(json.dumps({"path": str(p), "caption": text}) + "\n")
                fh.flush()
        return {
            "wall_s": time.perf_counter() - t0,
            "captions": captions,
            "generated": generated,
            "prompt_evaluated": prompt,
        }

    def close(self):
        self.llm.close()


def shell_loop(model: Path, mmproj: Path, images: list[Path], args, system: str) -> dict[str, Any]:
    """``edgevlm chat --json`` as a new process per image: the model loads every time."""
    t0 = time.perf_counter()
    generated = 0
    for p in images:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "edgevlm",
                "chat",
                "-m",
                str(model),
                "--mmproj",
                str(mmproj),
                "-i",
                str(p),
                "--system",
                system,
                "-n",
                str(args.lengths[0]),
                "--temp",
                "0",
                "--ctx",
                str(args.n_ctx),
                "--threads",
                str(args.threads),
                "--kv",
                "f16",
                "--json",
                PROMPT,
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        generated += json.loads(r.stdout)["stats"]["predicted_n"]
    return {"wall_s": time.perf_counter() - t0, "generated": generated, "images": len(images)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="llava15", choices=list(FAMILIES))
    ap.add_argument("--preset", default="real", choices=list(PRESETS))
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument(
        "--max-tokens", default="16,48", help="caption lengths in tokens, comma-separated: each is timed on both sides"
    )
    ap.add_argument("--threads", type=int, default=max(1, min(os.cpu_count() or 1, 8)))
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--parallel", default="auto", help="edgevlm's images in flight (auto = what caption uses)")
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument(
        "--long-system", action="store_true", help="a detailed captioning guide (~300 tokens) as the system prompt"
    )
    ap.add_argument(
        "--shell-loop",
        type=int,
        default=0,
        metavar="K",
        help="also time a process per image (model reloaded) on K images",
    )
    ap.add_argument("--out", type=Path, help="the JSON (default: a new file in docs/results/, scripts/resultfile.py)")
    args = ap.parse_args(argv)

    from resultfile import Run

    run = Run("bench_caption")
    args.lengths = [int(x) for x in str(args.max_tokens).split(",") if x.strip()]

    import llama_cpp
    from rich.console import Console
    from rich.table import Table

    con = Console(width=max(Console().width, 150))
    pair = cached_model_pair(args.family, args.preset, 0)
    runs: dict[int, dict[str, list[dict]]] = {n: {"edgevlm": [], "library": []} for n in args.lengths}
    captions: dict[int, dict[str, dict]] = {n: {} for n in args.lengths}
    shell = None
    with tempfile.TemporaryDirectory(prefix="bench_caption.") as tmp:
        d = Path(tmp)
        (d / "imgs").mkdir()
        images = make_images(d / "imgs", args.images)
        (d / "warm").mkdir()
        warm = make_images(d / "warm", 1, seed=10_000)  # not one of the timed pictures
        t0 = time.perf_counter()
        edge = EdgeSide(pair.model, pair.mmproj, args)
        lib = LibrarySide(args.family, pair.model, pair.mmproj, args, edge.stops)
        con.print(
            f"[dim]{args.family}/{args.preset}: both sides loaded in {time.perf_counter() - t0:.1f} s "
            f"({lib.handler_name}); {args.images} images, {args.lengths} tokens each, "
            f"{args.threads} threads, edgevlm {edge.slots} image(s) in flight[/dim]"
        )
        sides = [edge, lib]
        for s in sides:  # warm-up, not timed
            s.run(warm, d / f"warm-{s.name}.jsonl", args.lengths[0])
        for r in range(args.runs):
            for li, n in enumerate(args.lengths):
                for s in sides if (r + li) % 2 == 0 else sides[::-1]:  # alternate who goes first
                    out = d / f"{s.name}-{n}-{r}.jsonl"
                    with CpuMeter() as m:
                        res = s.run(images, out, n)
                    res["busy_others"] = m.others
                    captions[n][s.name] = res.pop("captions")
                    runs[n][s.name].append(res)
                    con.print(
                        f"[dim]run {r + 1}, {n} tokens: {s.name} {res['wall_s']:.1f} s "
                        f"(others used {(m.others or 0):.0%} of the CPUs)[/dim]"
                    )
        for s in sides:
            s.close()
        if args.shell_loop:
            with CpuMeter() as m:
                shell = shell_loop(pair.model, pair.mmproj, images[: args.shell_loop], args, edge.system)
            shell["busy_others"] = m.others

    nimg = args.images
    per_length = {}
    for n in args.lengths:
        rn = runs[n]

        def med(name: str, key: str, rn=rn) -> float:
            return float(statistics.median(x[key] for x in rn[name]))

        e_wall, l_wall = med("edgevlm", "wall_s"), med("library", "wall_s")
        # Runs side by side in time: their ratio cancels slow drift and load from other processes.
        paired = [round(lb["wall_s"] / ed["wall_s"], 3) for ed, lb in zip(rn["edgevlm"], rn["library"], strict=True)]
        same = sum(captions[n]["edgevlm"].get(k) == v for k, v in captions[n]["library"].items())
        per_length[n] = {
            "edgevlm": rn["edgevlm"],
            "library": rn["library"],
            "ratio_images_per_s": round(l_wall / e_wall, 3),
            "paired_ratios": paired,
            "ratio_median_of_pairs": round(statistics.median(paired), 3),
            "edgevlm_engine_share": round(med("edgevlm", "engine_share"), 4),
            "same_captions": same,
            "edgevlm_images_per_s": round(nimg / e_wall, 4),
            "library_images_per_s": round(nimg / l_wall, 4),
        }
    result: dict[str, Any] = {
        "config": {
            "family": args.family,
            "preset": args.preset,
            "images": nimg,
            "runs": args.runs,
            "max_tokens": args.lengths,
            "threads": args.threads,
            "n_ctx": args.n_ctx,
            "n_batch": args.n_batch,
            "edgevlm_slots": edge.slots,
            "system": edge.system,
            "prompt": PROMPT,
            "library_handler": lib.handler_name,
            "llama_cpp_python": llama_cpp.__version__,
            "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        },
        "by_max_tokens": {str(n): v for n, v in per_length.items()},
        "shell_loop": shell,
        "targets": {
            str(n): {
                "speed_ge_1.2": v["ratio_median_of_pairs"] >= SPEED_TARGET,
                "engine_share_ge_0.95": v["edgevlm_engine_share"] >= SHARE_TARGET,
            }
            for n, v in per_length.items()
        },
    }
    print(f"JSON: {run.save(result, args.out)}")

    t = Table(
        title=f"captioning {nimg} images ({args.family}/{args.preset}, {'long ' if args.long_system else ''}"
        f"system prompt; edgevlm {edge.slots} in flight; library: {lib.handler_name} loop; "
        f"median of {args.runs} run(s))"
    )
    for col in (
        "caption tokens",
        "side",
        "wall s",
        "images/s",
        "tok/s",
        "prompt tok evaluated/img",
        "vs library (pairs)",
        "in llama.cpp",
        "others' CPU",
    ):
        t.add_column(col, justify="left" if col == "side" else "right")
    for n, v in per_length.items():
        for name, label in (("edgevlm", "edgevlm caption"), ("library", "library loop")):
            rows = v[name]
            wall = statistics.median(x["wall_s"] for x in rows)
            gen = statistics.median(x["generated"] for x in rows)
            vs = (
                f"{v['ratio_median_of_pairs']:.2f}x ({', '.join(f'{x:.2f}' for x in v['paired_ratios'])})"
                if name == "edgevlm"
                else "1.00x"
            )
            share = f"{v['edgevlm_engine_share']:.1%}" if name == "edgevlm" else "-"
            t.add_row(
                str(n),
                label,
                f"{wall:.2f}",
                f"{nimg / wall:.3f}",
                f"{gen / wall:.1f}",
                f"{statistics.median(x['prompt_evaluated'] for x in rows) / nimg:.0f}",
                vs,
                share,
                ", ".join(f"{(x['busy_others'] or 0):.0%}" for x in rows),
            )
    if shell:
        kk = shell["images"]
        per = shell["wall_s"] / kk
        t.add_row(
            str(args.lengths[0]),
            f"shell loop, model per image ({kk} img)",
            f"{per * nimg:.2f}*",
            f"{1 / per:.3f}",
            f"{shell['generated'] / shell['wall_s']:.1f}",
            "-",
            "-",
            "-",
            f"{(shell['busy_others'] or 0):.0%}",
        )
    verdicts = []
    for n, v in per_length.items():
        ok = v["ratio_median_of_pairs"] >= SPEED_TARGET
        ok2 = v["edgevlm_engine_share"] >= SHARE_TARGET
        verdicts.append(
            f"{n} tokens: {'[green]meets' if ok else '[red]misses'} ≥ {SPEED_TARGET}x[/], "
            f"{'[green]meets' if ok2 else '[red]misses'} ≥ {SHARE_TARGET:.0%} in llama.cpp[/], "
            f"same captions {v['same_captions']}/{nimg}"
        )
    e = per_length[args.lengths[0]]["edgevlm"][0]
    t.caption = (
        "; ".join(verdicts) + f". edgevlm waited for images {e['wait_ms']:.0f} ms, wrote records "
        f"{e['write_ms']:.0f} ms, decoded images in the background {e['load_ms_background']:.0f} ms; "
        f"KV prefix reused {e['cached_per_image']:g} tok/image" + (" (* = extrapolated to N)" if shell else "")
    )
    con.print(t)
    con.print(f"[dim]wrote {args.out}[/dim]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
