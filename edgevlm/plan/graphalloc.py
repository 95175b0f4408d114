"""A Python replay of ggml's graph allocator, for predicting llama.cpp's compute buffers.

``Graph`` records the tensors a llama.cpp reserve graph creates (ops, shapes, views, in-place
candidates, inputs) in the same order; ``replay`` runs ggml-alloc's rules over it (``ggml_gallocr``
+ ``ggml_dyn_tallocr``: best-fit free list, 32-byte alignment on the CPU buffer type, in-place
reuse, free on last use) and returns the buffer size. ``compute.py`` builds the graphs.
Pure Python: no llama.cpp import.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["ALIGN", "INPLACE_OPS", "TYPE_SIZE", "Graph", "pad", "replay", "Tensor"]


ALIGN = 32  # TENSOR_ALIGNMENT of the CPU buffer type
F32, F16, I32, I64 = "f32", "f16", "i32", "i64"
TYPE_SIZE = {F32: 4, F16: 2, I32: 4, I64: 8}

INPLACE_OPS = {
    "FILL",
    "SCALE",
    "DIAG_MASK_ZERO",
    "DIAG_MASK_INF",
    "ADD",
    "ADD_ID",
    "ADD1",
    "SUB",
    "MUL",
    "DIV",
    "SQR",
    "SQRT",
    "LOG",
    "UNARY",
    "ROPE",
    "ROPE_BACK",
    "SILU_BACK",
    "RMS_NORM",
    "RMS_NORM_BACK",
    "CLAMP",
    "SOFT_MAX",
    "SOFT_MAX_BACK",
}
FLAG_INPUT, FLAG_OUTPUT = 1, 2


def pad(x: int, a: int) -> int:
    return (x + a - 1) // a * a


# ------------------------------------------------------------------------------------------------
# a tiny graph model: just what ggml-alloc looks at
# ------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class Tensor:
    op: str
    type: str
    ne: tuple
    nb: tuple
    src: list = field(default_factory=list)
    view_src: Tensor | None = None
    flags: int = 0
    external: bool = False  # weights, KV cache: live in other buffers
    name: str = ""

    @property
    def nbytes(self) -> int:
        if self.external:
            return 0
        ts = TYPE_SIZE[self.type]
        n = ts
        for i in range(4):
            n += (self.ne[i] - 1) * self.nb[i]
        return n


def _contig_nb(type_: str, ne: tuple) -> tuple:
    ts = TYPE_SIZE[type_]
    nb0 = ts
    nb1 = nb0 * ne[0]
    nb2 = nb1 * ne[1]
    nb3 = nb2 * ne[2]
    return (nb0, nb1, nb2, nb3)


def _ne4(ne: Sequence[int]) -> tuple:
    ne4 = tuple(int(x) for x in ne)
    return ne4 + (1,) * (4 - len(ne4))


class Graph:
    def __init__(self):
        self.leafs: list[Tensor] = []
        self.nodes: list[Tensor] = []
        self.EXT = Tensor("NONE", F16, (1, 1, 1, 1), (2, 2, 2, 2), external=True, name="ext")

    # leaf inputs (allocated by galloc in the leaf pass, in leaf order)
    def input(self, name, type_, ne):
        ne = _ne4(ne)
        t = Tensor("NONE", type_, ne, _contig_nb(type_, ne), flags=FLAG_INPUT, name=name)
        self.leafs.append(t)
        return t

    def op(self, op, type_, ne, *src, name="", flags=0):
        ne = _ne4(ne)
        t = Tensor(op, type_, ne, _contig_nb(type_, ne), [s for s in src], flags=flags, name=name)
        self.nodes.append(t)
        return t

    def view(self, a: Tensor, ne: Sequence[int], name: str = "", op: str = "VIEW", nb: tuple | None = None) -> Tensor:
        """reshape/view/permute of an own tensor (view_src = the root, like ggml)."""
        ne = _ne4(ne)
        root = a.view_src if a.view_src is not None else a
        t = Tensor(op, a.type, ne, nb or _contig_nb(a.type, ne), [a], view_src=root, name=name)
        self.nodes.append(t)
        return t

    def ext_op(self, op, *src, name=""):
        """a node whose result lives in an external buffer (SET_ROWS into the KV cache)."""
        t = Tensor(op, F16, (1, 1, 1, 1), (2, 2, 2, 2), [s for s in src], view_src=self.EXT, name=name)
        self.nodes.append(t)
        return t


# ------------------------------------------------------------------------------------------------
# ggml-alloc replay (ggml/src/ggml-alloc.c)
# ------------------------------------------------------------------------------------------------
class _DynAlloc:
    def __init__(self, align=ALIGN):
        self.align = align
        self.free = [[0, 1 << 62]]  # sorted [offset, size]; the last block is the growable tail
        self.max_size = 0

    def alloc(self, size):
        size = pad(size, self.align)
        best, best_size = -1, None
        for i in range(len(self.free) - 1):
            sz = self.free[i][1]
            if sz >= size and (best_size is None or sz <= best_size):
                best, best_size = i, sz
        if best == -1:
            best = len(self.free) - 1
        blk = self.free[best]
        off = blk[0]
        blk[0] += size
        blk[1] -= size
        if blk[1] == 0:
            del self.free[best]
        self.max_size = max(self.max_size, off + size)
        return off

    def free_bytes(self, off, size):
        size = pad(size, self.align)
        fb = self.free
        for i, b in enumerate(fb):
            if b[0] + b[1] == off:
                b[1] += size
                if i < len(fb) - 1 and b[0] + b[1] == fb[i + 1][0]:
                    b[1] += fb[i + 1][1]
                    del fb[i + 1]
                return
            if off + size == b[0]:
                b[0] = off
                b[1] += size
                if i > 0 and fb[i - 1][0] + fb[i - 1][1] == b[0]:
                    fb[i - 1][1] += b[1]
                    del fb[i]
                return
        j = 0
        while j < len(fb) and fb[j][0] < off:
            j += 1
        fb.insert(j, [off, size])


def _same_layout(a: Tensor, b: Tensor) -> bool:
    return a.type == b.type and a.ne == b.ne and a.nb == b.nb


def replay(g: Graph, align: int = ALIGN, trace: list | None = None, offsets: dict | None = None) -> int:
    """Size of the buffer ggml_gallocr_reserve would allocate for graph g.

    trace: if a list is given, (max_size, tensor name, node index) is appended whenever the
    buffer's high-water mark grows (used to find which tensor sets the peak)."""
    al = _DynAlloc(align)
    H: dict[int, dict] = {}

    def h(t):
        k = id(t)
        r = H.get(k)
        if r is None:
            r = H[k] = {"nc": 0, "nv": 0, "alloc": False, "off": None}
        return r

    def allocate(t):
        ht = h(t)
        if t.external or ht["alloc"] or t.view_src is not None:
            return
        ht["alloc"] = True
        if t.op in INPLACE_OPS:
            for p in t.src:
                if p is None or p.external:
                    continue
                hp = h(p)
                if not hp["alloc"]:
                    continue
                if p.flags & FLAG_OUTPUT or (p.view_src is not None and p.view_src.flags & FLAG_OUTPUT):
                    continue
                if not _same_layout(t, p):
                    continue
                # (a view parent is never "allocated" in ggml-alloc's hash, so the view branch of
                #  ggml_gallocr_allocate_node is dead: ROPE of a reshaped matmul is NOT in place)
                if hp["nc"] == 1 and hp["nv"] == 0:
                    ht["off"] = hp["off"]
                    hp["alloc"] = False
                    extra = pad(p.nbytes, align) - pad(t.nbytes, align)
                    if extra > 0:
                        al.free_bytes(ht["off"] + pad(t.nbytes, align), extra)
                    return
        before = al.max_size
        ht["off"] = al.alloc(t.nbytes)
        if offsets is not None and t.name:
            offsets[t.name] = ht["off"]
        if trace is not None and al.max_size > before:
            trace.append((al.max_size, t.name or t.op, cur_i[0]))

    cur_i = [-1]

    def free(t):
        if t.flags & FLAG_OUTPUT:
            return
        ht = h(t)
        al.free_bytes(ht["off"], t.nbytes)
        ht["alloc"] = False

    for leaf in g.leafs:
        allocate(leaf)
    for n in g.nodes:
        if n.view_src is not None and n.op != "NONE":
            h(n.view_src)["nv"] += 1
        for s in n.src:
            if s is not None:
                h(s)["nc"] += 1
    for i, n in enumerate(g.nodes):
        cur_i[0] = i
        for p in n.src:
            if p is not None:
                allocate(p)
        allocate(n)
        for p in n.src:
            if p is None:
                continue
            hp = h(p)
            hp["nc"] -= 1
            if hp["nc"] == 0 and hp["nv"] == 0:
                if p.view_src is not None:
                    vs = p.view_src
                    hv = h(vs)
                    hv["nv"] -= 1
                    if hv["nv"] == 0 and hv["nc"] == 0 and hv["alloc"] and not vs.external:
                        free(vs)
                elif hp["alloc"] and not p.external:
                    free(p)
    return al.max_size
