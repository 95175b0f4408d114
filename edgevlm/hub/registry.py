"""Models by name: the registry of known GGUF releases and resolution of ``--model`` specs.

A model spec is one of

* a registry name, optionally with a quantisation: ``llava-1.5-7b``, ``llava-1.5-7b:q8_0``
  (aliases such as ``llava`` work too);
* a local path to a text-model GGUF; its projector is found next to it (``*mmproj*.gguf`` in the
  same folder, the one whose output width matches the model);
* ``hf:owner/repo/file.gguf`` (a file on the hub), ``hf:owner/repo`` or ``hf:owner/repo:q4_k_m``
  (the repo's file of that quantisation, Q4_K_M by default); ``owner/repo@revision`` pins one;
* ``demo``: the toy VLM trained on edgevlm's synthetic world (``models/edgevlm-demo.gguf``,
  see ``hub.demo``); ``demo:qwen25vl`` (any generated family): the generated tiny pair, built
  once into the edgevlm cache, with random weights: it shows the pipeline, not a model (the
  generator is the ``edgevlm-testkit`` distribution, found by entry point: ``hub.demo``).

The registry data is ``edgevlm/data/registry.json`` (package data: the one copy, in a checkout
and in the wheel). ``EDGEVLM_REGISTRY=/path/file.json`` replaces it (a private registry, or the
tests' one).

Resolution downloads nothing: a remote file is described (repo, file, revision) and, when the
Hugging Face cache already holds it, its local path is filled in (only ``hf:`` specs ask the hub
for the repo's file list). ``edgevlm.hub`` does
the downloading and the header-only reads.
"""

from __future__ import annotations

import difflib
import functools
import glob
import json
import os
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import DownloadError, InputError, ModelFileError
from ..model.gguf_info import projector_info, read_gguf, text_model_info
from .store import cached_path, repo_files

SCHEMA = 1
DEFAULT_QUANT = "q4_k_m"
DEMO_NOTE = (
    "demo: a generated tiny {family} pair with RANDOM weights: the answers are gibberish. "
    "It exercises every step (GGUF loading, image encoding, prefill, streaming) offline; "
    "use a registry name (edgevlm models) for a real model."
)
# Preference among several projectors of one model: full precision first.
_MMPROJ_PREFERENCE = ("f16", "bf16", "f32", "q8_0")
_QUANT_RE = re.compile(r"(?<![a-z0-9])(i?q\d[a-z0-9_]*|bf16|f16|f32)(?![a-z0-9])", re.IGNORECASE)


# --- the registry ----------------------------------------------------------------------------


@dataclass(frozen=True)
class RegistryFile:
    file: str  # path inside the repo
    size: int | None = None  # bytes; approximate unless size_verified
    size_verified: bool = False
    sha256: str | None = None  # pinned digest, when known (else the hub's LFS sha256 is used)
    repo: str | None = None  # when the file lives in another repo than the entry's


@dataclass(frozen=True)
class RegistryEntry:
    name: str
    title: str
    repo: str
    params: str
    template_family: str
    projector_type: str
    license: str
    default_quant: str
    files: dict[str, RegistryFile]  # quant (lower case) -> file
    mmproj: RegistryFile
    revision: str = "main"
    aliases: tuple[str, ...] = ()
    notes: str = ""

    @property
    def quants(self) -> list[str]:
        return list(self.files)

    def approx_size(self, quant: str | None = None) -> int:
        f = self.files[quant or self.default_quant]
        return (f.size or 0) + (self.mmproj.size or 0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "title": self.title,
            "repo": self.repo,
            "revision": self.revision,
            "params": self.params,
            "template_family": self.template_family,
            "projector_type": self.projector_type,
            "license": self.license,
            "default_quant": self.default_quant,
            "aliases": list(self.aliases),
            "notes": self.notes,
            "files": {q: _file_dict(f) for q, f in self.files.items()},
            "mmproj": _file_dict(self.mmproj),
        }


def _file_dict(f: RegistryFile) -> dict[str, Any]:
    d = {"file": f.file, "size": f.size, "size_verified": f.size_verified}
    if f.sha256:
        d["sha256"] = f.sha256
    if f.repo:
        d["repo"] = f.repo
    return d


