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
reserved when its request starts, and llama.cpp's time is attributed to the requests by their
tokens in each batch. With one slot, a request gives exactly the tokens one-at-a-time
evaluation gives; with several, greedy replies start from the same logits (within the float
rounding of batched kernels).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..backend.llama import Backend
from ..backend.sampling import SamplingParams
from ..errors import BackendError, InputError
from ..plan.context import ContextBudget
from ..vision.merge import MergeSpec, grid_shape, merge_tokens
from .conversation import Message
from .items import ImageCache, ImageUnit, Item, Prompt
from .prompt import PromptRenderer
from .stats import TurnStats, build_stats
from .textstream import TextStream

__all__ = ["GenerationResponse", "Request", "Scheduler", "SchedulerOptions", "Sequence", "WAIT"]

WAIT = "wait"  # submit(): not now, the cells are taken until a request in flight finishes


@dataclass(frozen=True)
class SchedulerOptions:
    image_cache_units: int = 32  # pictures whose embeddings are kept for reuse
    image_cache_bytes: int = 512 * 2**20


@dataclass(frozen=True)
class GenerationResponse:
    """One step of a reply: new text, and on the last step the reason and stats."""

    text: str
    token: int | None = None
    finish_reason: str | None = None
    stats: TurnStats | None = None


@dataclass(frozen=True)
class Request:
    """A prompt to evaluate and reply to."""

    prompt: Prompt
    max_tokens: int = 512
    sampling: SamplingParams = SamplingParams()
    stops: tuple[str, ...] = ()  # besides the model's end-of-generation tokens
    reserve: int | None = None  # KV cells kept for the reply (None: the context budget's rule)
    new_images: frozenset[str] = frozenset()  # image units new in this turn (stats.image_tokens)
    t_start: float | None = None  # when the caller started on it (TTFT counts from there)
    counters: Mapping[str, int] = field(default_factory=dict)  # stats a policy adds
    tag: Any = None  # the caller's
    keep_logits: bool = False  # diagnostics: keep the logits the reply starts from


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
        self.last_used = 0

    def lcp(self, items: tuple[Item, ...]) -> int:
        k, n = 0, min(len(self.kv), len(items))
        while k < n and self.kv[k].item.key == items[k].key:
            k += 1
        return k


