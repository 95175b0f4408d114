"""Downloads from the Hugging Face hub: pull (verified), remove, and make a model local.

Downloads go through ``huggingface_hub.hf_hub_download``: its cache (``HF_HOME`` /
``HF_HUB_CACHE``), its retries (a dropped connection resumes with a Range request), tokens
(``HF_TOKEN`` or ``hf auth login``), ``HF_HUB_OFFLINE`` and ``HF_ENDPOINT`` (a mirror, or the
tests' local server). On top of it every downloaded file is hashed and compared with the hub's
sha256 for LFS files (git's blob sha1 for small files); a mismatch deletes the file from the
cache and raises one clear line.

Header-only reads and planning from them are in ``remote``; settings and the cache layout in
``store``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import DownloadError, InputError, IntegrityError
from .registry import FileRef, RemoteFile, ResolvedModel, is_mmproj_name, load_registry, resolve, unknown_name_message
from .store import cached_listing, cached_path, edgevlm_cache_dir, hf, hf_utils, map_error, repo_cache_dir, settings

__all__ = [
    "Digest",
    "DownloadResult",
    "PullResult",
    "download",
    "ensure_local",
    "expected_digest",
    "file_identity",
    "hash_file",
    "local_files",
    "pull",
    "remove",
    "remove_cached_file",
]

_HASH_CHUNK = 8 * 2**20


# --- integrity ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Digest:
    algo: str  # "sha256" (LFS) or "git-sha1" (small files stored in git)
    hexdigest: str
    source: str  # "registry" | "hub"


def expected_digest(rf: RemoteFile) -> Digest:
    """What the file must hash to: the registry's pinned sha256, else the hub's LFS sha256."""
    if rf.sha256:
        return Digest("sha256", rf.sha256.lower(), "registry")
    s = settings()
    api = hf()
    try:
        infos = api.HfApi(endpoint=s.endpoint).get_paths_info(rf.repo, [rf.file], revision=rf.revision)
    except Exception as exc:
        raise map_error(exc, rf.spec, s) from None
    for info in infos:
        if getattr(info, "path", None) != rf.file:
            continue
        lfs = getattr(info, "lfs", None)
        if lfs is not None:
            sha = lfs.get("sha256") if isinstance(lfs, dict) else getattr(lfs, "sha256", None)
            if sha:
                return Digest("sha256", str(sha).lower(), "hub")
        blob = getattr(info, "blob_id", None)
        if blob:
            return Digest("git-sha1", str(blob).lower(), "hub")
    raise InputError(f"{rf.spec}: no such file in the repository on {s.endpoint}")


def hash_file(path: str, algo: str = "sha256", progress: Callable[[int, int], None] | None = None) -> str:
    size = os.path.getsize(path)
    if algo == "git-sha1":
        h = hashlib.sha1(f"blob {size}\0".encode())
    else:
        h = hashlib.sha256()
    done = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            h.update(chunk)
            done += len(chunk)
            if progress:
                progress(done, size)
    return h.hexdigest()


# --- download -----------------------------------------------------------------------------


@dataclass(frozen=True)
class DownloadResult:
    remote: RemoteFile
    path: str
    size: int
    downloaded: bool  # False: it was in the cache already
    verified: Digest | None  # the digest the file was checked against (None: not re-checked)


@contextlib.contextmanager
def _progress_bars(enabled: bool) -> Iterator[None]:
    utils = hf_utils()
    was_disabled = utils.are_progress_bars_disabled()
    if not enabled and not was_disabled:
        utils.disable_progress_bars()
    try:
        yield
    finally:
        if not enabled and not was_disabled:
            utils.enable_progress_bars()


def download(
    rf: RemoteFile,
    *,
    progress: bool = True,
    verify_existing: bool = False,
    on_verify: Callable[[int, int], None] | None = None,
) -> DownloadResult:
    """Get one file into the hub cache (resumable, verified); returns its local path."""
    s = settings()
    before = cached_path(rf.repo, rf.file, rf.revision)
    if s.offline:
        if before is None:
            raise DownloadError(
                f"{rf.spec}: not in the local cache ({s.cache_dir}) and offline mode is on (HF_HUB_OFFLINE)"
            )
        return DownloadResult(rf, before, os.path.getsize(before), False, None)
    # Ask for the digest first when a download is expected: no point fetching GBs unverifiable.
    digest = expected_digest(rf) if (before is None or verify_existing) else None
    api = hf()
    try:
        with _progress_bars(progress):
            path = api.hf_hub_download(
                rf.repo, rf.file, revision=rf.revision, cache_dir=s.cache_dir, endpoint=s.endpoint
            )
    except Exception as exc:
        raise map_error(exc, rf.spec, s) from None
    downloaded = before is None or not os.path.samefile(before, path)
    checked = None
    if downloaded or verify_existing:
        if digest is None:  # the revision moved on: a new file came down
            digest = expected_digest(rf)
        got = hash_file(path, digest.algo, on_verify)
        if got != digest.hexdigest:
            remove_cached_file(rf.repo, path)
            raise IntegrityError(
                f"{rf.spec}: {digest.algo} mismatch after download (expected {digest.hexdigest[:16]}…, "
                f"got {got[:16]}…); the corrupt file was deleted from the cache, pull again"
            )
        checked = digest
    return DownloadResult(rf, path, os.path.getsize(path), downloaded, checked)


def remove_cached_file(repo: str, pointer: str) -> int:
    """Delete one snapshot entry and its blob when nothing else points at it; bytes freed."""
    repo_dir = repo_cache_dir(repo).resolve()
    p = Path(pointer)
    # The snapshot entry links to blobs/<etag> (which may itself link into huggingface_hub's
    # shared xet store: that one is the hub client's to collect, this repo's link is ours).
    blob = _link_target(p) if p.is_symlink() else None
    freed = 0
    if p.is_symlink() or p.exists():
        if blob is None:
            freed += p.stat().st_size
        p.unlink()
    if blob is not None and repo_dir in blob.parents and (blob.exists() or blob.is_symlink()):
        still_used = any(q.is_symlink() and _link_target(q) == blob for q in (repo_dir / "snapshots").rglob("*"))
        if not still_used:
            with contextlib.suppress(OSError):
                freed += blob.stat().st_size
            blob.unlink()
    _prune(repo_dir)
    return freed


def _link_target(link: Path) -> Path:
    """Where a symlink points, one hop, as an absolute normalised path (parents resolved)."""
    return Path(os.path.normpath(os.path.join(link.parent.resolve(), os.readlink(link))))


def _prune(repo_dir: Path) -> None:
    """Remove empty snapshot folders; the whole repo folder once no file is left in it."""
    snaps = repo_dir / "snapshots"
    if snaps.is_dir():
        for d in sorted((q for q in snaps.rglob("*") if q.is_dir()), key=lambda q: -len(q.parts)):
            with contextlib.suppress(OSError):
                d.rmdir()
    left = [q for q in snaps.rglob("*") if q.is_file() or q.is_symlink()] if snaps.is_dir() else []
    if not left:
        shutil.rmtree(repo_dir, ignore_errors=True)
        locks = repo_dir.parent / ".locks" / repo_dir.name
        shutil.rmtree(locks, ignore_errors=True)


@dataclass
class PullResult:
    resolved: ResolvedModel
    files: list[tuple[str, DownloadResult]] = field(default_factory=list)  # (role, result)

    @property
    def model_path(self) -> str:
        return self.resolved.model.local  # type: ignore[return-value]

    @property
    def mmproj_path(self) -> str | None:
        return self.resolved.mmproj.local if self.resolved.mmproj else None


def ensure_local(
    r: ResolvedModel,
    *,
    progress: bool = True,
    refresh: bool = False,
    verify_existing: bool = False,
    on_file: Callable[[str, RemoteFile], None] | None = None,
    on_verify: Callable[[int, int], None] | None = None,
) -> PullResult:
    """Download whatever of ``r`` is remote and not in the cache; returns the model with local
    paths filled in. ``refresh`` (``pull``) also asks the hub whether the revision moved on;
    without it a cached file is used without any network request (``chat``, ``caption``)."""
    out = PullResult(r)
    refs: dict[str, FileRef | None] = {"model": r.model, "mmproj": r.mmproj}
    for role, ref in refs.items():
        if ref is None or ref.remote is None:
            continue
        if ref.local is not None and not (refresh or verify_existing):
            continue
        if on_file:
            on_file(role, ref.remote)
        res = download(ref.remote, progress=progress, verify_existing=verify_existing, on_verify=on_verify)
        out.files.append((role, res))
        refs[role] = FileRef(local=res.path, remote=ref.remote)
    from dataclasses import replace

    model = refs["model"]
    assert model is not None  # r.model, or the FileRef that replaced it
    out.resolved = replace(r, model=model, mmproj=refs["mmproj"])
    return out


def local_files(
    spec: str,
    mmproj: str | None = None,
    *,
    progress: bool = False,
    on_file: Callable[[str, RemoteFile], None] | None = None,
) -> tuple[str, str]:
    """(model, mmproj) paths on this machine. Local paths are used as they are (a shared
    folder on a cluster); names and ``hf:`` specs come from the hub cache, downloaded first under
    a machine-wide lock, so however many processes ask at once (Ray actors on one node) the
    files come down once and the others wait, then find them cached."""
    from filelock import FileLock

    r = resolve(spec, mmproj)
    if r.mmproj is None:
        raise InputError(f"{r.name}: no vision projector found; pass --mmproj")
    if not r.is_local:
        cache = edgevlm_cache_dir()
        cache.mkdir(parents=True, exist_ok=True)
        with FileLock(str(cache / "fetch.lock")):
            r = resolve(spec, mmproj)  # another process may have fetched it meanwhile
            if not r.is_local:
                r = ensure_local(r, progress=progress, on_file=on_file).resolved
    model, proj = r.local_paths()
    assert proj is not None
    return model, proj


def file_identity(spec: str, mmproj: str | None = None) -> tuple[str, str]:
    """(model file, mmproj file) as ``name:size`` without downloading: from the files when they
    are here, from the hub's listing otherwise (so a cluster's driver knows a model's identity —
    part of every caption's resume key — without holding its weights)."""
    r = resolve(spec, mmproj)
    if r.mmproj is None:
        raise InputError(f"{r.name}: no vision projector found; pass --mmproj")

    def one(ref: FileRef) -> str:
        if ref.local is not None:
            return f"{os.path.basename(ref.local)}:{os.path.getsize(ref.local)}"
        rf = ref.remote
        assert rf is not None
        s = settings()
        try:
            infos = hf().HfApi(endpoint=s.endpoint).get_paths_info(rf.repo, [rf.file], revision=rf.revision)
        except Exception as exc:
            raise map_error(exc, rf.spec, s) from None
        size = next((getattr(i, "size", None) for i in infos if getattr(i, "path", None) == rf.file), None)
        if size is None:
            raise InputError(f"{rf.spec}: no such file in the repository on {s.endpoint}")
        return f"{os.path.basename(rf.file)}:{size}"

    return one(r.model), one(r.mmproj)


