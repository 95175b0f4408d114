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

__all__ = [
    "ALIGN",
    "INPLACE_OPS",
    "TYPE_SIZE",
    "Graph",
    "Shape",
    "Trace",
    "allocate",
    "input_bytes",
    "pad",
    "replay",
    "Tensor",
]


ALIGN = 32  # TENSOR_ALIGNMENT of the CPU buffer type
F32, F16, I32, I64 = "f32", "f16", "i32", "i64"
TYPE_SIZE = {F32: 4, F16: 2, I32: 4, I64: 8, "raw": 1}  # raw: a copied weight, in bytes

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

Shape = tuple[int, ...]  # ne (elements) or nb (byte strides) of a tensor: four entries, ggml's order


def pad(x: int, a: int) -> int:
    return (x + a - 1) // a * a


# ------------------------------------------------------------------------------------------------
# a tiny graph model: just what ggml-alloc looks at
# ------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class Tensor:
    op: str
    type: str
    ne: Shape
    nb: Shape
    src: list[Tensor | None] = field(default_factory=list)
    view_src: Tensor | None = None
    flags: int = 0
    external: bool = False  # weights, KV cache: live in other buffers
    name: str = ""
    # pre-allocated tensors (external): which buffer holds them, for the scheduler's replay
    # (``plan.sched``): a placement key ("tok_embd", "L3", "out", "kv3"), whether it is a model
    # weight (a WEIGHTS buffer), and its real size (what a device's size limits look at)
    home: str = ""
    weights: bool = False
    ext_bytes: int = 0

    @property
    def nbytes(self) -> int:
        if self.external:
            return 0
        return self.view_bytes

    @property
    def view_bytes(self) -> int:
        """ggml_nbytes: what the tensor spans (an external one: its real size)."""
        if self.external:
            return self.ext_bytes
        ts = TYPE_SIZE[self.type]
        n = ts
        for i in range(4):
            n += (self.ne[i] - 1) * self.nb[i]
        return n


def _contig_nb(type_: str, ne: Shape) -> Shape:
    ts = TYPE_SIZE[type_]
    nb0 = ts
    nb1 = nb0 * ne[0]
    nb2 = nb1 * ne[1]
    nb3 = nb2 * ne[2]
    return (nb0, nb1, nb2, nb3)


def _ne4(ne: Sequence[int]) -> Shape:
    ne4 = tuple(int(x) for x in ne)
    return ne4 + (1,) * (4 - len(ne4))


class Graph:
    def __init__(self) -> None:
        self.leafs: list[Tensor] = []
        self.nodes: list[Tensor] = []
        self.EXT = Tensor("NONE", F16, (1, 1, 1, 1), (2, 2, 2, 2), external=True, name="ext")

    # leaf inputs (allocated by galloc in the leaf pass, in leaf order)
    def input(self, name: str, type_: str, ne: Sequence[int]) -> Tensor:
        ne4 = _ne4(ne)
        t = Tensor("NONE", type_, ne4, _contig_nb(type_, ne4), flags=FLAG_INPUT, name=name)
        self.leafs.append(t)
        return t

    def op(self, op: str, type_: str, ne: Sequence[int], *src: Tensor | None, name: str = "", flags: int = 0) -> Tensor:
        ne4 = _ne4(ne)
        t = Tensor(op, type_, ne4, _contig_nb(type_, ne4), [s for s in src], flags=flags, name=name)
        self.nodes.append(t)
        return t

    def view(self, a: Tensor, ne: Sequence[int], name: str = "", op: str = "VIEW", nb: Shape | None = None) -> Tensor:
        """reshape/view/permute of an own tensor (view_src = the root, like ggml)."""
        ne4 = _ne4(ne)
        root = a.view_src if a.view_src is not None else a
        t = Tensor(op, a.type, ne4, nb or _contig_nb(a.type, ne4), [a], view_src=root, name=name)
        self.nodes.append(t)
        return t

    def raw_view(self, a: Tensor, nbytes: int, op: str = "VIEW") -> Tensor:
        """A view spanning ``nbytes`` of ``a`` (a cache's K or V seen by attention): allocates
        nothing; the scheduler's replay copies that many bytes when another backend reads it."""
        root = a.view_src if a.view_src is not None else a
        t = Tensor(op, "raw", (nbytes, 1, 1, 1), (1, nbytes, nbytes, nbytes), [a], view_src=root)
        self.nodes.append(t)
        return t

    def ext_op(self, op: str, *src: Tensor, name: str = "", into: Tensor | None = None) -> Tensor:
        """a node whose result lives in an external buffer (SET_ROWS into the KV cache ``into``)."""
        dst = into if into is not None else self.EXT
        t = Tensor(op, F16, (1, 1, 1, 1), (2, 2, 2, 2), [s for s in src], view_src=dst, name=name)
        t.ext_bytes = dst.ext_bytes
        self.nodes.append(t)
        return t

    def weight(self, home: str, nbytes: int = 0) -> Tensor:
        """A model weight living in the buffer ``home`` names (see ``Tensor.home``)."""
        t = Tensor("NONE", F16, (1, 1, 1, 1), (2, 2, 2, 2), external=True, name=home, home=home, weights=True)
        t.ext_bytes = nbytes
        return t

    def cache(self, home: str, nbytes: int = 0) -> Tensor:
        """A KV cache tensor living in the buffer ``home`` names."""
        return Tensor("NONE", F16, (1, 1, 1, 1), (2, 2, 2, 2), external=True, name=home, home=home, ext_bytes=nbytes)


