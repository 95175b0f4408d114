"""OpenAI's Responses API (``POST /v1/responses``) as data: a request body → ``ChatRequest``
(validated, one clear message naming the field that is wrong), an earlier response's
conversation read from the store (``responses_store``: the responses kept for
``previous_response_id`` and ``GET /v1/responses/{id}``); ``responses_reply`` shapes the
replies: the ``response`` object and the streaming events.

Input: a string, or items — messages (user, assistant, system, developer; ``input_text``,
``input_image`` with a URL or data URI, ``input_audio`` — base64 and its format, as chat's —
``output_text``), ``function_call`` items (consecutive
ones are one assistant turn's calls), ``function_call_output`` items (text or parts with
pictures: the tool's result) and ``reasoning`` items (dropped: the model reasons afresh).
``instructions`` is the system prompt; ``text.format`` asks for JSON (object or schema, by
grammar); ``tools`` are function tools (flat: ``{"type": "function", "name", "parameters"}``),
other tool types are a 400. ``reasoning.effort`` "none" or "minimal" switches a thinking
template's reasoning off, any other effort on. ``truncation: "auto"``: when the conversation no
longer fits, its oldest pictures become the model's summaries (edgevlm's ``evict``).

Fields clients send that do not change the answer (``user``, ``metadata``, ``include``,
``prompt_cache_key``, ``service_tier`` ...) are accepted and ignored; fields that would change it
and are not supported (``background``, ``conversation``, ``prompt``, logprobs) are a 400.
Pure functions, no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from ..backend.sampling import SamplingParams
from ..errors import shown
from .api_errors import NotFound
from .openai import parse_tools, sampling_of, tool_of
from .request import (
    DEFAULT_SAMPLING,
    ChatMessage,
    ChatRequest,
    ImageRef,
    ToolCall,
    audio_ref,
    bad,
    integer,
    new_id,
)
from .responses_store import ResponseStore, Stored

__all__ = [
    "ResponsesCall",
    "parse_responses_request",
]

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
DETAILS = {"auto": "auto", "low": "low", "high": "high", "original": "high"}
ROLES = ("user", "assistant", "system", "developer")


# --- the request ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ResponsesCall:
    """A parsed ``/v1/responses`` body: the request the service runs, the whole conversation
    (an earlier response's, then this input) to keep with its reply, and what the ``response``
    object echoes."""

    request: ChatRequest
    id: str
    messages: tuple[ChatMessage, ...]  # the conversation, as stored (the reply is added to it)
    system: tuple[str, ...]  # system and developer messages (not ``instructions``: they do not carry over)
    store: bool = True
    instructions: str | None = None
    previous_id: str | None = None
    max_tool_calls: int | None = None
    echo: dict[str, Any] = field(default_factory=dict)  # tools, tool_choice, text, reasoning ...


def parse_responses_request(
    body: Any, defaults: SamplingParams = DEFAULT_SAMPLING, store: ResponseStore | None = None
) -> ResponsesCall:
    """Validate a ``/v1/responses`` body; raise ``APIError`` (400) naming the field, a 404 for a
    ``previous_response_id`` not in ``store``. ``defaults``: the sampling of a request that names
    none (``ServeOptions.sampling``)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    _unsupported(body)
    prev_id = body.get("previous_response_id")
    prior: Stored | None = None
    if prev_id is not None:
        if not isinstance(prev_id, str) or not prev_id:
            raise bad("'previous_response_id' must be a response's id", "previous_response_id")
        prior = store.get(prev_id) if store is not None else None
        if prior is None:
            raise NotFound(
                f"previous response not found: {shown(prev_id)} (this server keeps its latest responses for a "
                "while, in memory, unless they were created with store: false)",
                "previous_response_id",
                "previous_response_not_found",
            )
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("'instructions' must be a string", "instructions")
    history = prior.messages if prior is not None else ()
    new, system = _input(body.get("input"), history)
    messages = history + tuple(new)
    if not messages:
        raise bad("'input' holds no user, assistant or tool message", "input")
    system_parts = (prior.system if prior is not None else ()) + tuple(system)
    tools, tool_echo = _tools(body.get("tools"))
    choice_raw = body.get("tool_choice")
    if isinstance(choice_raw, dict) and choice_raw.get("type") != "function":
        raise bad(
            f"tool_choice type {shown(choice_raw.get('type'))} is not supported (auto, none, required or "
            '{"type": "function", "name": ...})',
            "tool_choice",
            "unsupported_parameter",
        )
    tool_list, choice, tool_name = parse_tools(tools, choice_raw)
    tool_list = tuple(replace(t, schema_at=f"tools[{i}].parameters") for i, t in enumerate(tool_list))  # (flat)
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise bad("'parallel_tool_calls' must be true or false", "parallel_tool_calls")
    max_calls = integer(body, "max_tool_calls", 1)
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad("'stream' must be true or false", "stream")
    keep = body.get("store", True)
    if keep is None:
        keep = True
    if not isinstance(keep, bool):
        raise bad("'store' must be true or false", "store")
    kind, schema, text_echo = _text(body.get("text"))
    effort, reasoning_echo = _reasoning(body.get("reasoning"))
    truncation = body.get("truncation") or "disabled"
    if truncation not in ("auto", "disabled"):
        raise bad(f"'truncation' must be auto or disabled, not {shown(truncation)}", "truncation")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise bad("'metadata' must be an object of strings", "metadata")
    user = body.get("user")
    raw_model = body.get("model")
    request = ChatRequest(
        messages,
        system="\n\n".join(([instructions] if instructions else []) + list(system_parts)) or None,
        model=raw_model if isinstance(raw_model, str) else "",
        max_tokens=integer(body, "max_output_tokens", 1),
        sampling=sampling_of(body, defaults),
        stream=stream,
        include_usage=True,
        response_format=kind,
        json_schema=schema,
        schema_at="text.format.schema",
        evict=truncation == "auto",
        tools=tool_list,
        tool_choice=choice,
        tool_name=tool_name,
        parallel_tool_calls=parallel and max_calls != 1,
        think=None if effort is None else effort not in ("none", "minimal"),
    )
    echo = {
        "tools": tool_echo,
        "tool_choice": {"type": "function", "name": tool_name} if choice == "function" else choice,
        "text": text_echo,
        "reasoning": reasoning_echo,
        "truncation": truncation,
        "metadata": metadata or {},
        "user": user if isinstance(user, str) else None,
    }
    return ResponsesCall(
        request,
        new_id("resp_"),
        messages,
        system_parts,
        keep,
        instructions,
        prev_id,
        max_calls,
        echo,
    )


def _unsupported(body: dict[str, Any]) -> None:
    """Refuse what would change the answer and is not supported."""
    if body.get("background"):
        raise bad("'background' responses are not supported by this server", "background", "unsupported_parameter")
    if body.get("conversation") is not None:
        raise bad(
            "'conversation' is not supported by this server: chain responses with 'previous_response_id'",
            "conversation",
            "unsupported_parameter",
        )
    if body.get("prompt") is not None:
        raise bad("'prompt' (stored prompt templates) is not supported here", "prompt", "unsupported_parameter")
    if body.get("top_logprobs"):
        raise bad("'top_logprobs' is not supported by this server yet", "top_logprobs", "unsupported_parameter")
    include = body.get("include")
    if include is not None and (not isinstance(include, list) or not all(isinstance(s, str) for s in include)):
        raise bad("'include' must be a list of strings", "include")
    if include and "message.output_text.logprobs" in include:
        raise bad("logprobs are not supported by this server yet", "include", "unsupported_parameter")


def _input(raw: Any, prior: tuple[ChatMessage, ...]) -> tuple[list[ChatMessage], list[str]]:
    """``input``: a string (one user message) or a list of items → the messages it adds to
    ``prior`` (numbered on from it) and its system and developer messages."""
    if isinstance(raw, str):
        return [ChatMessage("user", raw, (), len(prior))], []
    if not isinstance(raw, list) or not raw:
        raise bad("'input' must be a string or a non-empty list of items", "input")
    out: list[ChatMessage] = []
    system: list[str] = []
    calls_open = False  # the last message is an assistant turn function_call items may join
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(f"{where} must be an object", where)
        kind = item.get("type", "message")
        at = len(prior) + len(out)
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad(
                    f"{where}.role must be user, assistant, system or developer, not {shown(role)}", f"{where}.role"
                )
            text, images = _content(item.get("content"), where, role)
            if role in ("system", "developer"):
                system.append(text)
                continue
            out.append(ChatMessage(role, text, images, at))
            calls_open = role == "assistant"
        elif kind == "function_call":
            call = _call(item, where)
            if calls_open and out and out[-1].role == "assistant":
                out[-1] = replace(out[-1], tool_calls=out[-1].tool_calls + (call,))
            else:
                out.append(ChatMessage("assistant", "", (), at, (call,)))
                calls_open = True
        elif kind == "function_call_output":
            cid = item.get("call_id")
            if not isinstance(cid, str) or not cid:
                raise bad(f"{where}.call_id must name the call this is the output of", f"{where}.call_id")
            text, images = _content(item.get("output"), where, "tool", "output")
            name = item.get("name") if isinstance(item.get("name"), str) else ""
            out.append(ChatMessage("tool", text, images, at, tool_call_id=cid, name=name or _called(prior, out, cid)))
            calls_open = False
        elif kind == "reasoning":
            continue  # the model's earlier reasoning: not shown to it again (as chat templates do)
        else:
            raise bad(
                f"{where}: input item type {shown(kind)} is not supported (message, function_call, "
                "function_call_output and reasoning are)",
                f"{where}.type",
                "unsupported_parameter",
            )
    return out, system


def _content(raw: Any, where: str, role: str, key: str = "content") -> tuple[str, tuple[ImageRef, ...]]:
    """A message's ``content`` (or a tool output's ``output``): a string, or a list of parts."""
    if raw is None:
        return "", ()
    if isinstance(raw, str):
        return raw, ()
    if not isinstance(raw, list):
        raise bad(f"{where}.{key} must be a string or a list of parts", f"{where}.{key}")
    texts: list[str] = []
    images: list[ImageRef] = []
    for j, part in enumerate(raw):
        at = f"{where}.{key}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text", "refusal"):
            text = part.get("refusal" if kind == "refusal" else "text")
            if not isinstance(text, str):
                raise bad(f"{at}.text must be a string", at)
            texts.append(text)
        elif kind == "input_image":
            if role not in ("user", "tool"):
                raise bad(f"{at}: only user messages and function call outputs may carry images", at)
            url = part.get("image_url")
            if isinstance(url, dict):  # (the chat-completions shape, sent here by mistake or habit)
                url = url.get("url")
            if part.get("file_id") and not url:
                raise bad(f"{at}.file_id: files are not supported; send image_url (a URL or a data URI)", at)
            if not isinstance(url, str) or not url:
                raise bad(f"{at}.image_url must be a URL or a data URI", f"{at}.image_url")
            detail = part.get("detail") or "auto"
            if detail not in DETAILS:
                raise bad(f"{at}.detail must be auto, low, high or original, not {shown(detail)}", f"{at}.detail")
            name = part.get("name") if isinstance(part.get("name"), str) else ""
            images.append(ImageRef(url, DETAILS[detail], name[:200]))
        elif kind == "input_audio":
            images.append(audio_ref(part, at, role))
        else:
            raise bad(
                f"{at}: content part type {shown(kind)} is not supported (input_text, input_image and input_audio are)",
                f"{at}.type",
                "unsupported_parameter",
            )
    return "\n".join(texts), tuple(images)


