#!/usr/bin/env python3
"""edgevlm against llama-server from the same llama.cpp build, on the same device (issue #58).

Both servers get the same model pair, ``-ngl`` (every layer on the device, and the laptop split:
half the layers and the output layer), context, KV types, micro-batch and batch, flash attention,
encoder placement, image budget, threads and 4 sequences in one unified KV: edgevlm's ``serve``
plans first and llama-server is given what its plan chose (``/status``). One server runs at a
time, on 127.0.0.1, stopped by its pid. Measured, with the same HTTP client for both:

- TTFT: a 4000x3000 picture (a new one each time, so no cache helps) at the image budget, a
  1-token reply; the median of ``--ttft-reps``;
- decode tokens/s of 1 stream and of 4 (text prompts, from the first token to the last);
- captioning images/s: ``--caption-images`` 640x480 pictures, ``--inflight`` requests at once
  (edgevlm's server, not ``edgevlm caption``: the same requests on both sides).

Ratios are edgevlm / llama-server; the targets (TTFT <= 1.0x, decode and captioning >= 1.0x) are
checked per split. For every workload the script also keeps where edgevlm's time went (its
``/status``: steps, the time inside llama.cpp and mtmd — decode, encode, sampling — and the rest,
Python) beside llama-server's own ``timings``: that is the profile a missed target is read from.

    # Vulkan: the venv and llama-server from one CMake build (~/.cache/edgevlm/vulkan/)
    python -m edgevlm_testkit.vulkan_build --venv .venv-vulkan --server
    .venv-vulkan/bin/python scripts/bench_gpu_speed.py --vulkan-server --tag lavapipe
    # CUDA: llama-server from the wheel's own build folder (docs/gpu.md, "Speed")
    python3 scripts/bench_gpu_speed.py --llama-server /tmp/llbuild/bin/llama-server -m M --mmproj P --tag h100
    # the CPU, against the CPU llama-server peer_servers.py builds: a quick check of the script
    python scripts/bench_gpu_speed.py --cpu
"""

from __future__ import annotations

import argparse
import base64
import io
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
# ggml lists a CPU-type Vulkan device (lavapipe) only when named, and lists devices when it loads (the
# imports below load it): vulkan_build.device_env; no effect on other backends
os.environ.setdefault("GGML_VK_VISIBLE_DEVICES", "0")

from caption_sides import PROMPT, SYSTEM, make_images
from peer_servers import EXTRA_BUFFERS, Server, find_llama_server, free_port, launch
from resultfile import Run

__all__ = ["TARGETS", "llama_server_args", "main", "ratios"]

TARGETS = {"ttft": ("<=", 1.0), "decode_1": (">=", 1.0), "decode_4": (">=", 1.0), "caption": (">=", 1.0)}
STORY = "Story {i}: write a long story about the sea, the ships and the people on them."


# --- the servers -------------------------------------------------------------------------------
def edgevlm_cmd(args, ngl: int, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "edgevlm", "serve", "-m", str(args.model), "--mmproj", str(args.mmproj)]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--ngl", str(ngl), "--ctx", str(args.ctx)]
    cmd += ["--kv", args.kv, "--ubatch", str(args.ubatch), "--image-tokens", str(args.image_tokens)]
    cmd += ["--parallel", str(args.parallel), "--threads", str(args.threads), "--tiles", "off", "--queue", "64"]
    return cmd + ["--max-tokens", str(args.decode_tokens), "--temp", "0"]


