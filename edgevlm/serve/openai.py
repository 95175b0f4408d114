"""OpenAI's chat-completions API as data: a request body → ``ChatRequest`` (validated, one clear
message naming the field that is wrong), and replies → the bodies OpenAI's clients expect
(``chat.completion``, ``chat.completion.chunk``, ``usage``, ``{"error": {...}}``).

Pure functions, no I/O: the server and batch files (``/v1/chat/completions`` lines) share them.
Fields clients send that do not change what edgevlm does (``user``, ``presence_penalty``,
``metadata`` ...) are accepted and ignored; fields that would change the answer and are not
supported (``logprobs: true``, the deprecated ``functions``) are a 400, so a client is told
instead of getting something else. Tools: ``tools``, ``tool_choice`` (auto, none, required, a
named function — the last two enforced by a grammar), ``parallel_tool_calls``, assistant
``tool_calls`` and ``tool`` messages (whose content may hold pictures) sent back; replies carry
``tool_calls`` and ``reasoning_content`` (a thinking model's ``<think>`` text;
``chat_template_kwargs.enable_thinking`` switches it where the template can).
Extensions (other servers ignore them):
an image part's ``name``, and ``"edgevlm": {"evict": "summary"}`` — when the conversation no
longer fits, its oldest pictures become the model's summaries and the reply says which
(``edgevlm.summaries``), as ``edgevlm chat`` does.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from ..backend.sampling import SamplingParams
from ..errors import EdgeVLMError
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
    "ChunkStream",
    "chunk_body",
    "completion_body",
    "error_body",
    "error_for",
    "finish_reason",
    "message_body",
    "parse_chat_request",
    "parse_tools",
    "sse",
    "stream_events",
    "tool_calls_of",
    "tool_of",
    "usage_body",
]

MAX_STOPS = 16
FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")


def _content(raw: Any, where: str, role: str) -> tuple[str, tuple[ImageRef, ...]]:
    """A message's ``content``: a string, or a list of text and image parts."""
    if raw is None:
        return "", ()
    if isinstance(raw, str):
        return raw, ()
    if not isinstance(raw, list):
        raise bad(f"{where}.content must be a string or a list of parts", f"{where}.content")
    texts: list[str] = []
    images: list[ImageRef] = []
    for j, part in enumerate(raw):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "input_text"):
            if not isinstance(part.get("text"), str):
                raise bad(f"{at}.text must be a string", at)
            texts.append(part["text"])
        elif kind in ("image_url", "input_image"):
            if role not in ("user", "tool"):
                raise bad(f"{at}: only user and tool messages may carry images", at)
            ref = part.get("image_url")
            if isinstance(ref, dict):
                url, detail = ref.get("url"), ref.get("detail") or "auto"
            else:  # some clients send "image_url": "data:..."
                url, detail = ref, part.get("detail") or "auto"
            if not isinstance(url, str) or not url:
                raise bad(f'{at}.image_url must be a URL string or {{"url": ...}}', at)
            if detail not in ("auto", "low", "high"):
                raise bad(f"{at}.image_url.detail must be auto, low or high", at)
            name = part.get("name") if isinstance(part.get("name"), str) else ""
            images.append(ImageRef(url, detail, name[:200]))
        elif kind in ("video_url", "input_video"):
            if role not in ("user", "tool"):
                raise bad(f"{at}: only user and tool messages may carry videos", at)
            ref = part.get(kind) if kind == "video_url" else part.get("video_url")
            url = ref.get("url") if isinstance(ref, dict) else ref
            if not isinstance(url, str) or not url:
                raise bad(f'{at}.video_url must be a URL string or {{"url": ...}}', at)
            name = part.get("name") if isinstance(part.get("name"), str) else ""
            images.append(ImageRef(url, "auto", name[:200], "video"))
        else:
            raise bad(f"{at}: content part type {kind!r} is not supported (text, image_url and video_url are)", at)
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
            raise bad(
                "response_format.json_schema.schema must be a JSON Schema object", "response_format.json_schema.schema"
            )
        return "json_schema", schema
    raise bad(f"response_format.type must be text, json_object or json_schema, not {kind!r}", "response_format.type")


