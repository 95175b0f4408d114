"""``edgevlm serve``: real servers on 127.0.0.1 (``edgevlm serve`` subprocesses started by
fixtures, real llama.cpp on a generated pair) driven by the official ``openai`` client."""

from __future__ import annotations

import base64
import http.server
import io
import json
import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import numpy as np
import pytest
from openai import APIStatusError, BadRequestError, OpenAI
from PIL import Image

from edgevlm.serve.api_errors import APIError, kind_of
from edgevlm.serve.openai import parse_chat_request
from edgevlm_testkit.waiting import until, wait_busy, wait_idle

LONG = {"type": "json_schema", "json_schema": {"name": "long", "schema": {"type": "string", "minLength": 3000}}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def png(width=320, height=240, seed=0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray((rng.random((height, width, 3)) * 255).astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def flat_png(width: int, height: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), (90, 140, 200)).save(buf, "PNG")
    return buf.getvalue()


def data_uri(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def user(text: str, *urls: str) -> dict:
    parts = [{"type": "text", "text": text}] + [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return {"role": "user", "content": parts}


class Served:
    """``edgevlm serve`` in a subprocess on a free port of 127.0.0.1; stopped by ``stop()``."""

    def __init__(self, pair, *args: str, port: int | None = None):
        self.key = args[args.index("--api-key") + 1] if "--api-key" in args else None
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "edgevlm",
                "serve",
                "-m",
                str(pair.model),
                "--mmproj",
                str(pair.mmproj),
                "--port",
                str(self.port),
                "--threads",
                "2",
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            until(self._ready, "ready", timeout=120)
        except AssertionError:
            self.stop()
            raise

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"the server exited: {self.proc.stderr.read()}")
        try:
            return httpx.get(self.url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def client(self, key: str = "none") -> OpenAI:
        return OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def status(self) -> dict:
        auth = {"authorization": f"Bearer {self.key}"} if self.key else {}
        return httpx.get(self.url + "/status", headers=auth, timeout=10).json()

    def wait_busy(self, n: int, timeout: float = 30) -> dict:
        return wait_busy(self.status, n, timeout)

    def wait_idle(self, timeout: float = 30) -> dict:
        return wait_idle(self.status, timeout)

    def stop(self) -> str:
        self.proc.terminate()
        try:
            _, err = self.proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return err


@pytest.fixture(scope="module")
def server(model_pair):
    # 4 × (a picture + a 3000-token reply) fit the context: concurrency is not cut short by it
    s = Served(model_pair("llava15"), "--parallel", "4", "--queue", "8", "--ctx", "16384", "--max-tokens", "16")
    yield s
    err = s.stop()
    assert "Traceback" not in err, err


@pytest.fixture(scope="module")
def tight(model_pair):
    """One sequence, no queue, a small context, a small body limit, a low pixel limit."""
    s = Served(
        model_pair("llava15"),
        "--parallel",
        "1",
        "--queue",
        "0",
        "--ctx",
        "2048",
        "--max-body",
        "1MiB",
        "--max-pixels",
        "200000",
        "--timeout",
        "60",
    )
    yield s
    err = s.stop()
    assert "Traceback" not in err, err


def test_a_reply_about_a_picture(server):
    r = server.client().chat.completions.create(
        model="anything", messages=[user("Describe the picture.", data_uri(png()))], max_tokens=8, temperature=0
    )
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    u = r.usage
    assert u.prompt_tokens > 576 and 0 < u.completion_tokens <= 8
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens


def test_a_streamed_reply_with_usage(server):
    stream = server.client().chat.completions.create(
        model="m",
        messages=[user("Describe it.", data_uri(png(seed=1)))],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish in (["stop"], ["length"]) and text
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens > 576
    assert usage.completion_tokens == 12 if finish == ["length"] else 0 < usage.completion_tokens <= 12


@pytest.mark.parametrize("clients", [2, 4])
def test_concurrent_clients_share_the_batch(server, clients):
    """``clients`` streamed replies, each far longer than it takes to look, run at once: /status
    shows that many sequences busy together (the server's own count, not a lifetime peak an
    earlier case may have set), each stream brings its own text, and when the clients leave
    every sequence is given back."""
    server.wait_idle()
    body = {"model": "m", "max_tokens": 3000, "temperature": 0, "stream": True, "response_format": LONG}
    with httpx.Client(timeout=60) as h, ExitStack() as streams:
        lines = []
        for i in range(clients):
            msg = user(f"Picture {i}?", data_uri(png(seed=10 + i)))
            resp = streams.enter_context(
                h.stream("POST", server.url + "/v1/chat/completions", json={**body, "messages": [msg]})
            )
            assert resp.status_code == 200
            lines.append(resp.iter_lines())
        st = server.wait_busy(clients)  # all of them in the batch at one moment
        assert st["queue"]["waiting"] == 0 and st["requests"]["peak_running"] >= clients
        for it in lines:
            deltas = (json.loads(ln[6:]) for ln in it if ln.startswith("data: {"))
            assert any(d["choices"] and d["choices"][0]["delta"].get("content") for d in deltas)
        assert server.status()["slots"]["busy"] == clients  # (still running: 3000 tokens each)
    assert server.wait_idle()["slots"]["busy"] == 0  # the clients left: their sequences are freed


def test_a_resent_history_reuses_its_cache(server):
    c = server.client()
    pic = data_uri(png(seed=3))
    first = c.chat.completions.create(model="m", messages=[user("What is it?", pic)], max_tokens=6, temperature=0)
    history = [
        user("What is it?", pic),
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "And the colours?"},
    ]
    second = c.chat.completions.create(model="m", messages=history, max_tokens=6, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # the picture and the reply's exact tokens are reused (the last reply token is evaluated with
    # the new turn, as a reply's last token never enters the cache before the next one is asked)
    assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens - 1
    assert second.usage.prompt_tokens - cached < 50


def test_a_reply_sent_back_as_text_is_matched_as_the_ids_it_was_generated_as(server):
    """Random replies often do not tokenize back to their ids (a leading space the API trims, a
    word split another way); the follow-up still finds the reply cached (serve.recall)."""
    c = server.client()
    for i in range(6):
        q = user(f"Say anything ({i}).")
        first = c.chat.completions.create(model="m", messages=[q], max_tokens=10, temperature=1.5, seed=i)
        history = [q, {"role": "assistant", "content": first.choices[0].message.content}, user("More.")]
        second = c.chat.completions.create(model="m", messages=history, max_tokens=2, temperature=0)
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert cached >= first.usage.prompt_tokens + first.usage.completion_tokens - 1, (i, first.choices[0])
    host = server.status()["memory"]["host"]
    assert 0 < host["reply_recall_used_bytes"] <= host["reply_recall_bytes"]


def test_the_reply_recall_keeps_the_newest_replies_within_its_bytes():
    from edgevlm.serve.recall import ENTRY_BYTES, ReplyRecall

    one = 10 + 4 * 5 + ENTRY_BYTES  # a 10-character reply of 5 ids
    recall = ReplyRecall(max_bytes=3 * one)
    for i in range(4):
        recall.remember(f"reply {i:04d}", [i] * 5)
    assert recall.held == 3 * one and recall.tokens("reply 0000") is None  # the oldest went
    assert recall.tokens("reply 0001") == [1] * 5  # (now the newest used)
    recall.remember("reply 0004", [4] * 5)
    assert recall.tokens("reply 0002") is None and recall.tokens("reply 0001") == [1] * 5
    recall.remember("x" * (4 * one), [1])  # larger than the whole bound: not kept
    assert recall.held == 3 * one


def test_json_schema_and_json_object_replies_parse(server):
    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["colour", "count"],
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "count": {"type": "integer", "minimum": 0, "maximum": 9},
        },
    }
    c = server.client()
    r = c.chat.completions.create(
        model="m",
        messages=[user("Tag it.", data_uri(png(seed=4)))],
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "tags", "schema": schema, "strict": True}},
    )
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"colour", "count"} and obj["colour"] in ("red", "green", "blue")
    assert isinstance(obj["count"], int) and 0 <= obj["count"] <= 9 and r.choices[0].finish_reason == "stop"
    r = c.chat.completions.create(
        model="m",
        messages=[user("JSON please.")],
        max_tokens=200,
        temperature=0.7,
        seed=5,
        response_format={"type": "json_object"},
    )
    if r.choices[0].finish_reason == "length":  # cut at max_tokens: the start of an object
        assert r.usage.completion_tokens == 200 and r.choices[0].message.content.lstrip().startswith("{")
    else:  # ended by the grammar: a whole object
        assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)


