"""Clips wherever pictures go: ``chat --video`` (and the library's ``Clip``), ``serve`` with
``video_url`` parts (and the page's budget route), ``caption`` over folders that hold clips, and
batch files — each sends exactly the frames ``edgevlm budget`` predicts, each frame after its
timestamp, and a broken clip is one error that ends nothing else. Real clips (PyAV), real
llama.cpp on generated pairs and the demo model, real subprocesses, the official client."""

from __future__ import annotations

import base64
import json

import httpx
import pytest

import edgevlm
from edgevlm.runtime.engine import Clip
from edgevlm.serve.options import ServeOptions
from edgevlm.vision.video import VideoBudget
from edgevlm_testkit import FAMILIES

from .conftest import run_cli
from .test_serve import data_uri, png
from .test_serve_faults import InProcess
from .test_video import make_clip

ALL_FAMILIES = sorted(FAMILIES)


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    d = tmp_path_factory.mktemp("use")
    return {
        "moving": make_clip(d / "moving.mp4", 4),
        "cut": make_clip(d / "cut.mp4", 4, "cut"),
        "broken": str(_broken(d / "broken.mp4")),
    }


def _broken(path):
    path.write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8)
    return path


def uri(path: str) -> str:
    with open(path, "rb") as fh:
        return "data:video/mp4;base64," + base64.b64encode(fh.read()).decode()


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_a_turn_sends_the_frames_the_plan_chose(family, model_pair, clips):
    """The image tokens llama.cpp evaluated for the clip are the plan's, for every family; each
    frame went in after its timestamp."""
    pair = model_pair(family)
    with edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, n_threads=2) as vlm:
        eng = vlm.conversation(video=VideoBudget(tokens=1200))
        result = eng.chat("What happens?", [Clip(clips["moving"], "moving.mp4")], max_tokens=2, temperature=0)
        (pic,) = eng.pictures
        msg = eng.messages[0]
        assert result.stats.image_tokens == pic.tokens <= 1200
        assert len(msg.images) == len(msg.labels) >= 1  # the frames, each a view with its timestamp
        assert len(msg.labels) >= 2 or pic.tokens > 600  # (several, unless one frame takes half the budget)
        stamps = [float(lb.strip("[]").split(":")[1]) + 60 * int(lb.strip("[]").split(":")[0]) for lb in msg.labels]
        assert stamps == sorted(stamps) and pic.name == "moving.mp4"


@pytest.mark.slow
def test_chat_sends_what_budget_predicts(clips):
    """The CLI: ``edgevlm budget CLIP`` and ``edgevlm chat --video CLIP`` agree token for token."""
    args = ["--model", "demo", "--video-tokens", "256"]
    planned = run_cli("budget", clips["cut"], *args, "--json")
    assert planned.returncode == 0, planned.stderr
    plan = json.loads(planned.stdout)
    out = run_cli("chat", *args, "--video", clips["cut"], "--temp", "0", "-n", "4", "--json", "Describe the image.")
    assert out.returncode == 0, out.stderr
    stats = json.loads(out.stdout)["stats"]
    assert stats["image_tokens"] == plan["total_tokens"] > 0
    assert [f["t"] for f in plan["frames"] if f["kept"]] == [0.0, 2.0]  # the scene cut's second scene
    bad = run_cli("chat", *args, "--video", clips["broken"], "Hi")
    assert bad.returncode == 2 and "broken.mp4" in bad.stderr and "Traceback" not in bad.stderr
    assert [line for line in bad.stderr.splitlines() if line.startswith("Error")] == [
        f"Error: {clips['broken']}: not a readable video (Invalid data found when processing input)"
    ]


