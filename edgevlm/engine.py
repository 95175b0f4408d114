"""Multi-turn multimodal chat over one Backend: KV reuse, image embedding cache, streaming.

Every turn renders the whole conversation with the model's template, turns it into a sequence
of *items* (text tokens and image chunks, each with its KV cells and positions) and compares it
with what the KV cache already holds. Only the items after the first difference are evaluated
(``llama_memory_seq_rm`` drops the rest), so a follow-up turn costs just the tokens it adds.
Image chunks are encoded once: their embeddings are cached by content hash (bounded LRU), so a
picture seen before — in this conversation, after ``reset()``, or in a new one — is not re-encoded.
"""

from __future__ import annotations

import codecs
import time
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .backend import Backend, Chunks, SamplingParams
from .chat_format import LLAVA15_TEMPLATE, PromptFormatter
from .errors import InputError
from .budget import ImagePlan, plan_image, render_views
from .images import LoadedImage, load_image
from .merge import NO_GRID, MergeResult, MergeSpec, grid_shape, merge_tokens
from .session import Picture, RoomReport, SessionPolicy, make_room
from .stats import TurnStats, peak_rss_bytes, per_second

@dataclass
class Message:
    role: str  # "system" | "user" | "assistant"
    text: str
    images: list[LoadedImage] = field(default_factory=list)  # the views sent, in order
    tokens: list[int] | None = None  # assistant: the exact ids generated
    labels: list[str | None] = field(default_factory=list)  # per view ("global view", ...)
    sources: list[str] = field(default_factory=list)  # the pictures the user gave
    pictures: list[int] = field(default_factory=list)  # per view: the picture's number (1-based)
    notes: list[str] = field(default_factory=list)  # text standing in for evicted pictures

    @property
    def content_text(self) -> str:
        return "\n".join(self.notes + [self.text]) if self.notes else self.text


@dataclass(frozen=True)
class GenerationResponse:
    """One step of ``Engine.stream``: new text, and on the last step the reason and stats."""

    text: str
    token: int | None = None
    finish_reason: str | None = None
    stats: TurnStats | None = None


@dataclass
class ChatResult:
    text: str
    stats: TurnStats
    finish_reason: str


@dataclass(frozen=True)
class _Item:
    key: tuple  # ("t", token_id) or ("i", image_sha, chunk_index)
    n_tokens: int
    n_pos: int


class _ImageUnit:
    """The mtmd chunks of one picture (as ``<marker>`` tokenizes) and their embeddings."""

    def __init__(self, key: str, chunks: Chunks):
        self.key = key
        self.chunks = chunks
        self.embeddings: dict[int, np.ndarray] = {}
        self.merged: dict[tuple[int, str], MergeResult] = {}  # (chunk, merge spec) → result

    def embedding(self, ci: int, backend: Backend, c: dict[str, Any]) -> np.ndarray:
        """Chunk ``ci``'s embeddings: cached, or encoded now (counted in ``c``: encode_ms,
        encoded, reused)."""
        emb = self.embeddings.get(ci)
        if emb is None:
            t0 = time.perf_counter()
            emb = backend.encode_image(self.chunks[ci])
            c["encode_ms"] += (time.perf_counter() - t0) * 1000
            c["encoded"] += 1
            self.embeddings[ci] = emb
        else:
            c["reused"] += 1
        return emb

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.embeddings.values()) + \
            sum(r.embd.nbytes for r in self.merged.values())


class ImageCache:
    """LRU of image units, bounded by count and by embedding bytes."""

    def __init__(self, backend: Backend, max_units: int = 32, max_bytes: int = 512 * 2**20):
        self.backend = backend
        self.max_units = max_units
        self.max_bytes = max_bytes
        self._units: OrderedDict[str, _ImageUnit] = OrderedDict()

    def get(self, image: LoadedImage) -> _ImageUnit:
        unit = self._units.get(image.sha256)
        if unit is not None:
            self._units.move_to_end(image.sha256)
            return unit
        bm = self.backend.bitmap_from_rgb(image.rgb, image.sha256[:16])
        try:
            chunks = self.backend.tokenize(self.backend.marker, [bm], add_special=False)
        finally:
            self.backend.free_bitmap(bm)
        unit = _ImageUnit(image.sha256, chunks)
        self._units[image.sha256] = unit
        return unit

    def trim(self, keep: set[str]) -> None:
        """Evict least-recently-used units beyond the bounds, never those in ``keep``."""
        while len(self._units) > self.max_units or self.nbytes > self.max_bytes:
            victim = next((k for k in self._units if k not in keep), None)
            if victim is None:
                return
            self._units.pop(victim).chunks.close()

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes for u in self._units.values())

    def close(self) -> None:
        for unit in self._units.values():
            unit.chunks.close()
        self._units.clear()


