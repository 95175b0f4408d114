"""One request never harms another, in-process on real llama.cpp (tiny generated pairs): a
decode that fails for one sequence, replies that outgrow a small context, image units evicted
while prompts wait, conversations that reset on one model, a template that refuses, a stop
string inside a token, a grammar llama.cpp cannot parse, shared state touched from threads."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

import edgevlm
from edgevlm.errors import BackendError, ContextExceeded, InputError
from edgevlm.runtime.conversation import Message
from edgevlm.runtime.requests import Client
from edgevlm.runtime.sched_options import THROUGHPUT
from edgevlm.runtime.scheduler import WAIT, Request, SchedulerOptions
from edgevlm.runtime.textstream import TextStream
from edgevlm.vision.budget import render_views
from edgevlm.vision.images import from_rgb, load_image

from .conftest import make_image

LONG = "root ::= [a-z ] root"  # a reply that never ends by itself


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    d = tmp_path_factory.mktemp("iso")
    return [
        load_image(str(make_image(d / f"{i}.png", 200 + 40 * i, 180, seed=200 + i, mode="gradient"))) for i in range(4)
    ]


def request(vlm, img, text="Caption this.", max_tokens=8, **kw) -> Request:
    views = render_views(img, vlm.plan_image(img)) if img is not None else []
    msg = Message("user", text, [v for _, v in views], labels=[lb for lb, _ in views])
    return Request(vlm.render([msg]), max_tokens, stops=tuple(vlm.default_stops), **kw)


def run(vlm, requests, client: Client | None = None) -> dict:
    """Submit every request (as cells free up) and step until all are done: {tag: Sequence}."""
    sched = vlm.scheduler
    client = client or Client("test")
    queue, out = list(requests), {}
    while queue or client.running:
        while queue and sched.has_free_slot():
            seq = sched.submit(queue[0], client)
            if seq == WAIT:
                break
            queue.pop(0)
        sched.step()
        for seq in client.take_finished():
            out[seq.request.tag] = seq
    return out


class FailingDecodes:
    """A thin wrapper around the backend's batch decodes (tokens: ``decode_multi``; tokens with
    a picture's rows: ``decode_rows``): it raises for batches that hold a row of the sequence
    ``poison`` names (``always``), or once for the first batch (not)."""

    def __init__(self, vlm, poison=None, always=True):
        self.be = vlm.backend
        self.sched = vlm.scheduler
        self.real = self.be.decode_multi
        self.real_rows = self.be.decode_rows
        self.poison = poison
        self.always = always
        self.raised = 0

    def _check(self, seq_ids):
        hit = self.poison is None or any(
            s.seq is not None and s.seq.request.tag == self.poison and s.id in seq_ids for s in self.sched.slots
        )
        if hit and (self.always or not self.raised):
            self.raised += 1
            raise BackendError("llama_decode failed (code -3): injected")

    def __call__(self, entries):
        self._check({e[0] for e in entries})
        return self.real(entries)

    def rows(self, tokens, embd):
        self._check({e[0] for e in tokens} | ({embd[0]} if embd is not None else set()))
        return self.real_rows(tokens, embd)

    def __enter__(self):
        self.be.decode_multi, self.be.decode_rows = self, self.rows
        return self

    def __exit__(self, *exc):
        self.be.decode_multi, self.be.decode_rows = self.real, self.real_rows


def test_a_failed_decode_ends_that_request_only(model_pair, pictures):
    pair = model_pair("llava15")
    # the throughput profile, and the pictures encoded first: its steps take all the batch holds,
    # where the latency profile slices prompts beside running streams by measured times, and no
    # step waits on the encoder thread — the three concurrent requests are batched the same way in
    # both runs however busy the machine is (llama.cpp's sums follow a batch's shape)
    with edgevlm.load(
        pair.model, pair.mmproj, n_ctx=4096, n_threads=2, n_seq_max=3, scheduler_options=THROUGHPUT
    ) as vlm:
        run(vlm, [request(vlm, img, max_tokens=1, tag=i) for i, img in enumerate(pictures[:3])])
        vlm.scheduler.clear()
        want = run(vlm, [request(vlm, img, max_tokens=10, tag=i) for i, img in enumerate(pictures[:3])])
        vlm.scheduler.clear()
        with FailingDecodes(vlm, poison=1) as fault:
            got = run(vlm, [request(vlm, img, max_tokens=10, tag=i) for i, img in enumerate(pictures[:3])])
        assert fault.raised >= 1
        assert got[1].finish_reason == "error" and isinstance(got[1].error, BackendError)
        for i in (0, 2):  # the others: exactly what they answer without the fault
            assert got[i].error is None and got[i].reply == want[i].reply and got[i].finish_reason == "length"
        # a batch that fails once is retried in parts: nobody fails
        vlm.scheduler.clear()
        with FailingDecodes(vlm, always=False) as once:
            again = run(vlm, [request(vlm, img, max_tokens=10, tag=i) for i, img in enumerate(pictures[:3])])
        assert once.raised == 1
        assert all(again[i].error is None and again[i].finish_reason == "length" for i in range(3))
        # (the same first tokens: past them a retried batch may lay the KV cells out otherwise,
        # and attention sums in another order)
        assert [again[i].tokens[0] for i in range(3)] == [want[i].tokens[0] for i in range(3)]
        # no cell of a failed batch is left behind: what llama.cpp holds is what is accounted
        sched = vlm.scheduler
        for s in sched.slots:
            assert vlm.backend.seq_pos_max(s.id) + 1 == s.pos


@pytest.mark.timeout(315)  # 105 s measured on 2 cores shared with 3 other suites
def test_two_long_replies_on_a_small_context_both_end_cleanly(model_pair):
    pair = model_pair("llava15")
    with edgevlm.load(pair.model, pair.mmproj, n_ctx=1024, n_threads=2, n_seq_max=2) as vlm:
        grammar = edgevlm.SamplingParams(0.0, grammar=LONG)
        reqs = [request(vlm, None, f"Talk {i}.", max_tokens=5000, sampling=grammar, tag=i) for i in range(2)]
        seen = []
        orig = vlm.scheduler.step

        def step():
            out = orig()
            seen.append(vlm.scheduler.cells_used())
            return out

        vlm.scheduler.step = step
        got = run(vlm, reqs)
        assert all(got[i].error is None and got[i].finish_reason == "context" for i in range(2))
        assert min(len(got[i].tokens) for i in range(2)) > vlm.scheduler.budget.reply_reserve(5000)
        assert max(seen) <= vlm.n_ctx
        # the context is usable afterwards (nothing was cleared or failed)
        assert vlm.chat("Still there?", max_tokens=3).stats.predicted_n >= 1


@pytest.mark.timeout(420)  # 140 s measured on 2 cores shared with 3 other suites
def test_a_reply_never_grows_into_another_requests_reserve(model_pair):
    """A reply past its reserve stops when only cells other requests reserved are left."""
    pair = model_pair("llava15")
    with edgevlm.load(pair.model, pair.mmproj, n_ctx=1024, n_threads=2, n_seq_max=2) as vlm:
        sched = vlm.scheduler
        long = request(vlm, None, "Talk.", max_tokens=5000, sampling=edgevlm.SamplingParams(0.0, grammar=LONG), tag="a")
        client = Client("t")
        a = sched.submit(long, client)
        while len(a.tokens) < 600:  # past its reserve of 256, into unreserved cells
            sched.step()
        b = sched.submit(
            request(vlm, None, "Short.", max_tokens=250, sampling=edgevlm.SamplingParams(0.0, grammar=LONG), tag="b"),
            client,
        )
        assert b != WAIT
        while not a.done:
            sched.step()
            # b's reply keeps its whole reserve while a grows: a never takes it
            assert sched.cells_used() + b.reserve - len(b.tokens) <= sched.n_ctx
        assert a.finish_reason == "context" and not b.done
        while not b.done:
            sched.step()
        assert b.finish_reason == "length" and len(b.tokens) == 250


def test_queued_prompts_keep_their_image_units_when_the_cache_evicts_them(model_pair, pictures):
    """An image cache of two units, four prompts rendered before any runs: the cache evicts
    units that waiting prompts hold; they stay alive until evaluated, and the answers equal
    those of one request at a time."""
    pair = model_pair("llava15")
    opts = SchedulerOptions(image_cache_units=2)
    with edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, n_threads=2, n_seq_max=1, scheduler_options=opts) as vlm:
        alone = {}
        for i, img in enumerate(pictures):
            vlm.scheduler.clear()
            alone[i] = run(vlm, [request(vlm, img, tag=i)])[i].reply
        vlm.scheduler.clear()
        vlm.scheduler.images.clear()
        queued = [request(vlm, img, tag=i) for i, img in enumerate(pictures)]  # all rendered now
        got = run(vlm, queued)
        assert {i: got[i].reply for i in got} == alone
        assert len(vlm.scheduler.images) <= 2 and vlm.scheduler.images.retired == 0
        # a unit closed while a prompt still holds it raises instead of touching freed memory
        r = request(vlm, pictures[0], tag="x")
        next(iter(r.prompt.units.values())).close()
        with pytest.raises(BackendError, match="used after it was closed"):
            vlm.scheduler.submit(r, Client("t"))
        assert vlm.chat("Fine?", max_tokens=2).stats.predicted_n >= 1


def test_two_conversations_on_one_model_reset_independently(model_pair, pictures):
    pair = model_pair("llava15")
    vlm = edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, n_threads=2, n_seq_max=2)
    try:
        a, b = vlm.conversation(), vlm.conversation(system="Be brief.")
        a.chat("What is it?", [pictures[0]], max_tokens=4, temperature=0)
        b.chat("And this?", [pictures[1]], max_tokens=4, temperature=0)
        both = vlm.n_ctx_used
        a.reset()
        assert a.messages == [] and len(b.messages) == 2
        assert vlm.n_ctx_used <= both - 576  # a's cells (its picture) are gone ...
        follow = b.chat("More?", max_tokens=4, temperature=0)
        assert follow.stats.cached_n > 576 and follow.stats.images_encoded == 0  # ... b's are all kept
        a.close()  # a conversation closes only itself
        assert b.chat("Still?", max_tokens=2).stats.predicted_n >= 1
        with b.with_options(merge=edgevlm.MergeSpec.parse("ratio:0.5")) as view:
            view.chat("Merged?", [pictures[2]], max_tokens=2)
        assert b.chat("And now?", max_tokens=2).stats.cached_n > 576
    finally:
        vlm.close()
    assert vlm.backend.llama is None  # the owner closed it


CONVERSATION_STATE = (
    "messages",
    "pictures",
    "notices",
    "last_stats",
    "summaries",
    "complete",
    "reset",
    "with_options",
    "default_conversation",
)


def test_the_model_holds_no_conversation_its_conversations_do(model_pair, pictures):
    """``vlm.chat``/``stream`` are one turn of a fresh conversation: a second call knows nothing
    of the first (its prompt is the cells a first turn of its text renders to, however many of
    them came from the cache), while a ``vlm.conversation()`` remembers its turns, whatever
    one-turn calls run between them; the model keeps none of a conversation's state."""
    from edgevlm.runtime.engine import Engine

    pair = model_pair("llava15")
    with edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, n_threads=2, n_seq_max=2) as vlm:
        fresh = vlm.render([Message("user", "And the colours?")])  # the reference: a first turn
        alone = fresh.cells
        fresh.release()
        first = vlm.chat("What is it?", [pictures[0]], max_tokens=4, temperature=0)
        assert first.stats.cached_n + first.stats.prompt_n > 576  # (the picture was in its prompt)
        second = vlm.chat("And the colours?", max_tokens=4, temperature=0)
        assert second.stats.cached_n + second.stats.prompt_n == alone  # no memory of the first
        (last,) = [r for r in vlm.stream("And the colours?", max_tokens=4, temperature=0) if r.stats]
        assert last.stats.cached_n + last.stats.prompt_n == alone  # nor of the second
        conv = vlm.conversation()
        conv.chat("What is it?", [pictures[1]], max_tokens=4, temperature=0)
        vlm.chat("Something else.", max_tokens=2)  # a one-turn call in between touches nothing
        follow = conv.chat("And the colours?", max_tokens=4, temperature=0)
        assert follow.stats.cached_n + follow.stats.prompt_n > alone + 576  # its picture and turn 1
        assert [m.role for m in conv.messages] == ["user", "assistant"] * 2 and len(conv.pictures) == 1
        assert conv.last_stats == follow.stats and vlm.conversation().messages == []
        assert not [name for name in CONVERSATION_STATE if hasattr(vlm, name)]
        assert not [v for v in vars(vlm).values() if isinstance(v, Engine)]


