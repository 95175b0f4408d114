"""The server's edges under abuse: bodies that trickle in, JSON nested 100,000 deep, refusals and
clients gone in the log, a port already in use. Real ``edgevlm serve`` subprocesses on
127.0.0.1 (tiny generated pairs), raw sockets and httpx; beside every fault, innocent requests
that must still get their 200."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from edgevlm.serve.http import BODY_COPIES
from edgevlm_testkit.waiting import until

from .conftest import run_cli
from .test_serve import LONG, Served, data_uri, free_port, png, user

BODY_TIMEOUT_S = 3.0  # the servers' --body-timeout here (1 s more per 64 KiB that came: none do)


def open_body(port: int, path: str, declared: int, first: bytes = b"{", headers: str = "") -> socket.socket:
    """A raw POST to ``path`` that declares ``declared`` body bytes and sends only ``first``
    (``headers``: more header lines, each ending in CRLF)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=60)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n{headers}"
        f"Content-Length: {declared}\r\n\r\n"
    )
    s.sendall(head.encode() + first)
    return s


def reply_of(s: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the response on a raw socket (``connection: close``: read to the
    end). A server that closes a connection whose body it stopped reading resets it (the kernel's
    answer to unread bytes, which a trickling client keeps sending): a reset after the answer ends
    it too."""
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            if not data:
                raise
            break
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def innocent(url: str) -> list[int]:
    """Two innocent requests, a photo and plain text: their statuses."""
    photo = {"model": "m", "messages": [user("What is this?", data_uri(png(96, 72, seed=3)))], "max_tokens": 4}
    text = {"model": "m", "messages": [user("Hi.")], "max_tokens": 4}
    with ThreadPoolExecutor(2) as pool:
        done = pool.map(
            lambda b: httpx.post(url + "/v1/chat/completions", json=b, timeout=60).status_code, [photo, text]
        )
        return list(done)


@pytest.fixture(scope="module")
def edge(model_pair):
    """One sequence, a queue of four (three bodies and the two innocent requests fit), a short body
    deadline."""
    s = Served(
        model_pair("llava15"),
        *("--parallel", "1", "--queue", "4", "--ctx", "2048", "--max-tokens", "8"),
        *("--body-timeout", str(BODY_TIMEOUT_S), "--body-min-rate", "64KiB", "--timeout", "60"),
    )
    yield s
    err = s.stop()
    assert "Traceback" not in err, err


@pytest.mark.slow
def test_trickled_bodies_hold_their_whole_length_and_no_place_end_with_408_and_a_photo_meanwhile_gets_its_200(edge):
    """Three raw sockets declare 30 MB bodies and send a byte now and then: each holds host
    allowance for its whole declared length from the start (so bodies half read never wait on
    each other) and no place in the queue (a place is taken once a body is in); a photo and a
    text request meanwhile get their 200; within the body deadline + 2 s each socket gets a 408
    (``body_timeout``, OpenAI's error shape) and every byte is given back."""
    declared = 30_000_000
    started = time.monotonic()
    socks = [open_body(edge.port, "/v1/chat/completions", declared) for _ in range(3)]

    def trickle() -> None:
        for s in socks:
            try:
                s.sendall(b" ")
            except OSError:  # (the server ended it)
                pass

    until(lambda: edge.status()["queue"]["reading"] == 3, "every body arriving", each=trickle)
    st = edge.status()
    assert st["queue"]["admitted"] == 0  # no place while a body arrives
    assert st["memory"]["host"]["in_use_bytes"] == 3 * declared * BODY_COPIES  # whole, from the start
    with ThreadPoolExecutor(1) as pool:
        meanwhile = pool.submit(innocent, edge.url)
        until(meanwhile.done, "the innocent requests answered", each=trickle)
    assert meanwhile.result() == [200, 200]
    until(lambda: edge.status()["queue"]["reading"] == 0, "the bodies ended", BODY_TIMEOUT_S + 2, each=trickle)
    assert time.monotonic() - started < BODY_TIMEOUT_S + 2 + 10  # (the innocent requests ran meanwhile)
    assert edge.status()["memory"]["host"]["in_use_bytes"] == 0
    for s in socks:
        status, body = reply_of(s)
        s.close()
        assert status == 408 and body["error"]["code"] == "body_timeout", body
        assert body["error"]["type"] == "invalid_request_error" and "did not arrive in time" in body["error"]["message"]
    assert innocent(edge.url) == [200, 200]


DEEP = b"[" * 100_000 + b"]" * 100_000
DEEP_FIELD = b'{"model": "m", "messages": ' + DEEP + b"}"
SHAPES = {  # bodies every API's parse must refuse with a 400, never a 500
    "deep": DEEP,
    "deep in a field": DEEP_FIELD,
    "200 deep": b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "x": '
    + b"[" * 200
    + b"]" * 200
    + b"}",
    "not an object": b"[1, 2]",
    "messages a number": b'{"model": "m", "messages": 7, "prompt": 7, "input": 7}',
    "a message a list": b'{"model": "m", "messages": [[1]], "input": [[1]], "prompt": [[1]]}',
}
ROUTES = {  # route → the API whose error shape it answers in
    "/v1/chat/completions": "openai",
    "/v1/responses": "openai",
    "/v1/edgevlm/budget": "openai",
    "/v1/messages": "anthropic",
    "/v1/messages/count_tokens": "anthropic",
    "/api/chat": "ollama",
    "/api/generate": "ollama",
    "/api/show": "ollama",
}


def test_json_nested_100000_deep_and_bodies_of_the_wrong_shape_are_400s_in_each_apis_shape(edge):
    """Every body route, every API: JSON nested 100,000 deep (at the top and in a field), 200
    deep (valid JSON, over the server's 128 levels), and bodies of the wrong shape are each a 400
    in the API's own error shape with one line saying what is wrong — never a 500; the innocent
    requests before and after get their 200 (and the server's stderr no traceback: the fixture)."""
    assert innocent(edge.url) == [200, 200]
    deep = 0
    for route, api in ROUTES.items():
        for name, body in SHAPES.items():
            if route in ("/v1/edgevlm/budget", "/api/show") and name.startswith(("messages", "a message")):
                continue  # (no messages there: a field they do not read is no error)
            r = httpx.post(edge.url + route, content=body, headers={"content-type": "application/json"}, timeout=30)
            big = route == "/api/show" and len(body) > 65536  # (its bodies name a model: 64 KiB at most)
            assert r.status_code == (413 if big else 400), (route, name, r.status_code, r.text[:300])
            got = r.json()
            if api == "openai":
                message = got["error"]["message"]
                assert got["error"]["type"] == "invalid_request_error", got
            elif api == "anthropic":
                message = got["error"]["message"]
                assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error", got
            else:
                assert set(got) == {"error"}, got
                message = got["error"]
            assert "\n" not in message and message, (route, name, message)
            if big:
                assert "larger than 65,536 bytes" in message, message
            elif "deep" in name:
                assert "too deeply" in message, (route, name, message)
                deep += 1
    assert deep == len(ROUTES) * 3 - 2  # (/api/show's two 100,000-deep bodies are over its size first)
    assert innocent(edge.url) == [200, 200]


@pytest.mark.slow
def test_refusals_and_clients_gone_are_one_log_line_each_and_every_cancellation_is_counted(model_pair):
    """With the one sequence busy with a long reply and the one queue place taken: a third
    request gets 503 ``server_busy``; the queued client drops its connection and is counted in
    ``requests.cancelled``; a body that stops coming gets 408; a client that leaves mid-body is
    counted too. Each is one line in the server's log (stderr), none a traceback; two innocent
    requests after them get their 200."""
    s = Served(
        model_pair("llava15"),
        *("--parallel", "1", "--queue", "1", "--ctx", "2048", "--max-tokens", "8"),
        *("--body-timeout", "2", "--timeout", "60"),
    )
    long = {"model": "m", "messages": [user("Talk.")], "max_tokens": 3200, "stream": True, "response_format": LONG}
    stop_long = threading.Event()

    def talk() -> None:  # the long reply, read until the test is done with it (then dropped)
        with httpx.stream("POST", s.url + "/v1/chat/completions", json=long, timeout=60) as r:
            for _ in r.iter_lines():
                if stop_long.is_set():
                    return

    try:
        talker = threading.Thread(target=talk, daemon=True)
        talker.start()
        s.wait_busy(1)
        # (a picture: a short follow-up would start beside the long reply, in the scheduler's short lane)
        ask = user("Me next?", data_uri(png(64, 48, seed=9)))
        queued = json.dumps({"model": "m", "messages": [ask], "max_tokens": 4}).encode()
        q = open_body(s.port, "/v1/chat/completions", len(queued), queued)
        until(lambda: s.status()["queue"]["waiting"] == 1, "the second request queued")
        busy = httpx.post(s.url + "/v1/chat/completions", json={"messages": [user("And me?")]}, timeout=30)
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "server_busy"
        before = s.status()["requests"]["cancelled"]
        q.close()  # the queued client leaves
        until(lambda: s.status()["requests"]["cancelled"] == before + 1, "the queued client counted cancelled")
        until(lambda: besides(s) == 0, "its place given back")

        slow = open_body(s.port, "/v1/chat/completions", 1000)
        status, body = reply_of(slow)  # (within the server's 2 s, 1 s per 16 KiB: one byte came)
        slow.close()
        assert status == 408 and body["error"]["code"] == "body_timeout"

        gone = open_body(s.port, "/v1/chat/completions", 1000)
        until(lambda: s.status()["queue"]["reading"] == 1, "the half-sent body arriving")
        assert besides(s) == 0  # (no place while its body arrives)
        gone.close()
        until(lambda: s.status()["requests"]["cancelled"] == before + 2, "the client gone mid-body counted")
        until(lambda: s.status()["queue"]["reading"] == 0, "its body given up")
        stop_long.set()
        talker.join(30)
        until(lambda: s.status()["queue"]["admitted"] == 0, "the long reply dropped")
        assert innocent(s.url) == [200, 200]
    finally:
        stop_long.set()
        err = s.stop()
    assert "Traceback" not in err, err
    lines = err.splitlines()
    for needle in (
        "503 server_busy",
        "went away before its reply",
        "408 body_timeout",
        "went away while its body was sent",
    ):
        assert len([ln for ln in lines if needle in ln]) == 1, (needle, err)
    assert all(ln.startswith("POST /v1/chat/completions: ") for ln in lines if ": 503 " in ln or ": 408 " in ln), err


def besides(s: Served) -> int:
    """Requests in beside the one running (or none: the long reply may have ended by then)."""
    st = s.status()
    return st["queue"]["admitted"] - st["slots"]["busy"]


@pytest.mark.parametrize("flag", ["--port", "--ollama-port"])
def test_a_port_in_use_is_one_error_line_and_exit_2_before_anything_loads(model_pair, flag):
    """``edgevlm serve`` on a port another socket holds (``--port``, or the second listener's
    ``--ollama-port``) exits 2 within a few seconds (its own start-up time + 10 s at most here)
    with one ``Error:`` line naming host:port and that it is in use — before planning or loading
    (no "loading" line), with no traceback."""
    pair = model_pair("llava15")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        ports = ["--port", str(port)] if flag == "--port" else ["--port", str(free_port()), "--ollama-port", str(port)]
        started = time.monotonic()
        r = run_cli("serve", "-m", str(pair.model), "--mmproj", str(pair.mmproj), *ports, timeout=60)
        took = time.monotonic() - started
    out = r.stdout + r.stderr
    assert r.returncode == 2, out
    errors = [ln for ln in out.splitlines() if ln.startswith("Error:")]
    assert len(errors) == 1 and f"127.0.0.1:{port}" in errors[0] and "in use" in errors[0], out
    assert flag in errors[0]
    assert "loading" not in out and "Traceback" not in out and "Errno" not in out, out
    assert took < 20, took  # (a CLI start-up is a few seconds here; planning and loading never began)
