"""``edgevlm pull``, ``edgevlm models``, ``edgevlm rm``, and the ``--model NAME`` plumbing that
``plan``, ``chat`` and ``caption`` share.

The commands are plain ``click.Command`` objects, registered on the main group by ``cli.py``.
``python -m edgevlm.models_cmd`` runs them (and a name-aware ``plan``) as a group of their own.
"""

from __future__ import annotations

import json
import os
import sys

import click

from .cli_types import CLIError, handle_errors, plan_options, wishes_from


def _err(msg: str) -> None:
    click.echo(msg, err=True)


def _echo_notes(r) -> None:
    for n in r.notes:
        _err(f"note: {n}")


def _size(n: int, exact: bool = True) -> str:
    from .devices import format_size

    return ("" if exact else "~") + format_size(n)


def _show_progress(quiet: bool) -> bool:
    return not quiet and sys.stderr.isatty()


# --- shared by plan / chat / caption ---------------------------------------------------------

def plan_for_spec(model: str, mmproj: str | None, probe, wishes):
    """``edgevlm plan --model NAME``: resolve the spec and plan from local files or, for files
    not downloaded yet, from their remote GGUF headers (a few MB, cached on disk)."""
    from .hub import plan_resolved
    from .registry import resolve

    r = resolve(model, mmproj, need_mmproj=False)
    _echo_notes(r)
    if not r.is_local:
        _err(f"planning {r.name} from its GGUF header{'s' if r.mmproj else ''} "
             f"(nothing is downloaded)")
    return plan_resolved(r, probe, wishes)


def model_paths(model: str | None, mmproj: str | None, *, probe_args: dict | None = None,
                wishes=None, quiet: bool = False) -> tuple[str, str]:
    """Local (model, mmproj) paths for ``chat`` / ``caption``.

    ``model`` is a path, registry name, ``hf:`` spec or ``demo``; None picks the largest
    registry model that fits (``$EDGEVLM_MODEL`` overrides). Remote files not in the cache are
    pulled first (progress on a terminal, sha256 verified); cached ones need no network.
    """
    from .registry import resolve

    if model is not None and mmproj is not None and os.path.isfile(model):
        return model, mmproj  # two local files: exactly what the command did before
    if model is None:
        if mmproj is not None:
            raise CLIError("--mmproj needs --model", 2)
        from .devices import probe
        from .model_list import choose_model

        r, why = choose_model(probe(**(probe_args or {})), wishes)
        _err(why)
    else:
        r = resolve(model, mmproj)
    _echo_notes(r)
    if r.mmproj is None:
        raise CLIError(f"{r.name}: no vision projector found; pass --mmproj", 2)
    if not r.is_local:
        from .hub import ensure_local

        res = ensure_local(r, progress=_show_progress(quiet),
                           on_file=lambda role, rf: quiet or _err(f"pulling {rf.spec} ({role})"))
        r = res.resolved
    return r.local_paths()  # type: ignore[return-value]


# --- pull ------------------------------------------------------------------------------------

