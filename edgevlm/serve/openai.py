"""OpenAI's chat-completions API as data: a request body → ``ChatRequest`` (validated, one clear
message naming the field that is wrong), and replies → the bodies OpenAI's clients expect
(``chat.completion``, ``chat.completion.chunk``, ``usage``, ``{"error": {...}}``).

Pure functions, no I/O: the server and batch files (``/v1/chat/completions`` lines) share them.
Fields clients send that do not change what edgevlm does (``user``, ``presence_penalty``,
``metadata`` ...) are accepted and ignored; fields that would change the answer and are not
supported yet (``tools``, ``tool_choice``, ``logprobs: true``) are a 400, so a client that asked
for a tool call is told instead of getting prose. Extensions (other servers ignore them):
an image part's ``name``, and ``"edgevlm": {"evict": "summary"}`` — when the conversation no
longer fits, its oldest pictures become the model's summaries and the reply says which
(``edgevlm.summaries``), as ``edgevlm chat`` does.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, overload

from ..backend.sampling import SERVE_REPLY, SamplingParams
from ..errors import EdgeVLMError, ImageError, InputError, MemoryBusy

__all__ = [
    "APIError",
    "ChatMessage",
    "ChatRequest",
    "ChunkStream",
    "ImageRef",
    "chunk_body",
    "completion_body",
    "error_body",
    "error_for",
    "finish_reason",
    "new_id",
    "parse_chat_request",
    "sse",
    "usage_body",
]

DEFAULT_SAMPLING = SERVE_REPLY.sampling  # as llama-server when a request names none (--temp ... change it)
MAX_STOPS = 16


class APIError(InputError):
    """A request the API refuses: an HTTP status and OpenAI's error fields."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type_: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.http_status = status
        self.param = param
        self.code = code
        self.type = type_
        self.headers = headers or {}


@dataclass(frozen=True)
class ImageRef:
    url: str  # a data: URI, an http(s) URL, or a path under --allow-path
    detail: str = "auto"  # auto | low | high
    name: str = ""  # edgevlm extension: the picture's file name, for summaries that mention it


@dataclass(frozen=True)
class ChatMessage:
    role: str  # user | assistant
    text: str
    images: tuple[ImageRef, ...] = ()
    index: int = 0  # its place in the request's "messages"


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[ChatMessage, ...]
    system: str | None = None
    model: str = ""
    max_tokens: int | None = None
    sampling: SamplingParams = DEFAULT_SAMPLING
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    response_format: str = "text"  # text | json_object | json_schema
    json_schema: dict | None = None
    evict: bool = False  # edgevlm extension: old pictures may become summaries to make room

    @property
    def images(self) -> list[ImageRef]:
        return [im for m in self.messages for im in m.images]


def _bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, 400, param, code)


