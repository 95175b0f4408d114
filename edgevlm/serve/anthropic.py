"""Anthropic's Messages API (``POST /v1/messages``) as data: a request body → ``ChatRequest``
(validated, a 400 naming the field that is wrong), and the API key's header. The replies'
bodies, events and errors are ``anthropic_reply``'s.

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
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ..backend.sampling import SamplingParams
from ..errors import shown
from . import openai
from .request import (
    DEFAULT_SAMPLING,
    ChatMessage,
    ChatRequest,
    ImageRef,
    Tool,
    ToolCall,
    bad,
    integer,
    number,
)

__all__ = [
    "api_key",
    "parse_messages_request",
    "from_tool_use_id",
    "tool_use_id",
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


def _text(block: dict[str, Any], at: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise bad(f"{at}.text must be a string", f"{at}.text")
    return text


def _image(block: dict[str, Any], at: str) -> ImageRef:
    src = block.get("source")
    kind = src.get("type") if isinstance(src, dict) else None
    if kind == "base64":
        assert isinstance(src, dict)
        mime, data = src.get("media_type"), src.get("data")
        if mime not in IMAGE_TYPES:
            raise bad(f"{at}.source.media_type must be one of {', '.join(IMAGE_TYPES)}, not {shown(mime)}", at)
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
        f" (a file id is not supported), not type {shown(kind)}",
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
            raise bad(f"{where}: a tool result holds text and image blocks, not {shown(kind)}", where)
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
            raise bad(f"{at}: a user message holds text, image and tool_result blocks, not {shown(kind)}", at)
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
            raise bad(f"{at}: an assistant message holds text, tool_use and thinking blocks, not {shown(kind)}", at)
    return ChatMessage("assistant", "".join(texts), (), i, tuple(calls))


def _system(raw: Any) -> str | None:
    if raw is None:
        return None
    texts = []
    for j, block in enumerate(_blocks(raw, "system")):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind != "text":
            raise bad(f"system[{j}] must be a text block, not {shown(kind)}", f"system[{j}]")
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
            raise bad(f"{at}: server tools ({shown(t.get('type'))}) are not supported; give name and input_schema", at)
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
        raise bad(f"tool_choice {shown(kind)} needs 'tools'", "tool_choice")
    if kind == "tool" and name not in {t.name for t in tools}:
        raise bad(f"tool_choice names the tool {shown(name)}, which is not in 'tools'", "tool_choice.name")
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


def _output_format(body: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
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
            raise bad(f"{where}.role must be user or assistant, not {shown(role)}", f"{where}.role")
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
        schema_at="output_config.format.schema",
        tools=tools,
        tool_choice=choice,
        tool_name=tool_name,
        parallel_tool_calls=parallel,
        think=think,
        think_budget=think_budget,
    )


# --- replies ---------------------------------------------------------------------------------


def tool_use_id(cid: str) -> str:
    """A tool call's id as Anthropic writes them (``toolu_…``; the other APIs' ``call_…``)."""
    return "toolu_" + cid[5:] if cid.startswith("call_") else cid


def from_tool_use_id(cid: str) -> str:
    """An id sent back in Anthropic's form, as the prompt held it (``call_…``)."""
    return "call_" + cid[6:] if cid.startswith("toolu_") else cid


# --- errors ----------------------------------------------------------------------------------
