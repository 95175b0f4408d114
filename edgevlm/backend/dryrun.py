"""llama.cpp's own memory-fit dry run, for a text model file on this machine.

What llama.cpp's ``--fit`` uses (common/fit.cpp): model params ``no_alloc`` with ``load_mode``
NONE, then a context. Nothing is read or allocated, yet llama.cpp places every weight and
reserves every compute buffer exactly as a real load does and logs them: the compute and output
buffers byte for byte (model and KV buffers log 0.00 MiB: their sizes come from the GGUF's
tensor table, which the planner reads anyway). In 0.05-0.1 s against seconds for a
real load of a large model, on any backend. The plan (``plan.footprint``) is built from its own
replay of llama.cpp's rules — it must plan from a remote header too, and for every lever it tries
— and ``edgevlm plan --check`` sets it against this run. Like ``llama``, this touches
``llama_cpp``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import ModelFileError
from ..model.kv_types import KV_TYPES
from . import logs
from .native import require
from .system import install_log_sink, placement

__all__ = ["DryRun", "dry_run"]


@dataclass(frozen=True)
class DryRun:
    """The compute and output buffers llama.cpp reserved, per buffer type (bytes)."""

    compute: dict[str, int]  # "CUDA0", "CUDA_Host", "Vulkan0", "CPU" -> bytes
    output: dict[str, int]  # the logits buffer ("CPU", "Vulkan_Host", ...)


def dry_run(
    model_path: str | os.PathLike[str],
    *,
    n_ctx: int,
    n_batch: int,
    n_ubatch: int,
    n_gpu_layers: int,
    flash_attn: bool,
    type_k: str,
    type_v: str,
    offload_kqv: bool = True,
    op_offload: bool | None = None,
    n_seq_max: int = 1,
    extra_buffers: bool | None = None,
    **_ignored: object,
) -> DryRun:
    """Reserve, without allocating, what ``Backend(model_path, ...)`` with these arguments would
    (the same placement rules: ``--ngl 0`` keeps no GPU in the text model, the CPU's extra
    buffer types as edgevlm sets them). Other ``Backend`` arguments are accepted and ignored, so
    ``plan.backend_options()`` can be passed as it is."""
    require()
    import llama_cpp

    install_log_sink()
    llama_cpp.llama_backend_init()
    mp = llama_cpp.llama_model_default_params()
    mp.n_gpu_layers = 0x7FFFFFFF if n_gpu_layers < 0 else n_gpu_layers
    mp.no_alloc = True
    mp.load_mode = llama_cpp.LLAMA_LOAD_MODE_NONE  # with mmap on, llama.cpp asserts !no_alloc
    for field, value in placement(n_gpu_layers, extra_buffers).items():
        setattr(mp, field, value)
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = n_ctx, n_batch, min(n_batch, n_ubatch)
    fa = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED
    cp.flash_attn_type = fa
    cp.type_k, cp.type_v = KV_TYPES[type_k].ggml_id, KV_TYPES[type_v].ggml_id
    cp.offload_kqv = offload_kqv
    if op_offload is not None:
        cp.op_offload = op_offload
    if n_seq_max > 1:
        cp.n_seq_max, cp.kv_unified = n_seq_max, True
    with logs.capture() as lines:
        model = llama_cpp.llama_model_load_from_file(os.fspath(model_path).encode(), mp)
        if not model:
            raise ModelFileError(f"{model_path}: llama.cpp could not place it (dry run)")
        try:
            ctx = llama_cpp.llama_init_from_model(model, cp)
            if not ctx:
                raise ModelFileError(f"{model_path}: llama.cpp could not reserve a context for it (dry run)")
            llama_cpp.llama_free(ctx)
        finally:
            llama_cpp.llama_model_free(model)
    compute: dict[str, int] = {}
    output: dict[str, int] = {}
    for fn, buf, what, mib in logs.buffer_sizes(lines):
        n = int(round(mib * 2**20))
        if fn == "sched_reserve" and what.startswith("compute buffer"):
            compute[buf] = max(compute.get(buf, 0), n)
        elif fn == "llama_context" and what.startswith("output buffer"):
            output[buf] = output.get(buf, 0) + n
    return DryRun(compute, output)
