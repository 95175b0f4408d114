"""Stopping the server: the first SIGTERM (or Ctrl-C) turns away what has not started (503
``server_stopping``), gives the replies in progress ``--shutdown-grace`` seconds, then ends each
with its last event in its API's shape, and the process exits 0; a second signal ends it at
once. A real ``edgevlm serve`` subprocess on the tiny llava pair on 127.0.0.1, read by httpx
(the raw events, to see each API's last one)."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import threading
import time

import httpx
import pytest

import edgevlm
from edgevlm.serve.api_errors import APIError, kind_of
from edgevlm.serve.openai import parse_chat_request
from edgevlm.serve.options import ServeOptions
from edgevlm.serve.service import ChatService
from edgevlm_testkit.waiting import until, until_async, wait_status

from .test_serve import Served, user

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")

GRACE = 2.0  # the server's --shutdown-grace in these tests
LONG = 3800  # tokens: ~16 s for four replies at once on 2 cores, so they still run when the grace ends (under load too)
SPEAK = [{"role": "user", "content": "Talk."}]


class Stream:
    """One streamed request in a thread: its status and its non-empty lines, each with the
    time it came (monotonic)."""

    def __init__(self, url: str, path: str, body: dict, api: str):
        self.api, self.status, self.lines, self.error = api, 0, [], None
        self.thread = threading.Thread(target=self._read, args=(url + path, body), daemon=True)
        self.thread.start()

    def _read(self, url: str, body: dict) -> None:
        try:
            with httpx.Client(timeout=60) as h, h.stream("POST", url, json=body) as r:
                self.status = r.status_code
                for line in r.iter_lines():
                    if line.strip():
                        self.lines.append((time.monotonic(), line))
        except httpx.HTTPError as exc:
            self.error = exc

    def data(self) -> list[dict]:
        """The JSON of each event (SSE ``data:`` lines, or NDJSON lines)."""
        out = []
        for _, line in self.lines:
            text = line[6:] if line.startswith("data: ") else line
            if text != "[DONE]" and not line.startswith("event: "):
                out.append(json.loads(text))
        return out

    @property
    def last_at(self) -> float:
        return self.lines[-1][0]


def openai_stream(url: str) -> Stream:
    body = {"model": "m", "messages": SPEAK, "max_tokens": LONG, "temperature": 0, "stream": True}
    return Stream(url, "/v1/chat/completions", body, "openai")


def served(pair, grace: float) -> Served:
    return Served(pair, "--parallel", "4", "--ctx", "16384", "--shutdown-grace", f"{grace:g}")


def wait_for(s: Served, what, timeout: float = 30) -> dict:
    """Poll /status until ``what(status)`` (within ``timeout``)."""
    return wait_status(s.status, what, "as asked", timeout)


@pytest.mark.slow
def test_sigterm_ends_every_reply_with_its_last_event_and_exits_0_within_the_grace(model_pair):
    """Four replies running (OpenAI chat, Anthropic, Ollama, Responses: all streamed) and five
    waiting (four OpenAI streams and one whole reply) behind ``--parallel 4``, then SIGTERM: the
    waiting ones get 503 ``server_stopping`` at once (a stream the worker had accepted, whose 200
    went out then, as its error event), a new request is refused, the running ones go
    on for the grace and then end with their API's last event, and the process exits 0 within
    the grace + 2 s of the signal, without a traceback."""
    s = served(model_pair("llava15"), GRACE)
    url = s.url
    try:
        running = [
            openai_stream(url),
            Stream(
                url,
                "/v1/messages",
                {"model": "m", "messages": SPEAK, "max_tokens": LONG, "temperature": 0, "stream": True},
                "anthropic",
            ),
            Stream(
                url,
                "/api/chat",
                {"model": "m", "messages": SPEAK, "options": {"num_predict": LONG, "temperature": 0}},
                "ollama",
            ),
            Stream(
                url,
                "/v1/responses",
                {"model": "m", "input": "Talk.", "max_output_tokens": LONG, "temperature": 0, "stream": True},
                "responses",
            ),
        ]
        wait_for(s, lambda st: st["slots"]["busy"] == 4)
        queued = [openai_stream(url) for _ in range(4)]
        whole: dict = {}

        def ask_whole() -> None:
            body = {"model": "m", "messages": SPEAK, "max_tokens": LONG}
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
            whole.update(status=r.status_code, body=r.json())

        asker = threading.Thread(target=ask_whole, daemon=True)
        asker.start()
        wait_for(s, lambda st: st["queue"]["waiting"] == 5 and st["slots"]["busy"] == 4)

        signalled = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        until(
            lambda: all(q.lines and q.data() and "error" in q.data()[-1] for q in queued),
            "every waiting stream's last event, inside the grace",
            timeout=GRACE,
        )
        turned_away = time.monotonic()
        try:  # a request after the signal: the listening socket is closed, or it is a 503
            late = httpx.post(url + "/v1/chat/completions", json={"messages": SPEAK, "max_tokens": 4}, timeout=10)
            assert late.status_code == 503 and late.json()["error"]["code"] == "server_stopping", late.text
        except httpx.ConnectError:
            pass
        rc = s.proc.wait(timeout=GRACE + 10)
        exited = time.monotonic() - signalled
        err = s.proc.stderr.read()
        for t in [*running, *queued]:
            t.thread.join(10)
        asker.join(10)
    finally:
        if s.proc.poll() is None:
            s.stop()

    assert rc == 0, err
    assert exited <= GRACE + 2, f"exited {exited:.2f} s after SIGTERM (grace {GRACE} s)"
    assert "Traceback" not in err and "stopping: replies in progress get up to 2 s" in err, err
    # the waiting ones: turned away at once (before the grace was over), in their API's shape
    assert turned_away - signalled < GRACE
    for q in queued:  # a 503 before the stream began, else the stream's error event and [DONE]
        assert q.error is None and q.data()[-1]["error"]["code"] == "server_stopping", q.lines
        assert q.status == 503 or (q.status == 200 and q.lines[-1][1] == "data: [DONE]"), (q.status, q.lines)
        assert q.data()[-1]["error"]["type"] == "server_error"
    assert whole["status"] == 503 and whole["body"]["error"]["code"] == "server_stopping", whole
    # the running ones: on during the grace, then each with its API's last event
    for r in running:
        assert r.status == 200 and r.error is None, (r.api, r.error, r.lines[-2:])
        assert r.last_at - signalled >= GRACE - 0.1, (r.api, r.last_at - signalled)
        events = r.data()
        assert len(events) > 3, (r.api, r.lines)
    chat, messages, ollama, responses = (r.data() for r in running)
    assert running[0].lines[-1][1] == "data: [DONE]"
    assert chat[-1]["choices"][0]["finish_reason"] == "length"
    assert any("shutting down" in n for n in chat[-1]["edgevlm"]["notices"])
    assert [e["type"] for e in messages[-2:]] == ["message_delta", "message_stop"]
    assert messages[-2]["delta"]["stop_reason"] == "max_tokens"
    assert any("shutting down" in n for n in messages[-2]["edgevlm"]["notices"])
    assert ollama[-1]["done"] is True and ollama[-1]["done_reason"] == "length"
    assert all(line["done"] is False for line in ollama[:-1])
    assert responses[-1]["type"] == "response.incomplete"
    assert responses[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_a_second_signal_stops_at_once_without_a_traceback(model_pair):
    """SIGTERM, then Ctrl-C right away, with four replies running and a long grace: the process
    ends within 2 s of the second signal, exit 128 + the number of the signal that ended it
    (Python runs the handlers of signals pending together lowest number first: 143 here, 130
    when Ctrl-C comes second), streams cut, one line saying so, no traceback."""
    s = served(model_pair("llava15"), 60)
    try:
        streams = [openai_stream(s.url) for _ in range(4)]
        wait_for(s, lambda st: st["slots"]["busy"] == 4)
        s.proc.send_signal(signal.SIGTERM)
        s.proc.send_signal(signal.SIGINT)
        second = time.monotonic()
        rc = s.proc.wait(timeout=10)
        took = time.monotonic() - second
        err = s.proc.stderr.read()
        for t in streams:
            t.thread.join(10)
    finally:
        if s.proc.poll() is None:
            s.stop()
    assert rc in (128 + signal.SIGINT, 128 + signal.SIGTERM) and took <= 2, (rc, took, err)
    assert "Traceback" not in err and "stopped at once" in err, err
    assert all(not t.thread.is_alive() for t in streams)
    assert all(not t.lines or t.lines[-1][1] != "data: [DONE]" for t in streams)  # cut: no last event


def test_a_drained_service_ends_a_whole_reply_with_what_it_has_and_refuses_the_rest(model_pair):
    """``ChatService.drain``: a whole (not streamed) reply in progress ends after the grace with
    its text so far (finish "length", a notice), and a new request is refused with 503
    ``server_stopping`` before it takes a place."""
    pair = model_pair("llava15")
    grace = 0.5
    with edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, n_threads=2) as vlm:
        service = ChatService(vlm, ServeOptions(shutdown_grace_s=grace))
        service.start()
        req = parse_chat_request({"messages": [user("Talk.")], "max_tokens": 3000, "temperature": 0})

        async def talk_then_drain():
            task = asyncio.ensure_future(service.complete(req))
            await until_async(lambda: service.worker.running, "the reply running")
            service.drain()
            drained = time.monotonic()
            reply = await asyncio.wait_for(task, grace + 5)
            return reply, time.monotonic() - drained

        try:
            reply, took = asyncio.run(talk_then_drain())
            with pytest.raises(APIError) as err:
                service.admit()
        finally:
            service.stop()
    assert reply.finish == "length" and reply.text and reply.completion_tokens < 3000
    assert grace - 0.1 <= took <= grace + 2, took
    assert any("shutting down" in n for n in reply.extension["notices"])
    assert kind_of(err.value).status == 503 and err.value.code == "server_stopping"
    assert service.admitted == 0 and service.host.in_use == 0
