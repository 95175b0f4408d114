"""The sequence scheduler (``edgevlm.runtime.scheduler``): several requests in flight over one
loaded model.

Real llama.cpp on the tiny generated pairs: replies generated in one batch start from the same
logits as one-at-a-time replies, prefixes are shared through ``seq_cp``, the KV cells of the
context are never over-committed, and ``edgevlm caption --parallel`` captions every image."""

from __future__ import annotations

import json

import numpy as np
import pytest

import edgevlm
from edgevlm.backend.llama import Backend
from edgevlm.caption import Captioner, CaptionSettings, caption_slots
from edgevlm.errors import InputError
from edgevlm.plan.context import ContextBudget
from edgevlm.runtime.conversation import Message
from edgevlm.runtime.scheduler import WAIT, Request
from edgevlm.vision.budget import render_views
from edgevlm.vision.images import load_image

from .conftest import make_image, run_cli
from .reference import stock_logits

SYSTEM = "You write short captions for a photo dataset."
PROMPT = "Caption this."


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    d = tmp_path_factory.mktemp("par")
    sizes = [(320, 240), (400, 400), (240, 320), (500, 300), (300, 300), (640, 480)]
    return [
        load_image(str(make_image(d / f"{i}.png", w, h, seed=40 + i, mode="gradient" if i % 2 else "noise")))
        for i, (w, h) in enumerate(sizes)
    ]


def _load(pair, slots, n_ctx=4096):
    return edgevlm.load(
        pair.model, pair.mmproj, n_ctx=n_ctx, kv="f16", n_seq_max=slots, options=edgevlm.EngineOptions(system=SYSTEM)
    )


def _message(eng, img) -> Message:
    """A one-turn caption message for picture ``img``, as captioning makes it."""
    views = render_views(img, eng.plan_image(img))
    return Message("user", PROMPT, [v for _, v in views], labels=[lb for lb, _ in views])


def _one_at_a_time_logits(eng, ref, img):
    """The logits after the caption prompt evaluated alone, from an empty cache, through mtmd's
    stock path on a backend of its own (``tests.reference``: no scheduler, no batch)."""
    msg = _message(eng, img)
    prompt = eng.render([msg])
    try:
        return stock_logits(ref, prompt, {eng.scheduler.images.key(v): v for v in msg.images})
    finally:
        prompt.release()


def _request(eng, i, img, max_tokens=8, stop=(), keep_logits=False):
    """A one-turn caption request for picture ``img``, as captioning makes it."""
    return Request(
        eng.render([_message(eng, img)]),
        max_tokens,
        stops=tuple(stop) + tuple(eng.default_stops),
        tag=i,
        keep_logits=keep_logits,
    )


def _run_all(eng, imgs, max_tokens=8, stop=(), keep_logits=False):
    """Submit every picture as slots free up; returns {index: Sequence or error} and the WAIT
    count."""
    sched = eng.scheduler
    out, queue, waits = {}, list(enumerate(imgs)), 0
    while queue or sched.busy:
        while queue and sched.has_free_slot():
            i, img = queue[0]
            try:
                r = sched.submit(_request(eng, i, img, max_tokens, stop, keep_logits))
            except InputError as exc:
                out[i] = exc
                queue.pop(0)
                continue
            if r == WAIT:
                waits += 1
                break
            queue.pop(0)
        for seq in sched.step():
            out[seq.tag] = seq
    return out, waits


@pytest.mark.parametrize("family", ["llava15", "qwen2vl"])
def test_batched_replies_start_from_the_one_at_a_time_logits(model_pair, pictures, family):
    pair = model_pair(family)
    eng = _load(pair, 4)
    try:
        with Backend(pair.model, pair.mmproj, n_ctx=4096, n_threads=2, type_k="f16", type_v="f16") as ref:
            want = [_one_at_a_time_logits(eng, ref, img) for img in pictures]
        got, _ = _run_all(eng, pictures, keep_logits=True)
        for i, ref in enumerate(want):
            c = got[i]
            assert c.error is None and c.stats is not None
            assert np.corrcoef(ref, c.first_logits)[0, 1] > 0.999
            assert int(np.argmax(ref)) == int(np.argmax(c.first_logits))
            assert c.stats.predicted_n == 8 and c.finish_reason == "length"
        # the system prompt and turn header are evaluated once, then shared (seq_cp)
        cached = sorted(got[i].stats.cached_n for i in got)
        assert cached[0] == 0 and cached[1] > 10
        assert all(got[i].stats.prompt_n + got[i].stats.cached_n > got[i].stats.image_tokens for i in got)
    finally:
        eng.close()


