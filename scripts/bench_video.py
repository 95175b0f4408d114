#!/usr/bin/env python3
"""A 90-second 1080p clip: edgevlm's frames under a token budget against all frames at 4 frames/s
as llama.cpp's video helper samples them, through the same bindings (issue #33).

    python scripts/bench_video.py                          # defaults: about 4 minutes on 2 cores
    python scripts/bench_video.py --budgets 1024 --no-demo --seconds 30
    python scripts/bench_video.py --preset tiny --seconds 20 --size 640x360   # quick check of the script

The clip (generated once with PyAV, cached under ``--work``, default ``~/.cache/edgevlm/bench``)
is the demo world in motion: coloured shapes drifting over plain or gradient backgrounds, two
scene cuts (at 1/3 and 0.72 of the clip), and an **event**: a red square that appears at 0:47
and is gone at 0:52 (the same fractions of a clip of another ``--seconds``). Nothing else in the
clip is red. H.264 (``libx264`` ultrafast) where PyAV has it, else MPEG-4 Part 2.

Every row runs in a fresh subprocess of this script, so its memory is its own; the parent polls
the RSS of the process and its children (ffmpeg, for llama.cpp's helper) with psutil every 50 ms
and also takes the process's own ``ru_maxrss`` when it exits; a side that passes ``--rss-cap`` is
stopped there (its RSS then shown with a "+"). Same pair, same threads, same ``--ctx``, flash attention,
extra CPU buffer types exactly as edgevlm uses them (``edgevlm_testkit.peers.same_kernels``).

- **llama.cpp, 4 fps** — ``llama_cpp.Llama`` and an mtmd context made as llama-cpp-python's
  ``MTMDChatHandler`` makes it. Where mtmd was built with ``MTMD_VIDEO`` and ``ffmpeg``/``ffprobe``
  are on PATH (``mtmd_helper_support_video``), the clip goes through llama.cpp's own helper
  (``mtmd_helper_bitmap_init_from_file``: an ffmpeg subprocess samples 4 frames/s, every frame at
  full size and mergeable, ``[XmY.YYs]`` every 5 s); otherwise (``--peer pyav``) the same is
  reproduced through the same bindings: PyAV decodes the frame nearest each 1/4 s, each becomes an
  ``mtmd_bitmap`` held in memory, mergeable, with the helper's ``Video:`` preamble and timestamps.
  Either way ``mtmd_tokenize`` expands it with the prompt, then the prompt's length is checked
  against ``n_ctx`` as llama-server checks it, before any frame is encoded (llama-cpp-python's
  handler would first encode the chunks that fit, then raise the same "Prompt exceeds n_ctx"):
  over it, the request is refused — the row reports the time from request to refusal and the
  peak RSS reached before it. The token count is also taken first with data-less bitmaps, so it is
  known even when the cap stops the real run.
- **edgevlm, budget N** — ``edgevlm chat --video CLIP --video-tokens N --json -n 16`` (the CLI's
  own code, run in the subprocess with ``plan_video`` wrapped to record the plan chat made):
  frames kept, image tokens sent (``stats.image_tokens``), TTFT (``stats.ttft_ms``: planning the
  frames, decoding them, encoding and prefill), peak RSS, wall time of the whole process (model
  load included), and whether a kept frame lies in the event window.
- **demo** (``--no-demo`` to skip) — the trained demo model (``--model demo``, LLaVA-like, 64
  tokens a frame) on a 640×360 rendering of the same clip, at ``--demo-budgets``, asked "What
  shape is red?" and "Describe the image.": whether the event frame survived the budget (from the
  plan: required) and what it answered (a bonus: it was trained on single pictures), plus the
  llama.cpp 4 fps row for it.

Ratios are against the llama.cpp row of the same model (tokens, peak RSS), never fixed seconds.
At the defaults the llama.cpp row holds 360 full-size frames and their preprocessed pixels:
about 11 GiB before it is refused (``--rss-cap`` stops it earlier on a smaller machine; its token
count is still reported). The clip is made once (about 35 s for the 1080p one).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "testkit"))

CLIP_VERSION = 1  # bump when the clip's content changes (the cache key)
EVENT = (47.0 / 90.0, 52.0 / 90.0)  # the red square's window, as fractions of the clip
CUTS = (1.0 / 3.0, 0.72)  # scene cuts, as fractions of the clip
LLAMA_FPS = 4.0  # mtmd_helper_video_init_params_default().fps_target
TIMESTAMP_MS = 5000  # ... .timestamp_interval_ms
PROMPT = "What happens in this clip, and when?"
DEMO_PROMPTS = ("What shape is red?", "Describe the image.")
SYSTEM = "You are a helpful assistant."


# --- the clip -----------------------------------------------------------------------------
def _scenes(seconds: float):
    """(start, end, background, gradient, [(kind, colour, size, path phase)]) per scene: no red
    anywhere but the event's square."""
    c0, c1 = CUTS[0] * seconds, CUTS[1] * seconds
    return [
        (0.0, c0, "white", True, [("circle", "blue", 0.22, 0.0), ("triangle", "yellow", 0.26, 1.7)]),
        (c0, c1, "green", False, [("circle", "white", 0.20, 0.4), ("triangle", "blue", 0.24, 2.5)]),
        (c1, seconds, "yellow", True, [("square", "black", 0.22, 1.1), ("circle", "blue", 0.18, 3.0)]),
    ]