class Registry:
    """Entries by name; lookup by name or alias, ``name:quant`` parsing, close-name suggestions;
    ``default``: the names tried, in order, when no model is named, and why."""

    def __init__(self, entries: list[RegistryEntry], source: str, default: tuple[str, ...] = (), default_why: str = ""):
        self.entries = entries
        self.source = source
        self.default = default
        self.default_why = default_why
        self._by_name: dict[str, RegistryEntry] = {}
        for e in entries:
            for key in (e.name, *e.aliases):
                k = key.lower()
                if k in self._by_name and self._by_name[k] is not e:
                    raise InputError(f"{source}: name '{key}' is used by two registry entries")
                self._by_name[k] = e

    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def get(self, name: str) -> RegistryEntry | None:
        return self._by_name.get(name.lower())

    def lookup(self, spec: str) -> tuple[RegistryEntry, str]:
        """``name`` or ``name:quant`` → (entry, quant); InputError with suggestions otherwise."""
        name, _, quant = spec.partition(":")
        entry = self.get(name)
        if entry is None:
            raise InputError(unknown_name_message(spec, self))
        q = (quant or entry.default_quant).lower()
        if q not in entry.files:
            raise InputError(
                f"{entry.name} has no quantisation '{quant}' in the registry (choose from {', '.join(entry.quants)})"
            )
        return entry, q

    def suggest(self, name: str, n: int = 3) -> list[str]:
        """Registry names close to ``name`` (aliases map back to their entry's name)."""
        key = name.partition(":")[0].lower()
        out: list[str] = []
        for cand in difflib.get_close_matches(key, list(self._by_name), n=n * 2, cutoff=0.5):
            real = self._by_name[cand].name
            if real not in out:
                out.append(real)
        # prefix / substring matches that difflib's ratio misses ("qwen" → all Qwen entries)
        for e in self.entries:
            if len(key) >= 3 and (key in e.name or any(key in a for a in e.aliases)) and e.name not in out:
                out.append(e.name)
        return out[:n]


def unknown_name_message(spec: str, reg: Registry) -> str:
    close = reg.suggest(spec)
    hint = f"did you mean {', '.join(close)}?" if close else f"known: {', '.join(reg.names())}"
    return (
        f"'{spec}' is not a file, an hf:owner/repo/file.gguf spec, 'demo', or a registry "
        f"name; {hint} (edgevlm models lists them)"
    )


def _parse_file(d: Any, where: str) -> RegistryFile:
    if isinstance(d, str):
        return RegistryFile(d)
    if not isinstance(d, dict) or not isinstance(d.get("file"), str):
        raise InputError(f'{where}: expected {{"file": ..., "size": ...}}')
    size = d.get("size")
    if size is not None and not isinstance(size, int):
        raise InputError(f"{where}: size must be a number of bytes")
    return RegistryFile(d["file"], size, bool(d.get("size_verified", False)), d.get("sha256"), d.get("repo"))


def parse_registry(data: Any, source: str) -> Registry:
    if not isinstance(data, dict) or not isinstance(data.get("models"), list):
        raise InputError(f"{source}: not a model registry (expected an object with a 'models' list)")
    if data.get("schema", SCHEMA) != SCHEMA:
        raise InputError(f"{source}: registry schema {data.get('schema')} is not supported (want {SCHEMA})")
    entries = []
    for i, m in enumerate(data["models"]):
        where = f"{source}: models[{i}]"
        try:
            name = m["name"]
            files = {q.lower(): _parse_file(f, f"{where} ({name} {q})") for q, f in m["files"].items()}
            default = m.get("default_quant", DEFAULT_QUANT).lower()
            if default not in files:
                raise InputError(f"{where} ({name}): default_quant '{default}' is not among its files")
            entries.append(
                RegistryEntry(
                    name=name,
                    title=m.get("title", name),
                    repo=m["repo"],
                    params=m.get("params", ""),
                    template_family=m.get("template_family", ""),
                    projector_type=m.get("projector_type", ""),
                    license=m.get("license", "unknown"),
                    default_quant=default,
                    files=files,
                    mmproj=_parse_file(m["mmproj"], f"{where} ({name} mmproj)"),
                    revision=m.get("revision", "main"),
                    aliases=tuple(m.get("aliases", ())),
                    notes=m.get("notes", ""),
                )
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise InputError(f"{where}: missing or malformed field ({type(exc).__name__}: {exc})") from None
    dflt = data.get("default") or {}
    order = dflt.get("order", []) if isinstance(dflt, dict) else None
    if not isinstance(order, list) or not all(isinstance(n, str) for n in order):
        raise InputError(f"{source}: 'default' must be an object with an 'order' list of model names")
    names = {e.name for e in entries}
    if unknown := [n for n in order if n not in names]:
        raise InputError(f"{source}: default.order names {', '.join(unknown)}, not in the registry")
    return Registry(entries, source, tuple(order), str(dflt.get("why", "")))


def registry_path() -> Path:
    """``$EDGEVLM_REGISTRY``, else the packaged ``edgevlm/data/registry.json``."""
    env = os.environ.get("EDGEVLM_REGISTRY")
    if env:
        return Path(env)
    return Path(__file__).resolve().parent.parent / "data" / "registry.json"


@functools.lru_cache(maxsize=8)
def _load_cached(path: str, mtime: float) -> Registry:
    try:
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
    except OSError as exc:
        raise InputError(f"{path}: cannot read the model registry ({exc.strerror or exc})") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}: the model registry is not valid JSON ({exc})") from None
    return parse_registry(data, path)


