"""The loaded model: one object that owns everything a model pair needs at run time, and that
every caller is a client of.

    vlm = edgevlm.load("model.gguf", "mmproj.gguf", n_seq_max=4)
    r = vlm.chat("What is in this picture?", images=["photo.jpg"])   # the model's own conversation
    other = vlm.conversation(system="Answer in French.")          # another one, same KV and cache
    vlm.close()                                                    # only the owner closes

``LoadedModel`` owns the backend (llama.cpp and mtmd), the scheduler (sequences, KV cells, the
image cache, the step loop), the plan it was loaded with, the guard, and the default options
(image budget, tiles, merging). It gives each client the one admission path for pictures
(``admit``: the guard, view by view, against the image room left) and the image budget for
its options. Its clients — conversations (``Engine``), captioning, the server's worker, batch
files and Ray actors — each own their sequences: a conversation's ``reset()`` forgets only
itself, and what ``step()`` finishes goes to the client that submitted it.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

from ..backend.llama import Backend
from ..plan.guard import Guard
from ..plan.planner import Plan
from ..vision.budget import ImageBudget, ImagePlan
from ..vision.images import LoadedImage
from ..vision.merge import MergeSpec
from ..vision.video import frame_text_tokens
from .chat_format import PromptFormatter
from .conversation import Message, Picture
from .engine import ChatResult, Engine, EngineOptions, GenerationResponse
from .intake import Fetcher, Intake, MediaRef, load_media
from .items import Prompt
from .scheduler import Scheduler
from .session import Summaries
from .stats import TurnStats

__all__ = ["LoadedModel"]


class LoadedModel:
    """A loaded model pair with its scheduler, plan, guard and default options (module doc)."""

    def __init__(
        self,
        scheduler: Scheduler,
        options: EngineOptions = EngineOptions(),
        *,
        plan: Plan | None = None,
        guard: Guard | None = None,
    ):
        self.scheduler = scheduler
        self.options = options
        self.plan = plan  # the Plan it was loaded with (None when built by hand)
        self.guard = guard  # runtime admission check for images (None: no check)
        self.image_budget = self.image_budget_for(options)
        self._default: Engine | None = None
        self.closed = False

    # --- what it is --------------------------------------------------------------------------
    @property
    def backend(self) -> Backend:
        return self.scheduler.backend

    @property
    def n_ctx(self) -> int:
        return self.scheduler.n_ctx

    @property
    def n_ctx_used(self) -> int:
        return self.scheduler.cells_used()

    @property
    def formatter(self) -> PromptFormatter:
        return self.scheduler.formatter

    @property
    def default_stops(self) -> list[str]:
        return self.scheduler.default_stops

    @property
    def merging(self) -> bool:
        """Whether the default options' token merging is on and applies to this model."""
        return self.scheduler.renderer.merging(self.options.merge)

    # --- what every client shares ------------------------------------------------------------
    def image_budget_for(self, options: EngineOptions) -> ImageBudget:
        """The image budget of ``options``: its per-picture tokens (else the plan's), tiles, and
        mtmd's own cap (``Intake.for_caller``'s rule)."""
        return self.intake(options).budget

    def intake(
        self,
        options: EngineOptions | None = None,
        *,
        fetcher: Fetcher | None = None,
        keep_originals: bool = False,
        host_wait_s: float = 30.0,
    ) -> Intake:
        """The intake of a caller with ``options`` (default: the model's): its pictures and
        clips budgeted for this model's projector and plan (``Intake.for_caller``, as
        ``edgevlm budget`` makes it), and run past its guard."""
        be = self.backend
        return Intake.for_caller(
            be.proj_info,
            options or self.options,
            self.plan.image_max_tokens if self.plan is not None else None,
            be.image_max_tokens,
            frame_text=self._frame_text,
            n_embd=be.n_embd_inp,
            guard=self.guard,
            fetcher=fetcher,
            keep_originals=keep_originals,
            host_wait_s=host_wait_s,
        )

    @functools.cached_property
    def _frame_text(self) -> int:
        """The tokens a clip frame's timestamp label takes (tokenized once)."""
        return frame_text_tokens(self.backend.tokenize_text)

    def load_images(self, images: Iterable[Any]) -> list[LoadedImage | MediaRef]:
        """``intake.load_media`` under the default options' pixel limit (clips too)."""
        return load_media(images, self.options.max_image_pixels)

    def plan_image(self, image: LoadedImage) -> ImagePlan:
        """The views of one picture under the default image budget (decided before encoding)."""
        return self.intake().plan_image(image)

    def render(
        self,
        messages: list[Message],
        system: str | None = None,
        merge: MergeSpec | None = None,
        keep_images: bool = True,
        **tooling: Any,
    ) -> Prompt:
        """The prompt of ``messages`` as the scheduler sees it (default options' system prompt
        and merging unless given; ``tooling``: tools, think, tool_required)."""
        return self.scheduler.render(
            messages,
            self.options.system if system is None else system,
            self.options.merge if merge is None else merge,
            keep_images,
            **tooling,
        )

    # --- conversations -----------------------------------------------------------------------
    def conversation(self, options: EngineOptions | None = None, **changes: Any) -> Engine:
        """A new conversation over this model (``options``, or the default options changed by
        ``changes``); it shares the scheduler, the KV cells of common prefixes and the image
        cache with every other client."""
        return Engine(self, replace(options or self.options, **changes))

    def with_options(self, **changes: Any) -> Engine:
        """A new conversation whose options differ from the default by ``changes``."""
        return self.conversation(**changes)

    @property
    def default_conversation(self) -> Engine:
        """The model's own conversation: what ``chat``, ``stream`` and ``reset`` act on."""
        if self._default is None:
            self._default = Engine(self)
        return self._default

    def chat(self, text: str, images: Iterable[Any] = (), **gen: Any) -> ChatResult:
        """A turn of the model's own conversation (``Engine.chat``)."""
        return self.default_conversation.chat(text, images, **gen)

    def stream(self, text: str, images: Iterable[Any] = (), **gen: Any) -> Iterator[GenerationResponse]:
        """A streamed turn of the model's own conversation (``Engine.stream``)."""
        return self.default_conversation.stream(text, images, **gen)

    def complete(self, text: str, max_tokens: int, messages: list[Message] | None = None) -> str:
        return self.default_conversation.complete(text, max_tokens, messages)

    def reset(self, keep_cache: bool = False) -> None:
        """Forget the model's own conversation (``Engine.reset``; other clients untouched)."""
        self.default_conversation.reset(keep_cache)

    @property
    def messages(self) -> list[Message]:
        return self.default_conversation.messages

    @property
    def pictures(self) -> list[Picture]:
        return self.default_conversation.pictures

    @property
    def notices(self) -> list[str]:
        return self.default_conversation.notices

    @property
    def last_stats(self) -> TurnStats | None:
        return self.default_conversation.last_stats

    @property
    def summaries(self) -> Summaries:
        return self.default_conversation.summaries

    # --- the owner's ---------------------------------------------------------------------------
    def close(self) -> None:
        """End every client's requests and free the model (llama.cpp context, mtmd, cache)."""
        if self.closed:
            return
        self.closed = True
        try:
            self.scheduler.close()
        finally:
            self.backend.close()

    def __enter__(self) -> LoadedModel:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
