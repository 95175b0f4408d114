"""Nothing one client sends stalls or bloats the server (#59): large bodies at once, bodies and
headers that trickle in, ``/api/show`` bodies, picture URLs that are large or slow — each
beside two innocent clients (``tests/beside.py``) that must keep getting their 200. Real
``edgevlm serve`` subprocesses on 127.0.0.1 (the tiny generated LLaVA pair), raw sockets, httpx,
and a picture server of the test's own on 127.0.0.1."""

from __future__ import annotations

import http.server
import io
import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from PIL import Image

from edgevlm_testkit.waiting import until

from .beside import Innocents, peak_rss_mib, rss_mib
from .test_serve import Served, data_uri, user
from .test_serve_bodies import open_body

MIB = 2**20


def noisy_png(width: int, height: int, seed: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def closed(s: socket.socket) -> bool:
    """Whether the server closed ``s`` (without a response: nothing to read, then the end)."""
    s.setblocking(False)
    try:
        return s.recv(65536) == b""
    except BlockingIOError:
        return False
    except OSError:  # (reset)
        return True
    finally:
        s.setblocking(True)


def status_of(s: socket.socket) -> tuple[int, bytes]:
    """The status and the body of the response on ``s`` (read to its Content-Length)."""
    f = s.makefile("rb")
    status = int(f.readline().split()[1])
    length = 0
    while (line := f.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode().partition(":")
        if name.lower() == "content-length":
            length = int(value)
    return status, f.read(length)


@pytest.mark.slow
def test_eight_large_bodies_at_once_are_all_answered_none_waiting_on_another_half_read(model_pair):
    """Case 4: eight clients send a ~6 MiB photo each at once to a server whose host allowance
    holds only two such bodies whole (``--host-allowance 48MiB``; 3 × 6.7 MiB each while read)
    and which lets a request wait for memory as long as it takes (``--host-wait 600``). Each
    body takes its whole length before its first byte is read, so the ones waiting hold nothing
    and the ones reading always finish: all eight get their 200, and the innocent clients keep
    being answered. Before, each body took its allowance chunk by chunk: eight half-read bodies
    held it all and waited on each other until the host wait ran out."""
    s = Served(
        model_pair("llava15"),
        *("--parallel", "2", "--queue", "16", "--ctx", "4096", "--max-tokens", "4"),
        *("--host-allowance", "48MiB", "--host-wait", "600"),
    )
    try:
        photos = [data_uri(noisy_png(1400, 1200, seed)) for seed in range(8)]
        assert all(3 * len(p) > 16 * MIB for p in photos)  # (two fit the allowance whole, three do not)

        def send(uri: str) -> int:
            body = {"model": "m", "messages": [user("What is it?", uri)], "max_tokens": 2, "temperature": 0}
            return httpx.post(s.url + "/v1/chat/completions", json=body, timeout=300).status_code

        with Innocents(s.url) as inn, ThreadPoolExecutor(8) as pool:
            sent = [pool.submit(send, p) for p in photos]
            inn.served(1, "answered while eight large bodies came in")
            assert [f.result(timeout=300) for f in sent] == [200] * 8
        until(lambda: s.status()["memory"]["host"]["in_use_bytes"] == 0, "every byte given back")
    finally:
        err = s.stop()
    assert "Traceback" not in err, err


@pytest.mark.slow
def test_twenty_trickling_bodies_hold_no_place_and_trickling_heads_are_closed(model_pair):
    """Case 5: twenty sockets declare 1,000,000-byte bodies and send 40 KB/s each (above the
    minimum rate: their bodies are on time), and twenty more send their request's head a line
    at a time, to a server with three places (one sequence, a queue of two). A body takes its
    place only once it is in: the innocent clients are answered while all twenty bodies are
    still arriving; the heads are closed by ``--header-timeout``. Before, a place was taken at
    the door: the trickling bodies held every place and the innocents got 503s, and uvicorn
    let a head trickle for as long as it liked."""
    s = Served(
        model_pair("llava15"),
        *("--parallel", "1", "--queue", "2", "--ctx", "4096", "--max-tokens", "4", "--header-timeout", "2"),
    )
    stop = threading.Event()
    bodies = [open_body(s.port, "/v1/chat/completions", 1_000_000, b'{"pad": "') for _ in range(20)]
    heads = []
    for _ in range(20):
        h = socket.create_connection(("127.0.0.1", s.port), timeout=60)
        h.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        heads.append(h)

    def trickle() -> None:  # 4 KB per 0.1 s to each body (40 KB/s), a header line to each head
        while not stop.wait(0.1):  # (the trickle's own pace, not a synchronisation)
            for b in bodies:
                try:
                    b.sendall(b"a" * 4000)
                except OSError:
                    pass
            for h in heads:
                try:
                    h.sendall(b"X-Trickle: 1\r\n")
                except OSError:
                    pass

    threading.Thread(target=trickle, daemon=True).start()
    try:
        with Innocents(s.url) as inn:
            until(lambda: s.status()["queue"]["reading"] == 20, "all twenty bodies arriving")
            inn.served(2, "answered while twenty bodies trickled in")
            st = s.status()
            # (still arriving: they held no place; an innocent's own body may be being read too)
            assert st["queue"]["reading"] >= 20, st["queue"]
            assert st["memory"]["host"]["in_use_bytes"] >= 20 * 1_000_000  # (each its whole length)
            until(lambda: all(closed(h) for h in heads), "every trickling head closed", timeout=60)
    finally:
        stop.set()
        for sock in bodies + heads:
            sock.close()
        err = s.stop()
    assert "Traceback" not in err, err


@pytest.mark.slow
def test_api_show_reads_its_body_under_the_rules_asks_for_the_key_and_shows_no_path(model_pair):
    """Case 6: sixteen clients POST 30 MB bodies to Ollama's ``/api/show`` at once: each is a 413
    in Ollama's shape before its body is read (``/api/show`` bodies name a model: 64 KiB at most,
    read under a lease at the server's pace), and the server's RSS does not grow by the bodies
    (before: +764 MiB, read whole outside the allowance). It asks for the API key like every API
    route, and its ``modelfile`` names the model's file, not the path it lies at."""
    pair = model_pair("llava15")
    key = "sekrit"
    s = Served(pair, "--parallel", "2", "--ctx", "4096", "--max-tokens", "4", "--api-key", key)
    declared = 30_000_000
    try:
        with Innocents(s.url, key=key) as inn:
            before = rss_mib(s.proc.pid)
            stop = threading.Event()
            peak = peak_rss_mib(s.proc.pid, stop)

            def show(i: int) -> tuple[int, bytes]:
                head = json.dumps({"model": "m", "pad": ""})[:-2].encode()
                sock = open_body(s.port, "/api/show", declared, head, f"Authorization: Bearer {key}\r\n")

                def rest() -> None:  # the rest of the body, for as long as the server takes it
                    try:
                        for _ in range(declared // MIB):
                            sock.sendall(b"a" * MIB)
                    except OSError:
                        pass

                threading.Thread(target=rest, daemon=True).start()
                try:
                    return status_of(sock)
                finally:
                    sock.close()

            with ThreadPoolExecutor(16) as pool:
                answers = list(pool.map(show, range(16)))
            stop.set()
            for status, body in answers:
                assert status == 413, (status, body[:200])
                assert set(json.loads(body)) == {"error"}
                assert "65,536" in json.loads(body)["error"]
            assert peak[0] - before < 64, f"RSS {before:.0f} MiB before, {peak[0]:.0f} MiB at its peak"
            inn.served(1)
        assert httpx.post(s.url + "/api/show", json={"model": "model"}, timeout=30).status_code == 401
        r = httpx.post(s.url + "/api/show", json={"model": "model"}, headers={"authorization": f"Bearer {key}"})
        assert r.status_code == 200, r.text
        assert str(pair.model.parent) not in r.text
        assert pair.model.name in r.json()["modelfile"]
    finally:
        err = s.stop()
    assert "Traceback" not in err, err


class Pictures:
    """Pictures served on 127.0.0.1: ``/big/N.png`` is a small PNG followed by ``pad`` bytes
    (a file of that size that decodes to 80×60) sent at once; ``/slow/N.png`` the same file
    sent 4 KiB at a time, just above the server's minimum rate, until ``stop``; ``/good.png``
    the small PNG alone. Counts the slow fetches open."""

    def __init__(self, pad: int):
        self.small = noisy_png(80, 60, 5)
        self.big = self.small + b"\0" * pad
        self.stop = threading.Event()
        self.slow_open = 0
        self.lock = threading.Lock()
        pics = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                slow = self.path.startswith("/slow/")
                data = pics.small if self.path == "/good.png" else pics.big
                self.send_response(200)
                self.send_header("content-type", "image/png")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                try:
                    if not slow:
                        self.wfile.write(data)
                        return
                    with pics.lock:
                        pics.slow_open += 1
                    for i in range(0, len(data), 4096):  # 4 KiB per 0.1 s: above 32 KiB/s once begun
                        self.wfile.write(data[i : i + 4096])
                        self.wfile.flush()
                        if pics.stop.wait(0.1):  # (the drip's own pace)
                            return
                except OSError:
                    pass
                finally:
                    if slow:
                        with pics.lock:
                            pics.slow_open -= 1

            def log_message(self, *a: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.slow
def test_picture_urls_are_fetched_within_the_allowance_and_the_memory_comes_back(model_pair):
    """Case 3, memory: four requests with sixteen 16 MiB picture URLs each, at once, to a server
    with a 256 MiB host allowance: the fetched bytes are held on each request's lease as they
    arrive, so the server's RSS never grows by more than the allowance (and a margin for the
    interpreter), every request ends with an answer or a 4xx/503 that says why (none hangs, no
    500), the innocent clients keep being answered, and once idle the RSS is back near where it
    was. Before, fetches were outside the allowance: 64 × 16 MiB fetched at once on 16 threads,
    and much of it kept while idle; and a request that gave way left its fetches reading on
    (``test_a_fetch_stops_at_its_next_chunk_once_its_request_has_ended``): 92 MiB over idle
    was seen after."""
    pics = Pictures(16 * MIB)
    s = Served(
        model_pair("llava15"),
        *("--parallel", "2", "--queue", "8", "--ctx", "4096", "--max-tokens", "4"),
        *("--host-allowance", "256MiB", "--host-wait", "5", "--allow-private-urls"),
    )
    try:

        def ask(r: int) -> int:
            urls = [f"{pics.url}/big/{r}-{i}.png" for i in range(16)]
            body = {"model": "m", "messages": [user("What are these?", *urls)], "max_tokens": 2}
            return httpx.post(s.url + "/v1/chat/completions", json=body, timeout=300).status_code

        with Innocents(s.url) as inn:
            idle = rss_mib(s.proc.pid)
            stop = threading.Event()
            peak = peak_rss_mib(s.proc.pid, stop)
            with ThreadPoolExecutor(4) as pool:
                sent = [pool.submit(ask, r) for r in range(4)]
                inn.served(1, "answered while 64 large URLs were fetched")
                statuses = [f.result(timeout=300) for f in sent]
            stop.set()
            assert all(st in (200, 400, 503) for st in statuses), statuses
            assert peak[0] - idle <= 256 + 128, f"RSS {idle:.0f} MiB idle, {peak[0]:.0f} MiB at its peak"
            until(lambda: s.status()["memory"]["host"]["in_use_bytes"] == 0, "every byte given back")
            # (a request's last objects are freed, and the allowance's trim runs, just after its
            # bytes are given back: the RSS is looked at until it is back, up to the deadline)
            try:
                until(lambda: rss_mib(s.proc.pid) - idle <= 64, "the RSS back within 64 MiB of idle")
            except AssertionError as exc:
                raise AssertionError(f"{exc}: {idle:.0f} MiB idle before, {rss_mib(s.proc.pid):.0f} MiB now") from None
    finally:
        pics.close()
        err = s.stop()
    assert "Traceback" not in err, err


@pytest.mark.slow
def test_a_request_with_sixteen_slow_urls_leaves_fetch_threads_to_others(model_pair):
    """Case 3, threads: one request names sixteen URLs that drip just above the minimum rate;
    while they drip, another request's good URL is fetched and answered — a request fetches at
    most four of its URLs at once, leaving the other threads to everyone else. Before, its
    sixteen URLs held all sixteen fetch threads and the good URL waited for them (27.7 s)."""
    pics = Pictures(MIB)  # (25 s a file at 40 KB/s: they drip for as long as the test needs)
    s = Served(
        model_pair("llava15"),
        *("--parallel", "2", "--queue", "8", "--ctx", "4096", "--max-tokens", "4", "--allow-private-urls"),
    )
    try:
        slow_urls = [f"{pics.url}/slow/{i}.png" for i in range(16)]
        slow_body = {"model": "m", "messages": [user("What are these?", *slow_urls)], "max_tokens": 2}
        with Innocents(s.url) as inn, ThreadPoolExecutor(1) as pool:
            slow = pool.submit(httpx.post, s.url + "/v1/chat/completions", json=slow_body, timeout=300)
            until(lambda: pics.slow_open >= 4, "its URLs dripping")
            good = {"model": "m", "messages": [user("What is it?", f"{pics.url}/good.png")], "max_tokens": 2}
            r = httpx.post(s.url + "/v1/chat/completions", json=good, timeout=300)
            assert r.status_code == 200, r.text
            assert not slow.done()
            assert pics.slow_open == 4
            inn.served(1)
            pics.stop.set()  # the drips end: the slow request gets its answer
            assert slow.result(timeout=300).status_code in (200, 400)
    finally:
        pics.close()
        err = s.stop()
    assert "Traceback" not in err, err


BIG = "x" * 1_000_000  # a caller's value no error, log line or stream chunk may repeat whole


def echo_cases() -> list[tuple[str, dict]]:
    """(route, body) pairs whose one bad field holds ``BIG``: each a 4xx that names the field."""
    hi = [{"role": "user", "content": "hi"}]
    fn = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    return [
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": BIG, "content": "hi"}]}),
        ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": [{"type": BIG}]}]}),
        ("/v1/chat/completions", {"model": "m", "messages": hi, "response_format": {"type": BIG}}),
        ("/v1/chat/completions", {"model": "m", "messages": hi, "temperature": BIG}),
        ("/v1/chat/completions", {"model": "m", "messages": hi, "max_tokens": BIG}),
        ("/v1/chat/completions", {"model": "m", "messages": hi, "tools": [fn], "tool_choice": BIG}),
        (
            "/v1/chat/completions",
            {
                "model": "m",
                "messages": hi,
                "tools": [fn],
                "tool_choice": {"type": "function", "function": {"name": BIG}},
            },
        ),
        (
            "/v1/chat/completions",
            {"model": "m", "messages": hi, "tools": [{"type": "function", "function": {"name": BIG}}]},
        ),
        ("/v1/responses", {"model": "m", "input": [{"role": BIG, "content": "hi"}]}),
        ("/v1/responses", {"model": "m", "input": [{"type": BIG}]}),
        ("/v1/responses", {"model": "m", "input": "hi", "truncation": BIG}),
        ("/v1/responses", {"model": "m", "input": "hi", "reasoning": {"effort": BIG}}),
        ("/v1/responses", {"model": "m", "input": "hi", "text": {"verbosity": BIG}}),
        ("/v1/responses", {"model": "m", "input": "hi", "previous_response_id": BIG}),
        ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": BIG, "content": "hi"}]}),
        ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": BIG}]}]}),
        ("/api/chat", {"model": "m", "messages": [{"role": BIG, "content": "hi"}]}),
        ("/api/chat", {"model": "m", "messages": hi, "format": BIG}),
        ("/api/chat", {"model": "m", "messages": hi, "think": BIG}),
        ("/api/chat", {"model": "m", "messages": hi, "options": {"num_predict": BIG}}),
        ("/v1/edgevlm/budget", {"image_url": {"url": data_uri(noisy_png(32, 24, 1))}, "name": BIG}),
    ]


@pytest.mark.slow
def test_no_error_log_line_or_stream_chunk_repeats_a_large_value_whole(model_pair):
    """Case 8: a megabyte in each field an error names — roles, part and tool types, tool names,
    numbers, formats, ids, the budget route's ``name`` — gets a 4xx of a few hundred bytes in
    the API's own shape (the value's first characters and its length), one log line of at most
    that; a streamed reply whose request names a 10 MB ``model`` repeats the server's model name
    in its chunks, not that. Before: a 30 MB ``$ref`` gave a 60 MB error body and log line, and
    a 10 MB model name came back in every chunk."""
    s = Served(model_pair("llava15"), "--parallel", "2", "--ctx", "4096", "--max-tokens", "4")
    try:
        with Innocents(s.url) as inn:
            for route, body in echo_cases():
                r = httpx.post(s.url + route, json=body, timeout=60)
                assert 400 <= r.status_code < 500, (route, r.status_code, r.text[:300])
                assert len(r.content) < 2000, (route, len(r.content), r.text[:300])
                assert BIG[:100] not in r.text, (route, r.text[:300])
            huge = {"model": "m" * 10_000_000, "messages": [user("hi")], "max_tokens": 8, "stream": True}
            with httpx.stream("POST", s.url + "/v1/chat/completions", json=huge, timeout=120) as r:
                lines = [ln for ln in r.iter_lines() if ln]
            assert r.status_code == 200
            assert lines[-1] == "data: [DONE]"
            assert all(len(ln) < 2000 for ln in lines), max(map(len, lines))
            inn.served(1)
    finally:
        err = s.stop()
    assert "Traceback" not in err, err
    assert max(map(len, err.splitlines())) < 2000, max(map(len, err.splitlines()))