def load_registry(path: str | os.PathLike[str] | None = None) -> Registry:
    p = Path(path) if path is not None else registry_path()
    try:
        mtime = p.stat().st_mtime
    except OSError:
        raise InputError(f"{p}: model registry not found") from None
    return _load_cached(str(p), mtime)


# --- resolution ------------------------------------------------------------------------------


@dataclass(frozen=True)
class RemoteFile:
    """A file on the hub: repo, path in the repo, revision (branch, tag or commit)."""

    repo: str
    file: str
    revision: str = "main"
    size: int | None = None  # the registry's (approximate) size, if any
    sha256: str | None = None  # pinned digest from the registry, if any

    @property
    def spec(self) -> str:
        rev = "" if self.revision == "main" else f"@{self.revision}"
        return f"hf:{self.repo}{rev}/{self.file}"


@dataclass(frozen=True)
class FileRef:
    """One GGUF file: a local path when it is on disk (or in the hub cache), and/or its hub origin."""

    local: str | None = None
    remote: RemoteFile | None = None

    @property
    def label(self) -> str:
        if self.remote is not None:
            return self.remote.spec
        assert self.local is not None  # every FileRef made has a local path, a hub origin or both
        return self.local

    @property
    def name(self) -> str:
        return os.path.basename(self.remote.file if self.remote else (self.local or ""))


@dataclass(frozen=True)
class ResolvedModel:
    spec: str  # what the user typed
    kind: str  # "registry" | "local" | "hf" | "demo"
    name: str  # what to call it in messages
    model: FileRef
    mmproj: FileRef | None
    entry: RegistryEntry | None = None
    quant: str | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def is_local(self) -> bool:
        return self.model.local is not None and (self.mmproj is None or self.mmproj.local is not None)

    def missing(self) -> list[FileRef]:
        """Remote files not in the local cache yet."""
        return [f for f in (self.model, self.mmproj) if f is not None and f.local is None]

    def local_paths(self) -> tuple[str, str | None]:
        if not self.is_local:
            raise InputError(f"{self.name} is not downloaded: run 'edgevlm pull {self.spec}'")
        return self.model.local, self.mmproj.local if self.mmproj else None  # type: ignore[return-value]

    def to_dict(self) -> dict[str, Any]:
        def f(ref: FileRef | None):
            if ref is None:
                return None
            return {"local": ref.local, "remote": ref.remote.spec if ref.remote else None}

        return {
            "spec": self.spec,
            "kind": self.kind,
            "name": self.name,
            "quant": self.quant,
            "model": f(self.model),
            "mmproj": f(self.mmproj),
            "notes": list(self.notes),
        }


def _looks_like_path(spec: str) -> bool:
    return os.sep in spec or (os.altsep or "/") in spec or spec.lower().endswith(".gguf") or spec.startswith((".", "~"))


def resolve(
    spec: str, mmproj: str | None = None, *, need_mmproj: bool = True, registry: Registry | None = None
) -> ResolvedModel:
    """Turn a ``--model`` spec (and an optional ``--mmproj`` spec) into files.

    Registry names, paths and ``demo`` need no network; an ``hf:`` spec lists the repo's files
    (to find its projector or its file of a quantisation), from the local cache when offline.

    ``need_mmproj=False`` (``plan``) lets a local model go without a projector when none is
    next to it (one that is found is still used). Raises InputError / ModelFileError with one
    clear line.
    """
    spec = spec.strip()
    if not spec:
        raise InputError("--model is empty")
    if spec.startswith("hf:"):
        r = _resolve_hf(spec)
    elif os.path.isfile(os.path.expanduser(spec)) or _looks_like_path(spec):
        r = _resolve_local(spec, mmproj is None, need_mmproj)
    elif spec == "demo" or spec.startswith("demo:"):
        r = _resolve_demo(spec)
    else:
        reg = registry or load_registry()
        entry, quant = reg.lookup(spec)
        r = _resolve_entry(spec, entry, quant)
    if mmproj:
        r = replace(r, mmproj=_resolve_mmproj_spec(mmproj))
    return r