def test_a_full_queue_answers_503_with_retry_after(tight):
    c = tight.client()
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(
            c.chat.completions.create,
            model="m",
            messages=[user("Go on.")],
            max_tokens=3200,
            temperature=0,
            response_format=LONG,
        )
        tight.wait_busy(1)
        with pytest.raises(APIStatusError) as err:
            c.chat.completions.create(model="m", messages=[user("Me too?")], max_tokens=4)
        assert err.value.status_code == 503 and int(err.value.response.headers["retry-after"]) >= 1
        assert err.value.body["code"] == "server_busy"
        assert running.result().choices[0].finish_reason in ("length", "stop")
    assert tight.status()["requests"]["rejected"] >= 1


def test_a_request_that_can_never_fit_is_a_400_not_to_retry(tight):
    pics = [data_uri(png(64, 48, seed=20 + i)) for i in range(4)]  # 4 × 576 tokens > a 2048 context
    with pytest.raises(BadRequestError) as err:
        tight.client().chat.completions.create(model="m", messages=[user("All of them?", *pics)], max_tokens=4)
    assert err.value.response.headers["x-should-retry"] == "false"
    assert err.value.body["code"] == "context_length_exceeded" and "context" in err.value.body["message"]


def test_a_client_that_disconnects_frees_its_sequence(tight):
    body = {"model": "m", "messages": [user("Talk.")], "max_tokens": 3200, "stream": True, "response_format": LONG}
    with httpx.Client(timeout=60) as h, h.stream("POST", tight.url + "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(ln.startswith("data: {") for ln in got)
    assert tight.wait_idle(timeout=10)["requests"]["cancelled"] >= 1
    r = tight.client().chat.completions.create(model="m", messages=[user("Still there?")], max_tokens=3)
    assert r.choices[0].message.content is not None


class _Pictures(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        data = png(seed=7)
        self.send_response(200)
        self.send_header("content-type", "image/png")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *a):
        pass


def test_bad_inputs_are_4xx_and_the_server_goes_on(tight, tmp_path):
    url = tight.url + "/v1/chat/completions"
    ok = {"model": "m", "messages": [user("Hi")], "max_tokens": 2}
    pictures = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Pictures)
    threading.Thread(target=pictures.serve_forever, daemon=True).start()
    local = f"http://127.0.0.1:{pictures.server_address[1]}/p.png"
    try:
        cases = [
            (b"{not json", 400, None),
            (json.dumps({"messages": "hi"}).encode(), 400, None),
            (json.dumps({**ok, "temperature": 9}).encode(), 400, None),
            (
                json.dumps({**ok, "messages": [user("x", "data:image/png;base64,@@@@")]}).encode(),
                400,
                "invalid_image_url",
            ),
            (
                json.dumps({**ok, "messages": [user("x", data_uri(b"hello", "text/plain"))]}).encode(),
                400,
                "invalid_image",
            ),
            (json.dumps({**ok, "messages": [user("x", data_uri(flat_png(600, 500)))]}).encode(), 400, "invalid_image"),
            (json.dumps({**ok, "messages": [user("x", local)]}).encode(), 400, "invalid_image_url"),
            (json.dumps({**ok, "messages": [user("x", "file:///etc/passwd")]}).encode(), 400, "invalid_image_url"),
            (json.dumps({**ok, "messages": [user("x", str(tmp_path / "a.png"))]}).encode(), 400, "invalid_image_url"),
            (json.dumps({**ok, "pad": "x" * (2 * 2**20)}).encode(), 413, "request_too_large"),
        ]
        for body, status, code in cases:
            r = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=60)
            assert r.status_code == status, (body[:80], r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], err
            assert code is None or err["code"] == code, err
        assert (
            "non-public address"
            in httpx.post(url, json={**ok, "messages": [user("x", local)]}).json()["error"]["message"]
        )
        assert httpx.get(tight.url + "/v1/nothing").status_code == 404
        assert httpx.get(url).status_code == 405
        assert httpx.post(url, json=ok, timeout=60).status_code == 200  # still serving
    finally:
        pictures.shutdown()


