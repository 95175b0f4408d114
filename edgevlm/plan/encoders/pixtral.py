"""The Pixtral / Mistral Small 3.1 encoder graph (``tools/mtmd/models/pixtral.cpp``), replayed
through ggml's allocator.

clip.cpp builds, for an image of ``nx × ny`` patches (``P = nx·ny``):

- ``build_inp``: the patch conv (``ggml_conv_2d``: IM2COL in F16, MUL_MAT, permute + CONT) and
  a transpose + CONT to ``[E, P]`` (no class token, no learned positions);
- ``build_vit`` with RMS norms (``v.pre_ln``, ``ln1``, ``ln2``, weights only), Q/K/V without
  biases, 2-D RoPE on Q and K (two ``ggml_rope_ext`` per tensor: the first allocates, the
  second runs in place), ``build_attn`` (flash attention: F16 casts of K and V; else KQ in F32
  with an in-place soft-max), SwiGLU FFN (gate, up, GLU, down), residual adds in place;
- Mistral Small 3.1's patch merger: RMS norm × ``mm.input_norm``, a permute + CONT to
  ``[nx, ny, E]``, an F32 IM2COL with an ``m × m`` dummy kernel, the merge matmul;
- ``mm.1`` → GELU (in place) → ``mm.2``;
- the ``[IMG_BREAK]`` rows: a leaf ``[E_text, 1, py]`` (allocated before every node, freed at
  the end: SCALE and ADD run in place on it), CONCAT onto the ``[E_text, px, py]`` grid.

The buffer depends on the token grid ``px × py`` (``px = nx / m``), not only on ``P``: the
break rows grow with ``py``. ``compute_bytes`` is given patches only, and treats them as an
upper bound on ``m²·px·py`` (what ``projectors.encoder_patches`` returns is ``m²`` times the
chunk's embeddings, ``px·py + py − 1``, or a budget ``B`` with ``px·py ≤ B``); it returns the
largest buffer over the grids with ``px·py = ⌈n_patches / m²⌉`` tokens (the tallest grid is the
worst: most break rows; up to ~8 % over a square image's buffer). Given the grid
(``compute_bytes(..., grid=(px, py))`` or ``grid_bytes``) the replay is exact.
"""

from __future__ import annotations

import functools
import math

from ...model.gguf_info import ProjectorInfo
from ..compute import vit_attention
from ..graphalloc import F16, F32, I32, Graph, Tensor
from ..sched import Backend, encoder_bytes

__all__ = ["compute_bytes", "grid_bytes", "pixtral_graph"]


def pixtral_graph(
    patch: int,
    n_embd: int,
    n_head: int,
    n_ff: int,
    n_layer: int,
    n_text: int,
    merge: int,
    px: int,
    py: int,
    flash_attn: bool,
    conv_type: str = F16,
    has_pre_ln: bool = True,
) -> Graph:
    """The reserve graph of one ``px × py``-token image (``px·merge × py·merge`` patches)."""
    g = Graph()
    W = g.EXT
    E, H, F, m = n_embd, n_head, n_ff, merge
    D = E // H
    nx, ny = px * m, py * m  # patches
    P = nx * ny
    T0 = px * py  # merged tokens

    # leafs in graph order: inp_raw, pos_h, pos_w (layer 0's RoPE), the [IMG_BREAK] rows
    inp_raw = g.input("inp_raw", F32, (nx * patch, ny * patch, 3))
    pos_h = g.input("pos_h", I32, (P,))
    pos_w = g.input("pos_w", I32, (P,))
    tok = g.input("img_break_rows", F32, (n_text, 1, py))

    # build_inp: ggml_conv_2d + reshape/transpose/cont
    col = g.op("IM2COL", conv_type, (3 * patch * patch, nx, ny, 1), W, inp_raw)
    colr = g.view(col, (3 * patch * patch, P), op="RESHAPE")
    mm = g.op("MUL_MAT", F32, (P, E), colr, W, name="patch_conv")
    r = g.view(mm, (nx, ny, 1, E), op="RESHAPE")
    r = g.view(r, (nx, ny, E, 1), op="PERMUTE", nb=(4, 4 * nx, 4 * P, 4 * P))
    x = g.op("CONT", F32, (nx, ny, E, 1), r)
    x = g.view(x, (P, E, 1), op="RESHAPE")
    x = g.view(x, (E, P, 1), op="TRANSPOSE", nb=(4 * P, 4, 4 * P * E, 4 * P * E))
    x = g.op("CONT", F32, (E, P, 1), x)
    x = g.view(x, (E, P), op="RESHAPE")  # build_vit: flatten the batch

    def rms(t: Tensor, ne: tuple[int, ...]) -> Tensor:
        t = g.op("RMS_NORM", F32, ne, t)
        return g.op("MUL", F32, ne, t, W)

    if has_pre_ln:
        x = rms(x, (E, P))
    inpL = x
    for il in range(n_layer):
        cur = rms(inpL, (E, P))
        q = g.op("MUL_MAT", F32, (E, P), W, cur, name=f"Qcur-{il}")
        q = g.view(q, (D, H, P), op="RESHAPE")
        q = g.op("ROPE", F32, (D, H, P), q, pos_h, name=f"Qrope_h-{il}")
        q = g.op("ROPE", F32, (D, H, P), q, pos_w, name=f"Qrope_w-{il}")
        k = g.op("MUL_MAT", F32, (E, P), W, cur, name=f"Kcur-{il}")
        k = g.view(k, (D, H, P), op="RESHAPE")
        k = g.op("ROPE", F32, (D, H, P), k, pos_h, name=f"Krope_h-{il}")
        k = g.op("ROPE", F32, (D, H, P), k, pos_w, name=f"Krope_w-{il}")
        v = g.op("MUL_MAT", F32, (E, P), W, cur, name=f"Vcur-{il}")
        v = g.view(v, (D, H, P), op="RESHAPE")
        cur = vit_attention(g, q, k, v, il, D, H, P, E, flash_attn)
        cur = g.op("MUL_MAT", F32, (E, P), W, cur, name=f"attn_out-{il}")
        cur = g.op("ADD", F32, (E, P), cur, inpL)  # ffn_inp
        inpL = cur
        cur = rms(cur, (E, P))
        gate = g.op("MUL_MAT", F32, (F, P), W, cur, name=f"ffn_gate-{il}")
        up = g.op("MUL_MAT", F32, (F, P), W, cur, name=f"ffn_up-{il}")
        cur = g.op("GLU", F32, (F, P), gate, up, name=f"ffn_swiglu-{il}")
        cur = g.op("MUL_MAT", F32, (E, P), W, cur, name=f"ffn_down-{il}")
        inpL = g.op("ADD", F32, (E, P), inpL, cur, name=f"layer_out-{il}")
    x = g.view(inpL, (E, P, 1), op="RESHAPE")  # build_vit: restore the batch dim

    Eo = E
    if m > 1:  # Mistral Small 3.1 patch merger
        x = rms(x, (E, P, 1))
        x = g.view(x, (E, nx, ny), op="RESHAPE")
        x = g.view(x, (nx, ny, E), op="PERMUTE", nb=(4 * E, 4 * E * nx, 4, 4 * E * P))
        x = g.op("CONT", F32, (nx, ny, E), x)
        kernel = g.view(x, (m, m, E), nb=(4, 0, 0, 0))
        x = g.op("IM2COL", F32, (E * m * m, px, py, 1), kernel, x, name="merge_im2col")
        x = g.view(x, (E * m * m, T0), op="RESHAPE")
        x = g.op("MUL_MAT", F32, (E, T0), W, x, name="patch_merger")
    else:
        x = g.view(x, (Eo, T0), op="RESHAPE")  # (no node in clip: same tensor; harmless view)
    # mm.1 (+ bias, in place) → GELU (in place) → mm.2 (+ bias, in place)
    x = g.op("MUL_MAT", F32, (n_text, T0), W, x, name="mm1")
    x = g.op("ADD", F32, (n_text, T0), x, W)
    x = g.op("UNARY", F32, (n_text, T0), x)
    x = g.op("MUL_MAT", F32, (n_text, T0), W, x, name="mm2")
    x = g.op("ADD", F32, (n_text, T0), x, W)
    # [IMG_BREAK] after each row
    tmp = g.view(x, (n_text, px, py), op="RESHAPE")
    t = g.op("SCALE", F32, (n_text, 1, py), tok)
    t = g.op("ADD", F32, (n_text, 1, py), t, W)
    cat = g.op("CONCAT", F32, (n_text, px + 1, py), tmp, t, name="concat")
    g.view(cat, (n_text, T0 + py - 1), name="embeddings")
    return g


