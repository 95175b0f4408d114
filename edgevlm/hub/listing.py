"""Which models there are and which fits: the registry and the local cache listed with sizes
and a plan verdict (``edgevlm models``), and the default model when none is given."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..errors import DownloadError, InputError
from ..plan.devices import probe as measure_devices
from .registry import FileRef, RemoteFile, ResolvedModel, is_mmproj_name, load_registry, pick_mmproj_file, resolve
from .remote import cached_header, plan_resolved
from .store import commit_for, first_line, settings, short_error

__all__ = ["ModelRow", "choose_model", "list_models"]


# --- listing models -----------------------------------------------------------------------


@dataclass
class ModelRow:
    name: str
    title: str
    repo: str
    files: list[str]
    size: int  # bytes, model + mmproj
    size_exact: bool
    local: str  # "yes" | "partial" | "no"
    fits: bool | None  # None: unknown (header not read, or the planner could not say)
    fit: str  # one-line verdict
    license: str = ""
    params: str = ""
    paths: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _fit_verdict(plan) -> tuple[bool, str]:
    if not plan.fits:
        return False, f"no ({plan.shortfall_bytes / 2**30:.1f} GiB short)"
    gpu = [d for d in plan.devices if d.kind != "cpu"]
    if not gpu:
        where = "CPU"
    elif plan.n_gpu_layers == 0:
        where = "CPU (GPU too small)"
    else:
        where = f"{plan.n_gpu_layers} layers on {gpu[0].name}"
    return True, f"yes · {where} · ctx {plan.n_ctx}"


def _row_for(
    r: ResolvedModel, title: str, license: str, params: str, probe, wishes, check: bool, no_plan: str = ""
) -> ModelRow:
    refs = [f for f in (r.model, r.mmproj) if f is not None]
    local = sum(f.local is not None for f in refs)
    size, exact = 0, True
    for f in refs:
        if f.local is not None:
            size += os.path.getsize(f.local)
        else:
            hdr = cached_header(f.remote) if f.remote else None
            if hdr is not None:
                size += hdr.file_size
            else:
                size += (f.remote.size or 0) if f.remote else 0
                exact = False
    fits, verdict = None, f"? {no_plan}" if no_plan else "? not planned yet"
    try:
        if not no_plan:
            fits, verdict = _fit_verdict(plan_resolved(r, probe, wishes, fetch=check))
    except DownloadError as exc:
        if check:
            verdict = f"? {short_error(exc)}"
    except Exception as exc:  # a listing must not die on one odd model
        verdict = f"? {short_error(exc)}"
    return ModelRow(
        name=r.name,
        title=title,
        repo=r.model.remote.repo if r.model.remote else "",
        files=[f.name for f in refs],
        size=size,
        size_exact=exact,
        local="yes" if local == len(refs) else ("partial" if local else "no"),
        fits=fits,
        fit=verdict,
        license=license,
        params=params,
        paths=[f.local for f in refs if f.local],
    )


def list_models(probe=None, wishes=None, *, check: bool = False, no_plan: str = "") -> list[ModelRow]:
    """Registry models (default quantisation, plus any other one in the cache) and other GGUF
    repos found in the hub cache, with sizes and the planner's verdict for this machine
    (``no_plan``: why there is none, the verdict of every row instead)."""
    if probe is None and not no_plan:
        probe = measure_devices()
    reg = load_registry()
    rows: list[ModelRow] = []
    seen: set[tuple[str, str]] = set()
    for e in reg.entries:
        for q in e.quants:
            r = resolve(f"{e.name}:{q}", registry=reg)
            is_default = q == e.default_quant
            if not is_default and r.model.local is None:
                continue
            row = _row_for(r, e.title, e.license, e.params, probe, wishes, check, no_plan)
            row.name = e.name if is_default else f"{e.name}:{q}"
            rows.append(row)
            for f in (r.model, r.mmproj):
                if f is not None and f.remote is not None:
                    seen.add((f.remote.repo, f.remote.file))
    rows.extend(_unregistered_rows(seen, probe, wishes, no_plan))
    return rows


def _unregistered_rows(seen: set[tuple[str, str]], probe, wishes, no_plan: str = "") -> list[ModelRow]:
    root = Path(settings().cache_dir)
    if not root.is_dir():
        return []
    out = []
    for repo_dir in sorted(root.glob("models--*")):
        repo = repo_dir.name[len("models--") :].replace("--", "/", 1)
        commit = commit_for(repo_dir, "main")
        snaps = [repo_dir / "snapshots" / commit] if commit else sorted((repo_dir / "snapshots").glob("*"))
        for snap in snaps:
            if not snap.is_dir():
                continue
            files = sorted(str(p.relative_to(snap)).replace(os.sep, "/") for p in snap.rglob("*.gguf"))
            projs = [f for f in files if is_mmproj_name(f)]
            for f in files:
                if is_mmproj_name(f) or (repo, f) in seen:
                    continue
                rev = "main" if snap.name == commit else snap.name
                model = FileRef(str(snap / f), RemoteFile(repo, f, rev))
                proj = (
                    FileRef(str(snap / pick_mmproj_file(projs)), RemoteFile(repo, pick_mmproj_file(projs), rev))
                    if projs
                    else None
                )
                r = ResolvedModel(model.label, "hf", model.label, model, proj)
                out.append(_row_for(r, "(not in the registry)", "", "", probe, wishes, False, no_plan))
    return out


# --- choosing a model when none is given --------------------------------------------------


def choose_model(probe, wishes=None, *, fetch: bool = True) -> tuple[ResolvedModel, str]:
    """``$EDGEVLM_MODEL``, else the registry's default: the first of its ``default.order`` whose
    plan fits this machine (a registry without one: its smallest model that fits)."""
    env = os.environ.get("EDGEVLM_MODEL")
    if env:
        return resolve(env), f"EDGEVLM_MODEL={env}"
    reg = load_registry()
    by_name = {e.name: e for e in reg.entries}
    order = [by_name[n] for n in reg.default] or sorted(reg.entries, key=lambda e: e.approx_size())
    tried: list[str] = []
    for e in order:
        r = resolve(e.name, registry=reg)
        try:
            plan = plan_resolved(r, probe, wishes, fetch=fetch and not settings().offline)
        except Exception as exc:  # try the next one
            tried.append(f"{e.name}: {first_line(exc)}")
            continue
        if plan.fits:
            _, verdict = _fit_verdict(plan)
            size = e.approx_size() / 2**30
            why = reg.default_why or "the smallest registry model"
            return r, (
                f"no --model given: {e.name} ({size:.1f} GiB), the default here by the plan "
                f"({verdict.removeprefix('yes · ')}): {why}; pass --model or set EDGEVLM_MODEL to choose"
            )
        tried.append(f"{e.name}: does not fit")
    detail = "; ".join(tried[:3])
    raise InputError(
        f"no --model given and no default model could be planned to fit ({detail}); "
        f"pass --model NAME, or --model demo to try the pipeline offline"
    )
