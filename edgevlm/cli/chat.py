"""``edgevlm chat``: load (with a progress bar on a terminal), then either answer one prompt or
run the chat session (``repl``)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

import click

from ..backend.sampling import CHAT_REPLY
from .common import (
    audio_options,
    echo_err,
    handle_errors,
    json_schema_option,
    max_pixels_option,
    merge_option,
    plan_options,
    sampling_options,
    threads_option,
    tiles_option,
    video_options,
    yes_option,
)

__all__ = ["chat"]


@click.command()
@click.argument("prompt", required=False)
@click.option(
    "--model",
    "-m",
    help="GGUF path, registry name (llava-1.5-7b), hf:owner/repo/file.gguf, or demo "
    "(default: the registry's small default that fits, see edgevlm models; $EDGEVLM_MODEL).",
)
@click.option("--mmproj", help="Vision projector (path or hf: spec); found automatically for names.")
@click.option(
    "--image",
    "-i",
    "images",
    multiple=True,
    type=click.Path(dir_okay=False),
    help="Image for the first message (repeatable).",
)
@click.option(
    "--video",
    "videos",
    multiple=True,
    type=click.Path(dir_okay=False, exists=True),
    help="Video for the first message (repeatable): frames chosen under its budget, each with its timestamp.",
)
@video_options
@click.option(
    "--audio",
    "sounds",
    multiple=True,
    type=click.Path(dir_okay=False, exists=True),
    help="Recording for the first message (repeatable; WAV, FLAC, MP3, Ogg/Opus, or a video's sound track), "
    "for models with an audio encoder: long silences dropped, cut to its budget, pieces timestamped.",
)
@audio_options
@click.option("--system", help="System prompt.")
@sampling_options(CHAT_REPLY.max_tokens, CHAT_REPLY.sampling)
@tiles_option
@click.option(
    "--evict",
    type=click.Choice(["summary", "off"]),
    default="summary",
    show_default=True,
    help="When the context is full: replace old images by their summary, or fail.",
)
@click.option("--summary-prompt", help="Prompt used to summarise an image ({n}, {name}).")
@merge_option
@plan_options
@threads_option
@max_pixels_option("Refuse images with more pixels than this (decompression-bomb guard).")
@json_schema_option("the answer")
@click.option("--stats", "show_stats", is_flag=True, help="Print a one-line stats footer to stderr.")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="One-shot: print one JSON object {text, stats} ({text, json, stats} with --json-schema).",
)
@click.option(
    "--session",
    "session_file",
    type=click.Path(dir_okay=False),
    help="Continue the conversation saved at this file (if it exists: no picture encoded again, no "
    "prefix evaluated again) and save it back after every turn.",
)
@click.option("--verbose", "-v", is_flag=True, help="Show llama.cpp's own logs.")
@yes_option
@handle_errors
def chat(
    prompt,
    model,
    mmproj,
    images,
    videos,
    video,
    sounds,
    audio,
    system,
    reply,
    tiles,
    evict,
    summary_prompt,
    merge,
    planning,
    threads,
    max_pixels,
    json_schema,
    show_stats,
    as_json,
    session_file,
    verbose,
    yes,
) -> None:
    """Chat with a vision-language model about images.

    \b
    One-shot:     edgevlm chat -m model.gguf --mmproj mmproj.gguf -i photo.jpg "Describe it"
    Interactive:  edgevlm chat -m model.gguf --mmproj mmproj.gguf
    Scripted:     printf '/image a.png\\nWhat is it?\\n' | edgevlm chat -m ... --mmproj ...
    Structured:   edgevlm chat -m ... -i photo.jpg --json-schema tags.json "Tag this picture"
    Video:        edgevlm chat -m ... --video clip.mp4 --video-tokens 2048 "What happens, and when?"
    Audio:        edgevlm chat -m ... --audio voice.mp3 "Transcribe this."
    """
    from ..runtime.engine import Clip, EngineOptions, Sound
    from ..runtime.intake import FetchRules, load_media
    from ..runtime.jsongrammar import json_grammar
    from ..runtime.saved import session_binding
    from ..runtime.session import SessionOptions
    from .loading import load_model, model_paths
    from .repl import ChatLoop

    # the schema and the pictures first: what cannot be used is said before anything is downloaded or loaded
    grammar = json_grammar(json_schema, "--json-schema") if json_schema else None
    pictures = load_media(images, max_pixels)
    if session_file and os.path.exists(session_file):  # plan the context the saved cells were made in
        planning = replace(planning, wishes=session_wishes(planning.wishes, session_binding(session_file)))
    model, mmproj = model_paths(
        model, mmproj, quiet=as_json, probe_args=planning.probe_args, wishes=planning.wishes, yes=yes
    )
    session = SessionOptions(enabled=evict == "summary")
    if summary_prompt:
        session = SessionOptions(enabled=session.enabled, summary_prompt=summary_prompt)
    options = EngineOptions(
        system=system,
        image_tokens=planning.wishes.image_tokens,
        tiles=tiles,
        merge=merge,
        max_image_pixels=max_pixels,
        session=session,
        video=video,
        audio=audio,
        fetch=FetchRules(allow_private_urls=True),  # (a URL on the user's own command line: theirs to name)
    )
    s = reply.sampling
    gen = dict(
        max_tokens=reply.max_tokens,
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
        min_p=s.min_p,
        seed=s.seed,
        stop=list(reply.stop),
        grammar=grammar,
    )
    vlm = load_model(
        model, mmproj, verbose, options=options, wishes=planning.wishes, n_threads=threads, **planning.probe_args
    )
    if merge.enabled and not vlm.merging:
        echo_err(f"note: --merge ignored: {vlm.backend.proj_info.projector_type} tokens are not on a spatial grid")
    try:
        engine = vlm.conversation()  # the chat's own conversation (the REPL's too)
        if session_file and os.path.exists(session_file):
            info = engine.load(session_file)
            if not as_json:
                echo_err(f"continuing {info.describe()}")
                flush_notices(engine)
        clips = [Clip(v, v) for v in videos] + [Sound(a, a) for a in sounds]
        if prompt is not None:
            code = _one_shot(engine, prompt, [*pictures, *clips], gen, show_stats, as_json, session_file)
        else:
            loop = ChatLoop(engine, gen, interactive=sys.stdin.isatty(), show_stats=show_stats, session=session_file)
            loop.queued = [*pictures, *clips]
            code = loop.run()
    finally:
        vlm.close()
    sys.exit(code)


def session_wishes(wishes, bound):
    """The wishes a saved conversation's binding implies where the user left the planner to
    choose (context, KV types, flash attention, image budget); what the user gave stays, and a
    difference is refused when the file is loaded, naming it."""
    from ..model.kv_types import KV_CHOICES

    changes: dict = {}
    if wishes.n_ctx is None:
        changes["n_ctx"] = bound.n_ctx
    if wishes.kv == "auto" and bound.type_k == bound.type_v and bound.type_k in KV_CHOICES:
        changes["kv"] = bound.type_k
    if wishes.flash_attn is None:
        changes["flash_attn"] = bound.flash_attn
    most = int(bound.image_budget.split("-")[-1] or 0)
    if wishes.image_tokens is None and most > 0:
        changes["image_tokens"] = most
    return replace(wishes, **changes)


def _one_shot(
    engine, prompt: str, images: list, gen: dict, show_stats: bool, as_json: bool, session: str | None = None
) -> int:
    loaded = engine.load_images(images)  # bad images fail before any work
    for img in loaded:
        for note in getattr(img, "notes", ()):  # (a clip's notes come when its frames are chosen)
            echo_err(f"note: {img.source}: {note}")
    if as_json:
        try:
            result = engine.chat(prompt, loaded, **gen)
        except KeyboardInterrupt:
            return 130
        flush_notices(engine)
        out = {"text": result.text.strip()}
        if gen.get("grammar"):
            out["json"] = parse_json_reply(result.text, result.finish_reason)
        out["stats"] = result.stats.to_dict()
        if session:
            out["session"] = _session_json(engine, engine.save(session))
        print(json.dumps(out))
        return 0
    started = False
    stream = engine.stream(prompt, loaded, **gen)
    try:
        for resp in stream:
            if resp.stats is None:  # (the last one's notices, a reply cut short, come after it)
                flush_notices(engine)
            piece = resp.text if started else resp.text.lstrip()
            started = started or bool(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
    except KeyboardInterrupt:
        stream.close()
        sys.stdout.write("\n")
        return 130
    sys.stdout.write("\n")
    sys.stdout.flush()
    flush_notices(engine)
    if show_stats and engine.last_stats:
        echo_err(engine.last_stats.footer())
    if session:
        echo_err(f"saved {engine.save(session).describe()}")
    return 0


def _session_json(engine, saved) -> dict:
    """``--json``'s ``session``: what came from the file (0 when it did not exist) and what was saved."""
    got = engine.restored
    return {
        "path": saved.path,
        "restored_tokens": got.tokens if got else 0,
        "restored_pictures": got.pictures if got else 0,
        "restored_messages": got.messages if got else 0,
        "saved_tokens": saved.tokens,
        "saved_pictures": saved.pictures,
        "saved_bytes": saved.bytes,
    }


def parse_json_reply(text: str, finish_reason: str):
    """The object a grammar-constrained reply holds; an unfinished one is a one-line error."""
    from ..errors import InputError

    try:
        return json.loads(text)
    except ValueError:
        why = " (it hit --max-tokens; raise it)" if finish_reason == "length" else ""
        raise InputError(f"the answer is not complete JSON{why}") from None


def flush_notices(engine) -> None:
    for notice in engine.notices:
        echo_err(f"note: {notice}")
    engine.notices.clear()