@functools.lru_cache(maxsize=4096)
def _grid_bytes(
    patch: int,
    n_embd: int,
    n_head: int,
    n_ff: int,
    n_layer: int,
    n_text: int,
    merge: int,
    px: int,
    py: int,
    flash_attn: bool,
    has_pre_ln: bool,
    gpu: Backend | None = None,
    host: bool = False,
) -> int:
    g = pixtral_graph(patch, n_embd, n_head, n_ff, n_layer, n_text, merge, px, py, flash_attn, has_pre_ln=has_pre_ln)
    return encoder_bytes(g, gpu, host)


def _shape(proj: ProjectorInfo) -> tuple[int, int, int, int, int, int, int]:
    merge = int(proj.spatial_merge_size or 1)
    # the buffer does not depend on the depth beyond a few blocks (blocks reuse the same space)
    n_layer = min(int(proj.n_layer), 3)
    return (
        int(proj.patch_size),
        int(proj.n_embd),
        int(proj.n_head),
        int(proj.n_ff),
        n_layer,
        int(proj.n_mmproj_embd),
        merge,
    )


def grid_bytes(
    proj: ProjectorInfo, px: int, py: int, flash_attn: bool, gpu: Backend | None = None, host: bool = False
) -> int:
    """The clip compute buffer for an image of ``px × py`` merged tokens (exact; ``host``: the
    part on the host, its inputs, when the encoder runs on ``gpu``)."""
    return _grid_bytes(*_shape(proj), int(px), int(py), bool(flash_attn), True, gpu, host)


def _divisors(n: int) -> list[int]:
    out = []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            out += [d, n // d]
    return sorted(set(out))


def compute_bytes(
    proj: ProjectorInfo,
    n_patches: int,
    flash_attn: bool,
    grid: tuple[int, int] | None = None,
    gpu: Backend | None = None,
    host: bool = False,
) -> int:
    """The clip compute buffer for one chunk of at most ``n_patches`` patches (before merging).

    ``grid``: the chunk's token grid ``(px, py)`` (``View.nx, View.ny`` of
    ``families.pixtral.image_tokens``) makes it exact; without it, the worst grid of
    ``⌈n_patches / merge²⌉`` tokens (see the module doc)."""
    if grid is not None:
        return grid_bytes(proj, grid[0], grid[1], flash_attn, gpu, host)
    merge = int(proj.spatial_merge_size or 1)
    tokens = max(1, -(-int(n_patches) // (merge * merge)))
    return max(grid_bytes(proj, tokens // py, py, flash_attn, gpu, host) for py in _divisors(tokens))
