"""OpenAI's Responses API (``POST /v1/responses``) on ``edgevlm serve``: a real server on 127.0.0.1
(an ``edgevlm serve`` subprocess, real llama.cpp on a generated pair) driven by the official
``openai`` client — plain and streamed replies, JSON output, chained responses, tool calls and
their results with pictures, errors; the body → request mapping and the store as pure code."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import ResponseFunctionToolCall, ResponseOutputMessage
from pydantic import BaseModel, Field

import edgevlm
from edgevlm.serve.api_errors import APIError, kind_of
from edgevlm.serve.options import ServeOptions
from edgevlm.serve.request import ChatMessage, ImageRef, Reply
from edgevlm.serve.responses import parse_responses_request
from edgevlm.serve.responses_store import ResponseStore, Stored, reply_message
from edgevlm_testkit import cached_model_pair, with_chat_template

from .conftest import STRICT_KEY
from .test_serve import Served, data_uri, png
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
TOOL = {"type": "function", "name": "tag_picture", "description": "Tag a picture.", "parameters": TAGS, "strict": True}
LONG = {"format": {"type": "json_schema", "name": "long", "schema": {"type": "string", "minLength": 3000}}}


class Tags(BaseModel):
    colour: Literal["red", "green", "blue"]
    count: int = Field(ge=0, le=9)


def ask(text: str, *pictures: bytes, detail: str = "auto") -> dict:
    parts = [{"type": "input_text", "text": text}]
    parts += [{"type": "input_image", "image_url": data_uri(p), "detail": detail} for p in pictures]
    return {"role": "user", "content": parts}


@pytest.fixture(scope="module")
def server(strict_server):
    return strict_server


def client(s: Served | InProcess, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key=key, max_retries=0, timeout=120)


def well_formed(events: list) -> None:
    """A stream's events: created first, a terminal event last, sequence numbers 0, 1, 2 ...;
    every item added is done at the same place with the same id, and the final response lists
    the items done."""
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] in ("response.completed", "response.incomplete") and kinds.count(kinds[-1]) == 1, kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = {e.output_index: e.item for e in events if e.type == "response.output_item.added"}
    done = {e.output_index: e.item for e in events if e.type == "response.output_item.done"}
    assert sorted(added) == sorted(done) == list(range(len(done)))
    assert all(added[i].id == done[i].id and added[i].type == done[i].type for i in done)
    final = events[-1].response
    assert final.id == events[0].response.id and [o.id for o in final.output] == [done[i].id for i in sorted(done)]
    for e in events:
        if e.type in ("response.output_text.delta", "response.output_text.done", "response.content_part.added"):
            assert e.item_id == added[e.output_index].id and e.content_index == 0


def test_a_picture_and_a_question_plain_and_streamed(server):
    c = client(server)
    kw = {"model": "m", "input": [ask("Describe the picture.", png(seed=1))], "max_output_tokens": 12, "temperature": 0}
    r = c.responses.create(instructions="Be brief.", **kw)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == "m" and r.instructions == "Be brief."
    assert r.status in ("completed", "incomplete") and r.error is None and r.store is True
    assert r.temperature == 0 and r.max_output_tokens == 12 and r.tools == [] and r.tool_choice == "auto"
    (msg,) = r.output
    assert isinstance(msg, ResponseOutputMessage) and msg.role == "assistant" and msg.id.startswith("msg_")
    assert msg.content[0].type == "output_text" and r.output_text == msg.content[0].text and r.output_text
    u = r.usage
    assert u.input_tokens > 576 and 0 < u.output_tokens <= 12 and u.total_tokens == u.input_tokens + u.output_tokens
    assert u.output_tokens_details.reasoning_tokens == 0
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens" and u.output_tokens == 12

    events = list(c.responses.create(instructions="Be brief.", stream=True, **kw))
    well_formed(events)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == r.output_text == final.output_text and final.status == r.status
    assert final.usage.output_tokens == u.output_tokens and final.usage.input_tokens == u.input_tokens
    assert events[-1].type == ("response.completed" if r.status == "completed" else "response.incomplete")
    # the same prompt again: read from the cache but the last token or so
    assert final.usage.input_tokens_details.cached_tokens >= u.input_tokens - 2

    # the raw events: an event line per event, its type repeated in the data
    body = {**kw, "input": "Hi", "max_output_tokens": 3, "stream": True}
    auth = {"authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, headers=auth, timeout=60) as resp:
        lines = [ln for ln in resp.iter_lines() if ln]
    assert resp.headers["content-type"].startswith("text/event-stream")
    for name, data in zip(lines[::2], lines[1::2], strict=True):
        assert name.startswith("event: ") and json.loads(data.removeprefix("data: "))["type"] == name[7:]


def test_json_output_by_schema_plain_and_with_the_stream_helper(server):
    c = client(server)
    r = c.responses.create(
        model="m",
        input=[ask("Tag it.", png(seed=4))],
        max_output_tokens=64,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "tags", "schema": TAGS, "strict": True}},
    )
    assert r.status == "completed" and r.text.format.type == "json_schema" and r.text.format.name == "tags"
    jsonschema.validate(json.loads(r.output_text), TAGS)

    parsed = c.responses.parse(model="m", input=[ask("Tag it.", png(seed=4))], max_output_tokens=64, text_format=Tags)
    assert isinstance(parsed.output_parsed, Tags)

    with c.responses.stream(
        model="m", input=[ask("Tag it.", png(seed=4))], max_output_tokens=64, temperature=0, text_format=Tags
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert final.output_parsed == Tags.model_validate_json(r.output_text)


def test_chained_responses_reuse_the_cache_and_are_kept_until_deleted(server):
    c = client(server)
    first = c.responses.create(model="m", input=[ask("What is it?", png(seed=3))], max_output_tokens=6, temperature=0)
    second = c.responses.create(
        model="m", previous_response_id=first.id, input="And the colours?", max_output_tokens=6, temperature=0
    )
    assert second.previous_response_id == first.id and second.status in ("completed", "incomplete")
    cached = second.usage.input_tokens_details.cached_tokens
    # the picture and the first reply's exact tokens are reused (its last token is evaluated
    # with the new turn: a reply's last token never enters the cache before the next is asked)
    assert cached >= first.usage.input_tokens + first.usage.output_tokens - 1
    assert second.usage.input_tokens - cached < 50

    # a streamed turn chains on too, and is kept
    events = list(c.responses.create(model="m", previous_response_id=second.id, input="Why?", stream=True))
    well_formed(events)
    third = events[-1].response
    assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens
    assert c.responses.retrieve(third.id).output_text == third.output_text

    got = c.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text and got.usage == first.usage
    c.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as err:
        c.responses.create(model="m", previous_response_id=first.id, input="More?", max_output_tokens=2)
    assert err.value.body["param"] == "previous_response_id" and "previous response not found" in err.value.message
    assert err.value.body["code"] == "previous_response_not_found"

    unkept = c.responses.create(model="m", input="Hi", max_output_tokens=2, store=False)
    assert unkept.store is False
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(unkept.id)


def test_a_forced_tool_call_then_its_output_with_a_picture(server):
    c = client(server)
    r = c.responses.create(
        model="m",
        input=[ask("Tag this picture.", png(seed=5))],
        tools=[TOOL],
        tool_choice={"type": "function", "name": "tag_picture"},
        parallel_tool_calls=False,  # (one call: the random model would go on)
        max_output_tokens=300,
        temperature=0,
    )
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert isinstance(call, ResponseFunctionToolCall) and call.name == "tag_picture" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id and r.status == "completed"
    jsonschema.validate(json.loads(call.arguments), TAGS)
    assert r.tools[0].name == "tag_picture" and r.tool_choice.name == "tag_picture" and r.parallel_tool_calls is False

    result = {
        "type": "function_call_output",
        "call_id": call.call_id,
        "output": [
            {"type": "input_text", "text": "Tagged. The crop:"},
            {"type": "input_image", "image_url": data_uri(png(48, 48, seed=6)), "detail": "auto"},
        ],
    }
    # chained by id ...
    answer = c.responses.create(
        model="m", previous_response_id=r.id, input=[result], tools=[TOOL], max_output_tokens=8, temperature=0
    )
    assert answer.status in ("completed", "incomplete") and answer.output
    assert answer.usage.input_tokens > 2 * 576  # both pictures
    # ... or with the whole conversation sent back (the output items as input items)
    again = c.responses.create(
        model="m",
        input=[ask("Tag this picture.", png(seed=5)), *[o.model_dump(exclude_none=True) for o in r.output], result],
        tools=[TOOL],
        max_output_tokens=8,
        temperature=0,
        store=False,
    )
    assert again.usage.input_tokens > 2 * 576 and again.output


def test_a_streamed_forced_tool_call(server):
    with client(server).responses.stream(
        model="m",
        input=[ask("Tag it.", png(seed=7))],
        tools=[TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=300,
        temperature=0,
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    (call,) = [o for o in final.output if o.type == "function_call"]
    assert final.status == "completed" and call.name == "tag_picture"
    jsonschema.validate(json.loads(call.arguments), TAGS)
    # strict tools: the helper parses the arguments too
    assert call.parsed_arguments == json.loads(call.arguments)


def test_a_picture_that_can_never_fit_is_a_400(server):
    pics = [png(64, 48, seed=20 + i) for i in range(4)]  # 4 × 576 tokens > a 2048 context
    with pytest.raises(openai.BadRequestError) as err:
        client(server).responses.create(model="m", input=[ask("All of them?", *pics)], max_output_tokens=4)
    assert err.value.body["code"] == "context_length_exceeded" and "context" in err.value.body["message"]
    assert err.value.response.headers["x-should-retry"] == "false"


def test_a_full_server_is_a_503_and_a_wrong_key_a_401(server):
    body = {"model": "m", "input": "Talk.", "max_output_tokens": 3200, "stream": True, "text": LONG}
    auth = {"authorization": f"Bearer {KEY}"}
    with httpx.Client(timeout=60) as h, h.stream("POST", server.url + "/v1/responses", json=body, headers=auth) as resp:
        assert resp.status_code == 200
        server.wait_busy(1)
        with pytest.raises(openai.APIStatusError) as err:
            client(server).responses.create(model="m", input="Me too?", max_output_tokens=4)
        lines = (ln for ln in resp.iter_lines() if ln)
        got = [next(lines) for _ in range(12)]
    assert err.value.status_code == 503 and int(err.value.response.headers["retry-after"]) >= 1
    assert err.value.body["code"] == "server_busy"
    assert "event: response.output_text.delta" in got
    deadline = time.monotonic() + 10  # the long reply was cancelled when its client left
    while server.status()["slots"]["busy"]:
        assert time.monotonic() < deadline
        time.sleep(0.05)

    with pytest.raises(openai.AuthenticationError) as err:
        client(server, key="wrong").responses.create(model="m", input="Hi", max_output_tokens=2)
    assert err.value.body["code"] == "invalid_api_key"


def test_bad_fields_are_a_400_naming_them(server):
    url, headers = server.url + "/v1/responses", {"authorization": f"Bearer {KEY}"}
    ok = {"model": "m", "input": "Hi", "max_output_tokens": 2}
    cases = [
        ({**ok, "input": []}, "input"),
        ({**ok, "temperature": 3}, "temperature"),
        ({**ok, "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({**ok, "tools": [TOOL], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
        (
            {**ok, "input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].type",
        ),
        ({**ok, "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({**ok, "reasoning": {"effort": "huge"}}, "reasoning.effort"),
        ({**ok, "background": True}, "background"),
        ({**ok, "input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
    ]
    for body, param in cases:
        r = httpx.post(url, json=body, headers=headers, timeout=30)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert httpx.post(url, json=ok, headers=headers, timeout=60).status_code == 200  # still serving


def test_reasoning_items_and_effort():
    """A thinking model (a Qwen3-style template that opens <think>): its reasoning is a reasoning
    item (streamed as reasoning_text events) before the message; effort "none" switches it off."""
    pair = with_chat_template(cached_model_pair("internvl"), (TEMPLATES / "hermes_thinking.jinja").read_text())
    vlm = edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, n_threads=2, n_seq_max=2)
    srv = InProcess(vlm, ServeOptions(max_tokens=32, reasoning_budget=4))
    try:
        c = client(srv, "none")
        kw = {"model": "m", "input": [ask("Why?", png(seed=9))], "max_output_tokens": 24, "temperature": 0}
        r = c.responses.create(reasoning={"effort": "low"}, **kw)
        thought, msg = r.output
        assert thought.type == "reasoning" and thought.id.startswith("rs_") and thought.summary == []
        assert thought.content[0].type == "reasoning_text" and thought.content[0].text
        assert msg.type == "message" and r.output_text
        assert 0 < r.usage.output_tokens_details.reasoning_tokens < r.usage.output_tokens
        events = list(c.responses.create(reasoning={"effort": "low"}, stream=True, **kw))
        well_formed(events)
        kinds = [e.type for e in events]
        assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
        assert "response.reasoning_text.done" in kinds
        assert events[-1].response.output_text == r.output_text
        off = c.responses.create(reasoning={"effort": "none"}, **kw)
        assert [o.type for o in off.output] == ["message"]
    finally:
        srv.stop()
        vlm.close()


# --- pure code ---------------------------------------------------------------------------------


def test_request_mapping():
    call = parse_responses_request(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": "Answer in English."},
                ask("What is it?", b"x", detail="original"),
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A cat."}]},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "g", "arguments": {"a": 1}},
                {"type": "function_call_output", "call_id": "c2", "output": "done"},
            ],
            "tools": [{"type": "function", "name": "f"}, {"type": "function", "name": "g", "parameters": TAGS}],
            "tool_choice": {"type": "function", "name": "g"},
            "text": {"format": {"type": "json_object"}},
            "reasoning": {"effort": "minimal"},
            "max_output_tokens": 20,
            "max_tool_calls": 1,
            "metadata": {"k": "v"},
            "user": "u",
            "include": ["reasoning.encrypted_content"],
            "truncation": "auto",
        }
    )
    req = call.request
    assert req.system == "Be brief.\n\nAnswer in English." and call.system == ("Answer in English.",)
    user, assistant, tool = req.messages
    assert user.images == (ImageRef(data_uri(b"x"), "high"),) and user.text == "What is it?"
    assert assistant.text == "A cat." and [c.id for c in assistant.tool_calls] == ["c1", "c2"]
    assert assistant.tool_calls[1].arguments == '{"a": 1}'
    assert tool.role == "tool" and tool.tool_call_id == "c2" and tool.name == "g" and tool.text == "done"
    assert [m.index for m in req.messages] == [0, 1, 2]
    assert req.tool_choice == "function" and req.tool_name == "g" and req.tools[1].parameters == TAGS
    assert req.response_format == "json_object" and req.max_tokens == 20 and req.think is False and req.evict
    assert req.parallel_tool_calls is False  # (max_tool_calls 1)
    assert call.echo["metadata"] == {"k": "v"} and call.echo["tools"][0]["name"] == "f" and call.store
    assert call.id.startswith("resp_") and call.instructions == "Be brief." and call.max_tool_calls == 1
    plain = parse_responses_request({"input": "Hi", "stream": True, "store": False}).request
    assert plain.messages == (ChatMessage("user", "Hi"),) and plain.stream and plain.think is None
    assert parse_responses_request({"input": "Hi", "reasoning": {"effort": "high"}}).request.think is True

    with pytest.raises(APIError) as err:
        parse_responses_request({"input": "Hi", "previous_response_id": "resp_nope"}, store=ResponseStore())
    assert kind_of(err.value).status == 404 and err.value.param == "previous_response_id"
    for body, param in [
        (
            {"input": [{"role": "assistant", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
        ({"input": "x", "conversation": "c"}, "conversation"),
        ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
        ({"input": "x", "tools": [{"type": "function", "name": "bad name"}]}, "tools[0].name"),
        ({"input": "x", "tool_choice": {"type": "allowed_tools"}}, "tool_choice"),
        ({"input": "x", "truncation": "sometimes"}, "truncation"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ]:
        with pytest.raises(APIError) as err:
            parse_responses_request(body)
        assert kind_of(err.value).status == 400 and err.value.param == param, (body, err.value)


def test_chained_requests_and_the_store_bounds():
    store = ResponseStore(limit=2, max_bytes=10**6)
    first = parse_responses_request({"input": [ask("Look.", b"p" * 1000)], "instructions": "Sys."})
    reply = Reply("id", 0, "m", "A picture.", "stop", None, raw="A picture.")
    assert store.keep(first, reply, {"id": first.id})["store"] is True
    second = parse_responses_request({"input": "More?", "previous_response_id": first.id}, store=store)
    old, answer, more = second.request.messages
    assert old is first.messages[0] and answer == reply_message(reply, 1) and more.text == "More?"
    assert second.request.system is None  # (instructions do not carry over)
    assert [m.index for m in second.request.messages] == [0, 1, 2]
    held = store.nbytes
    store.keep(second, reply, {"id": second.id})
    assert store.nbytes - held < 1000  # the picture's data URI is counted once
    third = parse_responses_request({"input": "Hi"})
    store.keep(third, reply, {"id": third.id})
    assert len(store) == 2 and store.get(first.id) is None and store.get(second.id) is not None
    assert store.delete(second.id) and store.delete(third.id) and len(store) == 0 and store.nbytes == 0

    small = ResponseStore(limit=10, max_bytes=5000)
    big = parse_responses_request({"input": [ask("Look.", b"p" * 4000)]})
    body = {"id": big.id}
    assert small.keep(big, reply, body)["store"] is False and len(small) == 0  # larger than the store
    for _ in range(5):
        call = parse_responses_request({"input": [ask("Look.", b"p" * 1000)]})
        small.keep(call, reply, {"id": call.id})
    assert 0 < len(small) < 5 and small.nbytes <= 5000
    assert isinstance(small.get(call.id), Stored)
    assert not parse_responses_request({"input": "x", "store": False}).store
