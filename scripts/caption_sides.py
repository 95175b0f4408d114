"""The sides ``scripts/bench_caption.py`` times: the same pictures captioned by ``edgevlm caption``,
``edgevlm batch``, a script against ``llama-server`` and a llama-cpp-python loop, each with one
model pair, context, thread count and (where a side has it) parallelism.

A side is loaded once (not timed) and then, for each timed block, ``reset`` (nothing of an earlier
block left in its caches), ``warm`` (one other picture: the system prompt cached as a steady run
has it) and ``run`` over the block's pictures; ``cpu_s()`` is the CPU time (user + system) its
model has used so far: this process for the sides that run in it, the server process and its
children for ``llama-server`` (``external``)."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
from peer_servers import free_port, launch, llama_server_cmd
from PIL import Image, ImageDraw

from edgevlm.runtime.scheduler import THROUGHPUT
from edgevlm_testkit.peers import same_kernels

__all__ = [
    "LONG_SYSTEM",
    "PROMPT",
    "SYSTEM",
    "THROUGHPUT",
    "BatchSide",
    "EdgeSide",
    "LibrarySide",
    "LlamaServerSide",
    "SideSkipped",
    "make_images",
    "own_cpu_s",
    "shell_loop",
]

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


def make_images(outdir: Path, n: int, seed: int = 100, size: tuple[int, int] = (640, 480)) -> list[Path]:
    """N deterministic pictures of ``size``: gradients with shapes, PNG and JPEG in turn."""
    outdir.mkdir(parents=True, exist_ok=True)
    w, h = size
    paths = []
    for i in range(n):
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


def own_cpu_s() -> float:
    """User + system CPU seconds of this process (all its threads) so far."""
    t = psutil.Process().cpu_times()
    return t.user + t.system


def _messages(system: str, url: str) -> list[dict[str, Any]]:
    image = {"type": "image_url", "image_url": {"url": url}}
    return [
        {"role": "system", "content": system},
        {"role": "user", "content": [image, {"type": "text", "text": PROMPT}]},
    ]


def _keep(fh: Any, captions: dict[str, str], path: Path, text: str) -> None:
    """A peer's caption: kept for the comparison and appended to its JSONL file, as a script does."""
    captions[path.name] = text
    fh.write(json.dumps({"path": str(path), "caption": text}) + "\n")
    fh.flush()


def _result(t0: float, captions: dict[str, str], generated: int, prompt: int, errors: list[str]) -> dict[str, Any]:
    return {
        "wall_s": time.perf_counter() - t0,
        "captions": captions,
        "generated": generated,
        "prompt_evaluated": prompt,
        "errors": len(errors),
        "error_examples": errors[:3],
    }


class SideSkipped(Exception):
    """A side that cannot run here (reported, not fatal)."""


class _Side:
    name = ""
    external = False  # its model runs in another process (cpu_s reads that one)

    def cpu_s(self) -> float:
        return own_cpu_s()

    def reset(self) -> None:
        pass

    def warm(self, picture: Path, out: Path, max_tokens: int) -> None:
        self.run([picture], out, max_tokens)

    def run(self, images: list[Path], out: Path, max_tokens: int) -> dict[str, Any]:
        raise NotImplementedError

    def close(self) -> None:
        pass


# --- edgevlm: caption and batch on one loaded model -----------------------------------------------
class EdgeSide(_Side):
    """``edgevlm caption``: a ``CaptionJob`` over the pictures, what the command runs (record log
    with fsync, resume index, pictures decoded in the background, KV prefix shared), ``--parallel``
    images in flight, loaded as the command loads: with the scheduler's throughput profile."""

    name = "caption"

    def __init__(self, model: Path, mmproj: Path, args):
        import edgevlm

        self.model, self.mmproj, self.args = model, mmproj, args
        self.system = LONG_SYSTEM if args.long_system else SYSTEM
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
            n_seq_max=args.parallel,
            parallel=args.parallel,
            scheduler_options=THROUGHPUT,
        )
        self.slots = self.vlm.scheduler.n_slots
        self.running = self.vlm.scheduler.max_running
        self.stops = list(self.vlm.default_stops)

    def reset(self) -> None:
        """Nothing of an earlier block kept: the KV cache, the host cache and the pictures'
        embeddings emptied (caption and batch caption the same pictures on this one model)."""
        self.vlm.scheduler.clear()
        self.vlm.scheduler.images.clear()

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
            "errors": 0,
            "cached_per_image": s.cached_per_image,
            "engine_ms": s.engine_ms + s.encode_ms,  # encode + prefill + decode
            "engine_share": (s.engine_ms + s.encode_ms) / (wall * 1000),
            "in_flight_max": s.in_flight_max,
            "wait_ms": s.wait_ms,
            "write_ms": s.write_ms,
            "load_ms_background": s.load_ms,
        }

    def close(self) -> None:
        self.vlm.close()


