"""``edgevlm budget``: what an image costs before the encoder runs, and which views it becomes."""

from __future__ import annotations

import json
from dataclasses import replace

import click

from .common import Tiles, handle_errors, max_pixels_option

__all__ = ["budget"]


@click.command()
@click.argument("image", type=click.Path(dir_okay=False))
@click.option("--mmproj", type=click.Path(dir_okay=False), help="Vision projector GGUF (found for model names).")
@click.option(
    "--model",
    "-m",
    help="The text model: a GGUF path, or a downloaded registry name, hf: spec or demo. With it, mtmd itself "
    "counts the tokens (needed for projector types edgevlm has no arithmetic for; its vocabulary is read, not "
    "its weights) and the budget is the plan's, as chat's.",
)
@click.option("--image-tokens", type=click.IntRange(1), help="Token budget for this image.")
@click.option(
    "--tiles", type=Tiles(), default="auto", show_default=True, help="Detail tiles for fixed-size encoders (LLaVA-1.5)."
)
@click.option(
    "--scorer",
    type=click.Choice(["edges", "entropy", "compress"]),
    default="edges",
    show_default=True,
    help="How tile detail is scored.",
)
@click.option("--overlay", type=click.Path(dir_okay=False), help="Write a PNG showing the views.")
@max_pixels_option("Refuse images with more pixels than this (decompression-bomb guard).")
@click.option("--json", "as_json", is_flag=True, help="Print the image plan as JSON.")
@handle_errors
def budget(image, mmproj, model, image_tokens, tiles, scorer, overlay, max_pixels, as_json) -> None:
    """Show how an image is split and budgeted before the encoder runs.

    \b
    edgevlm budget photo.jpg --mmproj mmproj.gguf --image-tokens 2304 --overlay views.png
    edgevlm budget photo.jpg --model demo
    """
    import os

    from ..errors import UnsupportedModel
    from ..hub.registry import resolve
    from ..model.gguf_info import load_projector
    from ..model.projectors import facts
    from ..plan.planner import image_budget
    from ..vision.budget import ImageBudget, draw_overlay
    from ..vision.images import load_image
    from .common import CLIError, echo_err

    if model is not None and not (mmproj is not None and os.path.isfile(model)):
        r = resolve(model, mmproj)  # a name: its files, when they are here (budget downloads nothing)
        for n in r.notes:
            echo_err(f"note: {n}")
        if r.mmproj is None:
            raise CLIError(f"{r.name}: no vision projector found; pass --mmproj", 2)
        model, mmproj = r.local_paths()
    if mmproj is None:
        raise CLIError("give the vision projector (--mmproj), or the model (--model) to find it", 2)
    proj = load_projector(mmproj)
    img = load_image(image, max_pixels)
    # the budget chat, serve and caption give this picture with default options: with the text
    # model, the plan's (memory may lower a dynamic one; mtmd gets it as its own limit); without,
    # the projector's default
    if model is not None:
        from ..backend.counting import ImageCounter
        from ..plan.devices import probe
        from ..plan.planner import Wishes, make_plan

        plan = make_plan(model, mmproj, probe(), Wishes(image_tokens=image_tokens))
        tokens, mtmd_cap = plan.image_max_tokens or None, plan.backend_options()["image_max_tokens"]
        source = "the plan's, as chat loads this pair"
        with ImageCounter(model, mmproj, image_max_tokens=mtmd_cap) as counter:
            ip = ImageBudget(counter.proj_info, tokens, tiles, mtmd_cap, scorer).plan(img)
    else:
        try:
            tokens = image_budget(proj, image_tokens)[0]
            mtmd_cap = tokens if facts(proj).dynamic else None
            source = "this projector's default"
            ip = ImageBudget(proj, tokens, tiles, mtmd_cap, scorer).plan(img)
        except UnsupportedModel as exc:
            raise UnsupportedModel(f"{exc}; give the text model (--model) and mtmd counts them") from None
    if image_tokens is None:
        ip = replace(ip, notes=(*ip.notes, f"budget {tokens} tokens per image: {source} (--image-tokens changes it)"))
    if overlay:
        draw_overlay(img, ip, overlay)
    if as_json:
        click.echo(json.dumps({"image": image, "projector_type": proj.projector_type, **ip.to_dict()}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, soft_wrap=True)
    title = f"{image} {img.width}x{img.height} · {ip.kind} · total {ip.total_tokens} tokens" + (
        f" (budget {tokens})" if tokens else ""
    )
    t = Table(title=title, title_justify="left", box=None)
    for col in ("view", "box", "sent as", "tokens", "score", "selected"):
        t.add_column(col, justify="right" if col in ("tokens", "score") else "left")
    for v in ip.views:
        t.add_row(
            v.label,
            "{},{}–{},{}".format(*v.box),
            f"{v.size[0]}x{v.size[1]}",
            str(v.tokens),
            "" if v.score is None else f"{v.score:.2f}",
            "yes" if v.selected else "-",
        )
    console.print(t)
    for n in ip.notes:
        console.print(f"note: {n}")
    if overlay:
        console.print(f"overlay written to {overlay}")