def scene_at(t: float, seconds: float, w: int, h: int):
    """The demo world's ``Scene`` shown at time ``t``."""
    from edgevlm_testkit.world import Scene, Shape

    short = min(w, h)
    scenes = _scenes(seconds)
    _, _, bg, grad, shapes = next((sc for sc in scenes if sc[0] <= t < sc[1]), scenes[-1])
    out = []
    for j, (kind, colour, frac, ph) in enumerate(shapes):
        s = frac * short
        # slow Lissajous drift, each shape in its own half of the frame
        cx = (0.25 + 0.5 * j) * w + 0.18 * w * math.sin(0.21 * t + ph)
        cy = 0.5 * h + 0.28 * h * math.sin(0.13 * t + 2 * ph)
        out.append(Shape(kind, colour, cx, cy, s))
    if EVENT[0] * seconds <= t < EVENT[1] * seconds:
        out.append(Shape("square", "red", 0.5 * w, 0.2 * h + 0.1 * short, 0.2 * short))
    return Scene(w, h, bg, grad, tuple(out))


def make_clip(path: Path, seconds: float, size: tuple[int, int], fps: int) -> Path:
    """Render and encode the clip (once: cached by its parameters)."""
    if path.is_file() and path.stat().st_size > 0:
        return path
    import av

    from edgevlm_testkit.world import render

    codec = "libx264" if "libx264" in av.codecs_available else "mpeg4"
    tmp = path.with_suffix(".part.mp4")
    w, h = size
    with av.open(str(tmp), "w") as c:
        s = c.add_stream(codec, rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
        if codec == "libx264":
            s.options = {"preset": "ultrafast", "crf": "26"}
        else:
            s.bit_rate = 4_000_000
        for i in range(int(round(seconds * fps))):
            img = render(scene_at(i / fps, seconds, w, h))
            for p in s.encode(av.VideoFrame.from_image(img)):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    tmp.replace(path)
    return path


def clip_path(work: Path, seconds: float, size: tuple[int, int], fps: int) -> Path:
    return work / f"bench-video-v{CLIP_VERSION}-{seconds:g}s-{size[0]}x{size[1]}-{fps}fps.mp4"


# --- the llama.cpp side (a worker process) ---------------------------------------------------
def _prompt_text(llm, marker: str, prompt: str) -> str:
    """The prompt as llama-cpp-python's handlers render it: the model's chat template with the
    media marker where the picture goes (a plain USER/ASSISTANT prompt without a template)."""
    tpl = llm.metadata.get("tokenizer.chat_template")
    content = f"{marker}\n{prompt}"
    if tpl:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        try:
            return env.from_string(tpl).render(
                messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": content}],
                add_generation_prompt=True,
                bos_token="",
                eos_token="",
            )
        except Exception:  # a template that wants list content: fall through to plain text
            pass
    return f"{SYSTEM}\nUSER: {content}\nASSISTANT:"


def _helper_stamp(frame: int, fps: float, next_ms: float) -> tuple[str | None, float]:
    """The text llama.cpp's video helper puts after frame ``frame`` (0-based) of a stream at ``fps``."""
    elapsed = frame / fps * 1000.0
    if elapsed >= next_ms:
        s = elapsed / 1000.0
        m = int(s / 60)
        return f"[{m}m{s - m * 60:.2f}s]", next_ms + TIMESTAMP_MS
    return None, next_ms


def _helper_layout(n_frames: int, marker: str) -> str:
    """The helper's expansion of one video, as text with one marker per frame."""
    out, next_ms = ["Video:"], 0.0
    for i in range(n_frames):
        out.append(marker)
        stamp, next_ms = _helper_stamp(i, LLAMA_FPS, next_ms)
        if stamp:
            out.append(stamp)
    return "".join(out)


def _pyav_frames(path: str, fps: float):
    """(time, HxWx3 uint8) for the frame nearest each 1/fps second, as ffmpeg's fps filter picks."""
    import av

    with av.open(path) as c:
        st = c.streams.video[0]
        st.thread_type = "AUTO"
        dur = float(st.duration * st.time_base) if st.duration else float(c.duration or 0) / 1e6
        n = max(1, int(round(dur * fps)))
        want = 0
        prev = None
        for fr in c.decode(st):
            t = float(fr.pts * st.time_base) if fr.pts is not None else 0.0
            while want < n and t >= want / fps:
                target = want / fps
                pick = prev if prev is not None and abs(prev[0] - target) < abs(t - target) else (t, fr)
                yield pick[0], pick[1].to_ndarray(format="rgb24")
                want += 1
            prev = (t, fr)
        while want < n and prev is not None:  # the tail: the last frame stands for the rest
            yield prev[0], prev[1].to_ndarray(format="rgb24")
            want += 1


def _tokenize(m, mctx, text: str, bitmaps: list):
    inp = m.mtmd_input_text()
    raw = text.encode("utf-8")
    inp.text, inp.text_len, inp.add_special, inp.parse_special = raw, len(raw), True, True
    chunks = m.mtmd_input_chunks_init()
    arr = (m.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
    rc = m.mtmd_tokenize(mctx, chunks, ctypes.byref(inp), arr, len(bitmaps))
    if rc != 0:
        m.mtmd_input_chunks_free(chunks)
        raise RuntimeError(f"mtmd_tokenize failed (code {rc})")
    n_img = sum(
        1
        for i in range(m.mtmd_input_chunks_size(chunks))
        if m.mtmd_input_chunk_get_type(m.mtmd_input_chunks_get(chunks, i)) == m.MTMD_INPUT_CHUNK_TYPE_IMAGE
    )
    return chunks, int(m.mtmd_helper_get_n_tokens(chunks)), n_img


def worker_llamacpp(args) -> int:
    import llama_cpp
    from llama_cpp import mtmd_cpp as m

    from edgevlm.runtime.stats import peak_rss_bytes
    from edgevlm_testkit.peers import same_kernels

    out: dict[str, Any] = {}
    same_kernels()
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(
        args.model,
        n_ctx=args.n_ctx,
        n_batch=512,
        n_ubatch=512,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        flash_attn=True,
        verbose=False,
    )
    cp = m.mtmd_context_params_default()  # as MTMDChatHandler._init_mtmd_context
    cp.use_gpu = False
    cp.print_timings = False
    cp.n_threads = args.threads
    cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
    mctx = m.mtmd_init_from_file(args.mmproj.encode(), llm.model, cp)
    if not mctx:
        raise SystemExit("mtmd_init_from_file failed")
    out["load_s"] = time.perf_counter() - t0
    out["rss_after_load"] = peak_rss_bytes()
    marker = m.mtmd_default_marker().decode()
    text = _prompt_text(llm, marker, args.prompt)

    # 1. the count, with data-less bitmaps laid out as the helper lays out the clip (cheap)
    import av

    with av.open(args.clip) as c:
        st = c.streams.video[0]
        w, h = st.codec_context.width, st.codec_context.height
        dur = float(st.duration * st.time_base) if st.duration else float(c.duration or 0) / 1e6
    n_frames = max(1, int(round(dur * LLAMA_FPS)))
    ph = [m.mtmd_bitmap_init(w, h, None) for _ in range(n_frames)]
    for bm in ph:
        m.mtmd_bitmap_set_mergeable(bm, True)
    chunks, n_tok, n_img = _tokenize(m, mctx, text.replace(marker, _helper_layout(n_frames, marker)), ph)
    m.mtmd_input_chunks_free(chunks)
    for bm in ph:
        m.mtmd_bitmap_free(bm)
    out.update(frames=n_frames, tokens_counted=n_tok, image_chunks=n_img, n_ctx=args.n_ctx, size=[w, h])
    print(json.dumps({"partial": out}), flush=True)

    # 2. the request: every frame decoded into a bitmap, tokenized with the prompt, checked
    helper = args.peer == "helper"
    if helper and not m.mtmd_helper_support_video(mctx):  # built without MTMD_VIDEO
        helper = False
        out["note"] = "mtmd built without MTMD_VIDEO: reproduced with PyAV"
    t1 = time.perf_counter()
    video = None
    bitmaps: list = []
    if helper:
        opt = m.mtmd_helper_init_opt_default()
        opt.video_params.fps_target = LLAMA_FPS
        wrap = m.mtmd_helper_bitmap_init_from_file_wrapper(mctx, args.clip.encode(), False, opt)
        if not wrap.bitmap:
            raise SystemExit("mtmd_helper_bitmap_init_from_file failed (ffmpeg/ffprobe on PATH?)")
        video = wrap.video_ctx
        bitmaps = [wrap.bitmap]
        req = text
    else:
        for _t, rgb in _pyav_frames(args.clip, LLAMA_FPS):
            data = rgb.ctypes.data_as(ctypes.POINTER(ctypes.c_ubyte))
            bm = m.mtmd_bitmap_init(rgb.shape[1], rgb.shape[0], data)  # mtmd copies the pixels
            m.mtmd_bitmap_set_mergeable(bm, True)
            bitmaps.append(bm)
        req = text.replace(marker, _helper_layout(len(bitmaps), marker))
        out["frames"] = len(bitmaps)
    chunks, n_tok, n_img = _tokenize(m, mctx, req, bitmaps)
    t_tok = time.perf_counter() - t1
    out.update(tokens=n_tok, image_chunks=n_img, tokenize_s=t_tok)
    if n_tok > llm.n_ctx():  # llama-server refuses here, before any encoding
        out["refused"] = f"Prompt exceeds n_ctx: {n_tok} > {llm.n_ctx()}"
        out["answer"] = None
    else:  # it fits (a short clip or a large --ctx): evaluate and generate as the handler does
        n_past = llama_cpp.llama_pos(0)
        rc = m.mtmd_helper_eval_chunks(mctx, llm._ctx.ctx, chunks, 0, 0, 512, True, ctypes.byref(n_past))
        out["refused"] = None if rc == 0 else f"eval failed (code {rc})"
        out["ttft_ms"] = (time.perf_counter() - t1) * 1000
    out["request_s"] = time.perf_counter() - t1
    out["peak_rss_bytes"] = peak_rss_bytes()
    out["source"] = "mtmd_helper_video (ffmpeg)" if helper else "PyAV → mtmd_bitmap"
    m.mtmd_input_chunks_free(chunks)
    for bm in bitmaps:
        m.mtmd_bitmap_free(bm)
    if video:
        m.mtmd_helper_video_free(video)
    m.mtmd_free(mctx)
    llm.close()
    print(json.dumps({"result": out}), flush=True)
    return 0


# --- the edgevlm side (a worker process running the CLI) --------------------------------------
def worker_edgevlm(args, cli_args: list[str]) -> int:
    """``edgevlm chat ... --json`` as the CLI runs it, with the plan chat made recorded."""
    import edgevlm.runtime.intake.views as eng  # where the intake looks plan_video up
    from edgevlm.cli import main as cli

    plans: list[dict] = []
    real = eng.plan_video

    def recording(*a, **kw):
        plan, frames = real(*a, **kw)
        plans.append(
            {
                "kept": [f.t for f in plan.kept],
                "total_tokens": plan.total_tokens,
                "budget": plan.budget,
                "frame_size": list(plan.frame_size),
                "rule": plan.rule,
                "notes": list(plan.notes),
                "candidates": len(plan.frames),
                "duration": plan.duration,
            }
        )
        return plan, frames

    eng.plan_video = recording
    code = 0
    try:
        cli.main(["chat", *cli_args], prog_name="edgevlm", standalone_mode=False)
    except SystemExit as e:
        code = int(e.code or 0)
    Path(args.plan_out).write_text(json.dumps(plans))
    return code


# --- the parent --------------------------------------------------------------------------------
class Watch:
    """Run a command, polling the RSS of it and its children; stop it past ``cap`` bytes or
    ``timeout`` seconds."""

    def __init__(self, cmd: list[str], cap: int, timeout: float):
        self.cmd, self.cap, self.timeout = cmd, cap, timeout

    def run(self) -> dict[str, Any]:
        import psutil

        from edgevlm_testkit.peers import machine_busy_s

        t0, busy0 = time.perf_counter(), machine_busy_s()
        proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out_lines: list[str] = []
        err_lines: list[str] = []
        ts = [
            threading.Thread(target=lambda: out_lines.extend(proc.stdout), daemon=True),
            threading.Thread(target=lambda: err_lines.extend(proc.stderr), daemon=True),
        ]
        for t in ts:
            t.start()
        peak, stopped, ru, status = 0, None, None, 0
        try:
            ps = psutil.Process(proc.pid)
        except psutil.Error:
            ps = None
        while True:  # wait4, not poll(): the child's own ru_maxrss comes with its exit
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if ps is not None:
                try:
                    rss = ps.memory_info().rss + sum(
                        c.memory_info().rss for c in ps.children(recursive=True) if c.is_running()
                    )
                    peak = max(peak, rss)
                except psutil.Error:
                    pass
            if peak > self.cap:
                stopped = f"stopped at the RSS cap ({self.cap / 2**30:.1f} GiB)"
            elif time.perf_counter() - t0 > self.timeout:
                stopped = f"stopped after {self.timeout:.0f} s"
            if stopped:
                for c in ps.children(recursive=True) if ps else []:
                    c.kill()
                proc.kill()
                _, status, ru = os.wait4(proc.pid, 0)
                break
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)  # (reaped here: Popen must not wait again)
        wall, busy1 = time.perf_counter() - t0, machine_busy_s()
        own = (ru.ru_utime + ru.ru_stime) if ru else 0.0
        others = (
            None
            if busy0 is None or busy1 is None or wall <= 0
            else round(max(0.0, busy1 - busy0 - own) / (wall * (os.cpu_count() or 1)), 3)
        )
        for t in ts:
            t.join(timeout=5)
        maxrss = ru.ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        return {
            "wall_s": wall,
            "peak_rss_bytes": max(peak, maxrss),
            "polled_peak_rss_bytes": peak,
            "ru_maxrss_bytes": maxrss,
            "rc": proc.returncode,
            "stopped": stopped,
            "others_cpu": others,
            "stdout": "".join(out_lines),
            "stderr_tail": "".join(err_lines)[-2000:],
        }


def run_llamacpp(args, model: str, mmproj: str, clip: Path, prompt: str, peer: str) -> dict[str, Any]:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        "llamacpp",
        "--model",
        model,
        "--mmproj",
        mmproj,
        "--clip",
        str(clip),
        "--ctx",
        str(args.ctx),
        "--threads",
        str(args.threads),
        "--prompt",
        prompt,
        "--peer",
        peer,
    ]
    r = Watch(cmd, args.rss_cap_bytes, args.side_timeout).run()
    res: dict[str, Any] = {}
    for line in r["stdout"].splitlines():
        try:
            d = json.loads(line)
        except ValueError:
            continue
        res.update(d.get("partial", {}))
        res.update(d.get("result", {}))
    keep = ("wall_s", "peak_rss_bytes", "polled_peak_rss_bytes", "ru_maxrss_bytes", "stopped", "others_cpu")
    res.update({k: r[k] for k in keep})
    if r["rc"] != 0 and not r["stopped"]:
        res["error"] = r["stderr_tail"].strip().splitlines()[-1:] or [f"exit {r['rc']}"]
    res.setdefault("tokens", res.get("tokens_counted"))
    return res


