#!/usr/bin/env python3
"""The next turn of a saved conversation: how soon its first token comes, three ways, in one run.

    python scripts/bench_restore.py                       # llava15/real, f16 and q8_0, 3 runs each
    python scripts/bench_restore.py --kv f16 --runs 5 --out /tmp/r.json

A conversation of 3 pictures (640×480, drawn) and about 2,000 tokens (3 turns, one picture each,
``--history-reply`` tokens per answer) is built on the LLaVA-1.5-7B-shaped pair and saved
(``conversation().save``). Then a short text follow-up, each run another one (the same one on
the three ways), and its time to the first token:

(a) **same process**: the conversation's KV cells still resident (the history is put back
    before each run: the engine's conversation is the object it was after turn 3, saved again to
    cut its sequence back to the history's cells — the file holds the same cells — so the run
    evaluates exactly what (b) does); TTFT as the turn's stats report it (``ttft_ms``: the turn's
    start to the first generated token, pictures tokenized and the follow-up evaluated).
(b) **restored**: a new process loads the model, ``conversation().load(FILE)`` (read, checked,
    its pictures decoded, its KV cells put back: ``llama_state_seq_set_data``) and asks the
    follow-up. ``load`` runs before the turn starts, so its time is added: TTFT = load + the
    turn's ``ttft_ms``. Also the wall time from starting the process to the first token.
(c) **history re-sent**: a new process gets the same conversation without its KV cells (loaded
    from the file, then its cells dropped: ``scheduler.forget``), as a client that re-sends the
    whole history does today: every picture is encoded and the whole prefix evaluated. TTFT is
    the turn's ``ttft_ms``; the wall time from the process start leaves the file's load out.

Each run's order of the ways rotates; the medians of ``--runs`` runs are compared (the first
``--resent-runs`` of them run (c) too: it takes tens of seconds on a CPU). (b) ÷ (a) is also
given per run, each beside the other in time.
Per KV type (``--kv``): the file's size per 1,000 KV cells, what (b)'s restore spent where
(read + checksum, pictures decoded, the binding's fingerprints, ``state_seq_set_data``, the
turn's prompt rendering, and a second follow-up's TTFT in the same new process: the first
turn's extra cost in a fresh process), and one ``edgevlm chat --session FILE --json`` one-shot (the CLI's
own figures and output: docs/chat.md shows it) — the first KV type's file also asked with
another ``--kv``, which is refused. Targets (issue #55): (b) at least 5× faster than (c),
within 1.5× of (a).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TURNS = (
    "Here is the first picture. Describe it in detail.",
    "Here is a second picture. Describe it and compare it with the first.",
    "And a third one. Describe it and compare it with the other two.",
)
QUESTIONS = (
    "Which of the three pictures is the brightest?",
    "Which of the three pictures has the most shapes?",
    "Which of the three pictures is the most colourful?",
)
SECOND = "And which one is the darkest?"  # asked before the file is saved, and by (b) after its timed turn
WAYS = ("same_process", "restored", "resent")
FASTER_THAN_RESENT = 5.0  # (c) ÷ (b), at least
WITHIN_SAME_PROCESS = 1.5  # (b) ÷ (a), at most
MARK = "@@"  # a child's protocol lines on stdout


def question(i: int) -> str:
    q = QUESTIONS[i % len(QUESTIONS)]
    return q if i < len(QUESTIONS) else f"{q} ({i + 1})"


def make_pictures(outdir: Path) -> list[Path]:
    """Three deterministic 640×480 pictures: a gradient with shapes, each its own."""
    import numpy as np
    from PIL import Image, ImageDraw

    w, h = 640, 480
    y, x = np.mgrid[0:h, 0:w]
    out = []
    for k in range(3):
        grad = np.stack(
            [(x + 97 * k) * 255 // (w + 200), (y * (k + 1)) % 256, 255 - (x + y) * 255 // (w + h - 2)], axis=-1
        ).astype(np.uint8)
        img = Image.fromarray(grad)
        draw = ImageDraw.Draw(img)
        for j in range(2 + 2 * k):  # 2, 4, 6 shapes
            x0, y0 = 40 + 90 * j, 40 + 50 * ((j + k) % 6)
            colour = ((60 * j + 80 * k) % 256, (200 - 40 * j) % 256, (30 + 70 * k) % 256)
            (draw.ellipse if (j + k) % 2 else draw.rectangle)([x0, y0, x0 + 120, y0 + 90], fill=colour, outline=0)
        path = outdir / f"picture{k + 1}.png"
        img.save(path)
        out.append(path)
    return out


# --- where the time goes ---------------------------------------------------------------------
class Timers:
    """Milliseconds (and calls) spent in wrapped functions; ``wrap`` replaces an attribute of a
    module or an object with a timed call of itself."""

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}
        self.calls: dict[str, int] = {}

    def wrap(self, owner: Any, name: str, label: str) -> None:
        inner: Callable[..., Any] = getattr(owner, name)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*a, **k)
            finally:
                self.ms[label] = self.ms.get(label, 0.0) + (time.perf_counter() - t0) * 1000
                self.calls[label] = self.calls.get(label, 0) + 1

        setattr(owner, name, timed)

    def take(self) -> dict[str, Any]:
        out = {"ms": {k: round(v, 2) for k, v in self.ms.items()}, "calls": dict(self.calls)}
        self.ms, self.calls = {}, {}
        return out


def instrument(engine: Any, timers: Timers) -> None:
    """Time what a restore and a turn are made of: the file read and checked, its pictures
    decoded, the binding's fingerprints, llama.cpp taking the cells, the prompt rendered."""
    import edgevlm.runtime.engine as engine_mod
    import edgevlm.runtime.saved.chatfile as chatfile

    timers.wrap(chatfile, "load_saved", "read_and_checksum")
    timers.wrap(chatfile, "decode_conversation", "decode_pictures")
    timers.wrap(engine_mod, "binding_of", "binding")
    timers.wrap(engine.backend, "state_load", "state_seq_set_data")
    timers.wrap(engine.scheduler, "render", "render")


