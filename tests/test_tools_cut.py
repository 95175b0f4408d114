"""A tool call cut off by max_tokens never reaches the client as text, in any of the four APIs:
OpenAI's chat gets the partial call in ``tool_calls`` (its arguments the JSON text as generated)
with finish_reason "length"; Anthropic a ``tool_use`` block (the input as far as it got) with
stop_reason "max_tokens"; Responses an ``incomplete`` function_call item in an incomplete
response; Ollama the call only when its arguments are whole, and never markup in ``content``. A
forced call that names no max_tokens is given room to close. The calls are forced by the grammar
``tool_choice`` makes (a generated pair writes random tokens), Ollama's by a ``format`` that is a
call (the JSON fallback: Ollama has no tool_choice); real llama.cpp, the app on uvicorn, the
official clients."""

from __future__ import annotations

import json

import anthropic
import httpx
import ollama
import pytest

from edgevlm.runtime.toolformat import ParsedCall, parse_cut, partial_object
from edgevlm.serve.replies import ReplySplitter

from .test_tools import ASK, TOOLS, serve

LONG = 48  # the note's length: its string spans many tokens, so a cut at CUT falls inside it
NOTE_ARGS = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": LONG, "maxLength": LONG}},
    "required": ["text"],
}
NOTE = {"type": "function", "function": {"name": "note", "description": "Write a note.", "parameters": NOTE_ARGS}}
NAMED = {"type": "function", "function": {"name": "note"}}
SERVER_MAX_TOKENS = 32  # (test_tools.serve's ServeOptions: a reply that names none gets this many)
CUT = 64  # past the call's name, inside its arguments (checked against the whole call's length)
# one prompt and one grammar (temperature 0): every cut-off reply is the start of the whole one
FORCED = dict(model="m", messages=[ASK], tools=[NOTE, *TOOLS], tool_choice=NAMED, parallel_tool_calls=False)


@pytest.fixture(scope="module")
def srv():
    vlm, s = serve("qwen2vl", "hermes_tools")
    try:
        yield s
    finally:
        s.stop()
        vlm.close()


@pytest.fixture(scope="module")
def whole(srv):
    """The whole forced call (temperature 0): what every cut-off reply must be the start of."""
    r = srv.client().chat.completions.create(max_tokens=400, temperature=0, **FORCED)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and r.usage.completion_tokens > CUT + 8
    return json.loads(call.function.arguments)["text"]


def begins(partial_text: str, whole_text: str) -> bool:
    return whole_text.startswith(partial_text) and len(partial_text) < len(whole_text)


def test_openai_chat_gets_the_partial_call_with_length_streamed_or_not(srv, whole):
    c = srv.client()
    kw = dict(temperature=0, **FORCED)
    for max_tokens in (8, CUT):  # before the arguments begin, and inside them
        r = c.chat.completions.create(max_tokens=max_tokens, **kw)
        choice = r.choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "note" and call.id.startswith("call_")
        args = call.function.arguments  # the JSON text as generated, cut where the reply was
        if max_tokens == 8:
            assert args == ""
        else:
            with pytest.raises(ValueError):
                json.loads(args)
            assert args.lstrip().startswith("{") and begins(partial_object(args)["text"], whole)
        content, deltas, finish = "", [], None
        for chunk in c.chat.completions.create(max_tokens=max_tokens, stream=True, **kw):
            content += chunk.choices[0].delta.content or ""
            deltas += chunk.choices[0].delta.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
        assert content == "" and finish == "length"
        assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [(0, "note", args)]


def test_anthropic_gets_a_tool_use_block_and_max_tokens_streamed_or_not(srv):
    c = anthropic.Anthropic(base_url=srv.url, api_key="none", max_retries=0, timeout=120)
    tools = [{"name": "note", "description": "Write a note.", "input_schema": NOTE_ARGS}]
    kw = dict(
        model="m",
        max_tokens=CUT,
        messages=[ASK],
        tools=tools,
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        extra_body={"temperature": 0},
    )
    plain = c.messages.create(**kw)
    with c.messages.stream(**kw) as stream:
        streamed = stream.get_final_message()
    for m in (plain, streamed):
        assert m.stop_reason == "max_tokens"
        assert [b.type for b in m.content] == ["tool_use"]  # no text block, no markup
        (use,) = m.content
        assert use.name == "note" and use.id.startswith("toolu_")  # (the one tool: "any" is it)
        assert 0 < len(use.input["text"]) < LONG  # the input as far as it got
    assert plain.content[0].input == streamed.content[0].input


def test_responses_gets_an_incomplete_function_call_streamed_or_not(srv, whole):
    body = {
        "model": "m",
        "input": ASK["content"],
        "tools": [{"type": "function", **t["function"]} for t in FORCED["tools"]],
        "tool_choice": {"type": "function", "name": "note"},
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_output_tokens": CUT,
    }
    r = httpx.post(srv.url + "/v1/responses", json=body, timeout=120).json()
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    (item,) = r["output"]  # no message item: the markup is never text
    assert item["type"] == "function_call" and item["status"] == "incomplete" and item["name"] == "note"
    assert begins(partial_object(item["arguments"])["text"], whole)
    events = []
    with httpx.stream("POST", srv.url + "/v1/responses", json={**body, "stream": True}, timeout=120) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "response.incomplete" and "response.output_text.delta" not in kinds
    (done,) = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done["status"] == "incomplete" and done["arguments"] == item["arguments"]
    assert events[-1]["response"]["output"] == [done]