def test_a_template_that_refuses_is_an_input_error(model_pair):
    pair = model_pair("gemma3")
    with edgevlm.load(pair.model, pair.mmproj, n_ctx=1024, n_threads=2) as vlm:
        with pytest.raises(InputError, match="chat template refused these messages: Conversation roles must alternate"):
            vlm.render([Message("user", "a"), Message("user", "b")])
        assert vlm.chat("Hi", max_tokens=2).stats.predicted_n >= 1


def test_the_repl_survives_a_refused_turn_after_an_identical_earlier_one(model_pair, images):
    from edgevlm.cli.repl import ChatLoop

    pair = model_pair("llava15")
    with edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, n_threads=2) as vlm:
        eng = vlm.conversation()
        lines = iter(
            [
                f"/image {images['gradient']}",
                "What is it?",
                f"/image {images['gradient']}",
                "What is it?",
                "Still there?",
            ]
        )
        real = vlm.scheduler.submit
        calls = []

        def refuse_second(req, client=None):  # a thin wrapper: the second turn is refused once
            calls.append(1)
            if len(calls) == 2:
                raise ContextExceeded("refused for the test")
            return real(req, client)

        vlm.scheduler.submit = refuse_second

        def read(_prompt):
            try:
                return next(lines)
            except StopIteration:
                raise EOFError from None

        import io

        out, err = io.StringIO(), io.StringIO()
        assert ChatLoop(eng, {"max_tokens": 3}, out=out, err=err, read_line=read).run() == 0
        assert "Error: refused for the test" in err.getvalue() and "Traceback" not in err.getvalue()
        # the first and the third turn are answered; the refused one left nothing behind
        assert [(m.role, m.text if m.role == "user" else "") for m in eng.messages] == [
            ("user", "What is it?"),
            ("assistant", ""),
            ("user", "Still there?"),
            ("assistant", ""),
        ]
        assert len(calls) == 3 and eng.last_stats.images_encoded == 0