@click.command("pull")
@click.argument("name")
@click.option("--mmproj", help="Projector to pull instead of the one found for NAME (hf:owner/repo/file.gguf).")
@click.option("--verify", is_flag=True, help="Also re-hash files already in the cache.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bars and no summary.")
@handle_errors
def pull(name, mmproj, verify, quiet) -> None:
    """Download a model (text model + projector) into the Hugging Face cache, verified.

    NAME is a registry name (see 'edgevlm models'), NAME:QUANT, or hf:owner/repo/file.gguf.
    Uses huggingface_hub: its cache (HF_HOME), tokens (HF_TOKEN), HF_ENDPOINT and
    HF_HUB_OFFLINE; a connection dropped mid-file is resumed with a range request. Each new
    file is checked against the hub's sha256; a mismatch deletes it and exits 1.

    \b
    edgevlm pull llava-1.5-7b
    edgevlm pull qwen2.5-vl-3b:q8_0
    edgevlm pull hf:ggml-org/gemma-3-4b-it-GGUF/gemma-3-4b-it-Q4_K_M.gguf
    """
    from .hub import pull as do_pull

    def on_file(role, rf):
        if not quiet:
            _err(f"{role:<6}  {rf.spec}")

    def on_verify(done, total):
        if not quiet and sys.stderr.isatty():
            click.echo(f"\r        verifying sha256 {done / max(total, 1):4.0%}", err=True, nl=False)
            if done >= total:
                click.echo("\r" + " " * 40 + "\r", err=True, nl=False)

    res = do_pull(name, mmproj, progress=_show_progress(quiet), verify_existing=verify,
                  on_file=on_file, on_verify=on_verify)
    r = res.resolved
    _echo_notes(r)
    if quiet:
        return
    if not res.files:
        click.echo(f"{r.name}: local files, nothing to pull")
        return
    for role, d in res.files:
        state = "downloaded" if d.downloaded else "in the cache"
        if d.verified is not None:
            state += f", {d.verified.algo} ok"
        click.echo(f"{role:<6}  {os.path.basename(d.path):<44} {_size(d.size):>11}  {state}")
    if r.entry is not None and r.entry.notes:
        click.echo(f"note: {r.entry.notes}")
    click.echo(f"ready: edgevlm chat --model {name} --image photo.jpg \"Describe this image\"")


# --- models ----------------------------------------------------------------------------------

@click.command("models")
@click.option("--check", is_flag=True,
              help="Read the GGUF headers of models not planned yet (a few MB each, network).")
@plan_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON list.")
@handle_errors
def models(check, ctx, ngl, kv, image_tokens, n_images, free_memory, device, gpu_overhead, as_json) -> None:
    """List registry models and downloaded ones: size, local or not, and whether the plan says
    each fits this machine (--free-memory etc. plan for another one).

    \b
    edgevlm models
    edgevlm models --check --free-memory 8GiB
    """
    from .devices import probe
    from .hub import settings
    from .model_list import list_models
    from .registry import registry_path

    pr = probe(device, list(free_memory), gpu_overhead)
    rows = list_models(pr, wishes_from(ctx, ngl, kv, image_tokens, n_images), check=check)
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in rows], indent=2))
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(highlight=False, soft_wrap=True)
    t = Table(box=None, title_justify="left", pad_edge=False)
    for col in ("NAME", "PARAMS", "SIZE", "LOCAL", "FITS THIS MACHINE", "LICENSE"):
        t.add_column(col, justify="right" if col == "SIZE" else "left", no_wrap=col != "FITS THIS MACHINE")
    for r in rows:
        fit_style = {True: "green", False: "red", None: "dim"}[r.fits]
        t.add_row(r.name, r.params, _size(r.size, r.size_exact), r.local, Text(r.fit, style=fit_style), r.license)
    console.print(t)
    devs = " + ".join(f"{d.name} {_size(d.free_bytes)} free" for d in pr.devices)
    console.print(f"planned for {devs}; ~ = approximate size from the registry", style="dim", markup=False)
    if any(r.fits is None and r.fit == "? not planned yet" for r in rows):
        console.print("? = GGUF header not read yet: 'edgevlm models --check' reads them (a few MB "
                      "each), or 'edgevlm plan --model NAME'", style="dim", markup=False)
    console.print(f"registry {registry_path()} · hub cache {settings().cache_dir}", style="dim", markup=False)


# --- rm --------------------------------------------------------------------------------------

@click.command("rm")
@click.argument("names", nargs=-1, required=True)
@handle_errors
def rm(names) -> None:
    """Delete downloaded models from the Hugging Face cache.

    NAME removes every quantisation of a registry model and its projector; NAME:QUANT removes
    that file (the projector goes once no other quantisation is left); hf:owner/repo/file.gguf
    removes that file.

    \b
    edgevlm rm llava-1.5-7b
    """
    from .hub import remove

    total = 0
    for name in names:
        for file, freed in remove(name):
            click.echo(f"removed {file} ({_size(freed)})")
            total += freed
    if len(names) > 1:
        click.echo(f"freed {_size(total)}")


__all__ = ["pull", "models", "rm", "plan_for_spec", "model_paths"]
