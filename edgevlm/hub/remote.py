"""Header-only reads of remote GGUF files (HTTP range requests, cached on disk) and planning a
model by name from them — the same ``Planner`` code path as local files.

Split from ``hub`` (downloads, cache, integrity), whose settings and helpers it uses.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import DownloadError, EdgeVLMError, ModelFileError
from ..model.gguf_info import GGUFFile, HeaderIncomplete, TensorInfo, parse_header, read_gguf
from ..plan.planner import Planner, Wishes
from .registry import FileRef, RemoteFile, ResolvedModel, resolve
from .store import HubSettings, edgevlm_cache_dir, hf, hf_utils, is_transport_error, map_error, settings

__all__ = [
    "HEADER_CACHE_VERSION",
    "HEADER_FIRST_CHUNK",
    "HEADER_MAX_BYTES",
    "HeaderRead",
    "cached_header",
    "fetch_header",
    "gguf_for",
    "gguf_from_json",
    "gguf_to_json",
    "header_cache_file",
    "plan_remote",
    "plan_resolved",
    "read_remote_header",
]

HEADER_FIRST_CHUNK = 2 * 2**20
HEADER_MAX_BYTES = 512 * 2**20  # a "header" larger than this is not one
HEADER_CACHE_VERSION = 1


# --- header-only reads --------------------------------------------------------------------


def header_cache_file(s: HubSettings, rf: RemoteFile) -> Path:
    key = hashlib.sha256(f"{s.endpoint}\n{rf.repo}\n{rf.revision}\n{rf.file}".encode()).hexdigest()[:40]
    return edgevlm_cache_dir() / "hub-headers" / f"{key}.json"


def gguf_to_json(gf: GGUFFile) -> dict[str, Any]:
    return {
        "file_size": gf.file_size,
        "metadata": gf.metadata,
        "array_lengths": gf.array_lengths,
        "tensors": [[t.name, t.ggml_type, list(t.shape), t.n_elements, t.n_bytes, t.offset] for t in gf.tensors],
    }


def gguf_from_json(d: dict[str, Any], path: str) -> GGUFFile:
    tensors = tuple(TensorInfo(n, ty, tuple(sh), ne, nb, off) for n, ty, sh, ne, nb, off in d["tensors"])
    return GGUFFile(path, int(d["file_size"]), dict(d["metadata"]), dict(d["array_lengths"]), tensors)


def _load_header_cache(p: Path, label: str) -> tuple[dict[str, Any], GGUFFile] | None:
    try:
        with open(p, encoding="utf-8") as fh:
            d = json.load(fh)
        if d.get("version") != HEADER_CACHE_VERSION:
            return None
        return d, gguf_from_json(d["gguf"], label)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _save_header_cache(p: Path, record: dict[str, Any]) -> None:
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(f"{p.name}.{os.getpid()}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(record, fh)
    os.replace(tmp, p)


def cached_header(rf: RemoteFile) -> GGUFFile | None:
    """The header of a hub file as an earlier read left it on disk (no network), or None."""
    cached = _load_header_cache(header_cache_file(settings(), rf), rf.spec)
    return cached[1] if cached is not None else None


@dataclass(frozen=True)
class HeaderRead:
    gguf: GGUFFile
    source: str  # "local" | "cache" | "remote"
    bytes_fetched: int = 0
    etag: str | None = None
    commit: str | None = None


def read_remote_header(rf: RemoteFile, *, first_chunk: int = HEADER_FIRST_CHUNK) -> GGUFFile:
    """The GGUF header of a hub file, from a few range requests or the on-disk header cache."""
    return fetch_header(rf, first_chunk=first_chunk).gguf


def fetch_header(rf: RemoteFile, *, first_chunk: int = HEADER_FIRST_CHUNK) -> HeaderRead:
    s = settings()
    label = rf.spec
    cache_file = header_cache_file(s, rf)
    cached = _load_header_cache(cache_file, label)
    if s.offline:
        if cached is None:
            raise DownloadError(
                f"{label}: header not cached and offline mode is on (HF_HUB_OFFLINE); plan it once online, or pull it"
            )
        return HeaderRead(cached[1], "cache", 0, cached[0].get("etag"), cached[0].get("commit"))
    api = hf()
    url = api.hf_hub_url(rf.repo, rf.file, revision=rf.revision, endpoint=s.endpoint)
    try:
        meta = api.get_hf_file_metadata(url, endpoint=s.endpoint)
    except Exception as exc:
        if cached is not None and is_transport_error(exc):
            return HeaderRead(cached[1], "cache", 0, cached[0].get("etag"), cached[0].get("commit"))
        raise map_error(exc, label, s) from None
    if cached is not None and meta.etag and cached[0].get("etag") == meta.etag:
        return HeaderRead(cached[1], "cache", 0, meta.etag, meta.commit_hash)
    headers = hf_utils().build_hf_headers()
    if _origin(meta.location) != _origin(url):
        headers.pop("authorization", None)  # a signed CDN url: the token stays on the hub
        headers.pop("Authorization", None)
    try:
        gf, fetched = _range_read_header(meta.location or url, meta.size, label, headers, first_chunk)
    except EdgeVLMError:
        raise
    except Exception as exc:
        raise map_error(exc, label, s) from None
    _save_header_cache(
        cache_file,
        {
            "version": HEADER_CACHE_VERSION,
            "endpoint": s.endpoint,
            "repo": rf.repo,
            "file": rf.file,
            "revision": rf.revision,
            "etag": meta.etag,
            "commit": meta.commit_hash,
            "bytes_fetched": fetched,
            "gguf": gguf_to_json(gf),
        },
    )
    return HeaderRead(gf, "remote", fetched, meta.etag, meta.commit_hash)


def _origin(url: str | None) -> tuple[str, str, int | None]:
    from urllib.parse import urlsplit

    u = urlsplit(url or "")
    return u.scheme, (u.hostname or "").lower(), u.port


def _get_range(url: str, start: int, end: int, headers: dict[str, str]) -> tuple[bytes, int | None]:
    """Bytes [start, end] of url, and the file's total size when the server says it."""
    utils = hf_utils()
    session = utils.get_session()
    h = dict(headers, Range=f"bytes={start}-{end}")
    h["Accept-Encoding"] = "identity"
    with session.stream("GET", url, headers=h, follow_redirects=True) as r:
        if r.status_code == 416:  # start is past the end
            return b"", None
        if r.status_code >= 400:
            r.read()
            utils.hf_raise_for_status(r)
        if r.status_code == 206:
            data = r.read()
            total = None
            cr = r.headers.get("Content-Range", "")
            if "/" in cr and cr.rsplit("/", 1)[1].strip().isdigit():
                total = int(cr.rsplit("/", 1)[1])
            return bytes(data[: end - start + 1]), total
        # 200: the server ignored Range. Read only as far as needed, then drop the connection.
        buf = bytearray()
        for chunk in r.iter_bytes():
            buf += chunk
            if len(buf) > end:
                break
        cl = r.headers.get("Content-Length")
        return bytes(buf[start : end + 1]), int(cl) if cl and cl.isdigit() else None


