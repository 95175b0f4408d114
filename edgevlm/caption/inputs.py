"""The images a caption run works on: files, directories, globs and list files, recognised by
content (not extension), in a stable order, and optionally one shard of N.

Rules (the same for every way of naming inputs):

- a file named explicitly (argument or list entry) is always an input: if it is not an image,
  the run records an error for it;
- inside a directory (or matched by a glob), a file is an input if its first bytes are an image
  signature, or if its extension is an image extension (so ``notes.jpg`` holding text gets an
  error record, while ``README.md`` and caption sidecars are ignored); hidden files and
  directories (``.name``) are skipped;
- directories are entered one level deep, all the way with ``recursive``;
- ``include`` / ``exclude`` are shell patterns, case-insensitive; a pattern with ``/`` matches
  the path below the directory given, one without matches the file name; ``exclude`` also
  prunes directories;
- order: arguments in the order given, each directory's files sorted by path; a file reached
  twice is kept once (first place);
- ``shard (i, n)`` keeps the files whose key (path below the directory given, or the path as
  given) hashes to ``i`` of ``n``: the same split on every machine, stable when files are added.
"""

from __future__ import annotations

import glob
import hashlib
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import IO

from ..errors import InputError
from ..runtime.intake.media import AUDIO_EXTS, looks_like_audio
from ..vision.images import has_image_ext
from ..vision.video import is_video_path, looks_like_video

__all__ = [
    "common_root",
    "discover",
    "Discovery",
    "InputItem",
    "parse_shard",
    "read_head",
    "read_list",
    "shard_of",
    "sniff",
]

_GLOB_CHARS = set("*?[")
_BMP_HEADERS = {12, 40, 52, 56, 64, 108, 124}
_ISO_BRANDS = {b"heic", b"heix", b"hevc", b"hevx", b"heim", b"heis", b"mif1", b"msf1", b"avif", b"avis"}


def sniff(head: bytes) -> str | None:
    """The image format of a file from its first bytes (32 are enough), or None."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if head.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "WEBP"
    if head[:4] in (b"II*\x00", b"MM\x00*", b"II+\x00", b"MM\x00+"):
        return "TIFF"
    if head[:2] == b"BM" and len(head) >= 18 and int.from_bytes(head[14:18], "little") in _BMP_HEADERS:
        return "BMP"
    if head[4:8] == b"ftyp" and head[8:12] in _ISO_BRANDS:
        return "AVIF" if head[8:12] in (b"avif", b"avis") else "HEIF"
    if head[:4] == b"\x00\x00\x01\x00" and len(head) >= 6 and head[4] + head[5] > 0:
        return "ICO"
    if len(head) >= 3 and head[:1] == b"P" and head[1:2] in b"1234567" and head[2:3] in b" \t\r\n":
        return "PNM"
    if head.startswith(b"\x00\x00\x00\x0cjP  \r\n\x87\n") or head.startswith(b"\xff\x4f\xff\x51"):
        return "JPEG2000"
    if head.startswith(b"\x00\x00\x00\x0cJXL \r\n\x87\n") or head.startswith(b"\xff\x0a"):
        return "JXL"
    for magic, fmt in ((b"qoif", "QOI"), (b"8BPS", "PSD"), (b"DDS ", "DDS"), (b"icns", "ICNS")):
        if head.startswith(magic):
            return fmt
    return None


def read_head(path: str, n: int = 32) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read(n)
    except OSError:
        return b""


@dataclass(frozen=True)
class InputItem:
    """One input image: ``path`` as shown and recorded, ``key`` for sharding."""

    path: str
    key: str
    explicit: bool = False  # named by the user (always an input), not found in a directory
    data: bytes | None = field(default=None, repr=False, compare=False)  # read already (Ray Data)

    @property
    def name(self) -> str:
        return os.path.splitext(os.path.basename(self.path))[0]


@dataclass
class Discovery:
    items: list[InputItem] = field(default_factory=list)
    ignored: int = 0  # files in directories that are not images by content nor by extension
    dirs_not_entered: int = 0  # subdirectories skipped without --recursive
    unmatched: list[str] = field(default_factory=list)  # globs that matched nothing
    sharded_out: int = 0  # inputs that belong to other shards
    root: str = "."  # the deepest folder holding every input, all shards (metadata.jsonl's home)


def _posix(p: str) -> str:
    return p.replace(os.sep, "/")


def _norm(p: str) -> str:
    return os.path.normpath(p) if p not in ("", ".") else "."


def _matches(patterns: Iterable[str], rel: str) -> bool:
    rel_l = rel.lower()
    base = rel_l.rsplit("/", 1)[-1]
    return any(fnmatchcase(rel_l if "/" in p else base, p.lower()) for p in patterns)


class _Finder:
    def __init__(self, recursive: bool, include: list[str], exclude: list[str]):
        self.recursive = recursive
        self.include = include
        self.exclude = exclude
        self.found = Discovery()
        self.seen: set[str] = set()

    def _add(self, path: str, key: str, explicit: bool) -> None:
        rel = _posix(key)
        if self.include and not _matches(self.include, rel):
            return
        if self.exclude and _matches(self.exclude, rel):
            return
        real = os.path.realpath(path)
        if real in self.seen:
            return
        self.seen.add(real)
        self.found.items.append(InputItem(path, rel, explicit))

    def _candidate(self, path: str) -> bool:
        """A picture, a clip or a recording, by extension or by its first bytes."""
        if has_image_ext(path) or is_video_path(path) or os.path.splitext(path)[1].lower() in AUDIO_EXTS:
            return True
        head = read_head(path, 64)
        return sniff(head) is not None or looks_like_video(head) or looks_like_audio(head[:16])

    def directory(self, root: str) -> None:
        root_n = _norm(root)
        visited: set[str] = set()
        found: list[tuple[tuple[str, ...], str]] = []
        for dirpath, dirnames, filenames in os.walk(root_n, followlinks=True):
            real = os.path.realpath(dirpath)
            if real in visited:  # a symlink loop
                dirnames[:] = []
                continue
            visited.add(real)
            rel_dir = os.path.relpath(dirpath, root_n)
            keep = []
            for d in sorted(dirnames):
                rel = _posix(os.path.normpath(os.path.join(rel_dir, d)))
                if d.startswith(".") or (self.exclude and _matches(self.exclude, rel)):
                    continue
                keep.append(d)
            if not self.recursive:
                self.found.dirs_not_entered += len(keep)
                keep = []
            dirnames[:] = keep
            for f in filenames:
                if f.startswith("."):
                    continue
                path = os.path.join(dirpath, f)
                if not os.path.isfile(path):
                    continue
                if not self._candidate(path):
                    self.found.ignored += 1
                    continue
                rel = os.path.normpath(os.path.join(rel_dir, f))
                found.append((tuple(_posix(rel).split("/")), path))
        for parts, path in sorted(found):
            self._add(path, "/".join(parts), explicit=False)

    def argument(self, arg: str, from_list: bool = False) -> None:
        path = os.path.expanduser(arg)
        if os.path.isdir(path):
            self.directory(path)
        elif os.path.exists(path) or os.path.islink(path):
            self._add(_norm(path), _norm(path), explicit=True)
        elif _GLOB_CHARS & set(arg):
            matches = sorted(glob.glob(path, recursive=True))
            if not matches:
                self.found.unmatched.append(arg)
            for m in matches:
                if os.path.basename(m).startswith("."):
                    continue
                if os.path.isdir(m):
                    self.directory(m)
                elif os.path.isfile(m) and self._candidate(m):
                    self._add(_norm(m), _norm(m), explicit=False)
                elif os.path.isfile(m):
                    self.found.ignored += 1
        elif from_list:  # a listed file that is missing gets an error record
            self._add(_norm(path), _norm(path), explicit=True)
        else:
            raise InputError(f"{arg}: no such file or directory")


def read_list(source: str, null: bool = False, stdin: IO[str] | None = None) -> list[str]:
    """Paths from a list file (``-`` = stdin): one per line (or NUL-separated with ``null``);
    blank lines and lines starting with ``#`` are skipped."""
    try:
        if source == "-":
            text = (stdin or sys.stdin).read()
        else:
            with open(source, encoding="utf-8", errors="surrogateescape") as fh:
                text = fh.read()
    except OSError as exc:
        raise InputError(f"{source}: cannot read the list ({exc.strerror or exc})") from None
    if null:
        return [p for p in text.split("\0") if p]
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