def llama_server_args(plan: dict[str, Any], parallel: int, threads: int) -> list[str]:
    """llama-server's flags for what edgevlm's plan chose: the same load on both sides."""
    t = str(threads)
    out = ["-ngl", str(plan["n_gpu_layers"]), "-c", str(plan["n_ctx"]), "-b", str(plan["n_batch"])]
    out += ["-ub", str(plan["n_ubatch"]), "-ctk", plan["type_k"], "-ctv", plan["type_v"]]
    out += ["-fa", "on" if plan["flash_attn"] else "off", "-np", str(parallel), "-kvu", "-t", t, "-tb", t]
    if plan.get("image_max_tokens"):
        out += ["--image-max-tokens", str(plan["image_max_tokens"])]
    out += [] if plan.get("mmproj_on_gpu", True) else ["--no-mmproj-offload"]
    out += [] if plan.get("offload_kqv", True) else ["--no-kv-offload"]
    out += [] if plan.get("repack", EXTRA_BUFFERS) else ["--no-repack"]
    return [*out, "--no-webui"]


def stop(server: Server) -> None:
    """Stop a server by its pid: SIGTERM, then SIGKILL after 30 s (``Server.stop``)."""
    server.stop()


def get_json(url: str, timeout: float = 30) -> dict[str, Any]:
    r = httpx.get(url, timeout=timeout)
    r.raise_for_status()
    d: dict[str, Any] = r.json()
    return d


def profile_now(server: Server, edge: bool) -> dict[str, float]:
    """edgevlm's step loop so far (``/status``): steps, tokens, ms inside llama.cpp and mtmd."""
    if not edge:
        return {}
    k = get_json(server.url + "/status").get("kv", {})
    steps = k.get("steps", {})
    keys = ("steps", "generated")
    return {
        **{x: steps.get(x, 0) for x in keys},
        "llama_ms": k.get("llama_ms", 0.0),
        "encode_ms": k.get("encode_ms", 0.0),
    }


def profile_between(a: dict[str, float], b: dict[str, float], wall_s: float) -> dict[str, Any]:
    """Where edgevlm's ``wall_s`` went between two ``profile_now``: in llama.cpp's decode calls
    (``llama_ms``: the batches, sampling), in mtmd's encoder (``encode_ms``) and the rest
    (``python_ms``: HTTP, the pictures' decoding and resizing, the step loop), per step too."""
    if not a or not b:
        return {}
    steps = b["steps"] - a["steps"]
    llama, enc = b["llama_ms"] - a["llama_ms"], b["encode_ms"] - a["encode_ms"]
    wall = wall_s * 1000
    rest = max(0.0, wall - llama - enc)
    per = max(1, steps)
    return {
        "steps": steps,
        "generated": b["generated"] - a["generated"],
        "wall_ms": round(wall, 1),
        "llama_ms": round(llama, 1),
        "encode_ms": round(enc, 1),
        "python_ms": round(rest, 1),
        "step_ms": round(wall / per, 3),
        "llama_ms_per_step": round(llama / per, 3),
        "python_ms_per_step": round(rest / per, 3),
    }


# --- requests ----------------------------------------------------------------------------------
def post(url: str, messages: list[dict], max_tokens: int, timeout: float, stream: bool = False) -> dict[str, Any]:
    """One chat completion: wall time, first-token time (streamed), tokens, llama-server's timings."""
    body: dict[str, Any] = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    out: dict[str, Any] = {"error": None, "tokens": 0, "timings": None}
    t0 = time.monotonic()
    try:
        if not stream:
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout, headers={"Connection": "close"})
            if r.status_code != 200:
                return {**out, "error": f"HTTP {r.status_code}: {r.text[:160]}"}
            d = r.json()
            out.update(tokens=d["usage"]["completion_tokens"], prompt_tokens=d["usage"]["prompt_tokens"])
            out.update(
                timings=d.get("timings"), wall=time.monotonic() - t0, first=time.monotonic(), last=time.monotonic()
            )
            return out
        body.update(stream=True, stream_options={"include_usage": True})
        with httpx.stream(
            "POST", url + "/v1/chat/completions", json=body, timeout=timeout, headers={"Connection": "close"}
        ) as r:
            if r.status_code != 200:
                r.read()
                return {**out, "error": f"HTTP {r.status_code}: {r.text[:160]}"}
            pieces = []
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                d = json.loads(line[6:])
                if d.get("usage"):
                    out["tokens"] = d["usage"].get("completion_tokens", 0)
                out["timings"] = d.get("timings") or out["timings"]
                for ch in d.get("choices") or []:
                    if (ch.get("delta") or {}).get("content"):
                        pieces.append(time.monotonic())
            out.update(
                wall=time.monotonic() - t0, first=pieces[0] if pieces else None, last=pieces[-1] if pieces else None
            )
            out["tokens"] = out["tokens"] or len(pieces)
    except httpx.HTTPError as exc:
        out["error"] = f"{type(exc).__name__}: {exc}"
    return out