def test_the_server_answers_video_url_parts(model_pair, clips):
    pair = model_pair("qwen2vl")
    vlm = edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, n_threads=2, n_seq_max=2)
    srv = InProcess(vlm, ServeOptions(max_tokens=4))
    try:
        c = srv.client()

        def ask(*parts):
            return c.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": [{"type": "text", "text": "What happens?"}, *parts]}],
                max_tokens=2,
                temperature=0,
            )

        video = {"type": "video_url", "video_url": {"url": uri(clips["moving"])}}
        r = ask(video)
        text_only = ask()
        budget = httpx.post(
            srv.url + "/v1/edgevlm/budget",
            json={"video_url": {"url": uri(clips["moving"])}, "name": "moving.mp4"},
            timeout=60,
        ).json()
        assert budget["kind"] == "video" and len(budget["thumbnails"]) == sum(f["kept"] for f in budget["frames"])
        assert budget["thumbnails"][0].startswith("data:image/jpeg;base64,")
        frames_text = r.usage.prompt_tokens - text_only.usage.prompt_tokens
        assert frames_text >= budget["total_tokens"] > 0  # (plus the timestamps' text)
        # a picture and a clip in one message
        both = ask({"type": "image_url", "image_url": {"url": data_uri(png(seed=5))}}, video)
        assert both.usage.prompt_tokens > r.usage.prompt_tokens
        # a broken clip is a 400 naming it; the server goes on
        import openai

        with pytest.raises(openai.BadRequestError) as err:
            ask({"type": "video_url", "video_url": {"url": uri(clips["broken"])}, "name": "broken.mp4"})
        assert "broken.mp4" in err.value.message
        assert ask(video).choices[0].finish_reason in ("stop", "length")
        assert srv.status()["memory"]["host"]["in_use_bytes"] == 0  # (what the clips held is given back)
    finally:
        srv.stop()
        vlm.close()


def test_caption_writes_one_record_per_clip_with_its_frames(tmp_path, clips):
    folder = tmp_path / "media"
    folder.mkdir()
    for name in ("moving", "cut", "broken"):
        (folder / f"{name}.mp4").write_bytes(open(clips[name], "rb").read())
    (folder / "still.png").write_bytes(png(seed=7))
    out = tmp_path / "captions.jsonl"
    run = run_cli("caption", str(folder), "--model", "demo", "--video-tokens", "320", "-n", "4", "--out", str(out))
    assert run.returncode == 4, run.stderr  # one input failed, the others are captioned
    recs = {r["path"].rsplit("/", 1)[-1]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(recs) == {"moving.mp4", "cut.mp4", "broken.mp4", "still.png"}
    assert recs["cut.mp4"]["frames"] == [0.0, 2.0] and recs["cut.mp4"]["image_tokens"] == 128
    assert 2 <= len(recs["moving.mp4"]["frames"]) <= 5 and recs["moving.mp4"]["image_tokens"] <= 320
    assert recs["broken.mp4"]["error"] and recs["broken.mp4"]["error_kind"] == "input"
    assert "frames" not in recs["still.png"] and recs["still.png"]["caption"] is not None
    again = run_cli("caption", str(folder), "--model", "demo", "--video-tokens", "320", "-n", "4", "--out", str(out))
    assert "captioned 0 · skipped 4 (1 failed earlier)" in again.stderr  # resumed: the clips are done


def test_a_batch_line_with_a_video_is_answered(tmp_path, clips):
    lines = [
        {
            "custom_id": "clip",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "demo",
                "max_tokens": 4,
                "temperature": 0,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "Describe the image."},
                            {"type": "video_url", "video_url": {"url": uri(clips["cut"])}},
                        ],
                    }
                ],
            },
        }
    ]
    req = tmp_path / "requests.jsonl"
    req.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run = run_cli("batch", str(req), "--model", "demo", "--video-tokens", "256")
    assert run.returncode == 0, run.stderr
    (out,) = [json.loads(x) for x in (tmp_path / "requests_output.jsonl").read_text().splitlines()]
    assert out["response"]["status_code"] == 200
    assert out["response"]["body"]["usage"]["prompt_tokens"] > 128


def test_an_old_clip_becomes_its_summary_when_the_context_fills(model_pair, clips):
    """A clip is one picture to the session: when the next one needs the room, the old clip's
    frames give way to the model's summary of them, as an old picture's would."""
    pair = model_pair("llava15")
    with edgevlm.load(pair.model, pair.mmproj, n_ctx=2048, n_threads=2) as vlm:
        eng = vlm.conversation()
        eng.chat("What happens?", [Clip(clips["moving"], "first.mp4")], max_tokens=4, temperature=0)
        second = eng.chat("And now?", [Clip(clips["moving"], "second.mp4")], max_tokens=4, temperature=0)
        first, latest = eng.pictures
        assert first.name == "first.mp4" and not first.in_context and first.summary
        assert latest.in_context and second.stats.image_tokens == latest.tokens >= 576
        assert any("first.mp4" in n and "summary" in n for n in eng.notices)


