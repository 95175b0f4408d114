"""``edgevlm pull``, ``edgevlm models``, ``edgevlm rm``: models by name in the hub cache."""

from __future__ import annotations

import json
import os
import sys

import click

from .common import handle_errors, plan_options

__all__ = ["models", "pull", "rm"]


def _err(msg: str) -> None:
    click.echo(msg, err=True)


def _echo_notes(r) -> None:
    for n in r.notes:
        _err(f"note: {n}")


def _size(n: int, exact: bool = True) -> str:
    from ..plan.devices import format_size

    return ("" if exact else "~") + format_size(n)


def _show_progress(quiet: bool) -> bool:
    return not quiet and sys.stderr.isatty()


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
    from ..hub.download import pull as do_pull

    def on_file(role, rf):
        if not quiet:
            _err(f"{role:<6}  {rf.spec}")

    def on_verify(done, total):
        if not quiet and sys.stderr.isatty():
            click.echo(f"\r        verifying sha256 {done / max(total, 1):4.0%}", err=True, nl=False)
            if done >= total:
                click.echo("\r" + " " * 40 + "\r", err=True, nl=False)

    res = do_pull(
        name, mmproj, progress=_show_progress(quiet), verify_existing=verify, on_file=on_file, on_verify=on_verify
    )
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
    click.echo(f'ready: edgevlm chat --model {name} --image photo.jpg "Describe this image"')


# --- models ----------------------------------------------------------------------------------


@click.command("models")
@click.option("--check", is_flag=True, help="Read the GGUF headers of models not planned yet (a few MB each, network).")
@plan_options
@click.option("--json", "as_json", is_flag=True, help="Print one JSON list.")
@handle_errors
def models(check, planning, as_json) -> None:
    """List registry models and downloaded ones: size, local or not, and whether the plan says
    each fits this machine (--free-memory etc. plan for another one).

    \b
    edgevlm models
    edgevlm models --check --free-memory 8GiB
    """
    from ..backend import native
    from ..hub.listing import list_models
    from ..hub.registry import registry_path
    from ..hub.store import settings

    lib = native.failure()  # the listing needs no llama.cpp, the verdicts do
    if lib is not None:
        _err(f"note: no model is planned: {lib.line()}")
    pr = None if lib else planning.probe()
    rows = list_models(pr, planning.wishes, check=check, no_plan="no llama.cpp" if lib else "")
    if as_json:
        click.echo(json.dumps([r.to_dict() for r in rows], indent=2))
        return
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    console = Console(highlight=False, soft_wrap=True)
    t = Table(box=None, title_justify="left", pad_edge=False, padding=(0, 1), collapse_padding=True)
    # one line a model in 80 columns: every column on one line, the license cut first when narrow
    for col in ("NAME", "PARAMS", "SIZE", "LOCAL", "FITS THIS MACHINE", "LICENSE"):
        t.add_column(
            col,
            justify="right" if col == "SIZE" else "left",
            no_wrap=True,
            overflow="ellipsis",
            min_width={"NAME": max((len(r.name) for r in rows), default=4), "PARAMS": 6, "LOCAL": 5}.get(col),
            max_width=14 if col == "LICENSE" else None,
        )
    for r in rows:
        fit_style = {True: "green", False: "red", None: "dim"}[r.fits]
        t.add_row(r.name, r.params, _size(r.size, r.size_exact), r.local, Text(r.fit, style=fit_style), r.license)
    console.print(t)
    devs = " + ".join(f"{d.name} {_size(d.free_bytes)} free" for d in pr.devices) if pr else ""
    planned = f"planned for {devs}" if pr else "not planned (llama.cpp did not load: edgevlm doctor)"
    console.print(f"{planned}; ~ = approximate size from the registry", style="dim", markup=False)
    if any(r.fits is None and r.fit == "? not planned yet" for r in rows):
        console.print(
            "? = GGUF header not read yet: 'edgevlm models --check' reads them (a few MB "
            "each), or 'edgevlm plan --model NAME'",
            style="dim",
            markup=False,
        )
    console.print(f"registry {registry_path()} · hub cache {settings().cache_dir}", style="dim", markup=False)
    console.print(default_line(rows), markup=False)


def default_line(rows) -> str:
    """Which model runs without --model, and why (the registry's ``default``)."""
    import os

    from ..hub.registry import load_registry

    if os.environ.get("EDGEVLM_MODEL"):
        return f"without --model: {os.environ['EDGEVLM_MODEL']} ($EDGEVLM_MODEL)"
    reg = load_registry()
    fits = {r.name: r.fits for r in rows}
    order = list(reg.default)
    chosen = next((n for n in order if fits.get(n)), None)
    unknown = [n for n in order if fits.get(n) is None]
    if chosen is None or unknown[:1] and order.index(unknown[0]) < order.index(chosen):
        head = f"without --model: the first of {', '.join(order)} that fits (--check plans them)"
    else:
        head = f"without --model: {chosen}, the first of {', '.join(order)} that fits this machine"
    return head + (f" — {reg.default_why}" if reg.default_why else "")


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
    from ..hub.download import remove

    total = 0
    for name in names:
        for file, freed in remove(name):
            click.echo(f"removed {file} ({_size(freed)})")
            total += freed
    if len(names) > 1:
        click.echo(f"freed {_size(total)}")
