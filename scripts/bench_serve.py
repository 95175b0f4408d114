#!/usr/bin/env python3
"""Benchmark ``edgevlm serve`` against ``llama-server`` and ``python -m llama_cpp.server``, side by
side in one run, on the same model pair, context, threads and parallelism.

    python scripts/bench_serve.py                                   # everything (about an hour)
    python scripts/bench_serve.py --clients 1,4,8 --servers edgevlm,llama-server
    python scripts/bench_serve.py --skip-chats --decode-streams 1,8,32   # tiny-pair decode only

``llama-server`` is built once from the sdist of the pinned llama-cpp-python (the llama.cpp it
vendors: the same kernels as ours) into ``~/.cache/edgevlm/llama-server/VERSION/build`` with
cmake, or taken from ``--llama-server PATH`` (``scripts/peer_servers.py``). ``llama_cpp.server`` needs the
``llama-cpp-python[server]`` extra (``pip install -e '.[bench]'``); a server that cannot start is
reported, not fatal.

Two workloads, each server started fresh on 127.0.0.1 for each:

- **chats** (LLaVA-1.5-7B-shaped pair, ``--preset real``): N clients (``--clients``), each a
  3-turn chat about its own 640×488 photo (``--shared-picture``: the same one for all), history
  resent every turn, ``--tokens``-token replies, streamed. Requests/s over the run, TTFT p50/p95
  per turn, and the p95 of the intervals between a running stream's tokens while another
  client's new picture is being evaluated (its turn 1 between sending and its first token),
  beside the same p95 without one.
- **decode** (tiny pair): S streams (``--decode-streams``) of ``--decode-tokens`` greedy tokens
  each, text only: generated tokens/s.

For every server and run, the CPU time (user + system) of the server process and all its
children, read just before the workload starts and just after it ends (the server still up):
``cpu_s`` and ``cpu_s_per_request`` in the chats rows, ``cpu_s_per_1k_tokens`` in the decode rows.
``--profile latency|throughput`` is passed on as ``edgevlm serve --profile`` (not passed when not
given: the server's default).

Prints a table per workload and writes JSON (``--json``). Every run is bounded by
``--max-seconds``; requests time out after ``--request-timeout``.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx
import numpy as np
from peer_servers import DEFAULT_CACHE, EXTRA_BUFFERS, Server, find_llama_server, free_port, launch, llama_server_cmd
from PIL import Image, ImageDraw

from edgevlm_testkit import cached_model_pair

SERVERS = ("edgevlm", "llama-server", "llama-cpp-python")
PROMPTS = ["What is in this picture?", "What colours does it have?", "Describe it in one sentence."]
# llama-cpp-python's server gets the model parameter that drops the CPU's extra buffer types where
# edgevlm and llama-server load without them (peer_servers.EXTRA_BUFFERS; it has no flag for it).
LLAMA_CPP_SERVER = """
import runpy, sys
from edgevlm_testkit.peers import same_kernels
same_kernels()
sys.argv = ["llama_cpp.server", *sys.argv[1:]]
runpy.run_module("llama_cpp.server", run_name="__main__")
"""


# --- the servers -----------------------------------------------------------------------------
def start(
    name: str, model: Path, mmproj: Path, args, parallel: int, ctx: int, logdir: Path, llama_server: Path | str
) -> Server | str:
    """A server on a free port of 127.0.0.1, ready (/health) — or why it could not start."""
    port = free_port()
    t = str(args.threads)
    if name == "edgevlm":
        cmd = [sys.executable, "-m", "edgevlm", "serve", "-m", str(model), "--mmproj", str(mmproj)]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--ctx", str(ctx), "--parallel", str(parallel)]
        cmd += ["--threads", t, "--kv", "f16", "--queue", "64", "--max-tokens", str(args.tokens)]
        cmd += ["--profile", args.profile] if args.profile else []  # only when asked: older serves lack it
    elif name == "llama-server":
        if isinstance(llama_server, str):
            return llama_server
        cmd = llama_server_cmd(llama_server, model, mmproj, port, parallel, ctx, args.threads)
    else:
        try:
            import llama_cpp.server  # noqa: F401
        except ImportError:
            return "llama_cpp.server is not installed (pip install -e '.[bench]')"
        cmd = [sys.executable, "-c", LLAMA_CPP_SERVER, "--model", str(model), "--clip_model_path", str(mmproj)]
        cmd += ["--chat_format", "llava-1-5", "--n_ctx", str(ctx), "--n_threads", t, "--n_threads_batch", t]
        cmd += ["--host", "127.0.0.1", "--port", str(port), "--interrupt_requests", "False", "--flash_attn", "True"]
    return launch(name, cmd, port, logdir, "/health" if name != "llama-cpp-python" else "/v1/models")


# --- one streamed request --------------------------------------------------------------------
@dataclass
class Reply:
    client: int
    turn: int
    sent: float
    first: float | None = None  # first token
    times: list[float] = field(default_factory=list)  # every content chunk
    text: str = ""
    tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent


def ask(
    http: httpx.Client, url: str, messages: list[dict], max_tokens: int, client: int, turn: int, timeout: float
) -> Reply:
    r = Reply(client, turn, time.monotonic())
    body = {
        "model": "m",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    try:
        # a connection per request (Connection: close): llama-server's HTTP layer closes kept-alive
        # connections while a client is about to reuse them ("Server disconnected without sending a
        # response" on a POST, which httpx must not retry); every server gets the same treatment
        with http.stream(
            "POST", url + "/v1/chat/completions", json=body, timeout=timeout, headers={"Connection": "close"}
        ) as resp:
            if resp.status_code != 200:
                resp.read()
                r.error = f"HTTP {resp.status_code}: {resp.text[:160]}"
                return r
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                d = json.loads(line[6:])
                if d.get("usage"):
                    r.tokens = d["usage"].get("completion_tokens", r.tokens)
                for ch in d.get("choices") or []:
                    piece = (ch.get("delta") or {}).get("content")
                    if piece:
                        now = time.monotonic()
                        r.first = r.first or now
                        r.times.append(now)
                        r.text += piece
    except httpx.HTTPError as exc:
        r.error = f"{type(exc).__name__}: {exc}"
    r.tokens = r.tokens or len(r.times)
    return r


# --- workloads -------------------------------------------------------------------------------
def photo(seed: int, w: int = 640, h: int = 488) -> str:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    c = rng.integers(0, 255, 3)
    arr = np.stack([(x * 255 // w + c[0]) % 256, (y * 255 // h + c[1]) % 256, np.full_like(x, c[2])], -1).astype(
        np.uint8
    )
    img = Image.fromarray(arr)
    draw = ImageDraw.Draw(img)
    for _ in range(6):
        x0, y0 = int(rng.integers(0, w - 60)), int(rng.integers(0, h - 60))
        draw.ellipse(
            [x0, y0, x0 + int(rng.integers(30, w // 3)), y0 + int(rng.integers(30, h // 3))],
            fill=tuple(int(v) for v in rng.integers(0, 255, 3)),
        )
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=90)
    import base64

    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def chats(url: str, clients: int, args, shared: bool) -> dict[str, Any]:
    """``clients`` 3-turn chats at once; what they measured."""
    replies: list[Reply] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + args.max_seconds

    def one(i: int) -> None:
        pic = photo(0 if shared else 100 + i)
        history = [
            {
                "role": "user",
                "content": [{"type": "text", "text": PROMPTS[0]}, {"type": "image_url", "image_url": {"url": pic}}],
            }
        ]
        with httpx.Client() as http:
            for turn in range(args.turns):
                if time.monotonic() > stop_at:
                    return
                r = ask(http, url, history, args.tokens, i, turn + 1, args.request_timeout)
                with lock:
                    replies.append(r)
                if r.error:
                    return
                history += [
                    {"role": "assistant", "content": r.text},
                    {"role": "user", "content": PROMPTS[(turn + 1) % len(PROMPTS)]},
                ]

    t0 = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
        time.sleep(0.05)  # the clients arrive one after another, as users do
    for t in threads:
        t.join(args.max_seconds + args.request_timeout)
    wall = time.monotonic() - t0
    ok = [r for r in replies if not r.error]
    out: dict[str, Any] = {
        "clients": clients,
        "requests": len(ok),
        "errors": len(replies) - len(ok),
        "wall_s": round(wall, 2),
        "req_per_s": round(len(ok) / wall, 3) if wall else 0.0,
        "error_examples": [r.error for r in replies if r.error][:3],
    }
    for turn in range(1, args.turns + 1):
        tt = sorted(r.ttft for r in ok if r.turn == turn and r.ttft is not None)
        out[f"ttft_p50_turn{turn}"] = round(statistics.median(tt), 3) if tt else None
        out[f"ttft_p95_turn{turn}"] = round(tt[min(len(tt) - 1, int(len(tt) * 0.95))], 3) if tt else None
    # intervals between a stream's tokens, during and outside another client's picture prefill
    admitting = [(r.sent, r.first or r.sent) for r in ok if r.turn == 1]
    during, outside = [], []
    for r in ok:
        for a, b in zip(r.times, r.times[1:], strict=False):
            busy = any(s < b and f > a for s, f in admitting if s != r.sent)
            (during if busy else outside).append(b - a)
    out["itl_p95_admitting_ms"] = round(float(np.percentile(during, 95)) * 1000, 1) if during else None
    out["itl_p95_ms"] = round(float(np.percentile(outside, 95)) * 1000, 1) if outside else None
    return out


def decode(url: str, streams: int, args) -> dict[str, Any]:
    replies: list[Reply] = []
    lock = threading.Lock()

    def one(i: int) -> None:
        with httpx.Client() as http:
            r = ask(
                http,
                url,
                [{"role": "user", "content": f"Stream {i}: write a long story about the sea."}],
                args.decode_tokens,
                i,
                1,
                args.request_timeout,
            )
            with lock:
                replies.append(r)

    t0 = time.monotonic()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(args.max_seconds)
    wall = time.monotonic() - t0
    ok = [r for r in replies if not r.error]
    gen = sum(r.tokens for r in ok)
    # generation only: from the first token of the first stream to the last token of the last
    starts = [r.first for r in ok if r.first]
    ends = [r.times[-1] for r in ok if r.times]
    span = (max(ends) - min(starts)) if starts and ends else wall
    return {
        "streams": streams,
        "tokens": gen,
        "mean_tokens": round(gen / max(1, len(ok)), 1),
        "errors": len(replies) - len(ok),
        "wall_s": round(wall, 2),
        "tok_per_s": round(gen / span, 1) if span > 0 else 0.0,
    }


# --- the run ---------------------------------------------------------------------------------
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument("--clients", default="1,2,4,8,16")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=16, help="reply length in the chats")
    ap.add_argument("--ctx", type=int, default=8192)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--family", default="llava15")
    ap.add_argument("--preset", default="real", help="the chats' pair (the decode test uses tiny)")
    ap.add_argument("--model")
    ap.add_argument("--mmproj")
    ap.add_argument("--shared-picture", action="store_true", help="also run the chats with one picture for all")
    ap.add_argument("--skip-chats", action="store_true")
    ap.add_argument("--decode-streams", default="1,8,32")
    ap.add_argument("--decode-tokens", type=int, default=256)
    ap.add_argument("--decode-ctx", type=int, default=16384)
    ap.add_argument(
        "--profile",
        choices=["latency", "throughput"],
        help="edgevlm serve --profile (scheduler profile; not passed unless given: serve's default, latency)",
    )
    ap.add_argument("--llama-server", type=Path, help="a llama-server binary (else built from the sdist)")
    ap.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where llama-server is built")
    ap.add_argument("--max-seconds", type=float, default=600, help="bound of one run (one server, one count)")
    ap.add_argument("--request-timeout", type=float, default=300)
    ap.add_argument("--json", help="the JSON (default: a new file in docs/results/, scripts/resultfile.py)")
    args = ap.parse_args()

    from resultfile import Run

    # the file's name says what sets the run apart: a shared-picture table, a profile asked for
    run = Run("bench_serve", "-".join(t for t in ("shared" if args.shared_picture else "", args.profile or "") if t))

    servers = [s for s in args.servers.split(",") if s]
    llama_server: Path | str = "not asked for"
    if "llama-server" in servers:
        llama_server = find_llama_server(args.llama_server, args.cache)
    logdir = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    kernels = (
        "with the CPU's extra buffer types"
        if EXTRA_BUFFERS
        else ("without the CPU's extra buffer types (this CPU's AMX build segfaults with them)")
    )
    results: dict[str, Any] = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "chats": [],
        "decode": [],
        "notes": [f"every server loads {kernels}"],
    }
    if args.model:
        chat_pair = (Path(args.model), Path(args.mmproj))
    else:
        p = cached_model_pair(args.family, args.preset, 0)
        chat_pair = (p.model, p.mmproj)
    tiny = cached_model_pair(args.family, "tiny", 0)

    variants = [False] + ([True] if args.shared_picture else [])
    if not args.skip_chats:
        for shared in variants:
            for n in [int(x) for x in args.clients.split(",") if x]:
                for name in servers:
                    srv = start(name, *chat_pair, args, args.parallel, args.ctx, logdir, llama_server)
                    if isinstance(srv, str):
                        results["notes"].append(f"{name}: {srv}")
                        print(f"{name}: {srv}", file=sys.stderr)
                        continue
                    try:
                        cpu0 = srv.cpu_s()
                        row = {"server": name, "shared_picture": shared, **chats(srv.url, n, args, shared)}
                        row["cpu_s"] = round(srv.cpu_s() - cpu0, 3)  # before it stops: the workload's alone
                    finally:
                        srv.stop()
                    row["cpu_s_per_request"] = round(row["cpu_s"] / row["requests"], 4) if row["requests"] else None
                    results["chats"].append(row)
                    out = run.save(results, args.json)  # kept if the run is cut short
                    print(json.dumps(row), file=sys.stderr)
    for s in [int(x) for x in args.decode_streams.split(",") if x]:
        for name in servers:
            srv = start(name, tiny.model, tiny.mmproj, args, s, args.decode_ctx, logdir, llama_server)
            if isinstance(srv, str):
                results["notes"].append(f"{name} (decode): {srv}")
                continue
            try:
                decode(srv.url, min(2, s), args)  # warm-up
                cpu0 = srv.cpu_s()
                row = {"server": name, **decode(srv.url, s, args)}
                row["cpu_s"] = round(srv.cpu_s() - cpu0, 3)
            finally:
                srv.stop()
            row["cpu_s_per_1k_tokens"] = round(1000 * row["cpu_s"] / row["tokens"], 3) if row["tokens"] else None
            results["decode"].append(row)
            out = run.save(results, args.json)
            print(json.dumps(row), file=sys.stderr)
    out = run.save(results, args.json)
    report(results, servers)
    print(f"JSON: {out}; server logs: {logdir}")


def _cpu(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}" if x >= 0.1 else f"{x:.3f}"


def _times(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}×" if a and b else "—"


def report(results: dict[str, Any], servers: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=140)
    for shared in (False, True):
        rows = [r for r in results["chats"] if r["shared_picture"] == shared]
        if not rows:
            continue
        t = Table(
            title=f"3-turn chats, {'one picture for all' if shared else 'a picture per conversation'}: "
            f"req/s, turn-3 TTFT p50, ITL p95 (beside a new picture / without)"
        )
        t.add_column("clients", justify="right")
        for s in servers:
            t.add_column(f"{s} req/s", justify="right")
        t.add_column("edgevlm ÷ llama-server", justify="right")
        for s in servers:
            t.add_column(f"{s} TTFT3", justify="right")
        t.add_column("edgevlm ITL p95 ms", justify="right")
        for s in servers:
            t.add_column(f"{s} CPU-s/req", justify="right")
        t.add_column("edgevlm ÷ llama-server CPU", justify="right")
        by = {(r["server"], r["clients"]): r for r in rows}
        for n in sorted({r["clients"] for r in rows}):
            e, ls = by.get(("edgevlm", n)), by.get(("llama-server", n))
            ratio = f"{e['req_per_s'] / ls['req_per_s']:.2f}×" if e and ls and ls["req_per_s"] else "—"
            itl = f"{e['itl_p95_admitting_ms']} / {e['itl_p95_ms']}" if e else "—"
            cpu = {s: (by.get((s, n)) or {}).get("cpu_s_per_request") for s in servers}
            cpu_ratio = _times(cpu.get("edgevlm"), cpu.get("llama-server"))
            t.add_row(
                str(n),
                *[f"{by[(s, n)]['req_per_s']:.2f}" if (s, n) in by else "—" for s in servers],
                ratio,
                *[
                    f"{by[(s, n)]['ttft_p50_turn3']:.2f} s"
                    if (s, n) in by and by[(s, n)].get("ttft_p50_turn3") is not None
                    else "—"
                    for s in servers
                ],
                itl,
                *[_cpu(cpu[s]) for s in servers],
                cpu_ratio,
            )
        console.print(t)
    if results["decode"]:
        t = Table(title="tiny pair, text only: generated tokens/s; CPU seconds per 1,000 tokens")
        t.add_column("streams", justify="right")
        for s in servers:
            t.add_column(s, justify="right")
        t.add_column("edgevlm ÷ llama-server", justify="right")
        for s in servers:
            t.add_column(f"{s} CPU-s/1k tok", justify="right")
        t.add_column("edgevlm ÷ llama-server CPU", justify="right")
        by = {(r["server"], r["streams"]): r for r in results["decode"]}
        for n in sorted({r["streams"] for r in results["decode"]}):
            e, ls = by.get(("edgevlm", n)), by.get(("llama-server", n))
            cpu = {s: (by.get((s, n)) or {}).get("cpu_s_per_1k_tokens") for s in servers}
            t.add_row(
                str(n),
                *[f"{by[(s, n)]['tok_per_s']:,.0f}" if (s, n) in by else "—" for s in servers],
                f"{e['tok_per_s'] / ls['tok_per_s']:.2f}×" if e and ls and ls["tok_per_s"] else "—",
                *[_cpu(cpu[s]) for s in servers],
                _times(cpu.get("edgevlm"), cpu.get("llama-server")),
            )
        console.print(t)
    for n in results["notes"]:
        console.print(f"note: {n}")


if __name__ == "__main__":
    main()
