"""Batch captioning: one loaded model, many images, resumable, nothing lost.

    vlm = edgevlm.load("model.gguf", "mmproj.gguf")
    for rec in caption_images(vlm, ["photos/"], CaptionSettings(max_tokens=64), recursive=True):
        print(rec.path, rec.caption or rec.error)

``CaptionJob`` adds files: it finds what an earlier run already did (resume), writes each record
atomically, and keeps sidecars / ``metadata.jsonl`` in step (see ``caption_outputs``).

Speed: the model is loaded once. When its context holds several sequences (``edgevlm.load(...,
n_seq_max=4)``; ``caption_slots`` says how many fit), several images are in flight and their
captions are generated in one batch per token (``parallel.ParallelRunner``), sharing the system
prompt's KV cells; with one sequence each image starts a new conversation with
``Engine.reset(keep_cache=True)``, so the system prompt and the turn header already in the KV
cache are not evaluated again (``stats.cached_n`` says how many tokens were reused). Reading,
hashing, decoding and resizing the next images happen in a background thread while llama.cpp
works.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

from .caption_inputs import InputItem, discover
from .caption_outputs import CaptionRecord
from .caption_prepare import (  # noqa: F401  (re-exported)
    Prefetcher,
    Prepared,
    Preparer,
    ResumeIndex,
    StopToken,
    _strip_label,
)
from .caption_sidecars import Plain
from .caption_text import (  # noqa: F401  (re-exported)
    DEFAULT_PROMPT,
    PLACEHOLDERS,
    check_template,
    clean_caption,
    compose,
    render_prompt,
)
from .errors import BackendError, EdgeVLMError, ImageError, InputError
from .images import DEFAULT_MAX_PIXELS

FAILS_IN_A_ROW = 3  # runtime failures in a row that stop the run (llama.cpp is broken, not the image)


@dataclass(frozen=True)
class CaptionSettings:
    """Everything that shapes a caption. Its digest is part of every record's resume key."""

    prompt: str = DEFAULT_PROMPT  # may use {name} {filename} {path} {existing}
    system: str | None = None
    prefix: str = ""  # added before the caption (trigger words)
    suffix: str = ""
    clean: bool = False  # strip preambles ("The image shows ..."), quotes, line breaks
    max_tokens: int = 128
    temperature: float = 0.0  # greedy
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    seed: int | None = None
    stop: tuple[str, ...] = ()
    image_tokens: int | None = None  # per-image budget (None: the plan's)
    tiles: str | int = "auto"
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_file_bytes: int = 1 << 30

    def validate(self) -> None:
        check_template(self.prompt)

    def digest(self, model_id: str, output: str = "log") -> str:
        """``output``: where captions go (a txt run after a jsonl run must write its sidecars)."""
        d = asdict(self)
        d.pop("max_file_bytes")
        if self.temperature <= 0:  # greedy: sampling knobs do not change the caption
            for k in ("top_k", "top_p", "min_p", "seed"):
                d.pop(k)
        d["model"] = model_id
        if output != "log":
            d["output"] = output
        return hashlib.sha256(repr(sorted(d.items())).encode()).hexdigest()[:12]

    def gen(self) -> dict[str, Any]:
        return dict(max_tokens=self.max_tokens, temperature=self.temperature, top_k=self.top_k,
                    top_p=self.top_p, min_p=self.min_p, seed=self.seed, stop=list(self.stop))


def caption_slots(n_ctx: int, image_tokens: int | None, settings: CaptionSettings,
                  want: int | None = None) -> int:
    """Images in flight for a context of ``n_ctx`` (``want`` None: as many as fit, up to 4):
    each needs its image tokens (``image_tokens``: the plan's budget), the instruction and
    ``max_tokens``; the system prompt is shared."""
    from .parallel import DEFAULT_SLOTS, fit_slots

    per_image = (settings.image_tokens or image_tokens or 1024) + 64 + settings.max_tokens
    prefix = 32 + len(settings.system or "") // 2
    return fit_slots(n_ctx, per_image, want or DEFAULT_SLOTS, prefix)


def model_identity(model: str, mmproj: str) -> tuple[str, str]:
    """(name for records, identity for the resume key): file names and sizes, no hashing."""
    def ident(p: str) -> str:
        try:
            return f"{os.path.basename(p)}:{os.path.getsize(p)}"
        except OSError:
            return os.path.basename(p)
    return os.path.basename(model), f"{ident(model)}+{ident(mmproj)}"


