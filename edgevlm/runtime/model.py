"""The loaded model: one object that owns everything a model pair needs at run time, and that
every caller is a client of.

    vlm = edgevlm.load("model.gguf", "mmproj.gguf", n_seq_max=4)
    r = vlm.chat("What is in this picture?", images=["photo.jpg"])   # one turn, nothing remembered
    conv = vlm.conversation(system="Answer in French.")           # a conversation: it remembers
    conv.chat("Qu'y a-t-il ?", images=["photo.jpg"]); conv.chat("Et les couleurs ?")
    vlm.close()                                                    # only the owner closes

``LoadedModel`` owns the backend (llama.cpp and mtmd), the scheduler (sequences, KV cells, the
image cache, the step loop), the plan it was loaded with, the guard, and the default options
(image budget, tiles, merging). It is no conversation: it makes them (``conversation()``, an
``Engine`` each), and its ``chat``/``stream`` run one turn in a fresh conversation that nothing
keeps. It gives each client the one intake for pictures (``intake``: budgeted for its options
and run past the guard). Its clients — conversations, captioning, the server's worker, batch
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
from .conversation import Message
from .engine import ChatResult, Engine, EngineOptions, GenerationResponse
from .intake import Fetcher, Intake, MediaRef, load_media
from .items import Prompt
from .scheduler import Scheduler

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
        be, opts = self.backend, options or self.options
        return Intake.for_caller(
            be.proj_info,
            opts,
            self.plan.image_max_tokens if self.plan is not None else None,
            be.image_max_tokens,
            frame_text=self._frame_text,
            n_embd=be.n_embd_inp,
            guard=self.guard,
            fetcher=fetcher if fetcher is not None else Fetcher(opts.fetch),
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

    def chat(self, text: str, images: Iterable[Any] = (), **gen: Any) -> ChatResult:
        """One turn of a fresh conversation (``Engine.chat``), forgotten afterwards: the model
        remembers nothing between calls (a second call knows nothing of the first; only the KV
        cells and image embeddings they share are reused). For a conversation that goes on,
        ``conv = vlm.conversation(); conv.chat(...); conv.chat(...)``."""
        with self.conversation() as conv:
            return conv.chat(text, images, **gen)

    def stream(self, text: str, images: Iterable[Any] = (), **gen: Any) -> Iterator[GenerationResponse]:
        """One streamed turn of a fresh conversation (``Engine.stream``), forgotten afterwards
        like ``chat``'s."""
        return self.conversation().stream(text, images, **gen)

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
