"""The one intake (``runtime.intake``): one "is this a video" rule, one ``detail`` mapping, one
place in the package that budgets a picture or plans a clip, and the same clip costing the same
tokens and remembered by the same key in chat, serve, caption and batch files — real clips
(PyAV), the demo model, real subprocesses for the CLIs."""

from __future__ import annotations

import ast
import base64
import hashlib
import io
import json
import re
from pathlib import Path

import pytest
from PIL import Image

import edgevlm
from edgevlm.hub.demo import trained_demo_pair
from edgevlm.runtime.intake import LOW_DETAIL_TOKENS, Clip, MediaRef, ReplySpec, load_media, media_kind
from edgevlm.serve.openai import parse_chat_request
from edgevlm.serve.options import ServeOptions
from edgevlm.serve.service import ChatService
from edgevlm.vision.images import load_image

from .conftest import run_cli
from .test_serve import png
from .test_video import make_clip

PKG = Path(__file__).resolve().parent.parent / "edgevlm"
N = 8  # the reply every caller asks for: the same room for the clip


def gif(frames: int) -> bytes:
    imgs = [Image.new("RGB", (32, 32), (40 * i % 256, 90, 200)) for i in range(frames)]
    buf = io.BytesIO()
    imgs[0].save(buf, "GIF", save_all=True, append_images=imgs[1:], duration=100, loop=0)
    return buf.getvalue()


def test_one_rule_says_what_a_video_is(tmp_path):
    clip = make_clip(tmp_path / "c.mp4", 1)
    data = Path(clip).read_bytes()
    renamed = tmp_path / "clip.bin"  # a clip by its content, whatever its name
    renamed.write_bytes(data)
    assert media_kind(MediaRef(clip)) == "video"
    assert media_kind(MediaRef(str(renamed))) == "video"
    assert media_kind(MediaRef(data)) == "video"
    assert media_kind(MediaRef(gif(3))) == "video"  # an animated GIF is a clip
    assert media_kind(MediaRef(gif(1))) == "image"
    assert media_kind(MediaRef(png())) == "image"
    assert media_kind(MediaRef(b"\x00" * 64, name="upload.mp4")) == "video"  # bytes named by their file
    assert media_kind(MediaRef(data, kind="image")) == "image"  # the caller's stated kind wins (an API part)
    # chat's early check takes the same rule: the renamed clip is a clip, a picture is decoded
    kinds = [type(m).__name__ for m in load_media([str(renamed), str(clip), png()])]
    assert kinds == ["MediaRef", "MediaRef", "LoadedImage"]
    with pytest.raises(edgevlm.InputError, match="no such video file"):
        load_media([Clip(str(tmp_path / "gone.mp4"))])


def test_detail_low_is_one_budget_for_requests_and_the_budget_route():
    pair = trained_demo_pair()
    assert pair is not None
    with edgevlm.load(*map(str, pair), n_ctx=4096, n_threads=2) as vlm:
        intake = vlm.intake()
        low = intake.budget_for("low")
        assert low.tiles == "off" and low.tokens == min(intake.budget.tokens or LOW_DETAIL_TOKENS, LOW_DETAIL_TOKENS)
        assert intake.budget_for("auto") == intake.budget_for("high") == intake.budget
        big = load_image(png(1600, 1200, seed=3))
        made = intake.views(MediaRef(big, detail="low"))
        assert made.tokens == intake.plan_image(big, "low").total_tokens <= low.tokens


