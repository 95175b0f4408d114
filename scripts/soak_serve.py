#!/usr/bin/env python3
"""Soak ``edgevlm serve``: many clients, random requests, faults on purpose — does every request
get an answer, does the server stay up, and does its memory stay within what it planned?

    python scripts/soak_serve.py                                  # 16 clients × 50 requests
    python scripts/soak_serve.py --clients 4 --requests 10 --family gemma3
    python scripts/soak_serve.py --server-arg=--parallel --server-arg=2 --json out.json

The script starts ``edgevlm serve`` on a free port of 127.0.0.1 (a generated tiny pair, or
``--model``/``--mmproj``), waits for ``/health``, and runs ``--clients`` threads of
``--requests`` requests each, drawn with ``--seed``:

- ``chat``: 0–2 pictures (32 px up to 6000×4000, JPEG or PNG, from a pool made at start),
  random ``max_tokens`` and temperature; ``stream``: the same, streamed to the end;
- ``disconnect``: a stream the client drops after a few chunks;
- ``huge``: one 6000×4000 or 4000×6000 photo; ``tiny``: a 32×32 one;
- ``malformed``: a broken body (not JSON, wrong types, bad base64, not an image, a field the
  server does not support, an empty body) — each must be a 4xx (or a 503 when the server is
  too busy to read it).

While it runs, a thread samples the server's RSS every 20 ms. At the end it checks that no
sequence or queue place is left taken, and prints the status counts per kind, latency, hangs
(no answer within ``--request-timeout``), and the peak RSS against what ``/status`` says the
server planned for the host (its buffers, the process reserve and the allowance for requests).

Exits 1 on any 5xx other than 503, a hang, a dead server, a leaked slot, or a peak RSS over
the planned limit (``--rss-slack`` allows a share over it; 0 by default); the loop is bounded by
``--requests`` and ``--max-seconds``. The JSON (``--json``) names the machine and the commit.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx
import numpy as np
import psutil
from PIL import Image, ImageDraw

from edgevlm_testkit.peers import machine

KINDS = {"chat": 0.45, "stream": 0.2, "disconnect": 0.1, "huge": 0.08, "tiny": 0.05, "malformed": 0.12}


# --- pictures --------------------------------------------------------------------------------
def picture(w: int, h: int, seed: int, fmt: str) -> bytes:
    """A photo-like picture (gradient, shapes, mild noise) encoded as JPEG or PNG."""
    rng = np.random.default_rng(seed)
    sw, sh = max(2, w // 8), max(2, h // 8)  # draw small, scale up: cheap even at 24 MP
    y, x = np.mgrid[0:sh, 0:sw]
    c = rng.integers(0, 255, 3)
    arr = np.stack([(x * 255 // sw + c[0]) % 256, (y * 255 // sh + c[1]) % 256, np.full_like(x, c[2])], axis=-1).astype(
        np.uint8
    )
    img = Image.fromarray(arr)
    draw = ImageDraw.Draw(img)
    for _ in range(5):
        x0, y0 = int(rng.integers(0, sw)), int(rng.integers(0, sh))
        box = [x0, y0, x0 + int(rng.integers(1, sw // 2 + 2)), y0 + int(rng.integers(1, sh // 2 + 2))]
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)(
            box, fill=tuple(int(v) for v in rng.integers(0, 255, 3))
        )
    img = img.resize((w, h), Image.Resampling.BILINEAR)
    noise = rng.integers(-6, 7, (h, w, 1), dtype=np.int16)
    img = Image.fromarray(np.clip(np.asarray(img, np.int16) + noise, 0, 255).astype(np.uint8))
    buf = io.BytesIO()
    img.save(buf, "JPEG", quality=85) if fmt == "jpeg" else img.save(buf, "PNG")
    return buf.getvalue()


def data_uri(data: bytes, fmt: str) -> str:
    return f"data:image/{fmt};base64," + base64.b64encode(data).decode()


def picture_pool(n: int, seed: int) -> dict[str, list[str]]:
    """Data URIs: ``any`` (sizes log-uniform from 32 px to 6000 px on the long side), ``huge``
    (6000×4000 both ways) and ``tiny`` (32×32)."""
    rng = random.Random(seed)
    pool: dict[str, list[str]] = {"any": [], "huge": [], "tiny": []}
    for i in range(n):
        long = int(round(32 * (6000 / 32) ** rng.random()))
        short = max(32, int(long * rng.uniform(0.5, 1.0)))
        w, h = (long, short) if rng.random() < 0.5 else (short, long)
        fmt = "png" if w * h < 600_000 and rng.random() < 0.5 else "jpeg"
        pool["any"].append(data_uri(picture(w, h, seed + i, fmt), fmt))
    for i, (w, h) in enumerate([(6000, 4000), (4000, 6000)]):
        pool["huge"].append(data_uri(picture(w, h, seed + 1000 + i, "jpeg"), "jpeg"))
    pool["tiny"].append(data_uri(picture(32, 32, seed + 2000, "png"), "png"))
    pool["any"] += pool["huge"] + pool["tiny"]
    return pool


# --- requests --------------------------------------------------------------------------------
def user(text: str, urls: list[str]) -> dict:
    return {
        "role": "user",
        "content": [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls],
    }


def malformed(rng: random.Random, pool: dict[str, list[str]]) -> tuple[str, bytes]:
    ok = {"model": "m", "messages": [user("Hi", [])], "max_tokens": 4}
    cases = [
        ("not json", b"{not json"),
        ("empty body", b""),
        ("messages not a list", json.dumps({"messages": "hi"}).encode()),
        ("temperature 9", json.dumps({**ok, "temperature": 9}).encode()),
        ("bad base64", json.dumps({**ok, "messages": [user("x", ["data:image/png;base64,@@@@"])]}).encode()),
        ("not an image", json.dumps({**ok, "messages": [user("x", ["data:text/plain;base64,aGVsbG8="])]}).encode()),
        (
            "truncated image",
            json.dumps({**ok, "messages": [user("x", [pool["any"][0][: len(pool["any"][0]) // 2 // 4 * 4]])]}).encode(),
        ),
        (  # (tools are answered since the server speaks tool calls: the deprecated 'functions' is not)
            "functions",
            json.dumps({**ok, "functions": [{"name": "f", "parameters": {}}]}).encode(),
        ),
        ("logprobs", json.dumps({**ok, "logprobs": True}).encode()),
        ("role tool", json.dumps({**ok, "messages": [{"role": "tool", "content": "x"}]}).encode()),
        ("max_tokens 0", json.dumps({**ok, "max_tokens": 0}).encode()),
    ]
    return rng.choice(cases)


@dataclass
class Outcome:
    kind: str
    status: int | str  # HTTP status, or "hang" / "conn-error"
    seconds: float
    detail: str = ""


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, o: Outcome) -> None:
        with self.lock:
            self.outcomes.append(o)


def one_request(
    http: httpx.Client, url: str, kind: str, rng: random.Random, pool: dict[str, list[str]], timeout: float
) -> Outcome:
    t0 = time.monotonic()
    body: dict[str, Any] = {"model": "m", "max_tokens": rng.randint(1, 96), "temperature": rng.choice([0, 0.7, 1.0])}
    if kind == "huge":
        pics = [rng.choice(pool["huge"])]
    elif kind == "tiny":
        pics = [pool["tiny"][0]]
    else:
        pics = rng.sample(pool["any"], rng.choice([0, 1, 1, 2]))
    body["messages"] = [user(rng.choice(["Describe it.", "What is in the picture?", "Hi", "Count things."]), pics)]
    try:
        if kind == "malformed":
            name, raw = malformed(rng, pool)
            r = http.post(url, content=raw, headers={"content-type": "application/json"}, timeout=timeout)
            return Outcome(kind, r.status_code, time.monotonic() - t0, name)
        if kind in ("stream", "disconnect"):
            body["stream"] = True
            drop_after = rng.randint(1, 5) if kind == "disconnect" else None
            with http.stream("POST", url, json=body, timeout=timeout) as resp:
                if resp.status_code != 200:
                    resp.read()
                    return Outcome(kind, resp.status_code, time.monotonic() - t0, resp.text[:200])
                n, error = 0, ""
                for line in resp.iter_lines():
                    if line.startswith("data: {"):
                        n += 1
                        if '"error"' in line[:20]:
                            error = line[:200]
                    if drop_after is not None and n >= drop_after:
                        break  # leaving the with-block closes the connection mid-stream
                    if time.monotonic() - t0 > timeout:
                        return Outcome(kind, "hang", time.monotonic() - t0, "stream stalled")
            # an error event inside a 200 stream is the server's failure: report it as a 500
            return Outcome(kind, 500 if error else 200, time.monotonic() - t0, error)
        r = http.post(url, json=body, timeout=timeout)
        return Outcome(kind, r.status_code, time.monotonic() - t0, "" if r.status_code == 200 else r.text[:200])
    except httpx.TimeoutException:
        return Outcome(kind, "hang", time.monotonic() - t0, "no answer in time")
    except httpx.HTTPError as exc:
        return Outcome(kind, "conn-error", time.monotonic() - t0, f"{type(exc).__name__}: {exc}")


def client_loop(i: int, args, url: str, pool, tally: Tally, stop_at: float) -> None:
    rng = random.Random(args.seed * 1000 + i)
    kinds, weights = zip(*KINDS.items(), strict=True)
    with httpx.Client() as http:
        for _ in range(args.requests):
            if time.monotonic() > stop_at:
                return
            kind = rng.choices(kinds, weights)[0]
            tally.add(one_request(http, url, kind, rng, pool, args.request_timeout))


# --- the server ------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RssSampler(threading.Thread):
    def __init__(self, pid: int, every: float = 0.02):
        super().__init__(daemon=True)
        self.proc = psutil.Process(pid)
        self.every = every
        self.peak = 0
        self.samples = 0
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                rss = self.proc.memory_info().rss
            except psutil.Error:
                return
            self.peak = max(self.peak, rss)
            self.samples += 1
            self.stop_event.wait(self.every)


def start_server(args) -> tuple[subprocess.Popen, str]:
    if args.model:
        model, mmproj = args.model, args.mmproj
    else:
        from edgevlm_testkit import cached_model_pair

        pair = cached_model_pair(args.family, "tiny", 0)
        model, mmproj = str(pair.model), str(pair.mmproj)
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "edgevlm",
        "serve",
        "-m",
        model,
        "--mmproj",
        mmproj,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--threads",
        str(args.threads),
        "--ctx",
        str(args.ctx),
        "--timeout",
        str(args.server_timeout),
        *args.server_arg,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=open(args.server_log, "w"), text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited at start: {Path(args.server_log).read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not become ready in 180 s")


def host_limit(status: dict) -> dict[str, Any]:
    """What the server planned for host memory, from ``/status`` (older servers state only
    their buffers)."""
    mem = status.get("memory", {})
    host = mem.get("host")
    if host:
        return {
            "buffers": host["buffers_bytes"],
            "image_cache": host["image_cache_bytes"],
            "process": host["process_reserve_bytes"],
            "allowance": host["allowance_bytes"],
            "kv_cache": host.get("kv_cache_bytes", 0),
            "limit": host["limit_bytes"],
        }
    predicted = mem.get("predicted", {})
    cpu = next((v for k, v in predicted.items() if k.lower().startswith("cpu")), 0)
    return {"buffers": cpu, "image_cache": None, "process": None, "allowance": None, "kv_cache": None, "limit": None}


def commit() -> str:
    """The commit the server ran (and whether the tree had changes)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True).stdout
    except OSError:
        return ""
    return head + ("-dirty" if dirty.strip() else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--requests", type=int, default=50, help="per client")
    ap.add_argument("--family", default="llava15", help="generated tiny pair (without --model)")
    ap.add_argument("--model")
    ap.add_argument("--mmproj")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--server-arg", action="append", default=[], help="passed to edgevlm serve (repeatable)")
    ap.add_argument("--server-timeout", type=float, default=120, help="the server's --timeout")
    ap.add_argument("--request-timeout", type=float, default=240, help="a request without an answer by then hangs")
    ap.add_argument("--max-seconds", type=float, default=1800, help="no new request after this")
    ap.add_argument("--pictures", type=int, default=24, help="pictures in the pool")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-log", default="soak-server.log")
    ap.add_argument("--json", help="the JSON (default: a new file in docs/results/, scripts/resultfile.py)")
    ap.add_argument("--rss-slack", type=float, default=0.0, help="share the peak RSS may exceed the plan by")
    args = ap.parse_args()

    from resultfile import Run

    run = Run("soak_serve")

    t0 = time.monotonic()
    pool = picture_pool(args.pictures, args.seed)
    made = time.monotonic() - t0
    proc, url = start_server(args)
    sampler = RssSampler(proc.pid)
    sampler.start()
    tally = Tally()
    status0 = httpx.get(url + "/status", timeout=10).json()
    rss_ready = psutil.Process(proc.pid).memory_info().rss
    stop_at = time.monotonic() + args.max_seconds
    threads = [
        threading.Thread(target=client_loop, args=(i, args, url + "/v1/chat/completions", pool, tally, stop_at))
        for i in range(args.clients)
    ]
    t1 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(args.max_seconds + args.request_timeout + 60)
    wall = time.monotonic() - t1
    alive = proc.poll() is None
    leaked = None
    status1: dict = {}
    if alive:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                status1 = httpx.get(url + "/status", timeout=10).json()
            except httpx.HTTPError:
                alive = False
                break
            leaked = status1["slots"]["busy"] + status1["queue"]["waiting"]
            if not leaked:
                break
            time.sleep(0.2)
        alive = alive and proc.poll() is None
    sampler.stop_event.set()
    sampler.join(2)
    proc.terminate()
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        proc.kill()

    # --- the table ---------------------------------------------------------------------------
    from rich.console import Console
    from rich.table import Table

    by_kind: dict[str, Counter] = defaultdict(Counter)
    secs: dict[str, list[float]] = defaultdict(list)
    for o in tally.outcomes:
        by_kind[o.kind][str(o.status)] += 1
        secs[o.kind].append(o.seconds)
    statuses = sorted({str(o.status) for o in tally.outcomes})
    table = Table(
        title=f"edgevlm serve soak: {args.clients} clients × {args.requests} requests, "
        f"{args.family if not args.model else Path(args.model).name}, ctx {args.ctx}"
    )
    table.add_column("kind")
    for s in statuses:
        table.add_column(s, justify="right")
    table.add_column("p50 s", justify="right")
    table.add_column("p95 s", justify="right")
    for kind in KINDS:
        if kind not in by_kind:
            continue
        ss = sorted(secs[kind])
        table.add_row(
            kind,
            *[str(by_kind[kind].get(s, 0)) for s in statuses],
            f"{statistics.median(ss):.2f}",
            f"{ss[min(len(ss) - 1, int(len(ss) * 0.95))]:.2f}",
        )
    total = Counter(str(o.status) for o in tally.outcomes)
    table.add_row("all", *[str(total.get(s, 0)) for s in statuses], "", "")
    console = Console(width=110)
    console.print(table)

    bad5xx = [o for o in tally.outcomes if isinstance(o.status, int) and o.status >= 500 and o.status != 503]
    hangs = [o for o in tally.outcomes if o.status == "hang"]
    conn = [o for o in tally.outcomes if o.status == "conn-error"]
    # a broken body is a 4xx — or a 503 when the server is too busy to read it
    wrong4xx = [
        o
        for o in tally.outcomes
        if o.kind == "malformed" and not (isinstance(o.status, int) and (400 <= o.status < 500 or o.status == 503))
    ]
    host = host_limit(status0)
    limit = host["limit"]
    mib = 2**20
    console.print(
        f"peak RSS {sampler.peak / mib:,.1f} MiB ({sampler.samples} samples; {rss_ready / mib:,.1f} MiB when ready)"
    )
    if limit:
        console.print(
            f"planned for the host: buffers {host['buffers'] / mib:,.1f} MiB + image cache "
            f"{host['image_cache'] / mib:,.1f} MiB + process {host['process'] / mib:,.1f} MiB + allowance for "
            f"requests {host['allowance'] / mib:,.1f} MiB + host KV cache {host['kv_cache'] / mib:,.1f} MiB = "
            f"{limit / mib:,.1f} MiB; "
            f"peak / planned = {sampler.peak / limit:.2f}"
        )
    else:
        console.print(
            f"planned for the host: buffers {host['buffers'] / mib:,.1f} MiB (the server states no "
            f"allowance for requests); peak / planned = {sampler.peak / max(host['buffers'], 1):.1f}"
        )
    held = status1.get("memory", {}).get("host", {}) if status1 else {}
    if held:
        console.print(
            f"requests held at most {held['peak_in_use_bytes'] / mib:,.1f} MiB of the allowance "
            f"({held['waits']} waited for it, {held['refused']} refused with 503); "
            f"RSS after the run {held['rss_bytes'] / mib:,.1f} MiB"
        )
    over_rss = limit is None or sampler.peak > limit * (1 + args.rss_slack)
    console.print(
        f"{len(tally.outcomes)} requests in {wall:.0f} s (pictures made in {made:.0f} s); "
        f"5xx other than 503: {len(bad5xx)}; hangs: {len(hangs)}; connection errors: {len(conn)}; "
        f"malformed not 4xx/503: {len(wrong4xx)}; server alive: {alive}; slots/queue left taken: {leaked}"
    )
    for o in (bad5xx + hangs + conn + wrong4xx)[:10]:
        console.print(f"  {o.kind} {o.status} after {o.seconds:.1f} s: {o.detail}")
    failed = bool(bad5xx or hangs or conn or wrong4xx or not alive or leaked or over_rss)
    out = run.save(
        {
            "machine": machine(),
            "commit": commit(),
            "args": vars(args),
            "wall_s": round(wall, 1),
            "counts": {k: dict(v) for k, v in by_kind.items()},
            "seconds": {  # per kind, as the table shows them
                k: {"p50": statistics.median(v), "p95": sorted(v)[min(len(v) - 1, int(len(v) * 0.95))]}
                for k, v in secs.items()
                if v
            },
            "host_held": held,
            "rss_samples": sampler.samples,
            "total": dict(total),
            "bad_5xx": len(bad5xx),
            "hangs": len(hangs),
            "connection_errors": len(conn),
            "malformed_not_4xx": len(wrong4xx),
            "alive": alive,
            "leaked": leaked,
            "peak_rss_bytes": sampler.peak,
            "rss_ready_bytes": rss_ready,
            "host_plan": host,
            "rss_within_plan": not over_rss,
            "failed": failed,
            "examples": [vars(o) for o in (bad5xx + hangs + conn + wrong4xx)[:20]],
        },
        args.json,
    )
    console.print(f"JSON: {out}")
    console.print("FAIL" if failed else "PASS")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