def test_ollama_gives_the_call_only_when_its_arguments_are_whole_and_never_markup(srv, whole):
    """Ollama has no tool_choice: a ``format`` that is a call makes the reply one (the JSON
    fallback, the model's own choice as far as the splitter knows). Cut inside its arguments:
    no call, no text, "length"; given room: the call."""
    c = ollama.Client(host=srv.url, timeout=120)
    call_format = {
        "type": "object",
        "properties": {"name": {"const": "note"}, "arguments": NOTE_ARGS},
        "required": ["name", "arguments"],
    }
    kw = dict(model="m", messages=[ASK], tools=[NOTE, *TOOLS], format=call_format)
    room = c.chat(options={"temperature": 0, "num_predict": 400}, **kw)
    (call,) = room.message.tool_calls
    assert room.done_reason == "stop" and room.message.content == ""
    assert call.function.name == "note" and len(call.function.arguments["text"]) == LONG
    within = {"temperature": 0, "num_predict": room.eval_count - 12}  # (inside the note's 48 characters)
    cut = c.chat(options=within, **kw)
    assert cut.done_reason == "length" and cut.message.content == "" and not cut.message.tool_calls
    pieces = list(c.chat(options=within, stream=True, **kw))
    assert "".join(p.message.content for p in pieces) == "" and pieces[-1].done_reason == "length"
    assert not any(p.message.tool_calls for p in pieces)


def test_a_forced_call_without_max_tokens_is_given_room_to_close(srv):
    """The server's own default (SERVER_MAX_TOKENS) is shorter than the call: a forced call that
    names no max_tokens may run until the context is full, and closes."""
    c = srv.client()
    r = c.chat.completions.create(model="m", messages=[ASK], tools=[NOTE], tool_choice=NAMED, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and r.usage.completion_tokens > SERVER_MAX_TOKENS
    assert len(json.loads(call.function.arguments)["text"]) == LONG
    body = {"model": "m", "input": ASK["content"], "tools": [{"type": "function", **NOTE["function"]}]}
    forced = {**body, "tool_choice": "required", "temperature": 0, "parallel_tool_calls": False}
    r2 = httpx.post(srv.url + "/v1/responses", json=forced, timeout=120).json()
    assert r2["status"] == "completed" and [i["status"] for i in r2["output"]] == ["completed"]
    # a reply the model decides stays within the server's default
    plain = c.chat.completions.create(model="m", messages=[ASK], tools=[NOTE], temperature=0)
    assert plain.usage.completion_tokens <= SERVER_MAX_TOKENS


# --- pure: what the splitter makes of a reply cut inside a call ------------------------------------


def test_an_unforced_call_cut_off_is_never_text_in_any_format():
    names = ["zoom", "get_weather"]
    split = ReplySplitter("hermes", names)  # tool_choice auto: the model started a call itself
    reply = 'Let me look. <tool_call>\n{"name": "zoom", "arguments": {"box": "le'
    out = [d for i in range(0, len(reply), 4) for d in split.feed(reply[i : i + 4])] + split.finish(cut=True)
    assert "".join(d.text for d in out if d.kind == "text") == "Let me look. "
    (call,) = [d.call for d in out if d.call is not None]
    assert (call.name, call.arguments, call.partial, call.args) == ("zoom", '{"box": "le', True, {"box": "le"})
    # a marker cut in two at the very end is no text either
    split = ReplySplitter("hermes", names)
    out = split.feed("Sure. <tool_") + split.finish(cut=True)
    assert "".join(d.text for d in out) == "Sure. " and not split.calls
    # the same text not cut off (a reply that ended there) is text, as it always was
    split = ReplySplitter("hermes", names)
    assert "".join(d.text for d in split.feed("Sure. <tool_") + split.finish()) == "Sure. <tool_"
    # each format: the whole calls, then the last as far as it got
    assert parse_cut('[TOOL_CALLS]zoom[ARGS]{"box": "left"}[TOOL_CALLS]get_w', "mistral", names) == (
        "",
        [ParsedCall("zoom", '{"box": "left"}'), ParsedCall("get_weather", "", partial=True)],
    )
    assert parse_cut('[TOOL_CALLS][{"name": "zoom", "arguments": {"bo', "mistral", names) == (
        "",
        [ParsedCall("zoom", '{"bo', partial=True)],
    )
    assert parse_cut('<|python_tag|>{"name": "zoom", "parameters": {"box": "left"}', "llama3", names) == (
        "",
        [ParsedCall("zoom", '{"box": "left"}')],  # (its arguments whole: a whole call)
    )
    # a call to a function not offered, or one whose name was cut before it could be told: left out
    assert parse_cut('<tool_call>\n{"name": "rm_rf", "arguments": {"', "hermes", names) == ("", [])
    assert parse_cut('<tool_call>\n{"name": "', "hermes", names) == ("", [])
    assert parse_cut('<tool_call>\n{"name": "', "hermes", names, forced="zoom")[1][0].name == "zoom"
    # a JSON answer cut off (no marker, not forced, no offered function named) stays text
    for answer in ('{"answer": 4', '{"name": "Zo', '{"na'):
        assert parse_cut(answer, "hermes", names) is None
    split = ReplySplitter("hermes", names)
    assert "".join(d.text for d in split.feed('{"answer": 4') + split.finish(cut=True)) == '{"answer": 4'


def test_a_partial_objects_members_are_what_was_whole_and_a_last_string_as_far_as_it_went():
    assert partial_object('{ "shape": "triangle') == {"shape": "triangle"}
    assert partial_object('{"a": 1, "b": tru') == {"a": 1}
    assert partial_object('{"a": [1, {"x": "y') == {"a": [1, {"x": "y"}]}
    assert partial_object('{"a": "b", "c":') == {"a": "b"}
    assert partial_object('{"a": "x\\') == {"a": "x"}  # (an escape cut in two)
    assert partial_object("") == partial_object("{") == partial_object('{"a"') == {}
    assert partial_object("[1, 2") == {}  # (arguments are an object)
