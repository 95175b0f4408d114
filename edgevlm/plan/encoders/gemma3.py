"""Gemma 3's vision encoder (projector ``gemma3``): SigLIP through clip.cpp's shared ViT builder
(``clip_graph::build_inp`` / ``build_vit`` / ``build_attn`` / ``build_ffn``), then
``tools/mtmd/models/siglip.cpp``'s Gemma 3 head: the patch grid average-pooled n_merge×n_merge
(4×4: 64×64 patches → 16×16 tokens), RMS norm × ``mm.soft_emb_norm``, and the matmul with
``ggml_cont(ggml_transpose(mm.input_projection))``.

Replayed node by node in ggml's order through ``plan.graphalloc``. Two things the order depends
on: ``build_attn`` puts Q, K and V into the graph as soon as each layer is built
(``ggml_build_forward_order``), so the rest of a layer joins the graph with the next layer's Q;
and the final ``ggml_build_forward_expand`` visits the projection's first operand first, so the
transposed copy of the input projection (F16, n_embd × n_mmproj_embd) is made *before* the last
layer's attention and stays allocated to the end.

What the ProjectorInfo does not say is taken from what ``convert_hf_to_gguf.py`` writes for every
Gemma 3 mmproj: a patch bias, no pre-norm, a post-norm, an F16 input projection. ``ggml_conv_2d``
runs im2col in F16 for F32 and F16 kernels alike (F32 only for a BF16 kernel).
"""

from __future__ import annotations

import math

from ...model.gguf_info import ProjectorInfo
from ..compute import vit_attention
from ..graphalloc import F16, F32, Graph, Tensor
from ..sched import Backend, encoder_bytes

__all__ = ["compute_bytes", "gemma3_graph", "pool_size"]