def test_text_and_tokens_agree_when_a_stop_string_begins_inside_a_token(model_pair, images):
    pair = model_pair("llava15")
    with edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, n_threads=2) as vlm:
        be, eng = vlm.backend, vlm.conversation()
        eng.chat("Say something.", [images["noise"]], max_tokens=32, temperature=0)
        raw = eng.messages[-1].text  # (chat() strips nothing: the message holds the reply as streamed)
        pieces = [be.token_bytes(t) for t in eng.messages[-1].tokens]
        # a token of 2+ ASCII letters, after ASCII-only tokens, whose 2nd letter starts a new string
        start, k = 0, None
        for i, p in enumerate(pieces):
            if not p.isascii():
                break
            stop = raw[start + 1 : start + 3]
            if i >= 1 and len(p.strip()) >= 2 and len(stop) == 2 and stop not in raw[: start + 1]:
                k = i
                break
            start += len(p)
        assert k is not None, pieces
        eng.reset()
        cut = eng.chat("Say something.", [images["noise"]], max_tokens=32, temperature=0, stop=[stop])
        msg = eng.messages[-1]
        assert cut.finish_reason == "stop" and msg.text == raw[: raw.index(stop)]
        assert be.llama.detokenize(msg.tokens).decode("utf-8", "replace") == msg.text  # they agree
    ts = TextStream(["XY"], tokenize=lambda s: [ord(c) for c in s])
    assert ts.add(1, b"abX") == ("ab", False) and ts.add(2, b"Yz") == ("", True)  # "X" was held back
    assert ts.text == "ab" and ts.tokens == [ord("a"), ord("b")]


