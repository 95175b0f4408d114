"""Ollama's API as data: ``/api/chat`` and ``/api/generate`` bodies → ``ChatRequest`` (validated,
a 400 naming the field that is wrong), and replies → the bodies and NDJSON lines Ollama's clients
expect; the bodies of ``/api/tags``, ``/api/show``, ``/api/ps`` and ``/api/version``.

Pure functions, no I/O, as ``openai``. What maps where:

- ``model``: any name is accepted (as ``/v1/chat/completions`` accepts any) and echoed in the
  reply; ``/api/tags`` lists the server's one model as ``<model id>:latest``. ``/api/show`` of
  another name is Ollama's 404 ``model '…' not found``.
- ``messages`` (chat): system, user, assistant and tool; ``content`` a string; ``images`` a list
  of base64 strings (``data:`` URIs too) on user and tool messages — an entry that is a
  recording by its content (WAV, FLAC, MP3, Ogg, M4A), or a ``data:audio/...`` URI, is audio, as
  Ollama takes audio in ``images``; assistant ``tool_calls``
  ``[{"function": {"name", "arguments": {...}}}]``; a tool message names its call by
  ``tool_call_id`` (Open WebUI) or ``tool_name`` (Ollama's own clients), else it answers the
  earliest call not yet answered. ``thinking`` sent back is dropped.
- ``prompt``, ``system`` and ``images`` (generate): one user turn under that system prompt.
- ``tools`` (OpenAI's shape; Ollama has no ``tool_choice``: the model decides), ``format``
  (``"json"``: a JSON object; a JSON Schema object: JSON that follows it — by grammar),
  ``think`` (true/false, or an effort ``"low"``…``"high"`` as on: the template's switch),
  ``stream`` (true unless said otherwise, as Ollama).
- ``options``: ``num_predict`` (the reply's most tokens; -1, -2 or 0: the server's
  ``--max-tokens``), ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``, ``stop``.
  ``num_ctx`` is accepted and ignored (clients send it routinely; the server's context is fixed
  when it starts), and so are the rest (``repeat_penalty``, ``num_gpu``, ``num_thread`` …),
  as Ollama ignores options it does not know. ``keep_alive`` is ignored: the model stays loaded.
- A chat without messages, or a generate without prompt and images, is Ollama's "load the
  model" call: answered at once, ``done_reason`` "load".
- Refused with a 400 (they would change the answer): generate's ``suffix``, ``template``,
  ``raw: true`` and a non-empty ``context`` (edgevlm returns none: send the conversation to
  ``/api/chat``), ``logprobs``.

Replies: ``message`` (chat) or ``response`` (generate) with ``thinking`` and ``tool_calls`` when
there are any; ``done_reason`` "stop" or "length" (a reply that made tool calls ends with
"stop", as Ollama's; one cut off inside a call has only the calls whose arguments are whole,
no markup in ``content``, and "length"; one the context or the server cut short is "length" with
``edgevlm.notices`` saying why, on the final record); counts and durations in nanoseconds:
``prompt_eval_count`` counts the whole prompt (cached tokens too), ``prompt_eval_duration`` the
time spent evaluating what was not cached, ``load_duration`` is 0 (the model is loaded once, at
start). Streamed: one NDJSON line per piece (``done: false``), then the final record; an error
after the stream began is a last line ``{"error": "…"}``. Errors: ``{"error": "…"}`` with
edgevlm's status (400, 401, 404, 413, 503 with ``retry-after`` when busy).
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from ..backend.sampling import SamplingParams
from ..errors import EdgeVLMError, shown
from . import openai
from .api_errors import RETRY_AFTER_S, APIError, NotFound, failure_of
from .http import bearer
from .ollama_media import media_refs
from .request import (
    DEFAULT_SAMPLING,
    ChatMessage,
    ChatRequest,
    Delta,
    Reply,
    ToolCall,
    bad,
)

if TYPE_CHECKING:
    pass

__all__ = [
    "MEDIA_TYPE",
    "VERSION",
    "LoadOnly",
    "api_key",
    "error_for",
    "load_body",
    "not_found",
    "parse_chat",
    "parse_generate",
    "reply_body",
    "stream_events",
    "timestamp",
]

VERSION = "0.12.0"  # what /api/version says: an Ollama whose API has everything served here
MEDIA_TYPE = "application/x-ndjson"
MAX_STOPS = openai.MAX_STOPS
EFFORTS = ("low", "medium", "high")

api_key = bearer  # Ollama's clients send Authorization: Bearer KEY (OLLAMA_API_KEY)


class LoadOnly(Exception):
    """A request that only asks for the model to be loaded (no messages, no prompt)."""

    def __init__(self, model: str):
        super().__init__("load")
        self.model = model


# --- requests -------------------------------------------------------------------------------


def _model(body: dict[str, Any]) -> str:
    m = body.get("model")
    if m is None:
        return ""
    if not isinstance(m, str):
        raise bad("'model' must be a string", "model")
    return m


def _answered(m: dict[str, Any], pending: list[ToolCall], where: str, i: int) -> tuple[str, str]:
    """(call id, function name) of a tool message: its ``tool_call_id``, else the earliest call
    not answered yet of its ``tool_name`` (or of any name)."""
    cid, name = m.get("tool_call_id"), m.get("tool_name", m.get("name"))
    if name is not None and not isinstance(name, str):
        raise bad(f"{where}.tool_name must be a string", f"{where}.tool_name")
    if cid is not None and not isinstance(cid, str):
        raise bad(f"{where}.tool_call_id must be a string", f"{where}.tool_call_id")
    if cid:
        call = next((c for c in pending if c.id == cid), None)
    else:
        call = next((c for c in pending if not name or c.name == name), None)
    if call is not None:
        pending.remove(call)
        return call.id, name or call.name
    return cid or f"call_{i}", name or ""


def _content(m: dict[str, Any], where: str) -> str:
    text = m.get("content")
    if text is None:
        return ""
    if not isinstance(text, str):
        raise bad(f"{where}.content must be a string (pictures go in {where}.images)", f"{where}.content")
    return text


def _messages(raw: Any) -> tuple[list[str], list[ChatMessage]]:
    if not isinstance(raw, list):
        raise bad("'messages' must be a list", "messages")
    system: list[str] = []
    out: list[ChatMessage] = []
    pending: list[ToolCall] = []  # calls made and not answered yet
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object", where)
        role = m.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise bad(f"{where}.role must be system, user, assistant or tool, not {shown(role)}", f"{where}.role")
        text = _content(m, where)
        images = media_refs(m.get("images"), f"{where}.images")
        if images and role not in ("user", "tool"):
            raise bad(f"{where}.images: only user and tool messages may carry images", f"{where}.images")
        if role == "system":
            system.append(text)
        elif role == "assistant":
            calls = openai.tool_calls_of(m.get("tool_calls"), where, i)
            pending += calls
            out.append(ChatMessage("assistant", text, (), i, calls))
        elif role == "tool":
            cid, name = _answered(m, pending, where, i)
            out.append(ChatMessage("tool", text, images, i, tool_call_id=cid, name=name))
        else:
            out.append(ChatMessage("user", text, images, i))
    return system, out


def _options(body: dict[str, Any], defaults: SamplingParams) -> tuple[SamplingParams, int | None, tuple[str, ...]]:
    """``options`` → (sampling, max tokens, stop strings)."""
    opts = body.get("options")
    if opts is None:
        opts = {}
    if not isinstance(opts, dict):
        raise bad("'options' must be an object", "options")
    try:
        sampling = openai.sampling_of(opts, defaults)
    except APIError as exc:
        raise bad(f"options: {exc}", f"options.{exc.param}") from None
    n = opts.get("num_predict")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int)):
        raise bad(f"options.num_predict must be an integer, not {shown(n)}", "options.num_predict")
    ctx = opts.get("num_ctx")  # accepted, not used: the context is the server's
    if ctx is not None and (isinstance(ctx, bool) or not isinstance(ctx, int)):
        raise bad(f"options.num_ctx must be an integer, not {shown(ctx)}", "options.num_ctx")
    stop = opts.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOPS:
        stops = tuple(s for s in stop if s)
    else:
        raise bad(f"options.stop must be a string or a list of at most {MAX_STOPS} strings", "options.stop")
    return sampling, (n if n is not None and n > 0 else None), stops


def _format(raw: Any) -> tuple[str, dict[str, Any] | None]:
    if raw is None or raw == "":
        return "text", None
    if raw == "json":
        return "json_object", None
    if isinstance(raw, dict):
        return "json_schema", raw
    raise bad(f"'format' must be \"json\" or a JSON Schema object, not {shown(raw)}", "format")


def _think(raw: Any) -> bool | None:
    if raw is None or isinstance(raw, bool):
        return raw
    if raw in EFFORTS:  # (gpt-oss's levels: any of them is reasoning on)
        return True
    raise bad(f"'think' must be true, false, low, medium or high, not {shown(raw)}", "think")


def _stream(body: dict[str, Any]) -> bool:
    s = body.get("stream")
    if s is None:
        return True  # Ollama streams unless told not to
    if not isinstance(s, bool):
        raise bad("'stream' must be true or false", "stream")
    return s


def _unsupported(body: dict[str, Any]) -> None:
    if body.get("logprobs") is True or body.get("top_logprobs"):
        raise bad("'logprobs' is not supported by this server", "logprobs", "unsupported_parameter")


def _request(
    body: dict[str, Any], messages: list[ChatMessage], system: list[str], defaults: SamplingParams, tools: Any
) -> ChatRequest:
    _unsupported(body)
    sampling, max_tokens, stops = _options(body, defaults)
    kind, schema = _format(body.get("format"))
    parsed, _, _ = openai.parse_tools(tools, None)
    return ChatRequest(
        tuple(messages),
        "\n\n".join(system) or None,
        _model(body),
        max_tokens,
        sampling,
        stops,
        _stream(body),
        response_format=kind,
        json_schema=schema,
        schema_at="format",
        tools=parsed,
        think=_think(body.get("think")),
    )


def parse_chat(body: Any, defaults: SamplingParams = DEFAULT_SAMPLING) -> ChatRequest:
    """Validate a ``/api/chat`` body; raise ``APIError`` (400) naming the field, or ``LoadOnly``
    for a body without messages."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    raw = body.get("messages")
    if raw is None or raw == []:
        raise LoadOnly(_model(body))
    system, out = _messages(raw)
    if not out:
        raise bad("'messages' holds no user or assistant message", "messages")
    return _request(body, out, system, defaults, body.get("tools"))


