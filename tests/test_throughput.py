"""The throughput profile (``SchedulerOptions(profile="throughput")``: caption, batch files, Ray,
``serve --profile throughput``): every step fills the batch with prompt rows and every picture is
encoded as a step of its own — and no greedy reply changes. Real llama.cpp on the tiny pairs."""

from __future__ import annotations

import math

import pytest

import edgevlm
from edgevlm.runtime.conversation import Message
from edgevlm.runtime.requests import Client
from edgevlm.runtime.scheduler import THROUGHPUT, Request, SchedulerOptions
from edgevlm.vision.budget import render_views
from edgevlm.vision.images import load_image

from .conftest import make_image
from .test_serve import Served, data_uri, png, user

FIRST = 3  # tokens compared: the first ones, before batched kernels' rounding can part them


def _message(vlm, picture, text):
    views = render_views(picture, vlm.plan_image(picture))
    return Message("user", text, [v for _, v in views], labels=[lb for lb, _ in views])


def _run(pair, pictures, options):
    """A text stream, then three picture requests while it runs; every reply's tokens, the
    calls that fed picture rows, the scheduler's counters and where its encodes ran."""
    with edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, n_threads=2, n_seq_max=4, scheduler_options=options) as vlm:
        sched, client, be = vlm.scheduler, Client("t"), vlm.scheduler.backend
        feeds = {"calls": 0}
        rows, separate = be.decode_rows, be.decode_embeddings

        def spy_rows(tokens, embd):
            feeds["calls"] += embd is not None
            return rows(tokens, embd)

        def spy_separate(*a, **kw):
            feeds["calls"] += 1
            return separate(*a, **kw)

        be.decode_rows, be.decode_embeddings = spy_rows, spy_separate
        try:
            greedy = edgevlm.SamplingParams(0.0)
            stream = sched.submit(Request(vlm.render([Message("user", "Tell me a story.")]), 12, greedy), client)
            while len(stream.tokens) < 2:
                sched.step()
            seqs = [
                sched.submit(Request(vlm.render([_message(vlm, p, f"Picture {i}: what is it?")]), 6, greedy), client)
                for i, p in enumerate(pictures)
            ]
            while not all(s.done for s in [stream, *seqs]):
                sched.step()
        finally:
            be.decode_rows, be.decode_embeddings = rows, separate
        assert all(s.error is None for s in [stream, *seqs])
        tokens = [list(s.tokens) for s in [stream, *seqs]]
        image_tokens = seqs[0].stats.image_tokens_in
        return tokens, feeds["calls"], dict(sched.counters), sched.encoder.encodes, image_tokens, be.n_batch


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    d = tmp_path_factory.mktemp("tp")
    return [load_image(str(make_image(d / f"{i}.png", 240 + 30 * i, 200, seed=70 + i))) for i in range(3)]


@pytest.mark.parametrize("family", ["llava15", "qwen2vl"])
def test_throughput_mode_gives_the_same_greedy_first_tokens(model_pair, pictures, family):
    pair = model_pair(family)
    lat, lat_feeds, lat_counters, lat_where, n_img, n_batch = _run(pair, pictures, SchedulerOptions())
    thr, thr_feeds, thr_counters, thr_where, _, _ = _run(pair, pictures, THROUGHPUT)
    assert [t[:FIRST] for t in thr] == [t[:FIRST] for t in lat]
    assert thr_counters["generated"] == lat_counters["generated"]
    # throughput: every picture a step of its own, its rows in as few batches as they fill
    assert thr_where == lat_where == 3
    assert thr_feeds <= 3 * math.ceil(n_img / (n_batch - 4))
    assert thr_counters["steps"] < lat_counters["steps"]


def test_an_unknown_profile_is_refused_in_one_line():
    with pytest.raises(ValueError, match="scheduler profile 'fast': use one of latency, throughput"):
        SchedulerOptions(profile="fast")


def test_serve_in_throughput_mode_says_so_and_encodes_in_the_step_loop(model_pair):
    s = Served(model_pair("llava15"), "--profile", "throughput", "--max-tokens", "4")
    try:
        st = s.status()
        assert st["profile"] == "throughput"
        assert st["threads"] == {"cores": 2, "encodes": 0, "encode_ms": 0.0}
        r = s.client().chat.completions.create(
            model="m", messages=[user("What is it?", data_uri(png(200, 150, seed=5)))], max_tokens=4, temperature=0
        )
        assert r.choices[0].finish_reason in ("length", "stop")
        th = s.status()["threads"]
        assert th["encodes"] == 1
    finally:
        s.stop()
