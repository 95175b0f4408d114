"""``edgevlm budget``: what an image costs before the encoder runs, and which views it becomes;
for a clip, which frames are kept, at what size, and what they cost."""

from __future__ import annotations

import json
from dataclasses import replace

import click

from ..vision.video import VideoBudget
from .common import Tiles, handle_errors, max_pixels_option

__all__ = ["budget"]


@click.command()
@click.argument("image", metavar="IMAGE|CLIP", type=click.Path(dir_okay=False))
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
@click.option(
    "--video-tokens",
    type=click.IntRange(1),
    help="Token budget for a whole clip (default: with --model, the room chat gives a first turn's pictures; "
    "without, 8 pictures' worth of the projector's default image budget).",
)
@click.option("--max-frames", type=click.IntRange(1), help="A clip: at most this many frames.")
@click.option(
    "--fps",
    type=click.FloatRange(min=0, min_open=True),
    default=VideoBudget.fps,
    show_default=True,
    help="A clip: at most this many frames per second are looked at (a cap, not a promise).",
)
@click.option(
    "--overlay", type=click.Path(dir_okay=False), help="Write a PNG showing the views (a clip: a contact sheet)."
)
@max_pixels_option("Refuse images with more pixels than this (decompression-bomb guard).")
@click.option("--json", "as_json", is_flag=True, help="Print the image (or clip) plan as JSON.")
@handle_errors
def budget(
    image, mmproj, model, image_tokens, video_tokens, max_frames, fps, tiles, scorer, overlay, max_pixels, as_json
) -> None:
    """Show how an image is split and budgeted before the encoder runs; for a clip
    (MP4/WebM/MOV/MKV/AVI, animated GIF/WebP), which frames are kept and what they cost.

    \b
    edgevlm budget photo.jpg --mmproj mmproj.gguf --image-tokens 2304 --overlay views.png
    edgevlm budget photo.jpg --model demo
    edgevlm budget clip.mp4 --mmproj mmproj.gguf --video-tokens 4096 --overlay frames.png
    """
    import os

    from ..backend import native
    from ..errors import UnsupportedModel
    from ..hub.registry import resolve
    from ..model.gguf_info import load_projector
    from ..model.projectors import facts
    from ..plan.planner import image_budget
    from ..runtime.intake import Intake
    from ..vision.budget import ImageBudget, draw_overlay
    from ..vision.images import load_image
    from .common import CLIError, echo_err

    if model is not None:
        native.require()  # mtmd counts with the text model: one line before any note if llama.cpp did not load
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
    from ..vision.video import is_video_file

    if is_video_file(image):  # by extension, else by content (animated GIF/WebP too)
        return _budget_clip(image, model, mmproj, proj, image_tokens, video_tokens, max_frames, fps, overlay, as_json)
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
            ip = Intake(counter.proj_info, ImageBudget(counter.proj_info, tokens, tiles, mtmd_cap, scorer)).plan_image(
                img
            )
    else:
        try:
            tokens = image_budget(proj, image_tokens)[0]
            mtmd_cap = tokens if facts(proj).dynamic else None
            source = "this projector's default"
            ip = Intake(proj, ImageBudget(proj, tokens, tiles, mtmd_cap, scorer)).plan_image(img)
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