def data_url(path: Path) -> str:
    return (
        f"data:image/{'png' if path.suffix == '.png' else 'jpeg'};base64,"
        + base64.b64encode(path.read_bytes()).decode()
    )


def picture_messages(path: Path, text: str, system: str | None = None) -> list[dict]:
    user = {
        "role": "user",
        "content": [{"type": "image_url", "image_url": {"url": data_url(path)}}, {"type": "text", "text": text}],
    }
    return ([{"role": "system", "content": system}] if system else []) + [user]


def big_picture(folder: Path, seed: int) -> Path:
    """A 4000x3000 JPEG (a photo's size), different for every seed."""
    from PIL import Image, ImageDraw

    path = folder / f"big-{seed}.jpg"
    if not path.exists():
        img = Image.new("RGB", (4000, 3000), ((seed * 53) % 256, (seed * 97) % 256, 180))
        d = ImageDraw.Draw(img)
        for k in range(12):
            x, y = (seed * 331 + k * 577) % 3600, (seed * 191 + k * 401) % 2600
            d.ellipse((x, y, x + 400, y + 400), fill=((k * 40) % 256, (seed * 7 + k * 90) % 256, (k * 13) % 256))
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=90)
        path.write_bytes(buf.getvalue())
    return path


# --- workloads ---------------------------------------------------------------------------------
def ttft(server: Server, edge: bool, args, folder: Path, seed0: int) -> dict[str, Any]:
    """Time to the first token of a 4000x3000 picture's reply (1 token), a new picture each time."""
    times, errors, prompt_tokens, timings = [], [], [], []
    p0, t0 = profile_now(server, edge), time.monotonic()
    for k in range(args.ttft_reps):
        r = post(
            server.url, picture_messages(big_picture(folder, seed0 + k), "Describe this picture."), 1, args.timeout
        )
        if r["error"]:
            errors.append(r["error"])
            continue
        times.append(r["wall"])
        prompt_tokens.append(r.get("prompt_tokens"))
        timings.append(r["timings"])
    out: dict[str, Any] = {
        "s": round(statistics.median(times), 4) if times else None,
        "runs_s": [round(t, 4) for t in times],
    }
    out.update(prompt_tokens=prompt_tokens, errors=errors)
    out["profile"] = (
        profile_between(p0, profile_now(server, edge), time.monotonic() - t0) if edge else {"timings": timings}
    )
    return out


def _together(server: Server, args, n: int, max_tokens: int) -> tuple[float, list[dict[str, Any]]]:
    """``n`` text requests at once, each a prompt neither server has seen (the same length): the
    time from the first sent to the last answered, and the answers."""
    first = next(args.prompt_ids)
    ids = [first * 10 + i for i in range(n)]
    t0 = time.monotonic()
    with ThreadPoolExecutor(n) as pool:
        res = list(
            pool.map(
                lambda i: post(server.url, [{"role": "user", "content": STORY.format(i=i)}], max_tokens, args.timeout),
                ids,
            )
        )
    return time.monotonic() - t0, res


