"""The unified KV cache as the scheduler accounts for it: one ``Slot`` per llama.cpp sequence id
(a conversation kept, running or idle), the items each holds in order, and the cells they take
— cells shared by several sequences through ``seq_cp`` counted once.

``KVCells`` changes what a slot holds only through ``hold``, ``truncate`` and ``share`` (which
call llama.cpp's ``seq_rm``/``seq_cp`` and keep the counts), so ``used()`` is always what
llama.cpp holds for the accounted items.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ..backend.llama import Backend
from .items import Item
from .requests import Client, Sequence

__all__ = ["Held", "KVCells", "Slot"]


@dataclass
class Held:
    item: Item
    uid: int  # these KV cells: equal uids = the same cells, shared by sequences (seq_cp)


class Slot:
    """One sequence id: what it holds (``kv``, next position ``pos``), the request running in
    it (``seq``), whose conversation it is (``owner``) and when it was last used."""

    def __init__(self, sid: int):
        self.id = sid
        self.kv: list[Held] = []
        self.pos = 0
        self.seq: Sequence | None = None  # the request running here, if any
        self.owner: Client | None = None  # whose conversation these cells are
        self.last_used = 0

    def lcp(self, items: tuple[Item, ...] | list[Item]) -> int:
        """How many of ``items`` this slot holds as its first items."""
        k, n = 0, min(len(self.kv), len(items))
        while k < n and self.kv[k].item.key == items[k].key:
            k += 1
        return k

    @property
    def running(self) -> Sequence:
        """The request running here; asked only of a live slot (``KVCells.live``), whose
        ``seq`` is set from ``KVCells.start`` to ``KVCells.stop``."""
        seq = self.seq
        assert seq is not None, f"slot {self.id} runs no request"
        return seq

    @property
    def idle(self) -> bool:
        """A conversation kept here with no request running."""
        return self.seq is None and bool(self.kv)

    @property
    def free(self) -> bool:
        return self.seq is None and not self.kv

    def items(self) -> tuple[Item, ...]:
        return tuple(h.item for h in self.kv)


class KVCells:
    """Slots over one unified KV cache, every cell accounted for."""

    def __init__(self, backend: Backend, n_slots: int):
        self.backend = backend
        self.slots = [Slot(i) for i in range(n_slots)]
        self.live: list[Slot] = []  # the slots a request runs in, in the order they started
        self._refs: dict[int, int] = {}  # cells (by uid) → how many slots hold them
        self._cells = 0  # cells held, each counted once
        self._uids = itertools.count()

    def used(self) -> int:
        """Cells the accounted items take (shared ones once)."""
        return self._cells

    def held(self) -> int:
        """Cells llama.cpp holds: the accounted items and the rows of pictures being fed."""
        return self._cells + sum(s.running.fed for s in self.live)

    def reserved(self) -> int:
        """Cells the requests in flight may still need: their unevaluated prompts and replies."""
        return sum(
            max(0, s.running.reserve - len(s.running.tokens)) + s.running.pending_cells - s.running.fed
            for s in self.live
        )

    def running(self) -> int:
        return len(self.live)

    def start(self, slot: Slot, seq: Sequence) -> None:
        slot.seq = seq
        self.live.append(slot)

    def stop(self, slot: Slot) -> None:
        slot.seq = None
        self.live.remove(slot)

    def new(self, items: list[Item] | tuple[Item, ...]) -> list[Held]:
        return [Held(it, next(self._uids)) for it in items]

    def hold(self, slot: Slot, held: list[Held]) -> None:
        """Append cells llama.cpp now holds for ``slot`` (new or shared ones)."""
        for h in held:
            n = self._refs.get(h.uid, 0)
            if n == 0:
                self._cells += h.item.n_tokens
            self._refs[h.uid] = n + 1
            slot.pos += h.item.n_pos
        slot.kv.extend(held)

    def truncate(self, slot: Slot, k: int) -> None:
        """Keep the first ``k`` items of a slot; llama.cpp drops its cells from there on (always
        asked: after an interrupted batch it may hold more than the list says)."""
        p0 = sum(h.item.n_pos for h in slot.kv[:k])
        self.backend.kv_remove(p0, -1, slot.id)
        for h in slot.kv[k:]:
            n = self._refs.pop(h.uid) - 1
            if n:
                self._refs[h.uid] = n
            else:
                self._cells -= h.item.n_tokens
        del slot.kv[k:]
        slot.pos = p0

    def share(self, src: Slot, dst: Slot, k: int) -> None:
        """``dst`` gets ``src``'s items ``len(dst.kv)..k`` (``dst`` holds the same items as
        ``src`` before them): the cells gain a sequence, nothing is copied."""
        m = len(dst.kv)
        if k <= m:
            return
        p0 = sum(h.item.n_pos for h in src.kv[:m])
        p1 = p0 + sum(h.item.n_pos for h in src.kv[m:k])
        if p1 > p0:
            self.backend.seq_copy(src.id, dst.id, p0, p1)
        self.hold(dst, src.kv[m:k])

    def unique(self, slot: Slot) -> int:
        """Cells that dropping ``slot`` would free (those no other slot shares)."""
        return sum(h.item.n_tokens for h in slot.kv if self._refs.get(h.uid, 0) == 1)

    def cells_of(self, slot: Slot, k: int | None = None) -> int:
        return sum(h.item.n_tokens for h in slot.kv[:k])

    def clear(self) -> None:
        for s in self.slots:
            s.kv.clear()
            s.pos = 0
            s.owner = None
        self._refs.clear()
        self._cells = 0
        self.backend.kv_clear()
