"""A turn as one value: what a caller asks of the model, built once by the intake (``Intake.turn``:
its messages' pictures and clips made ready, budgeted and guarded) and then only read —
rendered into a prompt and submitted as the scheduler's ``Request`` (``ReplySpec.request``,
the one place a ``Request`` is made).

    asked = [Asked("user", "What is it?", (MediaRef("photo.jpg"),))]
    turn = intake.turn(asked, ReplySpec(256, SamplingParams(0.0), stops), room, system="Be brief.")
    conv = turn.conversation()                   # a copy of its own for whoever changes it (the session)
    prompt = turn.render(model.render, conv.messages)
    seq = scheduler.submit(turn.reply.request(prompt, new_images=frozenset(prompt.units)), client)

Every caller builds its turn here — chat's one-shot and REPL and the library (``Engine``), the
server (``ChatService``), captioning and batch files — so a picture sent through any of them
becomes the same views, is named the same, and costs the same. A ``Turn`` is frozen, its
collections are tuples, and nothing outside the intake changes the messages it holds
(``tests/test_one_turn.py`` reads every module for that): what a caller changes per request
(the session's summaries and dropped turns, token ids written into assistant messages, notices
added while it runs) lives in an object of its own — ``conversation()``'s copy, the server's
``Job.progress``.

``ReplySpec`` is the reply's part (length, sampling, stops, a reasoning cap, control tokens the
reply shows): a per-request knob is added there once, not in each layer a request crosses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ...backend.sampling import SamplingParams
from ...vision.images import LoadedImage
from ..conversation import Conversation, Message, Picture
from ..items import Prompt
from ..requests import Request, ThinkCap

Render = Callable[..., Prompt]  # ``LoadedModel.render``: messages, system, tools, think, tool_required

__all__ = ["Asked", "ReplySpec", "Turn", "copy_message"]


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
            counters={"audio_tokens": prompt.audio_cells(new_images), **(counters or {})},
            tag=tag,
            preserve=self.preserve,
            think=self.think,
        )


@dataclass(frozen=True)
class Asked:
    """A message as a caller sends it, before its pictures and clips are made ready: its role and
    text, its media (sources — ``MediaRef``, a decoded ``LoadedImage`` — or ``Views`` the intake
    made already, as captioning's prefetch does), tool calls and results, and its place in what
    the client sent."""

    role: str
    text: str
    media: tuple[Any, ...] = ()  # MediaRef | LoadedImage | Views (see ``Intake.message``)
    tool_calls: tuple[Mapping[str, Any], ...] = ()  # assistant: {"id", "name", "arguments": dict}
    tool_call_id: str = ""  # tool: the call this is the result of
    name: str = ""  # tool: the function's name
    tokens: tuple[int, ...] | None = None  # assistant: the exact ids generated (chat's own history)
    place: int = 0


@dataclass(frozen=True)
class Turn:
    """A request made ready: its messages (pictures numbered, views admitted) and pictures, the
    reply, the template's switches (system prompt, tools offered, a call required, thinking),
    whether old pictures may give way to summaries (``evict``), each message's place in what
    the client sent, what the client should be told (``notes``, ``notices``), and how many
    pictures it added after the history (``added``). Frozen: ``conversation()`` gives a copy to
    change."""

    messages: tuple[Message, ...]
    pictures: tuple[Picture, ...]
    reply: ReplySpec
    system: str | None = None
    tools: tuple[Mapping[str, Any], ...] = ()  # offered to the model (OpenAI's shape, for the template)
    tool_required: str | None = None  # "any" or a function's name: said where the template cannot
    think: bool | None = None  # the template's enable_thinking (None: its default)
    evict: bool = False
    places: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()  # what the intake did to its new pictures (resized, tiles, frames)
    notices: tuple[str, ...] = ()  # what the guard did (a view shrunk)
    added: int = 0
    # the seconds each recording of its new messages lasts, in order (decoded to its end, or as its
    # header says where the budget stopped decoding; None: not known)
    heard: tuple[float | None, ...] = ()

    @property
    def new_views(self) -> tuple[LoadedImage, ...]:
        """The views its last message sends."""
        return tuple(self.messages[-1].images) if self.messages else ()

    def conversation(self) -> Conversation:
        """Its messages and pictures as a conversation of the caller's own: every message and
        picture a copy (the session may rewrite them, token ids may be written in), the views
        shared (they are never changed)."""
        return Conversation(
            [copy_message(m) for m in self.messages],
            [replace(p) for p in self.pictures],
        )

    def without_views(self) -> Turn:
        """The same turn once its prompt is rendered: the views' pixels dropped (the prompt holds
        what it needs), the rest kept."""
        return replace(self, messages=(), pictures=())

    def render(self, render: Render, messages: Sequence[Message] | None = None, limit: int | None = None) -> Prompt:
        """The prompt of ``messages`` (default: the turn's) as the scheduler sees it, made by
        ``render`` (the loaded model's ``render``); ``limit``: the most cells it may take, a
        longer one refused as soon as its text shows it (``PromptRenderer.render``)."""
        return render(
            list(self.messages if messages is None else messages),
            self.system,
            tools=[dict(t) for t in self.tools] or None,
            think=self.think,
            tool_required=self.tool_required,
            limit=limit,
        )


def copy_message(m: Message) -> Message:
    """A copy of ``m`` whose lists are its own (the views themselves are shared: never changed)."""
    return replace(
        m,
        images=list(m.images),
        tokens=None if m.tokens is None else list(m.tokens),
        labels=list(m.labels),
        sources=list(m.sources),
        pictures=list(m.pictures),
        notes=list(m.notes),
        tool_calls=[dict(c) for c in m.tool_calls],
    )