def shard_of(key: str, n: int) -> int:
    """0-based shard of a key among ``n`` (a hash: stable, independent of order)."""
    return int.from_bytes(hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()[:8], "big") % n


def discover(
    inputs: Iterable[str] = (),
    *,
    recursive: bool = False,
    from_list: str | None = None,
    null: bool = False,
    include: Iterable[str] = (),
    exclude: Iterable[str] = (),
    shard: tuple[int, int] | None = None,
    stdin: IO[str] | None = None,
) -> Discovery:
    """Find the input images. ``shard`` is (i, n) with 1 ≤ i ≤ n."""
    finder = _Finder(recursive, list(include), list(exclude))
    for arg in inputs:
        finder.argument(arg)
    if from_list is not None:
        for entry in read_list(from_list, null, stdin):
            finder.argument(entry, from_list=True)
    found = finder.found
    found.root = common_root(found.items)
    if shard is not None:
        i, n = shard
        keep = [it for it in found.items if shard_of(it.key, n) == i - 1]
        found.sharded_out = len(found.items) - len(keep)
        found.items = keep
    return found


def common_root(items: list[InputItem]) -> str:
    """The deepest folder holding every item (relative to the current one when inside it)."""
    if not items:
        return "."
    root = os.path.commonpath([os.path.dirname(os.path.abspath(i.path)) for i in items])
    rel = os.path.relpath(root)
    return rel if not rel.startswith("..") else root


def parse_shard(text: str) -> tuple[int, int]:
    """``"2/4"`` → (2, 4); shards are numbered 1..N."""
    try:
        a, b = (int(x) for x in text.split("/"))
    except ValueError:
        raise InputError(f"--shard {text}: expected I/N, e.g. 1/4") from None
    if b < 1 or not 1 <= a <= b:
        raise InputError(f"--shard {text}: I must be between 1 and N (shards are numbered 1..{max(b, 1)})")
    return a, b
