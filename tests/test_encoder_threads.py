"""The threads of the two ggml teams (``backend.threads``, ``runtime.encoder``): the encoder's
count is set per encode, a picture encoded beside running streams gets a part of the cores and
the decoder the rest — never more than the cores given together — and one encoded alone gets
all of them. Real llama.cpp on the tiny generated pairs."""

from __future__ import annotations

import threading
import time

import pytest

import edgevlm
from edgevlm.backend.llama import Backend
from edgevlm.backend.threads import LAYOUT_VERSION, EncoderThreads
from edgevlm.errors import BackendError
from edgevlm.runtime.conversation import Message
from edgevlm.runtime.encoder import Encoder, split_threads
from edgevlm.runtime.requests import Client
from edgevlm.runtime.scheduler import WAIT, Request
from edgevlm.vision.budget import render_views
from edgevlm.vision.images import load_image

from .conftest import make_image

LONG = "root ::= [a-z ] root"  # a reply that never ends by itself


@pytest.mark.parametrize("cores", range(1, 65))
def test_the_split_never_gives_the_two_teams_more_than_the_cores(cores):
    enc, dec = split_threads(cores)
    assert enc + dec <= cores
    assert dec >= enc
    assert dec >= 1
    assert (enc >= 1) == (cores >= 2)  # one core: nothing is encoded beside the streams


def _unit(vlm, picture):
    views = render_views(picture, vlm.plan_image(picture))
    prompt = vlm.render([Message("user", "What is it?", [v for _, v in views], labels=[lb for lb, _ in views])])
    return prompt, next(iter(prompt.units.values()))


def test_an_encode_on_one_thread_uses_one_core(model_pair, tmp_path):
    """mtmd's count is set per encode: one thread of two takes about as much CPU time as wall
    time (two would take up to twice it), measured on the process over repeated encodes."""
    pair = model_pair("llava15")
    pic = load_image(str(make_image(tmp_path / "p.png", 300, 220, seed=3)))
    with edgevlm.load(pair.model, pair.mmproj, n_ctx=2048, n_threads=2) as vlm:
        be = vlm.scheduler.backend
        assert be.encoder_threads.settable
        assert be.encoder_threads.value == 2
        prompt, unit = _unit(vlm, pic)
        wall = cpu = 0.0
        n = 0
        while wall < 0.5 and n < 500:
            unit.embeddings.clear()
            c0, t0 = time.process_time(), time.perf_counter()
            unit.encode(0, be, threads=1)
            cpu += time.process_time() - c0
            wall += time.perf_counter() - t0
            n += 1
            assert be.encoder_threads.value == 1
        assert cpu <= 1.25 * wall + 0.02, (cpu, wall, n)
        unit.embeddings.clear()
        unit.encode(0, be)  # (the default: all of them)
        assert be.encoder_threads.value == 2
        prompt.release()


def test_another_llama_cpp_build_leaves_the_field_alone_and_never_encodes_beside(model_pair):
    pair = model_pair("llava15")
    with Backend(pair.model, pair.mmproj, n_ctx=512, n_threads=2) as be:
        assert EncoderThreads(be.mctx, 2, False, LAYOUT_VERSION).settable
        assert not EncoderThreads(be.mctx, 2, False, "0.3.37").settable  # another version's layout
        assert not EncoderThreads(be.mctx, 3, False, LAYOUT_VERSION).settable  # the field does not hold it
        be.encoder_threads = EncoderThreads(be.mctx, 2, False, "0.3.37")
        enc = Encoder(be)
        assert not enc.can_go_beside
        assert enc.decoder_beside == 2