def decode(server: Server, edge: bool, args, streams: int) -> dict[str, Any]:
    """Tokens a second of ``streams`` replies generated at once: the replies' tokens after their
    first, over the time ``decode_tokens``-token replies took beyond 1-token replies to prompts of
    the same length (so the prompt's evaluation and the first token are out, on both sides alike;
    nothing depends on how a server streams). Medians of ``--reps`` of each."""
    shorts, fulls, gens, res_all, timings = [], [], [], [], []
    p0, t0 = profile_now(server, edge), time.monotonic()
    for _ in range(args.reps):
        short, res1 = _together(server, args, streams, 1)
        full, res = _together(server, args, streams, args.decode_tokens)
        ok = [r for r in res if not r["error"]]
        shorts.append(short)
        fulls.append(full)
        gens.append(sum(r["tokens"] for r in ok))
        res_all += res + res1
        timings += [r["timings"] for r in ok]
    short, full, tokens = statistics.median(shorts), statistics.median(fulls), statistics.median(gens)
    out: dict[str, Any] = {"streams": streams, "tokens": tokens, "first_s": [round(x, 4) for x in shorts]}
    out.update(all_s=[round(x, 4) for x in fulls], errors=[r["error"] for r in res_all if r["error"]])
    out["tok_per_s"] = round((tokens - streams) / (full - short), 2) if tokens > streams and full > short else None
    out["mean_tokens"] = round(tokens / streams, 1)
    prof = profile_between(p0, profile_now(server, edge), time.monotonic() - t0) if edge else {"timings": timings}
    out["profile"] = prof
    return out


def caption(server: Server, edge: bool, args, pictures: list[Path]) -> dict[str, Any]:
    """Pictures captioned a second, ``args.inflight`` requests at once (after one warm-up)."""
    post(server.url, picture_messages(pictures[-1], PROMPT, SYSTEM), args.caption_tokens, args.timeout)
    work = pictures[: args.caption_images]
    p0, t0 = profile_now(server, edge), time.monotonic()
    with ThreadPoolExecutor(args.inflight) as pool:
        res = list(
            pool.map(
                lambda p: post(server.url, picture_messages(p, PROMPT, SYSTEM), args.caption_tokens, args.timeout), work
            )
        )
    wall = time.monotonic() - t0
    ok = [r for r in res if not r["error"]]
    out: dict[str, Any] = {
        "images": len(ok),
        "wall_s": round(wall, 3),
        "images_per_s": round(len(ok) / wall, 3) if ok else None,
    }
    out.update(tokens=sum(r["tokens"] for r in ok), errors=[r["error"] for r in res if r["error"]])
    out["profile"] = profile_between(p0, profile_now(server, edge), wall) if edge else {}
    return out


def workloads(server: Server, edge: bool, args, folder: Path, pictures: list[Path], seed0: int) -> dict[str, Any]:
    """The four measures on one server; a server that dies leaves the rest unmeasured, with why."""
    steps = {
        "ttft": lambda: ttft(server, edge, args, folder, seed0),
        "decode_1": lambda: decode(server, edge, args, 1),
        "decode_4": lambda: decode(server, edge, args, args.parallel),
        "caption": lambda: caption(server, edge, args, pictures),
    }
    out: dict[str, Any] = {}
    try:
        post(server.url, [{"role": "user", "content": "Hello."}], 4, args.timeout)  # warm: the template, a step
        for key, measure in steps.items():
            out[key] = measure()
            if server.proc.poll() is not None:
                raise RuntimeError(f"the server exited during {key}")
    except (httpx.HTTPError, RuntimeError) as exc:
        server.proc.wait(30)
        log = server.log.read_text(errors="replace").strip().splitlines()
        out["died"] = {"error": f"{type(exc).__name__}: {exc}", "exit": server.proc.poll(), "log": log[-3:]}
    for key in steps:
        none = {"s": None, "tok_per_s": None, "images_per_s": None, "profile": {}}
        out.setdefault(key, {**none, "errors": ["not measured: the server died"]})
    return out


