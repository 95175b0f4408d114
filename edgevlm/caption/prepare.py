"""Inputs made ready for the model in a background thread: stat, resume check, read, hash,
decode, plan and resize (``Preparer``), ``depth`` ahead of the captioning loop (``Prefetcher``);
``ResumeIndex`` is what earlier runs left in the record log."""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import EdgeVLMError, InputError
from ..jobs.records import Entry
from ..jobs.stop import StopToken
from ..runtime.intake import Intake, MediaRef, Views, media_kind
from ..vision.images import LoadedImage, load_image
from .inputs import InputItem
from .settings import CaptionSettings
from .sidecars import Plain

__all__ = ["Prefetcher", "Prepared", "Preparer", "ResumeIndex", "strip_label"]


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
    image: LoadedImage | None = None  # the picture as decoded
    made: Views | None = None  # what the model sees: its views, made ready by the intake
    width: int | None = None
    height: int | None = None
    planned_tokens: int = 0
    frames: tuple[float, ...] | None = None  # a video: the seconds of the frames chosen
    notes: list[str] = field(default_factory=list)
    existing: str | None = None
    error: str | None = None
    error_kind: str | None = None
    load_ms: float = 0.0


def strip_label(msg: str, path: str) -> str:
    return msg[len(path) + 2 :] if msg.startswith(path + ": ") else msg


class ResumeIndex:
    """What earlier runs (same settings) left in the log: the latest record per path.

    Records a rerun redoes — io/runtime errors, every error with ``retry_errors``, duplicates —
    are listed in ``drop``; records of other settings are kept and counted."""

    def __init__(self, entries: Iterable[Entry] = (), digest: str = "", retry_errors: bool = False):
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

    def __init__(
        self,
        intake: Intake | None,
        settings: CaptionSettings,
        digest: str,
        deliverable: Plain,
        index: ResumeIndex,
        conflicts: dict[str, str],
        room: int | None = None,
    ):
        self.intake = intake  # None: no model (every input is known to be done)
        self.room = room  # the tokens a clip may take (the image room of one caption request)
        self.settings = settings
        self.digest = digest
        self.out = deliverable
        self.index = index
        self.conflicts = conflicts

    def custom_id(self, path: str, sha: str | None) -> str:
        return (
            "img-" + hashlib.sha256(f"{path}\0{sha}\0{self.digest}".encode("utf-8", "surrogateescape")).hexdigest()[:20]
        )

    def __call__(self, item: InputItem) -> Prepared:
        t0 = time.perf_counter()
        p = Prepared(item, "caption")
        try:
            self._prepare(p)
        except EdgeVLMError as exc:
            p.status, p.error_kind = "error", "input" if isinstance(exc, InputError) else "runtime"
            p.error = strip_label(str(exc), item.path)
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
        given = item.data  # the bytes, when a reader elsewhere (Ray Data) already has them
        try:
            st = os.stat(item.path)
        except FileNotFoundError:
            if given is None:
                return self._fail(p, "io", "no such file")
            st = None
        except OSError as exc:
            if given is None:
                return self._fail(p, "io", f"cannot read ({exc.strerror or exc})")
            st = None
        if given is not None and (st is None or st.st_size != len(given)):
            st = None  # not this node's file (or it changed since it was read): no mtime
        p.bytes = st.st_size if st is not None else len(given or b"")
        p.mtime_ns = st.st_mtime_ns if st is not None else None
        prev = self.index.get(item.path)
        if (
            prev is not None
            and st is not None
            and prev.data.get("bytes") == st.st_size
            and prev.data.get("mtime_ns") == st.st_mtime_ns
        ):
            p.status, p.reason, p.previous = "skip", "done", prev.data
            return p
        if item.path in self.conflicts:
            return self._fail(p, "input", self.conflicts[item.path])
        reason = self.out.skip_reason(item)
        if reason:
            p.status, p.reason = "skip", reason
            return p
        if given is None and os.path.isdir(item.path):
            return self._fail(p, "input", "is a directory, not an image")
        if p.bytes > s.max_file_bytes:
            return self._fail(
                p, "input", f"{p.bytes:,} bytes is over the file size limit of {s.max_file_bytes:,} (--max-file-size)"
            )
        if given is not None:
            data = given
        else:
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
        ref = MediaRef(data, name=item.path)
        if self.intake is None:  # no model: the picture is only checked
            if media_kind(ref) in ("video", "audio"):
                raise InputError(f"a {media_kind(ref)} file needs the model's projector to be planned")
            img = load_image(data, s.max_pixels, name=item.path)
            p.width, p.height, p.image, p.notes = img.width, img.height, img, list(img.notes)
            return p
        # plan, resize and cut tiles (a clip: choose its frames) here, off the model's thread
        made = self.intake.views(ref, self.room)
        p.width, p.height = made.width, made.height
        p.image = made.original or made.views[0]
        p.made = made
        p.planned_tokens = made.tokens
        p.notes += [*made.decoded, *made.notes]
        p.frames = made.times
        return p


class Prefetcher:
    """Runs a Preparer over the items in a thread, ``depth`` ahead of the consumer."""

    _END = object()

    def __init__(
        self,
        items: Iterable[InputItem],
        prepare: Callable[[InputItem], Prepared],
        depth: int = 2,
        stop: StopToken | None = None,
    ):
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
