#!/usr/bin/env python3
"""Benchmark ``edgevlm caption`` against ``edgevlm batch``, a script against ``llama-server`` and the
loop people write around llama-cpp-python (issue #48: the CPU a picture costs).

    python scripts/bench_caption.py --runs 3                  # llava15/real, 24 pictures, 32 tokens
    python scripts/bench_caption.py --preset tiny --images 4 --max-tokens 8 --runs 1
    python scripts/bench_caption.py --llama-server PATH --sides caption,llama-server

Side by side in one run, on the same generated model pair (random weights, real shapes), the
same N distinct pictures (``--images``, ``--size`` each, PNG and JPEG in turn), the same system
prompt and instruction, greedy decoding, the same ``--max-tokens`` (each length in the list is
timed on every side; the random weights never stop early), one n_ctx (4096: what the planner
picks for LLaVA-1.5), one thread count, flash attention, n_batch 512, f16 KV, and ``--parallel``
pictures in flight on every side that has parallelism (``scripts/caption_sides.py``):

- ``caption``: a ``CaptionJob`` over the pictures, exactly what ``edgevlm caption`` runs, the
  model loaded as the command loads it (the scheduler's throughput profile);
- ``batch``: an OpenAI batch file of the same pictures answered as ``edgevlm batch`` answers it,
  in this process on the caption side's model (its load is not in the time);
- ``llama-server``: ``llama-server -np N`` (started once, not timed; ``--llama-server PATH``, else
  built from the pinned sdist: ``scripts/peer_servers.py``; skipped, not fatal, when there is none)
  and a client keeping N non-streamed requests in flight, each picture a ``data:`` URI;
- ``library``: ``Llama`` + the family's mtmd chat handler, one ``create_chat_completion`` per
  picture (one at a time: the loop in most captioning scripts);
- ``shell loop`` (``--shell-loop K``, off by default): ``edgevlm chat --json`` as a new process
  per picture, so the model loads for every one, timed on K pictures.

Every timed block gets pictures of its own (no side meets a picture an earlier block cached);
before it each side drops what it cached and captions one other picture (not timed). The order
of the sides rotates from block to block. Reported per side: wall s, images/s, completion
tokens/s and total, the CPU seconds its model used (this process's CPU time for the sides that
run in it, the server process's for llama-server) and per picture; the ratios caption ÷
llama-server and caption ÷ library (images/s, median of the paired runs) and batch ÷ caption,
against the targets ≥ 1.2×, ≥ 1.3× and within 5 %. Other processes on a shared machine skew wall
times: each timed block records the share of CPU time they used.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from caption_sides import (
    PROMPT,
    THROUGHPUT,
    BatchSide,
    EdgeSide,
    LibrarySide,
    LlamaServerSide,
    SideSkipped,
    make_images,
    own_cpu_s,
    shell_loop,
)
from peer_servers import DEFAULT_CACHE, find_llama_server

from edgevlm_testkit import FAMILIES, PRESETS, cached_model_pair
from edgevlm_testkit.peers import machine_busy_s

SIDES = ("caption", "batch", "llama-server", "library")
LABELS = {
    "caption": "edgevlm caption",
    "batch": "edgevlm batch",
    "llama-server": "llama-server script",
    "library": "library loop",
}
# caption's images/s ÷ a peer's, at least (batch: within 5 % of caption either way)
TARGETS = {"llama-server": 1.2, "library": 1.3}
BATCH_TOLERANCE = 0.05
SHARE_TARGET = 0.95  # share of caption's wall time inside encode + prefill + decode, at least


def timed(side, images: list[Path], out: Path, n: int) -> dict[str, Any]:
    """One timed block of a side: its result, the CPU its model used, and the share of the
    machine's CPU time other processes took meanwhile."""
    busy0, own0, cpu0, t0 = machine_busy_s(), _own_all(), side.cpu_s(), time.perf_counter()
    client0 = own_cpu_s()
    res = side.run(images, out, n)
    busy1, own1, cpu1, wall = machine_busy_s(), _own_all(), side.cpu_s(), time.perf_counter() - t0
    res["cpu_s"] = round(cpu1 - cpu0, 3)
    res["cpu_s_per_image"] = round((cpu1 - cpu0) / len(images), 4)
    ours = own1 - own0
    if side.external:  # its server is ours too, though not this process
        res["client_cpu_s"] = round(own_cpu_s() - client0, 3)
        ours += cpu1 - cpu0
    res["busy_others"] = others(busy0, busy1, ours, wall)
    return res


def others(busy0: float | None, busy1: float | None, ours: float, wall: float) -> float | None:
    """The share of all CPUs that other processes used while a block ran (Linux)."""
    if busy0 is None or busy1 is None or wall <= 0:
        return None
    return round(max(0.0, (busy1 - busy0) - ours) / (wall * (os.cpu_count() or 1)), 3)


