"""The ``idefics3`` encoder graph (SmolVLM / Idefics3): SigLIP through clip.cpp's shared ViT
builder, then a pixel shuffle and one linear projection (``tools/mtmd/models/siglip.cpp``,
``clip_graph::build_inp`` / ``build_vit`` / ``build_attn`` / ``build_ffn`` /
``build_patch_merge_permute`` in ``tools/mtmd/clip.cpp``).

One chunk is one tile (SigLIP does not batch tiles), so the buffer does not depend on the image:
mtmd's warmup reserves the same graph (warmup size = image_size for idefics3).

Node order is the one ggml's graph builder produces (depth-first from the output, Q/K/V pinned
in that order by ``ggml_build_forward_order``), replayed through ``plan.graphalloc``:

    inp_raw → im2col (F16; F32 for a BF16 patch kernel) → mul_mat
    → cont (permute) → cont (transpose) → + patch bias → + learned position embeddings
    → blocks (LayerNorm, Q/K/V with bias, attention with or without flash attention, out proj,
       residual, LayerNorm, up + bias → GELU → down + bias, residual)
    → post LayerNorm → pixel shuffle (reshape, permute, cont_3d, permute, cont_2d)
    → mm.model.fc (no bias)
"""

from __future__ import annotations

import functools
import math

from ...model.gguf_info import ProjectorInfo
from ..compute import vit_attention
from ..graphalloc import F16, F32, Graph, Tensor
from ..sched import Backend, encoder_bytes

__all__ = ["compute_bytes", "graph"]

_KEY_SCALE = "clip.vision.projector.scale_factor"


@functools.lru_cache(maxsize=64)
def _conv_type(path: str | None) -> str:
    """im2col's output type in ``ggml_conv_2d``: F16, unless ``v.patch_embd.weight`` is BF16
    (then F32). Converted SmolVLM files keep the patch kernel in F32 (→ F16 im2col)."""
    if not path:
        return F16
    from ...errors import ModelFileError
    from ...model.gguf_info import read_gguf

    try:
        t = read_gguf(path).tensor("v.patch_embd.weight")
    except (ModelFileError, OSError):  # unreadable here: the usual F32/F16 kernel
        return F16
    if t is not None and t.ggml_type == "BF16":
        return F32
    return F16


