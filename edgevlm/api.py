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
from .plan.guard import Guard
from .plan.planner import Plan, Wishes, make_plan
from .runtime.engine import EngineOptions
from .runtime.model import LoadedModel
from .runtime.scheduler import Scheduler, SchedulerOptions
from .vision.merge import MergeSpec

__all__ = ["load"]


def load(model: str | os.PathLike[str], mmproj: str | os.PathLike[str], *,
         n_ctx: int | None = None, n_gpu_layers: int | None = None, kv: str = "auto",
         image_tokens: int | None = None, images: int = 1, reply_tokens: int = DEFAULT_REPLY_TOKENS,
         device: str | None = None, free_memory: list[str] | None = None,
         gpu_overhead: int | None = None, measure: Callable[[], Probe] | None = None,
         plan: Plan | None = None, merge: str | MergeSpec = "off",
         n_threads: int | None = None, system: str | None = None,
         options: EngineOptions | None = None, scheduler_options: SchedulerOptions = SchedulerOptions(),
         n_seq_max: int | Callable[[Plan], int] = 1, parallel: int | Callable[[Plan], int] | None = None,
         wishes: Wishes | None = None, verbose: bool = False, **backend_options: Any) -> LoadedModel:
    """Plan memory, load a model pair once, and return the ``LoadedModel`` (its own
    conversation answers ``chat``/``stream``; ``conversation()`` makes more).

    >>> vlm = edgevlm.load("model.gguf", "mmproj.gguf")
    >>> print(vlm.chat("What is in this picture?", images=["photo.jpg"]).text)
    >>> for r in vlm.stream("And the colours?"):
    ...     print(r.text, end="")

    ``n_ctx``, ``n_gpu_layers``, ``kv`` and ``image_tokens`` are wishes the planner keeps
    (None / "auto": the planner chooses); it raises ``DoesNotFit`` if nothing fits.
    ``reply_tokens``: the reply the plan keeps room for when it counts the images a context
    holds. ``wishes``: all of the planner's wishes at once (instead of the arguments above). ``measure``: what reads free memory (default: the device probe with ``device``,
    ``free_memory`` and ``gpu_overhead``); the plan and the per-request guard both use it. ``options``: how the conversation runs (system prompt, tiles, merging, what happens
    when the context is full); ``system``, ``merge`` and ``image_tokens`` fill them in when not
    given there. ``backend_options`` override the plan's ``Backend`` arguments
    (``flash_attn``, ``n_batch``, ``progress_callback`` ...). ``n_seq_max``: sequence ids the
    context keeps (conversations), or a function of the plan that says how many; ``parallel``:
    how many of them generate at once (default: all). Idle conversations moved out of the
    context go to a host cache of the plan's ``cache_ram`` bytes (``scheduler_options`` can
    set it instead).
    """
    spec = merge if isinstance(merge, MergeSpec) else MergeSpec.parse(merge)
    opts = options or EngineOptions()
    opts = replace(opts, system=opts.system if opts.system is not None else system,
                   merge=opts.merge if opts.merge.enabled else spec,
                   image_tokens=opts.image_tokens if opts.image_tokens is not None else image_tokens)
    if measure is None:
        measure = lambda: probe(device, free_memory, gpu_overhead)  # noqa: E731
    if plan is None:
        if wishes is None:
            wishes = Wishes(n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, kv=kv, image_tokens=image_tokens,
                            images=images, reply_tokens=reply_tokens)
        wishes = replace(wishes, merge=str(opts.merge))
        plan = make_plan(os.fspath(model), os.fspath(mmproj), measure(), wishes)
    if not plan.fits:
        raise DoesNotFit(plan.refusal or "the model does not fit in the memory available")
    seqs = n_seq_max(plan) if callable(n_seq_max) else n_seq_max
    running = parallel(plan) if callable(parallel) else parallel
    sched_opts = replace(scheduler_options, max_running=running or scheduler_options.max_running,
                         cache_ram=scheduler_options.cache_ram or plan.cache_ram)
    backend = Backend(model, mmproj, n_threads=n_threads, verbose=verbose, n_seq_max=max(seqs, running or 1),
                      **{**plan.backend_options(), **backend_options})
    try:
        guard = Guard(plan, backend.proj_info, measure)
        return LoadedModel(Scheduler(backend, sched_opts), opts, plan=plan, guard=guard)
    except BaseException:
        backend.close()
        raise