def test_private_urls_and_paths_when_allowed(model_pair, tmp_path):
    pictures = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Pictures)
    threading.Thread(target=pictures.serve_forever, daemon=True).start()
    (tmp_path / "p.png").write_bytes(png(seed=8))
    s = Served(
        model_pair("llava15"),
        "--allow-private-urls",
        "--allow-path",
        str(tmp_path),
        "--api-key",
        "sekrit",
        "--max-tokens",
        "3",
    )
    try:
        local = f"http://127.0.0.1:{pictures.server_address[1]}/p.png"
        r = s.client("sekrit").chat.completions.create(
            model="m", messages=[user("Both?", local, str(tmp_path / "p.png"))], temperature=0
        )
        assert r.usage.prompt_tokens > 2 * 576
        for key in ("wrong", ""):
            got = httpx.post(
                s.url + "/v1/chat/completions",
                json={"messages": [user("Hi")]},
                headers={"authorization": f"Bearer {key}"} if key else {},
            )
            assert got.status_code == 401 and got.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(s.url + "/v1/models").status_code == 401
        assert httpx.get(s.url + "/health").status_code == 200  # no key needed
        models = s.client("sekrit").models.list()
        assert models.data[0].id == "model" and models.data[0].owned_by == "edgevlm"
    finally:
        pictures.shutdown()
        assert "Traceback" not in s.stop()