def run_edgevlm(
    args, model: str, mmproj: str | None, clip: Path, budget: int, prompt: str, tmp: Path, n: int = 16
) -> dict[str, Any]:
    plan_out = tmp / f"plan-{time.monotonic_ns()}.json"
    cli = ["--model", model, *(["--mmproj", mmproj] if mmproj else [])]
    cli += ["--video", str(clip), "--video-tokens", str(budget), "--ctx", str(args.ctx)]
    cli += ["--threads", str(args.threads), "--temp", "0", "-n", str(n), "--json", prompt]
    cmd = [sys.executable, __file__, "--worker", "edgevlm", "--plan-out", str(plan_out), "--", *cli]
    r = Watch(cmd, args.rss_cap_bytes, args.side_timeout).run()
    res: dict[str, Any] = {k: r[k] for k in ("wall_s", "peak_rss_bytes", "stopped", "others_cpu")}
    try:
        d = json.loads(r["stdout"].strip().splitlines()[-1])
        st = d["stats"]
        res.update(
            answer=d["text"],
            tokens=st["image_tokens"],
            ttft_ms=st["ttft_ms"],
            encode_ms=st["image_encode_ms"],
            prompt_n=st["prompt_n"],
            n_ctx=st["n_ctx"],
            stats_peak_rss_bytes=st["peak_rss_bytes"],
        )
    except (IndexError, KeyError, ValueError):
        res["error"] = (r["stderr_tail"].strip().splitlines() or [f"exit {r['rc']}"])[-1]
    try:
        plans = json.loads(plan_out.read_text())
        if plans:
            p = plans[-1]
            res.update(
                frames=len(p["kept"]),
                kept_s=[round(t, 2) for t in p["kept"]],
                frame_size=p["frame_size"],
                rule=p["rule"],
                plan_tokens=p["total_tokens"],
                candidates=p["candidates"],
            )
            ev0, ev1 = EVENT[0] * p["duration"], EVENT[1] * p["duration"]
            res["event_frames"] = [t for t in p["kept"] if ev0 <= t < ev1]
    except (OSError, ValueError):
        pass
    return res


