"""Qwen3-VL's vision encoder graph (``tools/mtmd/models/qwen3vl.cpp`` + clip.cpp's shared
``build_norm`` / ``build_attn`` / ``build_ffn``), replayed through ggml's allocator.

Unlike the Qwen2-VL graph, node order here cannot be written down as a straight list: clip.cpp
adds each layer's Q/K/V to the graph early (``ggml_build_forward_order`` in ``build_attn``) and
everything else only when a later call reaches it — and the deepstack mergers hang off the final
``concat``, so they are visited at the very end, keeping each deepstack layer's output alive
until then. The module therefore builds the tensor DAG as clip.cpp does and orders it with
ggml's own depth-first visit (``ggml_visit_parents_graph``: sources left to right, a node after
its sources, leafs apart) before replaying the allocator.

Inputs the graph depends on beyond ``n_patches``: the position-embedding table is interpolated
(``resize_position_embeddings``) unless the patch grid equals the table's (48×48 for the real
model: a 768×768 image) — the interpolating graph is replayed for every size (it allocates two
more tensors; on the presets measured both give the same buffer, whose peak lies later).

(The ``qwen3vl`` *text* model's reserve graph is ``plan.compute``'s, with ``TextGraph`` flags.)
"""

from __future__ import annotations

from collections.abc import Sequence

from ...model.gguf_info import ProjectorInfo
from ..graphalloc import (
    F16,
    F32,
    FLAG_INPUT,
    I32,
    TYPE_SIZE,
    Graph,
    Shape,
    Tensor,
)
from ..sched import Backend, encoder_bytes

__all__ = ["compute_bytes", "deepstack_layers"]

# deepstack_visual_indexes of Qwen3-VL-2B (24 blocks), the fallback when the header has none
_DEFAULT_DEEPSTACK = (5, 11, 17)


