"""Anthropic's Messages API replies: a ``Reply`` → the bodies and server-sent events Anthropic's
clients expect (``message``, ``message_start`` … ``message_stop``), and an exception → ``{"type":
"error", "error": {...}}`` (the error table's status and type). ``anthropic`` parses the requests.

Replies: ``content`` holds a thinking block (with an empty ``signature``: edgevlm signs nothing,
and drops thinking blocks sent back), the text, and ``tool_use`` blocks; ``usage`` counts the
prompt tokens evaluated (``input_tokens``) apart from those read from the cache
(``cache_read_input_tokens``); a ``tool_use`` cut off by max_tokens holds the input as far as
it got (its whole members and a last string cut short), with ``stop_reason`` max_tokens.
``stop_reason``: end_turn, max_tokens, tool_use or model_context_window_exceeded (the context ran
out before max_tokens; ``edgevlm.notices`` says so too) — never stop_sequence: a stop sequence and
the template's own end are cut the same way, so which one ended a reply is not known
(``stop_sequence`` is always null).

Errors: Anthropic's types, the status, ``retry-after`` and ``x-should-retry`` come from the error
table (``api_errors.TABLE``: 400 invalid_request_error, 401 authentication_error, 404
not_found_error, 413 request_too_large, 500 api_error, 503 overloaded_error — a busy server is a
503 with retry-after, which Anthropic's clients retry). edgevlm's own code and the
field at fault ride beside, in ``"edgevlm": {"code", "param"}``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from ..errors import EdgeVLMError
from .anthropic import tool_use_id
from .api_errors import RETRY_AFTER_S, failure_of
from .request import Delta, Reply, ToolCall

__all__ = [
    "error_body",
    "error_for",
    "event",
    "message_body",
    "message_id",
    "stop_reason",
    "stream_events",
    "usage_body",
]


def message_id(reply_id: str) -> str:
    """Anthropic's ``msg_…`` id for a reply's id (``chatcmpl-…``)."""
    return "msg_" + reply_id.rsplit("-", 1)[-1]


def stop_reason(finish: str) -> str:
    """edgevlm's finish → Anthropic's stop_reason (a stop sequence is not told from the
    template's end: both end_turn; a reply the context stopped short of max_tokens is
    Anthropic's own model_context_window_exceeded)."""
    return {"length": "max_tokens", "context": "model_context_window_exceeded", "tool_calls": "tool_use"}.get(
        finish, "end_turn"
    )


def usage_body(reply: Reply) -> dict[str, int]:
    return {
        "input_tokens": reply.prompt_tokens - reply.cached_tokens,
        "output_tokens": reply.completion_tokens,
        "cache_read_input_tokens": reply.cached_tokens,
        "cache_creation_input_tokens": 0,
    }


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