def _resolve_mmproj_spec(spec: str) -> FileRef:
    if spec.startswith("hf:"):
        repo, rev, file, _ = _parse_hf(spec)
        if file is None:
            raise InputError(f"--mmproj {spec}: name the file (hf:owner/repo/mmproj-file.gguf)")
        return _cached_ref(RemoteFile(repo, file, rev))
    p = os.path.expanduser(spec)
    if not os.path.isfile(p):
        raise ModelFileError(
            f"{spec}: no such file" if not os.path.isdir(p) else f"{spec}: is a directory, not a GGUF file"
        )
    return FileRef(local=p)


def _cached_ref(rf: RemoteFile) -> FileRef:
    return FileRef(local=cached_path(rf.repo, rf.file, rf.revision), remote=rf)


def _resolve_entry(spec: str, entry: RegistryEntry, quant: str) -> ResolvedModel:
    f = entry.files[quant]
    model = RemoteFile(f.repo or entry.repo, f.file, entry.revision, f.size, f.sha256)
    m = entry.mmproj
    proj = RemoteFile(m.repo or entry.repo, m.file, entry.revision, m.size, m.sha256)
    return ResolvedModel(spec, "registry", f"{entry.name}:{quant}", _cached_ref(model), _cached_ref(proj), entry, quant)


def _parse_hf(spec: str) -> tuple[str, str, str | None, str | None]:
    """``hf:owner/repo[@rev][/path/file.gguf]`` or ``hf:owner/repo[@rev][:quant]``
    → (repo, revision, file or None, quant or None)."""
    body = spec[3:].strip("/")
    parts = body.split("/")
    if len(parts) < 2 or not parts[0] or not parts[1]:
        raise InputError(f"'{spec}' is not hf:owner/repo/file.gguf")
    owner, repo_part = parts[0], parts[1]
    file = "/".join(parts[2:]) or None
    quant = None
    if file is None:
        repo_part, _, quant = repo_part.partition(":")
    repo_part, _, rev = repo_part.partition("@")
    if not repo_part:
        raise InputError(f"'{spec}' is not hf:owner/repo/file.gguf")
    return f"{owner}/{repo_part}", rev or "main", file, quant or None


def _resolve_hf(spec: str) -> ResolvedModel:
    repo, rev, file, quant = _parse_hf(spec)
    listing: list[str] | None = None
    if file is None:
        listing = repo_files(repo, rev)
        file = pick_model_file(listing, quant, f"hf:{repo}")
    if not file.lower().endswith(".gguf"):
        raise InputError(f"{spec}: not a .gguf file")
    model = _cached_ref(RemoteFile(repo, file, rev))
    if listing is None:
        try:
            listing = repo_files(repo, rev)
        except DownloadError:  # offline / unreachable: the model may still be cached or planned
            listing = []
    cands = [f for f in listing if is_mmproj_name(f)]
    proj = _cached_ref(RemoteFile(repo, pick_mmproj_file(cands), rev)) if cands else None
    notes = () if proj else (f"hf:{repo}: no *mmproj*.gguf found in the repo; pass --mmproj",)
    return ResolvedModel(spec, "hf", model.label, model, proj, None, quant, notes)


def is_mmproj_name(name: str) -> bool:
    base = os.path.basename(name).lower()
    return "mmproj" in base and base.endswith(".gguf")


def pick_model_file(files: list[str], quant: str | None, where: str) -> str:
    """The text-model GGUF of a repo for a quantisation (default Q4_K_M, else the only one)."""
    ggufs = [f for f in files if f.lower().endswith(".gguf") and not is_mmproj_name(f)]
    if not ggufs:
        raise InputError(f"{where}: no text-model .gguf file in the repo")
    want = (quant or DEFAULT_QUANT).lower()
    hits = [f for f in ggufs if want in {m.lower() for m in _QUANT_RE.findall(os.path.basename(f))}]
    if len(hits) == 1 or (hits and quant is None):
        return sorted(hits)[0]
    if not hits and quant is None and len(ggufs) == 1:
        return ggufs[0]
    avail = sorted({m.lower() for f in ggufs for m in _QUANT_RE.findall(os.path.basename(f))})
    if hits:
        raise InputError(f"{where}: several files match {want}: {', '.join(sorted(hits))}; name one")
    raise InputError(
        f"{where}: no {want} file (quantisations there: {', '.join(avail) or 'unknown'}); add :QUANT or name the file"
    )


