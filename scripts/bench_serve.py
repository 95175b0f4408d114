#!/usr/bin/env python3
"""Benchmark ``edgevlm serve`` against ``llama-server`` and ``python -m llama_cpp.server``, side by
side in one run, on the same model pair, context, threads and parallelism.

    python scripts/bench_serve.py                                   # everything (about an hour)
    python scripts/bench_serve.py --clients 1,4,8 --servers edgevlm,llama-server
    python scripts/bench_serve.py --skip-chats --decode-streams 1,8,32   # tiny-pair decode only

``llama-server`` is built once from the sdist of the pinned llama-cpp-python (the llama.cpp it
vendors: the same kernels as ours) into ``~/.cache/edgevlm/llama-server/VERSION/build`` with
cmake, or taken from ``--llama-server PATH``. ``llama_cpp.server`` needs the
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

Prints a table per workload and writes JSON (``--json``). Every run is bounded by
``--max-seconds``; requests time out after ``--request-timeout``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
import numpy as np
from PIL import Image, ImageDraw

from edgevlm.backend.system import cpu_extra_buffers
from edgevlm_testkit import cached_model_pair

LLAMA_CPP_PYTHON = "0.3.36"  # the pinned version whose vendored llama.cpp llama-server is built from
SERVERS = ("edgevlm", "llama-server", "llama-cpp-python")
PROMPTS = ["What is in this picture?", "What colours does it have?", "Describe it in one sentence."]
# The same kernels on every side: where edgevlm loads without the CPU's extra buffer types (an AMX
# build, whose matmul segfaults in this llama.cpp: docs/install.md), llama-server gets --no-repack
# and llama-cpp-python's server the same model parameter (it has no flag for it).
EXTRA_BUFFERS = cpu_extra_buffers()
LLAMA_CPP_SERVER = """
import runpy, sys
from edgevlm_testkit.peers import same_kernels
same_kernels()
sys.argv = ["llama_cpp.server", *sys.argv[1:]]
runpy.run_module("llama_cpp.server", run_name="__main__")
"""


# --- the servers -----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_llama_server(cache: Path) -> Path:
    """llama-server from the sdist of the pinned llama-cpp-python, built once (static)."""
    build = cache / LLAMA_CPP_PYTHON / "build"
    exe = build / "bin" / "llama-server"
    if exe.exists():
        return exe
    src = Path(tempfile.mkdtemp(prefix="llama-src-"))
    print(
        f"building llama-server from llama-cpp-python {LLAMA_CPP_PYTHON}'s sdist into {build} (once; ~20 min "
        f"on 2 cores)",
        file=sys.stderr,
    )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "-d",
            str(src),
            f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
        ],
        check=True,
    )
    tar = next(src.glob("llama_cpp_python-*.tar.gz"))
    shutil.unpack_archive(tar, src)
    root = next(p for p in src.glob("llama_cpp_python-*") if p.is_dir()) / "vendor" / "llama.cpp"
    subprocess.run(
        [
            "cmake",
            "-S",
            str(root),
            "-B",
            str(build),
            "-DCMAKE_BUILD_TYPE=Release",
            "-DBUILD_SHARED_LIBS=OFF",
            "-DLLAMA_BUILD_SERVER=ON",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_OPENSSL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    subprocess.run(
        ["cmake", "--build", str(build), "--target", "llama-server", "-j", str(os.cpu_count() or 2)],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    shutil.rmtree(src, ignore_errors=True)
    return exe


@dataclass
class Server:
    name: str
    proc: subprocess.Popen
    url: str
    log: Path

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start(
    name: str, model: Path, mmproj: Path, args, parallel: int, ctx: int, logdir: Path, llama_server: Path | None
) -> Server | str:
    """A server on a free port of 127.0.0.1, ready (/health) — or why it could not start."""
    port = free_port()
    t = str(args.threads)
    if name == "edgevlm":
        cmd = [
            sys.executable,
            "-m",
            "edgevlm",
            "serve",
            "-m",
            str(model),
            "--mmproj",
            str(mmproj),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--ctx",
            str(ctx),
            "--parallel",
            str(parallel),
            "--threads",
            t,
            "--kv",
            "f16",
            "--queue",
            "64",
            "--max-tokens",
            str(args.tokens),
        ]
    elif name == "llama-server":
        if llama_server is None:
            return "no llama-server binary"
        cmd = [
            str(llama_server),
            "-m",
            str(model),
            "--mmproj",
            str(mmproj),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-np",
            str(parallel),
            "-c",
            str(ctx),
            "-t",
            t,
            "-tb",
            t,
            "-fa",
            "on",
            "--no-webui",
            *([] if EXTRA_BUFFERS else ["--no-repack"]),
        ]
    else:
        try:
            import llama_cpp.server  # noqa: F401
        except ImportError:
            return "llama_cpp.server is not installed (pip install -e '.[bench]')"
        cmd = [
            sys.executable,
            "-c",
            LLAMA_CPP_SERVER,
            "--model",
            str(model),
            "--clip_model_path",
            str(mmproj),
            "--chat_format",
            "llava-1-5",
            "--n_ctx",
            str(ctx),
            "--n_threads",
            t,
            "--n_threads_batch",
            t,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--interrupt_requests",
            "False",
            "--flash_attn",
            "True",
        ]
    log = logdir / f"{name}-{port}.log"
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited at start: {log.read_text()[-400:]}"
        try:
            r = httpx.get(url + ("/health" if name != "llama-cpp-python" else "/v1/models"), timeout=2)
            if r.status_code == 200:
                return Server(name, proc, url, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    return "not ready in 300 s"


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
    ap.add_argument("--llama-server", type=Path, help="a llama-server binary (else built from the sdist)")
    ap.add_argument(
        "--cache",
        type=Path,
        default=Path(os.environ.get("EDGEVLM_CACHE", Path.home() / ".cache" / "edgevlm")) / "llama-server",
    )
    ap.add_argument("--max-seconds", type=float, default=600, help="bound of one run (one server, one count)")
    ap.add_argument("--request-timeout", type=float, default=300)
    ap.add_argument("--json", help="the JSON (default: a new file in docs/results/, scripts/resultfile.py)")
    args = ap.parse_args()

    from resultfile import Run

    run = Run("bench_serve", "shared" if args.shared_picture else "")

    servers = [s for s in args.servers.split(",") if s]
    llama_server = args.llama_server
    if "llama-server" in servers and llama_server is None:
        llama_server = build_llama_server(args.cache)
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
                        row = {"server": name, "shared_picture": shared, **chats(srv.url, n, args, shared)}
                    finally:
                        srv.stop()
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
                row = {"server": name, **decode(srv.url, s, args)}
            finally:
                srv.stop()
            results["decode"].append(row)
            out = run.save(results, args.json)
            print(json.dumps(row), file=sys.stderr)
    out = run.save(results, args.json)
    report(results, servers)
    print(f"JSON: {out}; server logs: {logdir}")


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
        by = {(r["server"], r["clients"]): r for r in rows}
        for n in sorted({r["clients"] for r in rows}):
            e, ls = by.get(("edgevlm", n)), by.get(("llama-server", n))
            ratio = f"{e['req_per_s'] / ls['req_per_s']:.2f}×" if e and ls and ls["req_per_s"] else "—"
            itl = f"{e['itl_p95_admitting_ms']} / {e['itl_p95_ms']}" if e else "—"
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
            )
        console.print(t)
    if results["decode"]:
        t = Table(title="tiny pair, text only: generated tokens/s")
        t.add_column("streams", justify="right")
        for s in servers:
            t.add_column(s, justify="right")
        t.add_column("edgevlm ÷ llama-server", justify="right")
        by = {(r["server"], r["streams"]): r for r in results["decode"]}
        for n in sorted({r["streams"] for r in results["decode"]}):
            e, ls = by.get(("edgevlm", n)), by.get(("llama-server", n))
            t.add_row(
                str(n),
                *[f"{by[(s, n)]['tok_per_s']:,.0f}" if (s, n) in by else "—" for s in servers],
                f"{e['tok_per_s'] / ls['tok_per_s']:.2f}×" if e and ls and ls["tok_per_s"] else "—",
            )
        console.print(t)
    for n in results["notes"]:
        console.print(f"note: {n}")


if __name__ == "__main__":
    main()
