"""More conversations than requests running: conversations kept in the KV cache beside the few
that generate, idle ones moved to the host cache and back, fair steps while a new prompt is
evaluated, and a slot choice that never wipes an idle conversation while a sequence is free.
Real llama.cpp on the tiny generated pairs; the server through the official client."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

import edgevlm
from edgevlm.runtime.conversation import Message
from edgevlm.runtime.placement import SHORT_LANE
from edgevlm.runtime.requests import Client
from edgevlm.runtime.scheduler import WAIT, Request, SchedulerOptions
from edgevlm.vision.budget import render_views
from edgevlm.vision.images import load_image

from .conftest import make_image
from .test_serve import Served, data_uri, png, user

LONG = "root ::= [a-z ] root"  # a reply that never ends by itself


@pytest.fixture(scope="module")
def pictures(tmp_path_factory):
    d = tmp_path_factory.mktemp("conv")
    return [
        load_image(str(make_image(d / f"{i}.png", 180 + 30 * i, 160, seed=300 + i, mode="gradient"))) for i in range(4)
    ]


def test_eight_conversations_over_four_running_keep_their_prefixes(model_pair):
    """A server generating 4 requests at once keeps 8 three-turn conversations: every follow-up
    finds its whole history cached (picture included), whoever ran in between."""
    s = Served(model_pair("llava15"), "--parallel", "4", "--ctx", "8192", "--max-tokens", "8")
    try:
        st = s.status()
        assert st["slots"]["max_running"] == 4 and st["kv"]["sequences"] >= 8
        c = s.client()

        def chat(i):
            history = [user(f"Conversation {i}: what is it?", data_uri(png(200, 150, seed=400 + i)))]
            got = []
            for turn in range(3):
                r = c.chat.completions.create(model="m", messages=history, max_tokens=8, temperature=0)
                got.append(
                    (r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens, r.usage.completion_tokens)
                )
                history += [
                    {"role": "assistant", "content": r.choices[0].message.content},
                    {"role": "user", "content": f"And then? ({turn})"},
                ]
            return got

        with ThreadPoolExecutor(8) as pool:
            runs = list(pool.map(chat, range(8)))
        for got in runs:
            for (p0, _, n0), (p1, cached, _) in zip(got, got[1:], strict=False):
                # the previous prompt and its reply (but the last reply token) were cached
                assert cached >= p0 + n0 - 1, got
                assert p1 - cached < 40, got
        st = s.status()
        # 4 at once, and follow-ups whose history is cached beside them (the short lane)
        assert st["kv"]["conversations"] >= 8 and st["requests"]["peak_running"] <= 4 * SHORT_LANE
        assert st["requests"]["failed"] == 0
    finally:
        assert "Traceback" not in s.stop()


def test_a_conversation_restored_from_the_host_cache_answers_as_if_never_evicted(model_pair, pictures):
    pair = model_pair("llava15")
    kw = dict(n_ctx=4096, n_threads=2)
    with edgevlm.load(pair.model, pair.mmproj, n_seq_max=1, **kw) as vlm:
        ref = vlm.conversation()
        ref.chat("What is it?", [pictures[0]], max_tokens=8, temperature=0)
        want = ref.chat("Tell me more.", max_tokens=12, temperature=0)
        want_tokens = ref.messages[-1].tokens
    with edgevlm.load(
        pair.model, pair.mmproj, n_seq_max=2, scheduler_options=SchedulerOptions(cache_ram=64 * 2**20), **kw
    ) as vlm:
        a, b, c = vlm.conversation(), vlm.conversation(), vlm.conversation()
        first = a.chat("What is it?", [pictures[0]], max_tokens=8, temperature=0)
        b.chat("And this?", [pictures[1]], max_tokens=8, temperature=0)
        c.chat("And that?", [pictures[2]], max_tokens=8, temperature=0)  # two sequences: a moved out
        cache = vlm.scheduler.host_cache
        assert cache.saved >= 1 and len(cache) >= 1
        got = a.chat("Tell me more.", max_tokens=12, temperature=0)
        assert cache.restored == 1
        assert got.stats.cached_n >= first.stats.prompt_n + first.stats.predicted_n - 1
        assert got.stats.images_encoded == 0 and got.stats.prompt_n < 40
        assert got.text == want.text and a.messages[-1].tokens == want_tokens  # exactly the same answer


def test_a_long_prompt_beside_a_running_stream_never_stops_it_for_more_than_a_step(model_pair, pictures):
    pair = model_pair("llava15")
    with edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, n_threads=2, n_seq_max=2) as vlm:
        sched, client = vlm.scheduler, Client("t")
        stream = sched.submit(
            Request(vlm.render([Message("user", "Talk.")]), 3000, edgevlm.SamplingParams(0.0, grammar=LONG)), client
        )
        while len(stream.tokens) < 5:
            sched.step()
        views = render_views(pictures[3], vlm.plan_image(pictures[3]))
        long = Message("user", "word " * 500, [v for _, v in views], labels=[lb for lb, _ in views])
        newcomer = sched.submit(Request(vlm.render([long]), 4), client)
        assert newcomer != WAIT and newcomer.pending_cells > 1500
        steps, stalls, before = 0, 0, len(stream.tokens)
        while not newcomer.done:
            sched.step()
            steps += 1
            now = len(stream.tokens)
            stalls = stalls + 1 if now == before else 0
            assert stalls <= 1, f"the stream got no token for {stalls} steps in a row"
            before = now
        assert steps > 3  # the prompt went in slices, beside the stream
        assert newcomer.error is None and newcomer.stats.prompt_n > 1500 and not stream.done
        sched.cancel(stream)


def test_the_slot_choice_never_wipes_an_idle_conversation_while_a_sequence_is_free(model_pair, pictures):
    pair = model_pair("llava15")
    with edgevlm.load(
        pair.model, pair.mmproj, n_ctx=4096, n_threads=2, n_seq_max=4, options=edgevlm.EngineOptions(system="Be brief.")
    ) as vlm:
        a = vlm.conversation()
        a.chat("What is it?", [pictures[0]], max_tokens=6, temperature=0)
        slot = next(s for s in vlm.scheduler.slots if s.owner is a.client)
        kept = slot.items()
        # a request that shares only the system prompt, one that is a prefix of a's history,
        # and one that repeats a's first turn: each takes a free sequence
        others = [vlm.conversation(), vlm.conversation(), vlm.conversation()]
        others[0].chat("Something else entirely.", max_tokens=4)
        others[1].chat("What is it?", [pictures[0]], max_tokens=2)  # a's first turn again
        assert slot.items() == kept  # a's cells are where they were
        cached = others[1].last_stats.cached_n
        assert cached > 576  # (it shared a's picture, by seq_cp)
        follow = a.chat("And the colours?", max_tokens=4, temperature=0)
        assert follow.stats.cached_n >= len(kept) - 1 and follow.stats.images_encoded == 0
        assert len({s.id for s in vlm.scheduler.slots if s.kv}) == 3 + (1 if others[2].messages else 0)


def test_requests_that_share_a_prompt_evaluate_it_once(model_pair, pictures):
    """Four captions of the same picture submitted together: the first evaluates the system
    prompt and the picture, the others share those cells (seq_cp) once they are there."""
    pair = model_pair("llava15")
    with edgevlm.load(
        pair.model, pair.mmproj, n_ctx=4096, n_threads=2, n_seq_max=4, options=edgevlm.EngineOptions(system="Caption.")
    ) as vlm:
        views = render_views(pictures[1], vlm.plan_image(pictures[1]))
        client = Client("t")
        seqs = []
        for i in range(4):
            msg = Message("user", f"Caption {i}.", [v for _, v in views], labels=[lb for lb, _ in views])
            seqs.append(vlm.scheduler.submit(Request(vlm.render([msg]), 4, tag=i), client))
        while client.running:
            vlm.scheduler.step()
        cached = sorted(s.stats.cached_n for s in seqs)
        assert cached[0] == 0 and all(c > 576 for c in cached[1:]), cached
        assert sum(s.stats.images_encoded for s in seqs) == 1


def test_serve_plans_the_host_kv_cache_and_shows_it(model_pair):
    s = Served(model_pair("llava15"), "--ctx", "4096", "--cache-ram", "128MiB", "--parallel", "2")
    try:
        st = s.status()
        assert st["plan"]["cache_ram"] == 128 * 2**20 and st["plan"]["sequences"] >= st["kv"]["sequences"]
        assert "128.00 MiB for idle conversations (--cache-ram)" in next(
            r for r in st["plan"]["reasons"] if r.startswith("CPU budget")
        )
        host = st["memory"]["host"]
        assert host["kv_cache_bytes"] == 128 * 2**20 and st["kv"]["host_cache"]["max_bytes"] == 128 * 2**20
        assert st["slots"]["max_running"] == 2 and st["kv"]["sequences"] >= 16
    finally:
        assert "Traceback" not in s.stop()
