"""Parallel sequences: several one-turn prompts with images in flight over one loaded model.

Batch captioning spends most of its time on work that cannot be shared (encoding each picture,
prefilling its tokens), but generating is memory-bound: a batch of four tokens costs about 1.5×
one token (measured on 2 CPU cores, LLaVA-7B layer shapes).
``ParallelRunner`` keeps up to ``n_slots`` prompts in flight, each in its own llama.cpp sequence
of one unified KV cache, and generates the next token of every prompt in one batch (the text
after each new picture rides in the same batch). A finished slot takes the next prompt at once.

    runner = ParallelRunner(engine, 4)
    runner.submit(tag, "Describe this image.", [image], max_tokens=64)   # prefill, blocking
    for done in runner.step():            # one batched llama.cpp decode
        print(done.tag, done.text)

Prompt prefixes are shared, not copied: a new prompt starts from the longest prefix any slot
holds (the system prompt, the turn header), and ``llama_memory_seq_cp`` makes those KV cells
part of its sequence. Greedy replies start from the logits one-prompt-at-a-time evaluation gives
(within float rounding of the batched kernels; exactly with one slot) — tests.
"""

from __future__ import annotations

import codecs
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .backend import SamplingParams
from .engine import Message, _find_stop, _Item
from .errors import BackendError, InputError
from .images import LoadedImage
from .stats import TurnStats, peak_rss_bytes, per_second

WAIT = "wait"  # submit(): not now, the context is full until a prompt in flight finishes
DEFAULT_SLOTS = 4  # beyond ~4 a CPU spends the batch on compute, not on reading weights