def _size(s: str) -> tuple[int, int]:
    w, h = s.lower().split("x")
    return int(w), int(h)


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=90.0, help="clip length (default 90)")
    ap.add_argument("--size", default="1920x1080", help="clip size WxH (default 1920x1080)")
    ap.add_argument("--clip-fps", type=int, default=24, help="the clip's own frame rate (default 24)")
    ap.add_argument("--preset", default="real", help="generated Qwen2-VL pair: real (Qwen2-VL-2B shapes) or tiny")
    ap.add_argument("--budgets", default="1024,2048,4096", help="edgevlm --video-tokens values, comma-separated")
    ap.add_argument("--ctx", type=int, default=8192, help="n_ctx on every side (default 8192)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--peer",
        default="auto",
        choices=["auto", "helper", "pyav"],
        help="llama.cpp side: its video helper (needs ffmpeg + ffprobe on PATH), the PyAV reproduction, "
        "or auto (the helper where it can run)",
    )
    ap.add_argument("--no-demo", action="store_true", help="skip the demo model's rows")
    ap.add_argument("--demo-size", default="640x360")
    ap.add_argument("--demo-budgets", default="256,1024")
    ap.add_argument("--demo-ctx", type=int, default=4096)
    ap.add_argument(
        "--rss-cap",
        type=float,
        default=None,
        help="GiB: stop a side whose RSS passes this (default: 70%% of the memory available at the start, ≤ 16)",
    )
    ap.add_argument("--side-timeout", type=float, default=900, help="seconds for one row (default 900)")
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache" / "edgevlm" / "bench")
    ap.add_argument(
        "--json-out", type=Path, help="the JSON (default: a new file in docs/results/, scripts/resultfile.py)"
    )
    # worker arguments
    ap.add_argument("--worker", choices=["llamacpp", "edgevlm"], help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--mmproj", help=argparse.SUPPRESS)
    ap.add_argument("--clip", help=argparse.SUPPRESS)
    ap.add_argument("--prompt", default=PROMPT, help=argparse.SUPPRESS)
    ap.add_argument("--plan-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.n_ctx = args.ctx
    if args.worker == "llamacpp":
        return worker_llamacpp(args)
    if args.worker == "edgevlm":
        return worker_edgevlm(args, rest)

    from resultfile import Run

    run = Run("bench_video")

    import psutil
    from rich.console import Console
    from rich.table import Table

    from edgevlm.hub.demo import trained_demo_pair
    from edgevlm_testkit import cached_model_pair

    con = Console(width=max(Console().width, 170))
    avail = psutil.virtual_memory().available
    cap_gib = args.rss_cap if args.rss_cap is not None else min(16.0, 0.7 * avail / 2**30)
    args.rss_cap_bytes = int(cap_gib * 2**30)
    peer = args.peer
    if peer == "auto":
        peer = "helper" if _helper_available() else "pyav"
    size = _size(args.size)
    args.work.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()

    t0 = time.perf_counter()
    clip = make_clip(clip_path(args.work, args.seconds, size, args.clip_fps), args.seconds, size, args.clip_fps)
    clip_s = time.perf_counter() - t0
    ev = (EVENT[0] * args.seconds, EVENT[1] * args.seconds)
    con.print(
        f"[dim]clip {clip} ({clip.stat().st_size / 2**20:.1f} MiB, made in {clip_s:.0f} s); event (red square) "
        f"{ev[0]:.1f}–{ev[1]:.1f} s; llama.cpp side: {peer}; RSS cap {cap_gib:.1f} GiB[/dim]"
    )
    pair = cached_model_pair("qwen2vl", args.preset)
    budgets = [int(x) for x in args.budgets.split(",") if x.strip()]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench_video.") as tmpd:
        tmp = Path(tmpd)
        con.print(f"[dim]qwen2vl/{args.preset}: llama.cpp, 4 fps ...[/dim]")
        r = run_llamacpp(args, str(pair.model), str(pair.mmproj), clip, PROMPT, peer)
        rows.append({"model": f"qwen2vl/{args.preset}", "approach": "llama.cpp, 4 fps", "budget": None, **r})
        for b in budgets:
            con.print(f"[dim]qwen2vl/{args.preset}: edgevlm, budget {b} ...[/dim]")
            r = run_edgevlm(args, str(pair.model), str(pair.mmproj), clip, b, PROMPT, tmp)
            rows.append({"model": f"qwen2vl/{args.preset}", "approach": f"edgevlm, budget {b}", "budget": b, **r})
        demo = None if args.no_demo else trained_demo_pair()
        if not args.no_demo and demo is None:
            con.print("[yellow]demo model not found (models/edgevlm-demo.gguf): its rows are left out[/yellow]")
        if demo is not None:
            dsize = _size(args.demo_size)
            dclip = make_clip(
                clip_path(args.work, args.seconds, dsize, args.clip_fps), args.seconds, dsize, args.clip_fps
            )
            dargs = argparse.Namespace(**{**vars(args), "ctx": args.demo_ctx})
            con.print("[dim]demo: llama.cpp, 4 fps ...[/dim]")
            r = run_llamacpp(dargs, str(demo[0]), str(demo[1]), dclip, DEMO_PROMPTS[0], peer)
            rows.append({"model": "demo", "approach": "llama.cpp, 4 fps", "budget": None, **r})
            for b in [int(x) for x in args.demo_budgets.split(",") if x.strip()]:
                con.print(f"[dim]demo: edgevlm, budget {b} ...[/dim]")
                r = run_edgevlm(dargs, "demo", None, dclip, b, DEMO_PROMPTS[0], tmp)
                r2 = run_edgevlm(dargs, "demo", None, dclip, b, DEMO_PROMPTS[1], tmp)
                r["answers"] = {DEMO_PROMPTS[0]: r.get("answer"), DEMO_PROMPTS[1]: r2.get("answer")}
                rows.append({"model": "demo", "approach": f"edgevlm, budget {b}", "budget": b, **r})

    for r in rows:  # ratios against the llama.cpp row of the same model
        base = next(x for x in rows if x["model"] == r["model"] and x["budget"] is None)
        if base.get("peak_rss_bytes") and r.get("peak_rss_bytes"):
            r["rss_vs_llamacpp"] = r["peak_rss_bytes"] / base["peak_rss_bytes"]
        if base.get("tokens") and r.get("tokens"):
            r["tokens_vs_llamacpp"] = r["tokens"] / base["tokens"]
        if r["budget"] is None:
            r["fits_ctx"] = not r.get("refused") and not r.get("stopped") and not r.get("error")
            r["event_kept"] = None
        else:
            r["fits_ctx"] = bool(r.get("tokens") is not None and not r.get("error"))
            r["event_kept"] = bool(r.get("event_frames")) if "event_frames" in r else None

    total_s = time.perf_counter() - t_all
    title = (
        f"{args.seconds:g} s {size[0]}x{size[1]} clip ({args.clip_fps} fps; red square {ev[0]:.0f}–{ev[1]:.0f} s), "
        f"qwen2vl/{args.preset} pair{' (Qwen2-VL-2B widths, 2 layers each)' if args.preset == 'real' else ''}, "
        f"n_ctx {args.ctx}"
        + ("" if args.no_demo or demo is None else f"; demo at {args.demo_size}, n_ctx {args.demo_ctx}")
        + f" (CPU, {args.threads} threads)"
    )
    t = Table(title=title)
    cols = ("model", "approach", "frames", "tokens", "fits ctx?", "TTFT ms", "peak RSS MiB", "RSS ÷ llama.cpp")
    for col in (*cols, "wall s", "event frame kept?", "others' CPU"):
        t.add_column(col, justify="left" if col in ("model", "approach", "fits ctx?", "event frame kept?") else "right")
    for r in rows:
        if r["budget"] is None:
            fits = "refused" if r.get("refused") else ("yes" if r["fits_ctx"] else r.get("stopped") or "error")
            if r.get("refused") and r.get("request_s"):
                ttft = f"{r['request_s'] * 1000:.0f} to refusal"
            else:
                ttft = f"{r['ttft_ms']:.0f}" if r.get("ttft_ms") is not None else "-"
            event = "-"
            rss = f"{r['peak_rss_bytes'] / 2**20:.0f}" + ("+" if r.get("stopped") else "")
        else:
            fits = "yes" if r["fits_ctx"] else f"error: {r.get('error', '')}"[:40]
            ttft = f"{r['ttft_ms']:.0f}" if r.get("ttft_ms") is not None else "-"
            ks = r.get("event_frames") or []
            if r["event_kept"] is None:
                event = "-"
            elif not ks:
                event = "no"
            else:
                event = f"yes, {len(ks)} ({ks[0]:.1f}" + (f"–{ks[-1]:.1f} s)" if len(ks) > 1 else " s)")
            rss = f"{r['peak_rss_bytes'] / 2**20:.0f}"
        t.add_row(
            r["model"],
            r["approach"],
            str(r.get("frames", "-")),
            f"{r['tokens']:,}" if r.get("tokens") is not None else "-",
            fits,
            ttft,
            rss,
            f"{r['rss_vs_llamacpp']:.2f}x" if r.get("rss_vs_llamacpp") and r["budget"] is not None else "1.00x",
            f"{r['wall_s']:.1f}",
            event,
            f"{r['others_cpu']:.0%}" if r.get("others_cpu") is not None else "-",
        )
    notes = []
    for r in rows:
        if r["budget"] is None:
            notes.append(
                f"{r['model']} llama.cpp ({r.get('source', peer)}): "
                + (r.get("refused") or r.get("stopped") or (str(r["error"]) if r.get("error") else "fits, evaluated"))
                + (f"; model load {r['load_s']:.1f} s" if r.get("load_s") else "")
            )
            continue
        line = f"{r['model']} {r['approach']}: "
        if r.get("tokens_vs_llamacpp") and r.get("rss_vs_llamacpp"):
            line += (
                f"{1 / r['tokens_vs_llamacpp']:.0f}x fewer tokens, {1 / r['rss_vs_llamacpp']:.1f}x less peak RSS "
                f"than llama.cpp's 4 fps"
            )
        if r.get("answers"):
            line += "; " + "; ".join(f"{q} → {a!r}" for q, a in r["answers"].items())
        if r.get("error"):
            line += f"; error: {r['error']}"
        notes.append(line)
    t.caption = "\n".join(notes)
    t.caption_justify = "left"
    con.print(t)
    report = {
        "clip": {
            "path": str(clip),
            "seconds": args.seconds,
            "size": list(size),
            "fps": args.clip_fps,
            "event_s": list(ev),
            "cuts_s": [c * args.seconds for c in CUTS],
        },
        "preset": args.preset,
        "n_ctx": args.ctx,
        "threads": args.threads,
        "peer": peer,
        "rss_cap_gib": cap_gib,
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
        "total_s": total_s,
        "rows": rows,
    }
    con.print(f"[dim]total {total_s:.0f} s; wrote {run.save(report, args.json_out)}[/dim]")
    return 0


def _helper_available() -> bool:
    """llama.cpp's video helper can run here: ffmpeg and ffprobe on PATH (mtmd's build flag is
    checked in the worker through ``mtmd_helper_support_video``; the helper fails cleanly
    without it)."""
    return bool(shutil.which("ffmpeg") and shutil.which("ffprobe"))


if __name__ == "__main__":
    sys.exit(main())