def _own_all() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _med(xs) -> float:
    return float(statistics.median(list(xs)))


def _paired(a: list[dict], b: list[dict]) -> dict[str, Any]:
    """a's images/s ÷ b's run by run (their runs side by side in time: slow drift and other
    processes' load cancel), the median; and the median of a's CPU seconds ÷ b's."""
    paired = [round(y["wall_s"] / x["wall_s"], 3) for x, y in zip(a, b, strict=True)]
    cpu = [round(x["cpu_s"] / y["cpu_s"], 3) for x, y in zip(a, b, strict=True) if y["cpu_s"]]
    return {"median": round(_med(paired), 3), "paired": paired, "cpu": round(_med(cpu), 3) if cpu else None}


def summarise(rn: dict[str, list[dict]], caps: dict[str, dict], nimg: int) -> dict[str, Any]:
    """One caption length: each side's medians, the paired ratios, the captions alike."""
    summary = {}
    for name, rows in rn.items():
        wall = _med(x["wall_s"] for x in rows)
        summary[name] = {
            "wall_s": round(wall, 3),
            "images_per_s": round(nimg / wall, 4),
            "tok_per_s": round(_med(x["generated"] / x["wall_s"] for x in rows), 2),
            "generated": _med(x["generated"] for x in rows),
            "cpu_s": round(_med(x["cpu_s"] for x in rows), 3),
            "cpu_s_per_image": round(_med(x["cpu_s_per_image"] for x in rows), 4),
            "errors": max(x.get("errors", 0) for x in rows),
        }
    ratios: dict[str, Any] = {}
    cap = rn.get("caption")
    for other, key in (("llama-server", "caption_vs_llama_server"), ("library", "caption_vs_library")):
        if cap and rn.get(other):  # caption images/s ÷ the other's, run by run
            ratios[key] = _paired(cap, rn[other])
    if cap and rn.get("batch"):  # batch images/s ÷ caption's
        ratios["batch_vs_caption"] = _paired(rn["batch"], cap)
    out: dict[str, Any] = {"sides": rn, "summary": summary, "ratios": ratios}
    if cap:
        out["caption_engine_share"] = round(_med(x["engine_share"] for x in cap), 4)
        out["same_captions_as_caption"] = {
            name: sum(caps["caption"].get(k) == v for k, v in c.items())
            for name, c in caps.items()
            if name != "caption"
        }
    return out