def parse_generate(body: Any, defaults: SamplingParams = DEFAULT_SAMPLING) -> ChatRequest:
    """Validate a ``/api/generate`` body (one user turn: ``prompt`` and ``images`` under
    ``system``); raise ``APIError`` (400) naming the field, or ``LoadOnly`` for a body without
    prompt and images."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    for key, why in (
        ("suffix", "fill-in-the-middle is not supported by this server"),
        ("template", "the model's own chat template is always used"),
    ):
        if body.get(key):
            raise bad(f"'{key}': {why}", key, "unsupported_parameter")
    if body.get("raw") is True:
        raise bad(
            "'raw' prompts are not supported: the chat template is always applied", "raw", "unsupported_parameter"
        )
    if body.get("context"):
        raise bad(
            "'context' is not supported (this server returns none): send the conversation to /api/chat",
            "context",
            "unsupported_parameter",
        )
    prompt, system = body.get("prompt"), body.get("system")
    if prompt is not None and not isinstance(prompt, str):
        raise bad("'prompt' must be a string", "prompt")
    if system is not None and not isinstance(system, str):
        raise bad("'system' must be a string", "system")
    images = media_refs(body.get("images"), "images")
    if not prompt and not images:
        raise LoadOnly(_model(body))
    return _request(body, [ChatMessage("user", prompt or "", images)], [system] if system else [], defaults, None)


# --- replies --------------------------------------------------------------------------------


def timestamp(t: float | None = None) -> str:
    """RFC 3339 in UTC with microseconds (``datetime.fromisoformat`` reads it on every Python)."""
    return datetime.fromtimestamp(time.time() if t is None else t, timezone.utc).isoformat()


def done_reason(finish: str) -> str:
    """edgevlm's finish → Ollama's: cut short (max_tokens, the context ran out) is "length"."""
    return "length" if finish in ("length", "context") else "stop"


def _call(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "function": {"name": call.name, "arguments": call.args}}


def _counts(reply: Reply, started: float | None) -> dict[str, int]:
    st = reply.stats
    prompt_ns = int(float(getattr(st, "prompt_ms", 0.0) or 0.0) * 1e6)
    eval_ns = int(float(getattr(st, "predicted_ms", 0.0) or 0.0) * 1e6)
    total = int((time.monotonic() - started) * 1e9) if started is not None else 0
    return {
        "total_duration": max(total, prompt_ns + eval_ns),
        "load_duration": 0,
        "prompt_eval_count": reply.prompt_tokens,
        "prompt_eval_duration": prompt_ns,
        "eval_count": reply.completion_tokens,
        "eval_duration": eval_ns,
    }


def _message(text: str, thinking: str = "", calls: tuple[ToolCall, ...] = ()) -> dict[str, Any]:
    """An assistant message; its calls those whose arguments are whole (Ollama's ``arguments``
    is an object: a call cut off part-way has none to give)."""
    msg: dict[str, Any] = {"role": "assistant", "content": text}
    if thinking:
        msg["thinking"] = thinking
    if whole := [_call(c) for c in calls if not c.partial]:
        msg["tool_calls"] = whole
    return msg


def reply_body(reply: Reply, generate: bool = False, started: float | None = None) -> dict[str, Any]:
    """A whole reply (``stream: false``); ``started``: when the request came (``time.monotonic``)."""
    body: dict[str, Any] = {"model": reply.model, "created_at": timestamp()}
    if generate:
        body["response"] = reply.text
        if reply.reasoning:
            body["thinking"] = reply.reasoning
    else:
        body["message"] = _message(reply.text, reply.reasoning, reply.tool_calls)
    body.update(done=True, done_reason=done_reason(reply.finish), **_counts(reply, started))
    if reply.extension:  # (notices: why it was cut short, a picture shrunk ...)
        body["edgevlm"] = reply.extension
    return body


def load_body(model: str, generate: bool = False) -> dict[str, Any]:
    """The answer to a "load the model" call (it is loaded already)."""
    body: dict[str, Any] = {"model": model, "created_at": timestamp()}
    if generate:
        body["response"] = ""
    else:
        body["message"] = _message("")
    body.update(done=True, done_reason="load")
    return body


def _line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"


async def stream_events(
    deltas: AsyncIterator[Delta | Reply], model: str, generate: bool = False, started: float | None = None
) -> AsyncIterator[str]:
    """A reply's ``Delta``s as Ollama's NDJSON lines: a line per piece of answer, reasoning
    (``thinking``) or tool call, then the final record with the counts. An error after the
    stream began is a last ``{"error": ...}`` line."""
    try:
        async for d in deltas:
            if isinstance(d, Reply):
                final = reply_body(d, generate, started)
                if generate:
                    final["response"] = ""
                    final.pop("thinking", None)
                else:
                    final["message"] = _message("")
                yield _line(final)
                return
            head: dict[str, Any] = {"model": model, "created_at": timestamp()}
            if generate:
                head["response"] = d.text if d.kind == "text" else ""
                if d.kind == "reasoning":
                    head["thinking"] = d.text
                elif d.kind == "tool_call":  # (generate offers no tools)
                    continue
            elif d.kind == "tool_call" and d.call is not None:
                if d.call.partial:  # (cut off: no arguments to give, see _message)
                    continue
                head["message"] = _message("", calls=(d.call,))
            else:
                head["message"] = _message(d.text) if d.kind == "text" else _message("", d.text)
            head["done"] = False
            yield _line(head)
    except EdgeVLMError as exc:  # no answer in time, the worker is gone, the request failed
        yield _line(error_for(exc)[1])


def error_for(exc: BaseException, retry_after_s: int = RETRY_AFTER_S) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, ``{"error": message}``, headers): the error table's (``api_errors``) in Ollama's
    shape."""
    f = failure_of(exc, retry_after_s)
    return f.status, {"error": f.message}, dict(f.headers)


def not_found(name: str) -> NotFound:
    return NotFound(f"model '{name}' not found", "model", "model_not_found")
