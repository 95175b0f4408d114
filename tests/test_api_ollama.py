"""Ollama's API on ``edgevlm serve``: a real server (an ``edgevlm serve`` subprocess on a generated
Qwen2-VL pair whose template renders tools, with an API key and ``--ollama-port``) driven by the
official ``ollama`` client and by the bodies Open WebUI sends (``fixtures/openwebui``); the body
parsing and reply shaping as pure functions."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from datetime import datetime
from pathlib import Path
from types import SimpleNamespace

import httpx
import jsonschema
import ollama
import pytest

from edgevlm.errors import BackendError
from edgevlm.serve import ollama as api
from edgevlm.serve.api_errors import APIError, ServerBusy
from edgevlm.serve.ollama_models import model_name, parameter_size
from edgevlm.serve.request import Delta, Reply, ToolCall
from edgevlm_testkit import cached_model_pair, with_chat_template

from .test_serve import Served, free_port, png

KEY = "sk-ollama-test"
MODEL = "tiny-vlm"  # the server's --model-id; Ollama's clients call it tiny-vlm:latest
FIXTURES = Path(__file__).parent / "fixtures"
WEBUI = FIXTURES / "openwebui"
LONG = {"type": "string", "minLength": 3000}  # a reply that runs until num_predict
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "zoom",
            "description": "A closer look at part of the picture.",
            "parameters": {"type": "object", "properties": {"box": {"enum": ["left", "right"]}}, "required": ["box"]},
        },
    }
]


@pytest.fixture(scope="module")
def srv():
    """One sequence and no queue (a second request while one runs is a 503), a 4096 context."""
    pair = with_chat_template(cached_model_pair("qwen2vl"), (FIXTURES / "templates" / "hermes_tools.jinja").read_text())
    ollama_port = free_port()
    s = Served(
        pair,
        *("--parallel", "1", "--queue", "0", "--ctx", "4096", "--max-tokens", "16"),
        *("--model-id", MODEL, "--api-key", KEY, "--ollama-port", str(ollama_port)),
    )
    s.ollama_url = f"http://127.0.0.1:{ollama_port}"
    yield s
    err = s.stop()
    assert "Traceback" not in err, err


def client(url: str, key: str | None = KEY) -> ollama.Client:
    return ollama.Client(host=url, headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=120)


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def ndjson(resp: httpx.Response) -> list[dict]:
    assert resp.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in resp.text.splitlines() if line]


# --- the official client ------------------------------------------------------------------------


def test_a_picture_and_a_question_plain_and_streamed(srv):
    c = client(srv.url)
    ask = [{"role": "user", "content": "What is in this picture?", "images": [png(seed=1)]}]
    opts = {"temperature": 0, "seed": 7, "num_predict": 12}
    r = c.chat(model="anything", messages=ask, options=opts)
    assert r.model == "anything" and r.done and r.done_reason in ("stop", "length")
    assert r.message.role == "assistant" and isinstance(r.message.content, str) and r.message.content
    assert r.prompt_eval_count > 60 and 0 < r.eval_count <= 12  # the picture's tokens are in the prompt
    assert r.total_duration > 0 and r.prompt_eval_duration > 0 and r.eval_duration > 0 and r.load_duration == 0
    assert r.total_duration >= r.prompt_eval_duration + r.eval_duration
    datetime.fromisoformat(r.created_at)
    parts = list(c.chat(model="anything", messages=ask, options=opts, stream=True))
    assert all(not p.done for p in parts[:-1]) and parts[-1].done and parts[-1].done_reason == r.done_reason
    assert "".join(p.message.content for p in parts) == r.message.content
    assert parts[-1].eval_count == r.eval_count and parts[-1].prompt_eval_count == r.prompt_eval_count
    # no "stream" in the body: Ollama's default, NDJSON
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi", "images": [base64.b64encode(png()).decode()]}]}
    lines = ndjson(httpx.post(srv.url + "/api/chat", json=body, headers=auth(), timeout=60))
    assert lines[-1]["done"] is True and lines[-1]["message"] == {"role": "assistant", "content": ""}
    assert all(ln["done"] is False and ln["message"]["role"] == "assistant" for ln in lines[:-1])


def test_generate_with_pictures_and_what_it_refuses(srv):
    c = client(srv.url)
    kw = dict(
        prompt="Describe it.", system="Be brief.", images=[png(seed=2)], options={"temperature": 0, "num_predict": 8}
    )
    g = c.generate(model=MODEL, **kw)
    assert g.done and g.response and g.prompt_eval_count > 60 and 0 < g.eval_count <= 8 and g.context is None
    parts = list(c.generate(model=MODEL, stream=True, **kw))
    assert "".join(p.response for p in parts) == g.response and parts[-1].done and parts[-1].eval_count == g.eval_count
    for extra, field in ((dict(suffix="end"), "suffix"), (dict(raw=True), "raw"), (dict(context=[1, 2]), "context")):
        with pytest.raises(ollama.ResponseError) as err:
            c.generate(model=MODEL, prompt="Hi", **extra)
        assert err.value.status_code == 400 and field in err.value.error
    # an empty prompt (no pictures) only asks for the model to be loaded; an empty chat the same
    assert c.generate(model=MODEL).done_reason == "load"
    assert c.chat(model=MODEL, messages=[]).done_reason == "load"


def test_json_and_a_schema_by_format(srv):
    c = client(srv.url)
    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["colour", "count"],
        "properties": {"colour": {"enum": ["red", "green", "blue"]}, "count": {"type": "integer", "minimum": 0}},
    }
    ask = [{"role": "user", "content": "Tag it.", "images": [png(seed=4)]}]
    r = c.chat(model=MODEL, messages=ask, format=schema, options={"temperature": 0, "num_predict": 64})
    assert r.done_reason == "stop"
    jsonschema.validate(json.loads(r.message.content), schema)
    g = c.generate(
        model=MODEL, prompt="JSON please.", format="json", options={"temperature": 0.7, "seed": 5, "num_predict": 200}
    )
    assert g.done_reason == "length" or isinstance(json.loads(g.response), dict)


def test_bad_requests_are_4xx_in_ollamas_shape(srv):
    c = client(srv.url)
    pics = [png(640, 480, seed=30 + i) for i in range(12)]  # more pictures than the context holds
    with pytest.raises(ollama.ResponseError) as err:
        c.chat(model=MODEL, messages=[{"role": "user", "content": "All of them?", "images": pics}])
    assert err.value.status_code == 400 and "fits" in err.value.error
    for body, field in (
        ({"messages": [{"role": "robot", "content": "Hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "Hi"}], "format": "xml"}, "format"),
        ({"messages": [{"role": "user", "content": "Hi"}], "options": {"temperature": "hot"}}, "temperature"),
        ({"messages": [{"role": "user", "content": "Hi"}], "think": "very"}, "think"),
        ({"messages": [{"role": "user", "content": "Hi", "images": ["not base64!"]}]}, "base64"),
    ):
        r = httpx.post(srv.url + "/api/chat", json={"model": MODEL, **body}, headers=auth(), timeout=60)
        assert r.status_code == 400 and field in r.json()["error"], (body, r.text)
    r = httpx.post(srv.url + "/api/chat", content=b"{", headers=auth(), timeout=60)
    assert r.status_code == 400 and set(r.json()) == {"error"}


def test_a_full_queue_is_a_503_with_retry_after(srv):
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Go on."}],
        "format": LONG,
        "options": {"num_predict": 3200, "temperature": 0},
    }
    with httpx.Client(timeout=60) as h, h.stream("POST", srv.url + "/api/chat", json=body, headers=auth()) as running:
        assert running.status_code == 200
        lines = running.iter_lines()  # (kept: a line iterator let go of closes the connection)
        first = json.loads(next(lines))
        assert first["done"] is False
        busy = httpx.post(srv.url + "/api/generate", json={"model": MODEL, "prompt": "Me too?"}, headers=auth())
        assert busy.status_code == 503 and int(busy.headers["retry-after"]) >= 1 and "error" in busy.json()
        with pytest.raises(ollama.ResponseError) as err:
            client(srv.url).chat(model=MODEL, messages=[{"role": "user", "content": "And me?"}])
        assert err.value.status_code == 503
    deadline = time.monotonic() + 20  # the stream closed: its sequence is freed
    while srv.status()["slots"]["busy"]:
        assert time.monotonic() < deadline, srv.status()
        time.sleep(0.05)


def test_the_api_key(srv):
    with pytest.raises(ollama.ResponseError) as err:
        client(srv.url, key=None).list()
    assert err.value.status_code == 401 and "API key" in err.value.error
    with pytest.raises(ollama.ResponseError) as err:
        client(srv.url, key="wrong").chat(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    assert err.value.status_code == 401
    assert httpx.get(srv.url + "/api/version").json() == {"version": api.VERSION}  # open, as a health check
    assert httpx.get(srv.ollama_url + "/").text == "Ollama is running"


def test_tools_reach_the_template_and_a_tool_result_with_a_picture_is_answered(srv):
    c = client(srv.url)
    ask = {"role": "user", "content": "Look closer at the picture.", "images": [png(seed=5)]}
    opts = {"temperature": 0, "num_predict": 4}
    bare = c.chat(model=MODEL, messages=[ask], options=opts)
    offered = c.chat(model=MODEL, messages=[ask], tools=TOOLS, options=opts)
    assert offered.prompt_eval_count > bare.prompt_eval_count + 20  # the tool's schema is in the prompt
    called = {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "zoom", "arguments": {"box": "left"}}}],
    }

    def result(**extra):
        msg = {"role": "tool", "tool_name": "zoom", "content": "The left half:", **extra}
        return c.chat(model=MODEL, messages=[ask, called, msg], tools=TOOLS, options=opts)

    with_picture, text_only = result(images=[png(seed=6)]), result()
    assert with_picture.done and with_picture.done_reason in ("stop", "length")
    assert with_picture.prompt_eval_count - text_only.prompt_eval_count >= 16  # the result's picture is read
    assert srv.status()["requests"]["failed"] == 0


def test_listings_show_ps_and_the_ollama_port(srv):
    c, theirs = client(srv.url), client(srv.ollama_url)
    (m,) = theirs.list().models
    assert m.model == f"{MODEL}:latest" and m.size > 0 and len(m.digest) == 64
    assert m.details.format == "gguf" and m.details.family == "qwen2vl" and m.details.quantization_level
    assert m.details.parameter_size[-1] in "KMB"
    assert c.list().models == theirs.list().models  # the same model on both ports
    (p,) = c.ps().models
    assert p.model == m.model and p.size > 0 and p.size_vram >= 0 and p.context_length == 4096
    assert p.expires_at.year > 2100  # kept loaded for good
    info = c.show(MODEL)
    assert {"completion", "vision", "tools"} <= set(info.capabilities) and info.details == m.details
    assert info.modelinfo["qwen2vl.context_length"] == 4096 and info.template and "num_ctx" in info.parameters
    assert c.show(f"{MODEL}:latest").details == info.details
    with pytest.raises(ollama.ResponseError) as err:
        c.show("llama3.2")
    assert err.value.status_code == 404 and err.value.error == "model 'llama3.2' not found"
    # the Ollama port: Ollama's root, its API (a chat), Ollama's error shape for unknown paths
    assert httpx.head(srv.ollama_url + "/").status_code == 200
    r = theirs.chat(model=MODEL, messages=[{"role": "user", "content": "Hi"}], options={"num_predict": 3})
    assert r.done and r.eval_count <= 3
    for base in (srv.ollama_url, srv.url):  # Ollama's error shape for unknown /api paths on both ports
        missing = httpx.get(base + "/api/nothing")
        assert missing.status_code == 404 and isinstance(missing.json()["error"], str), (base, missing.text)
    assert isinstance(httpx.get(srv.url + "/v1/nothing").json()["error"], dict)  # OpenAI's elsewhere
    assert "<html" in httpx.get(srv.url + "/").text.lower()  # the main port keeps edgevlm's page


# --- what Open WebUI sends ----------------------------------------------------------------------


@pytest.mark.parametrize("name", ["chat_with_picture", "title_generation", "chat_tool_result", "chat_json_schema"])
def test_open_webui_chat_bodies_are_answered(srv, name):
    fx = json.loads((WEBUI / f"{name}.json").read_text())
    r = httpx.request(fx["method"], srv.ollama_url + fx["path"], json=fx["body"], headers=auth(), timeout=120)
    assert r.status_code == 200, r.text
    if fx["expect"]["stream"]:
        lines = ndjson(r)  # Open WebUI reads the stream line by line, one JSON object a line
        final = lines[-1]
        text = "".join(ln["message"]["content"] for ln in lines[:-1])
    else:
        final = r.json()
        text = final["message"]["content"]
    assert final["done"] is True and final["model"] == fx["body"]["model"]
    assert final["prompt_eval_count"] > 0 and final["eval_count"] > 0 and final["eval_duration"] > 0
    assert text or final["done_reason"] == "stop"
    if "schema" in fx["expect"]:
        jsonschema.validate(json.loads(text), fx["expect"]["schema"])


def test_open_webui_listing_calls_are_answered(srv):
    fx = json.loads((WEBUI / "listings.json").read_text())
    got = {}
    for call in fx["calls"]:
        r = httpx.request(call["method"], srv.ollama_url + call["path"], json=call.get("body"), headers=auth())
        assert r.status_code == 200, (call, r.text)
        got[call["path"]] = r.json()
    version = got["/api/version"]["version"]
    assert tuple(int(x) for x in version.split(".")) >= (0, 5, 0)  # (Open WebUI compares versions as ints)
    (tag,) = got["/api/tags"]["models"]
    assert tag["model"] == tag["name"] == f"{MODEL}:latest"
    (running,) = got["/api/ps"]["models"]
    assert running["model"] == tag["model"] and datetime.fromisoformat(running["expires_at"]).timestamp() > time.time()
    assert got["/api/show"]["details"] == tag["details"]
    assert got["/api/generate"]["done"] is True  # the unload call: answered (the model stays loaded)


# --- the body parsing and reply shaping -----------------------------------------------------------


def test_parsing():
    req = api.parse_chat(
        {
            "model": "x",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi", "images": ["iVBORw0KGgo\nAAAA", "data:image/jpeg;base64,/9j/AA=="]},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"function": {"name": "zoom", "arguments": {"box": "left"}}}],
                },
                {"role": "tool", "tool_name": "zoom", "content": "left"},
                {"role": "assistant", "thinking": "hm", "content": "ok"},
            ],
            "options": {"num_predict": -1, "num_ctx": 131072, "temperature": 0.2, "stop": "END", "repeat_penalty": 1.3},
            "format": "json",
            "think": "high",
            "keep_alive": -1,
            "tools": TOOLS,
        }
    )
    assert req.stream is True and req.system == "Be brief." and req.model == "x"
    assert req.max_tokens is None and req.stop == ("END",) and req.sampling.temperature == 0.2
    assert req.response_format == "json_object" and req.think is True and [t.name for t in req.tools] == ["zoom"]
    user, assistant, tool, last = req.messages
    assert [im.url for im in user.images] == [
        "data:image/png;base64,iVBORw0KGgoAAAA",
        "data:image/jpeg;base64,/9j/AA==",
    ]
    (call,) = assistant.tool_calls
    assert call.args == {"box": "left"} and tool.tool_call_id == call.id and tool.name == "zoom"
    assert last.text == "ok"
    g = api.parse_generate(
        {"prompt": "Hi", "system": "S", "stream": False, "options": {"num_predict": 5}, "format": {"type": "object"}}
    )
    assert g.messages[0].text == "Hi" and g.system == "S" and g.max_tokens == 5 and not g.stream
    assert g.response_format == "json_schema" and g.json_schema == {"type": "object"}
    for body in ({"messages": [{"role": "assistant", "content": "", "images": ["AAAA"]}]}, {"messages": "Hi"}):
        with pytest.raises(APIError):
            api.parse_chat(body)
    with pytest.raises(api.LoadOnly):
        api.parse_generate({"model": "x", "keep_alive": 0, "prompt": ""})


def _reply(**kw) -> Reply:
    stats = SimpleNamespace(prompt_n=90, cached_n=10, predicted_n=5, prompt_ms=12.5, predicted_ms=40.0)
    return Reply(**{"id": "r", "created": 0, "model": "m", "text": "", "finish": "stop", "stats": stats, **kw})


def test_reply_shapes():
    call = ToolCall("call_1", "zoom", '{"box": "right"}')
    body = api.reply_body(_reply(tool_calls=(call,), reasoning="why", finish="tool_calls"), started=time.monotonic())
    assert body["message"] == {
        "role": "assistant",
        "content": "",
        "thinking": "why",
        "tool_calls": [{"id": "call_1", "function": {"name": "zoom", "arguments": {"box": "right"}}}],
    }
    assert body["done_reason"] == "stop" and body["prompt_eval_count"] == 100 and body["eval_count"] == 5
    assert body["prompt_eval_duration"] == 12_500_000 and body["eval_duration"] == 40_000_000
    g = api.reply_body(_reply(text="hello", finish="length"), generate=True)
    assert g["response"] == "hello" and g["done_reason"] == "length" and "message" not in g

    async def deltas():
        yield Delta("reasoning", "think")
        yield Delta("text", "Hel")
        yield Delta("tool_call", call=call)
        raise BackendError("the model failed")

    async def lines():
        return [json.loads(x) async for x in api.stream_events(deltas(), "m")]

    got = asyncio.run(lines())
    assert got[0]["message"] == {"role": "assistant", "content": "", "thinking": "think"} and got[0]["done"] is False
    assert got[1]["message"]["content"] == "Hel" and got[2]["message"]["tool_calls"][0]["function"]["name"] == "zoom"
    assert got[-1] == {"error": "the model failed"}
    assert api.error_for(ServerBusy("busy"), 2) == (
        503,
        {"error": "busy"},
        {"retry-after": "2"},
    )
    assert model_name("llava") == "llava:latest" and model_name("llava:7b") == "llava:7b"
    assert parameter_size(7_241_732_096) == "7.2B" and parameter_size(8_000_000_000) == "8B"


def test_the_ollama_port_option_is_the_dataclasses():
    from edgevlm.cli import main
    from edgevlm.serve.options import ServeOptions

    (opt,) = [p for p in main.commands["serve"].params if "--ollama-port" in getattr(p, "opts", ())]
    assert opt.default == ServeOptions.ollama_port is None
