"""Batch captioning: one loaded model, many images, resumable, nothing lost.

    vlm = edgevlm.load("model.gguf", "mmproj.gguf", n_seq_max=4)   # a LoadedModel
    for rec in caption_images(vlm, ["photos/"], CaptionSettings(max_tokens=64), recursive=True):
        print(rec.path, rec.caption or rec.error)

``CaptionJob`` adds files: it finds what an earlier run already did (resume), writes each record
atomically, and keeps sidecars / ``metadata.jsonl`` in step (see ``outputs``).

Each image is a one-turn request to the model's scheduler. When the context holds several
sequences (``edgevlm.load(..., n_seq_max=4)``; ``caption_slots`` says how many fit), several
images are in flight and their captions are generated in one batch per token, sharing the
system prompt's KV cells (``stats.cached_n`` says how many tokens were reused); merged images
(``merge``) take the same path. Reading, hashing, decoding, resizing and tiling the next images
happen in a background thread while llama.cpp works. The captioner is a client of the model's
scheduler: it takes only its own finished sequences, so a conversation or a server on the same
model runs beside it; the model's own conversation and options are left as they are.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from ..errors import BackendError, ContextExceeded, EdgeVLMError, ImageError, InputError, MemoryBusy
from ..jobs.stop import StopToken
from ..runtime.intake import Asked, ReplySpec
from ..runtime.jsongrammar import json_grammar
from ..runtime.scheduler import WAIT, Client, Request, Sequence
from ..vision.merge import MergeSpec
from .inputs import InputItem, discover
from .outputs import CaptionRecord
from .prepare import Prefetcher, Prepared, Preparer, ResumeIndex, strip_label
from .settings import CaptionSettings, model_identity
from .sidecars import Plain
from .text import clean_caption, compose, render_prompt

__all__ = ["CaptionResult", "Captioner", "caption_images"]

FAILS_IN_A_ROW = 3  # runtime failures in a row that stop the run (llama.cpp is broken, not the image)


@dataclass(frozen=True)
class CaptionResult:
    status: str  # "done" | "failed" | "skipped"
    item: InputItem
    record: CaptionRecord | None = None  # done / failed: the new record
    reason: str | None = None  # skipped: "done" (earlier run) or an --existing reason
    previous: dict[str, Any] | None = None  # skipped as done: the earlier record

    def to_dict(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "path": self.item.path,
            "reason": self.reason,
            "record": self.record.to_dict() if self.record else None,
            "previous": self.previous,
        }


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass
class _InFlight:
    prepared: Prepared
    prompt: str
    notices: list[str]
    t0: float
    request: Request | None = None


class Captioner:
    """Captions prepared inputs on a loaded model's scheduler, up to ``slots`` at once; yields
    a CaptionResult per input (in the order images finish, within ``slots`` of the input
    order)."""

    def __init__(
        self,
        model: Any,
        settings: CaptionSettings,
        model_name: str,
        digest: str,
        deliverable: Plain | None = None,
        index: ResumeIndex | None = None,
        conflicts: dict[str, str] | None = None,
        stop: StopToken | None = None,
        prefetch: int = 2,
        slots: int | None = None,
    ):
        settings.validate()
        self.model = model  # a LoadedModel; None: every input is known to be done (nothing to caption)
        self.client = Client("caption")
        self.settings = settings
        self.model_name = model_name
        self.digest = digest
        self.out = deliverable or Plain()
        self.index = index or ResumeIndex()
        self.stop = stop or StopToken()
        self.prefetch = prefetch
        self.wait_s = 0.0
        self.fails_in_a_row = 0
        self.llama_ms: float | None = None  # time inside llama.cpp, measured
        self.peak_in_flight = 0  # most images captioned at once
        self.merge = MergeSpec.parse(settings.merge)
        self.grammar = json_grammar(json.loads(settings.json_schema), "--json-schema") if settings.json_schema else None
        self.slots = 1
        self.intake, room = None, None
        if model is not None:
            sched = model.scheduler
            opts = replace(
                model.options,
                image_tokens=settings.image_tokens or None,
                tiles=settings.tiles,
                video=settings.video,
                audio=settings.audio,
            )
            self.intake = model.intake(opts)
            self.slots = max(1, min(slots or sched.max_running, sched.max_running))
            room = sched.budget.image_room(settings.max_tokens)
        self.preparer = Preparer(self.intake, settings, digest, self.out, self.index, conflicts or {}, room)

    def run(self, items: Iterable[InputItem]) -> Iterator[CaptionResult]:
        pf = Prefetcher(items, self.preparer, max(self.prefetch, self.slots), self.stop)
        try:
            yield from self._run(pf)
        finally:
            pf.close()
            self.wait_s = pf.wait_s

    def _record(self, p: Prepared, **kw: Any) -> CaptionRecord:
        fields: dict[str, Any] = dict(
            custom_id=self.preparer.custom_id(p.item.path, p.sha256),
            path=p.item.path,
            sha256=p.sha256,
            caption=None,
            model=self.model_name,
            prompt=None,
            settings=self.digest,
            width=p.width,
            height=p.height,
            bytes=p.bytes,
            mtime_ns=p.mtime_ns,
            notes=tuple(p.notes),
            target=self.out.target(p.item),
            existing=p.existing,
            created=_now(),
        )
        return CaptionRecord(**{**fields, **kw})

    def _settled(self, p: Prepared) -> CaptionResult:
        """An input that needs no model: done before, skipped, or broken."""
        if p.status == "skip":
            return CaptionResult("skipped", p.item, reason=p.reason, previous=p.previous)
        rec = self._record(p, error=p.error, error_kind=p.error_kind, stats={"image_load_ms": round(p.load_ms, 2)})
        return CaptionResult("failed", p.item, rec)

    def _request(self, job: _InFlight) -> Request:
        """The one-turn request of a prepared picture, its views run past the guard."""
        eng, p, s = self.model, job.prepared, self.settings
        sched = eng.scheduler
        assert self.intake is not None  # (a model runs it)
        budget = sched.budget  # (an instruction too long by its size alone, {existing} text: before tokenizing)
        budget.check_text(budget.text_bytes(s.system, job.prompt), budget.reply_reserve(s.max_tokens))
        assert p.made is not None  # (prepared for the model)
        reply = ReplySpec(s.max_tokens, s.sampling(self.grammar), tuple(s.stop) + tuple(sched.default_stops))
        turn = self.intake.turn(
            [Asked("user", job.prompt, (p.made,))], reply, sched.budget.image_room(s.max_tokens), system=s.system
        )
        job.notices.extend(turn.notices)  # (the guard's: what planning did is in the record already)
        prompt = sched.render(list(turn.messages), s.system, self.merge, keep_images=False)
        return reply.request(prompt, new_images=frozenset(prompt.units), t_start=job.t0, tag=job)

    def _run(self, pf: Prefetcher) -> Iterator[CaptionResult]:
        sched = self.model.scheduler if self.model is not None else None
        source = iter(pf)
        llama_ms_before = sched.llama_ms if sched is not None else 0.0
        waiting: _InFlight | None = None
        flying: dict[int, Sequence] = {}
        try:
            while True:
                while len(flying) < self.slots and not self.stop.requested:
                    job = waiting
                    waiting = None
                    if job is None:
                        p = next(source, None)
                        if p is None:
                            break
                        if p.status != "caption":
                            yield self._settled(p)
                            continue
                        job = _InFlight(
                            p,
                            render_prompt(self.settings.prompt, p.item, p.existing, p.made.kind if p.made else "image"),
                            [],
                            time.perf_counter(),
                        )
                        if sched is None:  # the file changed after the run decided no model was needed
                            yield self._failed(p, job.prompt, "runtime", "changed while the run started; run again")
                            continue
                    assert sched is not None  # (checked above when the job was made)
                    try:
                        job.request = job.request or self._request(job)
                        seq = sched.submit(job.request, self.client)
                    except Exception as exc:
                        if job.request is not None:
                            job.request.prompt.release()
                        yield self._error(job.prepared, job.prompt, exc)
                        continue
                    if seq == WAIT:  # it fits once images in flight finish
                        waiting = job
                        break
                    flying[id(seq)] = seq
                    self.peak_in_flight = max(self.peak_in_flight, len(flying))
                if not flying:
                    if waiting is None or self.stop.requested:
                        return
                    continue  # it did not fit beside the others: now it runs alone
                assert sched is not None  # something is in flight
                sched.step()
                for seq in self.client.take_finished():  # written even when abandoning
                    if flying.pop(id(seq), None) is None:
                        continue  # one cancelled before (not in flight any more)
                    job = seq.tag
                    if seq.error is not None:
                        yield self._error(job.prepared, job.prompt, seq.error)
                    else:
                        yield self._done(job, seq)
                self.stop.check()
        finally:
            for seq in flying.values():
                assert sched is not None  # something is in flight
                sched.cancel(seq)
            if waiting is not None and waiting.request is not None:
                waiting.request.prompt.release()
            if sched is not None:
                self.llama_ms = sched.llama_ms - llama_ms_before

    def _error(self, p: Prepared, prompt: str, exc: BaseException) -> CaptionResult:
        if isinstance(exc, EdgeVLMError):
            # memory short now: "runtime" (a rerun retries); a template that refuses: "input"
            kind = (
                "input"
                if isinstance(exc, ImageError)
                else "runtime"
                if isinstance(exc, MemoryBusy)
                else "context"
                if isinstance(exc, ContextExceeded)
                else "input"
                if isinstance(exc, InputError)
                else "runtime"
            )
            return self._failed(p, prompt, kind, strip_label(str(exc), p.item.path))
        # a failure in llama.cpp or a bug: record it, go on
        return self._failed(p, prompt, "runtime", f"{type(exc).__name__}: {exc}")

    def _done(self, job: _InFlight, seq: Sequence) -> CaptionResult:
        p, stats = job.prepared, seq.stats
        assert stats is not None
        self.fails_in_a_row = 0
        raw = seq.reply.strip()
        parsed = None
        if self.grammar is not None:
            try:
                parsed = json.loads(raw)
            except ValueError:
                why = "it hit --max-tokens" if stats.finish_reason == "length" else "it stopped early"
                rec = self._record(
                    p,
                    prompt=job.prompt,
                    error=f"the answer is not complete JSON ({why})",
                    error_kind="output",
                    raw_caption=raw,
                    stats={"image_load_ms": round(p.load_ms, 2)},
                )
                return CaptionResult("failed", p.item, rec)
        text = clean_caption(raw, stats.finish_reason == "length") if self.settings.clean else raw
        caption = self.settings.prefix + text + self.settings.suffix
        st = {
            **stats.to_dict(),
            "image_load_ms": round(p.load_ms, 2),
            "total_ms": round((time.perf_counter() - job.t0) * 1000, 2),
        }
        rec = self._record(
            p,
            caption=caption,
            prompt=job.prompt,
            image_tokens=stats.image_tokens,
            frames=p.frames,
            stats=st,
            raw_caption=raw if raw != caption else None,
            json=parsed,
        )
        rec = rec.with_(notes=rec.notes + tuple(n for n in job.notices if n not in rec.notes))
        if rec.target is not None:
            rec = rec.with_(text=compose(p.existing, caption, self.out.policy, self.out.separator))
        return CaptionResult("done", p.item, rec)

    def _failed(self, p: Prepared, prompt: str, kind: str, msg: str) -> CaptionResult:
        if kind == "runtime":
            self.fails_in_a_row += 1
            if self.fails_in_a_row >= FAILS_IN_A_ROW:
                raise BackendError(
                    f"llama.cpp failed on {self.fails_in_a_row} images in a row, stopping (last: {p.item.path}: {msg})"
                )
        rec = self._record(p, prompt=prompt, error=msg, error_kind=kind, stats={"image_load_ms": round(p.load_ms, 2)})
        return CaptionResult("failed", p.item, rec)


def caption_images(
    model: Any,
    inputs: Iterable[str | InputItem],
    settings: CaptionSettings | None = None,
    *,
    recursive: bool = False,
    prefetch: int = 2,
    slots: int | None = None,
    **fields: Any,
) -> Iterator[CaptionRecord]:
    """Caption images (paths, directories, globs) without writing files: one record each.
    The model's conversation and options stay as they are.

    ``fields`` override ``settings`` (``caption_images(vlm, paths, max_tokens=32)``)."""
    settings = replace(settings or CaptionSettings(), **fields)
    inputs = list(inputs)
    items = [i for i in inputs if isinstance(i, InputItem)]
    names = [os.fspath(i) for i in inputs if not isinstance(i, InputItem)]
    if names:
        items += discover(names, recursive=recursive).items
    be = model.backend
    name, ident = model_identity(be.model_path, be.mmproj_path)
    cap = Captioner(model, settings, name, settings.digest(ident), prefetch=prefetch, slots=slots)
    for res in cap.run(items):
        if res.record is not None:
            yield res.record
