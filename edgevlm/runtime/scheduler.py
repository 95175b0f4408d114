"""The sequence scheduler: one runtime under every caller (the chat engine, captioning, the
server).

``Scheduler`` owns the llama.cpp context of a loaded model pair: ``n_seq_max`` sequence slots
over one unified KV cache, the image cache shared by all of them, and the step loop.

- ``submit(request)`` places a request in the free slot whose cache it continues (a
  conversation's next turn: at least half of that slot's cells are its prefix), else in an empty
  or the least recently used slot; the longest prefix any slot holds becomes part of its
  sequence (``llama_memory_seq_cp``: the cells gain a sequence, nothing is copied), the rest of
  the slot's cells are dropped, the request's pictures (and the text between them) are evaluated
  now, and its last text is left for the next step. When
  the cells it needs are taken, idle slots give theirs back, least recently used first; a
  request that fits only once others finish gets ``WAIT``; one that can never fit, an
  ``InputError``.
- ``step()`` evaluates the next tokens of every request in flight in **one** llama.cpp batch —
  the prompt text of new requests (as far as the micro-batch allows) and one generated token per
  reply — samples, and returns the requests that finished. Generating is memory-bound, so a
  batch of four tokens costs little more than one.
- ``stream(seq)`` yields one request's text as it is generated, stepping as needed.

Every KV cell is accounted for (cells shared through ``seq_cp`` once), every reply's cells are
reserved when its request starts — a reply grows into its own reserve or into cells nobody
reserved, never into another's (then it ends "context") — and llama.cpp's time is attributed
to the requests by their tokens in each batch.

A fault in one request ends that request only: a batch llama.cpp refuses is retried in
smaller parts (what a failed batch left in the KV cache is removed first), and only a sequence
that fails on its own ends with an error; a sampler that raises ends its own sequence. Each
request belongs to a ``Client`` (a conversation, a caption run, the server's worker): finished
sequences are handed to their client, and a client cancels and forgets only its own (the
request types are ``requests``'). With one slot, a request gives exactly the tokens
one-at-a-time evaluation gives; with several, greedy replies start from the same logits (within the float
rounding of batched kernels).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..backend.llama import Backend
from ..errors import BackendError, ContextExceeded
from ..plan.context import ContextBudget
from ..vision.merge import MergeSpec, grid_shape, merge_tokens
from .conversation import Message
from .items import ImageCache, ImageUnit, Item, Prompt
from .prompt import PromptRenderer
from .requests import WAIT, Client, GenerationResponse, Request, Sequence
from .stats import build_stats

__all__ = ["Client", "GenerationResponse", "Request", "Scheduler", "SchedulerOptions", "Sequence", "WAIT"]


@dataclass(frozen=True)
class SchedulerOptions:
    image_cache_units: int = 32  # pictures whose embeddings are kept for reuse
    image_cache_bytes: int = 512 * 2**20


@dataclass
class _Held:
    item: Item
    uid: int  # these KV cells: equal uids = the same cells, shared by sequences (seq_cp)


class _Slot:
    def __init__(self, sid: int):
        self.id = sid
        self.kv: list[_Held] = []  # what this sequence holds, in order (changed by the scheduler's
        self.pos = 0  # next position             _hold / _truncate only, which keep these counts)
        self.seq: Sequence | None = None
        self.owner: Client | None = None  # whose conversation these cells are (the last to run here)
        self.last_used = 0

    def lcp(self, items: tuple[Item, ...]) -> int:
        k, n = 0, min(len(self.kv), len(items))
        while k < n and self.kv[k].item.key == items[k].key:
            k += 1
        return k


class Scheduler:
    """N sequence slots over one llama.cpp context (see the module doc)."""

    def __init__(self, backend: Backend, options: SchedulerOptions = SchedulerOptions()):
        self.backend = backend
        self.options = options
        self.images = ImageCache(backend, options.image_cache_units, options.image_cache_bytes)
        self.renderer = PromptRenderer(backend, self.images)
        self.budget = ContextBudget(backend.n_ctx)
        self.slots = [_Slot(i) for i in range(backend.n_seq_max)]
        self.llama_ms = 0.0  # time inside llama.cpp / mtmd (encode, decode, sampling)
        self.lock = threading.RLock()
        self._refs: dict[int, int] = {}  # cells (by uid) → how many sequences hold them
        self._cells = 0  # KV cells held, each counted once
        self._uids = itertools.count()
        self._clock = itertools.count(1)

    # --- facts and capacity ------------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        return self.backend.n_ctx

    @property
    def n_slots(self) -> int:
        return len(self.slots)

    @property
    def formatter(self):
        return self.renderer.formatter

    @property
    def default_stops(self) -> list[str]:
        return self.renderer.formatter.default_stops

    def render(self, messages: list[Message], system: str | None = None,
               merge: MergeSpec = MergeSpec(), keep_images: bool = True) -> Prompt:
        """Messages → the prompt of the next reply (``PromptRenderer.render``)."""
        return self.renderer.render(messages, system, merge, keep_images)

    def cells_used(self) -> int:
        """KV cells held by the sequences, cells shared through seq_cp counted once."""
        return self._cells

    def _hold(self, slot: _Slot, held: list[_Held]) -> None:
        """Append cells to a slot's list, keeping the counts."""
        for h in held:
            n = self._refs.get(h.uid, 0)
            if n == 0:
                self._cells += h.item.n_tokens
            self._refs[h.uid] = n + 1
            slot.pos += h.item.n_pos
        slot.kv.extend(held)

    def _new(self, items: list[Item] | tuple[Item, ...]) -> list[_Held]:
        return [_Held(it, next(self._uids)) for it in items]

    def _reserved(self) -> int:
        """Cells the requests in flight may still need: their unevaluated text and replies."""
        return sum(max(0, s.seq.reserve - len(s.seq.tokens)) + len(s.seq.pending)
                   for s in self.slots if s.seq is not None)

    @property
    def busy(self) -> int:
        return sum(1 for s in self.slots if s.seq is not None)

    def has_free_slot(self) -> bool:
        return any(s.seq is None for s in self.slots)

    # --- starting a request ------------------------------------------------------------------
    def submit(self, request: Request, client: Client | None = None) -> Sequence | str:
        """Start ``request`` for ``client`` (see the module doc): a ``Sequence``, or ``WAIT``.
        A request that fails here (its pictures, its grammar) leaves nothing behind."""
        with self.lock:
            t_submit = time.perf_counter()
            items = request.prompt.items
            reserve = request.reserve if request.reserve is not None else \
                self.budget.reply_reserve(request.max_tokens)
            need = request.prompt.cells
            if not items or not items[-1].is_text:
                raise BackendError("the prompt does not end with text (nothing to generate from)")
            if need + reserve > self.n_ctx:
                raise ContextExceeded(
                    f"the prompt needs {need:,} tokens (and {reserve:,} for the reply) but the context "
                    f"holds {self.n_ctx:,} (use a larger --ctx, fewer or smaller images, or /reset)")
            slot = self._place(items, reserve)
            if slot is None:
                return WAIT
            seq = Sequence(request, reserve, request.t_start or t_submit, t_submit, client,
                           self.backend.tokenize_fragment)
            seq.sampler = self.backend.make_sampler(request.sampling)  # a bad grammar: before any work
            try:
                self._prefill(slot, seq)
            except BaseException:
                self.backend.free_sampler(seq.sampler)
                seq.sampler = None
                raise
            slot.seq = seq
            slot.owner = client
            slot.last_used = next(self._clock)
            if client is not None:
                client.running.add(seq)
            return seq

    def _place(self, items: tuple[Item, ...], reserve: int) -> _Slot | None:
        """A free slot set up to hold the longest prefix of ``items`` any slot holds, with room
        made for the rest and the reply (None: not until requests in flight finish)."""
        free = [s for s in self.slots if s.seq is None]
        if not free:
            return None
        lcp = {s.id: s.lcp(items) for s in self.slots}
        # A slot whose cache this request mostly continues (a conversation's next turn) is
        # reused; otherwise an empty slot, else the least recently used one, so that other
        # conversations keep their caches. The shared prefix comes by seq_cp either way.
        def cells(s: _Slot, k: int | None = None) -> int:
            return sum(h.item.n_tokens for h in s.kv[:k])

        continuing = [s for s in free if s.kv and cells(s, lcp[s.id]) * 2 >= cells(s)]
        own = max(continuing, key=lambda s: lcp[s.id]) if continuing else \
            min(free, key=lambda s: (bool(s.kv), s.last_used))
        cap = len(items) - 1  # the last prompt token is always evaluated (its logits)
        src = max(self.slots, key=lambda s: lcp[s.id])
        k = min(lcp[src.id], cap)
        if min(lcp[own.id], cap) >= k:
            src = own
        if src is own:
            self._truncate(own, k)
        else:
            self._truncate(own, 0)
            keep = src.kv[:k]
            p1 = sum(h.item.n_pos for h in keep)
            if p1 > 0:
                self.backend.seq_copy(src.id, own.id, 0, p1)
            self._hold(own, keep)
        need = sum(it.n_tokens for it in items[len(own.kv):]) + reserve
        while self.cells_used() + self._reserved() + need > self.n_ctx:
            idle = [s for s in self.slots if s.seq is None and s is not own and s.kv]
            if not idle:
                break
            victim = min(idle, key=lambda s: s.last_used)
            shared = victim.lcp(items)  # first what it does not share with this prompt
            self._truncate(victim, shared if shared < len(victim.kv) else 0)
        if self.cells_used() + self._reserved() + need > self.n_ctx:
            if self.busy:
                return None
            raise ContextExceeded(f"the prompt and its reply need {need:,} more tokens but the context "
                             f"holds {self.n_ctx:,} (use a larger --ctx, a smaller --image-tokens "
                             f"or fewer --max-tokens)")
        return own

    def _truncate(self, slot: _Slot, k: int) -> None:
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

    def _prefill(self, slot: _Slot, seq: Sequence) -> None:
        """Evaluate the request's pictures and the text between them now; the text after the
        last picture waits for the next step (it rides in the batch with the replies)."""
        be = self.backend
        prompt, req = seq.request.prompt, seq.request
        k = len(slot.kv)
        todo = prompt.items[k:]
        tail = len(todo)
        while tail > 0 and todo[tail - 1].is_text:
            tail -= 1
        c = seq.c
        c["cached_n"] = sum(it.n_tokens for it in prompt.items[:k])
        c["image_tokens"] = sum(it.n_tokens for it in todo if not it.is_text and it.key[1] in req.new_images)
        pos = slot.pos
        t0 = time.perf_counter()
        try:
            i = 0
            while i < tail:
                it = todo[i]
                if it.is_text:
                    j = i
                    while j < tail and todo[j].is_text:
                        j += 1
                    pos = be.decode_tokens([t.key[1] for t in todo[i:j]], pos, logits_last=False, seq_id=slot.id)
                    self._hold(slot, self._new(todo[i:j]))
                    c["prompt_n"] += j - i
                    i = j
                    continue
                unit = prompt.units[it.key[1]]
                emb = unit.embedding(it.key[2], be, c)
                if it.merged:
                    pos, it = self._decode_merged(unit, it, emb, pos, slot.id, c, it.key[1] in req.new_images)
                else:
                    pos = be.decode_image(unit.chunk(it.key[2]), emb, pos, slot.id)
                    c["image_tokens_in"] += it.n_tokens
                    c["image_tokens_out"] += it.n_tokens
                self._hold(slot, self._new([it]))
                c["prompt_n"] += it.n_tokens
                i += 1
        except BaseException:
            self._truncate(slot, k)  # nothing half-evaluated stays behind
            raise
        finally:
            prompt.release()  # its pictures are in the KV cache now (or it failed)
            self.images.trim(keep=prompt.units)
            dt = (time.perf_counter() - t0) * 1000
            seq.prompt_ms += dt
            self.llama_ms += dt
        seq.pending = list(todo[tail:])
        seq.pending_prompt = len(seq.pending)

    def _decode_merged(self, unit: ImageUnit, it: Item, emb: np.ndarray, pos: int, seq_id: int,
                       c: dict[str, Any], new: bool) -> tuple[int, Item]:
        """Merge an image chunk's embeddings (cached per merge spec) and feed them; returns
        the new position and the item as it now stands in the KV cache."""
        be = self.backend
        ci, spec = it.key[2], it.key[3]
        chunk = unit.chunk(ci)
        res = unit.merged.get((ci, spec))
        if res is None:
            w, h = grid_shape(chunk.n_tokens, chunk.nx, chunk.ny)
            res = merge_tokens(emb, w, h, spec)
            unit.merged[(ci, spec)] = res
        if be.use_mrope:
            positions = be.image_positions(chunk, pos, res.representative)
            new_pos = pos + chunk.n_pos  # M-RoPE: advance as mtmd would
        else:
            positions = pos + np.arange(res.n_out)
            new_pos = pos + res.n_out
        be.decode_embeddings(res.embd, positions, be.non_causal, seq_id)
        c["image_tokens_in"] += res.n_in
        c["image_tokens_out"] += res.n_out
        c["merge_map_size"] += res.n_in
        if new:
            c["image_tokens"] += res.n_out - it.n_tokens
        return new_pos, Item(it.key, res.n_out, it.n_pos if be.use_mrope else res.n_out)

    # --- one batched step --------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Evaluate the next tokens of every request in flight in one batch, sample, and return
        the requests that finished (every client's: each is also handed to its own client)."""
        with self.lock:
            active = [s for s in self.slots if s.seq is not None and s.seq.pending]
            if not active:
                return []
            groups: list[tuple[_Slot, int]] = []  # (slot, how many of its pending items)
            room = self.backend.n_batch
            for s in active:
                n = min(len(s.seq.pending), room)
                if n <= 0:
                    break
                groups.append((s, n))
                room -= n
            done: list[Sequence] = []
            t0 = time.perf_counter()
            self._run(groups, done)
            self.llama_ms += (time.perf_counter() - t0) * 1000
            return done

    def _run(self, groups: list[tuple[_Slot, int]], done: list[Sequence]) -> None:
        """Decode the next ``n`` pending items of each slot in one batch and sample the slots
        whose prompt is through. A batch llama.cpp refuses is retried in halves (by sequence,
        then a lone sequence with fewer items); a sequence that fails alone ends with the
        error, and no other sequence's cells are touched."""
        be = self.backend
        entries: list[tuple[int, int, int, bool]] = []
        outs: dict[int, int] = {}  # slot id → batch index of its output
        for s, n in groups:
            seq = s.seq
            for j in range(n):
                last = j == len(seq.pending) - 1
                entries.append((s.id, seq.pending[j].key[1], s.pos + j, last))
                if last:
                    outs[s.id] = len(entries) - 1
        t0 = time.perf_counter()
        try:
            be.decode_multi(entries)
        except Exception as exc:  # llama.cpp refused the batch, or something broke on the way
            for s, _ in groups:  # what a failed batch left in the cache is not accounted: drop it
                be.kv_remove(s.pos, -1, s.id)
            if len(groups) > 1:
                mid = len(groups) // 2
                self._run(groups[:mid], done)
                self._run(groups[mid:], done)
            elif groups[0][1] > 1:
                self._run([(groups[0][0], groups[0][1] // 2)], done)
            else:
                s = groups[0][0]
                s.seq.error = exc if isinstance(exc, BackendError) else BackendError(
                    f"evaluating the reply failed ({type(exc).__name__}: {exc})")
                done.append(self._finish(s, "error"))
            return
        dt = (time.perf_counter() - t0) * 1000
        for s, n in groups:
            seq = s.seq
            share = dt * n / len(entries)
            n_prompt = min(n, seq.pending_prompt)
            seq.prompt_ms += share * n_prompt / n
            seq.predicted_ms += share * (n - n_prompt)
            self._hold(s, self._new(seq.pending[:n]))
            seq.c["prompt_n"] += n_prompt
            seq.pending = seq.pending[n:]
            seq.pending_prompt -= n_prompt
        # cells nobody has reserved: what a reply past its own reserve may still grow into
        slack = self.n_ctx - self.cells_used() - self._reserved()
        for s, _ in groups:
            seq = s.seq
            if seq.pending:  # a long prompt: the rest comes next step
                continue
            try:
                finish = self._sample(s, outs[s.id])
            except Exception as exc:  # this sequence's sampler (or its text) failed: it alone ends
                seq.error = exc if isinstance(exc, BackendError) else BackendError(
                    f"sampling failed ({type(exc).__name__}: {exc})")
                done.append(self._finish(s, "error"))
                continue
            if finish is None and len(seq.tokens) > seq.reserve:
                slack -= 1  # its next token needs a cell outside its reserve
                if slack < 0:
                    finish = "context"
            if finish is not None:
                done.append(self._finish(s, finish))

    def _sample(self, s: _Slot, index: int) -> str | None:
        """Sample slot ``s``'s next token from batch output ``index``; a finish reason or None."""
        be, seq = self.backend, s.seq
        ts = time.perf_counter()
        if seq.request.keep_logits and seq.first_logits is None:
            seq.first_logits = be.logits(index).copy()
        tok = be.sample(seq.sampler, index)
        now = time.perf_counter()
        seq.predicted_ms += (now - ts) * 1000
        seq.times.append(now)
        if be.is_eog(tok):
            return "stop"
        piece, stopped = seq.text.add(tok, be.token_bytes(tok))
        if piece:
            seq.out.append(GenerationResponse(piece, tok))
        if stopped:
            return "stop"
        if len(seq.tokens) >= seq.request.max_tokens:
            return "length"
        seq.pending = [Item(("t", tok), 1, 1)]
        return None

    def _finish(self, slot: _Slot, finish: str) -> Sequence:
        seq = slot.seq
        assert seq is not None
        if seq.sampler is not None:
            self.backend.free_sampler(seq.sampler)
        seq.sampler = None
        slot.seq = None
        slot.last_used = next(self._clock)
        seq.pending = []
        seq.finish_reason = finish
        seq.request.prompt.release()
        seq.stats = build_stats(seq.c, len(seq.tokens), seq.times, seq.t_start, seq.prompt_ms,
                                seq.predicted_ms, self.cells_used(), self.n_ctx, finish)
        seq.out.append(GenerationResponse(seq.text.rest(), None, finish, seq.stats))
        if seq.client is not None:
            seq.client.running.discard(seq)
            seq.client.finished.append(seq)
        return seq

    def _forget_all(self) -> None:
        for s in self.slots:
            s.kv.clear()
            s.pos = 0
            s.owner = None
        self._refs.clear()
        self._cells = 0
        self.backend.kv_clear()

    # --- callers -----------------------------------------------------------------------------
    def cancel(self, seq: Sequence) -> None:
        """Stop a request (Ctrl-C, a client gone): it finishes "interrupted"; the cells it
        filled stay for the prefix of the next request."""
        with self.lock:
            if seq.done:
                return
            slot = next((s for s in self.slots if s.seq is seq), None)
            if slot is not None:
                self._finish(slot, "interrupted")

    def stream(self, seq: Sequence) -> Iterator[GenerationResponse]:
        """Yield ``seq``'s reply as it is generated (stepping every request in flight); the last
        response has the finish reason and stats. Closing the iterator cancels the request."""
        try:
            while True:
                while seq.out:
                    yield seq.out.popleft()
                if seq.done:
                    if seq.error is not None:
                        raise seq.error
                    return
                self.step()
        finally:
            self.cancel(seq)

    def cancel_client(self, client: Client) -> None:
        """Cancel what ``client`` has in flight (nobody else's)."""
        with self.lock:
            for seq in list(client.running):
                self.cancel(seq)

    def forget(self, client: Client) -> None:
        """Cancel ``client``'s requests and drop the KV cells of the conversations it left in
        the slots (other clients' cells, and prefixes they share, stay)."""
        with self.lock:
            self.cancel_client(client)
            for s in self.slots:
                if s.owner is client and s.seq is None:
                    self._truncate(s, 0)
                    s.owner = None

    def cancel_all(self) -> None:
        with self.lock:
            for s in self.slots:
                if s.seq is not None:
                    self.cancel(s.seq)

    def clear(self) -> None:
        """Cancel what is in flight and empty the KV cache (image embeddings stay cached): the
        model owner's reset, for every client at once."""
        with self.lock:
            self.cancel_all()
            self._forget_all()

    def close(self) -> None:
        with self.lock:
            self.cancel_all()
            self.images.close()
