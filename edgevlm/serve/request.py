"""The one request model every API route shares, and the one reply it gets.

Each API module (``openai``: chat completions, ``responses``, ``anthropic``, ``ollama``) turns
its body into a ``ChatRequest`` — validated, one clear message naming the field that is wrong,
raised as ``api_errors.APIError`` — and a ``Reply`` (or the stream of ``Delta``s before it) into its own
body and events. Admission, budgeting, the guard, tool calls and reasoning happen once, in
``service.ChatService``, for all of them.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
from dataclasses import dataclass, field
from typing import Any, overload

from ..backend.sampling import SERVE_REPLY, SamplingParams
from ..errors import shown
from ..runtime.stats import TurnStats
from ..runtime.toolformat import partial_object
from .api_errors import APIError

__all__ = [
    "AUDIO_FORMATS",
    "ChatMessage",
    "ChatRequest",
    "DEFAULT_SAMPLING",
    "Delta",
    "ImageRef",
    "Reply",
    "Tool",
    "ToolCall",
    "audio_ref",
    "audio_uri",
    "bad",
    "integer",
    "new_id",
    "number",
]

DEFAULT_SAMPLING = SERVE_REPLY.sampling  # as llama-server when a request names none (--temp ... change it)


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 for what the client sent, naming the field."""
    return APIError(message, param, code)


def number(body: dict[str, Any], key: str, lo: float, hi: float, default: float) -> float:
    """``body[key]``: a number from ``lo`` to ``hi`` (``default`` when absent), else a 400."""
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise bad(f"'{key}' must be a number from {lo:g} to {hi:g}, not {shown(v)}", key)
    return float(v)


@overload
def integer(body: dict[str, Any], key: str, lo: int, default: int) -> int: ...
@overload
def integer(body: dict[str, Any], key: str, lo: int, default: None = None) -> int | None: ...


def integer(body: dict[str, Any], key: str, lo: int, default: int | None = None) -> int | None:
    """``body[key]``: an integer of at least ``lo`` (``default`` when absent), else a 400."""
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise bad(f"'{key}' must be an integer of at least {lo}, not {shown(v)}", key)
    return v


def new_id(prefix: str = "chatcmpl-") -> str:
    return prefix + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ImageRef:
    url: str  # a data: URI, an http(s) URL, or a path under --allow-path
    detail: str = "auto"  # auto | low | high
    name: str = ""  # edgevlm extension: the picture's file name, for summaries that mention it
    kind: str = "image"  # image | video (a clip: frames chosen under the room left) | audio (a recording)


# ``input_audio.format``s taken (OpenAI documents wav and mp3; PyAV decodes these too), and the
# type their data: URI says (the intake tells a recording by its content, not by this)
AUDIO_FORMATS = {
    "wav": "audio/wav",
    "mp3": "audio/mpeg",
    "flac": "audio/flac",
    "ogg": "audio/ogg",
    "opus": "audio/ogg",
    "m4a": "audio/mp4",
    "aac": "audio/aac",
    "webm": "audio/webm",
}


def audio_ref(part: dict[str, Any], at: str, role: str) -> ImageRef:
    """An ``input_audio`` part (OpenAI's chat and Responses share the shape: ``{"type":
    "input_audio", "input_audio": {"data": <base64>, "format": "wav" | "mp3" ...}}``) → a
    recording's ``ImageRef`` (a ``data:`` URI of kind audio); ``at`` names the part in errors.
    Only user messages carry audio."""
    if role != "user":
        raise bad(f"{at}: only user messages may carry audio", at)
    name = part.get("name")
    name = name[:200] if isinstance(name, str) else ""
    return ImageRef(audio_uri(part.get("input_audio"), f"{at}.input_audio"), "auto", name, "audio")


