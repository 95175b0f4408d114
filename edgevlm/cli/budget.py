"""``edgevlm budget``: what an image costs before the encoder runs, and which views it becomes;
for a clip, which frames are kept, at what size, and what they cost; for a recording, which
pieces are sent (silences dropped, cut to its budget) and what they cost."""

from __future__ import annotations

import json
from dataclasses import replace

import click

from ..backend.sampling import CHAT_REPLY
from .common import audio_options, handle_errors, max_pixels_option, plan_options, tiles_option, video_options

__all__ = ["budget"]


@click.command()
@click.argument("image", metavar="IMAGE|CLIP|AUDIO", type=click.Path(dir_okay=False))
@click.option("--mmproj", type=click.Path(dir_okay=False), help="Vision projector GGUF (found for model names).")
@click.option(
    "--model",
    "-m",
    help="The text model: a GGUF path, or a downloaded registry name, hf: spec or demo. With it, what chat "
    "sends with the same flags: the plan's budget and context, and mtmd's own count (needed for projector "
    "types edgevlm has no arithmetic for; its vocabulary is read, not its weights).",
)
@tiles_option
@click.option(
    "--scorer",
    type=click.Choice(["edges", "entropy", "compress"]),
    default="edges",
    show_default=True,
    help="How tile detail is scored (the other commands use edges).",
)
@video_options
@audio_options
@click.option(
    "--max-tokens",
    "-n",
    default=CHAT_REPLY.max_tokens,
    show_default=True,
    type=click.IntRange(1),
    help="With --model: the reply chat keeps room for (a clip's default budget is the room a first turn's "
    "pictures have beside it).",
)
@plan_options
@click.option(
    "--overlay", type=click.Path(dir_okay=False), help="Write a PNG showing the views (a clip: a contact sheet)."
)
@max_pixels_option("Refuse images with more pixels than this (decompression-bomb guard).")
@click.option("--json", "as_json", is_flag=True, help="Print the image (or clip) plan as JSON.")
@handle_errors
def budget(
    image, mmproj, model, tiles, scorer, video, audio, max_tokens, planning, overlay, max_pixels, as_json
) -> None:
    """Show how an image is split and budgeted before the encoder runs; for a clip
    (MP4/WebM/MOV/MKV/AVI, animated GIF/WebP), which frames are kept and what they cost; for a
    recording (WAV/FLAC/MP3/Ogg), the pieces sent, their times and tokens.
    With --model, exactly what `edgevlm chat -i IMAGE|CLIP` (`--audio AUDIO`) sends on a first
    turn with the same flags (the guard aside: it weighs the memory free when the request comes).

    \b
    edgevlm budget photo.jpg --mmproj mmproj.gguf --image-tokens 2304 --overlay views.png
    edgevlm budget photo.jpg --model demo
    edgevlm budget clip.mp4 --mmproj mmproj.gguf --video-tokens 4096 --overlay frames.png
    edgevlm budget voice.mp3 --mmproj mmproj.gguf --audio-tokens 2000 --json
    """
    import os

    from ..backend import native
    from ..errors import DoesNotFit, UnsupportedModel
    from ..hub.registry import resolve
    from ..model.gguf_info import load_projector
    from ..runtime.engine import EngineOptions
    from ..runtime.intake import Intake, MediaRef, load_media
    from ..vision.budget import ImagePlan, draw_overlay
    from ..vision.images import LoadedImage
    from ..vision.video import DEFAULT_VIDEO_PICTURES
    from .common import CLIError, echo_err

    image_tokens = planning.wishes.image_tokens
    # the flags as chat parses them; the picture checked (a clip: found) as chat checks its own
    options = EngineOptions(
        image_tokens=image_tokens, tiles=tiles, max_image_pixels=max_pixels, video=video, audio=audio
    )
    (media,) = load_media([image], max_pixels)
    if model is not None:
        native.require()  # mtmd counts with the text model: one line before any note if llama.cpp did not load
    if model is not None and not (mmproj is not None and os.path.isfile(model)):
        r = resolve(model, mmproj)  # a name: its files, when they are here (budget downloads nothing)
        for n in r.notes:
            echo_err(f"note: {n}")
        if r.mmproj is None:
            raise CLIError(f"{r.name}: no projector found; pass --mmproj", 2)
        model, mmproj = r.local_paths()
    if mmproj is None:
        raise CLIError("give the projector (--mmproj), or the model (--model) to find it", 2)
    if model is not None:
        # chat's intake and room: the plan chat loads this pair with (same wishes, same probe), the
        # room its first turn gives pictures beside the reply, frame labels by the model's tokenizer
        from ..backend.counting import ImageCounter
        from ..plan.context import ContextBudget
        from ..plan.planner import make_plan
        from ..vision.video import frame_text_tokens

        plan = make_plan(model, mmproj, planning.probe(), planning.wishes)
        if not plan.fits:  # (chat sends nothing: it refuses to load, as here)
            raise DoesNotFit(plan.refusal or "the model does not fit in the memory available")
        mtmd_cap = plan.backend_options()["image_max_tokens"]
        room = ContextBudget(plan.n_ctx).image_room(max_tokens)
        with ImageCounter(model, mmproj, image_max_tokens=mtmd_cap) as counter:
            intake = Intake.for_caller(
                counter.proj_info,
                options,
                plan.image_max_tokens,
                mtmd_cap,
                scorer=scorer,
                frame_text=frame_text_tokens(counter.tokenize_text),
            )
            (made,), _ = intake.message([media], room)
        proj = counter.proj_info
        source = "the plan's, as chat loads this pair"
        clip_source = (
            f"the room pictures have in the plan's {plan.n_ctx}-token context beside a {max_tokens}-token reply, "
            "as chat gives it"
        )
    else:
        proj = load_projector(mmproj)
        try:
            if isinstance(media, MediaRef) and media.kind == "audio":  # (no picture budget for a recording)
                intake = Intake.for_audio(proj, options)
            else:
                intake = Intake.for_projector(proj, options, scorer=scorer)
            made = intake.views(media if isinstance(media, MediaRef) else MediaRef(media, "image", name=media.source))
        except UnsupportedModel as exc:
            raise UnsupportedModel(f"{exc}; give the text model (--model) and mtmd counts them") from None
        room = None
        source = "this projector's default"
        clip_source = (
            f"{DEFAULT_VIDEO_PICTURES} pictures of the {intake.budget.tokens}-token image budget (no context is "
            "known without --model)"
        )
    if made.kind == "audio":
        return _show_audio(image, made, audio.tokens, room, clip_source, as_json)
    if made.kind == "video":
        return _show_clip(image, made, video.tokens, room, clip_source, overlay, as_json)
    ip, img, tokens = made.plan, media, intake.budget.tokens
    assert isinstance(ip, ImagePlan)  # (a picture is planned as one)
    assert isinstance(img, LoadedImage)  # (and was decoded by load_media)
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