def test_a_bad_grammar_is_refused_before_any_picture_is_encoded(model_pair, images):
    pair = model_pair("llava15")
    with edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, n_threads=2) as vlm:
        eng = vlm.conversation()
        with pytest.raises(InputError, match="grammar"):
            list(eng.stream("Tag it.", [images["gradient"]], grammar="root ::= (("))
        assert len(vlm.scheduler.images) == 0 and eng.messages == [] and vlm.n_ctx_used == 0
        with pytest.raises(InputError, match="grammar"):  # the scheduler too: before its prefill
            vlm.scheduler.submit(
                request(
                    vlm, load_image(str(images["noise"])), sampling=edgevlm.SamplingParams(0.0, grammar="root ::= ((")
                ),
                Client("t"),
            )
        assert vlm.scheduler.images.nbytes == 0 and vlm.n_ctx_used == 0


def test_models_load_in_parallel_threads_with_their_own_parameters(model_pair):
    pair = model_pair("llava15")

    def load(n):
        vlm = edgevlm.load(pair.model, pair.mmproj, n_ctx=1024, n_threads=1, n_seq_max=n)
        try:
            return vlm.backend.n_seq_max
        finally:
            vlm.close()

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(load, [1, 3, 2, 4, 1, 3])) == [1, 3, 2, 4, 1, 3]


