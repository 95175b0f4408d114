"""A Python replay of ggml's backend scheduler, for predicting the compute buffers llama.cpp
reserves when layers live on a GPU (Vulkan, CUDA, Metal) — one buffer per backend.

``ggml_backend_sched_split_graph`` (ggml-backend.cpp) decides where each node of a reserve graph
runs: next to the weights it multiplies (or on the GPU when an op on host weights is big enough
to offload), inputs on the CPU, the rest expanded from their neighbours; then it cuts the graph
into splits per backend and gives each split copies of the inputs that live elsewhere (the
positions, masks and indices the CPU fills; host weights an offloaded op multiplies). ggml-alloc
then allocates every node, and those copies, in its backend's compute buffer (``graphalloc``).
The CPU backend's buffer is the first GPU's pinned host type when it has one (``Vulkan_Host``,
``CUDA_Host``): that is where logits computed next to a host-side output matrix land.

Pure Python: the graphs are ``compute``'s, the device facts are ``Backend``s (the real probe's
alignment, chunk size and largest tensor an op may touch; what-if devices get defaults).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from .graphalloc import FLAG_INPUT, DynAlloc, Graph, Tensor, allocate, replay
from .vkorder import vulkan_order

__all__ = ["Backend", "Home", "VIEW_OPS", "encoder_bytes", "schedule"]

VIEW_OPS = {"VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"}
HOST_BUFTS = {"CPU", "CPU_Mapped"}  # plus every "<GPU>_Host" pinned type


@dataclass(frozen=True)
class Backend:
    """One backend of the scheduler, in priority order (GPUs first, the CPU last)."""

    name: str  # "Vulkan0", "CUDA0", "CPU"
    buft: str  # its compute buffer type: the device's own, or for the CPU a GPU's pinned host type
    align: int = 32
    max_size: int = 0  # the largest buffer its type allocates (0: no limit); bigger ones are chunked
    max_tensor: int = 0  # the largest tensor an op on it may read or write (0: no limit)
    gpu: bool = False
    min_batch: int = 32  # op offload: rows an op on host weights needs to be worth moving here
    reorder: str = ""  # "vulkan": its splits are reordered before allocation (``vkorder``)
    pad: int = 0  # bytes its buffer type adds to every buffer (Vulkan_Host: 32, "like the CPU's")
    # the head sizes its flash attention takes, K and V alike (empty: any): CUDA's kernels are
    # built for a few (ggml-cuda/fattn.cu), and an attention it cannot run goes to the CPU
    fa_heads: tuple[int, ...] = ()


@dataclass(frozen=True)
class Home:
    """Where a pre-allocated tensor (a weight, a KV cache) lives."""

    buft: str  # "Vulkan0", "CPU_Mapped", "CPU_REPACK", "CPU"
    weights: bool = True


@dataclass
class _Split:
    b: int  # backend id
    start: int  # first node
    end: int = 0
    inputs: list[Tensor] = field(default_factory=list)  # tensors copied in from other backends


def _is_host(buft: str) -> bool:
    return buft in HOST_BUFTS or buft.endswith("_Host")


def _supports_buft(b: Backend, buft: str) -> bool:
    if b.gpu:
        return buft == b.buft
    return _is_host(buft) or buft == "CPU_REPACK"


def _batch(t: Tensor) -> int:
    """ggml's op batch size (``get_op_batch_size``): what op offload compares with min_batch."""
    if t.op == "GET_ROWS":
        return 0
    if t.op == "MUL_MAT":
        return t.ne[1]
    if t.op in ("MUL_MAT_ID", "ROPE"):
        return t.ne[2]
    return t.ne[1] * t.ne[2] * t.ne[3]