def ratios(edge: dict[str, Any], peer: dict[str, Any]) -> dict[str, Any]:
    """edgevlm / llama-server for each measure, and whether each target holds (None: unmeasured)."""

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a and b else None

    r = {
        "ttft": ratio(edge["ttft"]["s"], peer["ttft"]["s"]),
        "decode_1": ratio(edge["decode_1"]["tok_per_s"], peer["decode_1"]["tok_per_s"]),
        "decode_4": ratio(edge["decode_4"]["tok_per_s"], peer["decode_4"]["tok_per_s"]),
        "caption": ratio(edge["caption"]["images_per_s"], peer["caption"]["images_per_s"]),
    }
    met = {
        k: None if v is None else (v <= TARGETS[k][1] if TARGETS[k][0] == "<=" else v >= TARGETS[k][1])
        for k, v in r.items()
    }
    return {"ratios": r, "targets_met": met, "missed": [k for k, v in met.items() if v is False]}


# --- cProfile of edgevlm's step loop --------------------------------------------------------------
BACKEND_CALLS = {  # edgevlm.backend.llama methods that are a llama.cpp call and the arrays around it
    "decode_multi": "llama_decode (the step's batch)",
    "sample": "llama_sampler_sample (waits for the device's logits, then samples)",
    "decode_rows": "llama_decode (picture rows)",
    "decode_embeddings": "llama_decode (picture rows)",
    "decode_image": "mtmd: a picture's rows",
    "encode_image": "mtmd: the encoder",
    "decode_tokens": "llama_decode (prompt)",
    "accept": "llama_sampler_accept",
}


def step_profile_child(args, ngl: int) -> dict[str, Any]:
    """In this process: edgevlm loaded as the server loads it, one stream's replies (``decode_tokens``
    tokens in all) under cProfile (the step loop runs on the caller's thread): per step, the time in the backend's
    llama.cpp calls and the rest (Python: the scheduler, batches, text)."""
    import cProfile
    import pstats

    import edgevlm

    vlm = edgevlm.load(args.model, args.mmproj, n_ctx=args.ctx, n_gpu_layers=ngl, kv=args.kv,
                       image_tokens=args.image_tokens, n_threads=args.threads)  # fmt: skip
    vlm.chat(STORY.format(i=1), max_tokens=8, temperature=0)  # warm
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    tokens = 0
    for i in range(20, 30):  # replies until decode_tokens were generated (a random pair may stop early)
        tokens += vlm.chat(STORY.format(i=i), max_tokens=args.decode_tokens, temperature=0).stats.predicted_n
        if tokens >= args.decode_tokens:
            break
    prof.disable()
    wall = (time.perf_counter() - t0) * 1000
    calls: dict[str, float] = {}
    steps = 0
    for (fn, _, name), (_, n, tt, _, _) in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        path = fn.replace(os.sep, "/")
        if path.endswith("edgevlm/backend/llama.py") and name in BACKEND_CALLS:
            calls[name] = calls.get(name, 0.0) + tt * 1000
        if path.endswith("edgevlm/runtime/scheduler.py") and name == "_step":
            steps += n
    native = sum(calls.values())
    per = max(1, steps)
    return {
        "ngl": ngl,
        "tokens": tokens,
        "steps": steps,
        "wall_ms": round(wall, 1),
        "calls_ms": {k: round(v, 1) for k, v in sorted(calls.items(), key=lambda kv: -kv[1])},
        "python_ms": round(max(0.0, wall - native), 1),
        "step_ms": round(wall / per, 3),
        "calls_ms_per_step": round(native / per, 3),
        "python_ms_per_step": round(max(0.0, wall - native) / per, 3),
        "note": "under cProfile, which slows the Python part; the calls' times are their C time",
    }


def step_profile(args, ngl: int) -> dict[str, Any]:
    """``step_profile_child`` in a process of its own (a crash there costs only the profile)."""
    cmd = [sys.executable, __file__, "--profile-child", str(ngl), "-m", str(args.model), "--mmproj", str(args.mmproj)]
    cmd += ["--ctx", str(args.ctx), "--kv", args.kv, "--image-tokens", str(args.image_tokens)]
    cmd += ["--threads", str(args.threads), "--decode-tokens", str(args.decode_tokens)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
    if r.returncode != 0:
        return {"ngl": ngl, "error": f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1:] or ''}"}
    d: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    return d


