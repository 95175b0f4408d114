#!/usr/bin/env python3
"""A server restarts in the middle of a conversation with pictures: how long the follow-up waits
for its first token.

A conversation of 3 pictures (LLaVA-1.5-7B shapes: 576 tokens each) and their replies, about
2,000 tokens of history, then a short text follow-up, on:

- **edgevlm, no restart**: the follow-up while the conversation is still resident (the best case);
- **edgevlm --cache-dir**: SIGTERM (a graceful stop writes the conversation to disk), a new server
  on the same folder, the follow-up: restored from disk;
- **edgevlm, no disk tier**: the same restart without ``--cache-dir``: the whole history is
  evaluated again, every picture encoded again (today's server, and every server without one);
- **llama-server --slot-save-path**: the conversation, ``POST /slots/0?action=save``, a restart,
  ``action=restore`` (its time counted in the follow-up's), the follow-up — where it works: its
  save serialises the slot's tokens and refuses when they hold pictures (reported as such);
- **llama-server, no restore**: the restart alone, for the same comparison on its side.

TTFT is from sending the follow-up to its first streamed token (a restore's call included).

    python scripts/bench_restart.py                  # LLaVA-1.5-7B shapes, 2 layers ("real")
    python scripts/bench_restart.py --preset tiny    # a quick look
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "testkit"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serve import ask, photo  # noqa: E402
from peer_servers import find_llama_server, free_port, launch, llama_server_cmd  # noqa: E402
from render_restart import SIDES, table  # noqa: E402
from resultfile import Run  # noqa: E402

QUESTIONS = ["What is in this picture?", "And in this one?", "And this last one?"]
FOLLOW_UP = "Which of the three pictures was the brightest?"


def edgevlm_cmd(model: Path, mmproj: Path, port: int, args, cache_dir: Path | None) -> list[str]:
    cmd = [sys.executable, "-m", "edgevlm", "serve", "-m", str(model), "--mmproj", str(mmproj), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--ctx", str(args.ctx), "--parallel", "1", "--threads", str(args.threads)]
    cmd += ["--kv", "f16", "--max-tokens", str(args.reply)]
    return cmd + (["--cache-dir", str(cache_dir)] if cache_dir is not None else [])


def converse(url: str, args) -> tuple[list[dict], dict[str, Any]]:
    """The 3 picture turns; the history as a client resends it, and what they cost."""
    messages: list[dict] = []
    with httpx.Client() as http:
        for i, q in enumerate(QUESTIONS):
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": q},
                        {"type": "image_url", "image_url": {"url": photo(40 + i)}},
                    ],
                }
            )
            r = ask(http, url, messages, args.reply, 0, i, 600)
            if r.error:
                raise RuntimeError(f"turn {i + 1}: {r.error}")
            messages.append({"role": "assistant", "content": r.text})
    return messages, {"turns": len(QUESTIONS)}


def follow_up(url: str, messages: list[dict], args, before: float = 0.0) -> dict[str, Any]:
    with httpx.Client() as http:
        r = ask(http, url, [*messages, {"role": "user", "content": FOLLOW_UP}], args.follow, 0, 9, 600)
    if r.error or r.ttft is None:
        return {"error": r.error or "no token"}
    return {"ttft_s": round(r.ttft + before, 3), "text": r.text}


def cached_tokens(url: str, messages: list[dict]) -> int:
    body = {"model": "m", "messages": [*messages, {"role": "user", "content": FOLLOW_UP}], "max_tokens": 1}
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    return int(((r.json().get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0))


def edgevlm_sides(model: Path, mmproj: Path, args, logdir: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cache = logdir / "cache"
    port = free_port()
    first = launch("edgevlm", edgevlm_cmd(model, mmproj, port, args, cache), port, logdir)
    if isinstance(first, str):
        return {s: {"error": first} for s in SIDES[:3]}
    try:
        messages, _ = converse(first.url, args)
        out["edgevlm resident"] = follow_up(first.url, messages, args)
        history_tokens = cached_tokens(first.url, messages)  # (the follow-up again: all of it held now)
    finally:
        t0 = time.monotonic()
        first.stop()  # SIGTERM: the graceful stop writes the conversation to the folder
        stop_s = time.monotonic() - t0
    out["history_tokens"] = history_tokens
    out["stop_s"] = round(stop_s, 2)
    out["cache_dir_bytes"] = sum(p.stat().st_size for p in cache.iterdir() if p.is_file())
    for side, with_cache in (("edgevlm --cache-dir", cache), ("edgevlm no disk tier", None)):
        port = free_port()
        t0 = time.monotonic()
        s = launch("edgevlm", edgevlm_cmd(model, mmproj, port, args, with_cache), port, logdir)
        if isinstance(s, str):
            out[side] = {"error": s}
            continue
        try:
            out[side] = {**follow_up(s.url, messages, args), "start_s": round(time.monotonic() - t0, 2)}
        finally:
            s.stop()
    return out


def llama_server_sides(model: Path, mmproj: Path, args, logdir: Path, exe: Path | str) -> dict[str, Any]:
    if isinstance(exe, str):
        return {"llama-server slot restore": {"error": exe}, "llama-server": {"error": exe}}
    slots = logdir / "slots"
    slots.mkdir()

    def start() -> Any:
        port = free_port()
        cmd = llama_server_cmd(exe, model, mmproj, port, 1, args.ctx, args.threads)
        return launch("llama-server", [*cmd, "--slot-save-path", str(slots) + "/"], port, logdir)

    out: dict[str, Any] = {}
    s = start()
    if isinstance(s, str):
        return {"llama-server slot restore": {"error": s}, "llama-server": {"error": s}}
    try:
        messages, _ = converse(s.url, args)
        saved = httpx.post(s.url + "/slots/0?action=save", json={"filename": "talk.bin"}, timeout=600)
    finally:
        s.stop()
    save_error = None if saved.status_code == 200 else f"save: HTTP {saved.status_code}: {saved.text[:200]}"
    for side in ("llama-server slot restore", "llama-server"):
        s = start()
        if isinstance(s, str):
            out[side] = {"error": s}
            continue
        try:
            if side == "llama-server slot restore":
                if save_error:
                    out[side] = {"error": save_error}
                    continue
                t0 = time.monotonic()
                got = httpx.post(s.url + "/slots/0?action=restore", json={"filename": "talk.bin"}, timeout=600)
                took = time.monotonic() - t0
                if got.status_code != 200:
                    out[side] = {"error": f"restore: HTTP {got.status_code}: {got.text[:200]}"}
                    continue
                out[side] = follow_up(s.url, messages, args, before=took)
            else:
                out[side] = follow_up(s.url, messages, args)
        finally:
            s.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="real", help="test kit preset of the LLaVA-1.5 pair (real: 7B shapes)")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--reply", type=int, default=96, help="tokens per picture turn's reply")
    ap.add_argument("--follow", type=int, default=8, help="tokens of the follow-up's reply")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-server", type=Path, help="a llama-server binary (default: built once, peer_servers)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from edgevlm_testkit import cached_model_pair

    run = Run("bench_restart")
    pair = cached_model_pair("llava15", args.preset, 0)
    logdir = Path(tempfile.mkdtemp(prefix="bench-restart-"))
    try:
        ed = edgevlm_sides(pair.model, pair.mmproj, args, logdir)
        ls = llama_server_sides(pair.model, pair.mmproj, args, logdir, find_llama_server(args.llama_server))
    finally:
        shutil.rmtree(logdir, ignore_errors=True)
    sides = {k: v for k, v in {**ed, **ls}.items() if k in SIDES}
    result = {
        "preset": args.preset,
        "pictures": len(QUESTIONS),
        "history_tokens": ed.get("history_tokens"),
        "reply_tokens": args.reply,
        "ctx": args.ctx,
        "stop_s": ed.get("stop_s"),
        "cache_dir_bytes": ed.get("cache_dir_bytes"),
        "sides": sides,
    }
    print(table(result))
    print(f"results: {run.save(result, args.out)}")


if __name__ == "__main__":
    main()
