"""Steps that put a picture's rows in the running streams' batch (``backend.tokrows``), the
rows such a step takes (``runtime.stepcost``), and encodes as steps of their own
(``runtime.encoder``). Real llama.cpp on the tiny generated pairs."""

from __future__ import annotations

import numpy as np
import pytest

import edgevlm
from edgevlm.backend.llama import Backend
from edgevlm.runtime.conversation import Message
from edgevlm.runtime.requests import Client
from edgevlm.runtime.scheduler import WAIT, Request
from edgevlm.runtime.stepcost import MIN_SLICE, StepCosts
from edgevlm.vision.budget import render_views
from edgevlm.vision.images import load_image

from .conftest import make_image

LONG = "root ::= [a-z ] root"  # a reply that never ends by itself


@pytest.fixture(scope="module")
def picture(tmp_path_factory):
    d = tmp_path_factory.mktemp("mix")
    return load_image(str(make_image(d / "p.png", 300, 220, seed=7, mode="gradient")))


def test_token_rows_are_the_rows_llama_cpp_embeds(model_pair):
    pair = model_pair("llava15")
    with Backend(pair.model, pair.mmproj, n_ctx=1024, n_seq_max=3, n_threads=2) as be:
        assert be.mixes_tokens
        toks = be.tokenize_text("A few words to embed, one row each.", True)
        n = len(toks)
        be.decode_multi([(0, t, i, i == n - 1) for i, t in enumerate(toks)])
        want = be.logits(n - 1).copy()
        be.decode_rows([(1, t, i, i == n - 1) for i, t in enumerate(toks)], None)
        assert np.array_equal(be.logits(n - 1), want)  # the same bits: ggml's own dequantizer
        rows = np.random.default_rng(0).standard_normal((6, be.n_embd_inp)).astype(np.float32)
        be.decode_rows([(2, t, i, i == n - 1) for i, t in enumerate(toks)], (0, rows, n + np.arange(6)))
        assert np.allclose(be.logits(n - 1), want, atol=1e-4)  # another sequence's rows beside
        assert be.seq_pos_max(0) == n + 5


@pytest.mark.parametrize(("family", "mixes"), [("llava15", True), ("qwen2vl", False), ("gemma3", False)])
def test_only_models_whose_graph_takes_tokens_as_rows_mix(model_pair, family, mixes):
    # Qwen2-VL: M-RoPE stores 2-D positions for embedding rows; Gemma 3 scales token rows only
    pair = model_pair(family)
    with Backend(pair.model, pair.mmproj, n_ctx=512, n_threads=2) as be:
        assert be.mixes_tokens is mixes


def _newcomer(vlm, picture, text="Describe it."):
    views = render_views(picture, vlm.plan_image(picture))
    return Message("user", text, [v for _, v in views], labels=[lb for lb, _ in views])


def test_a_picture_beside_a_stream_goes_in_the_streams_batch(model_pair, picture):
    pair = model_pair("llava15")
    with edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, n_threads=2, n_seq_max=3) as vlm:
        sched, client, be = vlm.scheduler, Client("t"), vlm.scheduler.backend
        # the reply the picture's request gets alone
        alone = sched.submit(Request(vlm.render([_newcomer(vlm, picture)]), 6, keep_logits=True), client)
        while not alone.done:
            sched.step()
        sched.clear()
        calls = {"rows": 0, "separate": 0}
        rows, separate = be.decode_rows, be.decode_embeddings

        def spy_rows(tokens, embd):
            calls["rows"] += embd is not None
            return rows(tokens, embd)

        def spy_separate(*a, **kw):
            calls["separate"] += 1
            return separate(*a, **kw)

        be.decode_rows, be.decode_embeddings = spy_rows, spy_separate
        try:
            stream = sched.submit(
                Request(vlm.render([Message("user", "Talk.")]), 3000, edgevlm.SamplingParams(0.0, grammar=LONG)),
                client,
            )
            while len(stream.tokens) < 3:
                sched.step()
            beside = sched.submit(Request(vlm.render([_newcomer(vlm, picture)]), 6, keep_logits=True), client)
            assert beside != WAIT
            while not beside.done:
                sched.step()
        finally:
            be.decode_rows, be.decode_embeddings = rows, separate
        assert calls["separate"] == 0 and calls["rows"] > 1  # in slices, each in the streams' batch
        # the same logits as alone, within the float rounding of other slicings
        assert np.corrcoef(alone.first_logits, beside.first_logits)[0, 1] > 0.999
        assert int(np.argmax(alone.first_logits)) == int(np.argmax(beside.first_logits))
        assert beside.error is None and beside.stats.image_tokens_in == alone.stats.image_tokens_in == 576
        assert not stream.done
        sched.cancel(stream)