def follow_up(engine: Any, text: str, max_tokens: int, first: Callable[[], None] | None = None) -> dict[str, Any]:
    """One greedy text turn; its stats and the wall time to its first streamed response."""
    t0 = time.perf_counter()
    t_first = None
    parts, stats = [], None
    for r in engine.stream(text, max_tokens=max_tokens, temperature=0.0):
        if t_first is None:
            t_first = time.perf_counter()
            if first is not None:
                first()
        parts.append(r.text)
        if r.stats is not None:
            stats = r.stats
    assert stats is not None
    return {
        "question": text,
        "reply": "".join(parts),
        "ttft_ms": stats.ttft_ms,
        "first_response_ms": round(((t_first or time.perf_counter()) - t0) * 1000, 2),
        "prompt_n": stats.prompt_n,
        "cached_n": stats.cached_n,
        "images_encoded": stats.images_encoded,
        "image_encode_ms": stats.image_encode_ms,
        "prompt_ms": stats.prompt_ms,
        "n_ctx_used": stats.n_ctx_used,
    }


# --- a new process: (b) and (c) ----------------------------------------------------------------
def child(spec: dict[str, Any]) -> int:
    """A new process: load the model, then the saved conversation; for ``resent`` drop its KV
    cells again (the history re-sent without them); ask the follow-up."""
    t0 = time.perf_counter()
    import edgevlm

    t_import = time.perf_counter()
    vlm = edgevlm.load(spec["model"], spec["mmproj"], n_ctx=spec["n_ctx"], kv=spec["kv"], n_threads=spec["threads"])
    t_model = time.perf_counter()
    engine = vlm.conversation()
    timers = Timers()
    instrument(engine, timers)
    t = time.perf_counter()
    info = engine.load(spec["file"])
    load_ms = (time.perf_counter() - t) * 1000
    restore = timers.take()
    if spec["way"] == "resent":
        engine.scheduler.forget(engine.client)  # the conversation without its cells: all of it evaluated again

    def first() -> None:
        print(MARK + "first", flush=True)

    turn = follow_up(engine, spec["question"], spec["max_tokens"], first)
    turn |= {
        "import_ms": round((t_import - t0) * 1000, 2),
        "model_load_ms": round((t_model - t_import) * 1000, 2),
        "load_ms": round(load_ms, 2),
        "restore": restore,
        "turn_parts": timers.take(),
        "restored_tokens": info.tokens,
        "restored_pictures": info.pictures,
    }
    if spec["way"] == "restored":  # one more turn, after the timed one: what a turn costs once the process is warm
        again = follow_up(engine, SECOND, spec["max_tokens"])
        turn["second_turn"] = {k: again[k] for k in ("ttft_ms", "prompt_n", "cached_n")}
    vlm.close()
    print(MARK + "result " + json.dumps(turn), flush=True)
    return 0