# ------------------------------------------------------------------------------------------------
# ggml-alloc replay (ggml/src/ggml-alloc.c)
# ------------------------------------------------------------------------------------------------
class DynAlloc:
    """ggml_dyn_tallocr: best-fit free blocks in chunks of at most ``max_size`` bytes (a
    backend's largest buffer; the last chunk grows without bound)."""

    def __init__(self, align: int = ALIGN, max_size: int = 0):
        self.align = align
        self.max_chunk = max_size or (1 << 62)
        self.chunks: list[list[list[int]]] = []  # per chunk: sorted [offset, size] free blocks
        self.chunk_max: list[int] = []

    @property
    def max_size(self) -> int:
        return sum(self.chunk_max)

    def _new_chunk(self, size: int) -> int:
        self.chunks.append([[0, max(size, self.max_chunk)]])
        self.chunk_max.append(0)
        return len(self.chunks) - 1

    def alloc(self, size: int) -> tuple[int, int]:
        size = pad(size, self.align)
        best_c, best_i = -1, -1
        for c, fb in enumerate(self.chunks):
            best_in = None
            for i in range(len(fb) - 1):
                sz = fb[i][1]
                if sz >= size and (best_in is None or sz <= best_in):
                    best_c, best_i, best_in = c, i, sz
        if best_i == -1:
            best_reuse = None
            for c, fb in enumerate(self.chunks):
                if not fb:
                    continue
                blk = fb[-1]
                reuse = self.chunk_max[c] - blk[0] - size
                better_reuse = (best_reuse is None or best_reuse < 0) and (best_reuse is None or reuse > best_reuse)
                better_fit = reuse >= 0 and best_reuse is not None and reuse < best_reuse
                if blk[1] >= size and (better_reuse or better_fit):
                    best_c, best_i, best_reuse = c, len(fb) - 1, reuse
        if best_i == -1:
            best_c, best_i = self._new_chunk(size), 0
        fb = self.chunks[best_c]
        blk = fb[best_i]
        off = blk[0]
        blk[0] += size
        blk[1] -= size
        if blk[1] == 0:
            del fb[best_i]
        self.chunk_max[best_c] = max(self.chunk_max[best_c], off + size)
        return best_c, off

    def free_bytes(self, addr: tuple[int, int], size: int) -> None:
        c, off = addr
        size = pad(size, self.align)
        fb = self.chunks[c]
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


@dataclass(slots=True)
class _Hash:
    """What ggml-alloc's hash set keeps per tensor: children and views still to run, whether it
    holds memory now, and where (buffer index; chunk and offset in it)."""

    nc: int = 0
    nv: int = 0
    alloc: bool = False
    addr: tuple[int, int] | None = None
    buf: int = 0


def _same_layout(a: Tensor, b: Tensor) -> bool:
    return a.type == b.type and a.ne == b.ne and a.nb == b.nb


Trace = list[tuple[int, str, int]]  # (high-water mark, tensor name or op, node index)


