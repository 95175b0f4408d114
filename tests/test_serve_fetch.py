"""Fetching pictures at the server's edge: a ``data:`` picture is not kept once its request ends
(its scheme is read without ``urlsplit``, which keeps its last 128 inputs), a slow image URL is
cut at its own deadline or minimum rate with a 400 naming it, fetches run on threads of their
own so a text-only request beside slow URLs answers in its own time, and a request whose
preparation outlives ``--timeout`` ends with its timeout error. Real servers on 127.0.0.1 (an
``edgevlm serve`` subprocess, or the app on uvicorn in a thread), a slow picture server of the
test's own on 127.0.0.1, the official ``openai`` client."""

from __future__ import annotations

import base64
import functools
import http.server
import io
import struct
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import numpy as np
import pytest
from openai import APIStatusError, BadRequestError
from PIL import Image

import edgevlm
from edgevlm.errors import MediaRefused
from edgevlm.plan.host import HostAllowance, LeaseReleased
from edgevlm.runtime.intake.fetch import RATE_GRACE_S, URL_MAX_CHARS, fetch_bytes, url_scheme
from edgevlm.serve.api_errors import kind_of
from edgevlm.serve.options import ServeOptions

from .test_serve import Served, data_uri, user
from .test_serve_faults import InProcess, until

CACHED = hasattr(urlsplit, "cache_info")  # (Python 3.11+: urlsplit keeps its last 128 inputs)


class Drip:
    """A picture server on 127.0.0.1 that sends its headers at once, then one byte every
    ``every`` seconds (at most ``most``); counts the fetches that reached it and ended."""

    def __init__(self, every: float = 0.5, most: int = 200):
        self.stop, self.lock = threading.Event(), threading.Lock()
        self.connected = self.ended = 0
        drip = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                with drip.lock:
                    drip.connected += 1
                try:
                    self.send_response(200)
                    self.send_header("content-type", "image/jpeg")
                    self.send_header("content-length", "100000")
                    self.end_headers()
                    for _ in range(most):
                        self.wfile.write(b"\xff")
                        self.wfile.flush()
                        if drip.stop.wait(every):  # (the drip's own pace, not a synchronisation)
                            break
                except OSError:  # the fetch gave up
                    pass
                finally:
                    with drip.lock:
                        drip.ended += 1

            def log_message(self, *a):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()


def test_a_data_uri_scheme_is_read_without_parsing_the_uri():
    """A multi-megabyte data: URI is read without ``urlsplit`` being called (its cache would
    hold the URI, a second copy of the picture, after the request ends); the scheme read from
    the first characters is what urlsplit says for short sources; an over-long URL is refused
    before any parse."""
    raw = np.random.default_rng(1).integers(0, 256, 4 * 2**20, dtype=np.uint8).tobytes()
    uri = "data:image/jpeg;base64," + base64.b64encode(raw).decode()
    before = urlsplit.cache_info() if CACHED else None
    assert fetch_bytes(uri, ServeOptions().fetch_rules, "image 1") == raw
    with pytest.raises(MediaRefused, match=f"longer than {URL_MAX_CHARS:,} characters"):
        fetch_bytes("http://example.com/" + "a" * URL_MAX_CHARS, ServeOptions().fetch_rules, "image 1")
    if CACHED:
        after = urlsplit.cache_info()
        assert (after.hits, after.misses) == (before.hits, before.misses)  # urlsplit never called
    for source in [
        "data:image/png;base64,AAAA",
        "DATA:,x",
        "HTTPS://example.com/a.png",
        "h\tttp://example.com/a.png",
        "C:\\pictures\\a.png",
        "/tmp/a:b.png",
        "pictures/a.png",
        "a b:c",
        "1http://x",
        "svn+ssh://host/x",
        "file:///etc/passwd",
        ":nothing",
    ]:
        assert url_scheme(source) == urlsplit(source).scheme.lower(), source