def child_env() -> dict[str, str]:
    """The children run this checkout's edgevlm (and the test kit) whatever the venv points at."""
    path = [str(ROOT), str(ROOT / "testkit"), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(path), PYTHONWARNINGS="ignore")


class Busy:
    """The share of the CPUs other processes used while a block ran (this one's children are
    ours: a child's CPU time counts once it has been waited for)."""

    def __enter__(self) -> Busy:
        from edgevlm_testkit.peers import machine_busy_s

        self.busy0, self.own0, self.t0 = machine_busy_s(), _own(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        from edgevlm_testkit.peers import machine_busy_s

        busy1, wall = machine_busy_s(), time.perf_counter() - self.t0
        self.others = None
        if self.busy0 is not None and busy1 is not None and wall > 0:
            used = (busy1 - self.busy0) - (_own() - self.own0)
            self.others = round(max(0.0, used) / (wall * (os.cpu_count() or 1)), 3)


def _own() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def in_new_process(way: str, spec: dict[str, Any], tmp: Path) -> dict[str, Any]:
    """Run ``child`` for ``way``; its result with the wall time from the process start to the
    first token (the parent reads the child's mark as it comes)."""
    err = tmp / f"{way}.stderr"
    with Busy() as busy, open(err, "w") as ferr:
        t0 = time.perf_counter()
        p = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps({**spec, "way": way})],
            stdout=subprocess.PIPE,
            stderr=ferr,
            text=True,
            env=child_env(),
        )
        assert p.stdout is not None
        t_first, result = None, None
        for line in p.stdout:
            if line.startswith(MARK + "first") and t_first is None:
                t_first = time.perf_counter()
            elif line.startswith(MARK + "result "):
                result = json.loads(line[len(MARK + "result ") :])
        rc = p.wait()
        t_end = time.perf_counter()
    if rc != 0 or result is None or t_first is None:
        raise SystemExit(f"the {way} process failed (exit {rc}): {err.read_text()[-2000:]}")
    result["process_to_first_token_ms"] = round((t_first - t0) * 1000, 2)
    result["process_ms"] = round((t_end - t0) * 1000, 2)
    result["busy_others"] = busy.others
    return result


# --- the CLI: one example run, one refusal ------------------------------------------------------
def cli(args: list[str], cwd: Path) -> dict[str, Any]:
    argv = ["edgevlm", *args]
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "edgevlm", *args], cwd=cwd, capture_output=True, text=True, env=child_env(), timeout=600
    )
    out: dict[str, Any] = {
        "argv": argv,
        "returncode": r.returncode,
        "wall_ms": round((time.perf_counter() - t0) * 1000, 2),
        "stderr": r.stderr.strip(),
    }
    try:
        out["output"] = json.loads(r.stdout)
    except ValueError:
        out["stdout"] = r.stdout.strip()
    return out