def test_one_slot_gives_exactly_the_engine_captions(model_pair, pictures):
    eng = _load(model_pair("llava15"), 1)
    try:
        want = []
        for img in pictures[:3]:  # one turn each, nothing remembered between them
            want.append(eng.chat(PROMPT, [img], max_tokens=10).text)
        got, _ = _run_all(eng, pictures[:3], max_tokens=10)
        assert [got[i].reply for i in range(3)] == want
        # stop strings end a reply where the engine ends it
        stop = want[0][3:5]
        got, _ = _run_all(eng, pictures[:1], max_tokens=10, stop=[stop])
        assert got[0].reply == want[0][: want[0].index(stop)] and got[0].finish_reason == "stop"
    finally:
        eng.close()


def test_a_conversation_keeps_its_cache_while_another_request_runs(model_pair, pictures):
    """A new request takes an empty (or the least recently used) slot, not the one holding a
    conversation it shares a few tokens with; the conversation's next turn finds its cache."""
    eng = _load(model_pair("llava15"), 2)
    try:
        conv = eng.conversation()
        first = conv.chat("What is it?", [pictures[0]], max_tokens=4, temperature=0.0)
        held = eng.n_ctx_used
        got, _ = _run_all(eng, pictures[1:2])  # one caption, in the other slot
        assert got[0].error is None and got[0].stats.cached_n > 0  # the system prompt, by seq_cp
        follow = conv.chat("And the colours?", max_tokens=4, temperature=0.0)
        assert follow.stats.cached_n >= held - 1 and follow.stats.images_encoded == 0
        assert follow.stats.prompt_n < 40 < first.stats.prompt_n
    finally:
        eng.close()


def test_a_full_context_waits_instead_of_overcommitting(model_pair, pictures):
    # LLaVA-1.5 tiny: 576 image tokens + ~40 text; 1600 cells hold two prompts with replies
    eng = _load(model_pair("llava15"), 4, n_ctx=1600)
    try:
        sched = eng.scheduler
        peak = 0
        orig = sched.step

        def step():
            nonlocal peak
            peak = max(peak, sched.busy)
            # what llama.cpp holds per sequence (1-D positions: one cell each); prefixes shared
            lens = [eng.backend.seq_pos_max(s.id) + 1 for s in sched.slots if s.kv]
            used = sched.kv.used()  # the accounted items (pictures being fed come on top)
            assert used == sum({h.uid: h.item.n_tokens for s in sched.slots for h in s.kv}.values())
            held = sched.cells_used()  # ... and what llama.cpp holds: with pictures being fed
            assert held <= eng.n_ctx
            if lens:  # (before the first step nothing is evaluated yet)
                assert max(lens) <= held
                assert held + (len(lens) - 1) * min(lens) >= sum(lens)
            return orig()

        sched.step = step
        got, waits = _run_all(eng, pictures[:4], max_tokens=16)
        assert waits > 0 and peak == 2
        assert sorted(got) == [0, 1, 2, 3] and all(c.error is None for c in got.values())
    finally:
        eng.close()


def test_a_prompt_that_can_never_fit_fails_alone(model_pair, pictures):
    eng = _load(model_pair("llava15"), 2, n_ctx=512)
    try:
        got, _ = _run_all(eng, pictures[:2])
        assert all(isinstance(c, InputError) and "context holds 512" in str(c) for c in got.values())
        # the engine is usable afterwards
        assert eng.n_ctx_used == 0
    finally:
        eng.close()


