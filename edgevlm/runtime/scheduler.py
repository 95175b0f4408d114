"""The sequence scheduler: one runtime under every caller (the chat engine, captioning, the
server).

``Scheduler`` owns the llama.cpp context of a loaded model pair: ``n_seq_max`` sequence ids over
one unified KV cache — *conversations kept*, many more than the requests that generate at once
(``max_running``) — the image cache and the encoder queue shared by all of them, a host-RAM
cache of idle conversations (``cache_ram``), and the step loop.

- ``submit(request, client)`` places a request and returns at once (no model work): it
  continues in place in the idle sequence whose *whole* history is a prefix of the request;
  otherwise it takes a free sequence id and shares the longest prefix any sequence holds
  (``llama_memory_seq_cp``: the cells gain a sequence, nothing is copied) — or copies it back
  from the host cache when that holds a longer one. Cells are made by moving idle
  conversations out, least recently used first, by the cells they free: into the host cache
  (``llama_state_seq_get_data``) when it has room, else dropped. A request that fits only once
  others finish gets ``WAIT``; one that can never fit, a ``ContextExceeded``.
- ``step()`` gives every generating request its next token first, then fills the rest of the
  batch with prompt work — text slices and picture embedding rows, a bounded slice per step
  (chunked prefill, ``stepcost``: running streams slow down at most about twofold while a new
  picture is evaluated), in the same batch as the tokens where the model allows (``tokrows``)
  — samples, and returns the requests that finished. Prompt work goes least remaining first,
  then in arrival order: a follow-up turn gets its first token before a new picture's hundreds
  of rows are through. Alone (nobody generating), prompt work goes one micro-batch a step. A
  picture is encoded as a step of its own, on all the cores (``encoder``). The throughput
  profile (``sched_options``: batch work) fills every step's batch with prompt rows.
- ``stream(seq)`` yields one request's text as it is generated, stepping as needed.

Every KV cell is accounted for (``kvcells``), every reply's cells are reserved when its request
starts — a reply grows into its own reserve or into cells nobody reserved (idle conversations
moved out for it first), never into another's (then it ends "context") — and llama.cpp's time
is attributed to the requests by their tokens in each batch.

A fault in one request ends that request only: a batch llama.cpp refuses is retried in smaller
parts (what a failed batch left in the KV cache is removed first), and only a sequence that
fails on its own ends with an error; a sampler or an encode that raises ends its own sequence.
Each request belongs to a ``Client``: finished sequences are handed to their client, and a
client cancels and forgets only its own (the request types are ``requests``'). A request that
runs alone is cut into the same batches on every run — nothing measured in time decides its
cuts or its threads — so its greedy tokens are the same run after run; with several in flight,
the batches it shares depend on when the others came, and greedy replies start from the same
logits within the float rounding of batched kernels (docs/architecture.md).
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Generator
from typing import Any

from ..backend.llama import Backend
from ..errors import BackendError
from ..plan.context import ContextBudget
from ..vision.merge import MergeSpec
from .chat_format import PromptFormatter
from .conversation import Message
from .encoder import Encoder
from .feed import make_feed
from .hostcache import make_host_cache
from .items import ImageCache, Item, Prompt
from .kvcells import KVCells, Slot
from .placement import Placer
from .prompt import PromptRenderer
from .requests import WAIT, Client, GenerationResponse, Request, Sequence
from .sched_options import THROUGHPUT, SchedulerOptions
from .stats import build_stats
from .stepcost import StepCosts

__all__ = ["THROUGHPUT", "WAIT", "Client", "GenerationResponse", "Request", "Scheduler", "SchedulerOptions", "Sequence"]


class Scheduler:
    """Conversations kept over one llama.cpp context, requests stepped in one batch (module doc)."""

    def __init__(self, backend: Backend, options: SchedulerOptions = SchedulerOptions()):
        self.backend = backend
        self.options = options
        self.images = ImageCache(backend, options.image_cache_units, options.image_cache_bytes)
        self.renderer = PromptRenderer(backend, self.images)
        self.budget = ContextBudget(backend.n_ctx, backend.max_token_bytes)
        self.kv = KVCells(backend, backend.n_seq_max)
        self.slots = self.kv.slots
        self.max_running = max(1, min(options.max_running or len(self.slots), len(self.slots)))
        self.host_cache = make_host_cache(backend, options)
        self.placer = Placer(self.kv, self.host_cache, backend, backend.n_ctx)
        self.encoder = Encoder(backend)
        self.throughput = options.profile == "throughput"
        # whether a request waits to start (the server's worker): picture rows alone go in parts
        self.arrivals: Callable[[], bool] | None = None
        self.llama_ms = 0.0  # time inside llama.cpp / mtmd (encode, decode, sampling)
        self.lock = threading.RLock()
        self._clock = itertools.count(1)
        self._arrival = itertools.count()
        self.costs = StepCosts(options.prefill_share, backend.n_ubatch)  # what steps take, and the rows of the next
        # what the step loop did (``/status``): steps, those with prompt work beside streams,
        # tokens generated, prompt rows evaluated (text and image), steps that found nothing to do
        keys = ("steps", "mixed_steps", "generated", "prompt_rows", "image_rows", "idle_steps")
        self.counters = dict.fromkeys(keys, 0)

    # --- facts and capacity ------------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        return self.backend.n_ctx

    @property
    def n_slots(self) -> int:
        """Sequence ids: conversations the KV cache keeps."""
        return len(self.slots)

    @property
    def formatter(self) -> PromptFormatter:
        return self.renderer.formatter

    @property
    def default_stops(self) -> list[str]:
        return self.renderer.formatter.default_stops

    def render(
        self,
        messages: list[Message],
        system: str | None = None,
        merge: MergeSpec = MergeSpec(),
        keep_images: bool = True,
        **tooling: Any,
    ) -> Prompt:
        """Messages → the prompt of the next reply (``PromptRenderer.render``; ``tooling``: its
        ``tools``, ``think`` and ``tool_required``)."""
        return self.renderer.render(messages, system, merge, keep_images, **tooling)

    def cells_used(self) -> int:
        """KV cells llama.cpp holds: the accounted items (shared cells once) and the rows of
        pictures being fed."""
        return self.kv.held()

    @property
    def busy(self) -> int:
        """Requests running (generating or evaluating their prompt)."""
        return self.kv.running()

    def has_free_slot(self) -> bool:
        """Whether another request may start now (fewer than ``max_running`` run)."""
        return self.busy < self.max_running

    @property
    def conversations(self) -> int:
        """Sequences holding cells (running or idle)."""
        return sum(1 for s in self.slots if s.kv or s.seq is not None)

    # --- starting a request ------------------------------------------------------------------
    def submit(self, request: Request, client: Client | None = None) -> Sequence | str:
        """Place ``request`` for ``client`` (see the module doc): a ``Sequence`` whose prompt
        the next steps evaluate, or ``WAIT``. A request that fails here (its size, its
        grammar) leaves nothing behind."""
        with self.lock:
            t_submit = time.perf_counter()
            items = request.prompt.items
            reserve = request.reserve if request.reserve is not None else self.budget.reply_reserve(request.max_tokens)
            need = request.prompt.cells
            if not items or not items[-1].is_text:
                raise BackendError("the prompt does not end with text (nothing to generate from)")
            self.budget.check(need, reserve)
            for unit in request.prompt.units.values():
                unit.check()
            sampler = self.backend.make_sampler(request.sampling)  # a bad grammar: before any work
            try:
                slot = self.placer.place(request, reserve, self.max_running)
            except BaseException:
                self.backend.free_sampler(sampler)
                raise
            if slot is None:
                self.backend.free_sampler(sampler)
                self._warm(request)
                return WAIT
            tokenize, arrival = self.backend.tokenize_fragment, next(self._arrival)
            seq = Sequence(request, reserve, request.t_start or t_submit, t_submit, client, tokenize, arrival)
            seq.sampler = sampler
            k = len(slot.kv)
            seq.pending = list(items[k:])
            seq.pending_prompt = len(seq.pending)
            seq.pending_cells = sum(it.n_tokens for it in seq.pending)
            seq.c["cached_n"] = sum(it.n_tokens for it in items[:k])
            seq.c["cache_source"] = self.placer.source
            seq.c["image_tokens"] = sum(
                it.n_tokens for it in seq.pending if not it.is_text and it.key[1] in request.new_images
            )
            seq.wait_for = self.placer.shared_ahead(slot, items)
            self.kv.start(slot, seq)
            slot.owner = client
            slot.last_used = next(self._clock)
            if client is not None:
                client.running.add(seq)
            if not any(not it.is_text for it in seq.pending):
                request.prompt.release()  # its pictures are all in the KV cache already
            for it in seq.pending:  # pictures not encoded yet: the encoder starts on them now
                if not it.is_text:
                    self._ask_encoder(seq, it)
            return seq

    def new_cells(self, prompt: Prompt) -> int:
        """Cells ``prompt`` would evaluate if it started now (past what the caches hold)."""
        with self.lock:
            return self.placer.new_cells(prompt.items)

    def _warm(self, request: Request) -> None:
        """A request that waits for cells: its pictures are encoded meanwhile."""
        for it in request.prompt.items:
            if not it.is_text:
                unit = request.prompt.units[it.key[1]]
                if not unit.closed:
                    self.encoder.request(unit, it.key[2])

    def _ask_encoder(self, seq: Sequence, it: Item) -> None:
        """Have the encoder start on a picture chunk of ``seq``'s prompt (once); whether its
        embeddings were there already decides how the request counts it (reused/encoded)."""
        unit = seq.request.prompt.units[it.key[1]]
        ci = it.key[2]
        if (unit.key, ci) not in seq.asked:
            seq.asked[(unit.key, ci)] = ci in unit.embeddings
            self.encoder.request(unit, ci)

    # --- one step ------------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Give every generating request its next token and the rest of the batch to prompt
        work, least remaining first (module doc); sample; return the requests that finished
        (every client's: each is also handed to its own client)."""
        with self.lock:
            running = list(self.kv.live)
            if not running:
                return []
            done: list[Sequence] = []
            gen = [s for s in running if s.running.generating]
            if self.encoder.place():
                self.counters["steps"] += 1  # an encode was this step's work (encoder)
                return []
            done = self._step(running, gen)
        return done

    def _step(self, running: list[Slot], gen: list[Slot]) -> list[Sequence]:
        """One step's decode (``step``): its finished requests (a step that found nothing to do is counted)."""
        done: list[Sequence] = []
        room = self.backend.n_batch - len(gen)
        # tokens and a picture's rows in one batch (tokrows): a pass saved beside a slice; not with
        # the throughput profile's full batches of rows, which go faster on their own
        mix = self.backend.mixes_tokens and not self.throughput
        # prompt rows (stepcost; alone: a micro-batch); throughput: all the batch holds
        rows = room if self.throughput else self.costs.rows(len(gen), room, mix)
        groups = [(s, 1) for s in gen]
        picture: tuple[Slot, int] | None = None
        prompts = sorted(
            (s for s in running if not s.running.generating),  # (running: in arrival order)
            key=lambda s: s.running.pending_cells,
        )
        for s in prompts:
            if rows <= 0:
                break
            if self.placer.catch_up(s):
                continue
            seq = s.running
            if not seq.pending[0].is_text:
                if picture is None and self._feed_ready(s, done):
                    n = seq.feeding.left if seq.feeding.non_causal else min(rows, seq.feeding.left)
                    first = any(k == len(g.running.pending) for g, k in groups)  # a first token ...
                    if not gen and first and not self.throughput:  # ... that waits on this step
                        if seq.feeding.non_causal:  # (a slice as beside a stream)
                            continue
                        n = min(n, self.costs.rows(1, room, mix))
                    picture = (s, n)
                    rows -= n
                continue
            n = 0
            while n < min(rows, len(seq.pending)) and seq.pending[n].is_text:
                n += 1
            groups.append((s, n))
            rows -= n
        t0 = time.perf_counter()
        text_rows = sum(n for _, n in groups[len(gen) :])
        one = picture is not None and bool(groups) and mix and not picture[0].running.feeding.non_causal
        if groups:  # (one: the picture's rows in the same batch, one pass over the weights)
            self._run(groups, done, picture if one else None)
            n_rows = text_rows + (picture[1] if one and picture else 0)
            self.costs.measured(len(gen), n_rows, (time.perf_counter() - t0) * 1000, one or (mix and text_rows > 0))
        if picture is not None and not one:
            picture = self._feed_alone(*picture, done)
        self.llama_ms += (time.perf_counter() - t0) * 1000
        idle = not groups and picture is None and not done
        mixed = bool(gen and (text_rows or picture is not None))
        pic = picture[1] if picture is not None else 0
        for k, v in zip(self.counters, (1, mixed, len(gen), text_rows, pic, idle), strict=True):
            self.counters[k] += v
        return done

    def _run(
        self, groups: list[tuple[Slot, int]], done: list[Sequence], picture: tuple[Slot, int] | None = None
    ) -> None:
        """Decode the next ``n`` pending text items of each slot in one batch (with
        ``picture``'s next rows, as embedding rows: ``Backend.decode_rows``) and sample the
        slots whose prompt is through. A batch llama.cpp refuses is retried in halves (by
        sequence, then a lone sequence with fewer items; the picture on its own); a sequence
        that fails alone ends with the error, and no other sequence's cells are touched."""
        be = self.backend
        entries: list[tuple[int, int, int, bool]] = []
        outs: dict[int, int] = {}  # slot id → batch index of its output
        for s, n in groups:
            seq = s.running
            for j in range(n):
                last = j == len(seq.pending) - 1
                entries.append((s.id, seq.pending[j].key[1], s.pos + j, last))
                if last:
                    outs[s.id] = len(entries) - 1
        t0 = time.perf_counter()
        try:
            if picture is None:
                be.decode_multi(entries)
            else:
                ps, pn = picture
                feed = ps.running.feeding
                part = slice(feed.done, feed.done + pn)
                be.decode_rows(entries, (ps.id, feed.rows[part], feed.positions[part]))
        except Exception as exc:  # llama.cpp refused the batch, or something broke on the way
            for s, _ in groups:  # what a failed batch left in the cache is not accounted: drop it
                be.kv_remove(s.pos, -1, s.id)
            if picture is not None:  # ... and the picture's new rows (those fed before stay)
                be.kv_remove(int(feed.positions[feed.done]), -1, ps.id)
                self._run(groups, done)
                self._feed_rows(ps, pn, done)
            elif len(groups) > 1:
                mid = len(groups) // 2
                self._run(groups[:mid], done)
                self._run(groups[mid:], done)
            elif groups[0][1] > 1:
                self._run([(groups[0][0], groups[0][1] // 2)], done)
            else:
                self._fail(groups[0][0], exc, "evaluating the reply", done)
            return
        dt = (time.perf_counter() - t0) * 1000
        n_rows = len(entries) + (picture[1] if picture is not None else 0)
        if picture is not None:
            self._fed(*picture, dt * picture[1] / n_rows, done)
        for s, n in groups:
            seq = s.running
            share = dt * n / n_rows
            n_prompt = min(n, seq.pending_prompt)
            seq.prompt_ms += share * n_prompt / n
            seq.predicted_ms += share * (n - n_prompt)
            self.kv.hold(s, self.kv.new(seq.pending[:n]))
            seq.c["prompt_n"] += n_prompt
            seq.pending = seq.pending[n:]
            seq.pending_prompt -= n_prompt
            seq.pending_cells -= n
        # a reply past its own reserve grows into cells nobody has reserved: idle conversations
        # are moved out for it (least recently used first) before it is cut ("context"); those
        # sampled before it this step count already (their next token is pending: ``reserved``)
        for s, _ in groups:
            seq = s.running
            if seq.pending:  # a long prompt: the rest comes next step
                continue
            try:
                finish = self._sample(s, outs[s.id])
            except Exception as exc:  # this sequence's sampler (or its text) failed: it alone ends
                self._fail(s, exc, "sampling", done)
                continue
            if finish is None and len(seq.tokens) > seq.reserve and not self.placer.make_room(1, keep=s):
                finish = "context"  # (make_room: its next token's cell, idle conversations moved out)
            if finish is not None:
                done.append(self._finish(s, finish))
            else:
                seq.pending_cells = 1

    # --- pictures ------------------------------------------------------------------------------
    def _feed_ready(self, s: Slot, done: list[Sequence]) -> bool:
        """Whether the picture at the head of ``s``'s prompt can be fed now (its embeddings
        encoded); sets ``seq.feed``. A failed encode ends that request."""
        seq = s.running
        if seq.feed is not None:
            return True
        it = seq.pending[0]
        unit = seq.request.prompt.units[it.key[1]]
        ci = it.key[2]
        if ci in unit.errors or unit.closed:
            self._fail(
                s,
                unit.errors.get(ci) or BackendError("the picture's image unit was closed"),
                "encoding the picture",
                done,
            )
            return False
        emb = unit.embeddings.get(ci)
        if emb is None:
            self._ask_encoder(seq, it)
            return False
        if seq.asked.get((unit.key, ci), True):
            seq.c["reused"] += 1
        else:
            seq.c["encoded"] += 1
            seq.c["encode_ms"] += unit.encode_ms.get(ci, 0.0)
            seq.prompt_ms += unit.encode_ms.get(ci, 0.0)  # (prompt_ms: image encoding included)
        try:
            seq.feed = make_feed(self.backend, s.pos, it, unit, emb, seq.request.new_images)
        except Exception as exc:
            self._fail(s, exc, "preparing the picture", done)
            return False
        return True

    def _feed_alone(self, s: Slot, n: int, done: list[Sequence]) -> tuple[Slot, int]:
        """Feed ``n`` rows of ``s``'s picture in a batch of their own; where a request may arrive
        (``arrivals``), in parts (``StepCosts.part``) until one has: a follow-up's first token
        does not wait for a whole batch of another picture's rows. Returns (s, rows fed)."""
        fed, arrivals = 0, None if s.running.feeding.non_causal else self.arrivals
        while fed < n and s.seq is not None and s.running.feed is not None:
            k = self.costs.part(n - fed) if arrivals is not None else n - fed
            t1 = time.perf_counter()
            self._feed_rows(s, k, done)
            self.costs.measured(0, k, (time.perf_counter() - t1) * 1000)
            fed += k
            if arrivals is not None and arrivals():
                break
        return s, fed

    def _feed_rows(self, s: Slot, n: int, done: list[Sequence]) -> None:
        """Feed the next ``n`` rows of ``s``'s picture; once all are in, it stands in the slot's
        items. A failure ends that request (its rows are removed again)."""
        feed, t0 = s.running.feeding, time.perf_counter()
        part = slice(feed.done, feed.done + n)
        try:
            self.backend.decode_embeddings(feed.rows[part], feed.positions[part], feed.non_causal, s.id)
        except Exception as exc:
            self.backend.kv_remove(s.pos, -1, s.id)
            feed.done = 0
            self._fail(s, exc, "evaluating the picture", done)
            return
        self._fed(s, n, (time.perf_counter() - t0) * 1000, done)

    def _fed(self, s: Slot, n: int, ms: float, done: list[Sequence]) -> None:
        """The next ``n`` rows of ``s``'s picture are in the KV cache (they took ``ms``)."""
        seq, feed = s.running, s.running.feeding
        seq.prompt_ms += ms
        feed.done += n
        if feed.left > 0:
            return
        it = seq.pending.pop(0)
        seq.feed = None
        seq.pending_prompt -= 1
        seq.pending_cells -= it.n_tokens
        self.kv.hold(s, self.kv.new([feed.final]))  # (M-RoPE: it advances the position as mtmd counts)
        seq.c["prompt_n"] += feed.final.n_tokens
        for k, v in feed.counters.items():
            seq.c[k] = seq.c.get(k, 0) + v
        if all(p.is_text for p in seq.pending):
            seq.request.prompt.release()  # its pictures are in the KV cache now
            self.images.trim(keep=seq.request.prompt.units)

    # --- sampling and ending -------------------------------------------------------------------
    def _sample(self, s: Slot, index: int) -> str | None:
        """Sample slot ``s``'s next token from batch output ``index``; a finish reason or None."""
        be, seq = self.backend, s.running
        ts = time.perf_counter()
        if seq.request.keep_logits and seq.first_logits is None:
            seq.first_logits = be.logits(index).copy()
        if seq.forced:  # (a reasoning budget closing </think>): put in, the sampler told
            tok = seq.forced.popleft()
            be.accept(seq.sampler, tok)
        else:
            tok = be.sample(seq.sampler, index)
        now = time.perf_counter()
        seq.predicted_ms += (now - ts) * 1000
        seq.times.append(now)
        if be.is_eog(tok):
            return "stop"
        before = len(seq.text.text)
        piece, stopped = seq.text.add(tok, be.token_bytes(tok, special=tok in seq.request.preserve))
        if piece:
            seq.out.append(GenerationResponse(piece, tok))
        if stopped:
            return "stop"
        if seq.request.think is not None:
            seq.cap_thinking(before)
        if len(seq.tokens) >= seq.request.max_tokens:
            return "length"
        seq.pending = [Item(("t", tok), 1, 1)]
        return None

    def _fail(self, s: Slot, exc: BaseException, what: str, done: list[Sequence]) -> None:
        s.running.error = (
            exc if isinstance(exc, BackendError) else BackendError(f"{what} failed ({type(exc).__name__}: {exc})")
        )
        done.append(self._finish(s, "error"))

    def _finish(self, slot: Slot, finish: str) -> Sequence:
        seq = slot.seq
        assert seq is not None
        if seq.fed:  # a picture fed part of the way: its rows go (the slot keeps whole items)
            self.backend.kv_remove(slot.pos, -1, slot.id)
        seq.feed = None
        if seq.sampler is not None:
            self.backend.free_sampler(seq.sampler)
        seq.sampler = None
        self.kv.stop(slot)
        slot.last_used = next(self._clock)
        seq.pending = []
        seq.pending_cells = 0
        seq.finish_reason = finish
        seq.request.prompt.release()
        seq.stats = build_stats(
            seq.c,
            len(seq.tokens),
            seq.times,
            seq.t_start,
            seq.prompt_ms,
            seq.predicted_ms,
            self.cells_used(),
            self.n_ctx,
            finish,
        )
        seq.out.append(GenerationResponse(seq.text.rest(), None, finish, seq.stats))
        if seq.client is not None:
            seq.client.running.discard(seq)
            seq.client.finished.append(seq)
        return seq

    # --- callers -----------------------------------------------------------------------------
    def cancel(self, seq: Sequence) -> None:
        """Stop a request (Ctrl-C, a client gone): it finishes "interrupted"; the cells it
        filled stay for the prefix of the next request."""
        with self.lock:
            if seq.done:
                return
            slot = next((s for s in self.kv.live if s.seq is seq), None)
            if slot is not None:
                self._finish(slot, "interrupted")

    def stream(self, seq: Sequence) -> Generator[GenerationResponse, None, None]:
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

    # --- conversations to and from a file (``saved``) and the disk tier -----------------------
    def export(self, client: Client, items: tuple[Item, ...]) -> tuple[tuple[Item, ...], bytes] | None:
        with self.lock:  # (Placer.export says what)
            return self.placer.export(client, items, next(self._clock))

    def adopt(self, client: Client, items: tuple[Item, ...], data: bytes | memoryview) -> bool:
        with self.lock:  # (Placer.adopt says what)
            return self.placer.adopt(client, items, data, next(self._clock))

    def persist(self, deadline: float) -> int:
        """The server stops: idle conversations to the disk tier (``Placer.persist``) by ``deadline``."""
        with self.lock:
            n = self.placer.persist(deadline)
        if self.host_cache.disk is not None:
            self.host_cache.disk.flush(deadline)
        return n

    def cancel_client(self, client: Client) -> None:
        """Cancel what ``client`` has in flight (nobody else's)."""
        with self.lock:
            for seq in list(client.running):
                self.cancel(seq)

    def forget(self, client: Client) -> None:
        """Cancel ``client``'s requests and drop the KV cells of the conversations it left in
        the sequences and the host cache (other clients' cells, and prefixes they share, stay)."""
        with self.lock:
            self.cancel_client(client)
            for s in self.slots:
                if s.owner is client and s.seq is None:
                    self.kv.truncate(s, 0)
                    s.owner = None
            self.host_cache.forget(client)

    def cancel_all(self) -> None:
        with self.lock:
            for s in self.slots:
                if s.seq is not None:
                    self.cancel(s.seq)

    def clear(self) -> None:
        """Cancel what is in flight and empty the KV cache and the host cache (image embeddings
        stay cached): the model owner's reset, for every client at once."""
        with self.lock:
            self.cancel_all()
            self.kv.clear()
            self.host_cache.forget()

    def close(self) -> None:
        with self.lock:
            self.cancel_all()
            self.encoder.close()
            self.images.close()
            self.host_cache.close()
