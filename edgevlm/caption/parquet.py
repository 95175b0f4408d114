"""Caption records as Parquet shards (``--format parquet``): a folder of ``part-NNNNNN.parquet``
files that pandas, pyarrow, Ray Data, DuckDB and ``datasets`` read as one table.

Records are gathered in memory and written as a shard every ``rows_per_shard`` records or
``flush_s`` seconds (and at the end): each shard is written to a hidden temporary file, fsync-ed
and renamed into place, so a shard on disk is always whole. A kill loses at most the records not
yet in a shard; a rerun captions those images again (resume reads every shard). The folder is
locked while a run writes it, like the JSONL log. Columns are the JSONL record's keys; ``stats``
and ``json`` hold JSON text (their shape varies from record to record).

pyarrow comes with ``pip install 'edgevlm[parquet]'`` (or ``[ray]``).
"""

from __future__ import annotations

import glob
import io
import json
import os
import re
import time
from collections.abc import Iterable
from typing import Any

from filelock import FileLock

from ..errors import InputError
from ..jobs.records import Entry, commit_file, fsync_dir, lock_path, stage_file, take_lock
from .outputs import CaptionRecord

__all__ = ["PARQUET_COLUMNS", "ParquetLog", "parquet_row", "pyarrow_module", "read_records"]

_STR, _INT, _JSON, _LIST = "string", "int64", "json", "list"
PARQUET_COLUMNS: dict[str, str] = {
    "custom_id": _STR,
    "path": _STR,
    "sha256": _STR,
    "caption": _STR,
    "error": _STR,
    "error_kind": _STR,
    "model": _STR,
    "prompt": _STR,
    "image_tokens": _INT,
    "width": _INT,
    "height": _INT,
    "stats": _JSON,
    "settings": _STR,
    "bytes": _INT,
    "mtime_ns": _INT,
    "created": _STR,
    "raw_caption": _STR,
    "json": _JSON,
    "notes": _LIST,
    "target": _STR,
    "existing": _STR,
    "text": _STR,
}
_OPTIONAL = ("raw_caption", "json", "target", "existing", "text")  # absent from JSONL records when None
_SHARD = re.compile(r"^part-(\d{6,})\.parquet$")


def pyarrow_module():
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise InputError("--format parquet needs pyarrow: pip install 'edgevlm[parquet]'") from None
    return pyarrow


def _schema(pa):
    types = {_STR: pa.string(), _INT: pa.int64(), _JSON: pa.string(), _LIST: pa.list_(pa.string())}
    return pa.schema([(k, types[t]) for k, t in PARQUET_COLUMNS.items()])


def parquet_row(d: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for k, t in PARQUET_COLUMNS.items():
        v = d.get(k)
        if t == _JSON:
            v = None if v is None else json.dumps(v, ensure_ascii=False)
        elif t == _LIST:
            v = list(v or [])
        out[k] = v
    return out


def _record(row: dict[str, Any]) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for k, t in PARQUET_COLUMNS.items():
        v = row.get(k)
        if t == _JSON and v is not None:
            v = json.loads(v)
        if k in _OPTIONAL and v is None:
            continue
        if k == "notes":
            if v:
                d[k] = list(v)
            continue
        d[k] = v
    return d


def read_records(path: str) -> list[dict[str, Any]]:
    """Every record in a Parquet caption folder (or one shard file), as JSONL-shaped dicts."""
    files = [path] if os.path.isfile(path) else _shards(path)
    out = []
    for f in files:
        out += [_record(r) for r in _read_shard(f)]
    return out


def _shards(folder: str) -> list[str]:
    names = [n for n in os.listdir(folder) if _SHARD.match(n)] if os.path.isdir(folder) else []
    return [os.path.join(folder, n) for n in sorted(names)]


def _read_shard(path: str) -> list[dict[str, Any]]:
    pa = pyarrow_module()
    try:
        table = pa.parquet.read_table(path)
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"{path}: not a readable Parquet file ({exc})") from None
    missing = [k for k in ("custom_id", "path", "settings") if k not in table.column_names]
    if missing:
        raise InputError(f"{path}: not a caption shard (no {', '.join(missing)} column)")
    return table.to_pylist()