def test_status_metrics_and_models(server):
    st = server.status()
    assert st["state"] == "ready" and st["plan"]["fits"] and st["slots"]["max_running"] == 4
    assert st["memory"]["measured"]["process_rss_bytes"] > 0 and st["memory"]["predicted"]
    m = httpx.get(server.url + "/metrics").text
    assert 'edgevlm_requests_total{outcome="served"}' in m and "edgevlm_slots_max_running 4" in m
    card = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert card["object"] == "model" and card["input_modalities"] == ["text", "image"]


def test_request_parsing():
    r = parse_chat_request(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What?"},
                        {"type": "image_url", "image_url": "data:image/png;base64,AA=="},
                    ],
                },
            ],
            "max_completion_tokens": 7,
            "stop": "END",
            "unknown_field": 1,
            "user": "u1",
        }
    )
    assert r.system == "Be brief." and r.max_tokens == 7 and r.stop == ("END",)
    assert r.messages[0].images[0].url.startswith("data:") and r.sampling.temperature == 0.8
    for bad in (
        {},
        {"messages": []},
        {"messages": [{"role": "tool", "content": "x"}]},
        {"messages": [{"role": "user", "content": "x"}], "n": 2},
        {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
        {"messages": [{"role": "assistant", "content": [{"type": "image_url", "image_url": "x"}]}]},
        {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
    ):
        with pytest.raises(APIError) as err:
            parse_chat_request(bad)
        assert kind_of(err.value).status == 400


def test_a_dynamic_image_is_shrunk_to_fit_and_the_reply_says_so(model_pair):
    """Qwen2-VL: a picture over the budget is resized before encoding, and one over the context
    left is shrunk by the guard; the response's ``edgevlm.notices`` say what happened."""
    s = Served(model_pair("qwen2vl"), "--ctx", "1024", "--image-tokens", "1024", "--max-tokens", "4")
    try:
        big = data_uri(flat_png(1400, 1400))
        r = httpx.post(
            s.url + "/v1/chat/completions",
            timeout=60,
            json={"model": "m", "messages": [user("What is it?", big)], "temperature": 0},
        )
        assert r.status_code == 200, r.text
        body = r.json()
        notes = " ".join(body["edgevlm"]["notices"])
        assert "reduced to" in notes and "to fit the context left" in notes, notes
        assert body["usage"]["prompt_tokens"] < 1024 - 128
    finally:
        assert "Traceback" not in s.stop()


def test_health_says_503_while_loading_and_timeouts_end_replies(model_pair):
    """In-process app (``create_app``) over a loader that waits: /health and /v1 say 503 until the
    model is there; a reply past ``timeout_s`` ends as "length" and says why."""
    from starlette.testclient import TestClient

    import edgevlm
    from edgevlm.serve.app import create_app
    from edgevlm.serve.options import ServeOptions

    pair = model_pair("llava15")
    go = threading.Event()

    def load():
        go.wait(30)
        return edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, n_threads=2, n_seq_max=2)

    app = create_app(load, ServeOptions(model_id="tiny", timeout_s=0.3))
    with TestClient(app) as client:
        assert client.get("/health").status_code == 503 and client.get("/health").json()["status"] == "loading"
        r = client.post("/v1/chat/completions", json={"messages": [user("Hi")]})
        assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "model_loading"
        go.set()
        until(lambda: client.get("/health").status_code == 200, "loaded", timeout=60)
        r = client.post(
            "/v1/chat/completions", json={"messages": [user("Talk.")], "max_tokens": 3500, "response_format": LONG}
        )
        body = r.json()
        assert r.status_code == 200 and body["choices"][0]["finish_reason"] == "length"
        assert "stopped after 0.3 s" in body["edgevlm"]["notices"][-1]
        assert body["usage"]["completion_tokens"] < 3000
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"


def test_error_mapping():
    from edgevlm.errors import BackendError, ContextExceeded, ImageError, InputError, MemoryBusy
    from edgevlm.serve.openai_reply import error_for

    assert error_for(MemoryBusy("busy"))[0] == 503 and "retry-after" in error_for(MemoryBusy("x"))[2]
    status, body, headers = error_for(ImageError("a.png: not an image"))
    assert status == 400 and body["error"]["code"] == "invalid_image" and headers["x-should-retry"] == "false"
    # the code travels on the exception, not in a word of its message
    assert (
        error_for(ContextExceeded("needs 9 tokens but the context holds 4"))[1]["error"]["code"]
        == "context_length_exceeded"
    )
    assert error_for(InputError("the context word alone means nothing"))[1]["error"]["code"] is None
    assert error_for(BackendError("llama_decode failed"))[0] == 500
    status, body, _ = error_for(KeyError("x"))
    assert status == 500 and body["error"]["message"] == "internal error (KeyError)"


def test_old_pictures_become_summaries_when_the_client_asks(tight):
    """``edgevlm.evict: summary``: a history whose pictures no longer fit has its oldest picture
    replaced by the model's summary; the reply says where, and the shorter history then fits."""
    pics = [data_uri(png(80, 60, seed=30 + i)) for i in range(3)]
    history = [
        user("First?", pics[0]),
        {"role": "assistant", "content": "one"},
        user("Second?", pics[1]),
        {"role": "assistant", "content": "two"},
        user("Third?", pics[2]),
    ]
    body = {"model": "m", "messages": history, "max_tokens": 400, "temperature": 0}
    url = tight.url + "/v1/chat/completions"
    refused = httpx.post(url, json=body, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "context_length_exceeded"
    r = httpx.post(url, json={**body, "edgevlm": {"evict": "summary"}}, timeout=120)
    assert r.status_code == 200, r.text
    ext = r.json()["edgevlm"]
    (s,) = ext["summaries"]
    assert s["message"] == 0 and s["picture"] == 1 and s["content"].startswith("[image 1: ")
    assert any("replaced by its summary" in n for n in ext["notices"])
    history[0] = {"role": "user", "content": s["content"]}  # what the page then sends
    again = httpx.post(url, json={**body, "messages": history}, timeout=120)
    assert again.status_code == 200 and "summaries" not in again.json().get("edgevlm", {})


def test_the_key_covers_status_and_metrics_and_health_stays_open(strict_server):
    from .conftest import STRICT_KEY

    url = strict_server.url
    for path in ("/status", "/metrics"):
        r = httpx.get(url + path, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
        assert httpx.get(url + path, headers={"authorization": f"Bearer {STRICT_KEY}"}, timeout=10).status_code == 200
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    budget = httpx.post(url + "/v1/edgevlm/budget", json={"url": data_uri(flat_png(64, 48))}, timeout=10)
    assert budget.status_code == 401


def test_status_names_the_model_files_not_where_they_are(strict_server, model_pair):
    pair = model_pair("llava15")
    plan = strict_server.status()["plan"]
    assert plan["model"] == pair.model.name and plan["mmproj"] == pair.mmproj.name
    assert str(pair.model.parent) not in json.dumps(strict_server.status())


def test_the_page_has_its_icon(strict_server):
    r = httpx.get(strict_server.url + "/favicon.ico", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("image/svg+xml") and b"<svg" in r.content


def test_serve_help_names_every_api():
    r = subprocess.run([sys.executable, "-m", "edgevlm", "serve", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0
    for needle in (
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/api/chat",
        "--ollama-port",
        "/health (open)",
    ):
        assert needle in r.stdout, needle
    assert "/status and /metrics too" in " ".join(r.stdout.split())
