"""The record log of a caption run, written so that a kill at any moment leaves a valid file.

``RecordLog`` is the JSONL (or CSV) file of ``CaptionRecord``s. Each record is appended with one
``write`` on an ``O_APPEND`` descriptor and ``fsync``-ed before the next image starts; the file
is locked while a run writes it (``filelock``: ``flock`` on POSIX, ``msvcrt`` on Windows, on a
hidden ``.NAME.lock`` beside it; the system drops the lock when a killed run dies). On open, a torn
last record (power loss, a kill
between the pages of a large write) is cut off, and the records already there say what is done.
Files beside the log (sidecars, metadata.jsonl) are in ``caption_sidecars``.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from filelock import FileLock, Timeout

from ..errors import InputError

__all__ = [
    "BATCH_LINES",
    "CAPTION_RECORDS",
    "CSV_COLUMNS",
    "ERROR_KINDS",
    "CaptionRecord",
    "Entry",
    "LogKind",
    "RecordLog",
    "atomic_write",
    "commit_file",
    "csv_row",
    "fsync_dir",
    "lock_path",
    "stage_file",
    "take_lock",
]

# io and runtime errors are retried by a rerun; output: the answer did not parse (--json-schema)
ERROR_KINDS = ("input", "io", "context", "runtime", "output")


@dataclass(frozen=True)
class LogKind:
    """What a log's JSONL lines are: how each starts (a torn tail is recognised by it), the keys
    every one has, and what to call the file in messages."""

    mark: bytes
    keys: tuple[str, ...]
    what: str
    writer: str  # who holds the lock, for the "is writing it" message


CAPTION_RECORDS = LogKind(b'{"custom_id"', ("custom_id", "path"), "caption file", "edgevlm caption run")
BATCH_LINES = LogKind(b'{"id"', ("id", "custom_id"), "batch output file", "edgevlm batch run")


@dataclass(frozen=True)
class CaptionRecord:
    """One image's outcome: a caption, or an error (``caption`` None, ``error`` set)."""

    custom_id: str
    path: str
    sha256: str | None
    caption: str | None
    model: str
    prompt: str | None
    settings: str  # digest of everything that shapes the caption (see CaptionSettings.digest)
    image_tokens: int | None = None
    stats: dict[str, Any] | None = None
    error: str | None = None
    error_kind: str | None = None  # one of ERROR_KINDS
    width: int | None = None
    height: int | None = None
    bytes: int | None = None
    mtime_ns: int | None = None
    raw_caption: str | None = None  # the model's words, when --clean/--prefix/--suffix changed them
    json: Any = None  # --json-schema: the object the answer holds
    notes: tuple[str, ...] = ()
    target: str | None = None  # sidecar path or metadata file_name (txt / metadata formats)
    existing: str | None = None  # the caption that was there before (txt / metadata formats)
    text: str | None = None  # what was written there (existing caption combined per --existing)
    created: str = ""
    frames: tuple[float, ...] | None = None  # a video: the seconds of the frames the model saw

    @property
    def ok(self) -> bool:
        return self.error is None

    def with_(self, **changes: Any) -> CaptionRecord:
        """This record with ``changes`` (records are frozen: what is written is what was made)."""
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "custom_id": self.custom_id,
            "path": self.path,
            "sha256": self.sha256,
            "caption": self.caption,
            "error": self.error,
            "error_kind": self.error_kind,
            "model": self.model,
            "prompt": self.prompt,
            "image_tokens": self.image_tokens,
            "width": self.width,
            "height": self.height,
            "stats": self.stats,
            "settings": self.settings,
            "bytes": self.bytes,
            "mtime_ns": self.mtime_ns,
            "created": self.created,
        }
        for key in ("raw_caption", "json", "target", "existing", "text"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.frames is not None:
            d["frames"] = list(self.frames)
        if self.notes:
            d["notes"] = list(self.notes)
        return d


CSV_COLUMNS = [
    "custom_id",
    "path",
    "sha256",
    "caption",
    "error",
    "error_kind",
    "model",
    "prompt",
    "image_tokens",
    "width",
    "height",
    "prompt_n",
    "cached_n",
    "predicted_n",
    "total_ms",
    "finish_reason",
    "settings",
    "bytes",
    "mtime_ns",
    "created",
]
_CSV_INTS = {"image_tokens", "width", "height", "prompt_n", "cached_n", "predicted_n", "bytes", "mtime_ns"}
_STATS_COLS = ("prompt_n", "cached_n", "predicted_n", "total_ms", "finish_reason")


def csv_row(rec: CaptionRecord) -> bytes:
    d = rec.to_dict()
    stats = rec.stats or {}
    row = [d.get(c) if c not in _STATS_COLS else stats.get(c) for c in CSV_COLUMNS]
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(["" if v is None else v for v in row])
    return buf.getvalue().encode("utf-8")


def _csv_dict(row: list[str]) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for col, val in zip(CSV_COLUMNS, row, strict=True):
        if val == "":
            d[col] = None
        elif col in _CSV_INTS:
            try:
                d[col] = int(val)
            except ValueError:
                d[col] = None
        else:
            d[col] = val
    return d


@dataclass
class Entry:
    """A record already in the log: its fields and its exact bytes (kept when compacting)."""

    data: dict[str, Any]
    raw: bytes


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def lock_path(path: str) -> str:
    """The lock file guarding ``path``: hidden, beside it."""
    d, base = os.path.split(path)
    return os.path.join(d, f".{base}.lock")


def stage_file(path: str, data: bytes) -> str:
    """Write ``data`` to a temporary file beside ``path`` (fsync-ed); returns its name."""
    d, base = os.path.split(path)
    tmp = os.path.join(d, f".{base}.edgevlm-tmp")
    mode = 0o666
    try:
        mode = os.stat(path).st_mode & 0o7777
    except OSError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    finally:
        os.close(fd)
    return tmp


def commit_file(tmp: str, path: str) -> None:
    """Rename a staged file over ``path`` and make the rename durable."""
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))