class Sequence:
    """A request in flight or finished: its reply so far, its stats, and how it ended."""

    def __init__(self, request: Request, reserve: int, t_start: float, t_submit: float):
        self.request = request
        self.reserve = reserve
        self.t_start = t_start
        self.text = TextStream(request.stops)
        self.sampler: Any = None
        self.pending: list[Item] = []  # text to evaluate in the next step
        self.pending_prompt = 0  # how many of them belong to the prompt (the rest: a reply token)
        self.times: list[float] = []  # when each token was sampled
        self.prompt_ms = (t_submit - t_start) * 1000  # preparation + llama.cpp time for the prompt
        self.predicted_ms = 0.0
        self.c: dict[str, Any] = dict(cached_n=0, prompt_n=0, image_tokens=0, encode_ms=0.0,
                                      encoded=0, reused=0, image_tokens_in=0, image_tokens_out=0,
                                      merge_map_size=0, **request.counters)
        self.out: deque[GenerationResponse] = deque()
        self.finish_reason: str | None = None
        self.stats: TurnStats | None = None
        self.error: BaseException | None = None
        self.first_logits: np.ndarray | None = None

    @property
    def tag(self) -> Any:
        return self.request.tag

    @property
    def tokens(self) -> list[int]:
        return self.text.tokens

    @property
    def reply(self) -> str:
        return self.text.text

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


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
    def submit(self, request: Request) -> Sequence | str:
        """Start ``request`` (see the module doc): a ``Sequence``, or ``WAIT``."""
        with self.lock:
            t_submit = time.perf_counter()
            items = request.prompt.items
            reserve = request.reserve if request.reserve is not None else \
                self.budget.reply_reserve(request.max_tokens)
            need = request.prompt.cells
            if not items or not items[-1].is_text:
                raise BackendError("the prompt does not end with text (nothing to generate from)")
            if need + reserve > self.n_ctx:
                raise InputError(
                    f"the prompt needs {need:,} tokens (and {reserve:,} for the reply) but the context "
                    f"holds {self.n_ctx:,} (use a larger --ctx, fewer or smaller images, or /reset)")
            slot = self._place(items, reserve)
            if slot is None:
                return WAIT
            seq = Sequence(request, reserve, request.t_start or t_submit, t_submit)
            self._prefill(slot, seq)
            seq.sampler = self.backend.make_sampler(request.sampling)
            slot.seq = seq
            slot.last_used = next(self._clock)
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
            raise InputError(f"the prompt and its reply need {need:,} more tokens but the context "
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
                    pos = be.decode_image(unit.chunks[it.key[2]], emb, pos, slot.id)
                    c["image_tokens_in"] += it.n_tokens
                    c["image_tokens_out"] += it.n_tokens
                self._hold(slot, self._new([it]))
                c["prompt_n"] += it.n_tokens
                i += 1
        except BaseException:
            self._truncate(slot, k)  # nothing half-evaluated stays behind
            raise
        finally:
            for unit in prompt.units.values():
                if unit.transient:
                    unit.close()
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
        chunk = unit.chunks[ci]
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
        the requests that finished."""
        with self.lock:
            be = self.backend
            active = [s for s in self.slots if s.seq is not None and s.seq.pending]
            if not active:
                return []
            entries: list[tuple[int, int, int, bool]] = []
            outs: dict[int, int] = {}  # slot id → batch index of its output
            shares: dict[int, int] = {}
            room = be.n_batch
            for s in active:
                seq = s.seq
                take = seq.pending[:room]
                if not take:
                    break
                pos = s.pos
                for j, it in enumerate(take):
                    last = j == len(seq.pending) - 1
                    entries.append((s.id, it.key[1], pos + j, last))
                    if last:
                        outs[s.id] = len(entries) - 1
                shares[s.id] = len(take)
                room -= len(take)
            t0 = time.perf_counter()
            try:
                be.decode_multi(entries)
            except BackendError as exc:
                return self._fail_all(exc)
            dt_decode = (time.perf_counter() - t0) * 1000
            for s in active:
                seq, n = s.seq, shares.get(s.id, 0)
                if not n:
                    continue
                share = dt_decode * n / len(entries)
                n_prompt = min(n, seq.pending_prompt)
                seq.prompt_ms += share * n_prompt / n
                seq.predicted_ms += share * (n - n_prompt)
                self._hold(s, self._new(seq.pending[:n]))
                seq.c["prompt_n"] += n_prompt
                seq.pending = seq.pending[n:]
                seq.pending_prompt -= n_prompt
            used = self.cells_used()
            done: list[Sequence] = []
            for s in active:
                if s.id not in shares or s.seq.pending:  # a long prompt: the rest comes next step
                    continue
                finish = self._sample(s, outs[s.id], used)
                if finish is not None:
                    done.append(self._finish(s, finish))
            self.llama_ms += (time.perf_counter() - t0) * 1000
            return done

    def _sample(self, s: _Slot, index: int, used: int) -> str | None:
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
        if used + 1 > self.n_ctx:  # past its reserve, the context is full
            return "context"
        seq.pending = [Item(("t", tok), 1, 1)]
        return None

    def _finish(self, slot: _Slot, finish: str) -> Sequence:
        seq = slot.seq
        assert seq is not None
        self.backend.free_sampler(seq.sampler)
        seq.sampler = None
        slot.seq = None
        slot.last_used = next(self._clock)
        seq.pending = []
        seq.finish_reason = finish
        seq.stats = build_stats(seq.c, len(seq.tokens), seq.times, seq.t_start, seq.prompt_ms,
                                seq.predicted_ms, self.cells_used(), self.n_ctx, finish)
        seq.out.append(GenerationResponse(seq.text.rest(), None, finish, seq.stats))
        return seq

    def _fail_all(self, exc: BaseException) -> list[Sequence]:
        """A batch failed: every request in flight fails with it, the KV cache starts over."""
        out = []
        for s in self.slots:
            if s.seq is not None:
                s.seq.error = exc
                out.append(self._finish(s, "error"))
        self._forget_all()
        return out

    def _forget_all(self) -> None:
        for s in self.slots:
            s.kv.clear()
            s.pos = 0
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

    def cancel_all(self) -> None:
        for s in self.slots:
            if s.seq is not None:
                self.cancel(s.seq)

    def clear(self) -> None:
        """Cancel what is in flight and empty the KV cache (image embeddings stay cached)."""
        with self.lock:
            self.cancel_all()
            self._forget_all()

    def close(self) -> None:
        self.cancel_all()
        self.images.clear()
