"""Where a request goes in the KV cache, and what makes room for it: the placement rules of the
scheduler (module doc there), apart from its step loop.

- Continue in place only in an idle sequence whose *whole* history is a prefix of the request;
  otherwise a free sequence, sharing the longest prefix any sequence holds (``seq_cp``), or
  copying a longer one back from the host cache. With no free sequence, the least recently used
  idle conversation goes (keeping what it shares with the request when it is the one that does).
- Room is made by moving idle conversations out, least recently used first, by the cells they
  free: into the host cache when it has room (``state_seq_get_data``), else dropped.
- A request that shares a prefix with an earlier one still evaluating its prompt (a system
  prompt, the same picture) waits for those cells and shares them (``catch_up``) instead of
  evaluating them twice.
"""

from __future__ import annotations

import time

from ..backend.llama import Backend
from ..errors import ContextExceeded, MemoryBusy
from .hostcache import HostKVCache, Saved
from .items import Item
from .kvcells import KVCells, Slot
from .requests import Client, Request, Sequence

__all__ = ["Placer", "RESTORE_MIN", "SAVE_MIN", "SHORT_LANE", "SHORT_PROMPT"]

RESTORE_MIN = 32  # copy a conversation back from the host cache when it saves evaluating this many cells
# Beyond max_running requests, a request whose prompt evaluates at most SHORT_PROMPT cells past
# what the caches hold (a follow-up turn) still starts, up to SHORT_LANE × max_running in all: it
# would otherwise wait for a running request's whole picture and reply for a few rows of its own.
SHORT_PROMPT = 256
SHORT_LANE = 2
SAVE_MIN = 16  # conversations smaller than this are dropped, not saved to the host cache


