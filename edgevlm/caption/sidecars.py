"""What a caption run writes beside its record log, per ``--format``.

- ``Plain`` (jsonl / csv): nothing; ``{existing}`` reads ``<stem>.txt`` if there is one.
- ``Sidecars`` (txt): ``<stem>.txt`` next to each image, staged in a temporary file before the
  record is logged and renamed into place after, so a kill leaves the old file or the new one;
  ``recover`` writes what a killed run logged but did not rename.
- ``Metadata``: Hugging Face imagefolder ``metadata.jsonl`` (``file_name``, ``text``, other
  columns kept) under the dataset root, rewritten whole (temporary file + rename, under a lock
  on the folder so shards can share it) every 30 s and at the end; rebuilt from the log on rerun.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

from filelock import FileLock

from ..errors import InputError
from ..jobs.records import Entry, atomic_write, commit_file, lock_path, stage_file
from .inputs import InputItem
from .outputs import CaptionRecord

__all__ = ["Metadata", "Plain", "Sidecars"]


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
                bad[it.path] = (
                    f"its caption file {self.sidecar(it)} is also the caption file of {owner[t]}; rename one of them"
                )
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
        self.rows = self._load()
        self.updates: dict[str, str] = {}  # file_name → text, everything this run decided
        self.dirty = False
        self.last_flush = time.monotonic()

    def _load(self) -> dict[str, dict]:
        rows: dict[str, dict] = {}
        for n, line in enumerate((_read_text(self.path) or "").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if not isinstance(row, dict) or "file_name" not in row:
                raise InputError(
                    f"{self.path}: line {n} is not a metadata record with file_name; fix it or choose another --root"
                )
            rows[str(row["file_name"])] = row
        return rows

    def file_name(self, item: InputItem) -> str | None:
        rel = os.path.relpath(os.path.abspath(item.path), os.path.abspath(self.root))
        return None if rel.startswith("..") else rel.replace(os.sep, "/")

    def prepare(self, items: list[InputItem]) -> dict[str, str]:
        return {
            it.path: f"not under --root {self.root}, so metadata.jsonl cannot name it"
            for it in items
            if self.file_name(it) is None
        }

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
        self.updates[file_name] = text
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
        """Put what the log says into metadata.jsonl (a killed run may not have written it)."""
        before = self.dirty
        self.dirty = False
        for e in entries:
            d = e.data
            if d.get("target") and d.get("text") is not None and not d.get("error"):
                self._set(d["target"], d["text"])
        fixed = int(self.dirty)
        if self.dirty or before:
            self.flush()
        return fixed

    def flush(self) -> None:
        """Rewrite metadata.jsonl: the file as it is now (another shard may have written it),
        with this run's texts applied. The file is locked meanwhile (shards share it)."""
        os.makedirs(self.root or ".", exist_ok=True)
        with FileLock(lock_path(self.path)):
            rows = self._load()
            for name, text in self.updates.items():
                rows[name] = {**rows.get(name, {}), "file_name": name, "text": text}
            body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows.values())
            atomic_write(self.path, body.encode("utf-8"))
            self.rows = rows
        self.dirty = False
        self.last_flush = time.monotonic()

    def finish(self) -> None:
        if self.dirty:
            self.flush()