def _unsupported(body: dict) -> None:
    """Refuse what would change the answer and is not supported (silently ignoring it would
    hand a client something else than it asked for)."""
    if body.get("functions") or body.get("function_call") not in (None, "none", "auto"):
        raise bad(
            "'functions' (the deprecated function calls) is not supported: send 'tools'",
            "functions",
            "unsupported_parameter",
        )
    if body.get("logprobs") is True or body.get("top_logprobs"):
        raise bad("'logprobs' is not supported by this server yet", "logprobs", "unsupported_parameter")


def parse_tools(raw: Any, choice: Any, where: str = "tools") -> tuple[tuple[Tool, ...], str, str]:
    """OpenAI's ``tools`` and ``tool_choice`` → (tools, choice, the named function)."""
    if raw is None:
        raw = []
    if not isinstance(raw, list):
        raise bad(f"'{where}' must be a list of tools", where)
    tools: list[Tool] = []
    for i, t in enumerate(raw):
        at = f"{where}[{i}]"
        fn = t.get("function") if isinstance(t, dict) and t.get("type", "function") == "function" else None
        if not isinstance(fn, dict):
            raise bad(f'{at} must be {{"type": "function", "function": {{"name", "parameters"}}}}', at)
        tools.append(tool_of(fn, at + ".function"))
    if len({t.name for t in tools}) < len(tools):
        raise bad(f"'{where}' names a function twice", where)
    name: Any = ""
    if choice is None:
        kind = "auto"
    elif choice in ("auto", "none", "required"):
        kind = choice
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        kind, name = "function", choice["function"].get("name")
    elif isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        kind, name = "function", choice.get("name")  # (the Responses API's shape)
    else:
        raise bad(
            '\'tool_choice\' must be auto, none, required or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    if kind in ("required", "function") and not tools:
        raise bad(f"tool_choice {kind!r} needs 'tools'", "tool_choice")
    if kind == "function" and name not in {t.name for t in tools}:
        raise bad(f"tool_choice names the function {name!r}, which is not in '{where}'", "tool_choice")
    return tuple(tools), kind, name or ""


def tool_of(fn: dict, at: str) -> Tool:
    """A function tool ``{"name", "description", "parameters"}`` (Anthropic's ``input_schema``
    too), validated; ``at`` names it in errors."""
    name = fn.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        raise bad(f"{at}.name must be 1-128 letters, digits, _ . : or -, not {name!r}", f"{at}.name")
    key = "input_schema" if "input_schema" in fn and "parameters" not in fn else "parameters"
    params = fn.get(key)
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise bad(f"{at}.{key} must be a JSON Schema object", f"{at}.{key}")
    desc = fn.get("description") or ""
    if not isinstance(desc, str):
        raise bad(f"{at}.description must be a string", f"{at}.description")
    return Tool(name, desc, params)


def tool_calls_of(raw: Any, where: str, i: int = 0) -> tuple[ToolCall, ...]:
    """An assistant message's ``tool_calls`` sent back (``where``: ``messages[i]``): each
    ``{"id", "function": {"name", "arguments"}}``, arguments as JSON text or an object (Ollama's);
    an id made up where there is none. Chat completions and Ollama share it."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise bad(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    out = []
    for j, c in enumerate(raw):
        at = f"{where}.tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad(f'{at} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}', at)
        args = fn.get("arguments")
        if isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False)
        elif args is not None and not isinstance(args, str):
            raise bad(f"{at}.function.arguments must be JSON text or an object", f"{at}.function.arguments")
        cid = c.get("id")
        out.append(ToolCall(cid if isinstance(cid, str) and cid else f"call_{i}_{j}", fn["name"], args or "{}"))
    return tuple(out)


def parse_chat_request(body: Any, defaults: SamplingParams = DEFAULT_SAMPLING) -> ChatRequest:
    """Validate a ``/v1/chat/completions`` body; raise ``APIError`` (400) naming the field.
    ``defaults``: the sampling of a request that names none (``ServeOptions.sampling``)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", "messages")
    system: list[str] = []
    out: list[ChatMessage] = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object", where)
        role = m.get("role")
        if role == "function":
            raise bad(f"{where}: function messages are not supported (send tool messages)", f"{where}.role")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise bad(f"{where}.role must be system, developer, user, assistant or tool, not {role!r}", f"{where}.role")
        text, images = _content(m.get("content"), where, role)
        if role in ("system", "developer"):
            system.append(text)
        elif role == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str) or not cid:
                raise bad(f"{where}.tool_call_id must name the call this is the result of", f"{where}.tool_call_id")
            name = m.get("name") if isinstance(m.get("name"), str) else ""
            out.append(ChatMessage("tool", text, images, i, tool_call_id=cid, name=name or _called(out, cid)))
        else:
            calls = tool_calls_of(m.get("tool_calls"), where, i) if role == "assistant" else ()
            out.append(ChatMessage(role, text, images, i, calls))
    if not out:
        raise bad("'messages' holds no user or assistant message", "messages")
    _unsupported(body)
    tools, choice, tool_name = parse_tools(body.get("tools"), body.get("tool_choice"))
    parallel = body.get("parallel_tool_calls")
    parallel = True if parallel is None else parallel
    if not isinstance(parallel, bool):
        raise bad("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    if integer(body, "n", 1, 1) != 1:
        raise bad("only n = 1 is supported", "n")
    max_tokens = integer(body, "max_completion_tokens", 1) or integer(body, "max_tokens", 1)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop) and len(stop) <= MAX_STOPS:
        stops = tuple(s for s in stop if s)
    else:
        raise bad(f"'stop' must be a string or a list of at most {MAX_STOPS} strings", "stop")
    stream = body.get("stream") or False  # (null: the default)
    if not isinstance(stream, bool):
        raise bad("'stream' must be true or false", "stream")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise bad("'stream_options' must be an object", "stream_options")
    kind, schema = _response_format(body)
    raw_model, raw_ext = body.get("model"), body.get("edgevlm")
    model = raw_model if isinstance(raw_model, str) else ""
    ext = raw_ext if isinstance(raw_ext, dict) else {}
    if ext.get("evict", "off") not in ("off", "summary"):
        raise bad("edgevlm.evict must be off or summary", "edgevlm.evict")
    kwargs = body.get("chat_template_kwargs") or {}
    think = kwargs.get("enable_thinking") if isinstance(kwargs, dict) else None
    return ChatRequest(
        tuple(out),
        "\n\n".join(system) or None,
        model,
        max_tokens,
        sampling_of(body, defaults),
        stops,
        stream,
        bool(opts.get("include_usage")),
        kind,
        schema,
        ext.get("evict") == "summary",
        tools,
        choice,
        tool_name,
        parallel,
        think if isinstance(think, bool) else None,
    )