def schedule(
    g: Graph,
    backends: Sequence[Backend],
    home: Callable[[Tensor], Home],
    pinned: Callable[[Tensor], int] | None = None,
) -> dict[str, int]:
    """Compute buffer bytes per backend name for reserving graph ``g`` with these backends
    (GPUs first, the CPU last) and the weights and caches where ``home`` puts them;
    ``pinned(node)``: a backend llama.cpp assigns the node itself (-1: none). Like ggml,
    it rewires ``g``'s nodes to read the copies: build a fresh graph for each call."""
    nb = len(backends)
    cpu = nb - 1
    homes: dict[int, Home] = {}
    bid: dict[int, int] = {}  # tensor id -> backend id

    def home_of(t: Tensor) -> Home | None:
        base = t if t.external else t.view_src if (t.view_src is not None and t.view_src.external) else None
        if base is None:
            return None
        k = id(base)
        if k not in homes:
            homes[k] = home(base)
        return homes[k]

    def supports_op(b: int, t: Tensor) -> bool:
        be = backends[b]
        if be.fa_heads and t.op == "FLASH_ATTN_EXT" and t.ne[0] not in be.fa_heads:
            return False  # its output's rows are V's head size (the graphs here: K's too)
        if not be.gpu or not be.max_tensor:
            return True
        return all(s.view_bytes <= be.max_tensor for s in t.src if s is not None) and t.view_bytes <= be.max_tensor

    def from_buffer(t: Tensor, op: Tensor) -> int:
        hm = home_of(t)
        if hm is None:
            return -1
        for b in range(nb):
            if _supports_buft(backends[b], hm.buft) and supports_op(b, op):
                return b
        return -1

    def buft_of(t: Tensor) -> str | None:
        hm = home_of(t)
        if hm is not None:
            return hm.buft
        b = bid.get(id(t), -1)
        if b == -1 and t.view_src is not None:
            b = bid.get(id(t.view_src), -1)
        return backends[b].buft if b != -1 else None

    def buffer_supported(t: Tensor, b: int) -> bool:
        buft = buft_of(t)
        return buft is not None and _supports_buft(backends[b], buft)

    def from_cur(t: Tensor) -> int:
        b = from_buffer(t, t)
        if b != -1:
            return b
        if t.view_src is not None:
            b = from_buffer(t.view_src, t)
            if b != -1:
                return b
        if t.flags & FLAG_INPUT:
            return cpu
        if t.op not in ("ROPE", "FLASH_ATTN_EXT"):
            for s in t.src:
                if s is None or not s.external or not s.weights:
                    continue
                sb = from_buffer(s, t)
                hm = home_of(s)
                if sb == cpu and hm is not None and _is_host(hm.buft):
                    for b in range(cpu):
                        if supports_op(b, t) and _batch(t) >= backends[b].min_batch:
                            return b
                return sb
        return -1

    def is_view(t: Tensor) -> bool:
        return t.op in VIEW_OPS

    nodes = list(g.nodes)
    leafs = list(g.leafs)
    uses: dict[int, int] = {}  # ggml's use counts, taken before copies replace sources
    for t in nodes:
        for s in t.src:
            if s is not None:
                uses[id(s)] = uses.get(id(s), 0) + 1
    for t in nodes:
        b = pinned(t) if pinned is not None else -1
        if b != -1 and supports_op(b, t):
            bid[id(t)] = b
    # externals are leafs of the real graph; they are assigned like leafs
    for t in leafs:
        bid[id(t)] = from_cur(t)
    for t in nodes:
        for s in t.src:
            if s is not None and s.external and id(s) not in bid:
                bid[id(s)] = from_cur(s)
    # pass 1
    for t in nodes:
        if bid.get(id(t), -1) == -1:
            bid[id(t)] = from_cur(t)

    def set_if_supported(t: Tensor, b: int) -> None:
        if supports_op(b, t):
            bid[id(t)] = b

    # pass 2: expand GPU assignments down and up (skipping the CPU), then the rest
    for order, skip_cpu in (
        (nodes, True),
        (nodes[::-1], True),
        (nodes, False),
        (nodes[::-1], False),
    ):
        cur = -1
        for t in order:
            if is_view(t):
                continue
            b = bid.get(id(t), -1)
            if b != -1:
                cur = -1 if (skip_cpu and b == cpu) else b
            elif cur != -1:
                set_if_supported(t, cur)
    # pass 3: unassigned nodes to the backend with the most supported inputs; upgrades
    for t in nodes:
        if is_view(t):
            continue
        b = bid.get(id(t), -1)
        if b == -1:
            best = -1
            for c in range(nb):
                if supports_op(c, t):
                    n = sum(
                        1
                        for s in t.src
                        if s is not None
                        and (bid.get(id(s), -1) != -1 or (s.view_src is not None and bid.get(id(s.view_src), -1) != -1))
                        and buffer_supported(s, c)
                    )
                    if n > best:
                        best = n
                        bid[id(t)] = c
        else:
            for c in range(b):
                if (
                    backends[c].buft == backends[b].buft
                    and supports_op(c, t)
                    and all(buffer_supported(s, c) for s in t.src if s is not None)
                ):
                    bid[id(t)] = c
                    break
    # pass 4: sources from their consumers and views from their sources
    for t in nodes:
        if t.view_src is not None and bid.get(id(t), -1) == -1:
            bid[id(t)] = bid.get(id(t.view_src), -1)
        for s in t.src:
            if s is None or bid.get(id(s), -1) != -1:
                continue
            bid[id(s)] = bid.get(id(s.view_src), -1) if s.view_src is not None else bid.get(id(t), -1)
        for c in range(nb):
            if bid.get(id(t), -1) != -1:
                break
            set_if_supported(t, c)
    # pass 5: splits, and a copy of every input that lives on another backend
    splits: list[_Split] = []
    copies: dict[tuple[int, int], Tensor] = {}
    i = 0
    while i < len(nodes) and is_view(nodes[i]):
        i += 1
    split = _Split(bid[id(nodes[i])] if i < len(nodes) else cpu, 0)
    splits.append(split)
    for k in range(i, len(nodes)):
        t = nodes[k]
        if is_view(t):
            continue
        b = bid[id(t)]
        new = False
        if b == split.b and split.inputs:
            for s in t.src:
                if s is not None and s.external and s.weights:
                    sb = bid.get(id(s), -1)
                    if sb != split.b and not buffer_supported(s, split.b):
                        new = True
                        break
        if b != split.b or new:
            split.end = k
            split = _Split(b, k)
            splits.append(split)
        cur = split.b
        for j, s in enumerate(t.src):
            if s is None:
                continue
            sb = bid[id(s)]
            if sb != cur and not buffer_supported(s, cur):
                key = (id(s), cur)
                if key not in copies:
                    cp = Tensor("NONE", s.type, s.ne, s.nb, name=f"{backends[cur].name}#{s.name}#0")
                    if s.external:  # a weight copied next to the op that multiplies it
                        cp.type, cp.ne, cp.nb = (
                            "raw",
                            (s.ext_bytes, 1, 1, 1),
                            (1, s.ext_bytes, s.ext_bytes, s.ext_bytes),
                        )
                    copies[key] = cp
                    bid[id(cp)] = cur
                    split.inputs.append(s)
                t.src[j] = copies[key]  # like ggml, the graph now reads the copy
    split.end = len(nodes)
    # the graph ggml-alloc sees: per split, each input's keep-alive view and its copy, then the nodes
    copy_nodes: list[Tensor] = []
    copy_buf: list[int] = []
    for sp in splits:
        for s in sp.inputs:
            # ggml_view_tensor leaves op NONE: not a view to the allocator, only a last use of
            # the input, which frees it here unless a node on its own backend still reads it
            dep = Tensor("NONE", s.type, s.ne, s.nb, [s], view_src=s.view_src if s.view_src is not None else s)
            copy_nodes.append(dep)
            copy_buf.append(bid[id(s)])
            copy_nodes.append(copies[(id(s), sp.b)])
            copy_buf.append(sp.b)
        part = nodes[sp.start : sp.end]
        if backends[sp.b].reorder == "vulkan":
            part = vulkan_order(part, uses)
        for t in part:
            copy_nodes.append(t)
            copy_buf.append(bid[id(t)] if bid.get(id(t), -1) != -1 else sp.b)
    # one allocator per distinct buffer type
    bufts: list[str] = []
    for be in backends:
        if be.buft not in bufts:
            bufts.append(be.buft)
    first = {bt: next(be for be in backends if be.buft == bt) for bt in bufts}
    allocs = [DynAlloc(first[bt].align, first[bt].max_size) for bt in bufts]
    buf_of = [bufts.index(be.buft) for be in backends]
    sizes = allocate(copy_nodes, leafs, [buf_of[b] for b in copy_buf], [buf_of[bid[id(t)]] for t in leafs], allocs)
    return {be.name: sizes[buf_of[k]] + (be.pad if sizes[buf_of[k]] else 0) for k, be in enumerate(backends)}


def encoder_bytes(g: Graph, gpu: Backend | None = None, host: bool = False) -> int:
    """A vision encoder's compute buffer: on the CPU (``gpu`` None) the allocator's replay of
    its graph; on a GPU, which holds every encoder weight, that device's buffer, or with
    ``host`` the CPU's (the pixels and positions it fills, in a plain CPU buffer)."""
    if gpu is None:
        return 0 if host else replay(g)
    # clip loads the whole projector file into one buffer marked as weights
    # (GGML_BACKEND_BUFFER_USAGE_WEIGHTS, clip.cpp), so ggml's first pass puts every op on an
    # encoder weight next to it, on the GPU, and its second pass carries that GPU down to the
    # nodes after an op the GPU refuses (an attention score matrix past Vulkan's tensor limit):
    # the graphs' stand-in for those weights (``Graph.EXT``) must read as weights here too
    g.EXT.weights = True
    got = schedule(g, (gpu, Backend("CPU", "CPU")), lambda t: Home(gpu.buft))
    return got["CPU" if host else gpu.name]
