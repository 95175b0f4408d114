#!/usr/bin/env python3
"""A laptop on a big GPU (#58): a ballast process holds device memory until S is left free, so
that edgevlm's probe, its plan and llama.cpp all see a laptop-sized GPU; then a model pair larger
than S runs with ``--ngl auto``: ``chat`` with a 4000×3000 picture, ``serve`` with 4 parallel
clients (the official ``openai`` client) each sending a different large picture, ``caption`` of
16 pictures. Each size passes when nothing ran out of memory, the sampled peak device use of each
run stayed within its plan's device total + the GPU overhead the guard keeps, and one layer more
than the plan chose (every other lever pinned to its choice) does not fit the plan.

Run by ``scripts/gpu_check.py --laptop [S ...]`` in the GPU build's interpreter (``--vulkan`` for
the Vulkan build), or directly there: ``python scripts/laptop_check.py [S ...]``.

- CUDA: the LLaVA-1.5-7B shape at full size (random Q4_K blocks, ``edgevlm_testkit.bigpair``)
  at S = 4 and 6 GiB; the ballast through libcudart; peaks from ``nvidia-smi``.
- A device that cannot report its free memory (Mesa's lavapipe): the ballast still holds
  total − S of real memory, the plan is told S as a what-if size (``--free-memory``, said in the
  output), no peak can be sampled (said so), and the sizes are scaled to a miniature pair.
"""

from __future__ import annotations

import argparse
import base64
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
MIB, GIB = 2**20, 2**30
OOM = re.compile(r"out of memory|ErrorOutOfDeviceMemory|failed to allocate|cudaMalloc failed|\bOOM\b", re.I)


@dataclass(frozen=True)
class Setup:
    shape: str  # edgevlm_testkit.bigpair.BIG_SHAPES
    sizes: tuple[str, ...]
    overhead: str | None  # --gpu-overhead (None: the backend's measured default)
    levers: tuple[str, ...]  # further plan flags, the same for every run
    why: str
    captions: int = 16  # pictures captioned


SETUPS = {
    "cuda": Setup("llava7b", ("4GiB", "6GiB"), None, (), "LLaVA-1.5-7B at full size, laptop GPUs of 4 and 6 GiB"),
    # the software device runs llama.cpp's shaders on the CPU, seconds per layer and picture: a miniature pair with
    # S and the overhead scaled to it (2 and 4 of its 5 layers), the micro-batch kept at 512 (a smaller one costs
    # minutes of dispatches there), an f16 cache (lavapipe's heap breaks with a q8_0 cache and part of the layers
    # on the device: docs/gpu.md, Limits) and 4 captions, not 16
    "software": Setup(
        "llava-mini",
        ("88MiB", "94MiB"),
        "8MiB",
        ("--ubatch", "512", "--kv", "f16"),
        "a miniature LLaVA (4 layers 256 wide, 576 image tokens) with S and the GPU overhead scaled to it",
        4,
    ),  # fmt: skip
}