def _call(item: dict[str, Any], where: str) -> ToolCall:
    cid, name, args = item.get("call_id"), item.get("name"), item.get("arguments", "{}")
    if not isinstance(cid, str) or not cid:
        raise bad(f"{where}.call_id must be a string", f"{where}.call_id")
    if not isinstance(name, str) or not name:
        raise bad(f"{where}.name must be the function's name", f"{where}.name")
    if not isinstance(args, str):
        args = json.dumps(args, ensure_ascii=False)
    return ToolCall(cid, name, args)


def _called(prior: tuple[ChatMessage, ...], new: list[ChatMessage], cid: str) -> str:
    """The name of the function call ``cid`` (from the assistant turns before)."""
    for m in (*reversed(new), *reversed(prior)):
        for c in m.tool_calls:
            if c.id == cid:
                return c.name
    return ""


def _tools(raw: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Responses' flat function tools → (chat completions' shape for ``parse_tools``, the echo)."""
    if raw is None:
        return [], []
    if not isinstance(raw, list):
        raise bad("'tools' must be a list of tools", "tools")
    nested, echo = [], []
    for i, t in enumerate(raw):
        at = f"tools[{i}]"
        if not isinstance(t, dict):
            raise bad(f'{at} must be {{"type": "function", "name", "parameters"}}', at)
        if t.get("type") != "function":
            raise bad(
                f"{at}: tool type {shown(t.get('type'))} is not supported by this server (function tools are)",
                f"{at}.type",
                "unsupported_parameter",
            )
        tool = tool_of(t, at)
        strict = t.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad(f"{at}.strict must be true or false", f"{at}.strict")
        nested.append(tool.to_template())
        echo.append(
            {
                "type": "function",
                "name": tool.name,
                "description": tool.description or None,
                "parameters": tool.parameters,
                "strict": strict,
            }
        )
    return nested, echo


def _text(raw: Any) -> tuple[str, dict[str, Any] | None, dict[str, Any]]:
    """``text.format`` → (response format, JSON schema, the echo)."""
    if raw is None:
        return "text", None, {"format": {"type": "text"}}
    if not isinstance(raw, dict):
        raise bad("'text' must be an object", "text")
    verbosity = raw.get("verbosity")
    if verbosity is not None and verbosity not in ("low", "medium", "high"):
        raise bad(f"text.verbosity must be low, medium or high, not {shown(verbosity)}", "text.verbosity")
    fmt = raw.get("format")
    echo: dict[str, Any] = {"verbosity": verbosity} if verbosity else {}
    if fmt is None:
        return "text", None, {"format": {"type": "text"}, **echo}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return kind, None, {"format": {"type": kind}, **echo}
    if kind == "json_schema":
        assert isinstance(fmt, dict)
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise bad("text.format.schema must be a JSON Schema object", "text.format.schema")
        name = fmt.get("name") or "response"
        if not isinstance(name, str):
            raise bad("text.format.name must be a string", "text.format.name")
        strict = fmt.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad("text.format.strict must be true or false", "text.format.strict")
        out = {"type": "json_schema", "name": name, "schema": schema, "strict": strict}
        if isinstance(fmt.get("description"), str):
            out["description"] = fmt["description"]
        return "json_schema", schema, {"format": out, **echo}
    raise bad(f"text.format.type must be text, json_object or json_schema, not {shown(kind)}", "text.format.type")


def _reasoning(raw: Any) -> tuple[str | None, dict[str, Any]]:
    """``reasoning`` → (its effort, the echo)."""
    if raw is None:
        return None, {"effort": None, "summary": None}
    if not isinstance(raw, dict):
        raise bad("'reasoning' must be an object", "reasoning")
    effort = raw.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise bad(f"reasoning.effort must be one of {', '.join(EFFORTS)}, not {shown(effort)}", "reasoning.effort")
    summary = raw.get("summary")
    return effort, {"effort": effort, "summary": summary if isinstance(summary, str) else None}