@pytest.mark.parametrize("cores", [2, 3])
def test_the_encoder_and_the_decoder_never_have_more_threads_than_the_cores(model_pair, tmp_path, cores):
    """A long encode beside a running stream goes to the encoder thread with its part of the
    cores, and every batch decoded meanwhile has the rest; an encode in the step loop has all of
    them, with nothing decoded beside it."""
    pair = model_pair("llava15")
    pics = [load_image(str(make_image(tmp_path / f"{i}.png", 220 + 20 * i, 180, seed=40 + i))) for i in range(2)]
    with edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, n_threads=cores, n_seq_max=3) as vlm:
        sched, client, be = vlm.scheduler, Client("t"), vlm.scheduler.backend
        enc_threads, dec_threads = split_threads(cores)
        assert sched.encoder.threads_beside == enc_threads
        assert sched.encoder.decoder_beside == dec_threads
        log: list[tuple[str, float, float, int]] = []  # (what, start, end, threads)
        decodes_beside = threading.Event()
        seen = {"during": 0}
        encoding_beside = threading.Event()
        encode, decode_multi, decode_rows = be.encode_image, be.decode_multi, be.decode_rows

        def spy_encode(chunk, threads=None):
            t0 = time.perf_counter()
            out = encode(chunk, threads)
            used = be.encoder_threads.value  # what mtmd encoded with
            if threading.current_thread().name == "edgevlm-encoder":
                # the thread stays on this picture until the step loop has decoded beside it
                encoding_beside.set()
                assert decodes_beside.wait(60), "no batch was decoded beside the encode"
            log.append(("encode", t0, time.perf_counter(), used))
            return out

        def spied(fn):
            def run(*a, **kw):
                t0 = time.perf_counter()
                try:
                    return fn(*a, **kw)
                finally:
                    log.append(("decode", t0, time.perf_counter(), be.decode_threads))
                    if encoding_beside.is_set():
                        seen["during"] += 1
                        if seen["during"] >= 3:
                            decodes_beside.set()

            return run

        be.encode_image, be.decode_multi, be.decode_rows = spy_encode, spied(decode_multi), spied(decode_rows)
        try:
            first = sched.submit(Request(vlm.render([Message("user", "Hi.")]), 2), client)
            while not first.done:
                sched.step()
            stream = sched.submit(
                Request(vlm.render([Message("user", "Talk.")]), 3000, edgevlm.SamplingParams(0.0, grammar=LONG)),
                client,
            )
            while len(stream.tokens) < 3:
                sched.step()
            sched.encoder.cost_ms = 1e9  # a long encode (measured costs set, not this machine's clock)
            prompt, _ = _unit(vlm, pics[0])
            beside = sched.submit(Request(prompt, 2), client)
            assert beside != WAIT
            deadline = time.monotonic() + 120
            while not beside.done and time.monotonic() < deadline:
                sched.step()
            assert beside.done
            assert beside.error is None
            # alone (nobody generates): the step loop encodes with all the cores
            sched.cancel(stream)
            prompt2, _ = _unit(vlm, pics[1])
            alone = sched.submit(Request(prompt2, 2), client)
            while not alone.done:
                sched.step()
            assert alone.error is None
        finally:
            be.encode_image, be.decode_multi, be.decode_rows = encode, decode_multi, decode_rows
        assert sched.encoder.counts == {"here": 1, "beside": 1}
        encodes = [e for e in log if e[0] == "encode"]
        assert sorted(e[3] for e in encodes) == sorted([enc_threads, cores])
        decodes = [d for d in log if d[0] == "decode"]
        for _, a, b, threads in encodes:
            during = [d for d in decodes if d[1] < b and d[2] > a]
            if threads == cores:
                assert not during  # alone: nothing decoded beside it
            else:
                assert len(during) >= 3
                assert all(d[3] + threads <= cores for d in during), during
        assert max(d[3] for d in decodes) == cores  # all of them when the encoder is idle


def test_a_closed_backend_never_writes_the_field_nor_encodes(model_pair):
    pair = model_pair("llava15")
    be = Backend(pair.model, pair.mmproj, n_ctx=512, n_threads=2)
    assert be.encoder_threads.settable
    be.close()
    assert not be.encoder_threads.settable  # (the context's memory is freed: nothing is written into it)
    with pytest.raises(BackendError, match="the model is closed"):
        be.encode_image(None, threads=1)