def test_a_fetch_stops_at_its_next_chunk_once_its_request_has_ended():
    """A URL's body is read on the request's lease; when the request ends (it gave way, another
    of its pictures failed, its client left) the lease is released and gives back all it held,
    so the fetch stops at its next chunk with ``LeaseReleased`` and closes the connection.
    Before, it read on to the URL's end (here: its 30 s deadline) and copied the body, bytes
    nobody planned or would take."""
    drip = Drip(every=0.05, most=2000)
    allowance = HostAllowance(1 << 20)
    lease = allowance.lease("the request")
    opts = ServeOptions(allow_private_urls=True, url_deadline_s=30, url_min_rate=0)
    try:
        with ThreadPoolExecutor(1) as pool:
            fetch = pool.submit(fetch_bytes, drip.url + "/a.jpg", opts.fetch_rules, "messages[0]", None, lease)
            until(lambda: lease.held > 0, "its body's bytes taken up front")
            assert lease.held == 2 * 100_000  # (FETCH_COPIES × its Content-Length)
            lease.release()
            with pytest.raises(LeaseReleased, match="no longer read"):
                fetch.result(timeout=10)
        until(lambda: drip.ended == 1, "the connection closed")
        assert allowance.in_use == 0
    finally:
        drip.close()


@pytest.mark.slow
def test_a_slow_url_is_cut_at_its_deadline_and_a_dripping_one_at_its_rate():
    """A URL sending one byte every half second: with no minimum rate it ends at its deadline
    (1.5 s) with a 400 that names it and says it took too long; with a minimum rate it ends
    as too slow once its grace has passed — each within its bound + 1 s."""
    drip = Drip(every=0.5)
    try:
        url = drip.url + "/slow.jpg"
        opts = ServeOptions(allow_private_urls=True, url_deadline_s=1.5, url_min_rate=0)
        t0 = time.monotonic()
        with pytest.raises(MediaRefused) as err:
            fetch_bytes(url, opts.fetch_rules, "messages[0]")
        took = time.monotonic() - t0
        assert kind_of(err.value).status == 400 and 1.4 <= took <= 1.5 + 1, took
        assert str(err.value).startswith(f"messages[0]: the image URL {url} took longer than 1.5 s")
        opts = ServeOptions(allow_private_urls=True, url_deadline_s=30, url_min_rate=1024)
        t0 = time.monotonic()
        with pytest.raises(MediaRefused) as err:
            fetch_bytes(url, opts.fetch_rules, "messages[0]")
        took = time.monotonic() - t0
        assert RATE_GRACE_S - 0.1 <= took <= RATE_GRACE_S + 1, took
        assert f"the image URL {url} is too slow" in str(err.value) and "1,024 bytes/s" in str(err.value)
    finally:
        drip.close()


@pytest.mark.slow
def test_a_text_request_beside_eight_slow_urls_answers_in_its_own_time(model_pair):
    """Eight requests whose pictures drip in (one byte every half second) hold no thread a
    text-only request needs: it answers within its own time alone + 2 s, with the same answer,
    and each slow one ends with its 400 (naming its URL, "took longer") by its fetch deadline
    (4 s) + 2 s."""
    pair = model_pair("llava15")
    vlm = edgevlm.load(pair.model, pair.mmproj, n_ctx=2048, n_threads=2, n_seq_max=2)
    opts = ServeOptions(allow_private_urls=True, url_deadline_s=4, url_min_rate=0, max_tokens=8)
    srv, drip = InProcess(vlm, opts), Drip(every=0.5)
    try:
        c = srv.client()

        def text():
            t0 = time.monotonic()
            r = c.chat.completions.create(model="m", messages=[user("Hi, who are you?")], max_tokens=6, temperature=0)
            return r.choices[0].message.content, time.monotonic() - t0

        text()  # (warm-up)
        alone, own = text()

        def slow(i):
            t0 = time.monotonic()
            with pytest.raises(BadRequestError) as err:
                c.chat.completions.create(
                    model="m", messages=[user("What is it?", f"{drip.url}/{i}.jpg")], max_tokens=4
                )
            return err.value.body["message"], time.monotonic() - t0

        with ThreadPoolExecutor(8) as pool:
            slows = [pool.submit(slow, i) for i in range(8)]
            until(lambda: srv.status()["queue"]["admitted"] == 8 and drip.connected, "all eight in", timeout=10)
            answer, took = text()
            assert not any(f.done() for f in slows)  # (answered beside all eight)
            assert answer == alone and took <= own + 2, (took, own)
            until(lambda: drip.connected == 8, "all eight fetched at once", timeout=3)  # (before any ends: 4 s)
            for i, f in enumerate(slows):
                message, spent = f.result(timeout=30)
                assert f"the image URL {drip.url}/{i}.jpg took longer than 4 s" in message
                assert spent <= 4 + 2, spent
        until(lambda: srv.status()["queue"]["admitted"] == 0, "every place given back", timeout=5)
        assert srv.status()["memory"]["host"]["in_use_bytes"] == 0
    finally:
        drip.close()
        srv.stop()
        vlm.close()