def replay(g: Graph, align: int = ALIGN, trace: Trace | None = None, offsets: dict[str, int] | None = None) -> int:
    """Size of the buffer ggml_gallocr_reserve would allocate for graph g (one buffer).

    trace: if a list is given, (max_size, tensor name, node index) is appended whenever the
    buffer's high-water mark grows (used to find which tensor sets the peak)."""
    return allocate(g.nodes, g.leafs, [0] * len(g.nodes), [0] * len(g.leafs), [DynAlloc(align)], trace, offsets)[0]


def input_bytes(g: Graph, align: int = ALIGN) -> int:
    """The host-side buffer of a graph whose nodes all run on a GPU: its inputs, which the CPU
    fills (all allocated before any node: the peak)."""
    return sum(pad(t.nbytes, align) for t in g.leafs)


def allocate(
    nodes: Sequence[Tensor],
    leafs: Sequence[Tensor],
    node_buf: Sequence[int],
    leaf_buf: Sequence[int],
    allocs: list[DynAlloc],
    trace: Trace | None = None,
    offsets: dict[str, int] | None = None,
) -> list[int]:
    """ggml_gallocr_alloc_graph_impl over several buffers (``allocs``; a node or leaf goes to
    the buffer its id names): the size of each."""
    H: dict[int, _Hash] = {}

    def h(t: Tensor) -> _Hash:
        k = id(t)
        r = H.get(k)
        if r is None:
            r = H[k] = _Hash()
        return r

    def alloc_node(t: Tensor, buf: int) -> None:
        ht = h(t)
        if t.external or ht.alloc or t.view_src is not None:
            return
        ht.alloc = True
        if t.op in INPLACE_OPS:
            for p in t.src:
                if p is None or p.external:
                    continue
                hp = h(p)
                if not hp.alloc:
                    continue
                if p.flags & FLAG_OUTPUT or (p.view_src is not None and p.view_src.flags & FLAG_OUTPUT):
                    continue
                if not _same_layout(t, p):
                    continue
                # (a view parent is never "allocated" in ggml-alloc's hash, so the view branch of
                #  ggml_gallocr_allocate_node is dead: ROPE of a reshaped matmul is NOT in place)
                if hp.nc == 1 and hp.nv == 0:
                    ht.addr, ht.buf = hp.addr, hp.buf
                    hp.alloc = False
                    extra = pad(p.nbytes, allocs[hp.buf].align) - pad(t.nbytes, allocs[hp.buf].align)
                    if extra > 0:
                        assert ht.addr is not None  # (the parent is allocated: it has an address)
                        c, off = ht.addr
                        allocs[hp.buf].free_bytes((c, off + pad(t.nbytes, allocs[hp.buf].align)), extra)
                    return
        al = allocs[buf]
        before = al.max_size
        ht.addr, ht.buf = al.alloc(t.nbytes), buf
        if offsets is not None and t.name:
            offsets[t.name] = ht.addr[1]
        if trace is not None and al.max_size > before:
            trace.append((al.max_size, t.name or t.op, cur_i[0]))

    cur_i = [-1]

    def free(t: Tensor) -> None:
        if t.flags & FLAG_OUTPUT:
            return
        ht = h(t)
        assert ht.addr is not None  # (freed only while allocated)
        allocs[ht.buf].free_bytes(ht.addr, t.nbytes)
        ht.alloc = False

    for leaf, buf in zip(leafs, leaf_buf, strict=True):
        alloc_node(leaf, buf)
    for n, buf in zip(nodes, node_buf, strict=True):
        if n.view_src is not None and n.op != "NONE":
            h(n.view_src).nv += 1
        if n.flags & FLAG_INPUT:
            alloc_node(n, buf)
        for s in n.src:
            if s is not None:
                h(s).nc += 1
                if s.flags & FLAG_INPUT:
                    alloc_node(s, buf)
    for i, (n, buf) in enumerate(zip(nodes, node_buf, strict=True)):
        cur_i[0] = i
        for p in n.src:
            if p is not None:
                alloc_node(p, buf)
        alloc_node(n, buf)
        for p in n.src:
            if p is None:
                continue
            hp = h(p)
            hp.nc -= 1
            if hp.nc == 0 and hp.nv == 0:
                if p.view_src is not None:
                    vs = p.view_src
                    hv = h(vs)
                    hv.nv -= 1
                    if hv.nv == 0 and hv.nc == 0 and hv.alloc and not vs.external:
                        free(vs)
                elif hp.alloc and not p.external:
                    free(p)
    return [a.max_size for a in allocs]