def test_counting_from_threads_while_the_model_encodes(model_pair, pictures):
    """mtmd's counts asked from other threads (as the server's request threads do) while the
    model's own thread encodes: same counts, nothing breaks."""
    pair = model_pair("qwen2vl")
    with edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, n_threads=2) as vlm:
        be = vlm.backend
        sizes = [(64 + 28 * i, 300 - 14 * i) for i in range(12)]

        def tokens(w, h):  # mtmd tokenizes a placeholder of that size (no cache in between)
            return [c.n_tokens for c in be.count_image(w, h)]

        want = {s: tokens(*s) for s in sizes}
        stop = threading.Event()
        errors = []

        def count():
            while not stop.is_set():
                try:
                    for s in sizes:
                        assert tokens(*s) == want[s]
                except Exception as exc:  # pragma: no cover - reported below
                    errors.append(exc)
                    return

        threads = [threading.Thread(target=count) for _ in range(2)]
        for t in threads:
            t.start()
        try:
            for img in pictures:
                vlm.chat("What?", [img], max_tokens=2)  # (one turn each: nothing kept between)
        finally:
            stop.set()
            for t in threads:
                t.join(30)
        assert not errors, errors


def test_pictures_decoded_in_threads_leave_pillows_limit_as_it_was(tmp_path):
    before = Image.MAX_IMAGE_PIXELS
    paths = [make_image(tmp_path / f"{i}.png", 300 + i, 200, seed=i) for i in range(8)]
    with ThreadPoolExecutor(4) as pool:
        imgs = list(pool.map(lambda p: load_image(str(p)), paths * 4))
    assert before == Image.MAX_IMAGE_PIXELS and len({im.sha256 for im in imgs}) == 8


def test_messages_compare_by_identity_and_pictures_by_content():
    rgb = np.random.default_rng(0).integers(0, 255, (40, 50, 3), dtype=np.uint8)
    a, b = from_rgb(rgb, "a.png"), from_rgb(rgb.copy(), "a.png")
    assert a == b and hash(a) == hash(b) and a != from_rgb(rgb[::-1].copy(), "a.png")
    m1, m2 = Message("user", "same", [a]), Message("user", "same", [b])
    msgs = [m1, m2]
    msgs.remove(m2)  # raised ValueError (an array's truth value) when messages compared pixels
    assert msgs == [m1] and m1 != m2