def _budget_clip(path, model, mmproj, proj, image_tokens, video_tokens, max_frames, fps, overlay, as_json) -> None:
    """``edgevlm budget CLIP``: the frames chosen under the clip's budget, as chat would send them."""
    from ..backend.sampling import CHAT_REPLY
    from ..errors import UnsupportedModel
    from ..model.projectors import facts
    from ..plan.context import ContextBudget
    from ..plan.planner import image_budget
    from ..runtime.intake import Intake, MediaRef
    from ..vision.budget import ImageBudget
    from ..vision.sheet import draw_contact_sheet
    from ..vision.video import VideoBudget, VideoPlan, default_video_tokens, frame_text_tokens

    vb = VideoBudget(tokens=video_tokens, max_frames=max_frames, fps=fps)
    if model is not None:  # the plan's context and per-picture budget; mtmd counts
        from ..backend.counting import ImageCounter
        from ..plan.devices import probe
        from ..plan.planner import Wishes, make_plan

        plan = make_plan(model, mmproj, probe(), Wishes(image_tokens=image_tokens))
        per_picture, mtmd_cap = plan.image_max_tokens or None, plan.backend_options()["image_max_tokens"]
        room = ContextBudget(plan.n_ctx).image_room(CHAT_REPLY.max_tokens)  # what chat gives a first turn
        source = f"the room pictures have in the plan's {plan.n_ctx}-token context, as chat gives it"
        with ImageCounter(model, mmproj, image_max_tokens=mtmd_cap) as counter:
            text = frame_text_tokens(counter.tokenize_text)  # (as chat counts each frame's label)
            budget = ImageBudget(counter.proj_info, per_picture, mtmd_max_tokens=mtmd_cap)
            made = Intake(counter.proj_info, budget, video=vb, frame_text=text).views(MediaRef(path, "video"), room)
    else:
        try:
            per_picture = image_budget(proj, image_tokens)[0]
            mtmd_cap = per_picture if facts(proj).dynamic else None
            room = None
            if video_tokens is None:
                vb = VideoBudget(default_video_tokens(proj, per_picture), max_frames, fps)
            source = f"8 pictures of this projector's default {per_picture}-token image budget"
            budget = ImageBudget(proj, per_picture, mtmd_max_tokens=mtmd_cap)
            made = Intake(proj, budget, video=vb).views(MediaRef(path, "video"))
        except UnsupportedModel as exc:
            raise UnsupportedModel(f"{exc}; give the text model (--model) and mtmd counts them") from None
    vp, frames = made.plan, made.views
    assert isinstance(vp, VideoPlan)  # (a video ref is planned as one)
    notes = [n for n in vp.notes if not n.startswith("budget ")]
    if video_tokens is None:
        notes.insert(0, f"budget {vp.budget} tokens for the clip: {source} (--video-tokens changes it)")
    elif room is not None and vp.budget < video_tokens:
        notes.insert(0, f"budget {vp.budget} tokens: the {source} is less than --video-tokens {video_tokens}")
    if overlay:
        draw_contact_sheet(frames, vp, overlay)
    if as_json:
        d = {"video": path, **vp.to_dict(), "notes": notes}
        click.echo(json.dumps(d, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, soft_wrap=True)
    kept = vp.kept
    title = (
        f"{path} {vp.width}x{vp.height} · {vp.duration:.1f} s at {vp.source_fps:g} fps · {len(kept)} of "
        f"{len(vp.frames)} frames kept · total {vp.total_tokens} tokens (budget {vp.budget})"
    )
    t = Table(title=title, title_justify="left", box=None)
    for col in ("frame", "time", "sent as", "tokens", "kept"):
        t.add_column(col, justify="right" if col in ("frame", "tokens") else "left")
    rows = vp.frames
    i = 0
    while i < len(rows):
        f = rows[i]
        j = i
        while not f.kept and j + 1 < len(rows) and not rows[j + 1].kept:
            j += 1
        if j - i >= 2:  # a run of frames left out: one row, its reasons counted
            counts: dict[str, int] = {}
            for r in rows[i : j + 1]:
                counts[r.reason] = counts.get(r.reason, 0) + 1
            why = ", ".join(f"{k} ×{n}" for k, n in counts.items())
            t.add_row(f"{f.index}–{rows[j].index}", f"{f.label}–{rows[j].label}", "", "", f"- {why}")
            i = j + 1
            continue
        pair = " (pair)" if f.mergeable else ""
        t.add_row(
            str(f.index),
            f.label,
            f"{f.size[0]}x{f.size[1]}" if f.kept else "",
            str(f.tokens) if f.kept else "",
            (f"yes{pair}" if f.reason == "kept" else f"yes, {f.reason}{pair}") if f.kept else f"- {f.reason}",
        )
        i += 1
    console.print(t)
    console.print(f"rule: {vp.rule}")
    for n in notes:
        console.print(f"note: {n}")
    if overlay:
        console.print(f"contact sheet written to {overlay}")