# --- one KV type ----------------------------------------------------------------------------------
def one_kv(kv: str, pair: Any, pictures: list[Path], args: argparse.Namespace, tmp: Path, log: Any) -> dict[str, Any]:
    import edgevlm
    from edgevlm.runtime.saved.fileformat import read_header

    spec = {
        "model": str(pair.model),
        "mmproj": str(pair.mmproj),
        "n_ctx": args.n_ctx,
        "kv": kv,
        "threads": args.threads,
        "max_tokens": args.reply_tokens,
    }
    t = time.perf_counter()
    vlm = edgevlm.load(pair.model, pair.mmproj, n_ctx=args.n_ctx, kv=kv, n_threads=args.threads)
    engine = vlm.conversation()
    be = vlm.backend
    effective = {"n_ctx": be.n_ctx, "type_k": be.type_k, "type_v": be.type_v, "flash_attn": be.flash_attn}
    effective["image_budget"] = be.image_budget
    history = []
    for text, picture in zip(TURNS, pictures, strict=True):
        r = engine.chat(text, [str(picture)], max_tokens=args.history_reply, temperature=0.0)
        s = r.stats
        history.append(
            {
                "prompt_n": s.prompt_n,
                "cached_n": s.cached_n,
                "predicted_n": s.predicted_n,
                "ttft_ms": s.ttft_ms,
                "image_encode_ms": s.image_encode_ms,
                "n_ctx_used": s.n_ctx_used,
            }
        )
    built_s = time.perf_counter() - t
    # The history's cells, the same for (a) and (b): a turn ends with its answer's last token not
    # yet evaluated; once a follow-up has been asked it is. Saving the history then cuts the
    # sequence back to the history's cells (``Engine.save`` exports exactly the conversation's):
    # the file holds them, and (a)'s sequence is cut back the same way before each run — each
    # run evaluates the same tokens on both (not, on (a), words shared with the last question).
    hist = engine.conversation
    follow_up(engine, SECOND, args.reply_tokens)
    engine.conversation = hist
    file = tmp / f"talk-{kv}.evlm"
    t = time.perf_counter()
    info = engine.save(str(file))
    save_ms = (time.perf_counter() - t) * 1000
    sections = dict(read_header(str(file))["sections"])
    kv_bytes = int(sections.get("kv", 0))
    png_bytes = sum(int(n) for name, n in sections.items() if name.startswith("px:"))
    saved = {
        "bytes": info.bytes,
        "kv_bytes": kv_bytes,
        "picture_bytes": png_bytes,
        "header_bytes": info.bytes - kv_bytes - png_bytes,
        "cells": info.tokens,
        "pictures": info.pictures,
        "messages": info.messages,
        "save_ms": round(save_ms, 2),
        "bytes_per_1k_cells": round(info.bytes * 1000 / info.tokens),
        "kv_bytes_per_1k_cells": round(kv_bytes * 1000 / info.tokens),
    }
    log(
        f"{kv}: history of {info.tokens:,} tokens, {info.pictures} pictures built in {built_s:.1f} s; "
        f"saved {info.bytes / 2**20:.1f} MiB in {save_ms:.0f} ms"
    )
    timers = Timers()
    instrument(engine, timers)
    runs: dict[str, list[dict[str, Any]]] = {w: [] for w in WAYS}
    for i in range(args.runs):
        q = question(i)
        ways = WAYS if i < args.resent_runs else WAYS[:2]  # (c) takes tens of seconds a run
        order = ways[i % len(ways) :] + ways[: i % len(ways)]
        for way in order:
            if way == "same_process":
                engine.conversation = hist  # back to the history, its cells exactly (above)
                engine.save(str(tmp / "again.evlm"))
                timers.take()
                with Busy() as busy:
                    res = follow_up(engine, q, args.reply_tokens)
                res |= {"turn_parts": timers.take(), "busy_others": busy.others}
            else:
                res = in_new_process(way, {**spec, "file": str(file), "question": q}, tmp)
            res["ttft_total_ms"] = round(res["ttft_ms"] + (res["load_ms"] if way == "restored" else 0.0), 2)
            runs[way].append(res)
        log(
            f"{kv} run {i + 1}/{args.runs}: "
            + ", ".join(f"{w} {runs[w][-1]['ttft_total_ms']:.0f} ms" for w in ways)
            + f" (others used {max(runs[w][-1]['busy_others'] or 0 for w in ways):.0%} of the CPUs)"
        )
    vlm.close()

    # the CLI on a copy of the file (it saves the conversation back after the turn)
    talk = tmp / "talk.evlm"
    shutil.copyfile(file, talk)
    common = ["-m", str(pair.model), "--mmproj", str(pair.mmproj), "--ctx", str(args.n_ctx), "--temp", "0"]
    common += ["-n", str(args.reply_tokens), "--threads", str(args.threads)]
    example = cli(["chat", *common, "--kv", kv, "--session", "talk.evlm", "--json", question(0)], tmp)
    if example["returncode"] != 0:
        raise SystemExit(f"edgevlm chat --session failed: {example['stderr']}")
    return {
        "effective": effective,
        "history": history,
        "history_build_s": round(built_s, 1),
        "file": saved,
        "runs": runs,
        "summary": summarise(runs),
        "cli": example,
    }


def med(xs: list[float]) -> float:
    return round(float(statistics.median(xs)), 2)