def test_a_clips_default_per_frame_budget_is_the_planners(model_pair):
    """One fact in one place: with no per-picture budget given, frames are capped as the planner
    caps a picture (``plan.planner.image_budget``)."""
    from edgevlm.model.gguf_info import load_projector
    from edgevlm.plan.planner import image_budget
    from edgevlm.vision.framecost import per_picture

    for family in ALL_FAMILIES:
        proj = load_projector(model_pair(family).mmproj)
        assert per_picture(proj, None) == image_budget(proj)[0], family


def _colour_cut(path, seconds: int = 4, fps: int = 10) -> str:
    """Full red, then full green of the same luma: a cut only colour shows."""
    import av
    import numpy as np

    from .test_video import CODEC

    with av.open(str(path), "w") as c:
        s = c.add_stream(CODEC, rate=fps)
        s.width, s.height, s.pix_fmt = 160, 120, "yuv420p"
        for i in range(seconds * fps):
            img = np.zeros((120, 160, 3), np.uint8)
            img[:] = (200, 0, 0) if i < seconds * fps // 2 else (0, 102, 0)
            for p in s.encode(av.VideoFrame.from_ndarray(img, format="rgb24")):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return str(path)


@pytest.mark.slow
def test_a_clips_whole_footprint_fits_and_two_clips_share_the_room(model_pair, tmp_path):
    """With the default budget a long clip takes the room its turn has, labels and all: the turn
    fits (the labels' tokens were once left out and a 20 s clip overflowed). Two clips in one
    message each get frames."""
    long = make_clip(tmp_path / "long.mp4", 20)
    pair = model_pair("qwen2vl")
    with edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, n_threads=2) as vlm:
        eng = vlm.conversation()
        r = eng.chat("What happens?", [Clip(long, "long.mp4")], max_tokens=2, temperature=0)
        assert r.stats.n_ctx_used <= 4096 and len(eng.messages[0].images) >= 10
        eng.reset()
        eng.chat("And these?", [Clip(long, "a.mp4"), Clip(long, "b.mp4")], max_tokens=2, temperature=0)
        a, b = eng.pictures
        assert a.tokens > 0 and b.tokens > 0
        assert a.tokens + b.tokens <= vlm.scheduler.budget.image_room(2)
        # each clip's summary is remembered by all its frames: two clips that start alike differ
        short = make_clip(tmp_path / "short.mp4", 4)
        eng.reset()
        eng.chat("Now?", [Clip(short, "short.mp4"), Clip(long, "long.mp4")], max_tokens=2, temperature=0)
        assert eng.pictures[0].image.sha256 != eng.pictures[1].image.sha256


def test_a_follow_up_after_a_clip_is_answered_with_evict(model_pair, clips):
    """The page's follow-ups send the whole history with edgevlm.evict: the earlier clip is
    planned as it was when it was the last message, so the follow-up fits."""
    pair = model_pair("llava15")
    vlm = edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, n_threads=2, n_seq_max=2)
    srv = InProcess(vlm, ServeOptions(max_tokens=4))
    try:
        c = srv.client()
        first = [
            {"type": "text", "text": "What happens?"},
            {"type": "video_url", "video_url": {"url": uri(clips["moving"])}},
        ]
        r = c.chat.completions.create(
            model="m", messages=[{"role": "user", "content": first}], max_tokens=4, temperature=0
        )
        history = [
            {"role": "user", "content": first},
            {"role": "assistant", "content": r.choices[0].message.content or ""},
            {"role": "user", "content": "And then?"},
        ]
        again = c.chat.completions.create(
            model="m", messages=history, max_tokens=4, temperature=0, extra_body={"edgevlm": {"evict": "summary"}}
        )
        assert again.choices[0].finish_reason in ("stop", "length")
        assert again.usage.prompt_tokens_details.cached_tokens > 0  # the same frames: the prefix is reused
    finally:
        srv.stop()
        vlm.close()


def test_colour_cuts_are_seen_and_huge_frames_refused(tmp_path, model_pair):
    from edgevlm.errors import InputError
    from edgevlm.model.gguf_info import load_projector
    from edgevlm.vision.video import plan_video

    proj = load_projector(model_pair("qwen2vl").mmproj)
    plan, _ = plan_video(_colour_cut(tmp_path / "colour.mp4"), proj, VideoBudget(tokens=4000))
    assert [f.t for f in plan.kept] == [0.0, 2.0] and plan.kept[1].reason == "scene cut"
    with pytest.raises(InputError, match="over the 10,000-pixel limit"):
        plan_video(_colour_cut(tmp_path / "c2.mp4"), proj, VideoBudget(tokens=4000), max_pixels=10_000)
