"""Where captions go, written so that a run killed at any moment leaves valid files.

- ``RecordLog``: the record file (JSONL, or CSV). Each record is appended with one ``write``
  on an ``O_APPEND`` descriptor and ``fsync``-ed before the next image starts; the file is
  locked (``flock``) while a run writes it. On open, a torn last record (power loss, a kill
  between pages of a large write) is cut off, and the records already there index what is done.
- ``Sidecars`` (``--format txt``): ``<image stem>.txt`` next to each image, written through a
  temporary file and ``rename``. The record goes to the log *first*; a sidecar a kill left
  unwritten is written on the next run (``recover``).
- ``Metadata`` (``--format metadata``): Hugging Face imagefolder ``metadata.jsonl``
  (``file_name``, ``text``), rewritten whole (temporary file + ``rename``) every few seconds and
  at the end; the log is the truth it is rebuilt from.
"""

from __future__ import annotations

import csv
import fcntl
import io
import json
import os
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .caption_inputs import InputItem
from .errors import EdgeVLMError, InputError

ERROR_KINDS = ("input", "io", "context", "runtime")  # io and runtime errors are retried by a rerun
_MARK = b'{"custom_id"'  # how every JSONL record starts


class OutputError(EdgeVLMError):
    """A caption file could not be written (disk full, permissions): the run stops (exit 1)."""


