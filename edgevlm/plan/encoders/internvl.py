"""InternViT + InternVL's projector (``internvl``), replayed node by node as clip.cpp builds it
(``models/internvl.cpp`` over the shared ``clip_graph::build_inp`` / ``build_vit`` /
``build_attn`` / ``build_ffn``), one 448² tile (or the thumbnail) per chunk:

patch conv (+ bias) → CLS appended (``ggml_repeat_4d`` + ``ggml_concat``) → + learned position
embeddings → blocks (LayerNorm, Q/K/V with biases, attention, ``ls1`` layer scale, residual,
LayerNorm, GELU MLP, ``ls2``, residual) → CLS dropped (view + cont) → pixel shuffle (three
``cont``s) → LayerNorm (eps 1e-5) → Linear → GELU → Linear.

Node order is ggml's depth-first order from the graph output, with ``build_attn``'s
``ggml_build_forward_order`` calls putting each block's Q, K, V subgraphs first — what the
allocator sees. The 6B ViT (n_embd 3200, 45 blocks: InternVL 2.5/3 26B+) uses RMS norms and
full-width Q/K norms without Q/K/V biases; that variant follows clip.cpp but was not measured.
"""

from __future__ import annotations

import math

from ...model.gguf_info import ProjectorInfo
from ..compute import vit_attention
from ..graphalloc import F16, F32, Graph, Tensor
from ..sched import Backend, encoder_bytes

__all__ = ["compute_bytes", "internvl_graph"]