def summarise(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    a, b = runs["same_process"], runs["restored"]
    s: dict[str, Any] = {w: {"ttft_ms": med([r["ttft_total_ms"] for r in runs[w]])} for w in WAYS}
    for w in ("restored", "resent"):
        s[w]["process_to_first_token_ms"] = med(
            [r["process_to_first_token_ms"] - (r["load_ms"] if w == "resent" else 0.0) for r in runs[w]]
        )
        s[w]["model_load_ms"] = med([r["model_load_ms"] for r in runs[w]])
    s["restored"]["load_ms"] = med([r["load_ms"] for r in b])
    s["restored"]["turn_ttft_ms"] = med([r["ttft_ms"] for r in b])
    s["restored"]["second_turn_ttft_ms"] = med([r["second_turn"]["ttft_ms"] for r in b])
    parts = ("read_and_checksum", "decode_pictures", "binding", "state_seq_set_data")
    s["restored"]["load_parts_ms"] = {p: med([r["restore"]["ms"].get(p, 0.0) for r in b]) for p in parts}
    for w in WAYS:
        s[w]["render_ms"] = med([r["turn_parts"]["ms"].get("render", 0.0) for r in runs[w]])
    s["resent_over_restored"] = round(s["resent"]["ttft_ms"] / s["restored"]["ttft_ms"], 2)
    s["restored_over_same_process"] = round(s["restored"]["ttft_ms"] / s["same_process"]["ttft_ms"], 2)
    # each (b) beside the (a) of its run: drift and other processes' load hit both alike
    s["restored_over_same_process_paired"] = [
        round(y["ttft_total_ms"] / x["ttft_total_ms"], 2) for x, y in zip(a, b, strict=True)
    ]
    s["resent_over_restored_wall"] = round(
        s["resent"]["process_to_first_token_ms"] / s["restored"]["process_to_first_token_ms"], 2
    )
    s["targets"] = {
        f"restored_ge_{FASTER_THAN_RESENT:g}x_faster_than_resent": s["resent_over_restored"] >= FASTER_THAN_RESENT,
        f"restored_within_{WITHIN_SAME_PROCESS:g}x_of_same_process": s["restored_over_same_process"]
        <= WITHIN_SAME_PROCESS,
    }
    s["same_reply_as_same_process"] = {
        w: sum(x["reply"] == y["reply"] for x, y in zip(a, runs[w], strict=False)) for w in ("restored", "resent")
    }
    return s


@contextmanager
def workdir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="bench_restore.") as tmp:
        yield Path(tmp)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--family", default="llava15")
    ap.add_argument("--preset", default="real")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv", nargs="+", default=["f16", "q8_0"], help="KV cache types, each measured in turn")
    ap.add_argument("--runs", type=int, default=5, help="runs of (a) and (b)")
    ap.add_argument("--resent-runs", type=int, default=3, help="how many of them run (c) too")
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--history-reply", type=int, default=48, help="tokens per answer in the history (3 turns)")
    ap.add_argument("--reply-tokens", type=int, default=8, help="tokens of the follow-up's answer")
    ap.add_argument("--threads", type=int, default=max(1, min(os.cpu_count() or 1, 8)))
    ap.add_argument("--out", help="the JSON (default: a new file in docs/results/, scripts/resultfile.py)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(json.loads(args.child))

    from resultfile import Run

    run = Run("bench_restore")
    from rich.console import Console

    from edgevlm_testkit import cached_model_pair

    con = Console(width=max(Console().width, 120))

    def log(msg: str) -> None:
        con.print(f"[dim]{msg}[/dim]")

    pair = cached_model_pair(args.family, args.preset, args.seed)
    by_kv: dict[str, Any] = {}
    with workdir() as tmp:
        pictures = make_pictures(tmp)
        refusal = None
        for kv in args.kv:
            by_kv[kv] = one_kv(kv, pair, pictures, args, tmp, log)
            if refusal is None:  # the file just used, asked with another KV type
                other = next(k for k in ("q8_0", "f16") if k != kv)
                a = [x if x != kv else other for x in by_kv[kv]["cli"]["argv"][1:]]
                refusal = cli(a, tmp)
    result = {
        "config": {
            "family": args.family,
            "preset": args.preset,
            "seed": args.seed,
            "runs": args.runs,
            "resent_runs": min(args.runs, args.resent_runs),
            "n_ctx": args.n_ctx,
            "threads": args.threads,
            "history_reply": args.history_reply,
            "reply_tokens": args.reply_tokens,
            "pictures": "3 drawn 640x480 PNGs, one per history turn",
            "turns": list(TURNS),
            "questions": [question(i) for i in range(args.runs)],
            "targets": {
                "resent_over_restored_ge": FASTER_THAN_RESENT,
                "restored_over_same_process_le": WITHIN_SAME_PROCESS,
            },
        },
        "by_kv": by_kv,
        "refusal": refusal,
    }
    path = run.save(result, args.out)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from render_restore import tables

    con.print(tables({"result": result}))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
