"""OpenAI's chat-completions replies: a ``Reply`` → the bodies OpenAI's clients expect
(``chat.completion``, its ``message`` and ``usage``), its ``Delta``s → ``chat.completion.chunk``
server-sent events, and an exception → ``{"error": {...}}`` (the error table's status and type).
``openai`` parses the requests; the server and batch files (``/v1/chat/completions`` lines)
share both. Pure functions, no I/O.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

from ..errors import EdgeVLMError
from ..runtime.model import LoadedModel
from .api_errors import RETRY_AFTER_S, failure_of
from .request import ChatRequest, Delta, Reply, ToolCall

__all__ = [
    "model_object",
    "ChunkStream",
    "chunk_body",
    "completion_body",
    "error_body",
    "error_for",
    "finish_reason",
    "message_body",
    "sse",
    "stream_events",
    "usage_body",
]


def finish_reason(reason: str | None) -> str | None:
    """edgevlm's reasons → OpenAI's: a full context is "length" to a client."""
    if reason is None:
        return None
    return {"stop": "stop", "length": "length", "context": "length", "tool_calls": "tool_calls"}.get(reason, "stop")


def usage_body(reply: Reply) -> dict[str, Any]:
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": reply.cached_tokens, "audio_tokens": reply.stats.audio_tokens},
    }


def _call_body(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }
    if index is not None:
        body = {"index": index, **body}
    return body


def message_body(reply: Reply) -> dict[str, Any]:
    """The assistant message of a reply: content (null when it is only tool calls), its tool
    calls (one cut off by max_tokens as OpenAI gives it: its arguments the JSON text as far as
    it was generated, with finish_reason "length"), its reasoning."""
    msg: dict[str, Any] = {"role": "assistant", "content": reply.text if (reply.text or not reply.tool_calls) else None}
    if reply.reasoning:
        msg["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        msg["tool_calls"] = [_call_body(c) for c in reply.tool_calls]
    return msg


def completion_body(reply: Reply) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": reply.id,
        "object": "chat.completion",
        "created": reply.created or int(time.time()),
        "model": reply.model,
        "choices": [
            {
                "index": 0,
                "message": message_body(reply),
                "logprobs": None,
                "finish_reason": finish_reason(reply.finish),
            }
        ],
        "usage": usage_body(reply),
    }
    if reply.extension:
        body["edgevlm"] = reply.extension
    return body


def chunk_body(
    req_id: str,
    model: str,
    created: int,
    delta: dict[str, Any],
    finish: str | None = None,
    usage: dict[str, Any] | None = None,
) -> dict[str, Any]:
    choices = (
        []
        if usage is not None
        else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason(finish)}]
    )
    body: dict[str, Any] = {
        "id": req_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": choices,
    }
    if usage is not None:
        body["usage"] = usage
    return body


async def stream_events(
    deltas: AsyncIterator[Delta | Reply], req: ChatRequest, req_id: str, model: str, created: int
) -> AsyncIterator[str]:
    """A reply's ``Delta``s as OpenAI's server-sent ``chat.completion.chunk`` events: text,
    ``reasoning_content``, ``tool_calls`` (each whole, with its index), the finish, usage when
    asked for, ``[DONE]``. An error after the stream began is sent as an error event."""
    chunks = ChunkStream(req_id, model, created)
    yield chunks.event({"role": "assistant", "content": ""})
    try:
        async for d in deltas:
            if isinstance(d, Reply):
                ext = {"edgevlm": d.extension} if d.extension else None
                yield chunks.event({}, d.finish, extra=ext)
                if req.include_usage:
                    yield chunks.event({}, usage=usage_body(d))
            elif d.kind == "text":
                yield chunks.text(d.text)
            elif d.kind == "reasoning":
                yield chunks.event({"reasoning_content": d.text})
            elif d.call is not None:
                yield chunks.event({"tool_calls": [_call_body(d.call, d.index)]})
    except EdgeVLMError as exc:  # no answer in time, the worker is gone, the request failed
        yield sse(error_for(exc)[1])
    yield "data: [DONE]\n\n"


class ChunkStream:
    """The ``chat.completion.chunk`` events of one streamed reply as server-sent events, the
    text ones from a template (one per token: the same JSON as ``chunk_body``, built without a
    dict per token)."""

    def __init__(self, req_id: str, model: str, created: int):
        self.req_id, self.model, self.created = req_id, model, created
        head = json.dumps(
            {"id": req_id, "object": "chat.completion.chunk", "created": created, "model": model}, ensure_ascii=False
        )[:-1]
        self._prefix = "data: " + head + ', "choices": [{"index": 0, "delta": {"content": '
        self._suffix = '}, "logprobs": null, "finish_reason": null}]}\n\n'

    def text(self, piece: str) -> str:
        return self._prefix + json.dumps(piece, ensure_ascii=False) + self._suffix

    def event(
        self,
        delta: dict[str, Any],
        finish: str | None = None,
        usage: dict[str, Any] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        body = chunk_body(self.req_id, self.model, self.created, delta, finish, usage)
        if extra:
            body.update(extra)
        return sse(body)


def sse(obj: dict[str, Any]) -> str:
    return "data: " + json.dumps(obj, ensure_ascii=False) + "\n\n"


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_for(exc: BaseException, retry_after_s: int = RETRY_AFTER_S) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, body, headers) for an exception in OpenAI's shape: the error table's
    (``api_errors``); ``retry_after_s``: the server's ``ServeOptions.retry_after_s``."""
    f = failure_of(exc, retry_after_s)
    return f.status, error_body(f.message, f.openai_type, f.param, f.code), dict(f.headers)


def model_object(model_id: str, started: float, model: LoadedModel | None) -> dict[str, Any]:
    """``GET /v1/models`` and ``/v1/models/{id}``: the one model, and once it is loaded its
    context, projector type and image budget."""
    card: dict[str, Any] = {
        "id": model_id,
        "object": "model",
        "created": int(started),
        "owned_by": "edgevlm",
        "input_modalities": ["text", "image"],
        "output_modalities": ["text"],
    }
    if model is not None:
        card["meta"] = {
            "n_ctx": model.n_ctx,
            "projector_type": model.backend.proj_info.projector_type,
            "image_max_tokens": model.plan.image_max_tokens if model.plan else None,
        }
    return card
