"""The hub's local side and the primitives every hub module shares: settings read from the
environment at call time (``HF_ENDPOINT``, ``HF_HOME``, ``HF_HUB_OFFLINE``), the hub cache's
layout (``models--owner--name/{refs,blobs,snapshots}``), one-line errors for anything
huggingface_hub or its HTTP client raises, and a repository's file list (online or cached).

The environment is read at call time (not at import, as ``huggingface_hub.constants`` does), so a
process that changes ``HF_ENDPOINT`` / ``HF_HOME`` / ``HF_HUB_OFFLINE`` sees the change.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import DownloadError, EdgeVLMError, InputError

__all__ = [
    "DEFAULT_ENDPOINT",
    "HubSettings",
    "cached_listing",
    "cached_path",
    "commit_for",
    "edgevlm_cache_dir",
    "first_line",
    "hf",
    "hf_utils",
    "is_transport_error",
    "map_error",
    "repo_cache_dir",
    "repo_files",
    "settings",
    "short_error",
]

DEFAULT_ENDPOINT = "https://huggingface.co"


# --- settings (environment, read at call time) --------------------------------------------


def _truthy(v: str | None) -> bool:
    return (v or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


@dataclass(frozen=True)
class HubSettings:
    endpoint: str
    cache_dir: str
    offline: bool


def settings() -> HubSettings:
    """Endpoint, cache folder and offline flag with huggingface_hub's precedence rules."""
    endpoint = (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
    cache = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if not cache:
        home = os.environ.get("HF_HOME") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface"
        )
        cache = os.path.join(home, "hub")
    offline = _truthy(os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE"))
    return HubSettings(endpoint, os.path.expandvars(os.path.expanduser(cache)), offline)


def edgevlm_cache_dir() -> Path:
    base = os.environ.get("EDGEVLM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "edgevlm"
    )
    return Path(base)


def hf():
    try:
        import huggingface_hub
    except ImportError:  # pragma: no cover - it is a dependency
        raise InputError("huggingface_hub is not installed (pip install huggingface_hub)") from None
    return huggingface_hub


def hf_utils():
    hf()
    return importlib.import_module("huggingface_hub.utils")


# --- the local hub cache (layout: models--owner--name/{refs,blobs,snapshots}) ----------------


def repo_cache_dir(repo: str, cache_dir: str | None = None) -> Path:
    return Path(cache_dir or settings().cache_dir) / ("models--" + repo.replace("/", "--"))


def commit_for(repo_dir: Path, revision: str) -> str | None:
    if len(revision) == 40 and all(c in "0123456789abcdef" for c in revision):
        return revision
    try:
        return (repo_dir / "refs" / revision).read_text().strip() or None
    except OSError:
        return None


def cached_path(repo: str, file: str, revision: str = "main") -> str | None:
    """The file's path in the hub cache for its revision, or None (no network, no hf import)."""
    repo_dir = repo_cache_dir(repo)
    commit = commit_for(repo_dir, revision)
    if commit is None:
        return None
    p = repo_dir / "snapshots" / commit / file
    return str(p) if p.is_file() else None


def cached_listing(repo: str, revision: str) -> list[str] | None:
    repo_dir = repo_cache_dir(repo)
    commit = commit_for(repo_dir, revision)
    snap = repo_dir / "snapshots" / commit if commit else None
    if snap is None or not snap.is_dir():
        return None
    return sorted(str(p.relative_to(snap)).replace(os.sep, "/") for p in snap.rglob("*") if p.is_file())


# --- errors -------------------------------------------------------------------------------


def short_error(exc: BaseException) -> str:
    """An error's first line without the leading 'hf:owner/repo/file: ' label."""
    text = first_line(exc)
    if text.startswith(("hf:", "/")) and ": " in text:
        text = text.split(": ", 1)[1]
    return text


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def http_module():
    """httpx (huggingface_hub 1.x) or httpx2 (2.x): whichever its session is built on."""
    session = hf_utils().get_session()
    return importlib.import_module(type(session).__module__.split(".")[0])


def map_error(exc: BaseException, what: str, s: HubSettings) -> EdgeVLMError:
    """One line for anything huggingface_hub or the HTTP client raises."""
    errors = importlib.import_module("huggingface_hub.errors")

    def isa(name: str) -> bool:
        cls = getattr(errors, name, None)
        return cls is not None and isinstance(exc, cls)

    if isinstance(exc, EdgeVLMError):
        return exc
    if isa("GatedRepoError"):
        return InputError(
            f"{what}: the repository is gated: accept its terms on the hub, then set HF_TOKEN (or run 'hf auth login')"
        )
    if isa("RepositoryNotFoundError"):
        return InputError(f"{what}: no such repository on {s.endpoint} (or it is private: set HF_TOKEN)")
    if isa("RevisionNotFoundError"):
        return InputError(f"{what}: no such revision on {s.endpoint}")
    if isa("RemoteEntryNotFoundError") or isa("EntryNotFoundError"):
        return InputError(f"{what}: no such file in the repository on {s.endpoint}")
    if isa("OfflineModeIsEnabled") or isa("LocalEntryNotFoundError"):
        why = "offline mode is on (HF_HUB_OFFLINE)" if s.offline else f"{s.endpoint} cannot be reached"
        return DownloadError(f"{what}: not in the local cache and {why}")
    if isa("HfHubHTTPError"):
        resp = getattr(exc, "response", None)
        code = getattr(resp, "status_code", "?")
        return DownloadError(f"{what}: {s.endpoint} answered HTTP {code} ({first_line(exc)})")
    try:
        http = http_module()
        if isinstance(exc, http.TransportError):
            return DownloadError(f"{what}: cannot reach {s.endpoint} ({type(exc).__name__}: {first_line(exc)})")
    except Exception:  # pragma: no cover
        pass
    if isinstance(exc, OSError):
        return DownloadError(f"{what}: {exc.strerror or first_line(exc)}")
    return DownloadError(f"{what}: {type(exc).__name__}: {first_line(exc)}")


def is_transport_error(exc: BaseException) -> bool:
    try:
        return isinstance(exc, http_module().TransportError)
    except Exception:  # pragma: no cover
        return False


# --- listing ------------------------------------------------------------------------------


def repo_files(repo: str, revision: str = "main") -> list[str]:
    """Files of a hub repo: from the hub, or from the local cache when offline / unreachable."""
    s = settings()
    cached = cached_listing(repo, revision)
    if s.offline:
        if cached is None:
            raise DownloadError(f"hf:{repo}: not in the local cache and offline mode is on (HF_HUB_OFFLINE)")
        return cached
    api = hf()
    try:
        return sorted(api.HfApi(endpoint=s.endpoint).list_repo_files(repo, revision=revision))
    except Exception as exc:  # mapped to one line below
        if cached is not None and is_transport_error(exc):
            return cached
        raise map_error(exc, f"hf:{repo}", s) from None
