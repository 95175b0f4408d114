"""One conversation with images over a loaded model: the API behind ``edgevlm chat`` and the
conversations of ``edgevlm.load()`` (``LoadedModel.conversation()``).

Every turn renders the whole conversation with the model's template and submits it to the
scheduler, whose prefix matching evaluates only what the KV cache does not hold yet: a
follow-up turn costs just the tokens it adds. Pictures are budgeted before the encoder runs
(resized, tiled), checked by the guard against the memory free now and the context budget, and
encoded once (the scheduler's image cache is keyed by content), so a picture seen before — in
this conversation, after ``reset()``, or in a new one — is not encoded again. When the context
fills, the session policy replaces old pictures by the model's own summaries.

Options are given at construction (``EngineOptions``); nothing is configured afterwards. An
engine is a client of the model's scheduler: it owns the sequences it submits, ``reset()``
forgets only its own conversation, and ``close()`` ends only its own requests — the model
(backend, scheduler, image cache) is closed by its owner, the ``LoadedModel``.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from ..audio.budget import AudioBudget
from ..backend.llama import Backend
from ..backend.sampling import LIBRARY_REPLY, SamplingParams
from ..errors import InputError, MemoryBusy, SavedStateError
from ..plan.guard import Guard
from ..plan.planner import Plan
from ..vision.budget import ImagePlan
from ..vision.images import DEFAULT_MAX_PIXELS, LoadedImage
from ..vision.merge import MergeSpec
from ..vision.video import VideoBudget
from .chat_format import PromptFormatter
from .conversation import Conversation, Message, Picture
from .intake import Asked, Clip, Fetcher, FetchRules, Intake, MediaRef, ReplySpec, Sound, load_media
from .items import Prompt
from .saved import SavedInfo, binding_of, read_chat, write_chat
from .scheduler import Client, GenerationResponse, Request, Scheduler, Sequence
from .session import Footprint, RoomReport, SessionOptions, Summaries, make_room
from .stats import TurnStats

BUSY_WAIT_S = 120.0  # a turn waits this long for cells other clients' requests hold

__all__ = ["ChatResult", "Clip", "Engine", "EngineOptions", "GenerationResponse", "LoadedParts", "Message", "Sound"]


@dataclass(frozen=True)
class EngineOptions:
    """How a conversation runs; fixed when the engine is made."""

    system: str | None = None
    image_tokens: int | None = None  # per-picture budget (None: the plan's)
    tiles: str | int = "auto"  # AnyRes tiles for fixed-size encoders: auto | off | N
    merge: MergeSpec = MergeSpec()  # visual token merging after the projector (off by default)
    max_image_pixels: int = DEFAULT_MAX_PIXELS
    session: SessionOptions = SessionOptions()  # what happens when the context runs out
    video: VideoBudget = VideoBudget()  # a clip's frames: tokens (None: the room left), frames, fps cap
    audio: AudioBudget = AudioBudget()  # a recording's tokens (None: the room left), silences, longest
    # where pictures named by a string come from: any local file, data: URIs, public http(s) URLs
    fetch: FetchRules = FetchRules()


class LoadedParts(Protocol):
    """What a conversation uses of the model it runs on: ``LoadedModel``, which makes
    conversations and so is described here rather than imported (mypy checks it at each
    ``Engine(model)``)."""

    scheduler: Scheduler
    plan: Plan | None
    guard: Guard | None
    options: EngineOptions

    def intake(
        self,
        options: EngineOptions | None = None,
        *,
        fetcher: Fetcher | None = None,
        keep_originals: bool = False,
        host_wait_s: float = 30.0,
    ) -> Intake: ...


@dataclass(frozen=True)
class ChatResult:
    text: str
    stats: TurnStats
    finish_reason: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "text": self.text,
            "stats": self.stats.to_dict() if self.stats else None,
            "finish_reason": self.finish_reason,
        }


@dataclass
class _Pending:
    """What a submitted turn needs when its reply ends: its sequence, the conversation it makes
    (the history, the message it answers, what the session rewrote: the engine's once the reply
    is recorded), and what the session did."""

    seq: Sequence
    conv: Conversation
    room: RoomReport = field(default_factory=RoomReport)
    recorded: bool = False


class Engine:
    """A chat with images over one loaded model pair (a client of its scheduler)."""

    def __init__(self, model: LoadedParts, options: EngineOptions | None = None):
        self.model = model
        self.options = options if options is not None else model.options
        self.client = Client("conversation")
        self.notices: list[str] = []  # things the user should be told (e.g. an image shrunk)
        self.conversation = Conversation()
        self.summaries = Summaries()
        self.last_stats: TurnStats | None = None
        self.restored: SavedInfo | None = None  # what ``load`` read last
        self.intake: Intake = model.intake(self.options, keep_originals=True)  # (``/recall`` sends a picture again)

    def with_options(self, **changes: Any) -> Engine:
        """Another conversation over the same loaded model (scheduler, image cache, plan and
        guard shared) whose options differ by ``changes``."""
        return Engine(self.model, replace(self.options, **changes))

    # --- what it is made of ------------------------------------------------------------------
    @property
    def scheduler(self) -> Scheduler:
        return self.model.scheduler

    @property
    def backend(self) -> Backend:
        return self.model.scheduler.backend

    @property
    def plan(self) -> Plan | None:
        return self.model.plan

    @property
    def guard(self) -> Guard | None:
        return self.model.guard

    @property
    def formatter(self) -> PromptFormatter:
        return self.scheduler.formatter

    @property
    def default_stops(self) -> list[str]:
        return self.scheduler.default_stops

    @property
    def messages(self) -> list[Message]:
        return self.conversation.messages

    @property
    def pictures(self) -> list[Picture]:
        return self.conversation.pictures

    @property
    def merging(self) -> bool:
        """Whether visual token merging is on and applies to this model."""
        return self.scheduler.renderer.merging(self.options.merge)

    @property
    def n_ctx(self) -> int:
        return self.backend.n_ctx

    @property
    def n_ctx_used(self) -> int:
        return self.scheduler.cells_used()

    # --- conversation -----------------------------------------------------------------------
    def reset(self, keep_cache: bool = False) -> None:
        """Forget this conversation (image embeddings stay cached; other conversations and
        requests on the same model are not touched).

        With ``keep_cache`` its KV cells are left as they are: the next conversation reuses
        every token it shares with the old one from the start (a system prompt, an
        instruction), and only the rest is dropped and evaluated.
        """
        self.conversation.clear()
        if keep_cache:
            self.scheduler.cancel_client(self.client)
        else:
            self.scheduler.forget(self.client)

    # --- to and from a file -------------------------------------------------------------------
    def save(self, path: str) -> SavedInfo:
        """Write this conversation to ``path`` (atomically): its messages and pictures, the
        summaries made, and its KV cells, bound to this model pair and context. Loading it in
        another process continues exactly where this one is (``load``)."""
        from .. import __version__

        prompt = self.render()
        try:
            got = self.scheduler.export(self.client, prompt.items)
        finally:
            prompt.release()
        items, kv = got if got is not None else ((), b"")
        return write_chat(
            path,
            binding_of(self.backend),
            self.conversation,
            self.summaries,
            self.options.system,
            items,
            kv,
            __version__,
        )

    def load(self, path: str) -> SavedInfo:
        """Continue the conversation saved at ``path`` (this one is forgotten): its KV cells go
        back into the context, so the next turn evaluates only what it adds — no picture is
        encoded again. A file made with another model, projector, context, KV type or image
        budget, a damaged one, or one from a newer edgevlm raises ``SavedStateError`` naming
        the file and the reason; nothing is changed then."""
        got = read_chat(path, binding_of(self.backend))
        self.scheduler.forget(self.client)
        if got.items and not self.scheduler.adopt(self.client, got.items, got.kv):
            raise SavedStateError(f"{path}: llama.cpp did not take its KV cells")
        if got.system != self.options.system:
            if self.options.system is not None:
                self.notices.append(f"{path}: the conversation's own system prompt replaces this one")
            self.options = replace(self.options, system=got.system)
        self.conversation = got.conversation
        self.summaries = got.summaries
        self.restored = got.info
        return got.info

    def close(self) -> None:
        """End this conversation's requests in flight (the model stays loaded: its owner closes
        it)."""
        self.scheduler.cancel_client(self.client)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def load_images(self, images: Iterable[Any]) -> list[LoadedImage | MediaRef]:
        """``load_media`` under this engine's pixel limit."""
        return load_media(images, self.options.max_image_pixels)

    def plan_image(self, image: LoadedImage) -> ImagePlan:
        """The views of one picture under this engine's image budget (decided before encoding)."""
        return self.intake.plan_image(image)

    def render(self, messages: list[Message] | None = None, keep_images: bool = True) -> Prompt:
        """The prompt of ``messages`` (default: the conversation) as the scheduler sees it."""
        msgs = self.messages if messages is None else messages
        return self.scheduler.render(msgs, self.options.system, self.options.merge, keep_images)

    def chat(self, text: str, images: Iterable[Any] = (), **gen: Any) -> ChatResult:
        """One turn: returns the whole reply with its stats."""
        parts = []
        last = None
        for resp in self.stream(text, images, **gen):
            parts.append(resp.text)
            last = resp
        assert last is not None
        assert last.stats is not None
        return ChatResult("".join(parts), last.stats, last.finish_reason or "stop")

    def complete(self, text: str, max_tokens: int, messages: list[Message] | None = None) -> str:
        """Ask one greedy question after ``messages`` (default: the conversation) and forget it
        afterwards (the next turn drops its tokens from the KV cache by prefix matching)."""
        msgs = list(self.messages if messages is None else messages) + [Message("user", text)]
        prompt = self.render(msgs)
        seq = self._submit(ReplySpec(max_tokens, SamplingParams(0.0), tuple(self.default_stops)).request(prompt))
        return "".join(r.text for r in self.scheduler.stream(seq))

    def stream(
        self,
        text: str,
        images: Iterable[Any] = (),
        *,
        max_tokens: int = LIBRARY_REPLY.max_tokens,
        temperature: float = LIBRARY_REPLY.sampling.temperature,
        top_k: int = SamplingParams.top_k,
        top_p: float = SamplingParams.top_p,
        min_p: float = SamplingParams.min_p,
        seed: int | None = None,
        stop: Iterable[str] = (),
        grammar: str | None = None,
    ) -> Generator[GenerationResponse, None, None]:
        """Add a user turn and stream the reply. The last response carries stats. ``grammar``
        (GBNF, e.g. ``runtime.jsongrammar.json_grammar(schema)``) constrains the reply."""
        t_start = time.perf_counter()  # TTFT counts image decoding, budgeting and the guard too
        if max_tokens < 1:
            raise InputError(f"max_tokens {max_tokens}: a reply needs at least 1 token")
        budget = self.scheduler.budget
        reserve = budget.reply_reserve(max_tokens)
        budget.check_text(budget.text_bytes(self.options.system, text), reserve)  # (by its size: before tokenizing)
        self.backend.check_grammar(grammar)  # before any picture is decoded or encoded
        refs = self.load_images(images)
        kept = 0 if self.options.session.enabled else self.conversation.image_tokens_in_context()
        free = self.scheduler.budget.image_room(max_tokens) - kept
        sampling = SamplingParams(temperature, top_k, top_p, min_p, seed, grammar)
        reply = ReplySpec(max_tokens, sampling, tuple(stop) + tuple(self.default_stops))
        # the turn, built by the intake after this conversation's history (which it leaves as it is)
        turn = self.intake.turn(
            [Asked("user", text, tuple(refs))], reply, free, history=self.conversation, system=self.options.system
        )
        self.notices.extend(turn.notes + turn.notices)
        conv = turn.conversation()  # the history once this turn is answered (the session may rewrite it)
        room = RoomReport()
        if self.options.session.enabled:
            room = make_room(
                conv,
                n_ctx=self.n_ctx,
                reserve=reserve,
                image_room=self.scheduler.budget.image_room(max_tokens),
                measure=self._footprint,
                ask=self._ask,
                options=self.options.session,
                memory=self.summaries,
                notices=self.notices,
            )
        prompt = room.rendered or self.render(conv.messages)
        new = frozenset(self.scheduler.images.key(img) for img in turn.new_views)
        seq = self._submit(reply.request(prompt, new_images=new, t_start=t_start))
        yield from self._reply(_Pending(seq, conv, room))

    # --- one turn ----------------------------------------------------------------------------
    def _submit(self, request: Request) -> Sequence:
        """Start the request; while other clients hold the cells it needs, step their requests
        (they finish and give cells back) — up to ``BUSY_WAIT_S``."""
        deadline = time.monotonic() + BUSY_WAIT_S
        while True:
            seq = self.scheduler.submit(request, self.client)
            if isinstance(seq, Sequence):
                return seq
            if time.monotonic() > deadline:  # WAIT: other callers still hold the cells
                request.prompt.release()
                raise MemoryBusy(f"the context stayed busy with other requests for {BUSY_WAIT_S:g} s; try again")
            self.scheduler.step()

    def _reply(self, pending: _Pending) -> Generator[GenerationResponse, None, None]:
        steps = self.scheduler.stream(pending.seq)
        try:
            for r in steps:
                if r.stats is not None:
                    if r.finish_reason == "context":  # short of max_tokens: the caller is told
                        seq = pending.seq
                        self.notices.append(self.scheduler.budget.cut_notice(len(seq.tokens), seq.request.max_tokens))
                    r = GenerationResponse(r.text, r.token, r.finish_reason, self._record(pending))
                yield r
        finally:
            steps.close()  # a reply stopped early (Ctrl-C) is cancelled: it ends "interrupted"
            seq = pending.seq
            if seq.finish_reason == "error" and not seq.tokens:
                pending.recorded = True  # its prompt failed (a picture, llama.cpp): as if never sent
            elif not pending.recorded and seq.stats is not None:
                self._record(pending)  # what was generated becomes the assistant message

    def _record(self, pending: _Pending) -> TurnStats:
        seq = pending.seq
        stats = seq.stats
        assert stats is not None
        if pending.room.summarized or pending.room.dropped_turns:
            stats = replace(stats, **pending.room.counters(stats.cached_n))
        pending.conv.messages.append(Message("assistant", seq.reply, tokens=list(seq.tokens)))
        self.conversation = pending.conv  # the turn is part of the conversation now
        self.last_stats = stats
        pending.recorded = True
        return stats

    def _footprint(self, messages: list[Message]) -> Footprint:
        prompt = self.render(messages)
        return Footprint(prompt.cells, prompt.image_cells, prompt)

    def _ask(self, question: str, messages: list[Message]) -> str:
        return self.complete(question, self.options.session.summary_tokens, messages)