def internvl_graph(
    patch_size: int,
    n_embd: int,
    n_head: int,
    n_ff: int,
    n_layer: int,
    px: int,
    py: int,
    n_mmproj_embd: int,
    scale: int,
    flash_attn: bool,
    conv_type: str = F16,
    vit6b: bool = False,
) -> Graph:
    g = Graph()
    W = g.EXT  # weights (their views and reshapes allocate nothing)
    E, H, F, p = n_embd, n_head, n_ff, patch_size
    D = E // H
    P = px * py
    N = P + 1  # + CLS

    inp_raw = g.input("inp_raw", F32, (px * p, py * p, 3, 1))

    # build_inp: ggml_conv_2d (im2col → mul_mat → reshape → permute → cont), reshape, transpose, cont
    col = g.op("IM2COL", conv_type, (3 * p * p, px, py, 1), W, inp_raw)
    colr = g.view(col, (3 * p * p, P), op="RESHAPE")
    mm = g.op("MUL_MAT", F32, (P, E), colr, W)
    r = g.view(mm, (px, py, 1, E), op="RESHAPE")
    r = g.view(r, (px, py, E, 1), op="PERMUTE", nb=(4, 4 * px, 4 * P, 4 * P))
    conv = g.op("CONT", F32, (px, py, E, 1), r)
    x = g.view(conv, (P, E, 1), op="RESHAPE")
    x = g.view(x, (E, P, 1), op="TRANSPOSE", nb=(4 * P, 4, 4 * P * E, 4 * P * E))
    x = g.op("CONT", F32, (E, P, 1), x)
    x = g.op("ADD", F32, (E, P, 1), x, W)  # + v.patch_embd.bias
    # CLS: ggml_repeat_4d(class_embd) then concat along the sequence
    cls = g.op("REPEAT", F32, (E, 1, 1, 1), W)
    x = g.op("CONCAT", F32, (E, N, 1), x, cls)
    # build_vit: + learned position embeddings, flatten the batch
    x = g.op("ADD", F32, (E, N, 1), x, W)
    inpL = g.view(x, (E, N), op="RESHAPE")

    def norm(t: Tensor, ne: tuple[int, ...]) -> Tensor:
        if vit6b:
            t = g.op("RMS_NORM", F32, ne, t)
            return g.op("MUL", F32, ne, t, W)
        t = g.op("NORM", F32, ne, t)
        t = g.op("MUL", F32, ne, t, W)
        return g.op("ADD", F32, ne, t, W)

    def linear(t: Tensor, n_out: int, n_tok: int, bias: bool = True, name: str = "") -> Tensor:
        t = g.op("MUL_MAT", F32, (n_out, n_tok), W, t, name=name)
        return g.op("ADD", F32, (n_out, n_tok), t, W) if bias else t

    for il in range(n_layer):
        cur = norm(inpL, (E, N))
        qkv = []
        for what in ("q", "k", "v"):  # ggml_build_forward_order(Q), (K), (V)
            t = linear(cur, E, N, bias=not vit6b, name=f"{what}-{il}")
            if vit6b and what != "v":  # q_norm / k_norm over the full width (ne[0] = n_embd)
                t = g.op("RMS_NORM", F32, (E, N), t)
                t = g.op("MUL", F32, (E, N), t, W)
            qkv.append(g.view(t, (D, H, N, 1), op="RESHAPE"))
        q, k, v = qkv
        cur = vit_attention(g, q, k, v, il, D, H, N, E, flash_attn)
        cur = linear(cur, E, N, name=f"attn_out-{il}")
        cur = g.op("MUL", F32, (E, N), cur, W)  # ls1
        ffn_inp = g.op("ADD", F32, (E, N), cur, inpL)
        cur = norm(ffn_inp, (E, N))
        cur = linear(cur, F, N, name=f"ffn_up-{il}")
        cur = g.op("UNARY", F32, (F, N), cur)  # GELU
        cur = linear(cur, E, N, name=f"ffn_down-{il}")
        cur = g.op("MUL", F32, (E, N), cur, W)  # ls2
        inpL = g.op("ADD", F32, (E, N), ffn_inp, cur)  # layer_out

    x = g.view(inpL, (E, N, 1), op="RESHAPE")  # build_vit restores the batch dim
    x = g.view(x, (E, P, 1), op="VIEW", nb=(4, 4 * E, 4 * E * N, 4 * E * N))  # drop CLS
    x = g.op("CONT", F32, (E, P, 1), x)
    # pixel shuffle
    s = scale
    x = g.view(x, (E * s, py // s, px, 1), op="RESHAPE")
    x = g.view(x, (E * s, px, py // s, 1), op="PERMUTE", nb=(4, 4 * E * s * (py // s), 4 * E * s, 4 * E * P))
    x = g.op("CONT", F32, (E * s * s, py // s, px // s, 1), x)
    x = g.view(
        x, (E * s * s, px // s, py // s, 1), op="PERMUTE", nb=(4, 4 * E * s * s * (py // s), 4 * E * s * s, 4 * E * P)
    )
    T = (px // s) * (py // s)
    x = g.op("CONT", F32, (E * s * s, T, 1), x)
    # projector: LayerNorm(eps 1e-5) → Linear → GELU → Linear
    M = E * s * s
    x = g.op("NORM", F32, (M, T, 1), x)
    x = g.op("MUL", F32, (M, T, 1), x, W)
    x = g.op("ADD", F32, (M, T, 1), x, W)
    x = linear(x, n_mmproj_embd, T, name="mm1")
    x = g.op("UNARY", F32, (n_mmproj_embd, T), x)
    linear(x, n_mmproj_embd, T, name="mm3")
    return g


def compute_bytes(
    proj: ProjectorInfo,
    n_patches: int,
    flash_attn: bool,
    grid: tuple[int, int] | None = None,
    gpu: Backend | None = None,
    host: bool = False,
) -> int:
    """clip's compute buffer for one ``internvl`` chunk of ``n_patches`` patches (one tile:
    (image_size / patch_size)², the thumbnail has the same size)."""
    side = math.isqrt(max(n_patches, 1))
    if side * side != n_patches:
        side = proj.image_size // proj.patch_size
    scale = int((proj.meta or {}).get("clip.vision.projector.scale_factor", 1) or 1)
    vit6b = proj.n_embd == 3200 and proj.n_layer == 45
    return encoder_bytes(
        internvl_graph(
            proj.patch_size,
            proj.n_embd,
            proj.n_head,
            proj.n_ff,
            proj.n_layer,
            side,
            side,
            proj.n_mmproj_embd,
            scale,
            flash_attn,
            vit6b=vit6b,
        ),
        gpu,
        host,
    )