def pick_mmproj_file(cands: list[str]) -> str:
    def rank(name: str) -> tuple[int, str]:
        low = os.path.basename(name).lower()
        for i, tag in enumerate(_MMPROJ_PREFERENCE):
            if re.search(rf"(?<![a-z0-9]){tag}(?![a-z0-9])", low):
                return i, name
        return len(_MMPROJ_PREFERENCE), name

    return min(cands, key=rank)


def _resolve_local(spec: str, find_mmproj: bool, need: bool) -> ResolvedModel:
    path = os.path.expanduser(spec)
    if not os.path.exists(path):
        raise ModelFileError(f"{spec}: no such file")
    if os.path.isdir(path):
        raise ModelFileError(f"{spec}: is a directory, not a GGUF file (name the model file in it)")
    proj = None
    notes: tuple[str, ...] = ()
    if find_mmproj:
        found, note = find_mmproj_next_to(path, required=need)
        proj = FileRef(local=found) if found else None
        notes = (note,) if note else ()
    return ResolvedModel(spec, "local", spec, FileRef(local=path), proj, notes=notes)


def find_mmproj_next_to(model_path: str, required: bool = True) -> tuple[str | None, str | None]:
    """The projector in the model's folder whose output width fits the model: (path, note)."""

    folder = os.path.dirname(os.path.abspath(model_path))
    cands = sorted(
        p
        for p in glob.glob(os.path.join(glob.escape(folder), "*.gguf"))
        if is_mmproj_name(p) and os.path.abspath(p) != os.path.abspath(model_path)
    )
    shown = os.path.join(os.path.dirname(model_path), "*mmproj*.gguf")
    if not cands:
        if required:
            raise InputError(f"{model_path}: no vision projector next to it ({shown}); pass --mmproj")
        return None, None
    if len(cands) == 1:
        return cands[0], None
    try:
        n_embd = text_model_info(read_gguf(model_path)).n_embd
    except Exception:
        n_embd = None
    fits = []
    for c in cands:
        try:
            if n_embd is None or projector_info(read_gguf(c)).n_mmproj_embd == n_embd:
                fits.append(c)
        except Exception:
            continue
    if not fits:
        if required:
            raise InputError(
                f"{model_path}: none of the projectors next to it fits the model "
                f"({', '.join(os.path.basename(c) for c in cands)}); pass --mmproj"
            )
        return None, None
    chosen = pick_mmproj_file(fits)
    note = None
    if len(fits) > 1:
        note = (
            f"several projectors fit {os.path.basename(model_path)}; using "
            f"{os.path.basename(chosen)} (pass --mmproj to choose)"
        )
    return chosen, note


def _resolve_demo(spec: str) -> ResolvedModel:
    from .demo import (
        DEMO_MODEL,
        NO_GENERATED_PAIRS,
        TRAINED_NOTE,
        generated_pairs,
        trained_demo_dirs,
        trained_demo_pair,
    )

    family = spec.partition(":")[2]
    if not family:
        trained = trained_demo_pair()
        if trained is not None:
            return ResolvedModel(
                spec,
                "demo",
                "demo (toy VLM trained on edgevlm's synthetic world)",
                FileRef(local=str(trained[0])),
                FileRef(local=str(trained[1])),
                notes=(TRAINED_NOTE,),
            )
        family = "llava15"
    pairs = generated_pairs()
    if pairs is None:
        if spec == "demo":
            raise InputError(
                f"'demo': the trained pair ({DEMO_MODEL}) is in none of "
                f"{', '.join(map(str, trained_demo_dirs()))}, and {NO_GENERATED_PAIRS}"
            )
        raise InputError(f"'{spec}': {NO_GENERATED_PAIRS}")
    if family not in pairs.FAMILIES:
        raise InputError(f"'{spec}': no demo family '{family}' (choose from {', '.join(pairs.FAMILIES)})")
    pair = pairs.cached_model_pair(family, "tiny")
    return ResolvedModel(
        spec,
        "demo",
        f"demo ({family}, random weights)",
        FileRef(local=str(pair.model)),
        FileRef(local=str(pair.mmproj)),
        notes=(DEMO_NOTE.format(family=family),),
    )


__all__ = [
    "Registry",
    "RegistryEntry",
    "RegistryFile",
    "RemoteFile",
    "FileRef",
    "ResolvedModel",
    "load_registry",
    "parse_registry",
    "registry_path",
    "resolve",
    "find_mmproj_next_to",
    "pick_model_file",
    "pick_mmproj_file",
    "unknown_name_message",
    "DEMO_NOTE",
]