def test_no_second_place_budgets_a_picture_or_plans_a_clip():
    """``plan_video(`` and ``ImageBudget.plan`` are called in the intake alone (and inside
    ``vision``, where they are defined); a picture's ``ImageBudget(`` is made there alone too
    (``Intake.for_caller``: chat's ``LoadedModel.intake()`` and ``edgevlm budget`` alike), and a
    clip's ``VideoBudget(...)`` is an option's default (``VideoBudget()``) or the flags
    ``cli/common.video_options`` parses — no command builds its own."""
    calls: dict[str, list[str]] = {}
    budgets: dict[str, list[str]] = {}
    for p in PKG.rglob("*.py"):
        rel = str(p.relative_to(PKG))
        if rel.startswith("vision/"):
            continue
        for n in ast.walk(ast.parse(p.read_text(encoding="utf-8"))):
            if isinstance(n, ast.Call):
                f = n.func
                name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
                if name in ("plan_video", "plan_image", "render_views", "compact_view") or (
                    name == "plan" and isinstance(f, ast.Attribute) and "budget" in ast.unparse(f.value).lower()
                ):
                    calls.setdefault(rel, []).append(ast.unparse(n)[:60])
                made_here = name == "ImageBudget" or (name == "VideoBudget" and (n.args or n.keywords))
                if made_here and not rel.startswith("runtime/intake/") and rel != "cli/common.py":
                    budgets.setdefault(rel, []).append(ast.unparse(n)[:60])
    outside = {k: v for k, v in calls.items() if not k.startswith("runtime/intake/")}
    # ``plan_image`` callers outside the intake go through ``Intake.plan_image`` (a method of it)
    assert all(
        c.startswith(("self.intake.plan_image", "self.intake().plan_image", "Intake("))
        for v in outside.values()
        for c in v
    ), outside
    assert any("plan_video" in c for k, v in calls.items() if k.startswith("runtime/intake/") for c in v)
    assert not budgets, budgets


def uri(path: str) -> str:
    return "data:video/mp4;base64," + base64.b64encode(Path(path).read_bytes()).decode()


def test_the_same_clip_costs_the_same_and_has_one_key_in_chat_serve_caption_and_batch(tmp_path):
    pair = trained_demo_pair()
    assert pair is not None
    folder = tmp_path / "media"
    folder.mkdir()
    clip = make_clip(folder / "moving.mp4", 3)
    file_key = hashlib.sha256(Path(clip).read_bytes()).hexdigest()
    body = {
        "model": "demo",
        "max_tokens": N,
        "temperature": 0,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Describe the image."},
                    {"type": "video_url", "video_url": {"url": uri(clip)}},
                ],
            }
        ],
    }
    with edgevlm.load(*map(str, pair), n_ctx=4096, n_threads=2) as vlm:
        # chat (the library's conversation)
        eng = vlm.conversation()
        result = eng.chat("Describe the image.", [Clip(clip, "moving.mp4")], max_tokens=N, temperature=0)
        (pic,) = eng.pictures
        assert result.stats.image_tokens == pic.tokens > 0
        # serve (and batch files: the same service) — prepared as a server prepares a request
        service = ChatService(vlm, ServeOptions(max_tokens=N))
        lease = service.admit()
        try:
            turn = service.prepare(parse_chat_request(body), lease, {}, ReplySpec(N))
        finally:
            lease.release()
        (served,) = turn.pictures
        notices = turn.notes + turn.notices
    assert pic.image.sha256 == served.image.sha256 == file_key
    assert served.tokens == pic.tokens
    # caption (a real subprocess): the record's tokens and its file's hash
    out = tmp_path / "captions.jsonl"
    run = run_cli("caption", str(folder), "--model", "demo", "--ctx", "4096", "-n", str(N), "--out", str(out))
    assert run.returncode == 0, run.stderr
    (rec,) = map(json.loads, out.read_text().splitlines())
    assert rec["image_tokens"] == pic.tokens and rec["sha256"] == file_key
    # batch (a real subprocess): the reply says what the clip cost
    req = tmp_path / "requests.jsonl"
    line = {"custom_id": "clip", "method": "POST", "url": "/v1/chat/completions", "body": body}
    req.write_text(json.dumps(line) + "\n")
    run = run_cli("batch", str(req), "--model", "demo", "--ctx", "4096")
    assert run.returncode == 0, run.stderr
    (answer,) = [json.loads(x) for x in (tmp_path / "requests_output.jsonl").read_text().splitlines()]
    said = " ".join(answer["response"]["body"]["edgevlm"]["notices"])
    (tokens,) = re.findall(r"frame\(s\) of [\d.]+ s, ([\d,]+) tokens", said)
    assert int(tokens.replace(",", "")) == pic.tokens
    assert any(f"{pic.tokens:,} tokens" in n for n in notices)