def test_an_encode_is_a_step_of_its_own_beside_a_stream(model_pair, tmp_path):
    """A picture that arrives beside a running stream is encoded as a step of its own, on the
    step loop's thread (no token that step), then its rows go in like any other."""
    pair = model_pair("llava15")
    pic = load_image(str(make_image(tmp_path / "p.png", 220, 180, seed=1)))
    with edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, n_threads=2, n_seq_max=3) as vlm:
        sched, client = vlm.scheduler, Client("t")
        stream = sched.submit(
            Request(vlm.render([Message("user", "Talk.")]), 3000, edgevlm.SamplingParams(0.0, grammar=LONG)), client
        )
        while len(stream.tokens) < 3:
            sched.step()
        steps, encodes = sched.counters["steps"], sched.encoder.encodes
        second = sched.submit(Request(vlm.render([_newcomer(vlm, pic)]), 2), client)
        unit = next(iter(second.request.prompt.units.values()))
        while 0 not in unit.embeddings:  # its text first (beside the stream), then the encode
            n = len(stream.tokens)
            sched.step()
        assert len(stream.tokens) == n  # the encode was the step: no token
        assert sched.encoder.encodes == encodes + 1 and sched.counters["steps"] > steps
        while not second.done:
            sched.step()
        assert second.error is None and second.stats.images_encoded == 1
        sched.cancel(stream)


def test_mixed_steps_are_steered_to_twice_the_streams_own_step():
    # a CPU-like step: 40 ms for the weights and the output rows, 3.5 ms a prompt row
    costs = StepCosts(prefill_share=1.0, unit=512)
    costs.measured(0, 300, 300 * 3.5)  # a prompt alone
    for _ in range(3):
        costs.measured(2, 0, 40.0)  # two streams' tokens alone
    rows = costs.rows(2, 510, mixed=True)
    for _ in range(30):
        costs.measured(2, rows, 40.0 + 3.5 * rows, mixed=True)
        rows = costs.rows(2, 510, mixed=True)
    step = 40.0 + 3.5 * rows
    assert 0.8 * 80 <= step <= 1.1 * 80  # about 2x the streams' own 40 ms
    # an unmeasured stream count costs about a prompt row more per token, not 2x per stream
    assert costs.gen_cost(4) == pytest.approx(40 + 2 * 3.5)
    # a picture with fewer rows left than the slice says nothing about the time budget
    before = dict(costs.mix_rows)
    costs.measured(2, MIN_SLICE, 40.0 + 3.5 * MIN_SLICE, mixed=True)
    assert costs.mix_rows == before