def atomic_write(path: str, data: bytes) -> None:
    """Replace ``path`` with ``data``: temporary file in the same directory, fsync, rename."""
    commit_file(stage_file(path, data), path)


def take_lock(lock: FileLock, path: str, writer: str) -> None:
    """Lock ``path`` for this run, or say in one line why not (another run has it)."""
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise InputError(f"{path}: another {writer} is writing it") from None
    except OSError as exc:
        raise InputError(f"{path}: cannot lock ({exc.strerror or exc})") from None


def _write_all(fd: int, data: bytes) -> None:
    """One ``write`` (looped only if the kernel writes less); a failure cuts the file back."""
    start = os.fstat(fd).st_size
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
    except OSError:
        try:
            os.ftruncate(fd, start)
        except OSError:
            pass
        raise


class RecordLog:
    """The append-only record file of a run (``jsonl`` or ``csv``): caption records, or (with
    ``kind=BATCH_LINES``) the output lines of an OpenAI batch file."""

    def __init__(self, path: str, fmt: str = "jsonl", kind: LogKind = CAPTION_RECORDS):
        self.path = path
        self.fmt = fmt
        self.kind = kind
        self.fd: int | None = None
        self.lock = FileLock(lock_path(path))
        self.entries: list[Entry] = []
        self.repaired_bytes = 0  # torn tail cut off on open
        self.invalid_lines = 0  # lines that are not records (kept, ignored)

    # --- open / read ---------------------------------------------------------------------
    def open(self) -> RecordLog:
        d = os.path.dirname(self.path)
        if d:
            os.makedirs(d, exist_ok=True)
        if os.path.isdir(self.path):
            raise InputError(f"{self.path}: is a directory (--out names the caption file)")
        created = not os.path.exists(self.path)
        take_lock(self.lock, self.path, self.kind.writer)
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND | getattr(os, "O_BINARY", 0), 0o666)
        except OSError as exc:
            self.lock.release()
            raise InputError(f"{self.path}: cannot open for writing ({exc.strerror or exc})") from None
        self.fd = fd
        if created:
            fsync_dir(d)
        data = b""
        with open(self.path, "rb") as fh:
            data = fh.read()
        keep = self.parse(data)
        if keep < len(data):
            os.ftruncate(fd, keep)
            os.fsync(fd)
            self.repaired_bytes = len(data) - keep
        if self.fmt == "csv" and keep == 0:
            _write_all(fd, self._csv_header())
        return self

    def _csv_header(self) -> bytes:
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerow(CSV_COLUMNS)
        return buf.getvalue().encode()

    def parse(self, data: bytes) -> int:
        """Index the records in ``data``; returns how many bytes are whole records."""
        return self._parse_csv(data) if self.fmt == "csv" else self._parse_jsonl(data)

    def _parse_jsonl(self, data: bytes) -> int:
        end = data.rfind(b"\n") + 1
        recognised = False
        for raw in data[:end].splitlines(keepends=True):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except ValueError:
                obj = None
            if isinstance(obj, dict) and all(k in obj for k in self.kind.keys):
                self.entries.append(Entry(obj, raw))
                recognised = True
            else:
                self.invalid_lines += 1
                self.entries.append(Entry({}, raw))
        tail = data[end:]
        mark = self.kind.mark
        torn_ok = tail.startswith(mark) or mark.startswith(tail[: len(mark)])
        if (data[:end].strip() and not recognised) or not torn_ok:
            raise InputError(f"{self.path}: exists and is not a {self.kind.what} (choose another --out)")
        return end

    def _parse_csv(self, data: bytes) -> int:
        header = self._csv_header()
        if not data:
            return 0
        if not data.startswith(header):
            if header.startswith(data):  # a torn header: start over
                return 0
            raise InputError(f"{self.path}: exists and is not a caption CSV written by edgevlm (choose another --out)")
        # A record ends at a newline outside quotes: an even number of '"' since its start.
        pos = len(header)
        start = pos
        quotes = 0
        end = pos
        while True:
            nl = data.find(b"\n", pos)
            if nl < 0:
                break
            quotes += data.count(b'"', pos, nl)
            pos = nl + 1
            if quotes % 2 == 0:
                raw = data[start:pos]
                row = next(csv.reader(io.StringIO(raw.decode("utf-8", "replace"))), [])
                if len(row) == len(CSV_COLUMNS):
                    self.entries.append(Entry(_csv_dict(row), raw))
                else:
                    self.invalid_lines += 1
                    self.entries.append(Entry({}, raw))
                start = end = pos
                quotes = 0
        return end

    # --- write ---------------------------------------------------------------------------
    def _line(self, rec: CaptionRecord | dict[str, Any]) -> bytes:
        if self.fmt == "csv":
            assert isinstance(rec, CaptionRecord)
            return csv_row(rec)
        d = rec if isinstance(rec, dict) else rec.to_dict()
        return (json.dumps(d, ensure_ascii=False) + "\n").encode("utf-8")

    def append(self, rec: CaptionRecord | dict[str, Any]) -> None:
        """One record (a ``CaptionRecord``, or a line's dict), on disk when this returns."""
        self.append_many([rec])

    def append_many(self, recs: Iterable[CaptionRecord | dict[str, Any]]) -> None:
        """Several records in one write and one fsync (each line whole; a kill keeps a prefix)."""
        assert self.fd is not None, "open() the log first"
        data = b"".join(self._line(r) for r in recs)
        if data:
            _write_all(self.fd, data)

    def rewrite(self, keep: Iterable[Entry]) -> None:
        """Replace the file with ``keep`` (atomic; the lock stays held)."""
        assert self.fd is not None
        keep = list(keep)
        body = b"".join(e.raw for e in keep)
        if self.fmt == "csv":
            body = self._csv_header() + body
        os.close(self.fd)  # Windows renames over no open file
        self.fd = None
        atomic_write(self.path, body)
        self.fd = os.open(self.path, os.O_RDWR | os.O_APPEND | getattr(os, "O_BINARY", 0))
        self.entries = keep

    def remove(self, drop: Iterable[Entry]) -> int:
        """Rewrite the file without the records in ``drop`` (as the file is now, records
        appended since ``open`` included); returns how many went."""
        gone = Counter(e.raw for e in drop)  # the earliest copies go, should a line repeat
        with open(self.path, "rb") as fh:
            data = fh.read()
        now = RecordLog(self.path, self.fmt, self.kind)
        now.parse(data)
        keep = []
        for e in now.entries:
            if gone[e.raw] > 0:
                gone[e.raw] -= 1
            else:
                keep.append(e)
        if len(keep) < len(now.entries):
            self.rewrite(keep)
        return len(now.entries) - len(keep)

    @classmethod
    def peek(cls, path: str, fmt: str = "jsonl", kind: LogKind = CAPTION_RECORDS) -> list[Entry]:
        """The records in ``path`` without locking or repairing it ([] if there is none)."""
        log = cls(path, fmt, kind)
        try:
            with open(path, "rb") as fh:
                log.parse(fh.read())
        except (OSError, InputError):
            return []
        return log.entries

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.lock.is_locked:
            self.lock.release()