def audio_uri(inner: Any, at: str) -> str:
    """``{"data": <base64>, "format": ...}`` (``at`` names it in errors) → its ``data:`` URI. The
    base64 is checked here, so bad data is a 400 naming the field before anything is queued."""
    if not isinstance(inner, dict):
        raise bad(f'{at} must be {{"data": <base64>, "format": "wav" | "mp3"}}', at)
    data, fmt = inner.get("data"), inner.get("format")
    if fmt not in AUDIO_FORMATS:
        raise bad(f"{at}.format must be one of {', '.join(AUDIO_FORMATS)}, not {shown(fmt)}", f"{at}.format")
    if not isinstance(data, str) or not data:
        raise bad(f"{at}.data must be the recording as a base64 string", f"{at}.data")
    try:
        base64.b64decode(data, validate=True)  # (no data: prefix, as OpenAI's)
    except (binascii.Error, ValueError):
        raise bad(f"{at}.data is not valid base64", f"{at}.data") from None
    return f"data:{AUDIO_FORMATS[fmt]};base64,{data}"


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, and a JSON Schema of its arguments."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})
    schema_at: str = field(default="parameters", compare=False)  # where the body said it (errors name it)

    def to_template(self) -> dict[str, Any]:
        """As chat templates read ``tools`` (OpenAI's shape, which HF templates expect)."""
        fn: dict[str, Any] = {"name": self.name, "parameters": self.parameters}
        if self.description:
            fn["description"] = self.description
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolCall:
    """A call the model made (or an earlier one the client sends back)."""

    id: str
    name: str
    arguments: str  # a JSON object, as text (OpenAI's convention; other APIs parse it)
    # the reply was cut off (max_tokens) inside this call: ``arguments`` is the JSON text as far
    # as it was generated (OpenAI's chat shows it so; Responses marks the item incomplete)
    partial: bool = False

    @property
    def args(self) -> dict[str, Any]:
        """The arguments parsed (an object; {} when they are not one; cut off: what they hold
        so far, ``toolformat.partial_object``)."""
        if self.partial:
            return partial_object(self.arguments)
        try:
            v = json.loads(self.arguments or "{}")
        except ValueError:
            return {}
        return v if isinstance(v, dict) else {}


@dataclass(frozen=True)
class ChatMessage:
    role: str  # user | assistant | tool
    text: str
    images: tuple[ImageRef, ...] = ()
    index: int = 0  # its place in the request's message list (for errors and edgevlm.dropped)
    tool_calls: tuple[ToolCall, ...] = ()  # assistant: the calls it made
    tool_call_id: str = ""  # tool: the call this is the result of
    name: str = ""  # tool: the function's name (when the client gives it)


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
    json_schema: dict[str, Any] | None = None
    evict: bool = False  # edgevlm extension: old pictures may become summaries to make room
    tools: tuple[Tool, ...] = ()
    tool_choice: str = "auto"  # auto | none | required | function (then tool_name)
    tool_name: str = ""
    parallel_tool_calls: bool = True
    think: bool | None = None  # reasoning on/off where the template has a switch (None: its default)
    think_budget: int | None = None  # most reasoning tokens (None: the server's --reasoning-budget)
    schema_at: str = "response_format.json_schema.schema"  # where the body gave json_schema (errors name it)

    @property
    def images(self) -> list[ImageRef]:
        return [im for m in self.messages for im in m.images]

    @property
    def offered_tools(self) -> tuple[Tool, ...]:
        """The tools the model is told about (none with tool_choice "none")."""
        return () if self.tool_choice == "none" else self.tools


@dataclass(frozen=True)
class Delta:
    """A piece of a streamed reply: answer text, reasoning text, or a whole tool call."""

    kind: str  # text | reasoning | tool_call
    text: str = ""
    call: ToolCall | None = None
    index: int = 0  # tool_call: its place among the reply's calls


@dataclass(frozen=True)
class Reply:
    """A finished reply, in no API's shape yet."""

    id: str
    created: int
    model: str
    text: str  # the answer (without reasoning and tool-call markup)
    finish: str  # stop | length | tool_calls | context (short of max_tokens: the context ran out; a notice says so)
    stats: TurnStats  # prompt_n, cached_n, predicted_n, timings
    reasoning: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    extension: dict[str, Any] = field(default_factory=dict)  # the edgevlm object (notices ...)
    raw: str = ""  # the text as generated (tool-call markup and reasoning included)

    @property
    def prompt_tokens(self) -> int:
        return int(self.stats.prompt_n + self.stats.cached_n)

    @property
    def cached_tokens(self) -> int:
        return int(self.stats.cached_n)

    @property
    def completion_tokens(self) -> int:
        return int(self.stats.predicted_n)
