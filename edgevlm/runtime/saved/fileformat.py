"""The saved-conversation file: one format for ``chat --session`` and the server's disk tier.

::

    magic      12 bytes  b"EDGEVLM\\0CONV"
    format      4 bytes  little-endian u32 (``FORMAT``)
    header_len  8 bytes  little-endian u64
    header      JSON (UTF-8): what made the file (``binding``), what it holds, and
                ``sections``: [[name, length], ...] — the byte sections that follow, in order
    sections    the views' PNGs, then ``kv``: llama.cpp's copy of the sequence's cells
    checksum   32 bytes  sha256 of everything before it

Written atomically: a temporary file beside the target (named with the writer's process id),
flushed to disk, then renamed over it — a process killed while saving leaves the previous file
as it was, and the next save of that file removes what the dead one left. Reading checks the magic, the
format, the size and the checksum before anything is used; each failure is one line naming the
file (``SavedStateError``).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import OutputError, SavedStateError

__all__ = ["FORMAT", "MAGIC", "SavedFile", "fsync_dir", "load_saved", "read_header", "saved_size", "write_saved"]

MAGIC = b"EDGEVLM\0CONV"
FORMAT = 1  # raised when a reader of the previous format would misread a file
_PRELUDE = struct.Struct("<12sIQ")
_SUM = 32
HEADER_MAX = 256 * 2**20  # a header past this is not one edgevlm wrote


@dataclass(frozen=True)
class SavedFile:
    """A file read whole and checked: its header and its sections by name."""

    path: str
    header: dict[str, Any]
    sections: dict[str, memoryview]  # views of one buffer: the file is read once, never copied
    size: int


def _header_bytes(header: dict[str, Any], sections: Sequence[tuple[str, bytes]]) -> bytes:
    full = {**header, "sections": [[name, len(data)] for name, data in sections]}
    return json.dumps(full, ensure_ascii=False, separators=(",", ":")).encode()


def saved_size(header: dict[str, Any], sections: Sequence[tuple[str, bytes]]) -> int:
    """Bytes the file of ``header`` and ``sections`` takes on disk."""
    return _PRELUDE.size + len(_header_bytes(header, sections)) + sum(len(d) for _, d in sections) + _SUM


def write_saved(path: str, header: dict[str, Any], sections: Sequence[tuple[str, bytes]]) -> int:
    """Write the file atomically (its size checked against the free disk first); returns its size."""
    path = os.path.abspath(path)
    folder = os.path.dirname(path)
    head = _header_bytes(header, sections)
    size = _PRELUDE.size + len(head) + sum(len(d) for _, d in sections) + _SUM
    try:
        os.makedirs(folder, exist_ok=True)
        free = shutil.disk_usage(folder).free
    except OSError as exc:
        raise OutputError(f"{path}: cannot save there ({exc.strerror or exc})") from None
    if size > free:
        raise OutputError(f"{path}: saving needs {size / 2**20:,.1f} MiB, the disk has {free / 2**20:,.1f} MiB free")
    _clear_dead(folder, os.path.basename(path))
    digest = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.{os.getpid()}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            for part in (_PRELUDE.pack(MAGIC, FORMAT, len(head)), head, *(d for _, d in sections)):
                digest.update(part)
                f.write(part)
            f.write(digest.digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise OutputError(f"{path}: cannot save ({exc.strerror or exc})") from None
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(folder)
    return size


def _clear_dead(folder: str, name: str) -> None:
    """Remove temporary files of ``name`` left by saves whose process died (killed mid-save):
    their names carry the writer's process id."""
    import psutil

    prefix = f".{name}."
    try:
        entries = [e for e in os.listdir(folder) if e.startswith(prefix) and e.endswith(".tmp")]
    except OSError:
        return
    for entry in entries:
        pid = entry[len(prefix) :].split(".", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not psutil.pid_exists(int(pid)):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, entry))


