"""``edgevlm plan``: the memory plan for a model on this machine (or a what-if one)."""

from __future__ import annotations

import json
import os

import click

from .common import CLIError, handle_errors, plan_options

__all__ = ["plan"]


@click.command()
@click.option(
    "--model",
    "-m",
    required=True,
    help="GGUF path, registry name (llava-1.5-7b[:q8_0]), hf:owner/repo/file.gguf, or demo.",
)
@click.option("--mmproj", help="Vision projector (path or hf: spec); found automatically for names.")
@plan_options
@click.option("--explain", is_flag=True, help="Show every lever in the degradation order and what it saved.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as one JSON object.")
@handle_errors
def plan(model, mmproj, planning, explain, as_json) -> None:
    """Plan GPU layers, context, KV types and the encoder's place from measured free memory.

    \b
    edgevlm plan -m model.gguf --mmproj mmproj.gguf
    edgevlm plan -m model.gguf --mmproj mmproj.gguf --free-memory 8GiB --json
    edgevlm plan -m model.gguf --mmproj mmproj.gguf --free-memory 4GiB --explain
    """
    from ..plan.planner import make_plan
    from .render import render_plan

    pr = planning.probe()
    wishes = planning.wishes
    if os.path.isfile(model):
        p = make_plan(model, mmproj, pr, wishes)  # local files
    else:
        from .loading import plan_for_spec

        p = plan_for_spec(model, mmproj, pr, wishes)  # names / hf: / demo: header-only if not pulled
    if as_json:
        click.echo(json.dumps(p.to_dict(), indent=2))
    else:
        render_plan(p, explain=explain)
    if not p.fits:
        raise CLIError(p.refusal or "does not fit", 1)
