"""Getting a model ready for a command: ``--model NAME`` resolved to local files (pulled when
needed), a plan from local files or remote headers, and the model loaded with a progress bar
on a terminal (the plan printed with ``--verbose``)."""

from __future__ import annotations

import os
import sys
from typing import Any

from ..api import load
from ..backend import native
from ..hub.download import ensure_local
from ..hub.listing import choose_model
from ..hub.registry import RemoteFile, resolve
from ..hub.remote import plan_resolved
from ..plan.devices import format_size, probe
from ..runtime.model import LoadedModel
from .common import CLIError, echo_err
from .render import render_plan

__all__ = ["LARGE_DOWNLOAD", "confirm_download", "load_model", "model_paths", "plan_for_spec"]


def _echo_notes(r) -> None:
    for n in r.notes:
        echo_err(f"note: {n}")


def plan_for_spec(model: str, mmproj: str | None, probe_result, wishes):
    """``edgevlm plan --model NAME``: resolve the spec and plan from local files or, for files
    not downloaded yet, from their remote GGUF headers (a few MB, cached on disk)."""
    r = resolve(model, mmproj, need_mmproj=False)
    _echo_notes(r)
    if not r.is_local:
        echo_err(f"planning {r.name} from its GGUF header{'s' if r.mmproj else ''} (nothing is downloaded)")
    return plan_resolved(r, probe_result, wishes)


LARGE_DOWNLOAD = 2**30  # a download past this asks first on a terminal (``--yes`` skips the question)


def _download_size(r) -> tuple[int, list[str]]:
    """Bytes (the registry's sizes; a file without one counts 0) and specs of what ``r`` lacks here."""
    total, specs = 0, []
    for ref in (r.model, r.mmproj):
        if ref is not None and ref.remote is not None and ref.local is None:
            total += ref.remote.size or 0
            specs.append(ref.remote.spec)
    return total, specs


def confirm_download(r, *, yes: bool, explicit: bool) -> None:
    """A download over ``LARGE_DOWNLOAD`` asks first on a terminal and says its size and where it
    goes; off a terminal it proceeds only for a model the user named (``--model``) or with ``yes``."""
    size, specs = _download_size(r)
    if yes or size <= LARGE_DOWNLOAD:
        return
    from huggingface_hub import constants

    what = f"{r.name}: {format_size(size)} to download ({', '.join(specs)}) into {constants.HF_HUB_CACHE}"
    if sys.stdin.isatty() and sys.stderr.isatty():
        import click

        if not click.confirm(f"{what}. Download?", default=True, err=True):
            raise CLIError(f"{r.name}: not downloaded (answered no)", 1)
    elif not explicit:
        raise CLIError(
            f"no --model given and the default is {what}; pass --yes to download it, or --model to choose", 2
        )


def model_paths(
    model: str | None,
    mmproj: str | None,
    *,
    probe_args: dict | None = None,
    wishes=None,
    quiet: bool = False,
    yes: bool = False,
) -> tuple[str, str]:
    """Local (model, mmproj) paths for ``chat`` / ``caption`` / ``batch`` / ``serve``.

    ``model`` is a path, registry name, ``hf:`` spec or ``demo``; None picks the registry's
    default, the first of its small models that fits (``$EDGEVLM_MODEL`` overrides). Remote files not in the cache are
    pulled first (progress on a terminal, sha256 verified; a large download asks first:
    ``confirm_download``); cached ones need no network. Callers check their own inputs first.
    Every caller then loads the model: without llama.cpp's libraries that is one line
    (``LibraryError``) before anything is resolved or downloaded.
    """
    native.require()
    if model is not None and mmproj is not None and os.path.isfile(model):
        return model, mmproj  # two local files: exactly what the command did before
    explicit = model is not None
    if model is None:
        if mmproj is not None:
            raise CLIError("--mmproj needs --model", 2)
        r, why = choose_model(probe(**(probe_args or {})), wishes)
        if not quiet:
            echo_err(why)
    else:
        r = resolve(model, mmproj)
    if not quiet:  # (--quiet: errors only)
        _echo_notes(r)
    if r.mmproj is None:
        raise CLIError(f"{r.name}: no vision projector found; pass --mmproj", 2)

    def on_file(role: str, rf: RemoteFile) -> None:
        if not quiet:
            echo_err(f"pulling {rf.spec} ({role})")

    if not r.is_local:
        confirm_download(r, yes=yes, explicit=explicit)
        res = ensure_local(r, progress=not quiet and sys.stderr.isatty(), on_file=on_file)
        r = res.resolved
    return r.local_paths()  # type: ignore[return-value]


def load_model(model: str, mmproj: str, verbose: bool, **opts: Any) -> LoadedModel:
    """``edgevlm.load`` with a progress bar while the model loads (stderr a terminal)."""
    if verbose or not sys.stderr.isatty():
        vlm = load(model, mmproj, verbose=verbose, **opts)
        if verbose and vlm.plan is not None:
            render_plan(vlm.plan, file=sys.stderr)
        return vlm
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(
        TextColumn("loading {task.description}"),
        BarColumn(),
        TimeElapsedColumn(),
        transient=True,
        console=Console(stderr=True),
    ) as progress:
        task = progress.add_task(model.rsplit("/", 1)[-1], total=1.0)
        return load(
            model, mmproj, verbose=False, progress_callback=lambda p: progress.update(task, completed=p), **opts
        )
