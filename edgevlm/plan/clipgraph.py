"""The vision encoder's compute buffer for LLaVA's CLIP and the Qwen2/2.5-VL ViTs (``mlp``,
``qwen2vl_merger``, ``qwen2.5vl_merger`` with window attention): clip's ``compute buffer size``
for one image chunk, by rebuilding mtmd's graph (``tools/mtmd/clip.cpp``, ``models/llava.cpp``,
``models/qwen2vl.cpp``) and replaying ggml's allocator (``graphalloc``). The other encoders'
graphs are in ``encoders/``."""

from __future__ import annotations

from ..errors import UnsupportedModel
from .graphalloc import F16, F32, I32, Graph, Tensor
from .sched import Backend, encoder_bytes

__all__ = ["clip_compute_bytes"]


def _clip_graph(
    projector_type: str,
    patch_size: int,
    n_embd: int,
    n_head: int,
    n_ff: int,
    n_layer: int,
    n_patches: int,
    n_mmproj_embd: int,
    merge: int,
    flash_attn: bool,
    n_wa_pattern: int = 0,
    conv_type: str = F16,
    has_pre_ln: bool | None = None,
    has_post_ln: bool | None = None,
    n_blocks: int | None = None,
) -> Graph:
    g = Graph()
    W = g.EXT
    E, Hh, Ff, P, p = n_embd, n_head, n_ff, n_patches, patch_size
    D = E // Hh
    qwen = projector_type in ("qwen2vl_merger", "qwen2.5vl_merger")
    v25 = projector_type == "qwen2.5vl_merger"
    if not qwen and projector_type != "mlp":
        raise UnsupportedModel(f"no encoder graph for projector type {projector_type!r}")
    if has_pre_ln is None:
        has_pre_ln = not qwen  # LLaVA CLIP has v.pre_ln; Qwen ViTs have none
    if has_post_ln is None:
        has_post_ln = qwen  # Qwen has v.post_ln; LLaVA stops at layer -2 without it
    if n_blocks is None:
        n_blocks = n_layer if qwen else n_layer - 1  # llava: deepest feature layer = n_layer - 1
    windowed = v25 and n_wa_pattern > 0
    n_pos = P if qwen else P + 1  # + class embedding

    inp_raw = g.input("inp_raw", F32, (P * p * p, 3))  # (W', H', 3): W'*H' = n_patches * p^2

    def conv(inp: Tensor) -> Tensor:
        col = g.op("IM2COL", conv_type, (3 * p * p, P), W, inp)
        colr = g.view(col, (3 * p * p, P), op="RESHAPE")
        mm = g.op("MUL_MAT", F32, (P, E), colr, W)
        r = g.view(mm, (P, 1, 1, E), op="RESHAPE")
        r = g.view(r, (P, 1, E, 1), op="PERMUTE", nb=(4, 4 * P, 4 * P, 4 * P))
        return g.op("CONT", F32, (P, 1, E), r)

    if qwen:
        positions = None
        c0 = conv(inp_raw)
        c1 = conv(inp_raw)
        x = g.op("ADD", F32, (P, 1, E), c0, c1)
        x = g.view(x, (E, P, 1), op="PERMUTE", nb=(4 * P, 4, 4 * P, 4 * P * E))
        x = g.op("CONT", F32, (2 * E, P // 2, 1), x)
        x = g.view(x, (2 * E, P // 2, 1, 1), op="RESHAPE")
        x = g.view(x, (2 * E, 1, P // 2, 1), op="PERMUTE", nb=(4, 8 * E * P, 8 * E, 8 * E * P))
        x = g.op("CONT", F32, (E, P), x)
        inv_window_idx = g.input("inv_window_idx", I32, (P // 4,)) if windowed else None
        positions = g.input("positions", I32, (4 * P,))
        window_mask = g.input("window_mask", F32, (P, P)) if windowed else None
        if windowed:
            xr = g.view(x, (4 * E, P // 4), op="RESHAPE")
            x = g.op("GET_ROWS", F32, (4 * E, P // 4), xr, inv_window_idx)
            x = g.view(x, (E, P), op="RESHAPE")
    else:
        x = conv(inp_raw)
        x = g.view(x, (P, E), op="RESHAPE")
        x = g.view(x, (E, P), op="TRANSPOSE", nb=(4 * P, 4, 4 * P * E, 4 * P * E))
        x = g.op("CONT", F32, (E, P), x)
        x = g.op("CONCAT", F32, (E, n_pos), x, W)
        positions = g.input("positions", I32, (n_pos,))
        pe = g.op("GET_ROWS", F32, (E, n_pos), W, positions)
        x = g.op("ADD", F32, (E, n_pos), x, pe)
    N = n_pos

    def norm(t: Tensor, bias: bool = True, rms: bool = False) -> Tensor:
        t = g.op("RMS_NORM" if rms else "NORM", F32, (E, N), t)
        t = g.op("MUL", F32, (E, N), t, W)
        if bias:
            t = g.op("ADD", F32, (E, N), t, W)
        return t

    if has_pre_ln:
        x = norm(x, bias=not v25, rms=v25)
    inpL = x
    mask_f16 = None
    for il in range(n_blocks):
        full = (il + 1) % n_wa_pattern == 0 if windowed else True
        cur = norm(inpL, bias=not v25, rms=v25)
        q = g.op("ADD", F32, (E, N), g.op("MUL_MAT", F32, (E, N), W, cur, name=f"Qmm-{il}"), W)
        q = g.view(q, (D, Hh, N), op="RESHAPE")
        if qwen:
            q = g.op("ROPE", F32, (D, Hh, N), q, positions, name=f"Qrope-{il}")
        k = g.op("ADD", F32, (E, N), g.op("MUL_MAT", F32, (E, N), W, cur), W)
        k = g.view(k, (D, Hh, N), op="RESHAPE")
        if qwen:
            k = g.op("ROPE", F32, (D, Hh, N), k, positions, name=f"Krope-{il}")
        v = g.op("ADD", F32, (E, N), g.op("MUL_MAT", F32, (E, N), W, cur), W)
        v = g.view(v, (D, Hh, N), op="RESHAPE")
        mask = None if full else window_mask
        if flash_attn:
            qp = g.view(q, (D, N, Hh), op="PERMUTE", nb=(4, 4 * E, 4 * D, 4 * E * N))
            kp = g.view(k, (D, N, Hh), op="PERMUTE", nb=(4, 4 * E, 4 * D, 4 * E * N))
            kc = g.op("CPY", F16, (D, N, Hh), kp)
            vp = g.view(v, (D, N, Hh), op="PERMUTE", nb=(4, 4 * E, 4 * D, 4 * E * N))
            vc = g.op("CPY", F16, (D, N, Hh), vp)
            if mask is not None:
                if mask_f16 is None:  # qwen2vl.cpp casts the mask once ...
                    mask_f16 = g.op("CPY", F16, (P, P), window_mask)
                mask = g.op("CPY", F16, (P, P), mask_f16)  # ... and build_attn casts it again
            fa = g.op(
                "FLASH_ATTN_EXT",
                F32,
                (D, Hh, N),
                *([qp, kc, vc] + ([mask] if mask is not None else [])),
                name=f"fattn-{il}",
            )
            cur = g.view(fa, (E, N), op="RESHAPE")
        else:
            vp = g.view(v, (N, D, Hh), op="PERMUTE", nb=(4 * E, 4, 4 * D, 4 * E * N))
            vc = g.op("CONT", F32, (N, D, Hh), vp)
            kp = g.view(k, (D, N, Hh), op="PERMUTE", nb=(4, 4 * E, 4 * D, 4 * E * N))
            qp = g.view(q, (D, N, Hh), op="PERMUTE", nb=(4, 4 * E, 4 * D, 4 * E * N))
            kq = g.op("MUL_MAT", F32, (N, N, Hh), kp, qp, name=f"kq-{il}")
            kq = g.op("SOFT_MAX", F32, (N, N, Hh), *([kq] + ([mask] if mask is not None else [])))
            kqv = g.op("MUL_MAT", F32, (D, N, Hh), vc, kq)
            kqv = g.view(kqv, (D, Hh, N), op="PERMUTE", nb=(4, 4 * D * N, 4 * D, 4 * E * N))
            cur = g.op("CONT", F32, (E, N), kqv)
        cur = g.op("ADD", F32, (E, N), g.op("MUL_MAT", F32, (E, N), W, cur), W)
        cur = g.op("ADD", F32, (E, N), cur, inpL)  # ffn_inp
        inpL = cur
        cur = norm(cur, bias=not v25, rms=v25)
        if v25:  # SwiGLU with gate (+ biases)
            gt = g.op("ADD", F32, (Ff, N), g.op("MUL_MAT", F32, (Ff, N), W, cur, name=f"ffn_gate-{il}"), W)
            up = g.op("ADD", F32, (Ff, N), g.op("MUL_MAT", F32, (Ff, N), W, cur, name=f"ffn_up-{il}"), W)
            cur = g.op("GLU", F32, (Ff, N), gt, up, name=f"ffn_swiglu-{il}")
        else:  # up + bias, (quick-)GELU in place
            up = g.op("ADD", F32, (Ff, N), g.op("MUL_MAT", F32, (Ff, N), W, cur, name=f"ffn_up-{il}"), W)
            cur = g.op("UNARY", F32, (Ff, N), up)
        cur = g.op("ADD", F32, (E, N), g.op("MUL_MAT", F32, (E, N), W, cur), W)
        inpL = g.op("ADD", F32, (E, N), inpL, cur)  # layer_out
    x = inpL
    if has_post_ln:
        x = norm(x, bias=not v25, rms=v25)
    if qwen:
        m = merge * merge
        x = g.view(x, (E * m, P // m), op="RESHAPE")
        x = g.op("ADD", F32, (E * m, P // m), g.op("MUL_MAT", F32, (E * m, P // m), W, x, name="mm0"), W)
        x = g.op("UNARY", F32, (E * m, P // m), x)
        x = g.op(
            "ADD", F32, (n_mmproj_embd, P // m), g.op("MUL_MAT", F32, (n_mmproj_embd, P // m), W, x, name="mm2"), W
        )
        if windowed:
            window_idx = g.input("window_idx", I32, (P // m,))
            x = g.view(x, (n_mmproj_embd, P // m), op="RESHAPE")
            x = g.op("GET_ROWS", F32, (n_mmproj_embd, P // m), x, window_idx)
            x = g.view(x, (n_mmproj_embd, P // m, 1), op="RESHAPE")
    else:
        x = g.view(x, (E, N), op="RESHAPE")
        patches = g.input("patches", I32, (P,))
        x = g.op("GET_ROWS", F32, (E, P), x, patches)
        x = g.op("ADD", F32, (n_mmproj_embd, P), g.op("MUL_MAT", F32, (n_mmproj_embd, P), W, x, name="mm0"), W)
        x = g.op("UNARY", F32, (n_mmproj_embd, P), x)
        x = g.op("ADD", F32, (n_mmproj_embd, P), g.op("MUL_MAT", F32, (n_mmproj_embd, P), W, x, name="mm2"), W)
    return g


def clip_compute_bytes(
    projector_type: str,
    image_size: int,
    patch_size: int,
    n_embd: int,
    n_head: int,
    n_ff: int,
    n_layer: int,
    n_patches: int,
    n_mmproj_embd: int = 4096,
    merge: int = 1,
    flash_attn: bool = False,
    n_wa_pattern: int = 0,
    conv_type: str = F16,
    has_pre_ln: bool | None = None,
    has_post_ln: bool | None = None,
    gpu: Backend | None = None,
    host: bool = False,
) -> int:
    """Predicted clip ``compute buffer size`` (bytes) for one image (exact allocator replay);
    ``gpu``: the GPU it runs on (``host``: the host-side buffer then, its inputs).

    projector_type: "mlp" (LLaVA-1.5), "qwen2vl_merger", "qwen2.5vl_merger".
    n_layer: the GGUF's clip.vision.block_count (LLaVA runs n_layer - 1 blocks: feature layer -2).
    n_patches: patches of *this* image before merging (``projectors.encoder_patches``: LLaVA
        always resizes to image_size; Qwen: 4 × image tokens).
    n_mmproj_embd: projector output width (= text n_embd).  merge: 2 for Qwen, 1 for LLaVA.
    n_wa_pattern: Qwen2.5-VL clip.vision.n_wa_pattern (window attention; every n-th block full).
    conv_type: type of v.patch_embd.weight (im2col output type), f16 for usual mmproj files.
    has_pre_ln / has_post_ln: default to what the generated / official files have.

    The buffer is reserved for the first image encoded (or the 1288x1288-class warmup image when
    mtmd warmup is on) and silently grows for a larger one; it never shrinks.  For a session,
    the buffer = max over the images seen (and the warmup image).
    """
    return encoder_bytes(
        _clip_graph(
            projector_type,
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
            conv_type,
            has_pre_ln,
            has_post_ln,
        ),
        gpu,
        host,
    )