def _range_read_header(
    url: str, size: int | None, label: str, headers: dict[str, str], first_chunk: int
) -> tuple[GGUFFile, int]:
    buf = bytearray()
    total = size
    want = max(first_chunk, 64)
    while True:
        if total is not None:
            want = min(want, total)
        if len(buf) < want:
            data, t = _get_range(url, len(buf), want - 1, headers)
            total = total if total is not None else t
            if not data:
                raise ModelFileError(f"{label}: the server sent no bytes for range {len(buf)}-{want - 1}")
            buf += data
        if total is None:
            raise DownloadError(f"{label}: the server does not say how large the file is")
        try:
            return parse_header(bytes(buf), label, total), len(buf)
        except HeaderIncomplete:
            if len(buf) >= HEADER_MAX_BYTES:
                raise ModelFileError(f"{label}: GGUF header larger than {HEADER_MAX_BYTES // 2**20} MiB") from None
            want = len(buf) * 4


# --- planning -----------------------------------------------------------------------------


def gguf_for(ref: FileRef, *, fetch: bool = True) -> GGUFFile:
    """The header of a file: local when it is on disk, else cached or fetched from the hub."""
    if ref.local is not None:
        return read_gguf(ref.local)
    assert ref.remote is not None
    if not fetch:
        cached = cached_header(ref.remote)
        if cached is None:
            raise DownloadError(f"{ref.remote.spec}: header not read yet")
        return cached
    return read_remote_header(ref.remote)


def plan_resolved(r: ResolvedModel, probe, wishes=None, *, fetch: bool = True):
    """A Plan for a resolved model: from local files, or from remote headers (same Planner)."""
    text = gguf_for(r.model, fetch=fetch)
    proj = gguf_for(r.mmproj, fetch=fetch) if r.mmproj is not None else None
    return Planner(text, proj, probe, wishes or Wishes()).plan()


def plan_remote(spec: str, probe, wishes=None, mmproj: str | None = None):
    """``edgevlm plan --model NAME``: plan from the headers alone (nothing is downloaded)."""
    return plan_resolved(resolve(spec, mmproj, need_mmproj=False), probe, wishes)
