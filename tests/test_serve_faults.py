"""The server under faults: a request that fails — refused by the chat template, broken by a
fault while it is prepared, too large for the host allowance, waiting when the worker stops —
ends alone while the others get their answers. Real servers on 127.0.0.1 (``edgevlm serve``
subprocesses, or the app on uvicorn in a thread when a test wraps part of the model), real
llama.cpp on generated pairs, the official ``openai`` client."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn
from openai import APIStatusError, BadRequestError, OpenAI

import edgevlm
from edgevlm.errors import MediaRefused
from edgevlm.plan import host as host_module
from edgevlm.runtime.intake.fetch import fetch_bytes
from edgevlm.serve.api_errors import APIError, kind_of
from edgevlm.serve.app import create_app
from edgevlm.serve.http import BODY_COPIES
from edgevlm.serve.openai import parse_chat_request
from edgevlm.serve.options import ServeOptions
from edgevlm.serve.service import ChatService
from edgevlm_testkit.waiting import until, until_async

from .conftest import run_cli
from .test_serve import Served, _Pictures, data_uri, free_port, png, user


def photo(width: int, height: int, seed: int = 0) -> bytes:
    """A smooth photo-like JPEG (small as a file, large when decoded)."""
    import io

    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0 : height // 8, 0 : width // 8]
    c = rng.integers(0, 255, 3)
    small = np.stack([(x * 3 + c[0]) % 256, (y * 3 + c[1]) % 256, np.full_like(x, c[2])], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(small).resize((width, height)).save(buf, "JPEG", quality=85)
    return buf.getvalue()


class InProcess:
    """The app on uvicorn in a thread, on a free port of 127.0.0.1; ``stop()`` ends it."""

    def __init__(self, model, options: ServeOptions):
        self.app = create_app(model, options)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        try:
            until(self._ready, "ready", timeout=60)
        except AssertionError:
            self.stop()
            raise

    def _ready(self) -> bool:
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def client(self) -> OpenAI:
        return OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def status(self) -> dict:
        return httpx.get(self.url + "/status", timeout=10).json()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


LONG_STRING = {"type": "string", "minLength": 1000}


def test_a_refused_template_is_a_400_while_a_concurrent_request_gets_its_200(model_pair):
    """The good request is running (a long streamed reply, seen busy on /status) when the bad one
    is refused, is still running after, and then ends with its whole reply."""
    s = Served(model_pair("gemma3"), "--parallel", "2", "--ctx", "4096", "--max-tokens", "24")
    try:
        c = s.client()
        bad = [{"role": "user", "content": "First."}, {"role": "user", "content": "Second."}]
        good = {
            "model": "m",
            "messages": [user("Describe it.", data_uri(png(seed=60)))],
            "max_tokens": 1200,
            "temperature": 0,
            "stream": True,  # a string of 1000 characters at least: far longer than the refusal takes
            "stream_options": {"include_usage": True},
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": LONG_STRING}},
        }
        with httpx.Client(timeout=120) as h, h.stream("POST", s.url + "/v1/chat/completions", json=good) as ok:
            assert ok.status_code == 200
            s.wait_busy(1)
            with pytest.raises(BadRequestError) as err:
                c.chat.completions.create(model="m", messages=bad, max_tokens=8)
            assert "chat template refused" in err.value.body["message"]
            assert "roles must alternate" in err.value.body["message"]
            assert s.status()["slots"]["busy"] == 1  # the good one ran through the refusal
            events = [json.loads(ln[6:]) for ln in ok.iter_lines() if ln.startswith("data: {")]
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
        (finish,) = [ch[0]["finish_reason"] for e in events if (ch := e["choices"]) and ch[0]["finish_reason"]]
        if finish == "length":  # cut at max_tokens
            assert events[-1]["usage"]["completion_tokens"] == 1200 and text.startswith('"')
        else:  # or the whole string the schema asks for
            assert finish == "stop" and len(json.loads(text)) >= 1000, (finish, text)
        st = s.wait_idle()
        assert st["requests"]["served"] == 1 and st["requests"]["failed"] == 1  # (the refused one)
        assert c.chat.completions.create(model="m", messages=[user("Again?")], max_tokens=3).choices
    finally:
        assert "Traceback" not in s.stop()


def test_a_fault_while_a_request_is_prepared_is_its_500_only(model_pair, caplog):
    """A thin wrapper makes rendering raise for one request: that request gets a 500 and its
    traceback is logged once; concurrent and later requests are answered."""
    pair = model_pair("llava15")
    vlm = edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, n_threads=2, n_seq_max=2)
    real = vlm.render

    def render(messages, system=None, merge=None, keep_images=True, **tooling):
        if any(m.text == "boom" for m in messages):
            raise RuntimeError("injected fault")
        return real(messages, system, merge, keep_images, **tooling)

    vlm.render = render
    srv = InProcess(vlm, ServeOptions(max_tokens=16))
    try:
        c = srv.client()
        with caplog.at_level(logging.ERROR, logger="edgevlm.serve"), ThreadPoolExecutor(3) as pool:
            oks = [
                pool.submit(
                    c.chat.completions.create,
                    model="m",
                    messages=[user(f"Fine {i}?", data_uri(png(seed=i)))],
                    max_tokens=12,
                    temperature=0,
                )
                for i in range(2)
            ]
            with pytest.raises(APIStatusError) as err:
                c.chat.completions.create(model="m", messages=[user("boom")], max_tokens=4)
            assert err.value.status_code == 500 and "internal error (RuntimeError)" in err.value.body["message"]
            assert all(f.result(timeout=120).choices[0].message.content is not None for f in oks)
        logged = [r for r in caplog.records if r.exc_info and "injected fault" in str(r.exc_info[1])]
        assert len(logged) == 1
        with pytest.raises(APIStatusError) as err:  # a stream refused before it starts: a 500 too
            list(c.chat.completions.create(model="m", messages=[user("boom")], max_tokens=4, stream=True))
        assert err.value.status_code == 500
        st = srv.status()
        assert st["slots"]["busy"] == 0 and st["requests"]["failed"] >= 2 and st["requests"]["served"] >= 2
        assert st["memory"]["host"]["in_use_bytes"] == 0  # every lease given back
    finally:
        srv.stop()
        vlm.close()


def waiting_for_the_allowance() -> bool:
    """Whether a thread is blocked on the host allowance (in a ``Condition.wait`` called from
    ``edgevlm.plan.host``), waiting for bytes to be given back."""
    for frame in sys._current_frames().values():
        caller = frame.f_back
        if frame.f_code.co_name == "wait" and caller is not None and caller.f_code.co_filename == host_module.__file__:
            return True
    return False


def test_the_host_allowance_refuses_waits_and_is_shown(model_pair):
    pair = model_pair("llava15")
    vlm = edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, n_threads=2, n_seq_max=2)
    srv = InProcess(vlm, ServeOptions(max_tokens=8, host_allowance=48 * 2**20, host_wait_s=1.0))
    try:
        c = srv.client()
        # a 12-megapixel photo takes ~100 MiB while decoded: more than the whole allowance
        with pytest.raises(BadRequestError) as err:
            c.chat.completions.create(model="m", messages=[user("Big?", data_uri(photo(4000, 3000), "image/jpeg"))])
        assert "more than the whole allowance for requests" in err.value.body["message"]
        # the allowance taken by others: a request waits, then gets 503 with Retry-After
        service = srv.app.state.server.service
        other = service.host.lease("someone else")
        other.grow(40 * 2**20)
        t0 = time.monotonic()
        with pytest.raises(APIStatusError) as err:
            c.chat.completions.create(model="m", messages=[user("Wait?", data_uri(photo(1600, 1200), "image/jpeg"))])
        assert err.value.status_code == 503 and err.value.body["code"] == "memory_busy"
        assert int(err.value.response.headers["retry-after"]) >= 1 and time.monotonic() - t0 >= 1.0
        # given back while a request waits: it goes on
        with ThreadPoolExecutor(1) as pool:
            later = pool.submit(
                c.chat.completions.create,
                model="m",
                temperature=0,
                messages=[user("Now?", data_uri(photo(1600, 1200), "image/jpeg"))],
            )
            until(waiting_for_the_allowance, "waiting for the allowance")
            other.release()
            assert later.result(timeout=60).choices[0].finish_reason in ("stop", "length")
        host = srv.status()["memory"]["host"]
        assert host["waits"] >= 1  # (the allowance's own count: it went on after a wait)
        assert host["allowance_bytes"] == 48 * 2**20 and host["in_use_bytes"] == 0
        assert 0 < host["peak_in_use_bytes"] <= host["allowance_bytes"] and host["refused"] >= 1
        assert host["limit_bytes"] == (
            host["buffers_bytes"]
            + host["image_cache_bytes"]
            + host["kv_cache_bytes"]
            + host["responses_store_bytes"]
            + host["reply_recall_bytes"]
            + host["process_reserve_bytes"]
            + host["allowance_bytes"]
        )
        assert host["rss_bytes"] > 0  # (this test process holds more than the server: not compared)
    finally:
        srv.stop()
        vlm.close()


def test_serve_plans_its_allowance_and_says_so(model_pair):
    s = Served(model_pair("llava15"), "--ctx", "2048", "--host-allowance", "300MiB")
    try:
        st = s.status()
        assert st["plan"]["host_allowance"] == 300 * 2**20 and st["plan"]["host_reserve"] == 256 * 2**20
        line = next(r for r in st["plan"]["reasons"] if r.startswith("CPU budget"))
        assert "300.00 MiB for requests in flight (--host-allowance)" in line
        assert st["memory"]["host"]["allowance_bytes"] == 300 * 2**20
    finally:
        assert "Traceback" not in s.stop()
    r = run_cli(
        "plan",
        "-m",
        str(model_pair("llava15").model),
        "--mmproj",
        str(model_pair("llava15").mmproj),
        "--host-allowance",
        "1GiB",
        "--free-memory",
        "cpu=8GiB",
    )
    assert r.returncode == 0 and "1.00 GiB for requests in flight (--host-allowance)" in r.stdout, r.stdout


def test_waiting_requests_end_when_the_worker_stops(model_pair):
    pair = model_pair("llava15")
    with edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, n_threads=2) as vlm:
        service = ChatService(vlm, ServeOptions(max_tokens=8))
        req = parse_chat_request({"messages": [user("Hi")]})
        with pytest.raises(APIError) as err:  # never started: refused at once, nothing waits
            asyncio.run(asyncio.wait_for(service.complete(req), 10))
        assert kind_of(err.value).status == 503 and err.value.code == "server_stopping"
        service.start()
        long = parse_chat_request(
            {
                "messages": [user("Talk.")],
                "max_tokens": 3000,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": {"type": "string", "minLength": 3000}},
                },
            }
        )

        async def talk_then_stop():
            task = asyncio.ensure_future(service.complete(long))
            await until_async(lambda: service.worker.running == 1, "the reply running")
            await asyncio.get_running_loop().run_in_executor(None, service.stop)
            return await asyncio.wait_for(task, 20)

        with pytest.raises(APIError) as err:
            asyncio.run(talk_then_stop())
        assert err.value.code == "server_stopping" and service.host.in_use == 0


def test_unsupported_fields_are_a_400_not_ignored():
    base = {"messages": [user("Hi")]}
    for extra, param in (
        ({"logprobs": True}, "logprobs"),
        ({"top_logprobs": 2}, "logprobs"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ):
        with pytest.raises(APIError) as err:
            parse_chat_request({**base, **extra})
        assert (
            kind_of(err.value).status == 400 and err.value.param == param and err.value.code == "unsupported_parameter"
        )
    # what does not change the answer is still accepted
    parse_chat_request({**base, "tools": [], "tool_choice": "none", "logprobs": False, "user": "u"})
    # a forced call needs a tool to call
    with pytest.raises(APIError) as err:
        parse_chat_request({**base, "tool_choice": "required"})
    assert kind_of(err.value).status == 400 and err.value.param == "tool_choice"


def test_an_image_url_is_fetched_from_the_address_that_was_checked(monkeypatch):
    """DNS rebinding: the host resolves to an allowed address for the check, then to another.
    The fetch connects to the first (it resolves once); a server never reaches the second."""
    import http.server

    pictures = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Pictures)
    threading.Thread(target=pictures.serve_forever, daemon=True).start()
    port = pictures.server_address[1]
    answers = iter(
        [[(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", port))]]
        + [[(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.255.255.1", port))]] * 5
    )
    real = socket.getaddrinfo
    calls = []

    def resolve(host, *a, **kw):
        if host == "pictures.test":
            calls.append(host)
            return next(answers)
        return real(host, *a, **kw)

    monkeypatch.setattr(socket, "getaddrinfo", resolve)
    try:
        opts = ServeOptions(allow_private_urls=True, url_timeout_s=5)
        data = fetch_bytes(f"http://pictures.test:{port}/p.png", opts.fetch_rules, "image 1")
        assert data == png(seed=7) and calls == ["pictures.test"]
        # and without --allow-private-urls the checked address is refused before any connection
        with pytest.raises(MediaRefused, match="non-public address"):
            fetch_bytes(f"http://pictures.test:{port}/p.png", ServeOptions().fetch_rules, "image 1")
    finally:
        pictures.shutdown()


def test_a_path_on_another_drive_is_refused_not_a_500(monkeypatch, tmp_path):
    def other_drive(paths):
        raise ValueError("Paths don't have the same drive")

    monkeypatch.setattr(os.path, "commonpath", other_drive)
    with pytest.raises(MediaRefused) as err:
        fetch_bytes(str(tmp_path / "a.png"), ServeOptions(allow_paths=(str(tmp_path),)).fetch_rules, "image 1")
    assert kind_of(err.value).status == 400 and "only read under --allow-path" in str(err.value)


def test_a_batch_line_the_template_refuses_is_an_error_line(model_pair, tmp_path):
    pair = model_pair("gemma3")
    lines = [
        {
            "custom_id": "ok",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [user("Hi")], "max_tokens": 4},
        },
        {
            "custom_id": "refused",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [user("a"), user("b")], "max_tokens": 4},
        },
        {
            "custom_id": "after",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [user("Bye")], "max_tokens": 4},
        },
    ]
    req = tmp_path / "r.jsonl"
    req.write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    out = tmp_path / "o.jsonl"
    r = run_cli(
        "batch",
        str(req),
        "--out",
        str(out),
        "-m",
        str(pair.model),
        "--mmproj",
        str(pair.mmproj),
        "--threads",
        "2",
        timeout=300,
    )
    assert "Traceback" not in r.stderr and r.returncode in (0, 4), r.stderr
    got = {o["custom_id"]: o for o in map(json.loads, out.read_text().splitlines())}
    assert set(got) == {"ok", "refused", "after"}
    assert got["ok"]["response"]["status_code"] == 200 and got["after"]["response"]["status_code"] == 200
    bad = got["refused"]["response"]
    assert bad["status_code"] == 400 and "chat template refused" in bad["body"]["error"]["message"]


def test_queued_requests_keep_their_pictures_when_the_image_cache_is_small(model_pair):
    """Three requests with different pictures queued behind one sequence, an image cache of two
    units: the cache evicts units that queued prompts hold; the answers are those each request
    gets alone."""
    from edgevlm.runtime.scheduler import SchedulerOptions

    pair = model_pair("llava15")
    vlm = edgevlm.load(
        pair.model,
        pair.mmproj,
        n_ctx=4096,
        n_threads=2,
        n_seq_max=1,
        scheduler_options=SchedulerOptions(image_cache_units=2),
    )
    srv = InProcess(vlm, ServeOptions(max_tokens=12, queue=8))
    try:
        c = srv.client()
        pics = [data_uri(png(160 + 16 * i, 120, seed=80 + i)) for i in range(3)]

        def ask(i):
            return (
                c.chat.completions.create(
                    model="m", messages=[user("What is it?", pics[i])], max_tokens=12, temperature=0
                )
                .choices[0]
                .message.content
            )

        alone = [ask(i) for i in range(3)]
        vlm.scheduler.images.clear()  # so that the queued ones are tokenized again, together
        with ThreadPoolExecutor(3) as pool:
            together = list(pool.map(ask, range(3)))
        assert together == alone
        assert len(vlm.scheduler.images) <= 2 and vlm.scheduler.images.retired == 0
        assert srv.status()["requests"]["failed"] == 0
    finally:
        srv.stop()
        vlm.close()


def test_the_budget_route_takes_its_lease_before_its_body_and_its_place_after_like_any_request(model_pair):
    """Bodies sent to ``/v1/edgevlm/budget`` are admitted as every request is: a lease on the host
    allowance for their whole length before their first byte is read, and a place (the queue
    limit) only once they are in. With more bodies still arriving than there are places, none
    holds a place: a chat request meanwhile gets its 200, and the allowance holds each body's
    whole length from the start; once they arrive each is answered, and every place and byte is
    given back. With every place held by requests in the worker, a budget request whose body is
    in gets 503 ``server_busy``."""
    pair = model_pair("qwen2vl")
    vlm = edgevlm.load(pair.model, pair.mmproj, n_ctx=2048, n_threads=2, n_seq_max=1)
    srv = InProcess(vlm, ServeOptions(max_tokens=8, queue=2, host_allowance=64 * 2**20))
    socks = []
    try:
        capacity = 1 + 2  # one sequence and a queue of two
        for i in range(capacity + 1):
            body = json.dumps({"image_url": {"url": data_uri(png(64, 48, seed=i))}}).encode()
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=60)
            head = (
                "POST /v1/edgevlm/budget HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            )
            s.sendall(head.encode() + body[:16])  # the rest later: the body is still arriving
            socks.append((s, body))
        until(lambda: srv.status()["queue"]["reading"] == capacity + 1, "every body arriving")
        assert srv.status()["queue"]["admitted"] == 0  # no place while a body arrives
        held = sum(len(body) for _, body in socks) * BODY_COPIES  # the whole of each, never a part
        assert srv.status()["memory"]["host"]["in_use_bytes"] == held
        ok = srv.client().chat.completions.create(model="m", messages=[user("Hi?")], max_tokens=2)
        assert ok.choices[0].finish_reason in ("stop", "length")
        for s, body in socks:  # (one by one: each is answered and its place given back)
            s.sendall(body[16:])
            status = s.makefile("rb").readline()
            assert status.startswith(b"HTTP/1.1 200"), status
        until(lambda: srv.status()["queue"]["admitted"] == 0, "every place given back")
        assert srv.status()["memory"]["host"]["in_use_bytes"] == 0
        ok = httpx.post(srv.url + "/v1/edgevlm/budget", json={"image_url": {"url": data_uri(png())}}, timeout=30)
        assert ok.status_code == 200 and ok.json()["width"] == 320 and ok.json()["total_tokens"] > 0
        # every place taken by requests that are in: a budget request whose body is in gets 503
        service = srv.app.state.server.service
        taken = [service.admit() for _ in range(capacity)]
        try:
            late = httpx.post(srv.url + "/v1/edgevlm/budget", json={"image_url": {"url": data_uri(png())}}, timeout=30)
            assert late.status_code == 503 and late.json()["error"]["code"] == "server_busy"
            assert late.headers["retry-after"]
        finally:
            for lease in taken:
                lease.release()
        assert srv.status()["queue"]["admitted"] == 0
    finally:
        for s, _ in socks:
            s.close()
        srv.stop()
        vlm.close()