def gemma3_graph(
    n_patches: int,
    patch_size: int,
    n_embd: int,
    n_head: int,
    n_ff: int,
    n_layer: int,
    n_mmproj_embd: int,
    n_merge: int,
    flash_attn: bool,
    conv_type: str = F16,
    proj_type: str = F16,
) -> Graph:
    g = Graph()
    W = g.EXT
    E, H, F, P, p = n_embd, n_head, n_ff, n_patches, patch_size
    D = E // H
    side = math.isqrt(P)
    if side * side != P:
        raise ValueError(f"gemma3: {P} patches are not a square grid")
    N = P

    inp_raw = g.input("inp_raw", F32, (side * p, side * p, 3))
    # build_inp: ggml_conv_2d (im2col in the kernel's type, matmul, permute + cont) ...
    col = g.op("IM2COL", conv_type, (3 * p * p, side, side), W, inp_raw)
    colr = g.view(col, (3 * p * p, P), op="RESHAPE")
    mm = g.op("MUL_MAT", F32, (P, E), colr, W)
    r = g.view(mm, (side, side, 1, E), op="RESHAPE")
    r = g.view(r, (side, side, E, 1), op="PERMUTE", nb=(4, 4 * side, 4 * P, 4 * P))
    x = g.op("CONT", F32, (side, side, E, 1), r)
    # ... reshape_3d (n_patches, n_embd), transpose, cont, + patch bias
    x = g.view(x, (P, E), op="RESHAPE")
    x = g.view(x, (E, P), op="TRANSPOSE", nb=(4 * P, 4, 4 * P * E, 4 * P * E))
    x = g.op("CONT", F32, (E, P), x)
    x = g.op("ADD", F32, (E, P), x, W)  # patch bias
    # build_vit: learned position embeddings (the weight itself, no positions input)
    x = g.op("ADD", F32, (E, P), x, W)
    x = g.view(x, (E, N), op="RESHAPE")

    def norm(t: Tensor) -> Tensor:
        t = g.op("NORM", F32, (E, N), t)
        t = g.op("MUL", F32, (E, N), t, W)
        return g.op("ADD", F32, (E, N), t, W)

    def linear(t: Tensor, n_out: int, name: str = "") -> Tensor:
        t = g.op("MUL_MAT", F32, (n_out, N), W, t, name=name)
        return g.op("ADD", F32, (n_out, N), t, W)

    inpL = x
    heads = (D, H, N)
    deferred = None
    for il in range(n_layer):
        cur = norm(inpL)
        q = g.view(linear(cur, E, f"Qcur-{il}"), heads, op="RESHAPE")
        k = g.view(linear(cur, E, f"Kcur-{il}"), heads, op="RESHAPE")
        v = g.view(linear(cur, E, f"Vcur-{il}"), heads, op="RESHAPE")
        if il == n_layer - 1:
            # the final expand reaches cont(transpose(mm.input_projection)) before the rest of
            # the last layer (see the module doc)
            wt = g.view(W, (E, n_mmproj_embd), op="TRANSPOSE")
            deferred = g.op("CONT", proj_type, (E, n_mmproj_embd), wt, name="inp_proj_t")
        cur = vit_attention(g, q, k, v, il, D, H, N, E, flash_attn)
        cur = linear(cur, E, f"attn_out-{il}")
        cur = g.op("ADD", F32, (E, N), cur, inpL)  # ffn_inp
        inpL = cur
        cur = norm(cur)
        cur = linear(cur, F, f"ffn_up-{il}")
        cur = g.op("UNARY", F32, (F, N), cur)  # GELU (tanh)
        cur = linear(cur, E, f"ffn_down-{il}")
        inpL = g.op("ADD", F32, (E, N), inpL, cur)  # layer_out
    x = norm(inpL)  # v.post_ln
    x = g.view(x, (E, N, 1), op="RESHAPE")
    if deferred is None:  # no layers: the projection copy comes first in the final expand
        wt = g.view(W, (E, n_mmproj_embd), op="TRANSPOSE")
        deferred = g.op("CONT", proj_type, (E, n_mmproj_embd), wt, name="inp_proj_t")

    # siglip.cpp, PROJECTOR_TYPE_GEMMA3
    s = side // n_merge
    x = g.view(x, (N, E), op="TRANSPOSE", nb=(4 * E, 4, 4 * E * N, 4 * E * N))
    x = g.op("CONT", F32, (side, side, E, 1), x)
    x = g.op("POOL_2D", F32, (s, s, E, 1), x)
    x = g.view(x, (s * s, E, 1), op="RESHAPE")
    x = g.view(x, (E, s * s, 1), op="TRANSPOSE", nb=(4 * s * s, 4, 4 * s * s * E, 4 * s * s * E))
    x = g.op("CONT", F32, (E, s * s, 1), x)
    x = g.op("RMS_NORM", F32, (E, s * s, 1), x)
    x = g.op("MUL", F32, (E, s * s, 1), x, W)  # mm.soft_emb_norm
    g.op("MUL_MAT", F32, (n_mmproj_embd, s * s, 1), deferred, x, name="inp_proj")
    return g


def pool_size(proj: ProjectorInfo) -> int:
    """The pooling kernel: clip.cpp's default 4, or ``clip.vision.projector.scale_factor``."""
    return int(proj.meta.get("clip.vision.projector.scale_factor") or 4)


def compute_bytes(
    proj: ProjectorInfo,
    n_patches: int,
    flash_attn: bool,
    grid: tuple[int, int] | None = None,
    gpu: Backend | None = None,
    host: bool = False,
) -> int:
    """clip's compute buffer for one Gemma 3 image (always the whole 896² view: 4096 patches);
    ``host``: the host-side part when the encoder runs on a GPU (its inputs)."""
    return encoder_bytes(
        gemma3_graph(
            n_patches,
            proj.patch_size,
            proj.n_embd,
            proj.n_head,
            proj.n_ff,
            proj.n_layer,
            proj.n_mmproj_embd,
            pool_size(proj),
            flash_attn,
        ),
        gpu,
        host,
    )
