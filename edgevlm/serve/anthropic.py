"""Anthropic's Messages API (``POST /v1/messages``) as data: a request body → ``ChatRequest``
(validated, a 400 naming the field that is wrong), and replies → the bodies and server-sent
events Anthropic's clients expect (``message``, ``message_start`` … ``message_stop``,
``{"type": "error", "error": {...}}``).

Pure functions, no I/O, as ``openai``. What maps where:

- ``system`` (a string or text blocks), ``messages`` (user and assistant; content a string or
  blocks: ``text``, ``image`` from base64 or a URL, ``tool_use`` in assistant messages,
  ``tool_result`` in user messages — each becomes a ``tool`` message, in order, its text and
  pictures the result, ``is_error`` said as "Error: " before it — and ``thinking`` /
  ``redacted_thinking`` in assistant messages, dropped as Anthropic drops them from the prompt);
- ``max_tokens`` (required, as Anthropic requires it), ``stop_sequences``, ``temperature`` (0
  to 1), ``top_p``, ``top_k``, ``stream``;
- ``tools`` (``name``, ``description``, ``input_schema``), ``tool_choice`` (auto, any, tool, none
  → auto, required, function, none; ``disable_parallel_tool_use``);
- ``thinking``: enabled (reasoning on, ``budget_tokens`` its cap) / disabled (off) / adaptive
  (the template's default) — where the model's template has the switch;
- ``output_config.format`` ``{"type": "json_schema", "schema"}``: the reply follows the schema
  (the grammar ``response_format`` uses);
- consecutive user (or assistant) turns are one turn, as Anthropic combines them;
- ``metadata``, ``service_tier``, ``cache_control``, ``output_config.effort`` … are accepted and
  ignored. A server tool (``web_search_…``), a document block, a final assistant message
  (prefill: the reply would be a new turn, not its continuation) are a 400.

Replies: ``content`` holds a thinking block (with an empty ``signature``: edgevlm signs nothing,
and drops thinking blocks sent back), the text, and ``tool_use`` blocks; ``usage`` counts the
prompt tokens evaluated (``input_tokens``) apart from those read from the cache
(``cache_read_input_tokens``). ``stop_reason``: end_turn, max_tokens or tool_use — never
stop_sequence: a stop sequence and the template's own end are cut the same way, so which one
ended a reply is not known (``stop_sequence`` is always null).

Errors: Anthropic's types, the status, ``retry-after`` and ``x-should-retry`` come from the error
table (``api_errors.TABLE``: 400 invalid_request_error, 401 authentication_error, 404
not_found_error, 413 request_too_large, 500 api_error, 503 overloaded_error — a busy server is a
503 with retry-after, which Anthropic's clients retry). edgevlm's own code and the
field at fault ride beside, in ``"edgevlm": {"code", "param"}``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Mapping
from dataclasses import replace
from typing import Any

from ..backend.sampling import SamplingParams
from ..errors import EdgeVLMError
from . import openai
from .api_errors import RETRY_AFTER_S, failure_of
from .request import (
    DEFAULT_SAMPLING,
    ChatMessage,
    ChatRequest,
    Delta,
    ImageRef,
    Reply,
    Tool,
    ToolCall,
    bad,
    integer,
    number,
)

__all__ = [
    "api_key",
    "error_body",
    "error_for",
    "message_body",
    "message_id",
    "parse_messages_request",
    "stop_reason",
    "stream_events",
    "from_tool_use_id",
    "tool_use_id",
    "usage_body",
]

MAX_STOPS = 16
IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


def api_key(headers: Mapping[str, str]) -> str:
    """The key of ``x-api-key: KEY`` (Anthropic's clients), else of ``Authorization: Bearer KEY``."""
    if headers.get("x-api-key"):
        return headers["x-api-key"]
    auth = headers.get("authorization", "")
    return auth[7:] if auth.lower().startswith("bearer ") else ""


# --- requests --------------------------------------------------------------------------------


def _blocks(raw: Any, at: str) -> list[Any]:
    """A content: a string (one text block) or a list of blocks."""
    if isinstance(raw, str):
        return [{"type": "text", "text": raw}]
    if not isinstance(raw, list):
        raise bad(f"{at} must be a string or a list of content blocks", at)
    return raw


def _text(block: dict, at: str) -> str:
    if not isinstance(block.get("text"), str):
        raise bad(f"{at}.text must be a string", f"{at}.text")
    return block["text"]


def _image(block: dict, at: str) -> ImageRef:
    src = block.get("source")
    kind = src.get("type") if isinstance(src, dict) else None
    if kind == "base64":
        assert isinstance(src, dict)
        mime, data = src.get("media_type"), src.get("data")
        if mime not in IMAGE_TYPES:
            raise bad(f"{at}.source.media_type must be one of {', '.join(IMAGE_TYPES)}, not {mime!r}", at)
        if not isinstance(data, str) or not data:
            raise bad(f"{at}.source.data must be the picture's bytes in base64", f"{at}.source.data")
        return ImageRef(f"data:{mime};base64,{data}")
    if kind == "url":
        assert isinstance(src, dict)
        url = src.get("url")
        if not isinstance(url, str) or not url:
            raise bad(f"{at}.source.url must be a URL string", f"{at}.source.url")
        return ImageRef(url)
    raise bad(
        f'{at}.source must be {{"type": "base64", "media_type", "data"}} or {{"type": "url", "url"}}'
        f" (a file id is not supported), not type {kind!r}",
        f"{at}.source",
    )


def _result_content(raw: Any, at: str) -> tuple[str, tuple[ImageRef, ...]]:
    """A tool_result's content: a string, or text and image blocks."""
    if raw is None:
        return "", ()
    texts: list[str] = []
    images: list[ImageRef] = []
    for j, block in enumerate(_blocks(raw, at)):
        where = f"{at}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text(block, where))
        elif kind == "image":
            images.append(_image(block, where))
        else:
            raise bad(f"{where}: a tool result holds text and image blocks, not {kind!r}", where)
    return "\n".join(texts), tuple(images)


def _called(messages: list[ChatMessage], cid: str) -> str:
    """The name of the tool call ``cid`` (from the assistant messages before)."""
    for m in reversed(messages):
        for c in m.tool_calls:
            if c.id == cid:
                return c.name
    return ""


def _append(out: list[ChatMessage], m: ChatMessage) -> None:
    """Add ``m``; consecutive user (or assistant) turns are one turn, as Anthropic combines them."""
    last = out[-1] if out else None
    if last is None or last.role != m.role or m.role == "tool":
        out.append(m)
        return
    text = "\n\n".join(t for t in (last.text, m.text) if t)
    out[-1] = replace(last, text=text, images=last.images + m.images, tool_calls=last.tool_calls + m.tool_calls)


def _user(blocks: list[Any], where: str, i: int, out: list[ChatMessage]) -> None:
    """A user message: its tool results each a ``tool`` message, its text and pictures a user
    message, in the order they come."""
    texts: list[str] = []
    images: list[ImageRef] = []

    def flush() -> None:
        if texts or images:
            _append(out, ChatMessage("user", "\n".join(texts), tuple(images), i))
            texts.clear()
            images.clear()

    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "image":
            images.append(_image(block, at))
        elif kind == "tool_result":
            flush()
            cid = block.get("tool_use_id")
            if not isinstance(cid, str) or not cid:
                raise bad(f"{at}.tool_use_id must name the tool_use this is the result of", f"{at}.tool_use_id")
            text, pics = _result_content(block.get("content"), f"{at}.content")
            is_error = block.get("is_error", False)
            if not isinstance(is_error, bool):
                raise bad(f"{at}.is_error must be true or false", f"{at}.is_error")
            if is_error:
                text = "Error: " + text if text else "Error"
            cid = from_tool_use_id(cid)
            out.append(ChatMessage("tool", text, pics, i, tool_call_id=cid, name=_called(out, cid)))
        else:
            raise bad(f"{at}: a user message holds text, image and tool_result blocks, not {kind!r}", at)
    flush()


def _assistant(blocks: list[Any], where: str, i: int) -> ChatMessage:
    texts: list[str] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text":
            texts.append(_text(block, at))
        elif kind == "tool_use":
            cid, name, args = block.get("id"), block.get("name"), block.get("input", {})
            if not isinstance(cid, str) or not cid:
                raise bad(f"{at}.id must be the tool call's id", f"{at}.id")
            if not isinstance(name, str) or not name:
                raise bad(f"{at}.name must be the tool's name", f"{at}.name")
            if not isinstance(args, dict):
                raise bad(f"{at}.input must be an object", f"{at}.input")
            calls.append(ToolCall(from_tool_use_id(cid), name, json.dumps(args, ensure_ascii=False)))
        elif kind in ("thinking", "redacted_thinking"):
            continue  # earlier turns' reasoning does not enter the prompt
        else:
            raise bad(f"{at}: an assistant message holds text, tool_use and thinking blocks, not {kind!r}", at)
    return ChatMessage("assistant", "".join(texts), (), i, tuple(calls))


def _system(raw: Any) -> str | None:
    if raw is None:
        return None
    texts = []
    for j, block in enumerate(_blocks(raw, "system")):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise bad(f"system[{j}] must be a text block, not {kind!r}", f"system[{j}]")
        texts.append(_text(block, f"system[{j}]"))
    return "\n".join(texts) or None


def _tools(raw: Any) -> tuple[Tool, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise bad("'tools' must be a list of tools", "tools")
    tools = []
    for i, t in enumerate(raw):
        at = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad(f'{at} must be {{"name", "description", "input_schema"}}', at)
        if t.get("type", "custom") != "custom":
            raise bad(f"{at}: server tools ({t.get('type')!r}) are not supported; give name and input_schema", at)
        tools.append(openai.tool_of(t, at))
    if len({t.name for t in tools}) < len(tools):
        raise bad("'tools' names a tool twice", "tools")
    return tuple(tools)


def _tool_choice(raw: Any, tools: tuple[Tool, ...]) -> tuple[str, str, bool]:
    """(choice, the named tool, parallel calls allowed)."""
    if raw is None:
        return "auto", "", True
    kind = raw.get("type") if isinstance(raw, dict) else None
    if not isinstance(raw, dict) or kind not in ("auto", "any", "tool", "none"):
        raise bad('\'tool_choice\' must be {"type": "auto" | "any" | "tool" | "none"}', "tool_choice")
    serial = raw.get("disable_parallel_tool_use", False)
    if not isinstance(serial, bool):
        raise bad(
            "tool_choice.disable_parallel_tool_use must be true or false", "tool_choice.disable_parallel_tool_use"
        )
    choice = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}[kind]
    name = raw.get("name") if kind == "tool" else ""
    if choice in ("required", "function") and not tools:
        raise bad(f"tool_choice {kind!r} needs 'tools'", "tool_choice")
    if kind == "tool" and name not in {t.name for t in tools}:
        raise bad(f"tool_choice names the tool {name!r}, which is not in 'tools'", "tool_choice.name")
    return choice, name or "", not serial


def _thinking(raw: Any, max_tokens: int) -> tuple[bool | None, int | None]:
    """(reasoning on/off/the template's default, its budget)."""
    if raw is None:
        return None, None
    kind = raw.get("type") if isinstance(raw, dict) else None
    if kind == "enabled":
        assert isinstance(raw, dict)
        budget = integer(raw, "budget_tokens", 1)
        if budget is None:
            raise bad("thinking.budget_tokens must be given with thinking enabled", "thinking.budget_tokens")
        return True, min(budget, max_tokens)
    if kind == "disabled":
        return False, None
    if kind == "adaptive":
        return None, None
    raise bad('\'thinking\' must be {"type": "enabled", "budget_tokens"}, disabled or adaptive', "thinking")


def _output_format(body: dict) -> tuple[str, dict | None]:
    cfg = body.get("output_config")
    if cfg is None:
        return "text", None
    if not isinstance(cfg, dict):
        raise bad("'output_config' must be an object", "output_config")
    fmt = cfg.get("format")
    if fmt is None:
        return "text", None
    schema = fmt.get("schema") if isinstance(fmt, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(schema, dict):
        raise bad('output_config.format must be {"type": "json_schema", "schema": {...}}', "output_config.format")
    return "json_schema", schema


def parse_messages_request(body: Any, defaults: SamplingParams = DEFAULT_SAMPLING) -> ChatRequest:
    """Validate a ``/v1/messages`` body; raise ``APIError`` (400) naming the field.
    ``defaults``: the sampling of a request that names none (``ServeOptions.sampling``)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    max_tokens = integer(body, "max_tokens", 1)
    if max_tokens is None:
        raise bad("max_tokens: field required", "max_tokens")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", "messages")
    out: list[ChatMessage] = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object", where)
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise bad(f"{where}.role must be user or assistant, not {role!r}", f"{where}.role")
        blocks = _blocks(m.get("content"), f"{where}.content")
        if role == "user":
            _user(blocks, where, i, out)
        else:
            _append(out, _assistant(blocks, where, i))
    if not out:
        raise bad("'messages' holds no content", "messages")
    if out[-1].role == "assistant":
        raise bad(
            f"messages[{len(msgs) - 1}]: a final assistant message (prefill) is not supported",
            f"messages[{len(msgs) - 1}]",
        )
    stops = body.get("stop_sequences")
    if stops is None:
        stops = []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops) or len(stops) > MAX_STOPS:
        raise bad(f"'stop_sequences' must be a list of at most {MAX_STOPS} strings", "stop_sequences")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("'stream' must be true or false", "stream")
    tools = _tools(body.get("tools"))
    choice, tool_name, parallel = _tool_choice(body.get("tool_choice"), tools)
    think, think_budget = _thinking(body.get("thinking"), max_tokens)
    kind, schema = _output_format(body)
    model = body.get("model")
    sampling = SamplingParams(
        temperature=number(body, "temperature", 0, 1, defaults.temperature),
        top_k=integer(body, "top_k", 0, defaults.top_k),
        top_p=number(body, "top_p", 0, 1, defaults.top_p),
        min_p=defaults.min_p,
        seed=defaults.seed,
    )
    return ChatRequest(
        tuple(out),
        _system(body.get("system")),
        model if isinstance(model, str) else "",
        max_tokens,
        sampling,
        tuple(s for s in stops if s),
        stream,
        response_format=kind,
        json_schema=schema,
        tools=tools,
        tool_choice=choice,
        tool_name=tool_name,
        parallel_tool_calls=parallel,
        think=think,
        think_budget=think_budget,
    )


# --- replies ---------------------------------------------------------------------------------


def message_id(reply_id: str) -> str:
    """Anthropic's ``msg_…`` id for a reply's id (``chatcmpl-…``)."""
    return "msg_" + reply_id.rsplit("-", 1)[-1]


def stop_reason(finish: str) -> str:
    """edgevlm's finish → Anthropic's stop_reason (a stop sequence is not told from the
    template's end: both end_turn)."""
    return {"length": "max_tokens", "context": "max_tokens", "tool_calls": "tool_use"}.get(finish, "end_turn")


def usage_body(reply: Reply) -> dict[str, int]:
    return {
        "input_tokens": reply.prompt_tokens - reply.cached_tokens,
        "output_tokens": reply.completion_tokens,
        "cache_read_input_tokens": reply.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def tool_use_id(cid: str) -> str:
    """A tool call's id as Anthropic writes them (``toolu_…``; the other APIs' ``call_…``)."""
    return "toolu_" + cid[5:] if cid.startswith("call_") else cid


def from_tool_use_id(cid: str) -> str:
    """An id sent back in Anthropic's form, as the prompt held it (``call_…``)."""
    return "call_" + cid[6:] if cid.startswith("toolu_") else cid


def _tool_use(call: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": call.args}


def message_body(reply: Reply) -> dict[str, Any]:
    content: list[dict[str, Any]] = []
    if reply.reasoning:
        content.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.text or not reply.tool_calls:
        content.append({"type": "text", "text": reply.text})
    content += [_tool_use(c) for c in reply.tool_calls]
    body: dict[str, Any] = {
        "id": message_id(reply.id),
        "type": "message",
        "role": "assistant",
        "model": reply.model,
        "content": content,
        "stop_reason": stop_reason(reply.finish),
        "stop_sequence": None,
        "usage": usage_body(reply),
    }
    if reply.extension:
        body["edgevlm"] = reply.extension
    return body


def event(kind: str, data: dict[str, Any]) -> str:
    """One server-sent event, Anthropic's way: its type on the ``event:`` line and in the data."""
    return f"event: {kind}\ndata: " + json.dumps({"type": kind, **data}, ensure_ascii=False) + "\n\n"


async def stream_events(
    deltas: AsyncIterator[Delta | Reply], req_id: str, model: str, input_tokens: int = 0
) -> AsyncIterator[str]:
    """A reply's ``Delta``s as Anthropic's events: ``message_start`` (``input_tokens``: the
    prompt's, before the cache is known), a ping, each block's start, deltas (text, thinking,
    a tool call's whole input as one ``input_json_delta``) and stop, ``message_delta`` (the
    stop reason and the whole usage), ``message_stop``. An error after the stream began is an
    ``error`` event."""
    start: dict[str, Any] = {
        "id": message_id(req_id),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {
            "input_tokens": input_tokens,
            "output_tokens": 0,
            "cache_read_input_tokens": 0,
            "cache_creation_input_tokens": 0,
        },
    }
    yield event("message_start", {"message": start})
    yield event("ping", {})
    index, open_kind, seen_text = -1, "", False  # the block now open ("" none)

    def close() -> list[str]:
        nonlocal open_kind
        if not open_kind:
            return []
        open_kind = ""
        return [event("content_block_stop", {"index": index})]

    def begin(block: dict[str, Any]) -> list[str]:
        nonlocal index, open_kind
        out = close()
        index += 1
        open_kind = block["type"]
        return out + [event("content_block_start", {"index": index, "content_block": block})]

    try:
        async for d in deltas:
            if isinstance(d, Reply):
                parts = close()
                if not seen_text and not d.tool_calls:  # as the whole message: a text block, if empty
                    parts += begin({"type": "text", "text": ""}) + close()
                parts.append(
                    event(
                        "message_delta",
                        {
                            "delta": {"stop_reason": stop_reason(d.finish), "stop_sequence": None},
                            "usage": usage_body(d),
                            **({"edgevlm": d.extension} if d.extension else {}),
                        },
                    )
                )
                parts.append(event("message_stop", {}))
                for p in parts:
                    yield p
            elif d.kind == "text":
                if open_kind != "text":
                    for p in begin({"type": "text", "text": ""}):
                        yield p
                seen_text = True
                yield event("content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": d.text}})
            elif d.kind == "reasoning":
                if open_kind != "thinking":
                    for p in begin({"type": "thinking", "thinking": "", "signature": ""}):
                        yield p
                yield event(
                    "content_block_delta", {"index": index, "delta": {"type": "thinking_delta", "thinking": d.text}}
                )
            elif d.call is not None:
                block = {**_tool_use(d.call), "input": {}}
                for p in begin(block):
                    yield p
                partial = json.dumps(d.call.args, ensure_ascii=False)
                yield event(
                    "content_block_delta",
                    {"index": index, "delta": {"type": "input_json_delta", "partial_json": partial}},
                )
                for p in close():
                    yield p
    except EdgeVLMError as exc:  # no answer in time, the worker is gone, the request failed
        yield event("error", {k: v for k, v in error_for(exc)[1].items() if k != "type"})


# --- errors ----------------------------------------------------------------------------------


def error_body(
    message: str, type_: str = "invalid_request_error", code: str | None = None, param: str | None = None
) -> dict[str, Any]:
    body: dict[str, Any] = {"type": "error", "error": {"type": type_, "message": message}}
    if code or param:
        body["edgevlm"] = {"code": code, "param": param}
    return body


def error_for(exc: BaseException, retry_after_s: int = RETRY_AFTER_S) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, body, headers) for an exception in Anthropic's shape: the error table's
    (``api_errors``; a 500 says only its class, the log has the rest)."""
    f = failure_of(exc, retry_after_s)
    return f.status, error_body(f.message, f.anthropic_type, f.code, f.param), dict(f.headers)
