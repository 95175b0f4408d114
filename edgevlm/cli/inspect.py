"""``edgevlm inspect``: what a GGUF model or projector holds (no weights loaded)."""

from __future__ import annotations

import json

import click

from .common import ImageSize, handle_errors

__all__ = ["inspect"]


@click.command()
@click.argument("file", type=click.Path(dir_okay=False))
@click.option("--mmproj", type=click.Path(dir_okay=False), help="Vision projector to check against FILE.")
@click.option(
    "--image-size",
    type=ImageSize(),
    default=None,
    help="Image size for the token count (default: the projector's native size).",
)
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@handle_errors
def inspect(file, mmproj, image_size, as_json) -> None:
    """Show what a GGUF model or projector holds (metadata and tensor table only).

    \b
    edgevlm inspect model.gguf
    edgevlm inspect model.gguf --mmproj mmproj.gguf --json
    """
    from ..model.inspect import inspect_files, pair_error
    from .render import render_inspect

    report = inspect_files(file, mmproj, image_size)
    if as_json:
        click.echo(json.dumps(report, indent=2))
    else:
        render_inspect(report)
    err = pair_error(report)
    if err is not None:
        raise err
