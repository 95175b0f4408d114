"""``edgevlm caption``: the click command (batch captioning of image folders)."""

from __future__ import annotations

import click


@click.command(context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def caption(args) -> None:
    """Caption folders of images, resumably (not yet implemented)."""
    from .cli import CLIError

    raise CLIError("'edgevlm caption' is not implemented yet (planned in issue #7)", 3)