# ------------------------------------------------------------------------------------------------ pictures
def pictures(folder: Path, n: int, size: tuple[int, int], seed: int) -> list[Path]:
    """``n`` different pictures (smooth colour fields with a few shapes), JPEG."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        small = (rng.random((12, 16, 3)) * 255).astype(np.uint8)
        im = Image.fromarray(small).resize(size, Image.Resampling.BICUBIC)
        d = ImageDraw.Draw(im)
        for _ in range(6):
            x, y = int(rng.integers(0, size[0])), int(rng.integers(0, size[1]))
            r = int(rng.integers(size[0] // 40, size[0] // 6))
            d.ellipse((x - r, y - r, x + r, y + r), fill=tuple(int(c) for c in rng.integers(0, 256, 3)))
        p = folder / f"picture-{seed}-{i:02d}.jpg"
        im.save(p, quality=85)
        out.append(p)
    return out


# ------------------------------------------------------------------------------------------------ device use
class Peak:
    """The device's used memory, sampled every 50 ms while a run is on (``nvidia-smi -lms``); on a
    device no tool reports, ``available`` is False and ``why`` says so."""

    def __init__(self, index: int | None, why: str = ""):
        self.index, self.why = index, why
        self.available = index is not None and shutil.which("nvidia-smi") is not None
        self.proc: subprocess.Popen | None = None
        self.samples: list[int] = []

    def now(self) -> int | None:
        if not self.available:
            return None
        q = ["nvidia-smi", f"--id={self.index}", "--query-gpu=memory.used", "--format=csv,noheader,nounits"]
        return int(subprocess.run(q, capture_output=True, text=True, timeout=20).stdout.split()[0]) * MIB

    def __enter__(self) -> Peak:
        if self.available:
            self.proc = subprocess.Popen(
                ["nvidia-smi", f"--id={self.index}", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                 "-lms", "50"], stdout=subprocess.PIPE, text=True,
            )  # fmt: skip
            threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self) -> None:
        assert self.proc is not None
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.strip().isdigit():
                self.samples.append(int(line) * MIB)

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(timeout=10)

    @property
    def peak(self) -> int | None:
        return max(self.samples) if self.samples else None


# ------------------------------------------------------------------------------------------------ the runs
def _edgevlm(*args: str) -> list[str]:
    return [sys.executable, "-m", "edgevlm", *args]


def _run(cmd: list[str], timeout: float, env: dict | None = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = None, str(e.stdout or ""), f"no end within {timeout:.0f} s"
    return {"rc": rc, "seconds": round(time.perf_counter() - t0, 1), "oom": bool(OOM.search(err or "")),
            "stdout": (out or "")[-600:], "stderr": (err or "")[-1500:]}  # fmt: skip


def plan_json(common: list[str]) -> dict[str, Any]:
    p = subprocess.run(_edgevlm("plan", *common, "--json"), capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        raise RuntimeError(f"edgevlm plan failed: {p.stderr[-800:]}")
    d: dict[str, Any] = json.loads(p.stdout)
    return d


def one_more(spec: dict[str, Any]) -> dict[str, Any]:
    """(in a child: it touches the device) The plan ``spec["plan"]`` chose, with every lever pinned
    to its choice, at its layer count and at one layer more: does each fit?"""
    from edgevlm.plan.devices import parse_size, probe
    from edgevlm.plan.footprint import Wishes
    from edgevlm.plan.planner import make_plan

    p = spec["plan"]
    pr = probe(free_memory=spec["free_memory"] or None,
               gpu_overhead=parse_size(spec["overhead"]) if spec["overhead"] else None)  # fmt: skip
    from edgevlm.model.gguf_info import read_gguf, text_model_info

    layers = text_model_info(read_gguf(spec["model"])).n_layer + 1  # the output layer counts as one
    out: dict[str, Any] = {"layers": layers}
    for n in (p["n_gpu_layers"], p["n_gpu_layers"] + 1) if p["n_gpu_layers"] < layers else (p["n_gpu_layers"],):
        w = Wishes(n_ctx=p["n_ctx"], kv=p["type_k"], n_gpu_layers=n, flash_attn=p["flash_attn"],
                   mmproj_on_gpu=p["mmproj_on_gpu"], n_batch=p["n_batch"], n_ubatch=p["n_ubatch"],
                   image_tokens=p["image_max_tokens"], kv_offload=p["offload_kqv"])  # fmt: skip
        q = make_plan(spec["model"], spec["mmproj"], pr, w)
        gpu = q.devices[0]
        out[str(n)] = {"fits": q.fits, "n_gpu_layers": q.n_gpu_layers, "shortfall": q.shortfall_bytes,
                       "device_total": gpu.predicted.total, "budget": gpu.budget_bytes}  # fmt: skip
    return out


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=10) as r:
        d: dict[str, Any] = json.loads(r.read())
        return d


def serve(common: list[str], pics: list[Path], timeout: float) -> dict[str, Any]:
    """``edgevlm serve``, 4 openai clients at once, each with its own large picture; stopped by pid."""
    from openai import OpenAI
    from peer_servers import free_port

    port = free_port()
    t0 = time.perf_counter()
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(_edgevlm("serve", *common, "--port", str(port), "--parallel", str(len(pics))),
                            stdout=log, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    url, status, answers, errors = f"http://127.0.0.1:{port}", {}, [], []
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                status = _get(url + "/status")
                if status.get("state") == "ready":
                    break
            except OSError:
                pass
            time.sleep(0.5)
        if status.get("state") != "ready":
            raise RuntimeError(f"the server was not ready within {timeout:.0f} s (state {status.get('state')})")
        client = OpenAI(base_url=url + "/v1", api_key="none", timeout=timeout, max_retries=0)

        def ask(pic: Path) -> None:
            b64 = base64.b64encode(pic.read_bytes()).decode()
            try:
                r = client.chat.completions.create(
                    model=status.get("model", "m"), max_tokens=8,
                    messages=[{"role": "user", "content": [
                        {"type": "text", "text": "What is in this picture?"},
                        {"type": "image_url", "image_url": {"url": f"data:image/jpeg;base64,{b64}"}}]}],
                )  # fmt: skip
                answers.append(r.choices[0].message.content or "")
            except Exception as e:  # counted and shown: the run goes on
                errors.append(f"{type(e).__name__}: {str(e)[:300]}")

        threads = [threading.Thread(target=ask, args=(p,)) for p in pics]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
        status = _get(url + "/status")
    except Exception as e:
        errors.append(f"{type(e).__name__}: {e}")
    finally:
        proc.terminate()  # by pid: SIGTERM, the server's own graceful stop
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait(timeout=10)
        log.seek(0)
        text = log.read()
        log.close()
    return {"rc": 0 if not errors and rc in (0, -15) else rc, "seconds": round(time.perf_counter() - t0, 1),
            "oom": bool(OOM.search(text)), "answers": len(answers), "errors": errors, "stderr": text[-1500:],
            "plan": status.get("plan")}  # fmt: skip


def context_bytes(peak: Peak) -> int:
    """What a process's own CUDA context takes (outside every plan: the probe reads free memory
    after it): a child that probes the devices and waits, measured by the same tool."""
    if not peak.available:
        return 0
    before = peak.now() or 0
    code = "import edgevlm; from edgevlm.plan.devices import probe; probe(); print('ready', flush=True); input()"
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        p.stdout.readline()
        return max(0, (peak.now() or 0) - before)
    finally:
        p.communicate("", timeout=60)


def one_size(size: str, setup: Setup, pair, pics: dict[str, list[Path]], gpu, backend: str) -> dict[str, Any]:
    from edgevlm.plan.devices import parse_size
    from edgevlm_testkit.ballast import Ballast

    row: dict[str, Any] = {"size": size, "size_bytes": parse_size(size)}
    index = int(gpu["name"][4:]) if gpu["name"].startswith("CUDA") else None
    with Ballast(size, backend=backend, device=gpu["name"], python=sys.executable, timeout=180) as b:
        rep = b.report
        assert rep is not None
        row["ballast"] = {k: getattr(rep, k) for k in ("free", "total", "held", "free_known", "converged", "note")}
        print(f"[{size}] ballast: holds {rep.held / MIB:,.0f} MiB; {gpu['name']} reads {rep.free / MIB:,.0f} MiB free"
              + ("" if rep.free_known else f" — NOTE: {rep.note}"), flush=True)  # fmt: skip
        what_if = [] if rep.free_known else ["--free-memory", f"{gpu['name']}={size}"]
        if what_if:
            print(f"[{size}] the plan is told {gpu['name']}={size} (what-if): the device cannot say", flush=True)
        overhead = ["--gpu-overhead", setup.overhead] if setup.overhead else []
        common = ["-m", str(pair.model), "--mmproj", str(pair.mmproj), "--ngl", "auto", *what_if, *overhead,
                  *setup.levers]  # fmt: skip
        row["what_if"] = bool(what_if)
        plan = plan_json(common)
        dev = plan["devices"][0]
        keep = ("n_gpu_layers", "n_ctx", "n_ubatch", "type_k", "offload_kqv", "mmproj_on_gpu", "fits")
        row["plan"] = {k: plan[k] for k in keep}
        row["plan"].update(device_total=dev["predicted"]["total"], budget=dev["budget_bytes"])
        from edgevlm.plan.devices import gpu_overhead_for

        row["overhead"] = parse_size(setup.overhead) if setup.overhead else gpu_overhead_for(gpu["name"])
        spec = {"plan": plan, "model": str(pair.model), "mmproj": str(pair.mmproj),
                "free_memory": [f"{gpu['name']}={size}"] if what_if else [], "overhead": setup.overhead}  # fmt: skip
        more = subprocess.run([sys.executable, __file__, "--one-more", json.dumps(spec)], capture_output=True,
                              text=True, timeout=300)  # fmt: skip
        row["one_more"] = json.loads(more.stdout.strip().splitlines()[-1]) if more.returncode == 0 else {
            "error": more.stderr[-800:]}  # fmt: skip
        print(f"[{size}] plan: {plan['n_gpu_layers']} layers on {gpu['name']}, ctx {plan['n_ctx']}, "
              f"{dev['predicted']['total'] / MIB:,.1f} MiB there; one more: {row['one_more']}", flush=True)  # fmt: skip
        peak = Peak(index, "" if index is not None else f"{gpu['name']}: no tool reports its used memory")
        row["context"] = context_bytes(peak)
        runs = {}
        for name, go in (
            (
                "chat",
                lambda: _run(
                    _edgevlm(
                        "chat", *common, "--image", str(pics["chat"][0]), "-n", "8", "--stats", "Describe the picture."
                    ),
                    900,
                ),
            ),  # fmt: skip
            ("serve", lambda: serve(common, pics["serve"], 900)),
            (
                "caption",
                lambda: _run(
                    _edgevlm(
                        "caption",
                        str(pics["caption"][0].parent),
                        *common,
                        "-n",
                        "8",
                        "-o",
                        str(pics["caption"][0].parent.parent / f"captions-{size}.jsonl"),
                        "--existing",
                        "overwrite",
                    ),
                    1800,
                ),
            ),  # fmt: skip
        ):
            base = peak.now()
            with peak:
                peak.samples.clear()
                r = go()
            total = (r.get("plan") or {}).get("devices", [{}])[0].get("predicted", {}).get("total") if name == "serve" \
                else dev["predicted"]["total"]  # fmt: skip
            r["device_total"] = total
            r["peak"] = None if peak.peak is None or base is None else peak.peak - base - row["context"]
            r["bound"] = None if total is None else total + row["overhead"]
            r["within"] = None if r["peak"] is None or r["bound"] is None else r["peak"] <= r["bound"]
            r.pop("plan", None)
            runs[name] = r
            print(f"[{size}] {name}: rc {r['rc']} in {r['seconds']} s, OOM {r['oom']}, peak "
                  + ("unavailable" if r["peak"] is None else f"{r['peak'] / MIB:,.0f} MiB of {r['bound'] / MIB:,.0f}"),
                  flush=True)  # fmt: skip
        row["runs"] = runs
    om = row["one_more"]
    n = row["plan"]["n_gpu_layers"]
    row["largest"] = "error" not in om and om[str(n)]["fits"] and (str(n + 1) not in om or not om[str(n + 1)]["fits"])
    row["ok"] = bool(
        rep.converged and row["plan"]["fits"] and row["largest"]
        and all(r["rc"] == 0 and not r["oom"] and r["within"] is not False for r in runs.values())
        and runs["serve"].get("answers") == len(pics["serve"])
    )  # fmt: skip
    return row


def check(sizes: list[str] | None, shape: str | None, out: Path | None, tag: str | None) -> int:
    from resultfile import Run

    from edgevlm.plan.devices import probe
    from edgevlm_testkit.bigpair import cached_big_llava

    pr = probe()
    if not pr.gpus:
        print("no GPU in this llama.cpp build: the laptop check needs one (--vulkan, or a CUDA build)")
        return 2
    g = pr.gpus[0]
    kind = "cuda" if g.name.startswith("CUDA") else "software" if not g.free_known else "cuda"
    setup = SETUPS[kind]
    if shape:
        setup = Setup(shape, setup.sizes, setup.overhead, setup.levers, setup.why, setup.captions)
    sizes = sizes or list(setup.sizes)
    sizes = [s + "GiB" if re.fullmatch(r"[0-9.]+", s) else s for s in sizes]
    backend = "cuda" if g.name.startswith("CUDA") else "ggml"
    run = Run("laptop_check", tag or ("cuda" if kind == "cuda" else "lavapipe-vulkan"))
    t0 = time.perf_counter()
    pair = cached_big_llava(setup.shape)
    print(f"pair {setup.shape}: {pair.nbytes / MIB:,.0f} MiB"
          + (f", written in {pair.seconds:.1f} s" if pair.seconds else " (cached)"), flush=True)  # fmt: skip
    tmp = Path(tempfile.mkdtemp(prefix="laptop-"))
    rows = []
    try:
        (tmp / "caption").mkdir()
        pics = {"chat": pictures(tmp, 1, (4000, 3000), 1),
                "serve": [pictures(tmp, 1, (4000, 3000) if i % 2 else (3000, 4000), 10 + i)[0] for i in range(4)],
                "caption": pictures(tmp / "caption", setup.captions, (1600, 1200), 2)}  # fmt: skip
        for s in sizes:
            rows.append(one_size(s, setup, pair, pics, {"name": g.name}, backend))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    result = {
        "device": {"name": g.name, "description": g.description, "total": g.total_bytes, "free_known": g.free_known},
        "setup": {"shape": setup.shape, "why": setup.why, "overhead": setup.overhead, "levers": list(setup.levers),
                  "captions": setup.captions},
        "pair": {"shape": setup.shape, "bytes": pair.nbytes, "write_seconds": round(pair.seconds, 1)},
        "sizes": rows, "seconds": round(time.perf_counter() - t0, 1),
    }  # fmt: skip
    path = run.save(result, out)
    sys.path.insert(0, str(ROOT / "scripts"))
    import render_laptop

    print(render_laptop.table(run.envelope(result)))
    print(f"wrote {path}")
    return 0 if all(r["ok"] for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("sizes", nargs="*", help="free memory to leave: 4GiB, 6 (GiB), 96MiB (default: per device)")
    ap.add_argument("--shape", help="edgevlm_testkit.bigpair shape (default: per device)")
    ap.add_argument("--tag", help="the results file's tag (default: cuda / lavapipe-vulkan)")
    ap.add_argument("--out", type=Path, help="the JSON (default: a new file in docs/results/)")
    ap.add_argument("--one-more", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one_more:
        print(json.dumps(one_more(json.loads(args.one_more))))
        return 0
    return check(args.sizes, args.shape, args.out, args.tag)


if __name__ == "__main__":
    sys.exit(main())