def pull(spec: str, mmproj: str | None = None, **kw: Any) -> PullResult:
    """``edgevlm pull``: resolve a name (or hf: spec) and download its files, verified."""
    r = resolve(spec, mmproj)
    if r.kind in ("local", "demo"):
        return PullResult(r)
    kw.setdefault("refresh", True)
    return ensure_local(r, **kw)


# --- removing -----------------------------------------------------------------------------


def _hub_file(ref: FileRef) -> RemoteFile:
    """The hub origin of a registry or ``hf:`` model's file (resolution always gives one)."""
    assert ref.remote is not None
    return ref.remote


def remove(spec: str) -> list[tuple[str, int]]:
    """``edgevlm rm``: delete a pulled model's files from the hub cache; (file, bytes freed).

    ``name`` removes every quantisation of that registry model and its projector;
    ``name:quant`` removes that file, and the projector once no other quantisation is left.
    """
    reg = load_registry()
    if spec.startswith("hf:"):
        r = resolve(spec, need_mmproj=False)
        model_rf = _hub_file(r.model)
        targets = [model_rf]
        siblings: list[RemoteFile] = []
        proj = r.mmproj.remote if r.mmproj else None
        if proj is not None:
            listing = cached_listing(proj.repo, proj.revision) or []
            siblings = [
                RemoteFile(proj.repo, f, proj.revision)
                for f in listing
                if f.lower().endswith(".gguf") and not is_mmproj_name(f) and f != model_rf.file
            ]
    else:
        name, _, quant = spec.partition(":")
        entry = reg.get(name)
        if entry is None:
            if os.path.exists(spec) or spec == "demo":
                raise InputError(
                    f"'{spec}' is not a downloaded model: rm only deletes what 'edgevlm pull' put in the hub cache"
                )
            raise InputError(unknown_name_message(spec, reg))
        _, q = reg.lookup(spec)
        quants = [q] if quant else entry.quants
        rfs = {qq: resolve(f"{entry.name}:{qq}", registry=reg) for qq in entry.quants}
        targets = [_hub_file(rfs[qq].model) for qq in quants]
        siblings = [_hub_file(rfs[qq].model) for qq in entry.quants if qq not in quants]
        mm = rfs[q].mmproj
        proj = mm.remote if mm else None
    removed: list[tuple[str, int]] = []
    for rf in targets:
        for pointer in _pointers(rf):
            removed.append((rf.file, remove_cached_file(rf.repo, str(pointer))))
    if proj is not None and not any(_pointers(sib) for sib in siblings):
        for pointer in _pointers(proj):
            removed.append((proj.file, remove_cached_file(proj.repo, str(pointer))))
    if not removed:
        raise InputError(f"{spec} is not downloaded (nothing to remove)")
    return removed


def _pointers(rf: RemoteFile | None) -> list[Path]:
    """Every snapshot entry of the file, whatever the revision."""
    if rf is None:
        return []
    snaps = repo_cache_dir(rf.repo) / "snapshots"
    if not snaps.is_dir():
        return []
    return [p for p in (s / rf.file for s in snaps.iterdir()) if p.is_symlink() or p.exists()]