def graph(
    patch_size: int,
    n_embd: int,
    n_head: int,
    n_ff: int,
    n_layer: int,
    n_px: int,
    n_py: int,
    n_mmproj_embd: int,
    scale: int,
    flash_attn: bool,
    conv_type: str = F16,
    has_patch_bias: bool = True,
    has_post_ln: bool = True,
) -> Graph:
    g = Graph()
    W = g.EXT
    E, Hh, Ff, p = n_embd, n_head, n_ff, patch_size
    P = n_px * n_py
    D = E // Hh
    N = P

    g.input("inp_raw", F32, (n_px * p, n_py * p, 3, 1))
    inp_raw = g.leafs[-1]
    # ggml_conv_2d: im2col → mul_mat → reshape_4d → permute → cont
    col = g.op("IM2COL", conv_type, (3 * p * p, n_px, n_py, 1), W, inp_raw)
    colr = g.view(col, (3 * p * p, P), op="RESHAPE")
    mm = g.op("MUL_MAT", F32, (P, E), colr, W)
    r = g.view(mm, (n_px, n_py, 1, E), op="RESHAPE")
    r = g.view(r, (n_px, n_py, E, 1), op="PERMUTE", nb=(4, 4 * n_px, 4 * P, 4 * P))
    x = g.op("CONT", F32, (n_px, n_py, E, 1), r)
    # build_inp: reshape_3d(n_patches, n_embd, 1) → transpose → cont (+ patch bias)
    x = g.view(x, (P, E, 1), op="RESHAPE")
    x = g.view(x, (E, P, 1), op="TRANSPOSE", nb=(4 * P, 4, 4 * P * E, 4 * P * E))
    x = g.op("CONT", F32, (E, P, 1), x)
    if has_patch_bias:
        x = g.op("ADD", F32, (E, P, 1), x, W)
    # build_vit: + learned position embeddings, flatten the batch
    x = g.op("ADD", F32, (E, P, 1), x, W)
    x = g.view(x, (E, P), op="RESHAPE")

    def norm(t: Tensor) -> Tensor:
        t = g.op("NORM", F32, (E, N), t)
        t = g.op("MUL", F32, (E, N), t, W)
        return g.op("ADD", F32, (E, N), t, W)

    inpL = x
    for il in range(n_layer):
        cur = norm(inpL)
        q = g.op("ADD", F32, (E, N), g.op("MUL_MAT", F32, (E, N), W, cur, name=f"Qmm-{il}"), W)
        q = g.view(q, (D, Hh, N, 1), op="RESHAPE")
        k = g.op("ADD", F32, (E, N), g.op("MUL_MAT", F32, (E, N), W, cur), W)
        k = g.view(k, (D, Hh, N, 1), op="RESHAPE")
        v = g.op("ADD", F32, (E, N), g.op("MUL_MAT", F32, (E, N), W, cur), W)
        v = g.view(v, (D, Hh, N, 1), op="RESHAPE")
        cur = vit_attention(g, q, k, v, il, D, Hh, N, E, flash_attn)
        cur = g.op("ADD", F32, (E, N), g.op("MUL_MAT", F32, (E, N), W, cur), W)
        cur = g.op("ADD", F32, (E, N), cur, inpL)  # ffn_inp
        inpL = cur
        cur = norm(cur)
        up = g.op("ADD", F32, (Ff, N), g.op("MUL_MAT", F32, (Ff, N), W, cur, name=f"ffn_up-{il}"), W)
        cur = g.op("UNARY", F32, (Ff, N), up)  # GELU
        cur = g.op("ADD", F32, (E, N), g.op("MUL_MAT", F32, (E, N), W, cur), W)
        inpL = g.op("ADD", F32, (E, N), inpL, cur)  # layer_out
    x = inpL
    if has_post_ln:
        x = norm(x)
    x = g.view(x, (E, N, 1), op="RESHAPE")  # restore the batch dim

    # build_patch_merge_permute (pixel shuffle)
    w_, h_ = n_px, n_py
    x = g.view(x, (E, w_, h_), op="RESHAPE")
    pad_w, pad_h = -w_ % scale, -h_ % scale
    if pad_w or pad_h:
        w_, h_ = w_ + pad_w, h_ + pad_h
        x = g.op("PAD", F32, (E, w_, h_), x)
    s = scale
    x = g.view(x, (E * s, w_ // s, h_), op="RESHAPE")
    x = g.view(x, (E * s, h_, w_ // s), op="PERMUTE", nb=(4, 4 * E * s * w_ // s, 4 * E * s, 4 * E * w_ * h_))
    x = g.op("CONT", F32, (E * s * s, h_ // s, w_ // s), x)
    x = g.view(
        x, (E * s * s, w_ // s, h_ // s), op="PERMUTE", nb=(4, 4 * E * s * s * h_ // s, 4 * E * s * s, 4 * E * w_ * h_)
    )
    n_out = (w_ // s) * (h_ // s)
    x = g.op("CONT", F32, (E * s * s, n_out), x, name="pixel_shuffle")
    g.op("MUL_MAT", F32, (n_mmproj_embd, n_out), W, x, name="mm_fc")
    return g


def compute_bytes(
    proj: ProjectorInfo,
    n_patches: int,
    flash_attn: bool,
    grid: tuple[int, int] | None = None,
    gpu: Backend | None = None,
    host: bool = False,
) -> int:
    """clip's compute buffer for one tile of ``n_patches`` patches (``encoder_patches``: the
    whole (image_size / patch)² view)."""
    side = math.isqrt(max(n_patches, 1))
    if side * side != n_patches:
        side = proj.image_size // proj.patch_size
    scale = int(proj.meta.get(_KEY_SCALE, 1) or 1)
    g = graph(
        proj.patch_size,
        proj.n_embd,
        proj.n_head,
        proj.n_ff,
        proj.n_layer,
        side,
        side,
        proj.n_mmproj_embd,
        max(scale, 1),
        flash_attn,
        _conv_type(proj.path or None),
    )
    return encoder_bytes(g, gpu, host)
