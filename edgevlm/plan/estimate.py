"""Pure byte arithmetic: what llama.cpp will allocate, per component and device.

Inputs are GGUF tensor tables and settings; nothing here reads files or calls llama.cpp. The
formulas mirror the vendored llama.cpp (``llama-model.cpp`` layer placement,
``llama-kv-cache.cpp`` sizes, the graphs behind ``sched_reserve`` and clip's
``reserve_compute_meta``) and are checked against its logs by the test suite.
"""

from __future__ import annotations

import functools
import importlib
import platform
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, cast

from ..model.audio import AudioEncoderInfo, refusal
from ..model.gguf_info import GGUFFile, ProjectorInfo, TensorInfo, TextModelInfo
from ..model.kv_types import KV_DEFAULT, KV_TYPES
from ..model.projectors import facts
from . import clipgraph, compute, graphalloc
from .encoders import whisper
from .encoders.whisper import WhisperTensors
from .sched import Backend

__all__ = [
    "CTX_PAD",
    "audio_compute_bytes",
    "clip_compute_bytes",
    "HostWeights",
    "kv_bytes",
    "kv_bytes_per_layer",
    "kv_cells",
    "layer_devices",
    "pad",
    "replayed_graph",
    "text_compute_bytes",
    "TextTensors",
    "weight_bytes",
    "WeightTensor",
    "WhisperTensors",
]

# bytes per element of the KV cache types (ggml block size / type size)
CTX_PAD = 256
_BLK_RE = re.compile(r"^blk\.(\d+)\.")
# 2-D weights llama.cpp's CPU backend repacks for matmul, and the row multiple each needs
# (ggml-cpu/repack.cpp ggml_repack_get_optimal_repack_type): on x86 (AVX2; Q2_K with AVX-512)
# Q8_0 is never repacked; on ARM (NEON dotprod / i8mm) it is. A matrix whose row count is not a
# multiple stays in the mapped buffer (InternVL3-1B's 151674-row output).
if platform.machine().lower() in ("arm64", "aarch64"):
    _REPACK_ROWS = {"Q4_0": 4, "IQ4_NL": 4, "Q8_0": 4, "MXFP4": 4, "Q4_K": 8, "Q5_K": 8, "Q6_K": 8}
else:
    _REPACK_ROWS = {"Q4_0": 8, "IQ4_NL": 8, "Q4_K": 8, "Q2_K": 8, "MXFP4": 8}


def _repackable(t: TensorInfo) -> bool:
    """``t``: a GGUF tensor (ggml order: shape[1] is the row count)."""
    rows = _REPACK_ROWS.get(t.ggml_type)
    return rows is not None and len(t.shape) == 2 and t.shape[1] % rows == 0


def pad(n: int, to: int = CTX_PAD) -> int:
    return graphalloc.pad(n, to)


@dataclass(frozen=True)
class WeightTensor:
    name: str
    n_bytes: int
    offset: int
    layer: int  # 0..n_layer-1 for blocks, n_layer for the output layer, -1 for the input layer
    repackable: bool  # a 2-D matmul weight the CPU backend repacks (Q4_0 & co on AVX2/NEON)
    shape: tuple[int, ...] = ()  # ggml order
    ggml_type: str = ""  # ggml's type name ("Q8_0"; its block size and bytes: ``gguf.GGML_QUANT_SIZES``)


@dataclass(frozen=True)
class TextTensors:
    """The text model's weights, tagged with the layer llama.cpp places them by."""

    n_layer: int
    tensors: tuple[WeightTensor, ...]
    tied_output: bool  # no output.weight: llama.cpp duplicates the token embedding for the output

    @classmethod
    def from_gguf(cls, gf: GGUFFile, n_layer: int) -> TextTensors:
        out = []
        has_output = any(t.name == "output.weight" for t in gf.tensors)
        for t in gf.tensors:
            m = _BLK_RE.match(t.name)
            if m:
                layer = int(m.group(1))
            elif t.name.startswith("output"):
                layer = n_layer
            else:  # token embedding, rope factors and other globals stay with the input
                layer = -1
            rep = _repackable(t) and layer >= 0
            out.append(WeightTensor(t.name, t.n_bytes, t.offset, layer, rep, tuple(t.shape), t.ggml_type))
        if not has_output:
            # Tied embeddings: llama.cpp loads token_embd a second time as the output layer's
            # matrix, placed like an output.weight would be — on a GPU when the output layer is
            # offloaded, else repacked for the CPU's matmul when its type allows (the input copy
            # stays mapped); a plain host copy shares the mapped file bytes.
            emb = next((t for t in gf.tensors if t.name == "token_embd.weight"), None)
            if emb is not None:
                rep = _repackable(emb)
                tied = WeightTensor(
                    "output.weight(tied)", emb.n_bytes, emb.offset, n_layer, rep, tuple(emb.shape), emb.ggml_type
                )
                out.append(tied)
        return cls(n_layer, tuple(out), not has_output)

    @property
    def layer_bytes(self) -> list[int]:
        per = [0] * (self.n_layer + 1)
        for t in self.tensors:
            if t.layer >= 0:
                per[t.layer] += t.n_bytes
        return per


