"""The record log of a long run, written so that a kill at any moment leaves a valid file.

``RecordLog`` is an append-only JSONL (or CSV) file of records, one line each, of a kind
(``LogKind``): a caption run's records (``caption.outputs``) or a batch file's output lines
(``BATCH_LINES``). Each record is appended with one ``write`` on an ``O_APPEND`` descriptor and
``fsync``-ed before the next one starts; the file is locked while a run writes it (``filelock``:
``flock`` on POSIX, ``msvcrt`` on Windows, on a hidden ``.NAME.lock`` beside it; the system drops
the lock when a killed run dies). On open, a torn last record (power loss, a kill between the
pages of a large write) is cut off, and the records already there say what is done. The file
helpers (stage, commit, lock) serve the files written beside a log too.
"""

from __future__ import annotations

import csv
import io
import json
import os
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from filelock import FileLock, Timeout

from ..errors import InputError
from ..runtime.saved.fileformat import fsync_dir

__all__ = [
    "BATCH_LINES",
    "CsvForm",
    "Entry",
    "LogKind",
    "Record",
    "RecordLog",
    "atomic_write",
    "commit_file",
    "fsync_dir",
    "lock_path",
    "stage_file",
    "take_lock",
]


class Record(Protocol):
    """A record a log writes: its fields as one JSON object."""

    def to_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class LogKind:
    """What a log's JSONL lines are: how each starts (a torn tail is recognised by it), the keys
    every one has, and what to call the file in messages."""

    mark: bytes
    keys: tuple[str, ...]
    what: str
    writer: str  # who holds the lock, for the "is writing it" message
    csv: CsvForm | None = None  # its CSV form, where it has one


@dataclass(frozen=True)
class CsvForm:
    """A log's CSV form: the header, a record as one CSV line, a CSV row as a record's fields."""

    columns: tuple[str, ...]
    row: Callable[[Any], bytes]
    fields: Callable[[list[str]], dict[str, Any]]
    what: str  # what to call the file in messages ("caption CSV")


BATCH_LINES = LogKind(b'{"id"', ("id", "custom_id"), "batch output file", "edgevlm batch run")


@dataclass
class Entry:
    """A record already in the log: its fields and its exact bytes (kept when compacting)."""

    data: dict[str, Any]
    raw: bytes


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
    """The append-only record file of a run (``jsonl``, or ``csv`` where ``kind`` has a CSV
    form): caption records (``caption.outputs.CAPTION_RECORDS``), or the output lines of an
    OpenAI batch file (``BATCH_LINES``)."""

    def __init__(self, path: str, kind: LogKind, fmt: str = "jsonl"):
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

    @property
    def _csv(self) -> CsvForm:
        assert self.kind.csv is not None, f"a {self.kind.what} has no CSV form"
        return self.kind.csv

    def _csv_header(self) -> bytes:
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerow(self._csv.columns)
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
            raise InputError(
                f"{self.path}: exists and is not a {self._csv.what} written by edgevlm (choose another --out)"
            )
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
                if len(row) == len(self._csv.columns):
                    self.entries.append(Entry(self._csv.fields(row), raw))
                else:
                    self.invalid_lines += 1
                    self.entries.append(Entry({}, raw))
                start = end = pos
                quotes = 0
        return end

    # --- write ---------------------------------------------------------------------------
    def _line(self, rec: Record | dict[str, Any]) -> bytes:
        if self.fmt == "csv":
            return self._csv.row(rec)
        d = rec if isinstance(rec, dict) else rec.to_dict()
        return (json.dumps(d, ensure_ascii=False) + "\n").encode("utf-8")

    def append(self, rec: Record | dict[str, Any]) -> None:
        """One record (a ``Record`` such as a ``CaptionRecord``, or a line's dict), on disk when this returns."""
        self.append_many([rec])

    def append_many(self, recs: Iterable[Record | dict[str, Any]]) -> None:
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
        now = RecordLog(self.path, self.kind, self.fmt)
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
    def peek(cls, path: str, kind: LogKind, fmt: str = "jsonl") -> list[Entry]:
        """The records in ``path`` without locking or repairing it ([] if there is none)."""
        log = cls(path, kind, fmt)
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