def test_small_moves_of_the_mixed_slice_add_up_and_each_stream_count_has_its_own():
    # one stream: 36 ms, a row 3.6 ms, share 0.7 -> about 61 ms, 7 rows; from the 4-row floor each
    # step moves the slice by under 1.25x, which a whole-row slice would drop every time
    costs = StepCosts(prefill_share=0.7, unit=512)
    costs.measured(0, 300, 300 * 3.3)
    costs.measured(1, 0, 36.0)
    costs.measured(4, 0, 40.0)
    for _ in range(3):  # a few slow steps (another thread had the cores) drop it to the floor
        costs.measured(1, costs.rows(1, 510, mixed=True), 150.0, mixed=True)
    rows = {1: costs.rows(1, 510, mixed=True), 4: costs.rows(4, 510, mixed=True)}
    assert rows == {1: MIN_SLICE, 4: MIN_SLICE}
    for _ in range(40):
        for n, base in ((1, 36.0), (4, 40.0)):
            costs.measured(n, rows[n], base + 3.6 * rows[n], mixed=True)
            rows[n] = costs.rows(n, 510, mixed=True)
    assert 6 <= rows[1] <= 8  # 36 + 3.6 * 7 = 61 ms = 1.7 x 36
    assert 7 <= rows[4] <= 9  # 40 + 3.6 * 8 = 68 ms = 1.7 x 40: steered apart from one stream's
    assert costs.gen_cost(1) == pytest.approx(36.0)  # (the mixed steps left the streams' own cost alone)


def test_a_first_token_does_not_wait_for_a_whole_picture(model_pair, tmp_path):
    """A follow-up that arrives while a picture is evaluated alone gets its first token from a
    step that takes a slice of the picture (as beside a stream), not the rest of it."""
    pair = model_pair("llava15")
    pic = load_image(str(make_image(tmp_path / "p.png", 320, 240, seed=3)))
    with edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, n_threads=2, n_seq_max=3) as vlm:
        sched, client = vlm.scheduler, Client("t")
        warm = sched.submit(Request(vlm.render([Message("user", "Warm up.")]), 2), client)
        while not warm.done:
            sched.step()
        first = sched.submit(Request(vlm.render([_newcomer(vlm, pic)]), 2), client)
        unit = next(iter(first.request.prompt.units.values()))
        while first.pending[0].is_text or 0 not in unit.embeddings:
            sched.step()
        follow = sched.submit(Request(vlm.render([Message("user", "And now?")]), 4), client)
        # known step costs (not this machine's clock): 40 ms a stream's token, 3.5 ms a prompt row
        sched.costs.row_ms, sched.costs.gen_ms, sched.costs.mix_rows = 3.5, {1: 40.0}, {}
        beside = sched.costs.rows(1, sched.backend.n_batch, sched.backend.mixes_tokens)
        assert MIN_SLICE <= beside <= 12 < unit.chunk(0).n_tokens  # (a slice, far from the whole picture)
        sched.step()
        assert len(follow.tokens) == 1  # its first token, from this step ...
        assert first.feed is not None and 0 < first.feed.done <= beside  # ... with a slice of the picture
        while not first.done or not follow.done:
            sched.step()
        assert first.error is None and follow.error is None


@pytest.mark.parametrize("row_ms", [0.001, 1000.0])
def test_a_picture_alone_goes_one_micro_batch_a_step_whatever_a_row_took(model_pair, picture, row_ms):
    """Alone, a picture's rows go one micro-batch (``n_ubatch``) a step — with or without a
    request that may arrive, and whatever a prompt row was measured to take: nothing measured
    decides the cut of a request that runs alone (#57)."""
    pair = model_pair("llava15")
    with edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, n_threads=2, n_seq_max=2, n_ubatch=64) as vlm:
        sched, client = vlm.scheduler, Client("t")
        assert sched.backend.n_ubatch == 64
        seq = sched.submit(Request(vlm.render([_newcomer(vlm, picture)]), 2), client)
        unit = next(iter(seq.request.prompt.units.values()))
        while seq.pending[0].is_text or 0 not in unit.embeddings:  # the encode, the text before it
            sched.step()
        sched.arrivals = lambda: False
        cuts = []
        while seq.feed is not None or not seq.pending[0].is_text:
            sched.costs.row_ms = row_ms  # (a measured price set: slow or fast, the cut is the same)
            before = sched.counters["image_rows"]
            sched.step()
            cuts.append(sched.counters["image_rows"] - before)
        assert cuts == [64] * 9  # 576 rows
        while not seq.done:
            sched.step()
        assert seq.error is None
        assert seq.stats.image_tokens_in == 576
