"""The public Python entry point: ``edgevlm.load(model, mmproj)`` → a ``LoadedModel``."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .backend.llama import Backend
from .errors import DoesNotFit
from .plan.context import DEFAULT_REPLY_TOKENS
from .plan.devices import Probe, probe
from .plan.guard import Guard, after_load
from .plan.planner import Plan, Wishes, make_plan
from .runtime.engine import EngineOptions
from .runtime.model import LoadedModel
from .runtime.scheduler import Scheduler, SchedulerOptions

__all__ = ["load"]

_WISH_DEFAULTS = dict(
    n_ctx=None, n_gpu_layers=None, kv="auto", image_tokens=None, images=1, reply_tokens=DEFAULT_REPLY_TOKENS
)


def load(
    model: str | os.PathLike[str],
    mmproj: str | os.PathLike[str],
    *,
    n_ctx: int | None = None,
    n_gpu_layers: int | None = None,
    kv: str = "auto",
    image_tokens: int | None = None,
    images: int = 1,
    reply_tokens: int = DEFAULT_REPLY_TOKENS,
    wishes: Wishes | None = None,
    plan: Plan | None = None,
    device: str | None = None,
    free_memory: list[str] | None = None,
    gpu_overhead: int | None = None,
    measure: Callable[[], Probe] | None = None,
    options: EngineOptions | None = None,
    scheduler_options: SchedulerOptions = SchedulerOptions(),
    n_seq_max: int | Callable[[Plan], int] = 1,
    parallel: int | Callable[[Plan], int] | None = None,
    n_threads: int | None = None,
    verbose: bool = False,
    **backend_options: Any,
) -> LoadedModel:
    """Plan memory, load a model pair once, and return the ``LoadedModel`` (``chat``/``stream``:
    one turn each, nothing remembered; ``conversation()``: a conversation that goes on).

    >>> vlm = edgevlm.load("model.gguf", "mmproj.gguf")
    >>> print(vlm.chat("What is in this picture?", images=["photo.jpg"]).text)
    >>> conv = vlm.conversation()
    >>> conv.chat("What is in this picture?", images=["photo.jpg"])
    >>> for r in conv.stream("And the colours?"):
    ...     print(r.text, end="")

    Each option has one way in:

    - **what to plan for**: the common wishes as keywords (``n_ctx``, ``n_gpu_layers``, ``kv``,
      ``image_tokens``, ``images``, ``reply_tokens``; None / "auto": the planner chooses), *or*
      all of them as ``wishes`` (a ``Wishes``), *or* a finished ``plan`` — never two of these.
      It raises ``DoesNotFit`` if nothing fits. A conversation's per-picture budget is the
      ``image_tokens`` keyword, else the plan's, unless ``options`` names its own.
    - **what memory is free**: ``device`` / ``free_memory`` / ``gpu_overhead`` for the device
      probe, *or* ``measure`` (a function returning a ``Probe``); the plan and the per-request
      guard both use it.
    - **how conversations run** by default: ``options`` (an ``EngineOptions``: system prompt, tiles,
      merging, what happens when the context is full).
    - **the context's sequences**: ``n_seq_max`` sequence ids (conversations kept), or a function
      of the plan; ``parallel``: how many of them generate at once (default: all); idle
      conversations moved out of the context go to a host cache of the plan's ``cache_ram``
      bytes (``scheduler_options``: the scheduler's other settings).
    - ``backend_options`` override the plan's ``Backend`` arguments (``flash_attn``, ``n_batch``,
      ``progress_callback`` ...).
    """
    keywords: dict[str, Any] = dict(  # Wishes' fields, each of its own type
        n_ctx=n_ctx,
        n_gpu_layers=n_gpu_layers,
        kv=kv,
        image_tokens=image_tokens,
        images=images,
        reply_tokens=reply_tokens,
    )
    given = {k for k, v in keywords.items() if v != _WISH_DEFAULTS[k]}
    if sum((bool(given), wishes is not None, plan is not None)) > 1:
        raise TypeError(
            "load(): give the wishes as keywords, as wishes=, or a finished plan= — one of them "
            f"(got {', '.join(sorted(given)) or 'keywords'}"
            f"{', wishes' if wishes is not None else ''}{', plan' if plan is not None else ''})"
        )
    if measure is not None and (device is not None or free_memory or gpu_overhead is not None):
        raise TypeError("load(): give device/free_memory/gpu_overhead or measure=, not both")
    if wishes is None:
        wishes = Wishes(**keywords)
    opts = options or EngineOptions()
    if opts.image_tokens is None and image_tokens is not None:
        opts = replace(opts, image_tokens=image_tokens)
    what_if = measure is None and bool(free_memory)
    if measure is None:
        measure = lambda: probe(device, free_memory, gpu_overhead)
    if plan is None:
        plan = make_plan(os.fspath(model), os.fspath(mmproj), measure(), replace(wishes, merge=str(opts.merge)))
    if not plan.fits:
        raise DoesNotFit(plan.refusal or "the model does not fit in the memory available")
    seqs = n_seq_max(plan) if callable(n_seq_max) else n_seq_max
    running = parallel(plan) if callable(parallel) else parallel
    sched_opts = replace(
        scheduler_options,
        max_running=running or scheduler_options.max_running,
        cache_ram=scheduler_options.cache_ram or plan.cache_ram,
    )
    backend = Backend(
        model,
        mmproj,
        n_threads=n_threads,
        verbose=verbose,
        n_seq_max=max(seqs, running or 1),
        **{**plan.backend_options(), **backend_options},
    )
    try:
        guard = Guard(plan, backend.proj_info, measure)
        if what_if:  # the sizes given were free before loading: the guard sees them less what loading took
            guard.measure = after_load(measure, plan, lambda: guard.reserved_bytes)
        return LoadedModel(Scheduler(backend, sched_opts), opts, plan=plan, guard=guard)
    except BaseException:
        backend.close()
        raise
