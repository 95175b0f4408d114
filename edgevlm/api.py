"""The public Python entry point: ``edgevlm.load(model, mmproj)`` → an ``Engine``."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from .backend import Backend
from .devices import probe
from .engine import Engine
from .errors import DoesNotFit
from .guard import Guard
from .merge import MergeSpec
from .planner import Plan, Wishes, make_plan


def load(model: str | os.PathLike[str], mmproj: str | os.PathLike[str], *,
         n_ctx: int | None = None, n_gpu_layers: int | None = None, kv: str = "auto",
         image_tokens: int | None = None, images: int = 1, device: str | None = None,
         free_memory: list[str] | None = None, gpu_overhead: int | None = None,
         plan: Plan | None = None, merge: str = "off", n_threads: int | None = None,
         system: str | None = None, n_seq_max: int | Callable[[Plan], int] = 1,
         verbose: bool = False, **backend_options: Any) -> Engine:
    """Plan memory, load a model pair once, and return an Engine for chatting about images.

    >>> vlm = edgevlm.load("model.gguf", "mmproj.gguf")
    >>> print(vlm.chat("What is in this picture?", images=["photo.jpg"]).text)
    >>> for r in vlm.stream("And the colours?"):
    ...     print(r.text, end="")

    ``n_ctx``, ``n_gpu_layers``, ``kv`` and ``image_tokens`` are wishes the planner keeps
    (None / "auto": the planner chooses); it raises ``DoesNotFit`` if nothing fits.
    ``backend_options`` override the plan's ``Backend`` arguments (``flash_attn``, ``n_batch``,
    ``progress_callback`` ...). ``n_seq_max``: sequences the context holds (parallel captioning),
    or a function of the plan that says how many.
    """
    measure = lambda: probe(device, free_memory, gpu_overhead)  # noqa: E731
    if plan is None:
        wishes = Wishes(n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, kv=kv, image_tokens=image_tokens,
                        images=images, merge=merge)
        plan = make_plan(os.fspath(model), os.fspath(mmproj), measure(), wishes)
    if not plan.fits:
        raise DoesNotFit(plan.refusal or "the model does not fit in the memory available")
    opts = {**plan.backend_options(), **backend_options}
    seqs = n_seq_max(plan) if callable(n_seq_max) else n_seq_max
    backend = Backend(model, mmproj, n_threads=n_threads, verbose=verbose, n_seq_max=seqs, **opts)
    guard = Guard(plan, backend.proj_info, measure)
    engine = Engine(backend, system=system, plan=plan, guard=guard)
    engine.merge = MergeSpec.parse(merge)
    return engine