# --- the run -----------------------------------------------------------------------------------
def device_info(cpu: bool) -> dict[str, Any]:
    if cpu:
        return {"name": "CPU", "description": "the host's CPU", "backend": "CPU"}
    from edgevlm.backend.system import ggml_devices

    gpus = [d for d in ggml_devices() if d.kind in ("gpu", "igpu")]
    if not gpus:
        raise SystemExit("no GPU in this llama.cpp build (GGML_VK_VISIBLE_DEVICES=0 shows lavapipe; --cpu for the CPU)")
    d = gpus[0]
    return {"name": d.name, "description": d.description, "backend": d.name.rstrip("0123456789")}


def server_version(exe: Path, env: dict[str, str] | None) -> str:
    r = subprocess.run([str(exe), "--version"], capture_output=True, text=True, env=env, timeout=60)
    return " ".join(ln.strip() for ln in (r.stdout + r.stderr).splitlines() if ln.startswith(("version", "built with")))


def which_server(args) -> tuple[Path, dict[str, str] | None, dict[str, Any]]:
    """The llama-server binary, the environment it runs in and what is known of its build."""
    env = dict(os.environ)
    if args.vulkan_server:
        from edgevlm_testkit import vulkan_build as vb

        exe = vb.cached_server()
        if exe is None:
            raise SystemExit(
                "no cached llama-server: python -m edgevlm_testkit.vulkan_build --venv .venv-vulkan --server"
            )
        stamp = json.loads((exe.parent / "build.json").read_text())
        env = vb.server_env(env)
        mine = Path(sys.prefix) / "edgevlm-wheel.sha256"
        same = mine.exists() and mine.read_text().strip() == stamp["wheel_sha256"]
        if not same:
            raise SystemExit(
                f"{sys.prefix}'s llama-cpp-python is not the wheel built with {exe} (vulkan_build --server)"
            )
        return exe, env, {"same_build": True, "wheel_sha256": stamp["wheel_sha256"]}
    found = find_llama_server(args.llama_server)
    if isinstance(found, str):
        raise SystemExit(found)
    return found, env, {"same_build": args.same_build, "binary": str(found)}