class ParquetLog:
    """The record log as a folder of Parquet shards; the same interface as ``RecordLog``."""

    fmt = "parquet"

    def __init__(self, path: str, rows_per_shard: int = 1000, flush_s: float = 30.0):
        self.path = path
        self.rows_per_shard = rows_per_shard
        self.flush_s = flush_s
        self.lock = FileLock(lock_path(path.rstrip("/\\") or path))
        self.entries: list[Entry] = []
        self.repaired_bytes = 0
        self.invalid_lines = 0
        self._shard_of: dict[bytes, str] = {}  # entry key → its shard file
        self._buffer: list[dict[str, Any]] = []
        self._since = 0.0
        self._opened = False
        self._next = 1

    def open(self) -> ParquetLog:
        pyarrow_module()
        if os.path.isfile(self.path):
            raise InputError(
                f"{self.path}: is a file; --format parquet writes a folder of shards (choose another --out)"
            )
        os.makedirs(self.path, exist_ok=True)
        take_lock(self.lock, self.path, "edgevlm caption run")
        self._opened = True
        for tmp in glob.glob(os.path.join(glob.escape(self.path), ".*.edgevlm-tmp")):  # a kill mid-write
            try:
                os.remove(tmp)
            except OSError:
                pass
        try:
            self._load()
        except BaseException:
            self.close()
            raise
        return self

    def _load(self) -> None:
        self.entries, self._shard_of = [], {}
        for f in _shards(self.path):
            m = _SHARD.match(os.path.basename(f))
            assert m is not None  # _shards lists only the names it matches
            self._next = max(self._next, int(m.group(1)) + 1)
            for i, row in enumerate(_read_shard(f)):
                key = f"{os.path.basename(f)}\0{i}".encode()
                self.entries.append(Entry(_record(row), key))
                self._shard_of[key] = f

    def append(self, rec: CaptionRecord | dict[str, Any]) -> None:
        self.append_many([rec])

    def append_many(self, recs: Iterable[CaptionRecord | dict[str, Any]]) -> None:
        assert self._opened, "open() the log first"
        for r in recs:
            if not self._buffer:
                self._since = time.monotonic()
            self._buffer.append(r if isinstance(r, dict) else r.to_dict())
        if len(self._buffer) >= self.rows_per_shard or (
            self._buffer and time.monotonic() - self._since >= self.flush_s
        ):
            self.flush()

    def flush(self) -> None:
        """Write the gathered records as one new shard (atomic)."""
        if not self._buffer:
            return
        rows, self._buffer = self._buffer, []
        name = os.path.join(self.path, f"part-{self._next:06d}.parquet")
        self._write_shard(name, [parquet_row(r) for r in rows])
        self._next += 1

    def _write_shard(self, name: str, rows: list[dict[str, Any]]) -> None:
        pa = pyarrow_module()
        buf = io.BytesIO()
        pa.parquet.write_table(pa.Table.from_pylist(rows, schema=_schema(pa)), buf, compression="zstd")
        commit_file(stage_file(name, buf.getvalue()), name)

    def remove(self, drop: Iterable[Entry]) -> int:
        """Rewrite the shards holding ``drop`` without them; returns how many went."""
        by_shard: dict[str, set[bytes]] = {}
        for e in drop:
            f = self._shard_of.get(e.raw)
            if f is not None:
                by_shard.setdefault(f, set()).add(e.raw)
        gone = 0
        for f, keys in by_shard.items():
            base = os.path.basename(f)
            rows = _read_shard(f)
            keep = [r for i, r in enumerate(rows) if f"{base}\0{i}".encode() not in keys]
            gone += len(rows) - len(keep)
            if keep:
                self._write_shard(f, [parquet_row(_record(r)) for r in keep])
            else:
                os.remove(f)
                fsync_dir(self.path)
        if gone:
            self._load()
        return gone

    @classmethod
    def peek(cls, path: str) -> list[Entry]:
        try:
            return [Entry(r, b"") for r in read_records(path)]
        except (OSError, InputError):
            return []

    def close(self) -> None:
        try:
            if self._opened:
                self.flush()
        finally:
            self._opened = False
            if self.lock.is_locked:
                self.lock.release()
