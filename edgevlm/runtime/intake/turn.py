"""A turn as one value: what a caller asks of the model, built once by the intake (``make_turn``:
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

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from ...backend.sampling import SamplingParams
from ...plan.host import Lease
from ...vision.images import LoadedImage
from ..conversation import Conversation, Message, Picture
from ..items import Prompt
from ..requests import Request, ThinkCap

if TYPE_CHECKING:
    from .views import Intake

Render = Callable[..., Prompt]  # ``LoadedModel.render``: messages, system, tools, think, tool_required

__all__ = ["Asked", "ReplySpec", "Turn", "make_turn"]


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

    @property
    def new_views(self) -> tuple[LoadedImage, ...]:
        """The views its last message sends."""
        return tuple(self.messages[-1].images) if self.messages else ()

    def conversation(self) -> Conversation:
        """Its messages and pictures as a conversation of the caller's own: every message and
        picture a copy (the session may rewrite them, token ids may be written in), the views
        shared (they are never changed)."""
        return Conversation(
            [_copy(m) for m in self.messages],
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


def _copy(m: Message) -> Message:
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


def make_turn(
    intake: Intake,
    asked: Iterable[Asked],
    reply: ReplySpec,
    room: int,
    *,
    history: Conversation | None = None,
    full_room: int | None = None,
    system: str | None = None,
    tools: Iterable[Mapping[str, Any]] = (),
    tool_required: str | None = None,
    think: bool | None = None,
    evict: bool = False,
    lease: Lease | None = None,
) -> Turn:
    """The turn of ``asked`` (after ``history``, a conversation kept by the caller: its
    messages and pictures come first, unchanged) with ``reply``: every message's pictures and
    clips made ready and admitted by ``intake``, numbered after the history's. ``room``: the
    image cells the turn's new pictures may take — the last message's (all of them, without
    ``evict``) must fit it; with ``evict`` an earlier message's may give way to a summary later,
    so each is planned as if it were the last, against ``full_room`` (default ``room``). What
    they hold is taken on ``lease``."""
    asked = list(asked)
    messages = [_copy(m) for m in history.messages] if history is not None else []
    pictures = [replace(p) for p in history.pictures] if history is not None else []
    first_new = len(pictures)
    notes: list[str] = []
    notices: list[str] = []
    places: list[int] = [-1] * len(messages)  # (the history's messages are the caller's own)
    left = room
    for i, a in enumerate(asked):
        bound = i == len(asked) - 1 or not evict
        made, used = intake.message(
            list(a.media),
            left if bound else (room if full_room is None else full_room),
            first=len(pictures) + 1,
            lease=lease,
        )
        if bound:
            left -= used
        views: list[LoadedImage] = []
        labels: list[str | None] = []
        numbers: list[int] = []
        for v in made:
            notes += v.notes
            notices += v.notices
            pictures.append(v.picture(len(pictures) + 1))
            views += v.views
            labels += v.labels
            numbers += [len(pictures)] * len(v.views)
        messages.append(
            Message(
                a.role,
                a.text,
                views,
                tokens=None if a.tokens is None else list(a.tokens),
                labels=labels,
                sources=[v.name for v in made],
                pictures=numbers,
                tool_calls=[dict(c) for c in a.tool_calls],
                tool_call_id=a.tool_call_id,
                name=a.name,
            )
        )
        places.append(a.place)
    return Turn(
        tuple(messages),
        tuple(pictures),
        reply,
        system,
        tuple(tools),
        tool_required,
        think,
        evict,
        tuple(places),
        tuple(notes),
        tuple(notices),
        len(pictures) - first_new,
    )
