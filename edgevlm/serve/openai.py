"""OpenAI's chat-completions API as data: a request body → ``ChatRequest`` (validated, one clear
message naming the field that is wrong); ``openai_reply`` shapes the replies and errors.

Pure functions, no I/O: the server and batch files (``/v1/chat/completions`` lines) share them.
Fields clients send that do not change what edgevlm does (``user``, ``presence_penalty``,
``metadata`` ...) are accepted and ignored; fields that would change the answer and are not
supported (``logprobs: true``, the deprecated ``functions``) are a 400, so a client is told
instead of getting something else. Tools: ``tools``, ``tool_choice`` (auto, none, required, a
named function — the last two enforced by a grammar), ``parallel_tool_calls``, assistant
``tool_calls`` and ``tool`` messages (whose content may hold pictures) sent back; replies carry
``tool_calls`` and ``reasoning_content`` (a thinking model's ``<think>`` text;
``chat_template_kwargs.enable_thinking`` switches it where the template can).
Audio: ``input_audio`` parts (``{"data": <base64>, "format": "wav" | "mp3"}``, also flac, ogg,
opus, m4a, aac, webm) on user messages, a recording each (``request.audio_ref``).
Extensions (other servers ignore them):
an image part's ``name``, and ``"edgevlm": {"evict": "summary"}`` — when the conversation no
longer fits, its oldest pictures become the model's summaries and the reply says which
(``edgevlm.summaries``), as ``edgevlm chat`` does.
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..backend.sampling import SamplingParams
from ..errors import shown
from .request import (
    DEFAULT_SAMPLING,
    ChatMessage,
    ChatRequest,
    ImageRef,
    Tool,
    ToolCall,
    audio_ref,
    bad,
    integer,
    number,
)

__all__ = [
    "parse_chat_request",
    "parse_tools",
    "tool_calls_of",
    "tool_of",
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
        elif kind == "input_audio":
            images.append(audio_ref(part, at, role))
        else:
            raise bad(
                f"{at}: content part type {shown(kind)} is not supported (text, image_url, video_url and "
                "input_audio are)",
                at,
            )
    return "\n".join(texts), tuple(images)


def _response_format(body: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
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
    raise bad(
        f"response_format.type must be text, json_object or json_schema, not {shown(kind)}", "response_format.type"
    )


def _unsupported(body: dict[str, Any]) -> None:
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
        raise bad(f"tool_choice {shown(kind)} needs 'tools'", "tool_choice")
    if kind == "function" and name not in {t.name for t in tools}:
        raise bad(f"tool_choice names the function {shown(name)}, which is not in '{where}'", "tool_choice")
    return tuple(tools), kind, name or ""


def tool_of(fn: dict[str, Any], at: str) -> Tool:
    """A function tool ``{"name", "description", "parameters"}`` (Anthropic's ``input_schema``
    too), validated; ``at`` names it in errors."""
    name = fn.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        raise bad(f"{at}.name must be 1-128 letters, digits, _ . : or -, not {shown(name)}", f"{at}.name")
    key = "input_schema" if "input_schema" in fn and "parameters" not in fn else "parameters"
    params = fn.get(key)
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise bad(f"{at}.{key} must be a JSON Schema object", f"{at}.{key}")
    desc = fn.get("description") or ""
    if not isinstance(desc, str):
        raise bad(f"{at}.description must be a string", f"{at}.description")
    return Tool(name, desc, params, f"{at}.{key}")


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
            raise bad(
                f"{where}.role must be system, developer, user, assistant or tool, not {shown(role)}", f"{where}.role"
            )
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


def sampling_of(body: dict[str, Any], defaults: SamplingParams, temperature: str = "temperature") -> SamplingParams:
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
