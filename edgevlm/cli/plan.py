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
@click.option(
    "--check",
    is_flag=True,
    help="Set the plan's compute buffers against llama.cpp's own dry run of it (local model files; allocates nothing).",
)
@handle_errors
def plan(model, mmproj, planning, explain, as_json, check) -> None:
    """Plan GPU layers, context, KV types and the encoder's place from measured free memory.

    \b
    edgevlm plan -m model.gguf --mmproj mmproj.gguf
    edgevlm plan -m model.gguf --mmproj mmproj.gguf --free-memory 8GiB --json
    edgevlm plan -m model.gguf --mmproj mmproj.gguf --free-memory 4GiB --explain
    edgevlm plan -m model.gguf --mmproj mmproj.gguf --ngl 2 --check
    """
    from ..plan.planner import make_plan
    from .render import render_check, render_plan

    pr = planning.probe()
    wishes = planning.wishes
    if os.path.isfile(model):
        p = make_plan(model, mmproj, pr, wishes)  # local files
    else:
        from .loading import plan_for_spec

        p = plan_for_spec(model, mmproj, pr, wishes)  # names / hf: / demo: header-only if not pulled
    rows = None
    if check:
        from ..plan.check import check_plan

        if not os.path.isfile(p.model):
            raise CLIError(f"{p.model}: --check needs the model file on this machine (edgevlm pull it first)")
        rows = check_plan(p)
    if as_json:
        d = p.to_dict()
        if rows is not None:
            d["check"] = [r.to_dict() for r in rows]
        click.echo(json.dumps(d, indent=2))
    else:
        render_plan(p, explain=explain)
        if rows is not None:
            render_check(rows)
    if not p.fits:
        raise CLIError(p.refusal or "does not fit", 1)
