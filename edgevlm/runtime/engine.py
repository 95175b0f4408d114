"""One conversation with images over the scheduler: the API behind ``edgevlm chat`` and
``edgevlm.load()``.

Every turn renders the whole conversation with the model's template and submits it to the
scheduler, whose prefix matching evaluates only what the KV cache does not hold yet: a
follow-up turn costs just the tokens it adds. Pictures are budgeted before the encoder runs
(resized, tiled), checked by the guard against the memory free now and the context budget, and
encoded once (the scheduler's image cache is keyed by content), so a picture seen before — in
this conversation, after ``reset()``, or in a new one — is not encoded again. When the context
fills, the session policy replaces old pictures by the model's own summaries.

Options are given at construction (``EngineOptions``); nothing is configured afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from ..backend.llama import Backend
from ..backend.sampling import SamplingParams
from ..errors import InputError
from ..plan.guard import Guard
from ..plan.planner import Plan
from ..vision.budget import ImageBudget, ImagePlan, render_views
from ..vision.images import DEFAULT_MAX_PIXELS, LoadedImage, load_image
from ..vision.merge import MergeSpec
from .conversation import Conversation, Message, Picture
from .scheduler import GenerationResponse, Request, Scheduler, Sequence
from .session import Footprint, RoomReport, SessionOptions, Summaries, make_room
from .stats import TurnStats

__all__ = ["ChatResult", "Engine", "EngineOptions", "GenerationResponse", "Message"]


@dataclass(frozen=True)
class EngineOptions:
    """How a conversation runs; fixed when the engine is made."""

    system: str | None = None
    image_tokens: int | None = None  # per-picture budget (None: the plan's)
    tiles: str | int = "auto"  # AnyRes tiles for fixed-size encoders: auto | off | N
    merge: MergeSpec = MergeSpec()  # visual token merging after the projector (off by default)
    max_image_pixels: int = DEFAULT_MAX_PIXELS
    session: SessionOptions = SessionOptions()  # what happens when the context runs out


@dataclass
class ChatResult:
    text: str
    stats: TurnStats
    finish_reason: str


@dataclass
class _Turn:
    """What a submitted turn needs when its reply ends."""

    seq: Sequence
    room: RoomReport = field(default_factory=RoomReport)
    recorded: bool = False


class Engine:
    """A chat with images over one loaded model pair (a view over its scheduler)."""

    def __init__(self, scheduler: Scheduler, options: EngineOptions = EngineOptions(), *,
                 plan: Plan | None = None, guard: Guard | None = None):
        self.scheduler = scheduler
        self.options = options
        self.plan = plan  # the Plan it was loaded with (None when built by hand)
        self.guard = guard  # runtime admission check for images (None: no check)
        self.notices: list[str] = []  # things the user should be told (e.g. an image shrunk)
        self.conversation = Conversation()
        self.summaries = Summaries()
        self.last_stats: TurnStats | None = None
        cap = plan.image_max_tokens if plan is not None else None
        self.image_budget = ImageBudget(
            self.backend.proj_info, options.image_tokens if options.image_tokens is not None else cap,
            options.tiles, self.backend.image_max_tokens)

    def with_options(self, **changes: Any) -> Engine:
        """Another conversation over the same loaded model (scheduler, image cache, plan and
        guard shared) whose options differ by ``changes``."""
        return Engine(self.scheduler, replace(self.options, **changes), plan=self.plan, guard=self.guard)

    # --- what it is made of ------------------------------------------------------------------
    @property
    def backend(self) -> Backend:
        return self.scheduler.backend

    @property
    def formatter(self):
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
        """Forget the conversation (image embeddings stay cached).

        With ``keep_cache`` the KV cache is left as it is: the next conversation reuses every
        token it shares with the old one from the start (a system prompt, an instruction), and
        only the rest is dropped and evaluated.
        """
        self.conversation.clear()
        if not keep_cache:
            self.scheduler.clear()

    def close(self) -> None:
        self.scheduler.close()
        self.backend.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def load_images(self, images: Iterable[Any]) -> list[LoadedImage]:
        return [img if isinstance(img, LoadedImage) else load_image(img, self.options.max_image_pixels)
                for img in images]

    def plan_image(self, image: LoadedImage) -> ImagePlan:
        """The views of one picture under this engine's image budget (decided before encoding)."""
        return self.image_budget.plan(image)

    def render(self, messages: list[Message] | None = None, keep_images: bool = True):
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
        assert last is not None and last.stats is not None
        return ChatResult("".join(parts), last.stats, last.finish_reason or "stop")

    def complete(self, text: str, max_tokens: int, messages: list[Message] | None = None) -> str:
        """Ask one greedy question after ``messages`` (default: the conversation) and forget it
        afterwards (the next turn drops its tokens from the KV cache by prefix matching)."""
        msgs = list(self.messages if messages is None else messages) + [Message("user", text)]
        prompt = self.render(msgs)
        seq = self._submit(Request(prompt, max_tokens, SamplingParams(0.0), tuple(self.default_stops)))
        return "".join(r.text for r in self.scheduler.stream(seq))

    def stream(self, text: str, images: Iterable[Any] = (), *, max_tokens: int = 512,
               temperature: float = SamplingParams.temperature, top_k: int = SamplingParams.top_k,
               top_p: float = SamplingParams.top_p, min_p: float = SamplingParams.min_p,
               seed: int | None = None, stop: Iterable[str] = (),
               grammar: str | None = None) -> Iterator[GenerationResponse]:
        """Add a user turn and stream the reply. The last response carries stats. ``grammar``
        (GBNF, e.g. ``backend.system.json_grammar(schema)``) constrains the reply."""
        t_start = time.perf_counter()  # TTFT counts image decoding, budgeting and the guard too
        if max_tokens < 1:
            raise InputError(f"max_tokens {max_tokens}: a reply needs at least 1 token")
        originals = self.load_images(images)
        reserve = self.scheduler.budget.reply_reserve(max_tokens)
        kept = 0 if self.options.session.enabled else self.conversation.image_tokens_in_context()
        views, labels, pics = self._budget(originals)
        try:
            loaded = self._admit(views, self.scheduler.budget.image_room(max_tokens) - kept)
        except BaseException:
            del self.pictures[len(self.pictures) - len(originals):]
            raise
        msg = Message("user", text, loaded, labels=labels, sources=[im.source for im in originals],
                      pictures=pics)
        self.messages.append(msg)
        try:
            room = RoomReport()
            if self.options.session.enabled:
                room = make_room(self.conversation, n_ctx=self.n_ctx, reserve=reserve,
                                 image_room=self.scheduler.budget.image_room(max_tokens),
                                 measure=self._footprint, ask=self._ask, options=self.options.session,
                                 memory=self.summaries, notices=self.notices)
            prompt = room.rendered or self.render()
            new = frozenset(self.scheduler.images.key(img) for img in loaded)
            sampling = SamplingParams(temperature, top_k, top_p, min_p, seed, grammar)
            request = Request(prompt, max_tokens, sampling,
                              tuple(stop) + tuple(self.default_stops), new_images=new, t_start=t_start)
            seq = self._submit(request)
        except BaseException:
            self.messages.remove(msg)
            del self.pictures[len(self.pictures) - len(originals):]
            raise
        yield from self._reply(_Turn(seq, room))

    # --- one turn ----------------------------------------------------------------------------
    def _submit(self, request: Request) -> Sequence:
        seq = self.scheduler.submit(request)
        if not isinstance(seq, Sequence):  # WAIT: other callers hold the cells
            raise InputError("the context is busy with other requests; try again")
        return seq

    def _reply(self, turn: _Turn) -> Iterator[GenerationResponse]:
        steps = self.scheduler.stream(turn.seq)
        try:
            for r in steps:
                if r.stats is not None:
                    r = GenerationResponse(r.text, r.token, r.finish_reason, self._record(turn))
                yield r
        finally:
            steps.close()  # a reply stopped early (Ctrl-C) is cancelled: it ends "interrupted"
            if not turn.recorded and turn.seq.stats is not None:
                self._record(turn)  # what was generated becomes the assistant message

    def _record(self, turn: _Turn) -> TurnStats:
        seq = turn.seq
        stats = seq.stats
        assert stats is not None
        if turn.room.summarized or turn.room.dropped_turns:
            stats = replace(stats, **turn.room.counters(stats.cached_n))
        self.messages.append(Message("assistant", seq.reply, tokens=list(seq.tokens)))
        self.last_stats = stats
        turn.recorded = True
        return stats

    def _footprint(self, messages: list[Message]) -> Footprint:
        prompt = self.render(messages)
        return Footprint(prompt.cells, prompt.image_cells, prompt)

    def _ask(self, question: str, messages: list[Message]) -> str:
        return self.complete(question, self.options.session.summary_tokens, messages)

    def _budget(self, images: list[LoadedImage]) -> tuple[list[LoadedImage], list[str | None], list[int]]:
        views: list[LoadedImage] = []
        labels: list[str | None] = []
        pics: list[int] = []
        for img in images:
            ip = self.plan_image(img)
            self.notices.extend(f"{img.source}: {n}" for n in ip.notes)
            self.pictures.append(Picture(len(self.pictures) + 1, img, ip.total_tokens))
            for label, pix in render_views(img, ip):
                views.append(pix)
                labels.append(label)
                pics.append(len(self.pictures))
        return views, labels, pics

    def _admit(self, images: list[LoadedImage], cells_free: int) -> list[LoadedImage]:
        """Run each new image past the guard (memory now, image room left); may shrink it."""
        if self.guard is None or not images:
            return images
        out = []
        for img in images:
            adm = self.guard.admit(img, cells_free)
            cells_free -= adm.tokens
            if adm.notice:
                self.notices.append(adm.notice)
            out.append(adm.image)
        return out