def fsync_dir(folder: str) -> None:
    """A rename or a new file in ``folder`` on disk (POSIX; elsewhere as durable as the system
    makes it)."""
    if os.name != "posix":
        return
    try:
        fd = os.open(folder or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _prelude(path: str, data: bytes, total: int) -> tuple[int, dict[str, Any], int]:
    """(format, header, where the sections start) from the file's first bytes."""
    if len(data) < _PRELUDE.size or data[: len(MAGIC)] != MAGIC:
        raise SavedStateError(f"{path}: not an edgevlm saved conversation")
    _, fmt, head_len = _PRELUDE.unpack_from(data)
    if fmt > FORMAT:
        raise SavedStateError(
            f"{path}: saved by a newer edgevlm (format {fmt}; this one reads format {FORMAT}): upgrade edgevlm"
        )
    if fmt < 1 or head_len > HEADER_MAX:
        raise SavedStateError(f"{path}: corrupted (its prelude is not one edgevlm writes)")
    start = _PRELUDE.size + head_len
    if total < start + _SUM:
        raise SavedStateError(f"{path}: truncated ({total:,} bytes, its header alone needs {start + _SUM:,})")
    if len(data) < start:
        raise SavedStateError(f"{path}: truncated")
    try:
        header = json.loads(data[_PRELUDE.size : start])
        if not isinstance(header, dict) or not isinstance(header.get("sections"), list):
            raise ValueError
    except ValueError:
        raise SavedStateError(f"{path}: corrupted (its header is not readable)") from None
    return fmt, header, start


def read_header(path: str) -> dict[str, Any]:
    """The header alone (what the file is bound to, what it holds), without reading the rest:
    the size is checked, the checksum only by ``load_saved``."""
    try:
        with open(path, "rb") as f:
            total = os.fstat(f.fileno()).st_size
            first = f.read(_PRELUDE.size)
            if len(first) == _PRELUDE.size and first[: len(MAGIC)] == MAGIC:
                head_len = _PRELUDE.unpack_from(first)[2]
                first += f.read(min(head_len, HEADER_MAX))
    except FileNotFoundError:
        raise SavedStateError(f"{path}: no such file") from None
    except OSError as exc:
        raise SavedStateError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    _, header, start = _prelude(path, first, total)
    _check_length(path, header, start, total)
    return header


def _check_length(path: str, header: dict[str, Any], start: int, total: int) -> None:
    try:
        body = sum(int(n) for _, n in header["sections"])
    except (TypeError, ValueError):
        raise SavedStateError(f"{path}: corrupted (its header is not readable)") from None
    if total != start + body + _SUM:
        what = "truncated" if total < start + body + _SUM else "corrupted (longer than its header says)"
        raise SavedStateError(f"{path}: {what} ({total:,} bytes, its header says {start + body + _SUM:,})")


def load_saved(path: str) -> SavedFile:
    """Read and check the whole file: magic, format, size, checksum."""
    try:
        with open(path, "rb") as f:
            data = bytearray(os.fstat(f.fileno()).st_size)
            got = f.readinto(data)
            del data[got:]
    except FileNotFoundError:
        raise SavedStateError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise SavedStateError(f"{path}: a folder, not a saved conversation") from None
    except OSError as exc:
        raise SavedStateError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    view = memoryview(data)
    head_len = _PRELUDE.unpack_from(view)[2] if len(view) >= _PRELUDE.size else 0
    _, header, start = _prelude(path, bytes(view[: _PRELUDE.size + min(head_len, HEADER_MAX)]), len(data))
    _check_length(path, header, start, len(data))
    if hashlib.sha256(view[: len(data) - _SUM]).digest() != view[len(data) - _SUM :]:
        raise SavedStateError(f"{path}: corrupted (its checksum does not match its contents)")
    sections: dict[str, memoryview] = {}
    at = start
    for name, n in header["sections"]:
        sections[str(name)] = view[at : at + int(n)]
        at += int(n)
    return SavedFile(path, header, sections, len(data))