def run_split(
    args, ngl: int, exe: Path, env: dict[str, str] | None, folder: Path, pictures: list[Path]
) -> dict[str, Any]:
    logdir = Path(args.logs)
    port = free_port()
    # edgevlm in this process's environment: the server's LD_LIBRARY_PATH would load a second copy of
    # ggml beside the one llama_cpp opens by its path
    srv = launch("edgevlm", edgevlm_cmd(args, ngl, port), port, logdir, wait_s=args.timeout)
    if isinstance(srv, str):
        raise SystemExit(f"edgevlm serve --ngl {ngl}: {srv}")
    try:
        plan = get_json(srv.url + "/status")["plan"]
        edge = workloads(srv, True, args, folder, pictures, 1000 + 100 * len(args.done))
    finally:
        stop(srv)
    port = free_port()
    cmd = [str(exe), "-m", str(args.model), "--mmproj", str(args.mmproj), "--host", "127.0.0.1", "--port", str(port)]
    cmd += llama_server_args(plan, args.parallel, args.threads)
    srv = launch("llama-server", cmd, port, logdir, env=env, wait_s=args.timeout)
    if isinstance(srv, str):
        raise SystemExit(f"llama-server -ngl {plan['n_gpu_layers']}: {srv}")
    try:
        peer = workloads(srv, False, args, folder, pictures, 2000 + 100 * len(args.done))
    finally:
        stop(srv)
    keys = ("n_gpu_layers", "n_ctx", "n_batch", "n_ubatch", "type_k", "type_v", "flash_attn", "mmproj_on_gpu")
    setting = {k: plan.get(k) for k in (*keys, "image_max_tokens", "offload_kqv")}
    row = {"ngl": ngl, "settings": setting, "llama_server_flags": llama_server_args(plan, args.parallel, args.threads)}
    row.update(edgevlm=edge, llama_server=peer, **ratios(edge, peer))
    args.done.append(row)
    return row


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("-m", "--model", type=Path, help="GGUF (default: the test kit's --pair)")
    ap.add_argument("--pair", default="qwen2vl:tiny", help="FAMILY:PRESET of a generated pair (real: real widths)")
    ap.add_argument("--mmproj", type=Path)
    ap.add_argument("--llama-server", type=Path, help="llama-server of the same build as this llama-cpp-python")
    ap.add_argument("--vulkan-server", action="store_true", help="the one vulkan_build --server cached")
    ap.add_argument("--same-build", action="store_true", help="say that --llama-server is of the same build")
    ap.add_argument("--cpu", action="store_true", help="no layer on a device (-ngl 0): a quick check of the script")
    ap.add_argument("--splits", default="all,laptop", help="all, laptop (half the layers + output) or numbers")
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--kv", default="f16")
    ap.add_argument("--ubatch", type=int, default=512)
    ap.add_argument("--image-tokens", type=int, default=1024)
    ap.add_argument("--parallel", type=int, default=4, help="sequences of both servers, streams of decode_4")
    ap.add_argument("--threads", type=int, default=min(8, os.cpu_count() or 2))
    ap.add_argument("--ttft-reps", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3, help="decode: runs of each request set (medians)")
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--caption-images", type=int, default=16)
    ap.add_argument("--caption-tokens", type=int, default=32)
    ap.add_argument("--inflight", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=600, help="seconds a server may take to start, a request to end")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", help="the JSON's path (default: a new file in docs/results/)")
    ap.add_argument("--logs", default=tempfile.gettempdir())
    ap.add_argument("--profile-child", type=int, help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.profile_child is not None:
        print(json.dumps(step_profile_child(args, args.profile_child)))
        return 0
    args.done = []
    args.prompt_ids = itertools.count(10)  # a prompt id of two digits or more: the same length of text
    run = Run("bench_gpu_speed", args.tag)
    if args.model is None:
        from edgevlm_testkit import cached_model_pair

        family, _, preset = args.pair.partition(":")
        pair = cached_model_pair(family, preset or "tiny")
        args.model, args.mmproj = pair.model, pair.mmproj
    exe, env, build = which_server(args)
    device = device_info(args.cpu)
    build["llama_server_version"] = server_version(exe, env)
    rows = []
    with tempfile.TemporaryDirectory(prefix="gpu-speed-") as tmp:
        folder = Path(tmp)
        pictures = make_images(folder / "caption", args.caption_images + 1)
        splits = ["0"] if args.cpu else args.splits.split(",")
        n_all = None
        for s in splits:
            if s == "laptop":
                if n_all is None:
                    raise SystemExit("--splits: 'laptop' comes after 'all' (it is half of all's layers)")
                ngl = (n_all - 1) // 2 + 1
            else:
                ngl = -1 if s == "all" else int(s)
            row = run_split(args, ngl, exe, env, folder, pictures)
            row["split"] = s
            if row["missed"]:  # where the time goes: edgevlm's step loop under cProfile
                row["step_profile"] = step_profile(args, row["settings"]["n_gpu_layers"])
            n_all = row["settings"]["n_gpu_layers"] if s == "all" else n_all
            rows.append(row)
            print(f"{s} (ngl {row['settings']['n_gpu_layers']}): {json.dumps(row['ratios'])}", file=sys.stderr)
    knobs = ("ctx", "kv", "ubatch", "image_tokens", "parallel", "threads", "ttft_reps", "reps", "decode_tokens")
    result = {
        "device": device,
        "build": build,
        "pair": {"model": args.model.name, "mmproj": args.mmproj.name, "dir": args.model.parent.name},
        "settings": {k: getattr(args, k) for k in (*knobs, "caption_images", "caption_tokens", "inflight")},
        "targets": {k: f"{op} {v}" for k, (op, v) in TARGETS.items()},
        "splits": rows,
    }
    path = run.save(result, args.out)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