def targets(v: dict[str, Any]) -> dict[str, bool | None]:
    r = v["ratios"]

    def at_least(key: str, x: float) -> bool | None:
        return r[key]["median"] >= x if key in r else None

    return {
        "caption_ge_1.2x_llama_server": at_least("caption_vs_llama_server", TARGETS["llama-server"]),
        "caption_ge_1.3x_library": at_least("caption_vs_library", TARGETS["library"]),
        "batch_within_5pct_of_caption": (
            abs(r["batch_vs_caption"]["median"] - 1) <= BATCH_TOLERANCE if "batch_vs_caption" in r else None
        ),
        "caption_engine_share_ge_0.95": (
            v["caption_engine_share"] >= SHARE_TARGET if "caption_engine_share" in v else None
        ),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--family", default="llava15", choices=list(FAMILIES))
    ap.add_argument("--preset", default="real", choices=list(PRESETS))
    ap.add_argument("--images", type=int, default=24, help="distinct pictures per timed block")
    ap.add_argument("--size", default="640x480", help="the pictures' size, WxH")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--max-tokens", default="32", help="caption lengths in tokens, comma-separated: each is timed")
    ap.add_argument("--threads", type=int, default=max(1, min(os.cpu_count() or 1, 8)))
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--parallel", type=int, default=4, help="pictures in flight (caption, batch, llama-server -np)")
    ap.add_argument("--n-batch", type=int, default=512)
    ap.add_argument("--sides", default=",".join(SIDES), help=f"which of {', '.join(SIDES)} to time")
    ap.add_argument("--llama-server", type=Path, help="a llama-server binary (else built once from the sdist)")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where llama-server is built")
    ap.add_argument(
        "--long-system", action="store_true", help="a detailed captioning guide (~300 tokens) as the system prompt"
    )
    ap.add_argument(
        "--shell-loop", type=int, default=0, metavar="K", help="also time a process per image (model reloaded) on K"
    )
    ap.add_argument("--out", type=Path, help="the JSON (default: a new file in docs/results/, scripts/resultfile.py)")
    args = ap.parse_args(argv)
    args.lengths = [int(x) for x in str(args.max_tokens).split(",") if x.strip()]
    w, _, h = args.size.partition("x")
    size = (int(w), int(h))
    wanted = [s for s in args.sides.split(",") if s]
    if unknown := set(wanted) - set(SIDES):
        ap.error(f"--sides: no side {', '.join(sorted(unknown))} (choose from {', '.join(SIDES)})")

    from resultfile import Run

    run = Run("bench_caption")

    import llama_cpp
    from rich.console import Console

    con = Console(width=max(Console().width, 150))
    pair = cached_model_pair(args.family, args.preset, 0)
    skipped: dict[str, str] = {}
    shell = None
    with tempfile.TemporaryDirectory(prefix="bench_caption.") as tmp:
        d = Path(tmp)
        warm = make_images(d / "warm", 1, seed=10_000, size=size)[0]  # not one of the timed pictures
        t0 = time.perf_counter()
        edge = EdgeSide(pair.model, pair.mmproj, args)  # batch answers on its model
        sides: list[Any] = [edge] if "caption" in wanted else []
        if "batch" in wanted:
            sides.append(BatchSide(edge, args))
        llama_server: Path | str | None = None
        if "llama-server" in wanted:
            llama_server = find_llama_server(args.llama_server, args.cache)
            try:
                if isinstance(llama_server, str):
                    raise SideSkipped(llama_server)
                sides.append(LlamaServerSide(llama_server, pair.model, pair.mmproj, args, edge.stops, d))
            except SideSkipped as exc:
                skipped["llama-server"] = str(exc)
                con.print(f"[yellow]llama-server skipped: {exc}[/yellow]")
        lib = None
        if "library" in wanted:
            lib = LibrarySide(args.family, pair.model, pair.mmproj, args, edge.stops)
            sides.append(lib)
        con.print(
            f"[dim]{args.family}/{args.preset}: {len(sides)} side(s) loaded in {time.perf_counter() - t0:.1f} s; "
            f"{args.images} pictures of {args.size}, {args.lengths} tokens each, {args.threads} threads, "
            f"{args.parallel} in flight (edgevlm: {edge.slots} sequences, {edge.running} running; "
            f"scheduler profile {THROUGHPUT.profile})[/dim]"
        )
        runs = {n: {s.name: [] for s in sides} for n in args.lengths}
        captions: dict[int, dict[str, dict]] = {n: {} for n in args.lengths}
        try:
            for r in range(args.runs):
                for li, n in enumerate(args.lengths):
                    block = r * len(args.lengths) + li
                    images = make_images(d / f"imgs{block}", args.images, seed=100 + 1000 * block, size=size)
                    k = block % len(sides)
                    for s in sides[k:] + sides[:k]:  # rotate who goes first
                        s.reset()
                        s.warm(warm, d / f"warm-{s.name}-{block}.jsonl", n)
                        res = timed(s, images, d / f"{s.name}-{n}-{r}.jsonl", n)
                        captions[n][s.name] = res.pop("captions")
                        runs[n][s.name].append(res)
                        con.print(
                            f"[dim]run {r + 1}, {n} tokens: {s.name} {res['wall_s']:.1f} s, CPU {res['cpu_s']:.1f} s"
                            f" (others used {(res['busy_others'] or 0):.0%} of the CPUs)[/dim]"
                        )
        finally:
            for s in sides[::-1]:
                s.close()
            if "caption" not in wanted:
                edge.close()
        if args.shell_loop:
            b0, own0, t0 = machine_busy_s(), _own_all(), time.perf_counter()
            pics = make_images(d / "shell", args.shell_loop, seed=900_000, size=size)
            shell = shell_loop(pair.model, pair.mmproj, pics, args, edge.system)
            b1, own1, wall = machine_busy_s(), _own_all(), time.perf_counter() - t0
            shell["busy_others"] = others(b0, b1, own1 - own0, wall)

    nimg = args.images
    per_length = {n: summarise(runs[n], captions[n], nimg) for n in args.lengths}
    result: dict[str, Any] = {
        "config": {
            "family": args.family,
            "preset": args.preset,
            "images": nimg,
            "size": list(size),
            "runs": args.runs,
            "max_tokens": args.lengths,
            "threads": args.threads,
            "n_ctx": args.n_ctx,
            "n_batch": args.n_batch,
            "parallel": args.parallel,
            "sides": [s.name for s in sides],
            "skipped": skipped,
            "edgevlm_slots": edge.slots,
            "edgevlm_running": edge.running,
            "scheduler_profile": THROUGHPUT.profile,
            "batch": "in this process on the caption side's loaded model (read_batch_file, BatchOutput, run_lines)",
            "llama_server": (
                {"binary": str(llama_server), "command": sides_named(sides, "llama-server").cmd[1:]}
                if sides_named(sides, "llama-server")
                else None
            ),
            "system": edge.system,
            "prompt": PROMPT,
            "library_handler": lib.handler_name if lib else None,
            "llama_cpp_python": llama_cpp.__version__,
        },
        "by_max_tokens": {str(n): v for n, v in per_length.items()},
        "shell_loop": shell,
        "targets": {str(n): targets(v) for n, v in per_length.items()},
    }
    print(f"JSON: {run.save(result, args.out)}")
    report(con, result, args)
    return 0


def sides_named(sides: list[Any], name: str) -> Any:
    return next((s for s in sides if s.name == name), None)


def report(con, result: dict[str, Any], args) -> None:
    from rich.table import Table

    cfg = result["config"]
    nimg = cfg["images"]
    t = Table(
        title=f"captioning {nimg} pictures of {args.size} ({cfg['family']}/{cfg['preset']}, "
        f"{'long ' if args.long_system else ''}system prompt; {cfg['parallel']} in flight; "
        f"median of {cfg['runs']} run(s))"
    )
    cols = ["tokens", "side", "wall s", "images/s", "tok/s", "tokens", "CPU s", "CPU s/image"]
    cols += ["caption ÷ side (pairs)", "CPU caption ÷ side", "others' CPU"]
    for col in cols:
        t.add_column(col, justify="left" if col == "side" else "right")
    key = {"llama-server": "caption_vs_llama_server", "library": "caption_vs_library"}
    verdicts = []
    for n, v in result["by_max_tokens"].items():
        ratios = v["ratios"]
        for name, rows in v["sides"].items():
            sm = v["summary"][name]
            vs, cpu = "-", "-"
            if name in key and key[name] in ratios:
                q = ratios[key[name]]
                vs = f"{q['median']:.2f}x ({', '.join(f'{x:.2f}' for x in q['paired'])})"
                cpu = f"{q['cpu']:.2f}x" if q["cpu"] else "-"
            elif name == "batch" and "batch_vs_caption" in ratios:
                q = ratios["batch_vs_caption"]  # shown as caption ÷ batch, as the other rows
                vs = f"{1 / q['median']:.2f}x (batch {q['median'] - 1:+.1%})"
                cpu = f"{1 / q['cpu']:.2f}x" if q["cpu"] else "-"
            t.add_row(
                n,
                LABELS[name] + (f" [red]({sm['errors']} errors)[/red]" if sm["errors"] else ""),
                f"{sm['wall_s']:.2f}",
                f"{sm['images_per_s']:.3f}",
                f"{sm['tok_per_s']:.1f}",
                f"{sm['generated']:.0f}",
                f"{sm['cpu_s']:.1f}",
                f"{sm['cpu_s_per_image']:.2f}",
                vs,
                cpu,
                ", ".join(f"{(x['busy_others'] or 0):.0%}" for x in rows),
            )
        met = result["targets"][n]
        parts = [
            f"{'[green]meets' if ok else '[red]misses'} {what}[/]"
            for what, ok in (
                ("caption ≥ 1.2× llama-server", met["caption_ge_1.2x_llama_server"]),
                ("caption ≥ 1.3× library", met["caption_ge_1.3x_library"]),
                ("batch within 5 % of caption", met["batch_within_5pct_of_caption"]),
                (f"≥ {SHARE_TARGET:.0%} in llama.cpp", met["caption_engine_share_ge_0.95"]),
            )
            if ok is not None
        ]
        same = ", ".join(f"{k} {c}/{nimg}" for k, c in v.get("same_captions_as_caption", {}).items())
        same = f"; same captions as caption: {same}" if same else ""
        if parts:
            verdicts.append(f"{n} tokens: " + ", ".join(parts) + same)
    shell = result["shell_loop"]
    if shell:
        per = shell["wall_s"] / shell["images"]
        t.add_row(
            str(cfg["max_tokens"][0]),
            f"shell loop, model per image ({shell['images']} img)",
            f"{per * nimg:.2f}*",
            f"{1 / per:.3f}",
            f"{shell['generated'] / shell['wall_s']:.1f}",
            f"{shell['generated']}",
            f"{shell['cpu_s']:.1f}",
            f"{shell['cpu_s'] / shell['images']:.2f}",
            "-",
            "-",
            f"{(shell['busy_others'] or 0):.0%}",
        )
    caption = "; ".join(verdicts)
    first = next(iter(result["by_max_tokens"].values()))
    if first["sides"].get("caption"):
        e = first["sides"]["caption"][0]
        caption += (
            f". caption waited for images {e['wait_ms']:.0f} ms, wrote records {e['write_ms']:.0f} ms, decoded "
            f"images in the background {e['load_ms_background']:.0f} ms; KV prefix reused {e['cached_per_image']:g} "
            f"tok/image; {first.get('caption_engine_share', 0):.1%} of its wall time in llama.cpp"
        )
    t.caption = caption + (" (* = extrapolated to N)" if shell else "")
    con.print(t)
    for name, why in cfg["skipped"].items():
        con.print(f"[yellow]{name} skipped: {why}[/yellow]")


if __name__ == "__main__":
    sys.exit(main())