def _show_clip(path, made, video_tokens, room, source, overlay, as_json) -> None:
    """``edgevlm budget CLIP``: the frames chosen under the clip's budget, as chat sends them."""
    from ..vision.sheet import draw_contact_sheet
    from ..vision.video import VideoPlan

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


def _show_audio(path, made, audio_tokens, room, source, as_json) -> None:
    """``edgevlm budget AUDIO``: the pieces a recording is sent as, as chat sends them."""
    ap = made.plan
    notes = list(ap.notes)
    if audio_tokens is None and room is not None:
        notes.insert(0, f"budget {ap.budget_tokens} tokens for the recording: {source} (--audio-tokens changes it)")
    if as_json:
        click.echo(json.dumps({"audio": path, "key": made.key, **ap.to_dict(), "notes": notes}, indent=2))
        return
    from rich.console import Console
    from rich.table import Table

    console = Console(highlight=False, soft_wrap=True)
    budget = f" (budget {ap.budget_tokens})" if ap.budget_tokens is not None else ""
    title = f"{path} · {ap.duration_s:.1f} s · {len(made.views)} piece(s) · total {ap.total_tokens} tokens{budget}"
    t = Table(title=title, title_justify="left", box=None)
    for col in ("piece", "times", "seconds", "tokens"):
        t.add_column(col, justify="left" if col == "times" else "right")
    for i, p in enumerate(made.views, 1):
        t.add_row(str(i), p.label, f"{len(p.samples) / 16000:.1f}", str(p.tokens))
    console.print(t)
    console.print(f"rule: {ap.rule}")
    for n in notes:
        console.print(f"note: {n}")