def sampling_of(body: dict, defaults: SamplingParams, temperature: str = "temperature") -> SamplingParams:
    """``temperature``, ``top_k``, ``top_p``, ``min_p`` and ``seed`` of a body (each API names
    the temperature the same; Ollama's options are a body of their own)."""
    return SamplingParams(
        temperature=number(body, temperature, 0, 2, defaults.temperature),
        top_k=integer(body, "top_k", 0, defaults.top_k),
        top_p=number(body, "top_p", 0, 1, defaults.top_p),
        min_p=number(body, "min_p", 0, 1, defaults.min_p),
        seed=integer(body, "seed", -(2**63)),
    )


def _called(messages: list[ChatMessage], cid: str) -> str:
    """The name of the function call ``cid`` (from the assistant messages before)."""
    for m in reversed(messages):
        for c in m.tool_calls:
            if c.id == cid:
                return c.name
    return ""


# --- replies ---------------------------------------------------------------------------------


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
        "prompt_tokens_details": {"cached_tokens": reply.cached_tokens},
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
    calls, its reasoning."""
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


def error_for(exc: BaseException, retry_after_s: int = RETRY_AFTER_S) -> tuple[int, dict[str, Any], dict[str, str]]:
    """(status, body, headers) for an exception in OpenAI's shape: the error table's
    (``api_errors``); ``retry_after_s``: the server's ``ServeOptions.retry_after_s``."""
    f = failure_of(exc, retry_after_s)
    return f.status, error_body(f.message, f.openai_type, f.param, f.code), dict(f.headers)
