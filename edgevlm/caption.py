"""Batch captioning: one loaded model, many images, resumable, nothing lost.

    vlm = edgevlm.load("model.gguf", "mmproj.gguf")
    for rec in caption_images(vlm, ["photos/"], CaptionSettings(max_tokens=64), recursive=True):
        print(rec.path, rec.caption or rec.error)

``CaptionJob`` adds files: it finds what an earlier run already did (resume), writes each record
atomically, and keeps sidecars / ``metadata.jsonl`` in step (see ``caption_outputs``).

Speed: the model is loaded once; each image starts a new conversation with
``Engine.reset(keep_cache=True)``, so the system prompt and the turn header already in the KV
cache are not evaluated again (``stats.cached_n`` says how many tokens were reused); reading,
hashing, decoding and resizing the next image happen in a background thread while llama.cpp
works on the current one.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .budget import render_views
from .caption_inputs import InputItem, discover
from .caption_outputs import CaptionRecord, Entry
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
from .images import DEFAULT_MAX_PIXELS, LoadedImage, load_image

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


def model_identity(model: str, mmproj: str) -> tuple[str, str]:
    """(name for records, identity for the resume key): file names and sizes, no hashing."""
    def ident(p: str) -> str:
        try:
            return f"{os.path.basename(p)}:{os.path.getsize(p)}"
        except OSError:
            return os.path.basename(p)
    return os.path.basename(model), f"{ident(model)}+{ident(mmproj)}"


# --- preparing inputs in a background thread ---------------------------------------------------
@dataclass
class Prepared:
    """An input made ready for the model (or found done, skipped, or broken)."""

    item: InputItem
    status: str  # "caption" | "skip" | "error"
    reason: str | None = None  # why skipped
    previous: dict[str, Any] | None = None  # the earlier record that makes it done
    sha256: str | None = None
    bytes: int | None = None
    mtime_ns: int | None = None
    image: LoadedImage | None = None  # what goes to the engine (already resized when planned so)
    width: int | None = None
    height: int | None = None
    planned_tokens: int = 0
    notes: list[str] = field(default_factory=list)
    existing: str | None = None
    error: str | None = None
    error_kind: str | None = None
    load_ms: float = 0.0


def _strip_label(msg: str, path: str) -> str:
    return msg[len(path) + 2:] if msg.startswith(path + ": ") else msg


class ResumeIndex:
    """What earlier runs (same settings) left in the log: the latest record per path.

    Records a rerun redoes — io/runtime errors, every error with ``retry_errors``, duplicates —
    are listed in ``drop``; records of other settings are kept and counted."""

    def __init__(self, entries: list[Entry] = (), digest: str = "", retry_errors: bool = False):
        self.by_path: dict[str, Entry] = {}
        self.drop: list[Entry] = []
        self.other_settings = 0
        self.superseded: list[Entry] = []
        self._lock = threading.Lock()
        for e in entries:
            d = e.data
            if not d:
                continue
            if d.get("settings") != digest:
                self.other_settings += 1
                continue
            if d.get("error") and (retry_errors or d.get("error_kind") in ("io", "runtime")):
                self.drop.append(e)
                continue
            old = self.by_path.get(d["path"])
            if old is not None:
                self.drop.append(old)
            self.by_path[d["path"]] = e

    def get(self, path: str) -> Entry | None:
        return self.by_path.get(path)

    def supersede(self, e: Entry) -> None:
        with self._lock:
            self.superseded.append(e)


class Preparer:
    """Turns an InputItem into a Prepared: stat, resume check, read, hash, decode, budget."""

    def __init__(self, engine: Any, settings: CaptionSettings, digest: str, deliverable: Plain,
                 index: ResumeIndex, conflicts: dict[str, str]):
        self.engine = engine
        self.settings = settings
        self.digest = digest
        self.out = deliverable
        self.index = index
        self.conflicts = conflicts

    def custom_id(self, path: str, sha: str | None) -> str:
        return "img-" + hashlib.sha256(f"{path}\0{sha}\0{self.digest}".encode(
            "utf-8", "surrogateescape")).hexdigest()[:20]

    def __call__(self, item: InputItem) -> Prepared:
        t0 = time.perf_counter()
        p = Prepared(item, "caption")
        try:
            self._prepare(p)
        except EdgeVLMError as exc:
            p.status, p.error_kind = "error", "input" if isinstance(exc, InputError) else "runtime"
            p.error = _strip_label(str(exc), item.path)
        except MemoryError:
            p.status, p.error_kind, p.error = "error", "runtime", "out of memory while decoding"
        except Exception as exc:  # never let one file stop the run
            p.status, p.error_kind, p.error = "error", "runtime", f"{type(exc).__name__}: {exc}"
        p.load_ms = (time.perf_counter() - t0) * 1000
        return p

    def settled(self, item: InputItem) -> bool:
        """Cheaply known to need no model: done by an earlier run (same size and mtime) or
        kept by the --existing policy."""
        prev = self.index.get(item.path)
        if prev is not None:
            try:
                st = os.stat(item.path)
            except OSError:
                return False
            if prev.data.get("bytes") == st.st_size and prev.data.get("mtime_ns") == st.st_mtime_ns:
                return True
        return item.path not in self.conflicts and self.out.skip_reason(item) is not None

    def _fail(self, p: Prepared, kind: str, msg: str) -> Prepared:
        p.status, p.error_kind, p.error = "error", kind, msg
        return p

    def _prepare(self, p: Prepared) -> Prepared:
        item, s = p.item, self.settings
        try:
            st = os.stat(item.path)
        except FileNotFoundError:
            return self._fail(p, "io", "no such file")
        except OSError as exc:
            return self._fail(p, "io", f"cannot read ({exc.strerror or exc})")
        p.bytes, p.mtime_ns = st.st_size, st.st_mtime_ns
        prev = self.index.get(item.path)
        if prev is not None and prev.data.get("bytes") == st.st_size and \
                prev.data.get("mtime_ns") == st.st_mtime_ns:
            p.status, p.reason, p.previous = "skip", "done", prev.data
            return p
        if item.path in self.conflicts:
            return self._fail(p, "input", self.conflicts[item.path])
        reason = self.out.skip_reason(item)
        if reason:
            p.status, p.reason = "skip", reason
            return p
        if os.path.isdir(item.path):
            return self._fail(p, "input", "is a directory, not an image")
        if st.st_size > s.max_file_bytes:
            return self._fail(p, "input", f"{st.st_size:,} bytes is over the file size limit of "
                                          f"{s.max_file_bytes:,} (--max-file-size)")
        try:
            with open(item.path, "rb") as fh:
                data = fh.read()
        except OSError as exc:
            return self._fail(p, "io", f"cannot read ({exc.strerror or exc})")
        p.sha256 = hashlib.sha256(data).hexdigest()
        if prev is not None:
            if prev.data.get("sha256") == p.sha256:
                p.status, p.reason, p.previous = "skip", "done", prev.data
                return p
            self.index.supersede(prev)  # the file changed: its old record goes at the end
        if self.out.kind != "plain" or "{existing}" in s.prompt:
            p.existing = self.out.existing(item)
        img = load_image(data, s.max_pixels, name=item.path)
        p.width, p.height = img.width, img.height
        p.notes = list(img.notes)
        p.image = img
        if self.engine is not None:  # plan and resize here, off the model's thread
            plan = self.engine.plan_image(img)
            p.planned_tokens = plan.total_tokens
            p.notes += list(plan.notes)
            views = render_views(img, plan)
            if len(views) == 1 and views[0][0] is None:
                p.image = views[0][1]
        return p


class Prefetcher:
    """Runs a Preparer over the items in a thread, ``depth`` ahead of the consumer."""

    _END = object()

    def __init__(self, items: Iterable[InputItem], prepare: Callable[[InputItem], Prepared], depth: int = 2,
                 stop: StopToken | None = None):
        self.items = items
        self.stop = stop
        self.prepare = prepare
        self.q: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self.stopped = threading.Event()
        self.wait_s = 0.0  # time the consumer spent waiting for the next input
        self.thread = threading.Thread(target=self._work, name="edgevlm-caption-prefetch", daemon=True)
        self.thread.start()

    def _put(self, obj: Any) -> bool:
        while not self.stopped.is_set():
            try:
                self.q.put(obj, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _work(self) -> None:
        try:
            for it in self.items:
                if self.stopped.is_set() or not self._put(self.prepare(it)):
                    return
        finally:
            self._put(self._END)

    def __iter__(self) -> Iterator[Prepared]:
        while True:
            t0 = time.perf_counter()
            while True:
                try:
                    obj = self.q.get(timeout=0.1)
                    break
                except queue.Empty:
                    if self.stop is not None:
                        self.stop.check()
            self.wait_s += time.perf_counter() - t0
            if obj is self._END:
                return
            yield obj

    def close(self) -> None:
        self.stopped.set()
        while True:
            try:
                self.q.get_nowait()
            except queue.Empty:
                break
        self.thread.join(timeout=10)


# --- stopping cleanly --------------------------------------------------------------------------
class StopToken:
    """Ctrl-C, the polite way. ``request()``: stop after the current image. ``abandon()``: stop
    at the next safe point (between generated tokens, or while waiting for an image) without
    writing the current image, which a rerun does. Flags only: a signal handler may call them
    at any moment (even inside a llama.cpp log callback, where an exception would be lost)."""

    def __init__(self) -> None:
        self.requested = False
        self.abandoned = False

    def request(self) -> None:
        self.requested = True

    def abandon(self) -> None:
        self.requested = self.abandoned = True

    def check(self) -> None:
        if self.abandoned:
            raise KeyboardInterrupt


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
                 prefetch: int = 2):
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

    def run(self, items: Iterable[InputItem]) -> Iterator[CaptionResult]:
        pf = Prefetcher(items, self.preparer, self.prefetch, self.stop)
        try:
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
        except EdgeVLMError as exc:
            kind = "input" if isinstance(exc, ImageError) else "context" if isinstance(exc, InputError) else "runtime"
            return self._failed(p, prompt, kind, _strip_label(str(exc), p.item.path))
        except Exception as exc:  # a failure in llama.cpp or a bug: record it, go on
            return self._failed(p, prompt, "runtime", f"{type(exc).__name__}: {exc}")
        self.fails_in_a_row = 0
        raw = "".join(parts).strip()
        text = clean_caption(raw, stats.finish_reason == "length") if self.settings.clean else raw
        caption = self.settings.prefix + text + self.settings.suffix
        st = {**stats.to_dict(), "image_load_ms": round(p.load_ms, 2),
              "total_ms": round((time.perf_counter() - t0) * 1000, 2)}
        rec = self._record(p, caption=caption, prompt=prompt, image_tokens=stats.image_tokens, stats=st,
                           raw_caption=raw if raw != caption else None)
        rec.notes = rec.notes + [n for n in eng.notices if n not in rec.notes]
        if rec.target is not None:
            rec.text = compose(p.existing, caption, self.out.policy, self.out.separator)
        return CaptionResult("done", p.item, rec)

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