class Engine:
    """A chat with images over one loaded model pair."""

    def __init__(self, backend: Backend, system: str | None = None, max_image_pixels: int | None = None,
                 image_cache_units: int = 32, image_cache_bytes: int = 512 * 2**20,
                 plan: Any = None, guard: Any = None):
        self.backend = backend
        self.plan = plan  # the Plan it was loaded with (None when built by hand)
        self.guard = guard  # runtime admission check for images (None: no check)
        self.notices: list[str] = []  # things the user should be told (e.g. an image shrunk)
        self.image_tokens: int | None = None  # per-picture budget (None: the plan's)
        self.session = SessionPolicy()  # what happens when the context runs out
        self.pictures: list[Picture] = []  # every picture given, numbered from 1
        self.tiles: str | int = "auto"  # AnyRes tiles for fixed-size encoders: auto | off | N
        self.merge = MergeSpec()  # visual token merging after the projector (off by default)
        self.system = system
        self.max_image_pixels = max_image_pixels
        self.images = ImageCache(backend, image_cache_units, image_cache_bytes)
        lc = backend.llama_cpp
        vocab = lc.llama_model_get_vocab(backend.llama.model)
        self.add_bos = bool(lc.llama_vocab_get_add_bos(vocab))
        self.bos_id = lc.llama_vocab_bos(vocab)
        bos_text = backend.token_bytes(self.bos_id).decode("utf-8", "ignore") if self.bos_id >= 0 else ""
        eos_id = lc.llama_vocab_eos(vocab)
        eos_text = backend.llama.detokenize([eos_id], special=True).decode("utf-8", "ignore") if eos_id >= 0 else ""
        info = backend.text_info
        self.formatter = PromptFormatter(
            info.chat_template, info.arch, backend.proj_info.projector_type, backend.marker,
            bos_token=bos_text, eos_token=eos_text, strip_bos=self.add_bos,
        )
        self.default_stops = ["\nUSER:"] if self.formatter.template == LLAVA15_TEMPLATE else []
        self.messages: list[Message] = []
        self._kv: list[_Item] = []  # what the KV cache holds, in order
        self.last_stats: TurnStats | None = None

    # --- conversation -----------------------------------------------------------------
    def complete(self, text: str, max_tokens: int, stops: Iterable[str] = ()) -> str:
        """Ask one greedy question after the current conversation and forget it afterwards
        (the next turn drops its tokens from the KV cache by prefix matching)."""
        self.messages.append(Message("user", text))
        try:
            items, units = self._render()
            c = self._evaluate(items, units, set())
            now = time.perf_counter()
            out = "".join(r.text for r in self._generate(
                SamplingParams(0.0), max_tokens, list(stops) + self.default_stops, c, now, now,
                record=False))
        finally:
            self.messages.pop()
        return out

    def reset(self, keep_cache: bool = False) -> None:
        """Forget the conversation (image embeddings stay cached).

        With ``keep_cache`` the KV cache is left as it is: the next conversation reuses every
        token it shares with the old one from the start (a system prompt, an instruction), and
        only the rest is dropped and evaluated.
        """
        self.messages.clear()
        self.pictures.clear()
        if not keep_cache:
            self._kv.clear()
            self.backend.kv_clear()

    def close(self) -> None:
        self.images.close()
        self.backend.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    @property
    def n_ctx(self) -> int:
        return self.backend.n_ctx

    @property
    def n_ctx_used(self) -> int:
        return sum(it.n_tokens for it in self._kv)

    def load_images(self, images: Iterable[Any]) -> list[LoadedImage]:
        out = []
        for img in images:
            if isinstance(img, LoadedImage):
                out.append(img)
            elif self.max_image_pixels:
                out.append(load_image(img, self.max_image_pixels))
            else:
                out.append(load_image(img))
        return out

    def chat(self, text: str, images: Iterable[Any] = (), **gen: Any) -> ChatResult:
        """One turn: returns the whole reply with its stats."""
        parts = []
        last = None
        for resp in self.stream(text, images, **gen):
            parts.append(resp.text)
            last = resp
        assert last is not None and last.stats is not None
        return ChatResult("".join(parts), last.stats, last.finish_reason or "stop")

    # --- one turn ----------------------------------------------------------------------
    def _render(self) -> tuple[list[_Item], dict[str, _ImageUnit]]:
        msgs: list[tuple[str, str, list[str | None]]] = []
        if self.system:
            msgs.append(("system", self.system, []))
        imgs: list[LoadedImage] = []
        assistant: list[list[int]] = []
        for m in self.messages:
            msgs.append((m.role, m.content_text, m.labels or [None] * len(m.images)))
            imgs.extend(m.images)
            if m.role == "assistant":
                assistant.append(m.tokens or [])
        items: list[_Item] = [_Item(("t", self.bos_id), 1, 1)] if self.add_bos else []
        units: dict[str, _ImageUnit] = {}
        for piece in self.formatter.render(msgs):
            if piece.kind == "text":
                items += [_Item(("t", t), 1, 1) for t in self.backend.tokenize_text(piece.text)]
            elif piece.kind == "assistant":
                items += [_Item(("t", t), 1, 1) for t in assistant[piece.index]]
            else:
                unit = self.images.get(imgs[piece.index])
                units[unit.key] = unit
                for ci, c in enumerate(unit.chunks):
                    if c.kind == "text":
                        items += [_Item(("t", t), 1, 1) for t in c.tokens or []]
                    else:
                        items.append(self._image_item(unit, ci, c))
        return items, units

    def _merging(self) -> bool:
        return self.merge.enabled and self.backend.proj_info.projector_type not in NO_GRID

    def _image_item(self, unit: _ImageUnit, ci: int, c) -> _Item:
        if not self._merging():
            return _Item(("i", unit.key, ci), c.n_tokens, c.n_pos)
        spec = str(self.merge)
        done = unit.merged.get((ci, spec))
        n_out = done.n_out if done is not None else (self.merge.target(c.n_tokens) or c.n_tokens)
        return _Item(("i", unit.key, ci, spec), n_out, c.n_pos if self.backend.use_mrope else n_out)

    def _decode_merged(self, unit: _ImageUnit, ci: int, chunk, emb: np.ndarray, pos: int,
                       c: dict[str, Any]) -> tuple[int, int]:
        """Merge an image chunk's embeddings and feed them; returns (new pos, tokens fed)."""
        spec = str(self.merge)
        res = unit.merged.get((ci, spec))
        if res is None:
            w, h = grid_shape(chunk.n_tokens, chunk.nx, chunk.ny)
            res = merge_tokens(emb, w, h, self.merge)
            unit.merged[(ci, spec)] = res
        be = self.backend
        if be.use_mrope:
            positions = be.image_positions(chunk, pos, res.representative)
            new_pos = pos + chunk.n_pos  # M-RoPE: advance as mtmd would
        else:
            positions = pos + np.arange(res.n_out)
            new_pos = pos + res.n_out
        be.decode_embeddings(res.embd, positions, be.non_causal)
        c["image_tokens_in"] += res.n_in
        c["image_tokens_out"] += res.n_out
        c["merge_map_size"] += res.n_in
        return new_pos, res.n_out

    def _evaluate(self, items: list[_Item], units: dict[str, _ImageUnit],
                  new_images: set[str]) -> dict[str, Any]:
        """Bring the KV cache to ``items``; returns counters for the stats."""
        be = self.backend
        k = 0
        while k < min(len(items), len(self._kv)) and items[k].key == self._kv[k].key:
            k += 1
        if k == len(items):  # nothing new: re-evaluate the last token to get logits
            k -= 1
        need = sum(it.n_tokens for it in items)
        if need + 1 > be.n_ctx:
            raise InputError(
                f"the prompt needs {need:,} tokens but the context holds {be.n_ctx:,} "
                f"(use a larger --ctx, fewer or smaller images, or /reset)"
            )
        pos = sum(it.n_pos for it in self._kv[:k])
        if k < len(self._kv):
            be.kv_remove(pos)
            del self._kv[k:]
        c = {"cached_n": sum(it.n_tokens for it in items[:k]), "prompt_n": 0, "image_tokens": 0,
             "encode_ms": 0.0, "encoded": 0, "reused": 0}
        todo = items[k:]
        c["image_tokens"] = sum(it.n_tokens for it in todo if it.key[0] == "i" and it.key[1] in new_images)
        c.update(image_tokens_in=0, image_tokens_out=0, merge_map_size=0)
        i = 0
        try:
            while i < len(todo):
                it = todo[i]
                if it.key[0] == "t":
                    j = i
                    while j < len(todo) and todo[j].key[0] == "t":
                        j += 1
                    toks = [t.key[1] for t in todo[i:j]]
                    pos = be.decode_tokens(toks, pos, logits_last=(j == len(todo)))
                    self._kv.extend(todo[i:j])
                    c["prompt_n"] += len(toks)
                    i = j
                    continue
                unit = units[it.key[1]]
                chunk = unit.chunks[it.key[2]]
                emb = unit.embedding(it.key[2], be, c)
                if len(it.key) > 3:  # merged image tokens
                    pos, fed = self._decode_merged(unit, it.key[2], chunk, emb, pos, c)
                    it = _Item(it.key, fed, it.n_pos if be.use_mrope else fed)
                    if it.key[1] in new_images:
                        c["image_tokens"] += fed - todo[i].n_tokens
                else:
                    pos = be.decode_image(chunk, emb, pos)
                    c["image_tokens_in"] += it.n_tokens
                    c["image_tokens_out"] += it.n_tokens
                self._kv.append(it)
                c["prompt_n"] += it.n_tokens
                i += 1
        except BaseException:
            # The KV cache now holds part of this prompt: drop it so the next turn rebuilds.
            self.backend.kv_clear()
            self._kv.clear()
            raise
        finally:
            self.images.trim(keep=set(units))
        return c

    def stream(self, text: str, images: Iterable[Any] = (), *, max_tokens: int = 512,
               temperature: float = 0.0, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
               seed: int | None = None, stop: Iterable[str] = ()) -> Iterator[GenerationResponse]:
        """Add a user turn and stream the reply. The last response carries stats."""
        t_start = time.perf_counter()  # TTFT counts image decoding, budgeting and the guard too
        originals = self.load_images(images)
        views, labels, pics = self._budget(originals)
        reserve = self.reply_reserve(max_tokens)
        loaded = self._admit(views, reserve)
        msg = Message("user", text, loaded, labels=labels, sources=[im.source for im in originals],
                      pictures=pics)
        self.messages.append(msg)
        try:
            room = make_room(self, reserve) if self.session.enabled else RoomReport()
            items, units = room.rendered or self._render()
            counters = self._evaluate(items, units, {img.sha256 for img in loaded})
        except BaseException:
            self.messages.remove(msg)
            del self.pictures[len(self.pictures) - len(originals):]
            raise
        counters.update(room.counters(self, counters))
        t_prompt = time.perf_counter()
        yield from self._generate(
            SamplingParams(temperature, top_k, top_p, min_p, seed), max_tokens,
            list(stop) + self.default_stops, counters, t_start, t_prompt,
        )

    def reply_reserve(self, max_tokens: int) -> int:
        """KV cells kept free for a reply: ``max_tokens``, at most a quarter of the context (a
        longer reply stops with finish_reason "context" when the cells run out)."""
        return max(1, min(max_tokens, self.backend.n_ctx // 4))

    def plan_image(self, image: LoadedImage) -> ImagePlan:
        """The views of one picture under this engine's image budget (decided before encoding)."""
        cap = self.plan.image_max_tokens if self.plan is not None else None
        budget = self.image_tokens if self.image_tokens is not None else cap
        dyn_cap = self.backend.image_max_tokens
        return plan_image(image, self.backend.proj_info, budget, self.tiles, max_tokens=dyn_cap)

    def _budget(self, images: list[LoadedImage]) -> tuple[list[LoadedImage], list[str | None], list[int]]:
        views: list[LoadedImage] = []
        labels: list[str | None] = []
        pics: list[int] = []
        for img in images:
            ip = self.plan_image(img)
            self.notices.extend(f"{img.source}: {n}" for n in ip.notes)
            self.pictures.append(Picture(len(self.pictures) + 1, img, ip.total_tokens))
            for label, pix in render_views(img, ip):
                views.append(pix)
                labels.append(label)
                pics.append(len(self.pictures))
        return views, labels, pics

    def _admit(self, images: list[LoadedImage], reserve: int = 0) -> list[LoadedImage]:
        """Run each new image past the guard (memory now, context left); may shrink it."""
        if self.guard is None or not images:
            return images
        # With eviction on, older pictures can make room: a new one only has to fit the budget.
        used = 0 if self.session.enabled else self.n_ctx_used
        free = self.backend.n_ctx - used - 64 - (reserve if self.session.enabled else 0)
        out = []
        for img in images:
            adm = self.guard.admit(img, free)
            free -= adm.tokens
            if adm.notice:
                self.notices.append(adm.notice)
            out.append(adm.image)
        return out

    def _generate(self, params: SamplingParams, max_tokens: int, stops: list[str],
                  counters: dict[str, Any], t_start: float, t_prompt: float,
                  record: bool = True) -> Iterator[GenerationResponse]:
        be = self.backend
        sampler = be.make_sampler(params)
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        tokens: list[int] = []
        ends: list[int] = []  # text length after each token
        text = ""
        emitted = 0
        finish = "interrupted"
        times: list[float] = []
        pos = sum(it.n_pos for it in self._kv)
        try:
            while True:
                if len(tokens) >= max_tokens:
                    finish = "length"
                    break
                if self.n_ctx_used >= be.n_ctx:
                    finish = "context"
                    break
                if tokens:  # the previous token goes into the KV cache before sampling the next
                    pos = be.decode_tokens([tokens[-1]], pos)
                    self._kv.append(_Item(("t", tokens[-1]), 1, 1))
                tok = be.sample(sampler)
                times.append(time.perf_counter())
                if be.is_eog(tok):
                    finish = "stop"
                    break
                tokens.append(tok)
                text += decoder.decode(be.token_bytes(tok))
                ends.append(len(text))
                cut = _find_stop(text, stops, emitted)
                if cut is not None:
                    if cut > emitted:
                        yield GenerationResponse(text[emitted:cut], tok)
                    text = text[:cut]
                    emitted = cut
                    keep = sum(1 for e in ends if e <= cut)
                    del tokens[keep:]
                    finish = "stop"
                    break
                safe = len(text) - _stop_overlap(text, stops)
                if safe > emitted:
                    yield GenerationResponse(text[emitted:safe], tok)
                    emitted = safe
        finally:
            be.free_sampler(sampler)
            # Whatever was generated (also when interrupted) becomes the assistant message.
            tail = text[emitted:]
            if record:
                self.messages.append(Message("assistant", text, tokens=list(tokens)))
                self.last_stats = self._stats(counters, tokens, times, t_start, t_prompt, finish)
        yield GenerationResponse(tail, None, finish, self.last_stats if record else None)

    def _stats(self, c: dict[str, Any], tokens: list[int], times: list[float], t_start: float,
               t_prompt: float, finish: str) -> TurnStats:
        prompt_ms = (t_prompt - t_start) * 1000
        n = len(tokens)
        ttft = (times[0] - t_start) * 1000 if times else prompt_ms
        pred_ms = (times[-1] - t_prompt) * 1000 if times else 0.0
        itl = float(np.mean(np.diff(times)) * 1000) if len(times) > 1 else 0.0
        return TurnStats(
            prompt_n=c["prompt_n"], prompt_ms=round(prompt_ms, 2),
            prompt_per_second=per_second(c["prompt_n"], prompt_ms),
            predicted_n=n, predicted_ms=round(pred_ms, 2), predicted_per_second=per_second(n, pred_ms),
            ttft_ms=round(ttft, 2), itl_ms_mean=round(itl, 2), image_tokens=c["image_tokens"],
            image_encode_ms=round(c["encode_ms"], 2), images_encoded=c["encoded"],
            images_reused=c["reused"], cached_n=c["cached_n"], n_ctx_used=self.n_ctx_used,
            n_ctx=self.backend.n_ctx, peak_rss_bytes=peak_rss_bytes(),
            device_memory_used_bytes=None, finish_reason=finish,
            summarized_images=c.get("summarized_images", 0), evicted_tokens=c.get("evicted_tokens", 0),
            rebuild_tokens=c.get("rebuild_tokens", 0), dropped_turns=c.get("dropped_turns", 0),
            image_tokens_in=c.get("image_tokens_in", 0), image_tokens_out=c.get("image_tokens_out", 0),
            merge_map_size=c.get("merge_map_size", 0),
        )


def _find_stop(text: str, stops: list[str], emitted: int) -> int | None:
    best = None
    for s in stops:
        if not s:
            continue
        i = text.find(s, max(0, emitted - len(s)))
        if i >= 0 and (best is None or i < best):
            best = i
    return best


def _stop_overlap(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that could still grow into a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if s.startswith(text[-n:]):
                best = n
                break
    return best