def layer_devices(n_layer: int, n_gpu_layers: int, gpu_splits: list[float]) -> list[int]:
    """Device index per layer 0..n_layer (n_layer = the output layer); -1 = host.

    llama.cpp: ``i_gpu_start = max(n_layer + 1 - ngl, 0)``, so ``ngl = 1`` offloads only the
    output layer and ``ngl = n_layer + 1`` everything; GPU layers are split across GPUs by
    the fractions ``gpu_splits`` (free memory by default).
    """
    n_gpu = len(gpu_splits)
    ngl = max(n_gpu_layers, 0)
    act = 0 if n_gpu == 0 else min(ngl, n_layer + 1)
    start = max(n_layer + 1 - ngl, 0)
    total = sum(gpu_splits) or 1.0
    cum, acc = [], 0.0
    for s in gpu_splits:
        acc += s / total
        cum.append(acc)
    out = []
    for il in range(n_layer + 1):
        if act == 0 or il < start or il - start >= act:
            out.append(-1)
            continue
        frac = (il - start) / act
        out.append(next((i for i, c in enumerate(cum) if frac < c), n_gpu - 1))
    return out


@dataclass(frozen=True)
class HostWeights:
    mapped: int  # the file range llama.cpp maps for host tensors (``CPU_Mapped model buffer``)
    repack: int  # ``CPU_REPACK model buffer``: repacked copies of host matmul weights

    @property
    def total(self) -> int:
        return self.mapped + self.repack


def weight_bytes(
    tt: TextTensors,
    devices: list[int],
    repack: bool | Callable[[WeightTensor], bool] = True,
    use_mmap: bool = True,
    stays_host: Callable[[WeightTensor, int], bool] | None = None,
    on_gpu: Callable[[WeightTensor, int], int] | None = None,
) -> tuple[HostWeights, dict[int, int]]:
    """Host buffers and bytes per GPU index for a layer placement (``layer_devices``).

    With mmap the host buffer is the span of the file covering the host tensors that are not
    repacked (what llama.cpp maps and logs); without mmap it is their sum. ``repack``: whether a
    host weight llama.cpp could repack is repacked — for all of them, or per weight
    (``plan.offload.host_repacks``: not where a GPU's pinned host type takes it first).
    ``stays_host(t, gpu)``: a weight that GPU cannot multiply (``plan.offload.device_refuses``),
    which llama.cpp keeps in a host buffer although its layer is offloaded. ``on_gpu(t, gpu)``:
    what a weight takes in that GPU's model buffer (``plan.offload.device_tensor_bytes``;
    default: its bytes).
    """
    repacked = repack if callable(repack) else (lambda t: bool(repack) and t.repackable)
    gpu: dict[int, int] = {}
    rep = 0
    lo, hi, plain = None, 0, 0
    for t in tt.tensors:
        dev = -1 if t.layer < 0 else devices[t.layer]
        if dev >= 0 and stays_host is not None and stays_host(t, dev):
            dev = -1
        if dev >= 0:
            gpu[dev] = gpu.get(dev, 0) + (on_gpu(t, dev) if on_gpu is not None else t.n_bytes)
            continue
        if t.repackable and repacked(t):
            rep += t.n_bytes
            continue
        if t.name.endswith("(tied)"):
            continue  # same file bytes as the input embedding
        plain += t.n_bytes
        lo = t.offset if lo is None else min(lo, t.offset)
        hi = max(hi, t.offset + t.n_bytes)
    mapped = (hi - lo if lo is not None else 0) if use_mmap else plain
    return HostWeights(mapped, rep), gpu