class BatchSide(_Side):
    """``edgevlm batch``: an OpenAI batch file of the same pictures (``/v1/chat/completions``
    bodies, the picture as an ``image_url`` naming its path) answered as the command answers it —
    ``read_batch_file``, ``BatchOutput`` (fsync-ed lines) and ``run_lines`` with its options —
    in this process, on the caption side's loaded model (so without the command's model load;
    its layout is the caption side's: ``--parallel`` sequences, all generating)."""

    name = "batch"

    def __init__(self, edge: EdgeSide, args):
        self.edge, self.args = edge, args

    def reset(self) -> None:
        self.edge.reset()

    def requests(self, images: list[Path], path: Path, max_tokens: int) -> Path:
        with path.open("w") as fh:
            for p in images:
                body = {
                    "model": "edgevlm",
                    "messages": _messages(self.edge.system, str(p.resolve())),
                    "max_tokens": max_tokens,
                    "temperature": 0,
                }
                line = {"custom_id": p.name, "method": "POST", "url": "/v1/chat/completions", "body": body}
                fh.write(json.dumps(line) + "\n")
        return path

    def run(self, images: list[Path], out: Path, max_tokens: int) -> dict[str, Any]:
        from edgevlm.jobs.stop import StopToken
        from edgevlm.serve.batchfile import BatchOutput, read_batch_file
        from edgevlm.serve.batchrun import run_lines
        from edgevlm.serve.options import ServeOptions

        requests = self.requests(images, out.with_suffix(".requests.jsonl"), max_tokens)  # the input: not timed
        t0 = time.perf_counter()
        data = read_batch_file(str(requests))
        options = ServeOptions(  # as `edgevlm batch` makes them (cli/batch.py)
            model_id="edgevlm",
            queue=self.args.parallel,
            follow_ups_first=False,
            max_tokens=max_tokens,
            path_base=os.getcwd(),
            allow_paths=tuple(dict.fromkeys([str(requests.parent.resolve()), os.getcwd(), str(images[0].parent)])),
        )
        output = BatchOutput(data, str(out)).open()
        try:
            run_lines(self.edge.vlm, output.todo(), lambda d, line: output.write(d), options, StopToken())
        finally:
            output.close()
        wall = time.perf_counter() - t0
        captions, generated, prompt, errors = {}, 0, 0, []
        for ln in out.read_text().splitlines():
            d = json.loads(ln)
            resp = d.get("response") or {}
            body = resp.get("body") or {}
            if resp.get("status_code") != 200:
                errors.append(str(d.get("error") or body.get("error"))[:200])
                continue
            usage = body["usage"]
            captions[d["custom_id"]] = body["choices"][0]["message"]["content"].strip()
            generated += usage["completion_tokens"]
            prompt += usage["prompt_tokens"] - (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        return {
            "wall_s": wall,
            "captions": captions,
            "generated": generated,
            "prompt_evaluated": prompt,
            "errors": len(errors),
            "error_examples": errors[:3],
        }


# --- llama-server and a client script -------------------------------------------------------------
class LlamaServerSide(_Side):
    """``llama-server -np N`` (started once, not timed) and a client that keeps N requests in flight
    over the pictures: each a non-streamed ``/v1/chat/completions`` with the system prompt, the
    picture as a ``data:`` URI (the file read and base64-encoded by the client) and the
    instruction, greedy, ``max_tokens``."""

    name = "llama-server"
    external = True

    def __init__(self, exe: Path, model: Path, mmproj: Path, args, stops: list[str], logdir: Path):
        port = free_port()
        cmd = llama_server_cmd(exe, model, mmproj, port, args.parallel, args.n_ctx, args.threads)
        srv = launch("llama-server", cmd, port, logdir)
        if isinstance(srv, str):
            raise SideSkipped(srv)
        self.srv, self.cmd, self.args, self.stops = srv, cmd, args, stops
        self.system = LONG_SYSTEM if args.long_system else SYSTEM
        # a connection per request (Connection: close), as bench_serve.py: llama-server closes
        # kept-alive connections while a client is about to reuse them
        self.http = httpx.Client(timeout=600, headers={"Connection": "close"})

    def cpu_s(self) -> float:
        return self.srv.cpu_s()

    def _ask(self, p: Path, max_tokens: int) -> tuple[Path, dict[str, Any] | str]:
        mime = "image/png" if p.suffix == ".png" else "image/jpeg"
        url = f"data:{mime};base64," + base64.b64encode(p.read_bytes()).decode()
        body = {
            "model": "m",
            "messages": _messages(self.system, url),
            "temperature": 0,
            "max_tokens": max_tokens,
            "stop": self.stops,
            "stream": False,
        }
        try:
            r = self.http.post(self.srv.url + "/v1/chat/completions", json=body)
        except httpx.HTTPError as exc:
            return p, f"{type(exc).__name__}: {exc}"
        return (p, r.json()) if r.status_code == 200 else (p, f"HTTP {r.status_code}: {r.text[:200]}")

    def run(self, images: list[Path], out: Path, max_tokens: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        captions, generated, prompt, errors = {}, 0, 0, []
        with ThreadPoolExecutor(self.args.parallel) as pool, out.open("w") as fh:
            for fut in as_completed([pool.submit(self._ask, p, max_tokens) for p in images]):
                p, d = fut.result()
                if isinstance(d, str):
                    errors.append(d)
                    continue
                text = d["choices"][0]["message"]["content"].strip()
                usage = d["usage"]
                generated += usage["completion_tokens"]
                prompt += usage["prompt_tokens"] - (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                _keep(fh, captions, p, text)
        return _result(t0, captions, generated, prompt, errors)

    def close(self) -> None:
        self.http.close()
        self.srv.stop()


# --- the loop people write around llama-cpp-python ------------------------------------------------
class LibrarySide(_Side):
    """``Llama`` + the family's mtmd chat handler loaded once, then one ``create_chat_completion``
    per image (system + image + instruction), captions appended to a JSONL file."""

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
                    messages=_messages(self.system, p.resolve().as_uri()),
                    max_tokens=max_tokens,
                    temperature=0.0,
                    repeat_penalty=1.0,
                    stop=list(self.stops),
                )
                text = r["choices"][0]["message"]["content"].strip()
                generated += r["usage"]["completion_tokens"]
                prompt += r["usage"]["prompt_tokens"]
                _keep(fh, captions, p, text)
        return _result(t0, captions, generated, prompt, [])

    def close(self) -> None:
        self.llm.close()


def shell_loop(model: Path, mmproj: Path, images: list[Path], args, system: str) -> dict[str, Any]:
    """``edgevlm chat --json`` as a new process per image: the model loads every time."""
    t0, c0 = time.perf_counter(), os.times()
    generated = 0
    for p in images:
        cmd = [sys.executable, "-m", "edgevlm", "chat", "-m", str(model), "--mmproj", str(mmproj), "-i", str(p)]
        cmd += ["--system", system, "-n", str(args.lengths[0]), "--temp", "0", "--ctx", str(args.n_ctx)]
        cmd += ["--threads", str(args.threads), "--kv", "f16", "--json", PROMPT]
        r = subprocess.run(cmd, capture_output=True, text=True, check=True)
        generated += json.loads(r.stdout)["stats"]["predicted_n"]
    c1 = os.times()
    cpu = (c1.children_user + c1.children_system) - (c0.children_user + c0.children_system)
    return {"wall_s": time.perf_counter() - t0, "generated": generated, "images": len(images), "cpu_s": cpu}
