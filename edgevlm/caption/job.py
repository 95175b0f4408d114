"""A resumable caption run over files: the record log, the deliverable beside it, the summary.

    job = CaptionJob(items, CaptionSettings(), model="m.gguf", mmproj="p.gguf", out="captions.jsonl")
    job.open()                       # lock the log, read what is done, repair what a kill left
    summary = job.run(edgevlm.load("m.gguf", "p.gguf"))
    job.close()

Exit codes (``CaptionSummary.exit_code``): 0 every image has a caption; 4 some images failed
(their records carry ``error``); 130 interrupted (Ctrl-C / SIGTERM; the rest is left for a
rerun). The CLI adds 2 for bad input and 1 when llama.cpp or the disk fails the whole run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..errors import InputError, OutputError
from ..jobs.records import RecordLog
from ..jobs.stop import StopToken
from .inputs import InputItem, common_root
from .outputs import CAPTION_RECORDS
from .parquet import ParquetLog
from .prepare import Preparer, ResumeIndex
from .runner import Captioner, CaptionResult
from .settings import CaptionSettings, model_identity
from .sidecars import Metadata, Plain, Sidecars

__all__ = ["CaptionJob", "CaptionSummary", "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK"]

EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 4, 130
FORMATS = ("jsonl", "csv", "parquet", "txt", "metadata")
DEFAULT_OUT = {"jsonl": "captions.jsonl", "csv": "captions.csv", "parquet": "captions.parquet"}
POLICIES = ("skip", "overwrite", "append", "prepend")


@dataclass
class CaptionSummary:
    total: int = 0  # inputs of this run (this shard)
    done: int = 0  # captioned now
    skipped: int = 0  # not captioned now: done by an earlier run, or an existing caption kept
    skipped_done: int = 0  # ... of which done by an earlier run
    failed: int = 0  # error records written now
    failed_before: int = 0  # skipped as done, but the earlier record is an error
    interrupted: bool = False
    elapsed_s: float = 0.0
    generated_tokens: int = 0
    prompt_tokens: int = 0  # evaluated (cached ones excluded)
    cached_tokens: int = 0  # reused from the KV cache (the shared prefix)
    engine_ms: float = 0.0  # llama.cpp's prefill + decode, attributed by tokens (prompt_ms - encode + predicted_ms)
    encode_ms: float = 0.0  # the vision encoder's (it runs beside the step loop while replies are generated)
    load_ms: float = 0.0  # reading/decoding/resizing images (background thread)
    wait_ms: float = 0.0  # the model waiting for the next image
    write_ms: float = 0.0  # records, sidecars (fsync included)
    dropped_records: int = 0  # io/runtime errors of earlier runs removed from the log, redone
    recovered: int = 0  # sidecars / metadata entries a killed run logged but had not written
    other_settings: int = 0  # records in the log made with other settings (kept)
    in_flight_max: int = 0  # most images captioned at once (their replies in one batch)
    out: str = ""

    @property
    def remaining(self) -> int:
        return max(0, self.total - self.done - self.skipped - self.failed)

    @property
    def images_per_s(self) -> float:
        return round(self.done / self.elapsed_s, 3) if self.elapsed_s > 0 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return round(self.generated_tokens / self.elapsed_s, 2) if self.elapsed_s > 0 else 0.0

    @property
    def cached_per_image(self) -> float:
        return round(self.cached_tokens / self.done, 1) if self.done else 0.0

    @property
    def engine_share(self) -> float:
        return round(self.engine_ms / (self.elapsed_s * 1000), 4) if self.elapsed_s > 0 else 0.0

    @property
    def exit_code(self) -> int:
        if self.interrupted:
            return EXIT_INTERRUPTED
        return EXIT_FAILED if self.failed or self.failed_before else EXIT_OK

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("remaining", "images_per_s", "tokens_per_s", "cached_per_image", "engine_share", "exit_code"):
            d[k] = getattr(self, k)
        d["elapsed_s"] = round(self.elapsed_s, 3)
        for k in ("engine_ms", "encode_ms", "load_ms", "wait_ms", "write_ms"):
            d[k] = round(d[k], 1)
        return d

    def lines(self) -> list[str]:
        """The end-of-run summary for people."""
        skipped = f"skipped {self.skipped}"
        if self.failed_before:
            skipped += f" ({self.failed_before} failed earlier)"
        head = (
            f"captioned {self.done} · {skipped} · failed {self.failed}"
            f" · {self.total} image(s) in {self.elapsed_s:.1f} s"
        )
        if self.done:
            head += (
                f" · {self.images_per_s:.2f} images/s · {self.tokens_per_s:.1f} tok/s"
                f" · prefix reused {self.cached_per_image:g} tok/image"
            )
            if self.in_flight_max > 1:
                head += f" · {self.in_flight_max} in flight"
        out = [head]
        if self.interrupted:
            out.append(f"interrupted: {self.remaining} image(s) left; run the same command again to continue")
        if self.recovered:
            out.append(f"completed {self.recovered} caption file(s) an interrupted run had not written")
        if self.dropped_records:
            out.append(f"retried {self.dropped_records} image(s) that failed earlier")
        if self.failed or self.failed_before:
            out.append(
                f"{self.failed + self.failed_before} image(s) without a caption: their "
                f'records in {self.out} have "error" set'
            )
        return out


class CaptionJob:
    """Caption ``items`` into ``out`` (``fmt`` jsonl/csv, or parquet: a folder of shards), or
    sidecars / metadata.jsonl (txt / metadata, with the record log at ``out``), resuming whatever
    an earlier run did."""

    def __init__(
        self,
        items: list[InputItem],
        settings: CaptionSettings,
        *,
        model: str,
        mmproj: str,
        out: str | None = None,
        fmt: str = "jsonl",
        existing: str = "skip",
        separator: str = " ",
        root: str | None = None,
        sidecar_ext: str = ".txt",
        retry_errors: bool = False,
        identity: tuple[str, str] | None = None,
    ):
        if fmt not in FORMATS:
            raise InputError(f"--format {fmt}: use one of {', '.join(FORMATS)}")
        if existing not in POLICIES:
            raise InputError(f"--existing {existing}: use one of {', '.join(POLICIES)}")
        settings.validate()
        self.items = items
        self.settings = settings
        self.fmt = fmt
        self.out = out or DEFAULT_OUT.get(fmt, "captions.jsonl")
        # (name in records, identity in the resume key): from the files, or given (a cluster's
        # driver that has no copy of them)
        self.model_name, ident = identity or model_identity(model, mmproj)
        self.digest = settings.digest(ident, fmt if fmt in ("txt", "metadata") else "log")
        if fmt == "txt":
            self.deliverable: Plain = Sidecars(existing, separator, sidecar_ext)
        elif fmt == "metadata":
            self.deliverable = Metadata(root or common_root(items), existing, separator, sidecar_ext)
        else:
            self.deliverable = Plain(existing, separator, sidecar_ext)
        self.retry_errors = retry_errors
        self.log: RecordLog | ParquetLog = (
            ParquetLog(self.out)
            if fmt == "parquet"
            else RecordLog(self.out, CAPTION_RECORDS, "csv" if fmt == "csv" else "jsonl")
        )
        self.summary = CaptionSummary(total=len(items), out=self.out)
        self.index = ResumeIndex()
        self.conflicts: dict[str, str] = {}
        self.written: set[str] = set()  # custom_ids in the log: a record is never written twice

    @property
    def metadata_path(self) -> str | None:
        return self.deliverable.path if isinstance(self.deliverable, Metadata) else None

    def open(self) -> CaptionJob:
        """Lock and read the log, drop records a rerun redoes, finish what a kill left."""
        self.log.open()
        self.conflicts = self.deliverable.prepare(self.items)
        self.index = ResumeIndex(self.log.entries, self.digest, self.retry_errors)
        dropped = {id(e) for e in self.index.drop}
        self.written = {e.data["custom_id"] for e in self.log.entries if e.data and id(e) not in dropped}
        self.summary.other_settings = self.index.other_settings
        try:
            if self.index.drop:
                self.summary.dropped_records = self.log.remove(self.index.drop)
            self.summary.recovered = self.deliverable.recover(self.log.entries)
        except OSError as exc:
            raise OutputError(f"{self.out}: cannot update ({exc.strerror or exc})") from None
        return self

    def needs_model(self) -> bool:
        """Whether some input may need captioning (False: a rerun of a finished job)."""
        prep = Preparer(None, self.settings, self.digest, self.deliverable, self.index, self.conflicts)
        return not all(prep.settled(it) for it in self.items)

    def recorded_paths(self) -> set[str | None]:
        """Paths with a record of these settings, read without locking (``--dry-run``)."""
        log = self.log
        entries = (
            ParquetLog.peek(self.out)
            if isinstance(log, ParquetLog)
            else RecordLog.peek(self.out, CAPTION_RECORDS, log.fmt)
        )
        return {e.data.get("path") for e in entries if e.data.get("settings") == self.digest}

    def todo(self) -> int:
        """Inputs without a record of these settings (an upper bound of the work left)."""
        return sum(1 for it in self.items if self.index.get(it.path) is None)

    def run(
        self,
        model: Any,
        *,
        stop: StopToken | None = None,
        prefetch: int = 2,
        slots: int | None = None,
        on_result: Callable[[CaptionResult, CaptionSummary], None] | None = None,
    ) -> CaptionSummary:
        """Caption with ``model`` (None when ``needs_model()`` said no), up to ``slots`` images
        in flight (None: as many as its context has sequences)."""
        stop = stop or StopToken()
        cap = Captioner(
            model,
            self.settings,
            self.model_name,
            self.digest,
            self.deliverable,
            self.index,
            self.conflicts,
            stop,
            prefetch,
            slots,
        )

        def after() -> None:
            self.summary.wait_ms = cap.wait_s * 1000
            self.summary.in_flight_max = cap.peak_in_flight

        return self.consume(cap.run(self.items), stop=stop, on_result=on_result, after=after)

    def consume(
        self,
        results: Iterable[CaptionResult],
        *,
        stop: StopToken | None = None,
        on_result: Callable[[CaptionResult, CaptionSummary], None] | None = None,
        after: Callable[[], None] | None = None,
    ) -> CaptionSummary:
        """Write and count results as they come (from this process's Captioner, or from remote
        actors), then finish the deliverable; Ctrl-C (KeyboardInterrupt) ends it cleanly."""
        s = self.summary
        t0 = time.perf_counter()
        try:
            for res in results:
                res = self.accept(res) or res
                s.elapsed_s = time.perf_counter() - t0
                if on_result is not None:
                    on_result(res, s)
        except KeyboardInterrupt:
            s.interrupted = True
        finally:
            s.elapsed_s = time.perf_counter() - t0
            if after is not None:
                after()
            self._finish()
        if stop is not None and stop.requested and s.remaining:
            s.interrupted = True
        return s

    def accept(self, res: CaptionResult) -> CaptionResult | None:
        """Write an image's outcome (from this process or a remote actor) and count it: the
        outcome as written (a deliverable that could not be written turns it into a failure), or
        None when its record is already in the log (a retried batch's duplicate: nothing written)."""
        if res.record is not None:
            if res.record.custom_id in self.written:
                return None
            res = self._write(res)
            assert res.record is not None
            self.written.add(res.record.custom_id)
        self._account(res)
        return res

    def _account(self, res: CaptionResult) -> None:
        s = self.summary
        if res.status == "skipped":
            s.skipped += 1
            if res.reason == "done":
                s.skipped_done += 1
                if res.previous and res.previous.get("error"):
                    s.failed_before += 1
            return
        rec = res.record
        assert rec is not None
        st = rec.stats or {}
        s.load_ms += st.get("image_load_ms", 0.0)
        if res.status == "failed":
            s.failed += 1
            return
        s.done += 1
        s.generated_tokens += st.get("predicted_n", 0)
        s.prompt_tokens += st.get("prompt_n", 0)
        s.cached_tokens += st.get("cached_n", 0)
        encode = st.get("image_encode_ms", 0.0)
        s.encode_ms += encode
        s.engine_ms += st.get("prompt_ms", 0.0) - encode + st.get("predicted_ms", 0.0)

    def _write(self, res: CaptionResult) -> CaptionResult:
        """Stage the deliverable (a failure there fails this image), append the record, then
        complete the deliverable."""
        rec = res.record
        assert rec is not None
        t0 = time.perf_counter()
        commit = None
        try:
            commit = self.deliverable.stage(rec)
        except OSError as exc:  # e.g. the image's folder is read-only
            rec = rec.with_(
                caption=None, text=None, error=f"cannot write {rec.target} ({exc.strerror or exc})", error_kind="io"
            )
            res = replace(res, status="failed", record=rec)
        try:
            self.log.append(rec)
            if commit is not None:
                commit()
        except OSError as exc:
            raise OutputError(f"{self.out}: cannot write ({exc.strerror or exc})") from None
        self.summary.write_ms += (time.perf_counter() - t0) * 1000
        return res

    def _finish(self) -> None:
        try:
            self.deliverable.finish()
            if self.index.superseded:  # records of files that changed since: replaced now
                self.log.remove(self.index.superseded)
                self.index.superseded.clear()
        except OSError as exc:
            raise OutputError(f"{self.out}: cannot update ({exc.strerror or exc})") from None

    def close(self) -> None:
        try:
            self.log.close()
        except OSError as exc:  # the last Parquet shard
            raise OutputError(f"{self.out}: cannot write ({exc.strerror or exc})") from None

    def __enter__(self) -> CaptionJob:
        return self.open()

    def __exit__(self, *exc: Any) -> None:
        self.close()
