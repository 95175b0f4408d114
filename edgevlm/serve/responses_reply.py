"""The Responses API's replies (``POST /v1/responses``): a ``Reply`` → the ``response`` object
(reasoning, message and function-call output items, usage), and a reply's ``Delta``s → the
Responses streaming events (``response.created`` ... ``response.completed``), each with its
``type`` and ``sequence_number``. A function call cut off by ``max_output_tokens`` is an
``incomplete`` item (its arguments the JSON text as generated) in an ``incomplete`` response
(``incomplete_details.reason``: max_output_tokens — also when the context ran out first, which
``edgevlm.notices`` says). Pure functions: ``responses`` parses the
requests and keeps the store, ``app.Server`` serves both."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ..errors import EdgeVLMError
from .openai_reply import error_for
from .request import Delta, Reply, ToolCall, new_id
from .responses import ResponsesCall

__all__ = ["output_items", "reply_body", "response_body", "stream_response", "usage_body"]


def usage_body(reply: Reply) -> dict[str, Any]:
    """Responses' usage; the reasoning tokens estimated from the share of the generated text
    that was reasoning."""
    out = reply.completion_tokens
    reasoning = round(out * len(reply.reasoning) / len(reply.raw)) if reply.reasoning and reply.raw else 0
    return {
        "input_tokens": reply.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": reply.cached_tokens,
            "cache_write_tokens": 0,
            "audio_tokens": reply.stats.audio_tokens,
        },
        "output_tokens": out,
        "output_tokens_details": {"reasoning_tokens": min(reasoning, out)},
        "total_tokens": reply.prompt_tokens + out,
    }


def _status(reply: Reply) -> str:
    return "incomplete" if reply.finish in ("length", "context") else "completed"


def _reasoning_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def _message_item(item_id: str, text: str | None, status: str) -> dict[str, Any]:
    content = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(item_id: str, call: ToolCall, status: str, arguments: str | None = None) -> dict[str, Any]:
    """A function_call item (``status`` "completed" is "incomplete" for a call cut off)."""
    if call.partial and status == "completed":
        status = "incomplete"
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call.id,
        "name": call.name,
        "arguments": call.arguments if arguments is None else arguments,
        "status": status,
    }


def output_items(reply: Reply, max_tool_calls: int | None = None) -> list[dict[str, Any]]:
    """A reply's output items: its reasoning, its message (when it has text, or nothing else),
    its function calls."""
    status = _status(reply)
    items = []
    if reply.reasoning:
        items.append(_reasoning_item(new_id("rs_"), reply.reasoning, status))
    if reply.text or not reply.tool_calls:
        items.append(_message_item(new_id("msg_"), reply.text, status))
    calls = reply.tool_calls[:max_tool_calls] if max_tool_calls else reply.tool_calls
    items += [_call_item(new_id("fc_"), c, "completed") for c in calls]
    return items


def response_body(
    call: ResponsesCall,
    model: str,
    created: int,
    status: str,
    output: list[dict[str, Any]],
    reply: Reply | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The ``response`` object: its status and output (and usage once there is a reply), and
    what the request asked for."""
    req = call.request
    body: dict[str, Any] = {
        "id": call.id,
        "object": "response",
        "created_at": created,
        "status": status,
        "background": False,
        "completed_at": int(time.time()) if status == "completed" else None,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": call.instructions,
        "max_output_tokens": req.max_tokens,
        "max_tool_calls": call.max_tool_calls,
        "model": model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls,
        "previous_response_id": call.previous_id,
        "store": call.store,
        "temperature": req.sampling.temperature,
        "top_p": req.sampling.top_p,
        **call.echo,
        "usage": usage_body(reply) if reply is not None else None,
    }
    if reply is not None and reply.extension:
        body["edgevlm"] = reply.extension
    return body


def reply_body(call: ResponsesCall, model: str, created: int, reply: Reply) -> dict[str, Any]:
    """The ``response`` object of a finished reply."""
    return response_body(call, model, created, _status(reply), output_items(reply, call.max_tool_calls), reply)


def _failure(exc: BaseException) -> dict[str, Any]:
    """An error after the stream began, as a failed response's ``error``."""
    status, body, _ = error_for(exc)
    err = body["error"]
    code = (
        "server_error" if status >= 500 else "invalid_image" if err.get("code") == "invalid_image" else "invalid_prompt"
    )
    return {"code": code, "message": err["message"]}


