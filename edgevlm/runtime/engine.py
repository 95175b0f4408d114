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

import hashlib
import os
import time
from collections.abc import Generator, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from ..backend.llama import Backend
from ..backend.sampling import LIBRARY_REPLY, SamplingParams
from ..errors import InputError, MemoryBusy
from ..plan.guard import Guard
from ..plan.planner import Plan
from ..vision.budget import ImageBudget, ImagePlan, render_views
from ..vision.images import DEFAULT_MAX_PIXELS, LoadedImage, load_image
from ..vision.merge import MergeSpec
from ..vision.video import VideoBudget, frame_text_tokens, is_video_path, plan_video
from .conversation import Conversation, Message, Picture
from .items import Prompt
from .scheduler import Client, GenerationResponse, Request, Scheduler, Sequence
from .session import Footprint, RoomReport, SessionOptions, Summaries, make_room
from .stats import TurnStats

BUSY_WAIT_S = 120.0  # a turn waits this long for cells other clients' requests hold

__all__ = [
    "Admitted",
    "ChatResult",
    "Clip",
    "Engine",
    "EngineOptions",
    "GenerationResponse",
    "Message",
    "ModelRuntime",
    "load_media",
]


def load_media(images: Iterable[Any], max_pixels: int) -> list[LoadedImage | Clip]:
    """Pictures decoded (paths, bytes, PIL images, arrays) and clips named (a ``Clip``, or a
    path with a video extension: decoded when the turn is made, under its room); needs no
    model, so a command can check its inputs before one is downloaded or loaded."""
    out: list[LoadedImage | Clip] = []
    for img in images:
        if isinstance(img, (LoadedImage, Clip)):
            out.append(img)
        elif isinstance(img, str) and is_video_path(img):
            if not os.path.isfile(img):
                raise InputError(f"{img}: no such video file")
            out.append(Clip(img, img))
        else:
            out.append(load_image(img, max_pixels))
    return out


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


@dataclass(frozen=True)
class Clip:
    """A video a turn carries (a path, or its bytes): its frames are chosen under the room the
    turn has left when the turn is made (``vision.video.plan_video``), each sent as a view
    labelled with its timestamp."""

    source: str | bytes
    name: str = "video"


@dataclass(frozen=True)
class Admitted:
    """Views past the guard (maybe shrunk), the image cells they take, and what to tell."""

    views: list[LoadedImage]
    tokens: int
    notices: list[str]


class ModelRuntime(Protocol):
    """What a conversation needs of the loaded model it runs on (``LoadedModel`` is one)."""

    scheduler: Scheduler
    plan: Plan | None
    guard: Guard | None
    options: EngineOptions

    def image_budget_for(self, options: EngineOptions) -> ImageBudget: ...

    def admit(self, views: list[LoadedImage], cells_free: int) -> Admitted: ...


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
class _Turn:
    """What a submitted turn needs when its reply ends."""

    seq: Sequence
    room: RoomReport = field(default_factory=RoomReport)
    recorded: bool = False
    message: Message | None = None  # the user message it answers
    pictures: int = 0  # pictures that message added