def test_slot_count_follows_the_context():
    s = CaptionSettings(max_tokens=128)
    assert caption_slots(4096, 576, s) == 4
    assert caption_slots(2048, 576, s) == 2
    assert caption_slots(1024, 576, s) == 1
    assert caption_slots(8192, 576, s, want=2) == 2
    assert caption_slots(8192, None, CaptionSettings(max_tokens=64, image_tokens=256)) == 4
    assert ContextBudget(100).prompts_in_flight(500, 1, 32, 4) == 1


def test_merged_captions_are_in_flight_together(model_pair, pictures):
    """Merging goes through the scheduler like any picture: four merged images in flight."""
    eng = edgevlm.load(model_pair("llava15").model, model_pair("llava15").mmproj, n_ctx=4096, kv="f16", n_seq_max=4)
    try:
        cap = Captioner(eng, CaptionSettings(merge="ratio:0.5", max_tokens=6), "m", "d")
        assert cap.slots == 4
        sched = eng.scheduler
        peak, orig = 0, sched.step

        def step():
            nonlocal peak
            peak = max(peak, sched.busy)
            return orig()

        sched.step = step
        from edgevlm.caption.inputs import InputItem

        items = [InputItem(p.source, p.source, True) for p in pictures]
        results = list(cap.run(items))
        assert peak == 4 and [r.status for r in results] == ["done"] * len(pictures)
        for r in results:
            st = r.record.stats
            assert st["image_tokens_in"] == 576 and st["image_tokens_out"] == 288 == r.record.image_tokens
    finally:
        eng.close()


def test_caption_parallel_cli_captions_every_image_deterministically(model_pair, tmp_path):
    pair = model_pair("llava15")
    d = tmp_path / "photos"
    d.mkdir()
    for i in range(7):
        make_image(d / f"{i}.png", 200 + 20 * i, 180, seed=70 + i, mode="gradient")
    runs = []
    for k in range(2):
        out = tmp_path / f"c{k}.jsonl"
        r = run_cli(
            "caption",
            "--model",
            str(pair.model),
            "--mmproj",
            str(pair.mmproj),
            str(d),
            "--out",
            str(out),
            "-n",
            "6",
            "--parallel",
            "4",
            "--progress",
            "json",
        )
        assert r.returncode == 0, r.stderr
        recs = [json.loads(ln) for ln in out.read_text().splitlines()]
        assert sorted(x["path"] for x in recs) == sorted(str(p) for p in d.iterdir())
        runs.append({x["path"]: x["caption"] for x in recs})
        summary = json.loads(r.stderr.splitlines()[-1])
        assert summary["done"] == 7 and summary["cached_tokens"] > 0
        assert 0 < summary["engine_share"] <= 1.0  # llama.cpp time is attributed, not double-counted
    assert runs[0] == runs[1]


def test_caption_merge_keeps_four_images_in_flight(model_pair, tmp_path):
    """Done-when: ``edgevlm caption --merge ratio:0.5 --parallel 4`` keeps four images in flight."""
    pair = model_pair("llava15")
    d = tmp_path / "photos"
    d.mkdir()
    for i in range(8):
        make_image(d / f"{i}.png", 240 + 10 * i, 200, seed=90 + i)
    out = tmp_path / "m.jsonl"
    r = run_cli(
        "caption",
        "--model",
        str(pair.model),
        "--mmproj",
        str(pair.mmproj),
        str(d),
        "--out",
        str(out),
        "-n",
        "5",
        "--merge",
        "ratio:0.5",
        "--parallel",
        "4",
        "--progress",
        "json",
    )
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stderr.splitlines()[-1])
    assert summary["done"] == 8 and summary["in_flight_max"] == 4
    recs = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert all(x["image_tokens"] == 288 and x["stats"]["image_tokens_in"] == 576 for x in recs)


def test_parallel_zero_is_a_clean_error(model_pair, tmp_path):
    pair = model_pair("llava15")
    make_image(tmp_path / "a.png", 64, 64)
    r = run_cli("caption", "--model", str(pair.model), "--mmproj", str(pair.mmproj), str(tmp_path), "--parallel", "0")
    assert r.returncode == 2 and "--parallel 0" in r.stderr and "Traceback" not in r.stderr