class _Events:
    """Server-sent events, each with its type and the next sequence number."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.n, **fields}
        self.n += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class _Open:
    """The output item being streamed (reasoning or a message): its id, place and text."""

    def __init__(self, kind: str, index: int):
        self.kind, self.index = kind, index
        self.id = new_id("rs_" if kind == "reasoning" else "msg_")
        self.pieces: list[str] = []


async def stream_response(
    deltas: AsyncIterator[Delta | Reply],
    call: ResponsesCall,
    model: str,
    created: int,
    keep: Callable[[Reply, dict[str, Any]], dict[str, Any]] | None = None,
) -> AsyncIterator[str]:
    """A reply's ``Delta``s as the Responses streaming events: ``response.created`` and
    ``response.in_progress``; each output item added, its content (text and reasoning deltas, a
    function call's arguments) and done; then ``response.completed`` (``response.incomplete``
    when it ran out of tokens), its body passed through ``keep`` first (the store). An error
    after the stream began ends it with ``response.failed``."""
    ev = _Events()
    head = response_body(call, model, created, "in_progress", [])
    yield ev("response.created", response=head)
    yield ev("response.in_progress", response=head)
    items: list[dict[str, Any]] = []
    current: _Open | None = None
    said = False  # a message item was sent
    calls = 0

    def start(kind: str) -> list[str]:
        nonlocal current, said
        current = _Open(kind, len(items))
        said = said or kind == "message"
        make = _reasoning_item if kind == "reasoning" else _message_item
        part = {"type": "reasoning_text", "text": ""} if kind == "reasoning" else _text_part("")
        at = {"item_id": current.id, "output_index": current.index}
        return [
            ev("response.output_item.added", output_index=current.index, item=make(current.id, None, "in_progress")),
            ev("response.content_part.added", **at, content_index=0, part=part),
        ]

    def close(status: str = "completed") -> list[str]:
        nonlocal current
        if current is None:
            return []
        c, current = current, None
        text = "".join(c.pieces)
        at = {"item_id": c.id, "output_index": c.index, "content_index": 0}
        if c.kind == "reasoning":
            item = _reasoning_item(c.id, text, status)
            out = [
                ev("response.reasoning_text.done", **at, text=text),
                ev("response.content_part.done", **at, part={"type": "reasoning_text", "text": text}),
            ]
        else:
            item = _message_item(c.id, text, status)
            out = [
                ev("response.output_text.done", **at, text=text, logprobs=[]),
                ev("response.content_part.done", **at, part=_text_part(text)),
            ]
        items.append(item)
        return [*out, ev("response.output_item.done", output_index=c.index, item=item)]

    try:
        async for d in deltas:
            if isinstance(d, Reply):
                status = _status(d)
                for e in close(status):
                    yield e
                if not said and not d.tool_calls:  # an empty answer is still a message
                    for e in [*start("message"), *close(status)]:
                        yield e
                body = response_body(call, model, created, status, items, d)
                if keep is not None:
                    body = keep(d, body)
                yield ev(f"response.{status}", response=body)
                return
            if d.kind in ("text", "reasoning"):
                if not d.text:
                    continue
                kind = "message" if d.kind == "text" else "reasoning"
                if current is None or current.kind != kind:
                    for e in [*close(), *start(kind)]:
                        yield e
                assert current is not None
                current.pieces.append(d.text)
                name = "output_text" if kind == "message" else "reasoning_text"
                extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
                yield ev(
                    f"response.{name}.delta",
                    item_id=current.id,
                    output_index=current.index,
                    content_index=0,
                    delta=d.text,
                    **extra,
                )
            elif d.call is not None:
                calls += 1
                if call.max_tool_calls and calls > call.max_tool_calls:
                    continue
                for e in close():
                    yield e
                index, item_id = len(items), new_id("fc_")
                added = _call_item(item_id, d.call, "in_progress", "")
                yield ev("response.output_item.added", output_index=index, item=added)
                at = {"item_id": item_id, "output_index": index}
                yield ev("response.function_call_arguments.delta", **at, delta=d.call.arguments)
                yield ev("response.function_call_arguments.done", **at, arguments=d.call.arguments, name=d.call.name)
                item = _call_item(item_id, d.call, "completed")
                items.append(item)
                yield ev("response.output_item.done", output_index=index, item=item)
    except EdgeVLMError as exc:  # no answer in time, the worker is gone, the request failed
        for e in close("incomplete"):
            yield e
        yield ev("response.failed", response=response_body(call, model, created, "failed", items, error=_failure(exc)))