def kv_cells(n_ctx: int) -> int:
    return pad(max(n_ctx, 1))


def kv_bytes_per_layer(n_embd_k_gqa: int, n_embd_v_gqa: int, cells: int, type_k: str, type_v: str) -> int:
    return int(
        cells * (n_embd_k_gqa * KV_TYPES[type_k].bytes_per_element + n_embd_v_gqa * KV_TYPES[type_v].bytes_per_element)
    )


def kv_bytes(
    n_layer: int,
    n_head_kv: int,
    head_dim: int,
    n_ctx: int,
    type_k: str,
    type_v: str,
    devices: list[int] | None = None,
    offload_kqv: bool = True,
    n_swa: int = 0,
    swa_layers: set[int] | None = None,
    n_ubatch: int = 512,
) -> dict[int, int]:
    """KV cache bytes per device index (-1 = host) at llama.cpp's padded context."""
    cells = kv_cells(n_ctx)
    swa_cells = pad(min(cells, n_swa + n_ubatch)) if n_swa else cells
    e = n_head_kv * head_dim
    out: dict[int, int] = {}
    for il in range(n_layer):
        dev = devices[il] if devices is not None else -1
        if not offload_kqv:
            dev = -1
        c = swa_cells if (n_swa and swa_layers and il in swa_layers) else cells
        out[dev] = out.get(dev, 0) + kv_bytes_per_layer(e, e, c, type_k, type_v)
    return out


@functools.lru_cache(maxsize=4096)
def _text_compute(
    arch: str,
    n_embd: int,
    n_head: int,
    n_head_kv: int,
    head_dim: int,
    n_ff: int,
    n_vocab: int,
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
) -> int:
    return compute.text_compute_bytes(
        arch,
        n_embd,
        n_head,
        n_head_kv,
        head_dim,
        n_ff,
        n_vocab,
        n_ctx,
        n_ubatch,
        n_batch,
        flash_attn,
        type_k,
        type_v,
        n_layer,
        n_deepstack=n_deepstack,
        swa_layers=swa_layers,
        n_swa=n_swa,
    )


def replayed_graph(t: TextModelInfo) -> tuple[str, int]:
    """The ``plan.compute`` graph a text model is replayed with, and how many of its layers:
    the buffer does not depend on the depth once there are two layers (gemma3: every layer, for
    its sliding-window pattern; qwen3vl: its deepstack layers and one more)."""
    arch = t.arch if t.arch in ("qwen2vl", "qwen3vl") or (t.arch == "gemma3" and t.swa_layers) else "llama"
    if arch == "gemma3":
        return arch, t.n_layer
    if arch == "qwen3vl":
        return arch, min(t.n_layer, max(2, t.n_deepstack + 1))
    return arch, min(t.n_layer, 2)


def text_compute_bytes(
    t: TextModelInfo,
    n_ctx: int,
    n_ubatch: int,
    n_batch: int,
    flash_attn: bool,
    type_k: str = KV_DEFAULT,
    type_v: str = KV_DEFAULT,
) -> int:
    """Text compute buffer (``sched_reserve``) for a context of ``n_ctx`` tokens (unpadded:
    llama.cpp clamps the batch to it before padding). Exact for the ``llama``, ``qwen2vl``,
    ``qwen3vl`` (its deepstack input) and ``gemma3`` (its sliding-window layers) graphs of
    ``plan.compute``; other architectures are planned with the ``llama`` graph of the same shapes."""
    arch, n_layer = replayed_graph(t)
    swa = tuple(t.swa_layers) if arch == "gemma3" else None
    return _text_compute(
        arch,
        t.n_embd,
        t.n_head,
        t.n_head_kv,
        t.head_dim,
        t.n_ff,
        t.n_vocab,
        n_ctx,
        n_ubatch,
        n_batch,
        flash_attn,
        type_k,
        type_v,
        n_layer,
        t.n_deepstack if arch == "qwen3vl" else 0,
        swa,
        t.n_swa if arch == "gemma3" else 1024,
    )


BUILTIN_GRAPHS = ("mlp", "qwen2vl_merger", "qwen2.5vl_merger")  # in plan.compute