def fit_slots(n_ctx: int, per_prompt: int, want: int = DEFAULT_SLOTS, prefix: int = 256) -> int:
    """How many prompts of ``per_prompt`` KV cells (image + text + reply) fit ``n_ctx`` beside a
    shared ``prefix``; at most ``want``, at least 1."""
    return max(1, min(want, (n_ctx - prefix) // max(1, per_prompt)))


@dataclass
class Completion:
    """A prompt that left the runner: its reply, or the error that stopped it."""

    tag: Any
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "stop"
    stats: TurnStats | None = None
    error: Exception | None = None
    first_logits: np.ndarray | None = None  # with keep_logits: the logits the reply started from


@dataclass
class _Held:
    item: _Item
    uid: int  # these KV cells: equal uids = the same cells, shared by sequences (seq_cp)


class _Slot:
    def __init__(self, seq: int):
        self.seq = seq
        self.kv: list[_Held] = []  # what this sequence holds, in order
        self.job: _Job | None = None

    @property
    def pos(self) -> int:
        return sum(h.item.n_pos for h in self.kv)


@dataclass
class _Job:
    tag: Any
    params: SamplingParams
    max_tokens: int
    stops: list[str]
    reserve: int = 0  # KV cells kept for the reply (Engine.reply_reserve)
    sampler: Any = None
    pending: list[_Item] = field(default_factory=list)  # text to evaluate in the next step
    pending_prompt: int = 0  # how many of them belong to the prompt (the rest: the last reply token)
    tokens: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    text: str = ""
    decoder: Any = None
    t_start: float = 0.0
    times: list[float] = field(default_factory=list)
    prompt_ms: float = 0.0  # llama.cpp time attributed to the prompt (encode + prefill)
    predicted_ms: float = 0.0  # ... and to generation
    c: dict[str, Any] = field(default_factory=dict)
    first_logits: np.ndarray | None = None


class ParallelRunner:
    """Up to ``n_slots`` one-turn prompts in flight over an Engine's backend (see module doc).

    The engine's own conversation is cleared: use the engine again after ``close()``."""

    def __init__(self, engine: Any, n_slots: int, keep_logits: bool = False):
        self.engine = engine
        self.be = engine.backend
        self.n_slots = max(1, min(n_slots, self.be.n_seq_max))
        self.slots = [_Slot(i) for i in range(self.n_slots)]
        self.uids = itertools.count()
        self.keep_logits = keep_logits  # diagnostics: keep each reply's first logits
        self.llama_ms = 0.0  # time inside llama.cpp / mtmd (encode, decode, sampling)
        engine.reset()  # the KV cache is ours now

    # --- capacity ------------------------------------------------------------------------
    def cells_used(self) -> int:
        seen: dict[int, int] = {}
        for s in self.slots:
            for h in s.kv:
                seen[h.uid] = h.item.n_tokens
        return sum(seen.values())

    def _reserved(self) -> int:
        """Cells the prompts in flight may still need for their replies."""
        return sum(max(0, s.job.reserve - len(s.job.tokens)) + len(s.job.pending)
                   for s in self.slots if s.job is not None)

    @property
    def busy(self) -> int:
        return sum(1 for s in self.slots if s.job is not None)

    def has_free_slot(self) -> bool:
        return any(s.job is None for s in self.slots)

    # --- starting a prompt -------------------------------------------------------------------
    def render(self, text: str, images: list[LoadedImage], labels: list[str | None]) -> tuple[list[_Item], dict]:
        eng = self.engine
        eng.messages[:] = [Message("user", text, list(images), labels=list(labels))]
        try:
            return eng._render()
        finally:
            eng.messages.clear()

    def submit(self, tag: Any, text: str, images: list[LoadedImage], labels: list[str | None] | None = None,
               *, max_tokens: int = 512, temperature: float = 0.0, top_k: int = 40, top_p: float = 0.95,
               min_p: float = 0.05, seed: int | None = None, stop: list[str] | tuple = ()) -> Completion | str | None:
        """Evaluate a prompt's images (and any text between them) in a free slot now; its last
        text goes into the next ``step``. Returns None when it started, ``WAIT`` when it fits
        only once prompts in flight finish (step, then submit it again), or a Completion with
        the error that stopped it."""
        t_start = time.perf_counter()
        labels = list(labels) if labels is not None else [None] * len(images)
        job = _Job(tag, SamplingParams(temperature, top_k, top_p, min_p, seed), max_tokens,
                   list(stop) + self.engine.default_stops, reserve=self.engine.reply_reserve(max_tokens),
                   t_start=t_start)
        slot = None
        try:
            items, units = self.render(text, images, labels)
            need = sum(it.n_tokens for it in items)
            if need + job.reserve > self.be.n_ctx:
                raise InputError(f"the prompt needs {need:,} tokens but the context holds "
                                 f"{self.be.n_ctx:,} (use a larger --ctx or a smaller --image-tokens)")
            slot = self._pick(items, job.reserve)
            if slot is None:
                return WAIT
            self._prefill(slot, job, items, units, {img.sha256 for img in images})
        except Exception as exc:
            if slot is not None:
                self._drop(slot)
            return Completion(tag, error=exc)
        job.sampler = self.be.make_sampler(job.params)
        job.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        slot.job = job
        return None

    def _lcp(self, kv: list[_Held], items: list[_Item]) -> int:
        k = 0
        n = min(len(kv), len(items))
        while k < n and kv[k].item.key == items[k].key:
            k += 1
        return k

    def _pick(self, items: list[_Item], reserve: int) -> _Slot | None:
        """A free slot, set up to hold the longest prefix of ``items`` any slot holds (None:
        not enough KV cells until prompts in flight finish)."""
        free = [s for s in self.slots if s.job is None]
        if not free:
            raise BackendError("no free slot (internal error: submit after has_free_slot)")
        best_src, best_k = None, -1
        for s in self.slots:
            k = self._lcp(s.kv, items)
            if k > best_k or (k == best_k and s.job is None):
                best_src, best_k = s, k
        best_k = min(best_k, len(items) - 1)  # the last prompt token is always evaluated (logits)
        own = max(free, key=lambda s: self._lcp(s.kv, items))
        if self._lcp(own.kv, items) >= best_k:
            best_src = own
        # Idle slots give back the cells the new prompt does not share (old replies).
        for s in free:
            if s is not own:
                self._truncate(s, min(len(s.kv), self._lcp(s.kv, items)))
        if best_src is own:
            self._truncate(own, best_k)
        else:
            self._truncate(own, 0)
            keep = best_src.kv[:best_k]
            p1 = sum(h.item.n_pos for h in keep)
            if p1 > 0:
                self.be.seq_copy(best_src.seq, own.seq, 0, p1)
            own.kv = list(keep)
        need = sum(it.n_tokens for it in items[len(own.kv):]) + reserve
        if self.cells_used() + self._reserved() + need > self.be.n_ctx:
            if self.busy:
                return None
            raise InputError(f"the prompt and its reply need {need:,} more tokens but the context "
                             f"holds {self.be.n_ctx:,} (use a larger --ctx, a smaller --image-tokens "
                             f"or fewer --max-tokens)")
        return own

    def _truncate(self, slot: _Slot, k: int) -> None:
        if k < len(slot.kv):
            p0 = sum(h.item.n_pos for h in slot.kv[:k])
            self.be.kv_remove(p0, -1, slot.seq)
            del slot.kv[k:]

    def _drop(self, slot: _Slot) -> None:
        self._truncate(slot, 0)
        if slot.job is not None and slot.job.sampler is not None:
            self.be.free_sampler(slot.job.sampler)
        slot.job = None

    def _prefill(self, slot: _Slot, job: _Job, items: list[_Item], units: dict, new_images: set[str]) -> None:
        be = self.be
        k = len(slot.kv)
        todo = items[k:]
        tail = len(todo)
        while tail > 0 and todo[tail - 1].key[0] == "t":
            tail -= 1
        if tail == len(todo):
            raise BackendError("the prompt does not end with text (nothing to generate from)")
        c = job.c
        c.update(cached_n=sum(it.n_tokens for it in items[:k]), prompt_n=0, encode_ms=0.0, encoded=0,
                 reused=0, image_tokens=sum(it.n_tokens for it in todo if it.key[0] == "i" and it.key[1] in new_images))
        pos = slot.pos
        t0 = time.perf_counter()
        try:
            i = 0
            while i < tail:  # images, and text between them, now
                it = todo[i]
                if it.key[0] == "t":
                    j = i
                    while j < tail and todo[j].key[0] == "t":
                        j += 1
                    pos = be.decode_tokens([t.key[1] for t in todo[i:j]], pos, logits_last=False, seq_id=slot.seq)
                    slot.kv += [_Held(t, next(self.uids)) for t in todo[i:j]]
                    c["prompt_n"] += j - i
                    i = j
                    continue
                unit = units[it.key[1]]
                emb = unit.embedding(it.key[2], be, c)
                pos = be.decode_image(unit.chunks[it.key[2]], emb, pos, slot.seq)
                slot.kv.append(_Held(it, next(self.uids)))
                c["prompt_n"] += it.n_tokens
                i += 1
        finally:
            self.engine.images.trim(keep=set(units))
            dt = (time.perf_counter() - t0) * 1000
            job.prompt_ms += dt
            self.llama_ms += dt
        job.pending = list(todo[tail:])
        job.pending_prompt = len(job.pending)

    # --- one batched step -----------------------------------------------------------------------
    def step(self) -> list[Completion]:
        """Evaluate the next tokens of every prompt in flight in one batch (the text after
        each new picture, every reply's next token), sample, and return the prompts that
        finished."""
        be = self.be
        active = [s for s in self.slots if s.job is not None and s.job.pending]
        if not active:
            return []
        entries: list[tuple[int, int, int, bool]] = []
        outs: dict[int, int] = {}  # slot seq → batch index of its output
        shares: dict[int, int] = {}
        room = be.n_batch
        for s in active:
            job = s.job
            take = job.pending[:room]
            if not take:
                break
            pos = s.pos
            for j, it in enumerate(take):
                last = j == len(job.pending) - 1
                entries.append((s.seq, it.key[1], pos + j, last))
                if last:
                    outs[s.seq] = len(entries) - 1
            shares[s.seq] = len(take)
            room -= len(take)
        t0 = time.perf_counter()
        try:
            be.decode_multi(entries)
        except BackendError as exc:
            return self._fail_all(exc)
        dt_decode = (time.perf_counter() - t0) * 1000
        used = self.cells_used()
        done: list[Completion] = []
        n_entries = len(entries)
        for s in active:
            job = s.job
            n = shares.get(s.seq, 0)
            if not n:
                continue
            share = dt_decode * n / n_entries
            n_prompt = min(n, job.pending_prompt)
            job.prompt_ms += share * n_prompt / n
            job.predicted_ms += share * (n - n_prompt)
            s.kv += [_Held(it, next(self.uids)) for it in job.pending[:n]]
            job.c["prompt_n"] += n_prompt
            job.pending = job.pending[n:]
            job.pending_prompt -= n_prompt
            if job.pending:  # part of a long prompt text: the rest goes in the next step
                continue
            finish = self._sample(s, outs[s.seq], used)
            if finish is not None:
                done.append(self._complete(s, finish))
        self.llama_ms += (time.perf_counter() - t0) * 1000
        return done

    def _sample(self, s: _Slot, index: int, used: int) -> str | None:
        """Sample slot ``s``'s next token from batch output ``index``; a finish reason or None."""
        job = s.job
        ts = time.perf_counter()
        if self.keep_logits and job.first_logits is None:
            lc = self.be.llama_cpp
            ptr = lc.llama_get_logits_ith(self.be.llama.ctx, index)
            job.first_logits = np.ctypeslib.as_array(ptr, shape=(self.be.n_vocab,)).copy()
        tok = self.be.sample(job.sampler, index)
        now = time.perf_counter()
        job.predicted_ms += (now - ts) * 1000
        job.times.append(now)
        finish = self._accept(job, tok)
        if finish is None and len(job.tokens) >= job.max_tokens:
            finish = "length"
        if finish is None and used + 1 > self.be.n_ctx:  # past its reserve, the context is full
            finish = "context"
        if finish is None:
            job.pending = [_Item(("t", job.tokens[-1]), 1, 1)]
        return finish

    def _accept(self, job: _Job, tok: int) -> str | None:
        """Take a sampled token; returns a finish reason when the reply is over."""
        be = self.be
        if be.is_eog(tok):
            return "stop"
        before = len(job.text)
        job.tokens.append(tok)
        job.text += job.decoder.decode(be.token_bytes(tok))
        job.ends.append(len(job.text))
        cut = _find_stop(job.text, job.stops, before)
        if cut is not None:
            job.text = job.text[:cut]
            keep = sum(1 for e in job.ends if e <= cut)
            del job.tokens[keep:]
            return "stop"
        return None

    def _complete(self, slot: _Slot, finish: str) -> Completion:
        job = slot.job
        assert job is not None
        self.be.free_sampler(job.sampler)
        slot.job = None
        return Completion(job.tag, job.text, list(job.tokens), finish, self._stats(job, finish),
                          first_logits=job.first_logits)

    def _stats(self, job: _Job, finish: str) -> TurnStats:
        c = job.c
        n = len(job.tokens)
        times = job.times
        ttft = (times[0] - job.t_start) * 1000 if times else 0.0
        itl = float(np.mean(np.diff(times)) * 1000) if len(times) > 1 else 0.0
        return TurnStats(
            prompt_n=c["prompt_n"], prompt_ms=round(job.prompt_ms, 2),
            prompt_per_second=per_second(c["prompt_n"], job.prompt_ms),
            predicted_n=n, predicted_ms=round(job.predicted_ms, 2),
            predicted_per_second=per_second(n, job.predicted_ms), ttft_ms=round(ttft, 2),
            itl_ms_mean=round(itl, 2), image_tokens=c["image_tokens"],
            image_encode_ms=round(c["encode_ms"], 2), images_encoded=c["encoded"],
            images_reused=c["reused"], cached_n=c["cached_n"], n_ctx_used=self.cells_used(),
            n_ctx=self.be.n_ctx, peak_rss_bytes=peak_rss_bytes(), device_memory_used_bytes=None,
            finish_reason=finish, image_tokens_in=c["image_tokens"], image_tokens_out=c["image_tokens"],
        )

    def _fail_all(self, exc: Exception) -> list[Completion]:
        """A batch failed: every prompt in flight fails with it, the KV cache starts over."""
        out = []
        for s in self.slots:
            if s.job is not None:
                out.append(Completion(s.job.tag, error=exc))
                self.be.free_sampler(s.job.sampler)
                s.job = None
            s.kv.clear()
        self.be.kv_clear()
        return out

    def abandon(self) -> None:
        """Drop every prompt in flight (Ctrl-C): their cells go, their samplers are freed."""
        for s in self.slots:
            if s.job is not None:
                self._drop(s)

    def close(self) -> None:
        self.abandon()
        for s in self.slots:
            s.kv.clear()
        self.be.kv_clear()
        self.engine.reset()
