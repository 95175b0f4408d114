"""A caption run's records: ``CaptionRecord`` (one image's outcome), its CSV form, and
``CAPTION_RECORDS``, the kind of record log (``jobs.records.RecordLog``) a run writes them to.
Files beside the log (sidecars, metadata.jsonl) are in ``caption.sidecars``.
"""

from __future__ import annotations

import csv
import io
from dataclasses import dataclass, replace
from typing import Any

from ..jobs.records import CsvForm, LogKind

__all__ = [
    "CAPTION_RECORDS",
    "CSV_COLUMNS",
    "ERROR_KINDS",
    "CaptionRecord",
    "csv_row",
]

# io and runtime errors are retried by a rerun; output: the answer did not parse (--json-schema)
ERROR_KINDS = ("input", "io", "context", "runtime", "output")


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


CAPTION_RECORDS = LogKind(
    b'{"custom_id"',
    ("custom_id", "path"),
    "caption file",
    "edgevlm caption run",
    CsvForm(tuple(CSV_COLUMNS), csv_row, _csv_dict, "caption CSV"),
)
