"""Where llama.cpp puts a model whose layers live on GPUs, and the compute buffers it then
reserves on each device and on the host.

- A weight goes to its layer's GPU only when that GPU can multiply it (``weight_buft_supported``
  asks the device about ``w × f32[n_embd, 512]``): Vulkan refuses tensors past its
  ``maxStorageBufferRange``, so a large-vocabulary output matrix (Qwen2-VL's 151,936 × 1,536
  tied embedding: 297 MiB of logits) stays on the host although llama.cpp logs "offloading output
  layer to GPU" — ``device_refuses``.
- The compute buffers come from a replay of ggml's scheduler over the reserve graphs
  (``plan.sched``): each GPU's buffer, and the CPU's, which is the first GPU's pinned host type
  (``Vulkan_Host``) and holds the logits when the output matrix stays on the host. The graphs
  replay few layers; a placement is compressed to at most two layers per run of layers on one
  device, which keeps every boundary the scheduler sees.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ..model.gguf_info import TextModelInfo
from ..model.kv_types import KV_TYPES
from . import compute
from .devices import Device
from .estimate import TextTensors, WeightTensor, kv_cells, replayed_graph
from .graphalloc import Tensor
from .sched import Backend, Home, schedule

__all__ = [
    "CUDA_ROW_PADDING",
    "PROBE_COLUMNS",
    "device_refuses",
    "device_tensor_bytes",
    "gpu_backend",
    "host_repacks",
    "placed_compute",
    "quant_size",
]

PROBE_COLUMNS = 512  # the batch llama.cpp's weight check multiplies by


def device_refuses(w: WeightTensor, gpu: Device) -> bool:
    """Whether ``gpu`` cannot take weight ``w`` for its op, so llama.cpp keeps it on the host."""
    if not gpu.max_tensor or len(w.shape) < 2:
        return False
    out = w.shape[1] * PROBE_COLUMNS * 4
    inp = w.shape[0] * PROBE_COLUMNS * 4
    return max(w.n_bytes, out, inp) > gpu.max_tensor


CUDA_ROW_PADDING = 512  # ggml-cuda's MATRIX_ROW_PADDING


def device_tensor_bytes(w: WeightTensor, gpu: Device) -> int:
    """What weight ``w`` takes in ``gpu``'s model buffer: ggml's allocation size for it — CUDA
    pads a quantized weight whose rows are not a multiple of 512 values by the rest of one such
    row (``ggml_backend_cuda_buffer_type_get_alloc_size``) — aligned to the buffer type's
    alignment, as ``ggml_backend_alloc_ctx_tensors_from_buft`` lays tensors out."""
    n = w.n_bytes
    if gpu.name.startswith("CUDA") and w.shape and w.shape[0] % CUDA_ROW_PADDING:
        block, size = quant_size(w.ggml_type)
        if block > 1:
            n += (CUDA_ROW_PADDING - w.shape[0] % CUDA_ROW_PADDING) // block * size
    return -(-n // gpu.align) * gpu.align if gpu.align > 1 else n


def quant_size(ggml_type: str) -> tuple[int, int]:
    """(values per block, bytes per block) of a ggml type by name; (1, 0) for one gguf does not know."""
    try:
        return GGML_QUANT_SIZES[GGMLQuantizationType[ggml_type]]
    except KeyError:
        return 1, 0


def host_repacks(w: WeightTensor, gpus: list[Device], repack: bool) -> bool:
    """Whether llama.cpp puts host weight ``w`` in the CPU's repacked buffer (``CPU_REPACK``).

    ``make_cpu_buft_list`` (src/llama-model.cpp) gives a weight on the host these buffer types,
    first taken first when its device supports the weight's op: the first GPU's pinned host type
    (``CUDA_Host``, ``Vulkan_Host``; asked of that GPU), then the CPU's extra types (repack, AMX;
    only with ``use_extra_bufts``), then plain CPU. With mmap a pinned host choice becomes the
    plain mapped buffer (``CPU_Mapped``). So with a GPU in the model only what that GPU refuses
    is repacked; without one, every weight the CPU build repacks (``repack``)."""
    if not (repack and w.repackable):
        return False
    host_gpu = next((g for g in gpus if g.host_buffer), None)
    return host_gpu is None or device_refuses(w, host_gpu)


_ROLES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def _replayed(devs: list[int], n_replay: int, direct: bool) -> list[int]:
    """The real layers the replayed ones stand for: for graphs whose layers differ (``direct``)
    the first ``n_replay - 1`` and the last; otherwise two, or — when the layers sit on several
    devices — every layer compressed to two per run on one device."""
    n = len(devs)
    if direct:
        return [min(i, n - 1) for i in range(n_replay - 1)] + [n - 1]
    if len(set(devs)) == 1:
        return list(range(min(2, n)))
    out: list[int] = []
    run = 0
    for i, d in enumerate(devs):
        run = run + 1 if i and devs[i - 1] == d else 1
        if run <= 2:
            out.append(i)
    return out


def placed_compute(
    t: TextModelInfo,
    tt: TextTensors,
    devs: list[int],
    gpus: list[Device],
    n_ctx: int,
    n_ubatch: int,
    n_batch: int,
    flash_attn: bool,
    type_k: str,
    type_v: str,
    repack: bool,
    offload_kqv: bool = True,
    op_offload: bool = True,
) -> tuple[list[int], int]:
    """(compute bytes per GPU, host compute bytes) for layers placed as ``devs`` (per layer and
    the output layer: a GPU index or -1); ``repack``: the CPU's extra buffer types are on and
    the build repacks (which host weights then are: ``host_repacks``)."""
    by_name = {w.name: w for w in tt.tensors}
    emb = by_name.get("token_embd.weight")
    out = by_name.get("output.weight") or by_name.get("output.weight(tied)")
    out_dev = devs[t.n_layer]
    out_host = out_dev < 0 or (out is not None and device_refuses(out, gpus[out_dev]))
    sizes = {"tok_embd": emb.n_bytes if emb else 0, "out": out.n_bytes if out else 0, "norm": t.n_embd * 4}
    rep = {"out": bool(out and host_repacks(out, gpus, repack))}
    for role in _ROLES:
        w = by_name.get(f"blk.0.{role}.weight")
        if w is not None:
            sizes[role] = w.n_bytes
            rep[role] = host_repacks(w, gpus, repack)
    sizes["bias"] = t.n_embd * 4
    cells = kv_cells(n_ctx)
    e = t.n_head_kv * t.head_dim
    sizes["k"] = int(cells * e * KV_TYPES[type_k].bytes_per_element)
    sizes["v"] = int(cells * e * KV_TYPES[type_v].bytes_per_element)
    arch, n_replay = replayed_graph(t)
    layers = _replayed(devs[: t.n_layer], n_replay, arch in ("gemma3", "qwen3vl"))
    replayed = [devs[i] for i in layers]
    homes = {"tok_embd": "CPU_Mapped", "out_norm": _name(out_dev, gpus, "CPU_Mapped")}
    homes["out"] = ("CPU_REPACK" if rep["out"] else "CPU_Mapped") if out_host else gpus[out_dev].name
    for il, d in enumerate(replayed):
        for role in (*_ROLES, "norm", "bias"):
            host = "CPU_REPACK" if rep.get(role) else "CPU_Mapped"
            homes[f"L{il}:{role}"] = _name(d, gpus, host)
        kv = _name(d, gpus, "CPU") if offload_kqv else "CPU"
        homes[f"kv{il}:k"] = homes[f"kv{il}:v"] = kv
    backends = tuple(gpu_backend(g, op_offload) for g in gpus) + (
        Backend(
            "CPU",
            gpus[0].host_buffer or "CPU",
            gpus[0].host_align if gpus[0].host_buffer else 32,
            gpus[0].max_alloc if gpus[0].host_buffer else 0,
            pad=32 if gpus[0].host_buffer.startswith("Vulkan") else 0,
        ),
    )
    swa = tuple(t.swa_layers[i] for i in layers) if arch == "gemma3" else None
    got = _scheduled(
        arch,
        (t.n_embd, t.n_head, t.n_head_kv, t.head_dim, t.n_ff, t.n_vocab),
        n_ctx,
        n_ubatch,
        n_batch,
        flash_attn,
        type_k,
        type_v,
        len(replayed),
        t.n_deepstack if arch == "qwen3vl" else 0,
        swa,
        t.n_swa if arch == "gemma3" else 1024,
        tuple(sorted(sizes.items())),
        tuple(sorted(homes.items())),
        backends,
        tuple(replayed),
        all(d >= 0 for d in devs),
    )
    return [got.get(g.name, 0) for g in gpus], got.get("CPU", 0)


# the head sizes ggml-cuda's flash attention is built for with K and V of one size
# (ggml_cuda_get_best_fattn_kernel; 192, 320, 512 and 576 need other V sizes or grouped queries)
CUDA_FA_HEADS = (40, 64, 72, 80, 96, 112, 128, 256)


def gpu_backend(g: Device, op_offload: bool = True) -> Backend:
    """The scheduler's view of a GPU: its buffer facts, Vulkan's node reorder, CUDA's flash
    attention head sizes."""
    return Backend(
        g.name,
        g.name,
        g.align,
        g.max_alloc,
        g.max_tensor,
        gpu=True,
        min_batch=32 if op_offload else 1 << 62,
        reorder="vulkan" if g.name.startswith("Vulkan") else "",
        fa_heads=CUDA_FA_HEADS if g.name.startswith("CUDA") else (),
    )


def _name(d: int, gpus: list[Device], host: str) -> str:
    return gpus[d].name if d >= 0 else host


@functools.lru_cache(maxsize=1024)
def _scheduled(
    arch: str,
    dims: tuple[int, ...],
    n_ctx: int,
    n_ubatch: int,
    n_batch: int,
    flash_attn: bool,
    type_k: str,
    type_v: str,
    n_layer: int,
    n_deepstack: int,
    swa_layers: tuple[bool, ...] | None,
    n_swa: int,
    sizes: tuple[tuple[str, int], ...],
    homes: tuple[tuple[str, str], ...],
    backends: tuple[Backend, ...],
    layer_devs: tuple[int, ...],
    full_offload: bool,
) -> dict[str, int]:
    """Per backend: the larger of the prompt-processing and the one-token reserve graph."""
    where = dict(homes)
    cpu = len(backends) - 1

    def pin(u: int) -> Callable[[Tensor], int] | None:
        # llama_context::graph_get_cb: with fewer than 32 tokens, or every layer offloaded, each
        # layer's "norm" runs on that layer's device
        if u >= 32 and not full_offload:
            return None

        def pinned(x: Tensor) -> int:
            if x.op != "RMS_NORM" or not x.name.startswith("norm-"):
                return -1
            d = layer_devs[int(x.name[5:])]
            return d if d >= 0 else cpu

        return pinned

    def home(x: Tensor) -> Home:
        return Home(where[x.home], weights=not x.home.startswith("kv"))

    flags = compute.TextGraph.for_arch(arch, n_deepstack, swa_layers)
    n_kv, n_tokens, n_outputs = compute.text_effective(n_ctx, n_ubatch, n_batch)
    n_kv_swa = None
    if flags.layers is not None:
        _, n_kv_swa = compute.swa_kv_cells(n_ctx, n_swa, min(min(n_ctx, n_batch), n_ubatch), True)
    E, H, Hkv, D, F, V = dims
    best: dict[str, int] = {}
    for u, o in ((n_tokens, n_outputs), (1, 1)):
        g = compute.build_text_graph(
            flags, E, H, Hkv, D, F, V, n_kv, u, o, flash_attn, type_k, type_v, n_layer, n_kv_swa, sizes
        )
        for name, size in schedule(g, backends, home, pin(u)).items():
            best[name] = max(best.get(name, 0), size)
    return best