def _number(body: dict, key: str, lo: float, hi: float, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise _bad(f"'{key}' must be a number from {lo:g} to {hi:g}, not {v!r}", key)
    return float(v)


@overload
def _integer(body: dict, key: str, lo: int, default: int) -> int: ...
@overload
def _integer(body: dict, key: str, lo: int, default: None = None) -> int | None: ...


def _integer(body: dict, key: str, lo: int, default: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise _bad(f"'{key}' must be an integer of at least {lo}, not {v!r}", key)
    return v


def _content(raw: Any, where: str, role: str) -> tuple[str, tuple[ImageRef, ...]]:
    """A message's ``content``: a string, or a list of text and image parts."""
    if raw is None:
        return "", ()
    if isinstance(raw, str):
        return raw, ()
    if not isinstance(raw, list):
        raise _bad(f"{where}.content must be a string or a list of parts", f"{where}.content")
    texts: list[str] = []
    images: list[ImageRef] = []
    for j, part in enumerate(raw):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "input_text"):
            if not isinstance(part.get("text"), str):
                raise _bad(f"{at}.text must be a string", at)
            texts.append(part["text"])
        elif kind in ("image_url", "input_image"):
            if role != "user":
                raise _bad(f"{at}: only user messages may carry images", at)
            ref = part.get("image_url")
            if isinstance(ref, dict):
                url, detail = ref.get("url"), ref.get("detail") or "auto"
            else:  # some clients send "image_url": "data:..."
                url, detail = ref, part.get("detail") or "auto"
            if not isinstance(url, str) or not url:
                raise _bad(f'{at}.image_url must be a URL string or {{"url": ...}}', at)
            if detail not in ("auto", "low", "high"):
                raise _bad(f"{at}.image_url.detail must be auto, low or high", at)
            name = part.get("name") if isinstance(part.get("name"), str) else ""
            images.append(ImageRef(url, detail, name[:200]))
        else:
            raise _bad(f"{at}: content part type {kind!r} is not supported (text and image_url are)", at)
    return "\n".join(texts), tuple(images)


def _response_format(body: dict) -> tuple[str, dict | None]:
    rf = body.get("response_format")
    if rf is None:
        return "text", None
    kind = rf.get("type") if isinstance(rf, dict) else None
    if kind == "text":
        return "text", None
    if kind == "json_object":
        return "json_object", None
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise _bad(
                "response_format.json_schema.schema must be a JSON Schema object", "response_format.json_schema.schema"
            )
        return "json_schema", schema
    raise _bad(f"response_format.type must be text, json_object or json_schema, not {kind!r}", "response_format.type")


def _unsupported(body: dict) -> None:
    """Refuse what would change the answer and is not supported yet (silently ignoring it
    would hand a client something else than it asked for)."""
    if body.get("tools"):
        raise _bad("'tools' (tool calls) is not supported by this server yet", "tools", "unsupported_parameter")
    choice = body.get("tool_choice")
    if choice not in (None, "none", "auto"):
        raise _bad(
            "'tool_choice' is not supported by this server yet (no tools)", "tool_choice", "unsupported_parameter"
        )
    if body.get("functions") or body.get("function_call") not in (None, "none", "auto"):
        raise _bad(
            "'functions' (function calls) is not supported by this server yet", "functions", "unsupported_parameter"
        )
    if body.get("logprobs") is True or body.get("top_logprobs"):
        raise _bad("'logprobs' is not supported by this server yet", "logprobs", "unsupported_parameter")


def parse_chat_request(body: Any, defaults: SamplingParams = DEFAULT_SAMPLING) -> ChatRequest:
    """Validate a ``/v1/chat/completions`` body; raise ``APIError`` (400) naming the field.
    ``defaults``: the sampling of a request that names none (``ServeOptions.sampling``)."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("'messages' must be a non-empty list", "messages")
    system: list[str] = []
    out: list[ChatMessage] = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(f"{where} must be an object", where)
        role = m.get("role")
        if role in ("tool", "function"):
            raise _bad(f"{where}: {role} messages are not supported", f"{where}.role")
        if role not in ("system", "developer", "user", "assistant"):
            raise _bad(f"{where}.role must be system, developer, user or assistant, not {role!r}", f"{where}.role")
        text, images = _content(m.get("content"), where, role)
        if role in ("system", "developer"):
            system.append(text)
        else:
            out.append(ChatMessage(role, text, images, i))
    if not out:
        raise _bad("'messages' holds no user or assistant message", "messages")
    _unsupported(body)
    if _integer(body, "n", 1, 1) != 1:
        raise _bad("only n = 1 is supported", "n")
    max_tokens = _integer(body, "max_completion_tokens", 1) or _integer(body, "max_tokens", 1)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOPS:
        stops = tuple(s for s in stop if s)
    else:
        raise _bad(f"'stop' must be a string or a list of at most {MAX_STOPS} strings", "stop")
    seed = _integer(body, "seed", -(2**63))
    sampling = SamplingParams(
        temperature=_number(body, "temperature", 0, 2, defaults.temperature),
        top_k=_integer(body, "top_k", 0, defaults.top_k),
        top_p=_number(body, "top_p", 0, 1, defaults.top_p),
        min_p=_number(body, "min_p", 0, 1, defaults.min_p),
        seed=seed,
    )
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise _bad("'stream' must be true or false", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise _bad("'stream_options' must be an object", "stream_options")
    kind, schema = _response_format(body)
    raw_model, raw_ext = body.get("model"), body.get("edgevlm")
    model = raw_model if isinstance(raw_model, str) else ""
    ext = raw_ext if isinstance(raw_ext, dict) else {}
    if ext.get("evict", "off") not in ("off", "summary"):
        raise _bad("edgevlm.evict must be off or summary", "edgevlm.evict")
    return ChatRequest(
        tuple(out),
        "\n\n".join(system) or None,
        model,
        max_tokens,
        sampling,
        stops,
        stream,
        bool(opts.get("include_usage")),
        kind,
        schema,
        ext.get("evict") == "summary",
    )


# --- replies ---------------------------------------------------------------------------------


def new_id() -> str:
    return "chatcmpl-" + uuid.uuid4().hex[:24]


def finish_reason(reason: str | None) -> str | None:
    """edgevlm's reasons → OpenAI's: a full context is "length" to a client."""
    if reason is None:
        return None
    return {"stop": "stop", "length": "length", "context": "length"}.get(reason, "stop")


def usage_body(stats: Any) -> dict[str, Any]:
    prompt = stats.prompt_n + stats.cached_n
    return {
        "prompt_tokens": prompt,
        "completion_tokens": stats.predicted_n,
        "total_tokens": prompt + stats.predicted_n,
        "prompt_tokens_details": {"cached_tokens": stats.cached_n},
    }


def completion_body(
    req_id: str,
    model: str,
    text: str,
    finish: str,
    stats: Any,
    extension: dict[str, Any] | None = None,
    created: int | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": req_id,
        "object": "chat.completion",
        "created": created or int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": finish_reason(finish),
            }
        ],
        "usage": usage_body(stats),
    }
    if extension:
        body["edgevlm"] = extension
    return body


def chunk_body(
    req_id: str, model: str, created: int, delta: dict[str, Any], finish: str | None = None, usage: dict | None = None
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
        usage: dict | None = None,
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


def error_for(exc: BaseException) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, body, headers) for an exception: edgevlm's errors in OpenAI's shape; anything
    else is a 500 that says only that (the log has the rest)."""
    if isinstance(exc, APIError):
        return exc.http_status, error_body(str(exc), exc.type, exc.param, exc.code), exc.headers
    if isinstance(exc, MemoryBusy):  # may work once memory frees up
        return 503, error_body(str(exc), "server_error", code="memory_busy"), {"retry-after": "5"}
    if isinstance(exc, ImageError):
        return 400, error_body(str(exc), code="invalid_image"), {"x-should-retry": "false"}
    if isinstance(exc, InputError):
        return 400, error_body(str(exc), code=exc.code), {"x-should-retry": "false"}
    if isinstance(exc, EdgeVLMError):
        return exc.http_status, error_body(str(exc), "server_error", code=exc.code), {}
    return 500, error_body(f"internal error ({type(exc).__name__})", "server_error"), {}