@pytest.mark.slow
def test_a_request_whose_preparation_outlives_its_timeout_ends_with_its_timeout_error(model_pair):
    """--timeout counts from the request's start, its preparation included: a picture that
    drips in for longer ends the request with the timeout error (503, code "timeout") by its
    --timeout (2 s) + 2 s; its place and memory come back, and the next request is answered."""
    pair = model_pair("llava15")
    vlm = edgevlm.load(pair.model, pair.mmproj, n_ctx=2048, n_threads=2, n_seq_max=2)
    opts = ServeOptions(allow_private_urls=True, timeout_s=2, url_deadline_s=30, url_min_rate=0, max_tokens=8)
    srv, drip = InProcess(vlm, opts), Drip(every=0.5)
    try:
        c = srv.client()
        t0 = time.monotonic()
        with pytest.raises(APIStatusError) as err:
            c.chat.completions.create(model="m", messages=[user("What is it?", drip.url + "/a.jpg")], max_tokens=4)
        took = time.monotonic() - t0
        assert err.value.status_code == 503 and err.value.body["code"] == "timeout", err.value.body
        assert "not prepared within its 2 s" in err.value.body["message"]
        assert 1.9 <= took <= 2 + 2, took
        until(lambda: srv.status()["queue"]["admitted"] == 0, "its place given back", timeout=5)
        assert srv.status()["memory"]["host"]["in_use_bytes"] == 0
        assert c.chat.completions.create(model="m", messages=[user("Hi")], max_tokens=3).choices
    finally:
        drip.close()
        srv.stop()
        vlm.close()


@functools.lru_cache(maxsize=1)
def big_photo() -> bytes:
    """A 6000×4000 JPEG of noise: about 6 MiB, 8.5 MiB as a data: URI."""
    buf = io.BytesIO()
    noise = np.random.default_rng(0).integers(0, 256, (4000, 6000, 3), dtype=np.uint8)
    Image.fromarray(noise).save(buf, "JPEG", quality=30)
    return buf.getvalue()


def distinct_photo(seed: int) -> bytes:
    """``big_photo`` as a file of its own: a random comment (a JPEG COM segment) after its first
    marker, so its data: URI differs from every other while its pixels are the same (one unit
    in the server's image cache, which is bounded and planned: not what this measures)."""
    data, note = big_photo(), np.random.default_rng(seed).bytes(16).hex().encode()
    return data[:2] + b"\xff\xfe" + struct.pack(">H", len(note) + 2) + note + data[2:]


@pytest.mark.slow
def test_distinct_data_pictures_leave_the_idle_rss_where_it_was(model_pair):
    """20 distinct 6000×4000 data: pictures, one request each: the server's idle RSS after them
    is within 10 % of where it was after the first 3 (warm-up). Before, every distinct data:
    URI stayed in memory (urlsplit's cache), about 8.5 MiB each here."""
    s = Served(model_pair("llava15"), "--max-tokens", "4")
    try:
        c = s.client()

        def idle_rss() -> int:
            until(lambda: s.status()["queue"]["admitted"] == 0, "idle", timeout=10)
            return s.status()["memory"]["measured"]["process_rss_bytes"]

        for i in range(20):
            uri = data_uri(distinct_photo(i), "image/jpeg")
            r = c.chat.completions.create(model="m", messages=[user("What is it?", uri)], max_tokens=2)
            assert r.choices[0].finish_reason in ("stop", "length")
            del uri
            if i == 2:
                warm = idle_rss()
        end = idle_rss()
        assert end <= warm * 1.10, f"idle RSS {warm / 2**20:.0f} MiB after warm-up, {end / 2**20:.0f} MiB after"
    finally:
        assert "Traceback" not in s.stop()
