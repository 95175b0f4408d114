"""Gemma 3's text reserve graph (``src/models/gemma3.cpp`` with the iSWA KV cache,
``llama-graph.cpp`` ``build_attn`` for ``llm_graph_input_attn_kv_iswa``), replayed through
``plan.graphalloc`` like ``compute``'s llama graph: two masks and index sets (sliding-window and
global layers), Q/K norms, post-attention and post-FFN norms, the embedding scale. The buffer
depends on the layer pattern, so every layer is replayed (34 layers: 0.04 s)."""

from __future__ import annotations

from .compute import (
    attn_output,
    hadamard,
    kv_rotation,
    result_head,
    store_and_attend,
    text_effective,
)
from .graphalloc import F16, F32, I32, I64, Graph, pad, replay

__all__ = ["gemma3_text_compute_bytes", "swa_kv_cells"]


def _gemma3_text_graph(n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab, n_kv, n_kv_swa,
                       n_tokens, n_outputs, flash_attn, type_k, type_v, layer_swa):
    """layer_swa: per replayed layer, True = sliding-window layer (uses the SWA cache's inputs)."""
    g = Graph()
    E, H, Hkv, D, F, V, U = n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab, n_tokens
    Eq, Ekv = H * D, Hkv * D
    rot_k, rot_v, nrot_k, nrot_v = kv_rotation(type_k, type_v, D)
    W = g.EXT

    # leafs in the order the graph reaches them: the embedding select, then per cache kind
    # (SWA / base) at its first layer: k_rot (hadamard on Q), inp_pos (first layer only),
    # v_rot, k_idxs, v_idxs, kq_mask; out_ids at the last layer
    inp_tokens = g.input("inp_tokens", I32, (U,))
    g.input("inp_embd", F32, (E, U))
    ins = {}
    inp_pos = None
    for il, swa in enumerate(layer_swa):
        if swa in ins:
            continue
        nk = n_kv_swa if swa else n_kv
        d = {}
        d["k_rot"] = g.input("k_rot", F32, (nrot_k, nrot_k)) if rot_k else None
        if inp_pos is None:
            inp_pos = g.input("inp_pos", I32, (U,))
        d["v_rot"] = g.input("v_rot", F32, (nrot_v, nrot_v)) if rot_v else None
        d["k_idxs"] = g.input("k_idxs", I64, (U,))
        d["v_idxs"] = g.input("v_idxs", I64, (U if flash_attn else U * Ekv,))
        d["mask"] = g.input("kq_mask", F16 if flash_attn else F32, (nk, U))
        ins[swa] = d
    out_ids = g.input("out_ids", I32, (n_outputs,))

    def rms(x, ne):
        x = g.op("RMS_NORM", F32, ne, x)
        return g.op("MUL", F32, ne, x, W)

    inpL = g.op("GET_ROWS", F32, (E, U), W, inp_tokens, name="embd")
    inpL = g.op("SCALE", F32, (E, U), inpL, name="inp_scaled")     # * sqrt(n_embd)
    n_layer = len(layer_swa)
    for il, swa in enumerate(layer_swa):
        last = il == n_layer - 1
        d = ins[swa]
        n_kv_l = n_kv_swa if swa else n_kv
        cur = rms(inpL, (E, U))
        # build_attn (iSWA) expands Q, then K, then V
        q = g.op("MUL_MAT", F32, (Eq, U), W, cur, name=f"Qcur-{il}")
        q = g.view(q, (D, H, U), op="RESHAPE")
        q = rms(q, (D, H, U))
        q = g.op("ROPE", F32, (D, H, U), q, inp_pos, name=f"Qrope-{il}")
        q = g.op("SCALE", F32, (D, H, U), q)
        if rot_k:
            q = hadamard(g, q, d["k_rot"], nrot_k, (D, H, U))
        k = g.op("MUL_MAT", F32, (Ekv, U), W, cur, name=f"Kcur-{il}")
        k = g.view(k, (D, Hkv, U), op="RESHAPE")
        k = rms(k, (D, Hkv, U))
        k = g.op("ROPE", F32, (D, Hkv, U), k, inp_pos, name=f"Krope-{il}")
        if rot_k:
            k = hadamard(g, k, d["k_rot"], nrot_k, (D, Hkv, U))
        v = g.op("MUL_MAT", F32, (Ekv, U), W, cur, name=f"Vcur-{il}")
        v = g.view(v, (D, Hkv, U), op="RESHAPE")
        if rot_v:
            v = hadamard(g, v, d["v_rot"], nrot_v, (D, Hkv, U))
        cur = store_and_attend(g, q, k, v, il, H, Hkv, D, U, n_kv_l, flash_attn, d["k_idxs"], d["v_idxs"],
                               d["mask"], d["v_rot"], nrot_v)
        cur, res, T = attn_output(g, cur, inpL, il, E, U, last, n_outputs, out_ids)
        cur = rms(cur, (E, T))                                          # attn_post_norm
        sa_out = g.op("ADD", F32, (E, T), cur, res)
        cur = rms(sa_out, (E, T))                                       # ffn_norm
        gate = g.op("MUL_MAT", F32, (F, T), W, cur, name=f"ffn_gate-{il}")
        up = g.op("MUL_MAT", F32, (F, T), W, cur, name=f"ffn_up-{il}")
        glu = g.op("GLU", F32, (F, T), gate, up, name=f"ffn_geglu-{il}")
        cur = g.op("MUL_MAT", F32, (E, T), W, glu, name=f"ffn_out-{il}")
        cur = rms(cur, (E, T))                                          # ffn_post_norm
        inpL = g.op("ADD", F32, (E, T), cur, sa_out)
    result_head(g, inpL, E, V, n_outputs)
    return g


def swa_kv_cells(n_ctx: int, n_swa: int, n_ubatch: int, swa_full: bool = True, n_seq_max: int = 1,
                 kv_unified: bool = False) -> tuple[int, int]:
    """(base cells, SWA cells) of llama_kv_cache_iswa (llama-kv-cache-iswa.cpp)."""
    base = pad(max(n_ctx, 1), 256)
    if swa_full:
        return base, base
    return base, pad(min(base, n_swa * (n_seq_max if kv_unified else 1) + n_ubatch), 256)


def gemma3_text_compute_bytes(n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab, n_ctx,
                              n_ubatch=512, n_batch=512, flash_attn=False, type_k="f16",
                              type_v="f16", swa_layers=(True, False), n_swa=1024,
                              swa_full=True, n_outputs_max=0):
    n_kv, n_tokens, n_outputs = text_effective(n_ctx, n_ubatch, n_batch, n_outputs_max)
    n_ub = min(min(n_ctx, n_batch), n_ubatch)
    _, n_kv_swa = swa_kv_cells(n_ctx, n_swa, n_ub, swa_full)
    kinds = list(swa_layers)
    pp = replay(_gemma3_text_graph(n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab, n_kv, n_kv_swa,
                                   n_tokens, n_outputs, flash_attn, type_k, type_v, kinds))
    tg = replay(_gemma3_text_graph(n_embd, n_head, n_head_kv, head_dim, n_ff, n_vocab, n_kv, n_kv_swa,
                                   1, 1, flash_attn, type_k, type_v, kinds))
    return max(pp, tg)
