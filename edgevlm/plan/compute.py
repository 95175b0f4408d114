"""llama.cpp's compute-buffer sizes, predicted by rebuilding the reserve graphs and replaying
ggml's allocator (``graphalloc``) — exact to the byte on every configuration measured with the
vendored llama.cpp 0.3.36 (105 text and 54 vision-encoder configurations, CPU).

- ``text_compute_bytes``: ``sched_reserve: … compute buffer size`` of the text model (one
  builder for the ``llama``, ``qwen2``, ``qwen2vl``, ``qwen3vl`` and ``gemma3`` graphs, with and
  without flash attention, any KV types), and the blocks the vision graphs share
  (``vit_attention``); the encoders' graphs are ``clipgraph`` (CLIP, Qwen2/2.5-VL) and
  ``encoders/``.

What would differ on other backends: CUDA pads to 128 bytes and adds a host-side buffer and
cuBLAS/pool memory not in the log; Metal/Vulkan may reorder nodes. After a llama.cpp upgrade the
graphs must be re-checked against the real ones (the test suite compares with llama.cpp's logs).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import InputError
from ..model.kv_types import KV_DEFAULT, is_quantized
from .graphalloc import ALIGN, F16, F32, FLAG_INPUT, FLAG_OUTPUT, I32, I64, Graph, Tensor, pad, replay  # noqa: F401

__all__ = [
    "TextGraph",
    "attn_output",
    "build_text_graph",
    "hadamard",
    "kv_rotation",
    "result_head",
    "store_and_attend",
    "swa_kv_cells",
    "swiglu_block",
    "text_compute_bytes",
    "text_effective",
    "vit_attention",
]


# ------------------------------------------------------------------------------------------------
# (a) text model: llama / qwen2vl decoder reserve graph (src/models/llama.cpp, qwen2vl.cpp,
#     src/llama-graph.cpp build_attn / build_attn_mha / build_ffn)
# ------------------------------------------------------------------------------------------------
# Blocks of the one decoder graph (llama, qwen2vl, qwen3vl, gemma3: ``TextGraph``): the same nodes
# in the same order as llama-graph.cpp builds them.


def kv_rotation(type_k: str, type_v: str, head_dim: int) -> tuple[bool, bool, int, int]:
    """Hadamard rotations of quantized K / V caches: (rot_k, rot_v, n_rot_k, n_rot_v)."""
    rot_k = is_quantized(type_k) and head_dim % 64 == 0
    rot_v = is_quantized(type_v) and head_dim % 64 == 0
    nrot_k = 0
    if rot_k:
        nrot_k = 64
        while head_dim % (nrot_k * 2) == 0:
            nrot_k *= 2
    return rot_k, rot_v, nrot_k, 64


def hadamard(g: Graph, x: Tensor, rot: Tensor, n: int, ne3: tuple[int, int, int]) -> Tensor:
    r = g.view(x, (n, (ne3[0] * ne3[1] * ne3[2]) // n), op="RESHAPE")
    m = g.op("MUL_MAT", F32, (n, (ne3[0] * ne3[1] * ne3[2]) // n), rot, r)
    return g.view(m, ne3, op="RESHAPE")


def store_and_attend(
    g: Graph,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    il: int,
    H: int,
    Hkv: int,
    D: int,
    U: int,
    n_kv: int,
    flash_attn: bool,
    k_idxs: Tensor,
    v_idxs: Tensor,
    mask: Tensor,
    v_rot: Tensor | None,
    nrot_v: int,
    kc: Tensor | None = None,
    vc: Tensor | None = None,
) -> Tensor:
    """K and V into the cache (SET_ROWS into ``kc``/``vc``, the layer's K and V caches),
    attention over it, the V rotation undone: (H·D, U)."""
    Eq, Ekv = H * D, Hkv * D
    Kc = kc if kc is not None else g.EXT
    Vc = vc if vc is not None else g.EXT
    kv = g.view(k, (Ekv, U))
    g.ext_op("SET_ROWS", Kc, kv, k_idxs, into=Kc)
    if flash_attn:
        vv = g.view(v, (Ekv, U))
        g.ext_op("SET_ROWS", Vc, vv, v_idxs, into=Vc)
    else:
        vv = g.view(v, (Ekv, U), op="RESHAPE")
        vv = g.view(vv, (1, Ekv * U), op="RESHAPE")
        g.ext_op("SET_ROWS", Vc, vv, v_idxs, into=Vc)

    def q_heads() -> Tensor:  # build_attn_mha: a 4-D view of Q, permuted
        qv = g.view(q, (D, H, U))
        return g.view(qv, (D, U, H), op="PERMUTE", nb=(4, 4 * D * H, 4 * D, 4 * D * H * U))

    def cache_heads(c: Tensor) -> Tensor:  # get_k / get_v: a view of the layer's cache, permuted
        return g.raw_view(g.raw_view(c, c.ext_bytes), c.ext_bytes, op="PERMUTE")

    # (the order is ggml's depth-first visit from the attention's sources)
    if flash_attn:
        qp = q_heads()
        kp, vp = cache_heads(Kc), cache_heads(Vc)
        fa = g.op("FLASH_ATTN_EXT", F32, (D, H, U), qp, kp, vp, mask, name=f"fattn-{il}")
        cur = g.view(fa, (Eq, U), op="RESHAPE")
    else:
        kp = cache_heads(Kc)
        qp = q_heads()
        kq = g.op("MUL_MAT", F32, (n_kv, U, H), kp, qp, name=f"kq-{il}")
        kq = g.op("SOFT_MAX", F32, (n_kv, U, H), kq, mask)
        kqv = g.op("MUL_MAT", F32, (D, U, H), cache_heads(Vc), kq, name=f"kqv-{il}")
        kqp = g.view(kqv, (D, H, U), op="PERMUTE", nb=(4, 4 * D * U, 4 * D, 4 * D * U * H))
        cur = g.op("CONT", F32, (Eq, U), kqp, name=f"kqv_out-{il}")
    if v_rot is not None:
        cur = hadamard(g, cur, v_rot, nrot_v, (Eq, U, 1))
    return cur


def attn_output(
    g: Graph,
    cur: Tensor,
    inpL: Tensor,
    il: int,
    E: int,
    U: int,
    last: bool,
    n_outputs: int,
    out_ids: Tensor,
    lw: Tensor | None = None,
) -> tuple[Tensor, Tensor, int]:
    """The attention's output projection (``lw``: the layer's weights); on the last layer only
    the output rows go on: (cur, residual, rows)."""
    cur = g.op("MUL_MAT", F32, (E, U), lw if lw is not None else g.EXT, cur, name=f"attn_out-{il}")
    if not last:
        return cur, inpL, U
    cur = g.op("GET_ROWS", F32, (E, n_outputs), cur, out_ids)
    res = g.op("GET_ROWS", F32, (E, n_outputs), inpL, out_ids)
    return cur, res, n_outputs


def swiglu_block(
    g: Graph,
    cur: Tensor,
    res: Tensor,
    il: int,
    E: int,
    F: int,
    T: int,
    post_norms: bool = False,
    lw: Callable[[str], Tensor] | None = None,
) -> Tensor:
    """Residual add, RMS norm, gated FFN (SwiGLU; Gemma's GeGLU has the same nodes), residual add:
    the layer's output (E, T). ``post_norms`` (Gemma 3): an RMS norm on the attention's output
    before the add and on the FFN's output before the second add."""

    def W(role: str) -> Tensor:  # the layer's weight of this role
        return lw(role) if lw is not None else g.EXT

    def rms(x: Tensor) -> Tensor:
        return g.op("MUL", F32, (E, T), g.op("RMS_NORM", F32, (E, T), x, name=f"norm-{il}"), W("norm"))

    ffn_inp = g.op("ADD", F32, (E, T), rms(cur) if post_norms else cur, res)
    ffn_norm = rms(ffn_inp)
    gate = g.op("MUL_MAT", F32, (F, T), W("ffn_gate"), ffn_norm, name=f"ffn_gate-{il}")
    up = g.op("MUL_MAT", F32, (F, T), W("ffn_up"), ffn_norm, name=f"ffn_up-{il}")
    glu = g.op("GLU", F32, (F, T), gate, up, name=f"ffn_glu-{il}")
    down = g.op("MUL_MAT", F32, (E, T), W("ffn_down"), glu, name=f"ffn_out-{il}")
    return g.op("ADD", F32, (E, T), rms(down) if post_norms else down, ffn_inp)


def vit_attention(
    g: Graph,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    il: int,
    D: int,
    H: int,
    N: int,
    E: int,
    flash_attn: bool,
    nb_heads: tuple[int, int, int, int] | None = None,
) -> Tensor:
    """clip's ``build_attn`` with no cache and no mask: q, k, v are (D, H, N) views of (E, N)
    rows (``nb_heads``: their permuted strides); flash attention on F16 copies, or KQ → softmax →
    KQV. The result is (E, N)."""
    nb = nb_heads or (4, 4 * E, 4 * D, 4 * E * N)
    if flash_attn:
        qp = g.view(q, (D, N, H), op="PERMUTE", nb=nb)
        kp = g.view(k, (D, N, H), op="PERMUTE", nb=nb)
        kc = g.op("CPY", F16, (D, N, H), kp)
        vp = g.view(v, (D, N, H), op="PERMUTE", nb=nb)
        vc = g.op("CPY", F16, (D, N, H), vp)
        fa = g.op("FLASH_ATTN_EXT", F32, (D, H, N), qp, kc, vc, name=f"fattn-{il}")
        return g.view(fa, (E, N), op="RESHAPE")
    vp = g.view(v, (N, D, H), op="PERMUTE", nb=(4 * E, 4, 4 * D, 4 * E * N))
    vc = g.op("CONT", F32, (N, D, H), vp)
    kp = g.view(k, (D, N, H), op="PERMUTE", nb=nb)
    qp = g.view(q, (D, N, H), op="PERMUTE", nb=nb)
    kq = g.op("MUL_MAT", F32, (N, N, H), kp, qp, name=f"kq-{il}")
    kq = g.op("SOFT_MAX", F32, (N, N, H), kq)
    kqv = g.op("MUL_MAT", F32, (D, N, H), vc, kq, name=f"kqv-{il}")
    kqv = g.view(kqv, (D, H, N), op="PERMUTE", nb=(4, 4 * D * N, 4 * D, 4 * E * N))
    return g.op("CONT", F32, (E, N), kqv)


def result_head(
    g: Graph, inpL: Tensor, E: int, V: int, n_outputs: int, norm_w: Tensor | None = None, out_w: Tensor | None = None
) -> None:
    norm = g.op("RMS_NORM", F32, (E, n_outputs), inpL)
    nw = norm_w if norm_w is not None else g.EXT
    rn = g.op("MUL", F32, (E, n_outputs), norm, nw, flags=FLAG_OUTPUT, name="result_norm")
    g.op(
        "MUL_MAT",
        F32,
        (V, n_outputs),
        out_w if out_w is not None else g.EXT,
        rn,
        flags=FLAG_OUTPUT,
        name="result_output",
    )


@dataclass(frozen=True)
class TextGraph:
    """What one decoder family's reserve graph adds to llama's (``src/models/*.cpp``), as flags
    of the one builder below:

    - ``qwen2vl``: Q/K/V bias adds, 4 positions per token (M-RoPE);
    - ``qwen3vl``: Q/K RMS norms, 4 positions, the token embeddings padded to
      n_embd × (1 + n_deepstack) (``build_inp_embd``: GET_ROWS → PAD, then a view) and one
      deepstack ADD after each of the first ``n_deepstack`` layers;
    - ``gemma3``: the embedding scale, Q/K norms, Q scaled after RoPE, Q → K → V order,
      post-attention and post-FFN norms, and the iSWA cache: per layer kind (sliding-window or
      global) its own index sets and mask, made at its first layer (``layers``: True = SWA)."""

    bias: bool = False
    n_pos: int = 1
    qk_norm: bool = False
    n_deepstack: int = 0
    embed_scale: bool = False
    q_scale: bool = False
    qkv_order: str = "qvk"
    post_norms: bool = False
    layers: tuple[bool, ...] | None = None  # per replayed layer, True = sliding window; None: all global

    @classmethod
    def for_arch(cls, arch: str, n_deepstack: int = 0, swa_layers: tuple[bool, ...] | None = None) -> TextGraph:
        if arch == "qwen2vl":
            return cls(bias=True, n_pos=4)
        if arch == "qwen3vl":
            return cls(n_pos=4, qk_norm=True, n_deepstack=n_deepstack)
        if arch == "gemma3":
            return cls(
                qk_norm=True,
                embed_scale=True,
                q_scale=True,
                qkv_order="qkv",
                post_norms=True,
                layers=tuple(swa_layers) if swa_layers else None,
            )
        return cls()  # llama, and the estimate for architectures without a graph of their own


@dataclass(frozen=True)
class _CacheInputs:
    """The inputs of one cache kind (full or sliding-window), made at its first layer: the
    Hadamard rotations (quantized caches only), the rows K and V go to, the attention mask."""

    k_rot: Tensor | None
    v_rot: Tensor | None
    k_idxs: Tensor
    v_idxs: Tensor
    mask: Tensor


def build_text_graph(
    f: TextGraph,
    n_embd: int,
    n_head: int,
    n_head_kv: int,
    head_dim: int,
    n_ff: int,
    n_vocab: int,
    n_kv: int,
    n_tokens: int,
    n_outputs: int,
    flash_attn: bool,
    type_k: str,
    type_v: str,
    n_layer: int,
    n_kv_swa: int | None = None,
    sizes: tuple[tuple[str, int], ...] = (),
) -> Graph:
    """The reserve graph. Each weight and cache is its own external tensor, tagged with where
    it lives (``Tensor.home``: "tok_embd", "out_norm", "out", "L<il>:<role>", "kv<il>:k|v") and
    sized from ``sizes`` (role → bytes: "tok_embd", "out", "attn_q", "attn_k", "attn_v",
    "attn_output", "ffn_gate", "ffn_up", "ffn_down", "norm", "bias", "k", "v"), which is what the
    scheduler's replay (``plan.sched``) needs; the allocator alone ignores them."""
    g = Graph()
    E, H, Hkv, D, F, V, U = n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab, n_tokens
    Ekv = Hkv * D
    Ein = E * (1 + f.n_deepstack)
    rot_k, rot_v, nrot_k, nrot_v = kv_rotation(type_k, type_v, D)
    layers = f.layers if f.layers is not None else (False,) * n_layer
    size = dict(sizes)

    def w(il: int, role: str) -> Tensor:
        return g.weight(f"L{il}:{role}", size.get(role, 0))

    caches = [
        (g.cache(f"kv{il}:k", size.get("k", 0)), g.cache(f"kv{il}:v", size.get("v", 0))) for il in range(len(layers))
    ]

    # leafs, in the order the graph reaches them: the tokens, the vector-embedding input
    # (allocated, never used → never freed), then per cache kind at its first layer: k_rot
    # (hadamard on Q), inp_pos (first layer only), v_rot, k_idxs, v_idxs, kq_mask; out_ids last
    inp_tokens = g.input("inp_tokens", I32, (U,))
    g.input("inp_embd", F32, (Ein, U))
    ins: dict[bool, _CacheInputs] = {}
    inp_pos = None
    for swa in layers:
        if swa in ins:
            continue
        k_rot = g.input("attn_inp_k_rot", F32, (nrot_k, nrot_k)) if rot_k else None
        if inp_pos is None:
            inp_pos = g.input("inp_pos", I32, (U * f.n_pos,))
        v_rot = g.input("attn_inp_v_rot", F32, (nrot_v, nrot_v)) if rot_v else None
        k_idxs = g.input("k_idxs", I64, (U,))
        v_idxs = g.input("v_idxs", I64, (U if flash_attn else U * Ekv,))
        cells = n_kv_swa if swa else n_kv
        assert cells is not None  # sliding-window layers come only with n_kv_swa (text_compute_bytes)
        mask = g.input("kq_mask", F16 if flash_attn else F32, (cells, U))
        ins[swa] = _CacheInputs(k_rot, v_rot, k_idxs, v_idxs, mask)
    out_ids = g.input("out_ids", I32, (n_outputs,))

    def rms(x: Tensor, ne: tuple[int, ...], il: int) -> Tensor:  # build_norm names every layer's RMS norm "norm-<il>"
        x = g.op("RMS_NORM", F32, ne, x, name=f"norm-{il}")
        return g.op("MUL", F32, ne, x, w(il, "norm"))

    def proj(x: Tensor, rows: int, heads: int, name: str, il: int) -> Tensor:
        y = g.op("MUL_MAT", F32, (rows, U), w(il, f"attn_{name.lower()}"), x, name=f"{name}cur-{il}")
        if f.bias:
            y = g.op("ADD", F32, (rows, U), y, w(il, "bias"))
        return g.view(y, (D, heads, U), op="RESHAPE")

    inpL = g.op("GET_ROWS", F32, (E, U), g.weight("tok_embd", size.get("tok_embd", 0)), inp_tokens, name="embd")
    if f.embed_scale:
        inpL = g.op("SCALE", F32, (E, U), inpL, name="inp_scaled")  # * sqrt(n_embd)
    inp_embd = inpL
    if f.n_deepstack:
        padded = g.op("PAD", F32, (Ein, U), inpL)  # the token path padded to n_embd_inp
        inpL = inp_embd = g.view(padded, (E, U), nb=(4, 4 * Ein, 4 * Ein * U, 4 * Ein * U))
    for il, swa in enumerate(layers):
        d = ins[swa]
        layer_kv = n_kv_swa if swa else n_kv
        assert layer_kv is not None  # sliding-window layers come only with n_kv_swa (text_compute_bytes)
        cur = rms(inpL, (E, U), il)
        qkv = {}
        for which in f.qkv_order:
            if which == "q":
                q = proj(cur, H * D, H, "Q", il)
                if f.qk_norm:
                    q = rms(q, (D, H, U), il)
                q = g.op("ROPE", F32, (D, H, U), q, inp_pos, name=f"Qrope-{il}")
                if f.q_scale:
                    q = g.op("SCALE", F32, (D, H, U), q)
                if d.k_rot is not None:  # (there is one when rot_k)
                    q = hadamard(g, q, d.k_rot, nrot_k, (D, H, U))
                qkv["q"] = q
            elif which == "k":
                k = proj(cur, Ekv, Hkv, "K", il)
                if f.qk_norm:
                    k = rms(k, (D, Hkv, U), il)
                k = g.op("ROPE", F32, (D, Hkv, U), k, inp_pos, name=f"Krope-{il}")
                if d.k_rot is not None:
                    k = hadamard(g, k, d.k_rot, nrot_k, (D, Hkv, U))
                qkv["k"] = k
            else:
                v = proj(cur, Ekv, Hkv, "V", il)
                if d.v_rot is not None:  # (there is one when rot_v)
                    v = hadamard(g, v, d.v_rot, nrot_v, (D, Hkv, U))
                qkv["v"] = v
        cur = store_and_attend(
            g,
            qkv["q"],
            qkv["k"],
            qkv["v"],
            il,
            H,
            Hkv,
            D,
            U,
            layer_kv,
            flash_attn,
            d.k_idxs,
            d.v_idxs,
            d.mask,
            d.v_rot,
            nrot_v,
            *caches[il],
        )
        cur, res, T = attn_output(
            g, cur, inpL, il, E, U, il == len(layers) - 1, n_outputs, out_ids, w(il, "attn_output")
        )
        inpL = swiglu_block(g, cur, res, il, E, F, T, post_norms=f.post_norms, lw=functools.partial(w, il))
        if il < f.n_deepstack:  # deepstack_out: + feature il of the wide input embedding
            ds = g.view(inp_embd, (E, U), nb=(4, 4 * Ein, 4 * Ein * U, 4 * Ein * U))
            inpL = g.op("ADD", F32, (E, T), inpL, ds, name=f"deepstack_out-{il}")
    result_head(
        g, inpL, E, V, n_outputs, g.weight("out_norm", size.get("norm", 0)), g.weight("out", size.get("out", 0))
    )
    return g


def text_effective(n_ctx: int, n_ubatch: int, n_batch: int, n_outputs_max: int = 0) -> tuple[int, int, int]:
    """(n_kv, n_tokens, n_outputs) of the worst-case prompt-processing reserve graph.

    llama_context ctor: n_batch = min(n_ctx, n_batch) (causal attention; the *unpadded* n_ctx),
    n_ubatch = min(n_batch, n_ubatch), then n_ctx is padded up to a multiple of 256.
    sched_reserve: n_tokens = min(n_ctx, n_ubatch); the KV view spans the whole cache
    (init_full → n_kv = kv size = padded n_ctx); n_outputs = min(n_tokens, n_outputs_max) where
    n_outputs_max = n_batch (llama_context_params.n_outputs_max = 0 by default) → n_tokens.
    """
    n_batch = min(n_ctx, n_batch)
    n_ubatch = min(n_batch, n_ubatch if n_ubatch else n_batch)
    n_kv = pad(n_ctx, 256)
    n_tokens = min(n_kv, n_ubatch)
    return n_kv, n_tokens, min(n_tokens, n_outputs_max if n_outputs_max else n_batch)


def text_compute_bytes(
    arch: str,
    n_embd: int,
    n_head: int,
    n_head_kv: int,
    head_dim: int,
    n_ff: int,
    n_vocab: int,
    n_ctx: int,
    n_ubatch: int = 512,
    n_batch: int = 512,
    flash_attn: bool = False,
    type_k: str = KV_DEFAULT,
    type_v: str = KV_DEFAULT,
    n_layer: int = 2,
    n_outputs_max: int = 0,
    *,
    n_deepstack: int = 0,
    swa_layers: tuple[bool, ...] | None = None,
    n_swa: int = 1024,
    swa_full: bool = True,
) -> int:
    """Predicted ``sched_reserve: CPU compute buffer size`` in bytes (exact allocator replay).

    arch: "llama", "qwen2vl", "qwen3vl" (``n_deepstack``: the GGUF's
    ``qwen3vl.n_deepstack_layers``) or "gemma3" (``swa_layers``: per layer, True = sliding window,
    every layer replayed; ``n_swa``, ``swa_full``: the iSWA cache) — see ``TextGraph``; any other
    name gets llama's graph. n_layer: the buffer does not depend on it once n_layer >= 2 (layers
    reuse the same space; qwen3vl: once every deepstack layer and one more are in);
    n_layer = 1 differs slightly (the out_ids row-gather happens in layer 0).
    n_outputs_max: llama_context_params.n_outputs_max (0 = n_batch, the default; llama_cpp.Llama
    never sets it).  The reserve graph computes logits for min(n_ubatch, n_outputs_max) rows.
    Reserve builds the pp graph (n_tokens = n_ubatch, n_outputs = n_ubatch, n_kv = n_ctx) and the tg
    graph (1 token, 1 output); the buffer only grows, so the result is the max of both.
    """
    if is_quantized(type_v) and not flash_attn:
        raise InputError("a quantized V cache requires flash attention")
    flags = TextGraph.for_arch(arch, n_deepstack, swa_layers if arch == "gemma3" else None)
    if arch == "qwen3vl":
        n_layer = min(n_layer, max(2, n_deepstack + 1))
    n_kv, n_tokens, n_outputs = text_effective(n_ctx, n_ubatch, n_batch, n_outputs_max)
    n_kv_swa = None
    if flags.layers is not None:
        _, n_kv_swa = swa_kv_cells(n_ctx, n_swa, min(min(n_ctx, n_batch), n_ubatch), swa_full)
    dims = (n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab, n_kv)
    pp = replay(build_text_graph(flags, *dims, n_tokens, n_outputs, flash_attn, type_k, type_v, n_layer, n_kv_swa))
    tg = replay(build_text_graph(flags, *dims, 1, 1, flash_attn, type_k, type_v, n_layer, n_kv_swa))
    return max(pp, tg)


def swa_kv_cells(
    n_ctx: int, n_swa: int, n_ubatch: int, swa_full: bool = True, n_seq_max: int = 1, kv_unified: bool = False
) -> tuple[int, int]:
    """(base cells, SWA cells) of llama_kv_cache_iswa (llama-kv-cache-iswa.cpp)."""
    base = pad(max(n_ctx, 1), 256)
    if swa_full:
        return base, base
    return base, pad(min(base, n_swa * (n_seq_max if kv_unified else 1) + n_ubatch), 256)