# --- the captioning loop -----------------------------------------------------------------------
@dataclass
class CaptionResult:
    status: str  # "done" | "failed" | "skipped"
    item: InputItem
    record: CaptionRecord | None = None  # done / failed: the new record
    reason: str | None = None  # skipped: "done" (earlier run) or an --existing reason
    previous: dict[str, Any] | None = None  # skipped as done: the earlier record


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class Captioner:
    """Captions prepared inputs one by one on an Engine; yields a CaptionResult per input."""

    def __init__(self, engine: Any, settings: CaptionSettings, model_name: str, digest: str,
                 deliverable: Plain | None = None, index: ResumeIndex | None = None,
                 conflicts: dict[str, str] | None = None, stop: StopToken | None = None,
                 prefetch: int = 2, slots: int | None = None):
        settings.validate()
        self.engine = engine
        self.settings = settings
        self.model_name = model_name
        self.digest = digest
        self.out = deliverable or Plain()
        self.index = index or ResumeIndex()
        self.stop = stop or StopToken()
        self.preparer = Preparer(engine, settings, digest, self.out, self.index, conflicts or {})
        self.prefetch = prefetch
        self.wait_s = 0.0
        self.fails_in_a_row = 0
        self.llama_ms: float | None = None  # parallel runs: time inside llama.cpp, measured
        self.slots = 1
        if engine is not None:  # None: every input is known to be done (nothing to caption)
            engine.system = settings.system
            engine.image_tokens = settings.image_tokens
            engine.tiles = settings.tiles
            engine.max_image_pixels = settings.max_pixels
            cache = getattr(engine, "images", None)
            if cache is not None:  # every picture is new: keep few embeddings around
                cache.max_units = min(cache.max_units, 4)
            session = getattr(engine, "session", None)
            if session is not None:  # one picture per conversation: nothing to summarise away
                session.enabled = False
            # Several images in flight when the context was made with several sequences and
            # image tokens go in as mtmd gives them (merging feeds its own batches: one at a time).
            backend = getattr(engine, "backend", None)
            if backend is not None and not engine._merging():
                self.slots = max(1, min(slots or backend.n_seq_max, backend.n_seq_max))

    def run(self, items: Iterable[InputItem]) -> Iterator[CaptionResult]:
        pf = Prefetcher(items, self.preparer, max(self.prefetch, self.slots), self.stop)
        try:
            if self.slots > 1:
                yield from self._run_parallel(pf)
                return
            for p in pf:
                if self.stop.requested:
                    return
                yield self._one(p)
        finally:
            pf.close()
            self.wait_s = pf.wait_s

    def _record(self, p: Prepared, **kw: Any) -> CaptionRecord:
        fields: dict[str, Any] = dict(
            custom_id=self.preparer.custom_id(p.item.path, p.sha256), path=p.item.path,
            sha256=p.sha256, caption=None, model=self.model_name, prompt=None, settings=self.digest,
            width=p.width, height=p.height, bytes=p.bytes, mtime_ns=p.mtime_ns, notes=p.notes,
            target=self.out.target(p.item), existing=p.existing, created=_now())
        return CaptionRecord(**{**fields, **kw})

    def _one(self, p: Prepared) -> CaptionResult:
        if p.status == "skip":
            return CaptionResult("skipped", p.item, reason=p.reason, previous=p.previous)
        if p.status == "error":
            rec = self._record(p, error=p.error, error_kind=p.error_kind,
                               stats={"image_load_ms": round(p.load_ms, 2)})
            return CaptionResult("failed", p.item, rec)
        t0 = time.perf_counter()
        prompt = render_prompt(self.settings.prompt, p.item, p.existing)
        eng = self.engine
        if eng is None:  # the file changed after the run decided no model was needed
            return self._failed(p, prompt, "runtime", "changed while the run started; run again")
        # Keep the KV prefix (system prompt, turn header) unless the old conversation would
        # crowd the new image out of the context the guard sees.
        eng.reset(keep_cache=eng.n_ctx_used + p.planned_tokens + 64 <= eng.n_ctx)
        eng.notices.clear()
        try:
            parts, stats = [], None
            stream = eng.stream(prompt, [p.image], **self.settings.gen())
            try:
                for r in stream:
                    self.stop.check()
                    parts.append(r.text)
                    stats = r.stats or stats
            finally:
                stream.close()
        except KeyboardInterrupt:
            raise
        except Exception as exc:
            return self._error(p, prompt, exc)
        return self._done(p, prompt, "".join(parts), stats, list(eng.notices), t0)

    def _error(self, p: Prepared, prompt: str, exc: BaseException) -> CaptionResult:
        if isinstance(exc, EdgeVLMError):
            kind = "input" if isinstance(exc, ImageError) else "context" if isinstance(exc, InputError) else "runtime"
            return self._failed(p, prompt, kind, _strip_label(str(exc), p.item.path))
        # a failure in llama.cpp or a bug: record it, go on
        return self._failed(p, prompt, "runtime", f"{type(exc).__name__}: {exc}")

    def _done(self, p: Prepared, prompt: str, text: str, stats: Any, notices: list[str],
              t0: float) -> CaptionResult:
        self.fails_in_a_row = 0
        raw = text.strip()
        text = clean_caption(raw, stats.finish_reason == "length") if self.settings.clean else raw
        caption = self.settings.prefix + text + self.settings.suffix
        st = {**stats.to_dict(), "image_load_ms": round(p.load_ms, 2),
              "total_ms": round((time.perf_counter() - t0) * 1000, 2)}
        rec = self._record(p, caption=caption, prompt=prompt, image_tokens=stats.image_tokens, stats=st,
                           raw_caption=raw if raw != caption else None)
        rec.notes = rec.notes + [n for n in notices if n not in rec.notes]
        if rec.target is not None:
            rec.text = compose(p.existing, caption, self.out.policy, self.out.separator)
        return CaptionResult("done", p.item, rec)

    # --- several images in flight ------------------------------------------------------------
    def _run_parallel(self, pf: Prefetcher) -> Iterator[CaptionResult]:
        """Up to ``slots`` images in flight, their replies generated in one batch per token.
        Results come in the order images finish (within ``slots`` of the input order)."""
        from .parallel import WAIT, ParallelRunner

        eng = self.engine
        runner = ParallelRunner(eng, self.slots)
        source = iter(pf)
        waiting: Prepared | None = None
        try:
            while True:
                while runner.has_free_slot() and not self.stop.requested:
                    p = waiting or next(source, None)
                    waiting = None
                    if p is None:
                        break
                    if p.status != "caption":
                        yield self._one(p)
                        continue
                    t0 = time.perf_counter()
                    prompt = render_prompt(self.settings.prompt, p.item, p.existing)
                    eng.notices.clear()
                    try:
                        views, labels, _ = eng._budget([p.image])
                        views = eng._admit(views, eng.reply_reserve(self.settings.max_tokens))
                        eng.pictures.clear()
                        r = runner.submit((p, prompt, list(eng.notices), t0), prompt, views, labels,
                                          **self.settings.gen())
                    except Exception as exc:
                        eng.pictures.clear()
                        yield self._error(p, prompt, exc)
                        continue
                    if r == WAIT:
                        waiting = p
                        break
                    if r is not None:
                        yield self._error(p, prompt, r.error)
                if not runner.busy:
                    if waiting is None or self.stop.requested:
                        return
                    continue  # it did not fit beside the others: now it runs alone
                for c in runner.step():  # finished captions are written even when abandoning
                    p, prompt, notices, t0 = c.tag
                    if c.error is not None:
                        yield self._error(p, prompt, c.error)
                    else:
                        yield self._done(p, prompt, c.text, c.stats, notices, t0)
                self.stop.check()
        finally:
            self.llama_ms = runner.llama_ms
            runner.close()

    def _failed(self, p: Prepared, prompt: str, kind: str, msg: str) -> CaptionResult:
        if kind == "runtime":
            self.fails_in_a_row += 1
            if self.fails_in_a_row >= FAILS_IN_A_ROW:
                raise BackendError(f"llama.cpp failed on {self.fails_in_a_row} images in a row, "
                                   f"stopping (last: {p.item.path}: {msg})")
        rec = self._record(p, prompt=prompt, error=msg, error_kind=kind,
                           stats={"image_load_ms": round(p.load_ms, 2)})
        return CaptionResult("failed", p.item, rec)


def caption_images(engine: Any, inputs: Iterable[str | InputItem],
                   settings: CaptionSettings | None = None, *, recursive: bool = False,
                   prefetch: int = 2, **fields: Any) -> Iterator[CaptionRecord]:
    """Caption images (paths, directories, globs) without writing files: one record each.

    ``fields`` override ``settings`` (``caption_images(vlm, paths, max_tokens=32)``)."""
    settings = replace(settings or CaptionSettings(), **fields)
    inputs = list(inputs)
    items = [i for i in inputs if isinstance(i, InputItem)]
    names = [os.fspath(i) for i in inputs if not isinstance(i, InputItem)]
    if names:
        items += discover(names, recursive=recursive).items
    be = engine.backend
    name, ident = model_identity(be.model_path, be.mmproj_path)
    cap = Captioner(engine, settings, name, settings.digest(ident), prefetch=prefetch)
    for res in cap.run(items):
        if res.record is not None:
            yield res.record