class Placer:
    """The placement rules over one KV cache and its host cache (module doc)."""

    def __init__(self, kv: KVCells, host_cache: HostKVCache, backend: Backend, n_ctx: int):
        self.kv = kv
        self.host_cache = host_cache
        self.backend = backend
        self.n_ctx = n_ctx
        self.evicted = 0  # idle conversations moved out of the KV cache (saved or dropped)
        self.evicted_cells = 0
        self.source = ""  # where the last placed request's cached prefix was (``TurnStats.cache_source``)

    def new_cells(self, items: tuple[Item, ...]) -> int:
        """Cells a prompt of ``items`` would evaluate now: those past the longest prefix the KV
        cache or the host cache holds."""
        cap = len(items) - 1
        k = max((min(s.lcp(items), cap) for s in self.kv.slots if s.kv), default=0)
        _, hk = self.host_cache.best(items)
        return sum(it.n_tokens for it in items[max(k, min(hk, cap)) :])

    def place(self, request: Request, reserve: int, max_running: int) -> Slot | None:
        """A sequence set up to hold the longest prefix of the request anything holds, with
        room made for the rest and the reply (None: not until requests in flight finish)."""
        items = request.prompt.items
        running = self.kv.running()
        if running >= max_running * SHORT_LANE:
            return None
        cap = len(items) - 1  # the last prompt token is always evaluated (its logits)
        lcp = {s.id: min(s.lcp(items), cap) for s in self.kv.slots}
        if running >= max_running:  # the short lane: only a follow-up whose history is cached
            _, hk = self.host_cache.best(items)
            if sum(it.n_tokens for it in items[max(max(lcp.values()), min(hk, cap)) :]) > SHORT_PROMPT:
                return None
        # continue in place only where the whole history is a prefix of the request
        whole = [s for s in self.kv.slots if s.idle and lcp[s.id] == len(s.kv)]
        self.source = "resident"
        if whole:
            own = max(whole, key=lambda s: (len(s.kv), s.last_used))
        else:
            src = max(self.kv.slots, key=lambda s: lcp[s.id])
            k = lcp[src.id]
            saved, hk = self.host_cache.best(items)
            hk = min(hk, cap)
            restore = (
                saved is not None and sum(it.n_tokens for it in items[k:hk]) >= RESTORE_MIN
            )  # (cells it saves evaluating)
            free = [s for s in self.kv.slots if s.free]
            if free:
                own = free[0]
            else:  # every sequence holds a conversation: the least recently used idle one goes
                idle = [s for s in self.kv.slots if s.idle]
                if not idle:  # all of them run (the short lane past max_running): wait
                    return None
                victim = min(idle, key=lambda s: s.last_used)
                if victim is src and not restore:  # ... but what it shares with the request stays
                    self.save(victim)
                    self.kv.truncate(victim, k)
                    own, k = victim, 0
                else:
                    own = self.evict(victim)
            if restore and saved is not None and self.restore(own, saved, hk, request, reserve):
                self.source = saved.source
            elif k > 0 and src is not own and src.kv:
                self.kv.share(src, own, k)
        need = sum(it.n_tokens for it in items[len(own.kv) :]) + reserve
        if not self.make_room(need, keep=own):
            if self.kv.running():
                return None
            raise ContextExceeded(
                f"the prompt and its reply need {need:,} more tokens but the context "
                f"holds {self.n_ctx:,} (use a larger --ctx, a smaller --image-tokens "
                f"or fewer --max-tokens)"
            )
        return own

    def make_room(self, need: int, keep: Slot) -> bool:
        """Move idle conversations out (least recently used first) until ``need`` more cells
        fit beside what runs and is reserved."""
        while self.kv.held() + self.kv.reserved() + need > self.n_ctx:
            idle = [s for s in self.kv.slots if s.idle and s is not keep and self.kv.unique(s) > 0]
            if not idle:
                return False
            self.evict(min(idle, key=lambda s: s.last_used))
        return True

    def evict(self, slot: Slot) -> Slot:
        """An idle conversation out of the KV cache: copied into the host cache when it has
        room for it, then its cells dropped. Returns the slot, now free."""
        self.evicted += 1
        self.evicted_cells += self.kv.cells_of(slot)
        self.save(slot)
        self.kv.truncate(slot, 0)
        slot.owner = None
        return slot

    def save(self, slot: Slot) -> None:
        if slot.kv and self.host_cache.keeps and self.kv.cells_of(slot) >= SAVE_MIN:
            data = self.backend.state_save(slot.id, self.host_cache.largest)
            if data is not None:
                self.host_cache.put(slot.items(), data, slot.owner)

    def restore(self, own: Slot, saved: Saved, k: int, request: Request, reserve: int) -> bool:
        """Copy a saved conversation back into ``own`` (empty) and keep its first ``k`` items;
        False (and nothing changed) when its cells do not fit or llama.cpp refuses."""
        rest = sum(it.n_tokens for it in request.prompt.items[k:])
        kept = sum(it.n_tokens for it in saved.items[:k])
        # all its cells come in before those past ``k`` are cut: room for the larger of the two
        if not self.make_room(max(saved.cells, kept + rest + reserve), keep=own):
            return False
        data = self.host_cache.data(saved)  # (read back from disk for an entry there)
        if data is None or not self.backend.state_load(data, own.id):
            self.backend.kv_remove(0, -1, own.id)
            return False
        self.kv.hold(own, self.kv.new(saved.items))
        self.kv.truncate(own, k)
        self.host_cache.take(saved)
        return True

    def shared_ahead(self, own: Slot, items: tuple[Item, ...]) -> tuple[Sequence, int] | None:
        """An earlier request still evaluating its prompt that will hold more of ``items`` than
        ``own`` does (a system prompt, a picture they share), and how much: this one shares
        those cells once they are there instead of evaluating them a second time."""
        cap = len(items) - 1
        best, k = None, len(own.kv)
        for s in self.kv.slots:
            if s.seq is None or s is own or s.seq.generating:
                continue
            target = s.items() + tuple(s.seq.pending[: s.seq.pending_prompt])
            n = 0
            m = min(len(target), cap)
            while n < m and target[n].key == items[n].key:
                n += 1
            if n > k:
                best, k = s.seq, n
        return (best, k) if best is not None else None

    def catch_up(self, s: Slot) -> bool:
        """Before ``s`` evaluates more of its prompt: share what another sequence now holds of
        it. True when it should wait a step (an earlier request is evaluating what they share)."""
        seq = s.running
        if seq.feed is not None:
            return False
        items = seq.request.prompt.items
        if seq.wait_for is not None:
            ahead, k = seq.wait_for
            holder = next((o for o in self.kv.slots if o.seq is ahead), None)
            if holder is not None and holder.lcp(items) < min(k, len(items) - 1):
                return True  # it is on its way: wait for it
            seq.wait_for = None
        else:
            return False  # (placement shared what there was; nothing came since)
        cap = len(items) - 1
        best = max((o for o in self.kv.slots if o is not s and o.kv), key=lambda o: o.lcp(items), default=None)
        k = min(best.lcp(items), cap) if best is not None else 0
        m = len(s.kv)
        if k > m and best is not None and s.lcp(items) == m:  # (k > m: there is a best)
            self.kv.share(best, s, k)
            taken = seq.pending[: k - m]
            seq.pending = seq.pending[k - m :]
            seq.pending_prompt -= len(taken)
            seq.pending_cells -= sum(it.n_tokens for it in taken)
            seq.c["cached_n"] += sum(it.n_tokens for it in taken)
            seq.c["image_tokens"] -= sum(
                it.n_tokens for it in taken if not it.is_text and it.key[1] in seq.request.new_images
            )
        return False

    # --- saved cells in and out (``Scheduler.export``, ``adopt``, ``persist``: under its lock) --
    def export(self, client: Client, items: tuple[Item, ...], now: int) -> tuple[tuple[Item, ...], bytes] | None:
        """The KV cells of ``client``'s conversation: the idle sequence it owns holding the
        longest prefix of ``items`` (brought back from the host cache first when that holds a
        longer one), cut to that prefix, and llama.cpp's copy of them (``state_seq_get_data``,
        positions included). None: it holds none of them."""
        own = [s for s in self.kv.slots if s.owner is client and s.idle]
        slot = max(own, key=lambda s: s.lcp(items), default=None)
        k = slot.lcp(items) if slot is not None else 0
        saved, hk = self.host_cache.best(items)
        if saved is not None and saved.owner is client and hk > k:
            if hk == len(saved.items):
                return saved.items, saved.data
            slot = self.free_slot()
            if not self.backend.state_load(saved.data, slot.id):
                self.backend.kv_remove(0, -1, slot.id)
                return None
            self.kv.hold(slot, self.kv.new(saved.items))
            self.host_cache.take(saved)
            slot.owner, slot.last_used, k = client, now, hk
        if slot is None or k == 0:
            return None
        if k < len(slot.kv):
            self.kv.truncate(slot, k)  # (a question asked after it, a reply cut short)
        data = self.backend.state_save(slot.id)
        return (slot.items(), data) if data is not None else None

    def free_slot(self) -> Slot:
        """A free sequence: one nobody holds, or the least recently used idle one, moved out."""
        slot = next((s for s in self.kv.slots if s.free), None)
        if slot is not None:
            return slot
        idle = [s for s in self.kv.slots if s.idle]
        if not idle:
            raise MemoryBusy("every sequence is running a request; try again when one finishes")
        return self.evict(min(idle, key=lambda s: s.last_used))

    def adopt(self, client: Client, items: tuple[Item, ...], data: bytes | memoryview, now: int) -> bool:
        """Saved cells into a sequence of ``client``'s (a free one, or the least recently used
        idle conversation's, moved out first), room made for them as for any request: the next
        request whose prompt starts with ``items`` continues there without evaluating them.
        False (nothing changed) when llama.cpp does not take them."""
        slot = self.free_slot()
        if not self.make_room(sum(it.n_tokens for it in items), keep=slot):
            raise MemoryBusy("the context is held by requests in flight; try again when they finish")
        if not self.backend.state_load(data, slot.id):
            self.backend.kv_remove(0, -1, slot.id)
            return False
        self.kv.hold(slot, self.kv.new(items))
        slot.owner, slot.last_used = client, now
        return True

    def persist(self, deadline: float) -> int:
        """The server stops: queue the idle conversations in the KV cache and in host RAM for the
        disk tier (until ``deadline``, monotonic), so a restart loses none of them. Returns how
        many were queued; none without a disk tier."""
        disk = self.host_cache.disk
        if disk is None:
            return 0
        n = 0
        for s in self.kv.slots:
            if time.monotonic() >= deadline:
                break
            if s.seq is None and self.kv.cells_of(s) >= SAVE_MIN:
                data = self.backend.state_save(s.id, disk.max_bytes)
                if data is not None and disk.put(s.items(), data, wait_s=max(0.0, deadline - time.monotonic())):
                    n += 1
        for e in self.host_cache.entries():
            if time.monotonic() < deadline:
                n += disk.put(e.items, e.data, wait_s=max(0.0, deadline - time.monotonic()))
        return n
