"""The node order llama.cpp's Vulkan backend gives each split before ggml allocates it
(``ggml_vk_graph_optimize``, ggml-vulkan.cpp): it pulls independent nodes of the next 20 forward
so that they run together and keeps fusable runs (RMS_NORM → MUL → ADD, ROPE → VIEW →
SET_ROWS, ...) adjacent. The order changes which tensors are alive together, so the compute
buffer on a Vulkan device is the allocator replayed over this order, not the graph's (on the
LLaVA-1.5 shape 84.5 MiB, where the graph's order needs 100.5).

Ported for the ops the replayed graphs contain; the mixture-of-experts, snake, QSA and
hyper-connection patterns of the original need ops (ARGSORT, SIN, TOP_K, DSV4_HC_POST) that
never occur in them, so they cannot match and are left out.
"""

from __future__ import annotations

from collections.abc import Sequence

from .graphalloc import FLAG_OUTPUT, Tensor

__all__ = ["vulkan_order"]

EMPTY = {"NONE", "RESHAPE", "TRANSPOSE", "VIEW", "PERMUTE"}
MAX_SRC = 10
NUM_TO_CHECK = 20
KEEP = (
    ("RMS_NORM", "MUL", "ADD", "MUL"),
    ("RMS_NORM", "MUL", "ADD"),
    ("RMS_NORM", "MUL", "ROPE", "VIEW", "SET_ROWS"),
    ("RMS_NORM", "VIEW", "SET_ROWS"),
    ("ROPE", "VIEW", "SET_ROWS"),
)


def _src(t: Tensor, i: int) -> Tensor | None:
    return t.src[i] if i < len(t.src) else None


def _base(t: Tensor) -> Tensor:
    return t.view_src if t.view_src is not None else t


def _empty(t: Tensor) -> bool:
    return t.op in EMPTY


def _is_src_of(dst: Tensor, src: Tensor) -> bool:
    for s in range(MAX_SRC):
        ds = _src(dst, s)
        if ds is src:
            return True
        if _empty(dst) or _empty(src):
            continue
        if ds is not None and _base(ds) is _base(src):
            return True
        ss = _src(src, s)
        if ss is not None and _base(dst) is _base(ss):
            return True
    return _base(dst) is _base(src)


def vulkan_order(nodes: Sequence[Tensor], uses: dict[int, int]) -> list[Tensor]:
    """The split's nodes in the order ggml_vk_graph_optimize leaves them. ``uses``: how many
    times each tensor is a source in the whole graph (ggml's use counts, before copies)."""
    n = len(nodes)
    used = [False] * n
    done: set[int] = set()
    order: list[Tensor] = []
    first = 0

    def match(pattern: tuple[str, ...], start: int) -> bool:
        if start + len(pattern) > n:
            return False
        return all(nodes[start + k].op == op and not used[start + k] for k, op in enumerate(pattern))

    def advance() -> None:
        nonlocal first
        while first < n and used[first]:
            first += 1

    def scheduled_between(lo: int, hi: int) -> bool:
        return all(used[v] or _empty(nodes[v]) for v in range(lo, hi))

    def can_pull(idxs: list[int], output: int) -> bool:
        """ggml_can_fuse_subgraph_ext for a ROPE/RMS_NORM → VIEW → SET_ROWS run."""
        members = [nodes[i] for i in idxs]
        for k, i in enumerate(idxs):
            t = nodes[i]
            if i == output:
                continue
            if t.flags & FLAG_OUTPUT:
                return False
            inside = sum(1 for o in members[k + 1 :] for s in o.src if s is t)
            if inside != uses.get(id(t), 0):
                return False
            v = t.view_src
            while v is not None:
                if not any(v is m for m in members) and not v.external:
                    return False
                v = v.view_src
        return True

    while first < n:
        kept = next((p for p in KEEP if match(p, first)), None)
        if kept is not None:
            for k in range(len(kept)):
                order.append(nodes[first + k])
                done.add(id(nodes[first + k]))
                used[first + k] = True
            advance()
            continue
        cur = [first]
        for j in range(first + 1, min(first + NUM_TO_CHECK, n)):
            if used[j] or _empty(nodes[j]):
                continue
            if any(match(p, j) for p in KEEP):
                continue
            ok = True
            for c in range(first, j):
                if used[c] or not _is_src_of(nodes[j], nodes[c]):
                    continue
                last = c == cur[-1]
                cj, cc = nodes[j].op, nodes[c].op
                if last and cc == "RMS_NORM" and cj == "MUL" and scheduled_between(c + 1, j):
                    continue
                if last and cc == "UNARY" and cj == "MUL" and scheduled_between(c + 1, j):
                    continue
                if j == c + 1 and last and (cc, cj) in (("MUL_MAT", "ADD"), ("ADD", "ADD")):
                    continue
                ok = False
                break
            if not ok:
                continue
            cur.append(j)
            rope = j
            if nodes[j].op == "MUL" and nodes[j - 1].op == "RMS_NORM":
                for k in range(j + 1, min(j + 15, n)):
                    t = nodes[k]
                    s1, s2 = _src(t, 1), _src(t, 2)
                    if (
                        t.op == "ROPE"
                        and _src(t, 0) is nodes[j]
                        and s1 is not None
                        and s1.op == "NONE"
                        and (s2 is None or s2.op == "NONE")
                    ):
                        rope = k
                        cur.append(k)
                        used[k] = True
                        break
            if nodes[rope].op in ("ROPE", "RMS_NORM"):
                view = rows = -1
                for k in range(rope + 1, min(rope + 15, n)):
                    if used[k]:
                        continue
                    if view == -1 and nodes[k].op == "VIEW" and _src(nodes[k], 0) is nodes[rope]:
                        view = k
                        continue
                    if view != -1 and nodes[k].op == "SET_ROWS" and _src(nodes[k], 0) is nodes[view]:
                        rows = k
                        break
                if rows != -1:
                    pull = can_pull([rope, view, rows], rows)
                    for c in range(rope + 1, rows):
                        if not pull:
                            break
                        if not used[c] and c != view and not _empty(nodes[c]) and _is_src_of(nodes[rows], nodes[c]):
                            pull = False
                    if pull:
                        cur += [view, rows]
                        used[view] = used[rows] = True
            if nodes[j].op == "ADD" and nodes[j - 1].op == "MUL_MAT":
                for k in range(j + 1, min(j + 15, n)):
                    t = nodes[k]
                    s1 = _src(t, 1)
                    if (
                        t.op == "ADD"
                        and _src(t, 0) is nodes[j]
                        and s1 is not None
                        and (s1.op == "NONE" or id(s1) in done)
                    ):
                        cur.append(k)
                        used[k] = True
                        break
        if nodes[cur[-1]].op != "ADD":
            for j in range(first + 1, min(first + NUM_TO_CHECK, n)):
                if used[j] or not _empty(nodes[j]):
                    continue
                if all(used[c] or c in cur or not _is_src_of(nodes[j], nodes[c]) for c in range(first, j)):
                    cur.append(j)
        for c in cur:
            order.append(nodes[c])
            done.add(id(nodes[c]))
            used[c] = True
        advance()
    return order