@functools.cache
class _EncoderGraph(Protocol):
    """What a ``plan.encoders`` module offers: its encoder's compute buffer."""

    def compute_bytes(
        self,
        proj: ProjectorInfo,
        n_patches: int,
        flash_attn: bool,
        grid: tuple[int, int] | None = None,
        gpu: Backend | None = None,
        host: bool = False,
    ) -> int: ...


def _encoder_module(name: str | None) -> _EncoderGraph | None:
    """The ``plan.encoders`` module replaying ``name``'s graph, if there is one."""
    if name is None or name in BUILTIN_GRAPHS:
        return None
    try:
        module = importlib.import_module(f"{__package__}.encoders.{name}")
    except ImportError:
        return None
    # every module in plan/encoders defines compute_bytes with this signature (mypy checks each
    # one's definition; the import by name is what it cannot follow)
    return cast(_EncoderGraph, module)


@functools.lru_cache(maxsize=4096)
def _clip_compute(
    ptype: str,
    image_size: int,
    patch_size: int,
    n_embd: int,
    n_head: int,
    n_ff: int,
    n_layer: int,
    n_patches: int,
    n_mmproj_embd: int,
    merge: int,
    flash_attn: bool,
    n_wa_pattern: int,
    gpu: Backend | None = None,
    host: bool = False,
) -> int:
    return clipgraph.clip_compute_bytes(
        ptype,
        image_size,
        patch_size,
        n_embd,
        n_head,
        n_ff,
        n_layer,
        n_patches,
        n_mmproj_embd,
        merge,
        flash_attn,
        n_wa_pattern,
        gpu=gpu,
        host=host,
    )


def clip_compute_bytes(
    proj: ProjectorInfo,
    n_patches: int,
    flash_attn: bool,
    grid: tuple[int, int] | None = None,
    gpu: Backend | None = None,
    host: bool = False,
) -> int:
    """Vision encoder compute buffer for one chunk of ``n_patches`` patches (before merging).

    Exact for the projectors whose encoder graph the facts table names and edgevlm replays
    (``plan.compute``'s built-in ones, ``plan.encoders``' modules); others get a conservative
    upper bound (full attention scores in f32
    plus four activations and the FFN). ``gpu``: the GPU the encoder runs on (ggml's scheduler
    reorders and copies there); ``host`` then asks for the host-side buffer (the pixels and
    positions the CPU fills)."""
    f = facts(proj)
    graph = _encoder_module(f.encoder_graph)
    if graph is not None:
        return graph.compute_bytes(proj, n_patches, flash_attn, grid=grid, gpu=gpu, host=host)
    if f.encoder_graph in BUILTIN_GRAPHS:
        merge = f.merge
        return _clip_compute(
            f.encoder_graph,
            proj.image_size,
            proj.patch_size,
            proj.n_embd,
            proj.n_head,
            proj.n_ff,
            proj.n_layer,
            n_patches,
            proj.n_mmproj_embd,
            merge,
            flash_attn,
            int(proj.n_wa_pattern or 0),
            gpu,
            host,
        )
    if host:
        return 12 * n_patches * proj.patch_size**2 + 16 * n_patches
    n = n_patches + 1
    attn = n * max(proj.n_embd, 1) * 4 * 2 if flash_attn else n * n * max(proj.n_head, 1) * 4
    return attn + n * (4 * proj.n_embd + 3 * max(proj.n_ff, proj.n_embd)) * 4 + 12 * n_patches * proj.patch_size**2


@functools.lru_cache(maxsize=256)
def audio_compute_bytes(
    audio: AudioEncoderInfo,
    flash_attn: bool,
    tensors: WhisperTensors = WhisperTensors(),
    gpu: Backend | None = None,
    host: bool = False,
) -> int:
    """The audio encoder's compute buffer: its own clip context's, beside the vision encoder's,
    reserved at warm-up or the first encode for one 3000-frame window (every window's size, so
    a recording's length does not change it; ``plan.encoders.whisper``, exact). ``tensors``: what
    the graph reads from the file's tensor table (``WhisperTensors.from_gguf``). 0 for an encoder
    this llama.cpp cannot take (``model.audio.refusal``: it is never loaded for audio)."""
    if refusal(audio) is not None:
        return 0
    return whisper.compute_bytes(audio, flash_attn, tensors, gpu, host)