class Engine:
    """A chat with images over one loaded model pair (a client of its scheduler)."""

    def __init__(self, model: ModelRuntime, options: EngineOptions | None = None):
        self.model = model
        self.options = options if options is not None else model.options
        self.client = Client("conversation")
        self.notices: list[str] = []  # things the user should be told (e.g. an image shrunk)
        self.conversation = Conversation()
        self.summaries = Summaries()
        self.last_stats: TurnStats | None = None
        self.image_budget = model.image_budget_for(self.options)

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

    def close(self) -> None:
        """End this conversation's requests in flight (the model stays loaded: its owner closes
        it)."""
        self.scheduler.cancel_client(self.client)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def load_images(self, images: Iterable[Any]) -> list[LoadedImage | Clip]:
        """``load_media`` under this engine's pixel limit."""
        return load_media(images, self.options.max_image_pixels)

    def plan_image(self, image: LoadedImage) -> ImagePlan:
        """The views of one picture under this engine's image budget (decided before encoding)."""
        return self.image_budget.plan(image)

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
        assert last is not None and last.stats is not None
        return ChatResult("".join(parts), last.stats, last.finish_reason or "stop")

    def complete(self, text: str, max_tokens: int, messages: list[Message] | None = None) -> str:
        """Ask one greedy question after ``messages`` (default: the conversation) and forget it
        afterwards (the next turn drops its tokens from the KV cache by prefix matching)."""
        msgs = list(self.messages if messages is None else messages) + [Message("user", text)]
        prompt = self.render(msgs)
        seq = self._submit(Request(prompt, max_tokens, SamplingParams(0.0), tuple(self.default_stops)))
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
        (GBNF, e.g. ``backend.system.json_grammar(schema)``) constrains the reply."""
        t_start = time.perf_counter()  # TTFT counts image decoding, budgeting and the guard too
        if max_tokens < 1:
            raise InputError(f"max_tokens {max_tokens}: a reply needs at least 1 token")
        self.backend.check_grammar(grammar)  # before any picture is decoded or encoded
        originals = self.load_images(images)
        reserve = self.scheduler.budget.reply_reserve(max_tokens)
        kept = 0 if self.options.session.enabled else self.conversation.image_tokens_in_context()
        n_before = len(self.pictures)
        try:
            views, labels, pics = self._budget(originals, self.scheduler.budget.image_room(max_tokens) - kept)
        except BaseException:  # (a clip that cannot be decoded or does not fit: nothing of the turn stays)
            del self.pictures[n_before:]
            raise
        try:
            loaded = self._admit(views, self.scheduler.budget.image_room(max_tokens) - kept)
        except BaseException:
            del self.pictures[len(self.pictures) - len(originals) :]
            raise
        sources = [im.name if isinstance(im, Clip) else im.source for im in originals]
        msg = Message("user", text, loaded, labels=labels, sources=sources, pictures=pics)
        self.messages.append(msg)
        try:
            room = RoomReport()
            if self.options.session.enabled:
                room = make_room(
                    self.conversation,
                    n_ctx=self.n_ctx,
                    reserve=reserve,
                    image_room=self.scheduler.budget.image_room(max_tokens),
                    measure=self._footprint,
                    ask=self._ask,
                    options=self.options.session,
                    memory=self.summaries,
                    notices=self.notices,
                )
            prompt = room.rendered or self.render()
            new = frozenset(self.scheduler.images.key(img) for img in loaded)
            sampling = SamplingParams(temperature, top_k, top_p, min_p, seed, grammar)
            request = Request(
                prompt, max_tokens, sampling, tuple(stop) + tuple(self.default_stops), new_images=new, t_start=t_start
            )
            seq = self._submit(request)
        except BaseException:
            self.messages.remove(msg)
            del self.pictures[len(self.pictures) - len(originals) :]
            raise
        yield from self._reply(_Turn(seq, room, message=msg, pictures=len(originals)))

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

    def _reply(self, turn: _Turn) -> Generator[GenerationResponse, None, None]:
        steps = self.scheduler.stream(turn.seq)
        try:
            for r in steps:
                if r.stats is not None:
                    r = GenerationResponse(r.text, r.token, r.finish_reason, self._record(turn))
                yield r
        finally:
            steps.close()  # a reply stopped early (Ctrl-C) is cancelled: it ends "interrupted"
            seq = turn.seq
            if seq.finish_reason == "error" and not seq.tokens and turn.message is not None:
                self._undo(turn)  # its prompt failed (a picture, llama.cpp): as if never sent
            elif not turn.recorded and seq.stats is not None:
                self._record(turn)  # what was generated becomes the assistant message

    def _undo(self, turn: _Turn) -> None:
        if turn.message in self.messages:
            self.messages.remove(turn.message)
        if turn.pictures:
            del self.pictures[len(self.pictures) - turn.pictures :]
        turn.recorded = True

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

    def _budget(
        self, images: list[LoadedImage | Clip], room: int
    ) -> tuple[list[LoadedImage], list[str | None], list[int]]:
        """The views of the turn's pictures and clips (a clip: its frames, within the ``room``
        its pictures leave), their labels, and their picture numbers."""
        views: list[LoadedImage] = []
        labels: list[str | None] = []
        pics: list[int] = []
        plans = {id(im): self.plan_image(im) for im in images if isinstance(im, LoadedImage)}
        room -= sum(ip.total_tokens for ip in plans.values())
        clips_left = sum(1 for im in images if isinstance(im, Clip))
        for img in images:
            if isinstance(img, Clip):  # the clips share what the pictures leave, each an equal part
                frames, stamps, tokens = self._clip(img, room // clips_left)
                room -= tokens
                clips_left -= 1
                key = hashlib.sha256("".join(f.sha256 for f in frames).encode()).hexdigest()
                # (its summary is remembered by all its frames, not the first alone)
                self.pictures.append(Picture(len(self.pictures) + 1, replace(frames[0], sha256=key), tokens))
                views += frames
                labels += stamps
                pics += [len(self.pictures)] * len(frames)
                continue
            ip = plans[id(img)]
            self.notices.extend(f"{img.source}: {n}" for n in ip.notes)
            self.pictures.append(Picture(len(self.pictures) + 1, img, ip.total_tokens))
            for label, pix in render_views(img, ip):
                views.append(pix)
                labels.append(label)
                pics.append(len(self.pictures))
        return views, labels, pics

    def _clip(self, clip: Clip, room: int) -> tuple[list[LoadedImage], list[str | None], int]:
        """A clip's frames, chosen under its budget and the room left: the frames (their source
        the clip's name), their timestamp labels, their tokens."""
        plan, frames = plan_video(  # (one that cannot fit: ContextExceeded)
            clip.source,
            self.backend.proj_info,
            replace(self.options.video, merge=False),  # (frames go one by one: no temporal pairs)
            room=max(room, 0),
            image_budget_tokens=self.image_budget.tokens,
            mtmd_max_tokens=self.image_budget.mtmd_max_tokens,
            name=clip.name,
            frame_text=frame_text_tokens(self.backend.tokenize_text),
            max_pixels=self.options.max_image_pixels,
        )
        kept = plan.kept
        self.notices.append(
            f"{clip.name}: {len(kept)} frame(s) of {plan.duration:.1f} s, {plan.total_tokens:,} tokens ({plan.rule})"
        )
        self.notices.extend(f"{clip.name}: {n}" for n in plan.notes)
        return frames, [f.label for f in kept], plan.total_tokens

    def _admit(self, images: list[LoadedImage], cells_free: int) -> list[LoadedImage]:
        """Run each new image past the guard (memory now, image room left); may shrink it."""
        adm = self.model.admit(images, cells_free)
        self.notices.extend(adm.notices)
        return adm.views
