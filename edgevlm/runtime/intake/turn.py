"""A turn as one value: what a caller asks of the model, built once (its pictures and clips made
ready by the one intake, ``runtime.intake``) and then only read — rendered into a prompt and
submitted as the scheduler's ``Request``.

    turn = Turn(conversation, ReplySpec(256, SamplingParams(0.0), stops), system="Be brief.")
    prompt = turn.render(model.render)           # the template, the tools, the thinking switch
    seq = scheduler.submit(turn.reply.request(prompt, new_images=frozenset(prompt.units)), client)

``ReplySpec`` is the reply's part (length, sampling, stops, a reasoning cap, control tokens the
reply shows): a per-request knob is added there once, not in each layer a request crosses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ...backend.sampling import SamplingParams
from ..conversation import Conversation, Message
from ..items import Prompt
from ..requests import Request, ThinkCap

Render = Callable[..., Prompt]  # ``LoadedModel.render``: messages, system, tools, think, tool_required

__all__ = ["ReplySpec", "Turn"]


@dataclass(frozen=True)
class ReplySpec:
    """The reply a turn asks for."""

    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    stops: tuple[str, ...] = ()  # besides the model's end-of-generation tokens
    think: ThinkCap | None = None  # a reasoning budget
    preserve: frozenset[int] = frozenset()  # control tokens whose text the reply shows
    # KV cells kept for the reply (None: the context budget's rule for max_tokens); a reply past
    # them grows into cells nobody reserved (a forced tool call left room to close)
    reserve: int | None = None

    def request(
        self,
        prompt: Prompt,
        *,
        new_images: frozenset[str] = frozenset(),
        t_start: float | None = None,
        counters: Mapping[str, int] | None = None,
        tag: Any = None,
    ) -> Request:
        """The scheduler's request for ``prompt`` with this reply."""
        return Request(
            prompt,
            self.max_tokens,
            self.sampling,
            self.stops,
            reserve=self.reserve,
            new_images=new_images,
            t_start=t_start,
            counters=dict(counters or {}),
            tag=tag,
            preserve=self.preserve,
            think=self.think,
        )


@dataclass(frozen=True)
class Turn:
    """A request made ready: its conversation (pictures numbered, views admitted), the reply,
    the template's switches (system prompt, tools offered, a call required, thinking), whether
    old pictures may give way to summaries (``evict``), each message's place in what the
    client sent, and what the client should be told (``notices``; the server adds to it)."""

    conversation: Conversation
    reply: ReplySpec
    system: str | None = None
    tools: tuple[dict[str, Any], ...] = ()  # offered to the model (OpenAI's shape, for the template)
    tool_required: str | None = None  # "any" or a function's name: said where the template cannot
    think: bool | None = None  # the template's enable_thinking (None: its default)
    evict: bool = False
    places: tuple[int, ...] = ()
    notices: list[str] = field(default_factory=list)

    def render(self, render: Render, messages: list[Message] | None = None, limit: int | None = None) -> Prompt:
        """The prompt of ``messages`` (default: the turn's) as the scheduler sees it, made by
        ``render`` (the loaded model's ``render``); ``limit``: the most cells it may take, a
        longer one refused as soon as its text shows it (``PromptRenderer.render``)."""
        return render(
            self.conversation.messages if messages is None else messages,
            self.system,
            tools=list(self.tools) or None,
            think=self.think,
            tool_required=self.tool_required,
            limit=limit,
        )
