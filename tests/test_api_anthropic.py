"""Anthropic's Messages API (``POST /v1/messages``) on ``edgevlm serve``: a real server on
127.0.0.1 (an ``edgevlm serve`` subprocess, real llama.cpp on a generated pair) driven by the
official ``anthropic`` client; the body → request mapping as pure functions."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path

import anthropic
import httpx
import jsonschema
import pytest

import edgevlm
from edgevlm.serve.anthropic import parse_messages_request
from edgevlm.serve.anthropic_reply import error_for
from edgevlm.serve.api_errors import APIError, RequestTooLarge, kind_of
from edgevlm.serve.options import ServeOptions
from edgevlm_testkit import cached_model_pair, with_chat_template

from .conftest import STRICT_KEY
from .test_serve import Served, png, user
from .test_serve_faults import InProcess

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"

KEY = STRICT_KEY
TAGS = {
    "type": "object",
    "additionalProperties": False,
    "required": ["colour", "count"],
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
}
GREEDY = {"temperature": 0}  # (this client no longer sends temperature itself; the API takes it)
TOOL = {"name": "tag_picture", "description": "Tag a picture.", "input_schema": TAGS}


def picture(data: bytes) -> dict:
    return {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(data).decode()},
    }


def ask(text: str, *pictures: bytes) -> dict:
    return {"role": "user", "content": [*(picture(p) for p in pictures), {"type": "text", "text": text}]}


@pytest.fixture(scope="module")
def server(strict_server):
    return strict_server


def client(s: Served, **kw) -> anthropic.Anthropic:
    kw.setdefault("api_key", KEY)
    return anthropic.Anthropic(base_url=s.url, max_retries=0, timeout=120, **kw)


def test_a_picture_and_a_question_plain_and_streamed(server):
    c = client(server)
    msgs = [ask("Describe the picture.", png(seed=1))]
    r = c.messages.create(model="m", max_tokens=12, extra_body=GREEDY, messages=msgs, system="Be brief.")
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_") and r.model == "m"
    assert r.stop_reason in ("end_turn", "max_tokens") and r.stop_sequence is None
    (block,) = r.content
    assert block.type == "text" and block.text
    assert 0 < r.usage.output_tokens <= 12 and r.usage.input_tokens + r.usage.cache_read_input_tokens > 576

    with c.messages.stream(model="m", max_tokens=12, extra_body=GREEDY, messages=msgs, system="Be brief.") as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [e.type for e in events]
    deltas = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    # the streamed reply is its deltas; greedy on a random-weight model, it may part from the
    # first reply where the cached prompt's logits differ in the last bits (a near tie)
    assert final.content[0].text == deltas and deltas
    assert final.stop_reason in ("end_turn", "max_tokens") and 0 < final.usage.output_tokens <= 12
    # the same prompt: all of it read from the cache but the last token or so
    assert (
        final.usage.input_tokens + final.usage.cache_read_input_tokens
        == r.usage.input_tokens + r.usage.cache_read_input_tokens
    )
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1

    # the raw events: an event line per event, its type repeated in the data
    body = {"model": "m", "max_tokens": 4, "messages": msgs, "stream": True}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60) as resp:
        lines = [ln for ln in resp.iter_lines() if ln]
    assert resp.headers["content-type"].startswith("text/event-stream")
    for name, data in zip(lines[::2], lines[1::2], strict=True):
        assert name.startswith("event: ") and json.loads(data.removeprefix("data: "))["type"] == name[7:]


def test_usage_counts_the_prompt_and_its_cache_reads(server):
    c = client(server)
    msgs = [ask("What is it?", png(seed=2))]
    first = c.messages.create(model="m", max_tokens=4, extra_body=GREEDY, messages=msgs)
    again = c.messages.create(model="m", max_tokens=4, extra_body=GREEDY, messages=msgs)
    # the prompt's tokens, as the chat-completions route counts the same conversation
    openai = httpx.post(
        server.url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {KEY}"},
        json={
            "model": "m",
            "max_tokens": 4,
            "temperature": 0,
            "messages": [user("What is it?", "data:image/png;base64," + base64.b64encode(png(seed=2)).decode())],
        },
        timeout=60,
    ).json()["usage"]
    for u in (first.usage, again.usage):
        assert u.input_tokens + u.cache_read_input_tokens == openai["prompt_tokens"]
        assert u.cache_creation_input_tokens == 0
    assert again.usage.cache_read_input_tokens >= openai["prompt_tokens"] - 2 and again.usage.input_tokens <= 2


def test_count_tokens_counts_what_a_request_would_send(server):
    c = client(server)
    msgs = [ask("How many?", png(seed=4))]
    counted = c.messages.count_tokens(model="m", messages=msgs, system="Be brief.")
    sent = c.messages.create(model="m", max_tokens=2, extra_body=GREEDY, messages=msgs, system="Be brief.").usage
    assert counted.input_tokens == sent.input_tokens + sent.cache_read_input_tokens
    assert counted.input_tokens > c.messages.count_tokens(model="m", messages=[ask("How many?")]).input_tokens + 16
    # nothing ran: no reply was generated for the count
    assert server.status()["slots"]["busy"] == 0


def test_a_conversation_that_can_never_fit_is_a_400_in_anthropics_shape(server):
    pics = [png(64, 48, seed=20 + i) for i in range(4)]  # 4 × 576 tokens > a 2048 context
    with pytest.raises(anthropic.BadRequestError) as err:
        client(server).messages.create(model="m", max_tokens=4, messages=[ask("All of them?", *pics)])
    body = err.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "context" in body["error"]["message"] and body["edgevlm"]["code"] == "context_length_exceeded"
    assert err.value.response.headers["x-should-retry"] == "false"


def test_a_full_server_is_a_retryable_status(server):
    c = client(server)
    long = {"format": {"type": "json_schema", "schema": {"type": "string", "minLength": 3000}}}
    body = {"model": "m", "max_tokens": 3200, "messages": [ask("Talk.")], "stream": True, "output_config": long}
    with (
        httpx.Client(timeout=60) as h,
        h.stream("POST", server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}) as resp,
    ):
        assert resp.status_code == 200
        server.wait_busy(1)
        with pytest.raises(anthropic.APIStatusError) as err:
            c.messages.create(model="m", max_tokens=4, messages=[ask("Me too?")])
        lines = (ln for ln in resp.iter_lines() if ln)
        got = [next(lines) for _ in range(10)]
    assert err.value.status_code == 503 and int(err.value.response.headers["retry-after"]) >= 1
    assert isinstance(err.value, anthropic.InternalServerError)  # retried by the client (5xx)
    assert err.value.body["error"]["type"] == "overloaded_error" and err.value.body["edgevlm"]["code"] == "server_busy"
    assert any(ln.startswith("event: content_block_delta") for ln in got)
    deadline = time.monotonic() + 10  # the long reply was cancelled when its client left
    while server.status()["slots"]["busy"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_the_api_key_is_read_from_x_api_key_or_a_bearer_token(server):
    with pytest.raises(anthropic.AuthenticationError) as err:
        client(server, api_key="wrong").messages.create(model="m", max_tokens=2, messages=[ask("Hi")])
    assert (
        err.value.body["error"]["type"] == "authentication_error" and "x-api-key" in err.value.body["error"]["message"]
    )
    r = httpx.post(server.url + "/v1/messages", json={"model": "m", "max_tokens": 2, "messages": [ask("Hi")]})
    assert r.status_code == 401 and r.json()["type"] == "error"
    bearer = anthropic.Anthropic(base_url=server.url, auth_token=KEY, max_retries=0, timeout=60)
    assert bearer.messages.create(model="m", max_tokens=2, messages=[ask("Hi")]).content


def test_a_forced_tool_call_then_its_result_with_a_picture(server):
    c = client(server)
    msgs: list = [ask("Tag this picture.", png(seed=5))]
    r = c.messages.create(
        model="m",
        max_tokens=300,
        extra_body=GREEDY,
        messages=msgs,
        tools=[TOOL],
        tool_choice={"type": "tool", "name": "tag_picture", "disable_parallel_tool_use": True},
    )
    uses = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and len(uses) == 1  # (one call: the random model would go on)
    call = uses[0]
    assert call.name == "tag_picture" and call.id.startswith("toolu_")  # Anthropic's own id form
    jsonschema.validate(call.input, TAGS)

    result = {
        "type": "tool_result",
        "tool_use_id": call.id,
        "content": [{"type": "text", "text": "Tagged. The crop:"}, picture(png(48, 48, seed=6))],
    }
    msgs += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in r.content]},
        {"role": "user", "content": [result, {"type": "text", "text": "What now?"}]},
    ]
    answer = c.messages.create(model="m", max_tokens=8, extra_body=GREEDY, messages=msgs, tools=[TOOL])
    assert answer.content and answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert answer.usage.input_tokens + answer.usage.cache_read_input_tokens > 2 * 576  # both pictures


def test_a_streamed_forced_tool_call(server):
    with client(server).messages.stream(
        model="m",
        max_tokens=300,
        extra_body=GREEDY,
        messages=[ask("Tag it.", png(seed=7))],
        tools=[TOOL],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    ) as stream:
        final = stream.get_final_message()
    (call,) = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and call.name == "tag_picture"
    jsonschema.validate(call.input, TAGS)


def test_thinking_blocks_and_their_budget():
    """A thinking model (a Qwen3-style template that opens <think>): thinking enabled gives a
    thinking block capped at budget_tokens, then the text; disabled gives none."""
    pair = with_chat_template(cached_model_pair("internvl"), (TEMPLATES / "hermes_thinking.jinja").read_text())
    vlm = edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, n_threads=2, n_seq_max=2)
    srv = InProcess(vlm, ServeOptions(max_tokens=32))
    try:
        c = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=60)
        kw = {"model": "m", "max_tokens": 24, "messages": [ask("Why?", png(seed=9))], "extra_body": GREEDY}
        r = c.messages.create(thinking={"type": "enabled", "budget_tokens": 4}, **kw)
        thought, text = r.content
        assert thought.type == "thinking" and thought.thinking and thought.signature == ""
        assert len(vlm.backend.tokenize_text(thought.thinking)) <= 5 and text.type == "text" and text.text
        with c.messages.stream(thinking={"type": "enabled", "budget_tokens": 4}, **kw) as stream:
            deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
            final = stream.get_final_message()
        assert deltas[0] == "thinking_delta" and deltas[-1] == "text_delta"
        # (the streamed thinking may keep the whitespace before </think> that the whole one strips)
        assert final.content[0].thinking.strip() == thought.thinking and final.content[1].text == text.text
        off = c.messages.create(thinking={"type": "disabled"}, **kw)
        assert [b.type for b in off.content] == ["text"]
    finally:
        srv.stop()
        vlm.close()


def test_bad_fields_are_a_400_naming_them(server):
    url, headers = server.url + "/v1/messages", {"x-api-key": KEY}
    ok = {"model": "m", "max_tokens": 2, "messages": [ask("Hi")]}
    cases = [
        ({k: v for k, v in ok.items() if k != "max_tokens"}, "max_tokens"),
        ({**ok, "temperature": 1.5}, "temperature"),
        ({**ok, "messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({**ok, "tool_choice": {"type": "tool", "name": "nope"}, "tools": [TOOL]}, "tool_choice.name"),
    ]
    # one after another: this server has one place, and a request holds it from its first byte
    replies = [httpx.post(url, json=b, headers=headers, timeout=30) for b, _ in cases]
    for (_, param), r in zip(cases, replies, strict=True):
        assert r.status_code == 400, r.text
        body = r.json()
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert body["edgevlm"]["param"] == param and param.split(".")[0].split("[")[0] in body["error"]["message"]
    assert httpx.post(url, json=ok, headers=headers, timeout=60).status_code == 200  # still serving


def test_request_mapping():
    data = base64.b64encode(b"png").decode()
    r = parse_messages_request(
        {
            "model": "claude",
            "max_tokens": 50,
            "system": [{"type": "text", "text": "Be"}, {"type": "text", "text": "brief."}],
            "messages": [
                {"role": "user", "content": "Look."},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm", "signature": "x"},
                        {"type": "text", "text": "Calling."},
                        {"type": "tool_use", "id": "t1", "name": "crop", "input": {"x": 1}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "done", "is_error": True},
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}},
                        {"type": "text", "text": "And this?"},
                    ],
                },
            ],
            "stop_sequences": ["END"],
            "temperature": 0.5,
            "top_k": 5,
            "tools": [{"name": "crop", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "thinking": {"type": "enabled", "budget_tokens": 2000},
            "metadata": {"user_id": "u"},
        }
    )
    assert r.system == "Be\nbrief." and r.max_tokens == 50 and r.stop == ("END",) and r.model == "claude"
    assert [m.role for m in r.messages] == ["user", "assistant", "tool", "user"]
    asst, tool, last = r.messages[1:]
    assert asst.text == "Calling." and asst.tool_calls[0].args == {"x": 1}
    assert tool.tool_call_id == "t1" and tool.name == "crop" and tool.text == "Error: done" and tool.index == 2
    assert last.images[0].url == f"data:image/png;base64,{data}" and last.text == "And this?" and last.index == 2
    assert r.tool_choice == "required" and not r.parallel_tool_calls and r.tools[0].name == "crop"
    assert r.think is True and r.think_budget == 50 and r.sampling.temperature == 0.5 and r.sampling.top_k == 5
    assert parse_messages_request({**_min(), "thinking": {"type": "disabled"}}).think is False
    url = parse_messages_request(
        {
            **_min(),
            "messages": [
                {"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": "https://x/p.png"}}]}
            ],
        }
    )
    assert url.messages[0].images[0].url == "https://x/p.png"
    for bad, param in (
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, "messages[1]"),
        ({"stop_sequences": "END"}, "stop_sequences"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0]"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
        ({"system": [{"type": "image"}]}, "system[0]"),
    ):
        with pytest.raises(APIError) as err:
            parse_messages_request({**_min(), **bad})
        assert kind_of(err.value).status == 400 and err.value.param == param, (bad, err.value.param)


def _min() -> dict:
    return {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]}


def test_error_mapping():
    from edgevlm.errors import BackendError, ContextExceeded, MemoryBusy

    status, body, headers = error_for(MemoryBusy("busy"))
    assert status == 503 and body["error"]["type"] == "overloaded_error" and headers["retry-after"]
    status, body, _ = error_for(ContextExceeded("too long"))
    assert status == 400 and body == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "too long"},
        "edgevlm": {"code": "context_length_exceeded", "param": None},
    }
    assert error_for(RequestTooLarge("big"))[1]["error"]["type"] == "request_too_large"
    assert error_for(BackendError("llama_decode failed"))[1]["error"]["type"] == "api_error"
    assert error_for(KeyError("x"))[1]["error"] == {"type": "api_error", "message": "internal error (KeyError)"}


def test_tool_use_ids_go_out_in_anthropics_form_and_come_back_as_the_prompt_had_them():
    from edgevlm.serve.anthropic import from_tool_use_id, parse_messages_request, tool_use_id

    assert tool_use_id("call_3fa9") == "toolu_3fa9" and from_tool_use_id("toolu_3fa9") == "call_3fa9"
    assert tool_use_id("a1B2c3D4e") == "a1B2c3D4e"  # Mistral's nine-character ids stay as they are
    req = parse_messages_request({
        "model": "m", "max_tokens": 4,
        "messages": [
            {"role": "user", "content": "Tag it."},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_7", "name": "tag", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_7", "content": "done"}]},
        ],
    })  # fmt: skip
    assistant, tool = req.messages[1], req.messages[2]
    assert assistant.tool_calls[0].id == "call_7" and tool.tool_call_id == "call_7" and tool.name == "tag"
