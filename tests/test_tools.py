"""Tool calls and reasoning through the chat-completions route: tools rendered by the model's own
chat template (templates written in the Qwen3/hermes and Mistral styles, put into generated pairs)
or taught in the system prompt where the template has none; a forced call (tool_choice named or
required) made by a grammar and parsed into the client's tool-call objects; a tool result that
carries a picture answered and budgeted like any picture; <think> text split off, and capped by a
reasoning budget. Real llama.cpp on generated pairs, the app on uvicorn, the official client."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

import edgevlm
from edgevlm.runtime.toolformat import ParsedCall, parse_calls
from edgevlm.serve.options import ServeOptions
from edgevlm.serve.replies import ReplySplitter
from edgevlm_testkit import cached_model_pair, with_chat_template

from .test_serve import data_uri, png
from .test_serve_faults import InProcess

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 5},
    },
    "required": ["city", "days"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather.", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "zoom",
            "description": "A closer look at part of the picture.",
            "parameters": {"type": "object", "properties": {"box": {"enum": ["left", "right"]}}, "required": ["box"]},
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = {"role": "user", "content": "What is the weather in Paris?"}


def pair_with(family: str, template: str | None):
    pair = cached_model_pair(family)
    return pair if template is None else with_chat_template(pair, (TEMPLATES / f"{template}.jinja").read_text())


def serve(family: str, template: str | None, **options):
    pair = pair_with(family, template)
    vlm = edgevlm.load(pair.model, pair.mmproj, n_ctx=4096, n_threads=2, n_seq_max=2)
    return vlm, InProcess(vlm, ServeOptions(max_tokens=32, **options))


# --- pure: parsing and streaming -----------------------------------------------------------------


def test_each_format_parses_into_calls_and_anything_else_stays_text():
    names = ["get_weather", "zoom"]
    hermes = (
        'Let me look.\n<tool_call>\n{"name": "zoom", "arguments": {"box": "left"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\", \\"days\\": 2}"}\n</tool_call>'
    )
    text, calls = parse_calls(hermes, "hermes", names)
    assert text == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("zoom", {"box": "left"}),
        ("get_weather", {"city": "Oslo", "days": 2}),
    ]
    text, calls = parse_calls(
        '[TOOL_CALLS][{"name": "zoom", "arguments": {"box": "right"}, "id": "a1b2c3d4e"}]', "mistral", names
    )
    assert text == "" and calls == [ParsedCall("zoom", '{"box": "right"}', "a1b2c3d4e")]
    text, calls = parse_calls('[TOOL_CALLS]zoom[ARGS]{"box": "left"}', "mistral", names)  # the newer Mistral form
    assert calls == [ParsedCall("zoom", '{"box": "left"}')]
    text, calls = parse_calls('<|python_tag|>{"name": "zoom", "parameters": {"box": "left"}}', "llama3", names)
    assert calls == [ParsedCall("zoom", '{"box": "left"}')]
    # the JSON fallback: a reply that is nothing but a call, in any format
    assert parse_calls(' {"name": "zoom", "arguments": {"box": "left"}}', "hermes", names)[1][0].name == "zoom"
    # a last call cut off by max_tokens: the whole calls before it stand
    cut = '<tool_call>\n{"name": "zoom", "arguments": {"box": "left"}}\n</tool_call>\n<tool_call>\n{"name": "zo'
    assert parse_calls(cut, "hermes", names)[1] == [ParsedCall("zoom", '{"box": "left"}')]
    # what only looks like a call stays text: an unknown function, broken JSON, JSON that is an answer
    for reply in (
        '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>',
        '<tool_call>\n{"name": "zoom", "arguments": {"box": \n</tool_call>',
        '{"answer": 4}',
    ):
        assert parse_calls(reply, "hermes", names) == (reply, [])


def test_a_streamed_reply_never_shows_half_a_marker_and_splits_reasoning():
    split = ReplySplitter("hermes", ["zoom"], thinking=True)
    reply = 'I should zoom.</think>\n\nSure. <tool_call>\n{"name": "zoom", "arguments": {"box": "left"}}\n</tool_call>'
    shown = []
    for i in range(0, len(reply), 3):  # three characters at a time: markers arrive in pieces
        shown += split.feed(reply[i : i + 3])
    shown += split.finish()
    text = "".join(d.text for d in shown if d.kind == "text")
    assert text == "Sure. " and "<" not in text
    assert "".join(d.text for d in shown if d.kind == "reasoning") == "I should zoom."
    calls = [d.call for d in shown if d.kind == "tool_call"]
    assert [(c.name, c.arguments) for c in calls] == [("zoom", '{"box": "left"}')]
    assert split.calls and split.text == "Sure." and split.thought == "I should zoom."
    # blanks around the reasoning are never streamed (what streams is what the whole reply says)
    spaced = ReplySplitter(thinking=True)
    got = [d for piece in ("\n Hm", "m \n", "\n</th", "ink>\n\nOK") for d in spaced.feed(piece)] + spaced.finish()
    assert [(d.kind, d.text) for d in got] == [("reasoning", "Hm"), ("reasoning", "m"), ("text", "OK")]
    # without tools offered, the same text is an answer, markers and all
    plain = ReplySplitter()
    assert "".join(d.text for d in plain.feed("<tool_call>x") + plain.finish()) == "<tool_call>x"
    # a reply that starts like JSON but is an answer comes out whole at the end
    js = ReplySplitter("hermes", ["zoom"])
    assert js.feed('{"answer": ') == [] and [d.text for d in js.feed("4}") + js.finish()] == ['{"answer": 4}']


# --- templates -----------------------------------------------------------------------------------


def test_tools_reach_the_template_or_the_system_prompt():
    tools = [TOOLS[1]]
    history = [
        ("user", "Hi", [], {}),
        ("assistant", "", [], {"tool_calls": [{"id": "abc123XYZ", "name": "zoom", "arguments": {"box": "left"}}]}),
        ("tool", "the left half", [None], {"tool_call_id": "abc123XYZ", "name": "zoom"}),
    ]
    for family, template, fmt, own in (
        ("qwen2vl", "hermes_tools", "hermes", True),
        ("pixtral", "mistral_tools", "mistral", True),
        ("qwen2vl", None, "hermes", False),  # ChatML without tools: edgevlm teaches the format
    ):
        pair = pair_with(family, template)
        vlm = edgevlm.load(pair.model, pair.mmproj, n_ctx=2048, n_threads=2)
        try:
            f = vlm.scheduler.formatter
            assert f.caps.tools is own and f.tool_format == fmt
            pieces = f.render(history, tools)
            text = "".join(p.text for p in pieces if p.kind == "text")
            assert [p.kind for p in pieces].count("image") == 1  # the tool result's picture
            assert '"name": "zoom"' in text and "the left half" in text
            if fmt == "mistral":
                assert (
                    "[AVAILABLE_TOOLS]" in text and '[TOOL_CALLS][{"name": "zoom"' in text and "[TOOL_RESULTS]" in text
                )
            else:
                assert "<tools>" in text and "<tool_call>" in text and "<tool_response>" in text
            if not own:  # the instructions sit in the system turn, the calls and results in the chat
                assert text.index("<tools>") < text.index("Hi")
        finally:
            vlm.close()


# --- the server ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family,template", [("qwen2vl", "hermes_tools"), ("pixtral", "mistral_tools"), ("qwen2vl", None)]
)
def test_a_forced_call_parses_and_its_result_with_a_picture_is_answered(family, template):
    vlm, srv = serve(family, template)
    try:
        c = srv.client()
        r = c.chat.completions.create(
            model="m",
            messages=[ASK],
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            parallel_tool_calls=False,  # (a random model would add calls until max_tokens)
            max_tokens=300,
            temperature=0,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and call.id
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        # "required", one call only: any tool, arguments that fit its schema
        r = c.chat.completions.create(
            model="m",
            messages=[ASK],
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=300,
            temperature=0,
        )
        (other,) = r.choices[0].message.tool_calls
        jsonschema.validate(json.loads(other.function.arguments), SCHEMAS[other.function.name])
        # the result carries a picture: it is budgeted and answered like any picture
        history = [ASK, choice.message.model_dump(exclude_none=True)]

        def answer(content):
            return c.chat.completions.create(
                model="m",
                messages=[*history, {"role": "tool", "tool_call_id": call.id, "content": content}],
                tools=TOOLS,
                max_tokens=8,
                temperature=0,
            )

        with_picture = answer(
            [{"type": "text", "text": "Radar:"}, {"type": "image_url", "image_url": {"url": data_uri(png(seed=3))}}]
        )
        text_only = answer("Radar:")
        assert with_picture.choices[0].finish_reason in ("stop", "length", "tool_calls")
        picture_tokens = with_picture.usage.prompt_tokens - text_only.usage.prompt_tokens
        assert picture_tokens >= 16  # the picture's tokens are in the prompt
        # the call itself is in the prompt too (its name and arguments, as the template writes them)
        history[1] = {"role": "assistant", "content": ""}
        no_call = answer("Radar:")
        arguments = len(vlm.backend.tokenize_text(call.function.arguments))
        assert text_only.usage.prompt_tokens - no_call.usage.prompt_tokens >= arguments
        assert srv.status()["requests"]["failed"] == 0
    finally:
        srv.stop()
        vlm.close()


def test_a_streamed_call_arrives_as_tool_call_deltas():
    vlm, srv = serve("qwen2vl", "hermes_tools")
    try:
        c = srv.client()
        kw = dict(
            model="m",
            messages=[ASK],
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=300,
            temperature=0,
        )
        whole = c.chat.completions.create(**kw).choices[0].message.tool_calls
        deltas, finish, content = [], None, ""
        for chunk in c.chat.completions.create(stream=True, **kw):
            d = chunk.choices[0].delta
            content += d.content or ""
            deltas += d.tool_calls or []
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and content == ""
        assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
            (i, w.function.name, w.function.arguments) for i, w in enumerate(whole)
        ]
    finally:
        srv.stop()
        vlm.close()


def test_thinking_is_split_off_and_capped_by_the_reasoning_budget():
    budget = 6
    vlm, srv = serve("internvl", "hermes_thinking", reasoning_budget=budget)
    try:
        c = srv.client()
        be = vlm.backend
        r = c.chat.completions.create(model="m", messages=[ASK], max_tokens=24, temperature=0)
        m = r.choices[0].message
        reasoning = m.model_extra["reasoning_content"]
        # the random model never closes <think> by itself: the budget closed it, the answer followed
        assert reasoning and len(be.tokenize_text(reasoning)) <= budget + 1
        assert m.content and "</think>" not in m.content and "<think>" not in (m.content + reasoning)
        # a request may ask for less, never for more than the server allows
        r = c.chat.completions.create(
            model="m",
            messages=[ASK],
            max_tokens=24,
            temperature=0,
            extra_body={"chat_template_kwargs": {"enable_thinking": False}},
        )
        assert "reasoning_content" not in (r.choices[0].message.model_extra or {})
        assert r.choices[0].message.content
    finally:
        srv.stop()
        vlm.close()
    vlm, srv = serve("internvl", "hermes_thinking")  # no budget: all 24 tokens are reasoning
    try:
        r = srv.client().chat.completions.create(model="m", messages=[ASK], max_tokens=24, temperature=0)
        assert r.choices[0].finish_reason == "length" and not r.choices[0].message.content
        assert r.choices[0].message.model_extra["reasoning_content"]
    finally:
        srv.stop()
        vlm.close()


def test_ids_and_turns_are_put_as_each_template_wants_them():
    """Mistral's templates refuse ids that are not nine letters and digits (Ollama's clients send
    none, OpenAI's are longer): they are mapped, the same for a call and its result. Templates
    that want user and assistant turns to alternate (Gemma 3's) get a tool result and the user's
    next words as one turn."""
    call = [("assistant", "", [], {"tool_calls": [{"id": "call_0", "name": "zoom", "arguments": {"box": "left"}}]})]
    result = [("tool", "the left half", [], {"tool_call_id": "call_0", "name": "zoom"})]
    for family, template, then in (("pixtral", "mistral_tools", []), ("gemma3", None, [("user", "And now?", [], {})])):
        pair = pair_with(family, template)
        vlm = edgevlm.load(pair.model, pair.mmproj, n_ctx=2048, n_threads=2)
        try:
            pieces = vlm.scheduler.formatter.render([("user", "Hi", [], {}), *call, *result, *then], [TOOLS[1]])
            text = "".join(p.text for p in pieces if p.kind == "text")
            if template == "mistral_tools":
                (cid,) = set(re.findall(r'"(?:id|call_id)": "(\w+)"', text))
                assert len(cid) == 9 and cid.isalnum()
            else:
                assert "the left half" in text and "And now?" in text
        finally:
            vlm.close()


def test_a_schema_with_references_is_a_forced_call():
    """Pydantic, LangChain and agent SDKs write arguments with "$defs" and "$ref"."""
    box = {
        "type": "object",
        "$defs": {"Box": {"type": "object", "properties": {"side": {"enum": ["left", "right"]}}, "required": ["side"]}},
        "properties": {"box": {"$ref": "#/$defs/Box"}},
        "required": ["box"],
    }
    tools = [{"type": "function", "function": {"name": "zoom", "parameters": box}}, TOOLS[0]]
    vlm, srv = serve("qwen2vl", "hermes_tools")
    try:
        r = srv.client().chat.completions.create(
            model="m",
            messages=[ASK],
            tools=tools,
            tool_choice={"type": "function", "function": {"name": "zoom"}},
            parallel_tool_calls=False,
            max_tokens=300,
            temperature=0,
        )
        (call,) = r.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), box)
    finally:
        srv.stop()
        vlm.close()


def test_a_grammar_on_a_template_that_always_thinks_closes_the_block_first():
    """A template that opens <think> with no switch to turn it off (Qwen3-VL-Thinking's): under
    a grammar (JSON output, a forced call) the reply closes the block at once, and no token is
    put in past the grammar (which would abort llama.cpp), whatever the reasoning budget."""
    vlm, srv = serve("internvl", "think_always", reasoning_budget=4)
    try:
        c = srv.client()
        r = c.chat.completions.create(
            model="m", messages=[ASK], response_format={"type": "json_object"}, max_tokens=200, temperature=0
        )
        if r.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(r.choices[0].message.content), dict)
        assert "{" not in (r.choices[0].message.model_extra or {}).get("reasoning_content", "")
        r = c.chat.completions.create(
            model="m",
            messages=[ASK],
            tools=TOOLS,
            tool_choice="required",
            parallel_tool_calls=False,
            max_tokens=300,
            temperature=0,
        )
        (call,) = r.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        # without a grammar the same server still thinks, within its budget
        r = c.chat.completions.create(model="m", messages=[ASK], max_tokens=24, temperature=0)
        assert len(vlm.backend.tokenize_text(r.choices[0].message.model_extra["reasoning_content"])) <= 5
        assert srv.status()["requests"]["failed"] == 0
    finally:
        srv.stop()
        vlm.close()