def deepstack_layers(proj: ProjectorInfo) -> list[int]:
    """Vision blocks with a deepstack merger. clip.cpp counts the ``v.deepstack.N.*`` tensors;
    the converter also writes ``clip.vision.is_deepstack_layers`` (one flag per block), which is
    what the header offers. Without the key, the released models' 5/11/17 of 24, scaled."""
    flags = proj.meta.get("clip.vision.is_deepstack_layers")
    if isinstance(flags, list):
        return [i for i, f in enumerate(flags) if f]
    n = proj.n_layer
    return sorted({min(n - 1, i * n // 24) for i in _DEFAULT_DEEPSTACK}) if n else []


def _ne4(ne: Sequence[int]) -> Shape:
    ne4 = tuple(int(x) for x in ne)
    return ne4 + (1,) * (4 - len(ne4))


def _contig_nb(type_: str, ne: Shape) -> Shape:
    ts = TYPE_SIZE[type_]
    return (ts, ts * ne[0], ts * ne[0] * ne[1], ts * ne[0] * ne[1] * ne[2])


class _DAG:
    """Tensors with sources, ordered into a ggml graph by ``expand`` / ``order``."""

    def __init__(self) -> None:
        self.W = Tensor("NONE", F16, (1, 1, 1, 1), (2, 2, 2, 2), external=True, name="weight")
        self.nodes: list[Tensor] = []
        self.leafs: list[Tensor] = []
        self._seen: set[int] = set()

    def input(self, name: str, type_: str, ne: Sequence[int]) -> Tensor:
        ne4 = _ne4(ne)
        return Tensor("NONE", type_, ne4, _contig_nb(type_, ne4), flags=FLAG_INPUT, name=name)

    def op(self, op: str, type_: str, ne: Sequence[int], *src: Tensor | None, name: str = "") -> Tensor:
        ne4 = _ne4(ne)
        return Tensor(op, type_, ne4, _contig_nb(type_, ne4), list(src), name=name)

    def view(self, a: Tensor, ne: Sequence[int], nb: Sequence[int] | None = None, op: str = "VIEW") -> Tensor:
        ne4 = _ne4(ne)
        root = a.view_src if a.view_src is not None else a
        return Tensor(op, a.type, ne4, tuple(nb) if nb else _contig_nb(a.type, ne4), [a], view_src=root)

    def expand(self, t: Tensor) -> None:
        """ggml_build_forward_expand / _order: add t and its unvisited ancestors, sources first."""
        stack = [(t, 0)]
        while stack:
            node, i = stack.pop()
            if i == 0:
                if id(node) in self._seen or node.external:
                    continue
                self._seen.add(id(node))
            if i < len(node.src):
                stack.append((node, i + 1))
                s = node.src[i]
                if s is not None and s is not node and id(s) not in self._seen and not s.external:
                    stack.append((s, 0))
                continue
            (self.leafs if node.op == "NONE" else self.nodes).append(node)

    order = expand

    def graph(self) -> Graph:
        g = Graph()
        g.leafs = self.leafs
        g.nodes = self.nodes
        return g


def _graph(
    n_patches: int,
    patch: int,
    E: int,
    H: int,
    F: int,
    n_layer: int,
    n_out: int,
    deepstack: list[int],
    merge: int,
    flash_attn: bool,
    interpolate: bool = True,
) -> Graph:
    d = _DAG()
    W = d.W
    P, p = n_patches, patch
    D = E // H
    m2 = merge * merge
    G = P // m2  # output tokens

    # build_inp_with_temporal_merge: two 2-D convs over the same still image, added
    inp_raw = d.input("inp_raw", F32, (P * p * p, 3))  # (nx*p, ny*p, 3): only the size matters

    def conv() -> Tensor:
        col = d.op("IM2COL", F16, (3 * p * p, P), W, inp_raw)
        colr = d.view(col, (3 * p * p, P), op="RESHAPE")
        mm = d.op("MUL_MAT", F32, (P, E), colr, W)
        r = d.view(mm, (P, 1, 1, E), op="RESHAPE")
        r = d.view(r, (P, 1, E, 1), op="PERMUTE", nb=(4, 4 * P, 4 * P, 4 * P))
        return d.op("CONT", F32, (P, 1, E), r)

    x = d.op("ADD", F32, (P, 1, E), conv(), conv())
    # spatial merge: permute → cont_4d → reshape_4d → permute → cont_3d
    x = d.view(x, (E, P, 1), op="PERMUTE", nb=(4 * P, 4, 4 * P, 4 * P * E))
    x = d.op("CONT", F32, (2 * E, P // 2, 1), x)
    x = d.view(x, (2 * E, 1, P // 2, 1), op="RESHAPE")
    x = d.view(x, (2 * E, P // 2, 1, 1), op="PERMUTE", nb=(4, 8 * E, 8 * E, 8 * E * P))
    x = d.op("CONT", F32, (E, P), x)
    x = d.op("ADD", F32, (E, P), x, W, name="patch_bias")
    # learned position embeddings, bilinearly resized to the patch grid, then the same shuffle
    if interpolate:
        pe = d.op("UPSCALE", F32, (P, 1, E), W)  # (width, height, n_embd)
        pe = d.view(pe, (E, P, 1), op="PERMUTE", nb=(4 * P, 4, 4 * P, 4 * P * E))
        pe = d.op("CONT", F32, (E, P), pe)
    else:
        pe = W
    pe = d.op("CONT", F32, (2 * E, P // 2, 1), pe)
    pe = d.view(pe, (2 * E, 1, P // 2, 1), op="RESHAPE")
    pe = d.view(pe, (2 * E, P // 2, 1, 1), op="PERMUTE", nb=(4, 8 * E, 8 * E, 8 * E * P))
    pe = d.op("CONT", F32, (E, P), pe)
    x = d.op("ADD", F32, (E, P), x, pe, name="inp_pos_emb")

    positions = d.input("positions", I32, (4 * P,))

    def norm(t: Tensor, n: int, rows: int) -> Tensor:
        t = d.op("NORM", F32, (n, rows), t)
        t = d.op("MUL", F32, (n, rows), t, W)
        return d.op("ADD", F32, (n, rows), t, W)

    def ffn(t: Tensor, n_in_out: tuple[int, int, int], rows: int) -> Tensor:
        _, n_hidden, n_o = n_in_out
        t = d.op("ADD", F32, (n_hidden, rows), d.op("MUL_MAT", F32, (n_hidden, rows), W, t), W)
        t = d.op("UNARY", F32, (n_hidden, rows), t)  # GELU
        return d.op("ADD", F32, (n_o, rows), d.op("MUL_MAT", F32, (n_o, rows), W, t), W)

    inpL = x
    ds_feats: Tensor | None = None
    for il in range(n_layer):
        cur = norm(inpL, E, P)
        qkv = d.op("ADD", F32, (3 * E, P), d.op("MUL_MAT", F32, (3 * E, P), W, cur, name=f"qkv-{il}"), W)
        nb = (4, 4 * D, 4 * 3 * E, 4 * 3 * E * P)
        qv = d.view(qkv, (D, H, P), nb=nb)
        kv = d.view(qkv, (D, H, P), nb=nb)
        vv = d.view(qkv, (D, H, P), nb=nb)
        q = d.op("ROPE", F32, (D, H, P), qv, positions, name=f"Qrope-{il}")
        k = d.op("ROPE", F32, (D, H, P), kv, positions, name=f"Krope-{il}")
        # build_attn: Q, K, V enter the graph now, in this order
        d.order(q)
        d.order(k)
        d.order(vv)
        qp = d.view(q, (D, P, H), op="PERMUTE", nb=(4, 4 * E, 4 * D, 4 * E * P))
        kp = d.view(k, (D, P, H), op="PERMUTE", nb=(4, 4 * E, 4 * D, 4 * E * P))
        if flash_attn:
            vp = d.view(vv, (D, P, H), op="PERMUTE", nb=(4, 4 * 3 * E, 4 * D, 4 * 3 * E * P))
            kc = d.op("CPY", F16, (D, P, H), kp)
            vc = d.op("CPY", F16, (D, P, H), vp)
            fa = d.op("FLASH_ATTN_EXT", F32, (D, H, P), qp, kc, vc, name=f"fattn-{il}")
            att = d.view(fa, (E, P), op="RESHAPE")
        else:
            vp = d.view(vv, (P, D, H), op="PERMUTE", nb=(4 * 3 * E, 4, 4 * D, 4 * 3 * E * P))
            vc = d.op("CONT", F32, (P, D, H), vp)
            kq = d.op("MUL_MAT", F32, (P, P, H), kp, qp, name=f"kq-{il}")
            kq = d.op("SOFT_MAX", F32, (P, P, H), kq)
            kqv = d.op("MUL_MAT", F32, (D, P, H), vc, kq)
            kqv = d.view(kqv, (D, H, P), op="PERMUTE", nb=(4, 4 * D * P, 4 * D, 4 * E * P))
            att = d.op("CONT", F32, (E, P), kqv)
        att = d.op("ADD", F32, (E, P), d.op("MUL_MAT", F32, (E, P), W, att), W)
        ffn_inp = d.op("ADD", F32, (E, P), att, inpL)
        cur = ffn(norm(ffn_inp, E, P), (E, F, E), P)
        cur = d.op("ADD", F32, (E, P), ffn_inp, cur, name=f"layer_out-{il}")
        if il in deepstack:
            feat = d.view(cur, (E * m2, G), op="RESHAPE")
            feat = ffn(norm(feat, E * m2, G), (E * m2, E * m2, n_out), G)
            if ds_feats is None:
                ds_feats = feat
            else:
                ds_feats = d.op("CONCAT", F32, (ds_feats.ne[0] + n_out, G), ds_feats, feat)
        inpL = cur

    x = norm(inpL, E, P)  # post_ln (merger.norm, before the shuffle)
    x = d.view(x, (E * m2, G), op="RESHAPE")
    x = ffn(x, (E * m2, E * m2, n_out), G)
    if ds_feats is not None:
        x = d.op("CONCAT", F32, (n_out + ds_feats.ne[0], G), x, ds_feats)
    d.expand(x)
    return d.graph()


def compute_bytes(
    proj: ProjectorInfo,
    n_patches: int,
    flash_attn: bool,
    grid: tuple[int, int] | None = None,
    gpu: Backend | None = None,
    host: bool = False,
) -> int:
    """clip's compute buffer (bytes, CPU) for one image of ``n_patches`` patches (tokens × 4)."""
    merge = int(proj.spatial_merge_size or 2)
    n_head = proj.n_head or 1
    return encoder_bytes(
        _graph(
            n_patches,
            proj.patch_size,
            proj.n_embd,
            n_head,
            proj.n_ff,
            proj.n_layer,
            proj.n_mmproj_embd,
            deepstack_layers(proj),
            merge,
            flash_attn,
        ),
        gpu,
        host,
    )