@dataclass
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
    notes: list[str] = field(default_factory=list)
    target: str | None = None  # sidecar path or metadata file_name (txt / metadata formats)
    existing: str | None = None  # the caption that was there before (txt / metadata formats)
    text: str | None = None  # what was written there (existing caption combined per --existing)
    created: str = ""

    @property
    def ok(self) -> bool:
        return self.error is None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "custom_id": self.custom_id, "path": self.path, "sha256": self.sha256,
            "caption": self.caption, "error": self.error, "error_kind": self.error_kind,
            "model": self.model, "prompt": self.prompt, "image_tokens": self.image_tokens,
            "width": self.width, "height": self.height, "stats": self.stats,
            "settings": self.settings, "bytes": self.bytes, "mtime_ns": self.mtime_ns,
            "created": self.created,
        }
        for key in ("raw_caption", "target", "existing", "text"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.notes:
            d["notes"] = list(self.notes)
        return d


CSV_COLUMNS = ["custom_id", "path", "sha256", "caption", "error", "error_kind", "model", "prompt",
               "image_tokens", "width", "height", "prompt_n", "cached_n", "predicted_n", "total_ms",
               "finish_reason", "settings", "bytes", "mtime_ns", "created"]
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
    for col, val in zip(CSV_COLUMNS, row):
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
            view = view[os.write(fd, view):]
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


def _write_all(fd: int, data: bytes) -> None:
    """One ``write`` (looped only if the kernel writes less); a failure cuts the file back."""
    start = os.fstat(fd).st_size
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except OSError:
        try:
            os.ftruncate(fd, start)
        except OSError:
            pass
        raise


class RecordLog:
    """The append-only record file of a run (``jsonl`` or ``csv``)."""

    def __init__(self, path: str, fmt: str = "jsonl"):
        self.path = path
        self.fmt = fmt
        self.fd: int | None = None
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
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o666)
        except OSError as exc:
            raise InputError(f"{self.path}: cannot open for writing ({exc.strerror or exc})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise InputError(f"{self.path}: another edgevlm caption run is writing it") from None
        self.fd = fd
        if created:
            fsync_dir(d)
        data = b""
        with open(self.path, "rb") as fh:
            data = fh.read()
        keep = self._parse(data)
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

    def _parse(self, data: bytes) -> int:
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
            if isinstance(obj, dict) and "custom_id" in obj and "path" in obj:
                self.entries.append(Entry(obj, raw))
                recognised = True
            else:
                self.invalid_lines += 1
                self.entries.append(Entry({}, raw))
        tail = data[end:]
        torn_ok = tail.startswith(_MARK) or _MARK.startswith(tail[:len(_MARK)])
        if (data[:end].strip() and not recognised) or not torn_ok:
            raise InputError(f"{self.path}: exists and is not a caption file (choose another --out)")
        return end

    def _parse_csv(self, data: bytes) -> int:
        header = self._csv_header()
        if not data:
            return 0
        if not data.startswith(header):
            if header.startswith(data):  # a torn header: start over
                return 0
            raise InputError(f"{self.path}: exists and is not a caption CSV written by edgevlm "
                             "(choose another --out)")
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
    def append(self, rec: CaptionRecord) -> None:
        assert self.fd is not None, "open() the log first"
        if self.fmt == "csv":
            data = csv_row(rec)
        else:
            data = (json.dumps(rec.to_dict(), ensure_ascii=False) + "\n").encode("utf-8")
        _write_all(self.fd, data)

    def rewrite(self, keep: Iterable[Entry]) -> None:
        """Replace the file with ``keep`` (atomic), then hold the lock on the new file."""
        assert self.fd is not None
        keep = list(keep)
        body = b"".join(e.raw for e in keep)
        if self.fmt == "csv":
            body = self._csv_header() + body
        atomic_write(self.path, body)
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(self.fd)
        self.fd = fd
        self.entries = keep

    def remove(self, drop: Iterable[Entry]) -> int:
        """Rewrite the file without the records in ``drop`` (as the file is now, records
        appended since ``open`` included); returns how many went."""
        gone = Counter(e.raw for e in drop)  # the earliest copies go, should a line repeat
        with open(self.path, "rb") as fh:
            data = fh.read()
        now = RecordLog(self.path, self.fmt)
        now._parse(data)
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
    def peek(cls, path: str, fmt: str = "jsonl") -> list[Entry]:
        """The records in ``path`` without locking or repairing it ([] if there is none)."""
        log = cls(path, fmt)
        try:
            with open(path, "rb") as fh:
                log._parse(fh.read())
        except (OSError, InputError):
            return []
        return log.entries

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


# --- deliverables beside the log ---------------------------------------------------------------
def compose(existing: str | None, caption: str, policy: str, separator: str) -> str:
    """The text to write given what was there: overwrite/skip → caption; append/prepend join."""
    old = (existing or "").strip()
    if not old or policy in ("overwrite", "skip"):
        return caption
    return old + separator + caption if policy == "append" else caption + separator + old


def _read_text(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read()
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None


class Plain:
    """``jsonl`` / ``csv``: nothing beside the log. ``{existing}`` reads a sidecar if present."""

    kind = "plain"

    def __init__(self, policy: str = "overwrite", separator: str = " ", ext: str = ".txt"):
        self.policy = policy
        self.separator = separator
        self.ext = ext

    def sidecar(self, item: InputItem) -> str:
        return os.path.splitext(item.path)[0] + self.ext

    def prepare(self, items: list[InputItem]) -> dict[str, str]:
        """Inputs that cannot be written (path → error message)."""
        return {}

    def target(self, item: InputItem) -> str | None:
        return None

    def existing(self, item: InputItem) -> str | None:
        text = _read_text(self.sidecar(item))
        return text if text and text.strip() else None

    def skip_reason(self, item: InputItem) -> str | None:
        return None

    def stage(self, rec: CaptionRecord) -> Callable[[], None] | None:
        """Do the part of writing ``rec`` that can fail on the image's account (before the log
        has the record); returns what completes it after the log append."""
        return None

    def recover(self, entries: list[Entry]) -> int:
        return 0

    def finish(self) -> None:
        pass


class Sidecars(Plain):
    """``--format txt``: ``<stem>.txt`` next to each image, per ``--existing``."""

    kind = "txt"

    def prepare(self, items: list[InputItem]) -> dict[str, str]:
        owner: dict[str, str] = {}
        bad: dict[str, str] = {}
        for it in items:
            t = os.path.normcase(os.path.abspath(self.sidecar(it)))
            if t == os.path.normcase(os.path.abspath(it.path)):
                bad[it.path] = f"its caption file would be the image itself ({self.ext})"
            elif t in owner:
                bad[it.path] = (f"its caption file {self.sidecar(it)} is also the caption file of "
                                f"{owner[t]}; rename one of them")
            else:
                owner[t] = it.path
        return bad

    def target(self, item: InputItem) -> str | None:
        return self.sidecar(item)

    def skip_reason(self, item: InputItem) -> str | None:
        if self.policy == "skip" and self.existing(item) is not None:
            return "has a caption file"
        return None

    def stage(self, rec: CaptionRecord) -> Callable[[], None] | None:
        if not (rec.ok and rec.target and rec.text is not None):
            return None
        target = rec.target
        tmp = stage_file(target, rec.text.encode("utf-8"))
        return lambda: commit_file(tmp, target)

    def recover(self, entries: list[Entry]) -> int:
        """Write the sidecars a killed run logged but did not write; returns how many."""
        latest: dict[str, dict] = {}
        for e in entries:
            if e.data.get("target") and e.data.get("text") is not None and not e.data.get("error"):
                latest[e.data["target"]] = e.data
        fixed = 0
        for target, d in latest.items():
            now = _read_text(target)
            if now == d["text"]:
                continue
            untouched = now == d.get("existing") or ((now is None or not now.strip()) and not d.get("existing"))
            if untouched:
                atomic_write(target, d["text"].encode("utf-8"))
                fixed += 1
        return fixed


class Metadata(Plain):
    """``--format metadata``: ``metadata.jsonl`` with ``file_name`` and ``text`` under ``root``."""

    kind = "metadata"
    FLUSH_SECONDS = 30.0

    def __init__(self, root: str, policy: str = "skip", separator: str = " ", ext: str = ".txt"):
        super().__init__(policy, separator, ext)
        self.root = root
        self.path = os.path.join(root, "metadata.jsonl")
        self.rows: dict[str, dict] = {}
        self.dirty = False
        self.last_flush = time.monotonic()
        text = _read_text(self.path)
        for n, line in enumerate((text or "").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if not isinstance(row, dict) or "file_name" not in row:
                raise InputError(f"{self.path}: line {n} is not a metadata record with file_name; "
                                 "fix it or choose another --root")
            self.rows[str(row["file_name"])] = row

    def file_name(self, item: InputItem) -> str | None:
        rel = os.path.relpath(os.path.abspath(item.path), os.path.abspath(self.root))
        return None if rel.startswith("..") else rel.replace(os.sep, "/")

    def prepare(self, items: list[InputItem]) -> dict[str, str]:
        return {it.path: f"not under --root {self.root}, so metadata.jsonl cannot name it"
                for it in items if self.file_name(it) is None}

    def target(self, item: InputItem) -> str | None:
        return self.file_name(item)

    def existing(self, item: InputItem) -> str | None:
        row = self.rows.get(self.file_name(item) or "")
        text = row.get("text") if row else None
        return text if isinstance(text, str) and text.strip() else None

    def skip_reason(self, item: InputItem) -> str | None:
        if self.policy == "skip" and self.existing(item) is not None:
            return "has a caption in metadata.jsonl"
        return None

    def _set(self, file_name: str, text: str) -> None:
        row = self.rows.get(file_name)
        if row is None or row.get("text") != text:
            self.rows[file_name] = {**(row or {}), "file_name": file_name, "text": text}
            self.dirty = True

    def stage(self, rec: CaptionRecord) -> Callable[[], None] | None:
        if not (rec.ok and rec.target and rec.text is not None):
            return None
        target, text = rec.target, rec.text

        def commit() -> None:
            self._set(target, text)
            if time.monotonic() - self.last_flush >= self.FLUSH_SECONDS:
                self.flush()
        return commit

    def recover(self, entries: list[Entry]) -> int:
        before = self.dirty
        self.dirty = False
        for e in entries:
            d = e.data
            if d.get("target") and d.get("text") is not None and not d.get("error"):
                self._set(d["target"], d["text"])
        fixed = int(self.dirty)
        self.dirty = self.dirty or before
        if self.dirty:
            self.flush()
        return fixed

    def flush(self) -> None:
        body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in self.rows.values())
        os.makedirs(self.root or ".", exist_ok=True)
        atomic_write(self.path, body.encode("utf-8"))
        self.dirty = False
        self.last_flush = time.monotonic()

    def finish(self) -> None:
        if self.dirty:
            self.flush()
