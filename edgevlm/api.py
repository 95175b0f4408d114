"""The public Python entry point: ``edgevlm.load(model, mmproj)`` → an ``Engine``."""

from __future__ import annotations

import os
from typing import Any

from .backend import Backend
from .engine import Engine


def load(model: str | os.PathLike[str], mmproj: str | os.PathLike[str], *, n_ctx: int = 4096,
         n_gpu_layers: int = -1, n_threads: int | None = None, system: str | None = None,
         verbose: bool = False, **backend_options: Any) -> Engine:
    """Load a model pair once and return an Engine for chatting about images.

    >>> vlm = edgevlm.load("model.gguf", "mmproj.gguf")
    >>> print(vlm.chat("What is in this picture?", images=["photo.jpg"]).text)
    >>> for r in vlm.stream("And the colours?"):
    ...     print(r.text, end="")

    ``backend_options`` go to ``Backend`` (``flash_attn``, ``type_k``, ``type_v``, ``n_batch``,
    ``image_max_tokens``, ``progress_callback`` ...).
    """
    backend = Backend(model, mmproj, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, n_threads=n_threads,
                      verbose=verbose, **backend_options)
    return Engine(backend, system=system)
