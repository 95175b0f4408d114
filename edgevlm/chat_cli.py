"""What ``edgevlm chat`` does once click has parsed it: load (with a progress bar on a
terminal), then either answer one prompt or run the chat loop."""

from __future__ import annotations

import json
import sys
from typing import Any

from .api import load
from .engine import Engine
from .errors import EdgeVLMError
from .repl import ChatLoop


def _load(model: str, mmproj: str, verbose: bool, **opts: Any) -> Engine:
    if verbose or not sys.stderr.isatty():
        engine = load(model, mmproj, verbose=verbose, **opts)
        if verbose and engine.plan is not None:
            from .cli import render_plan

            render_plan(engine.plan, file=sys.stderr)
        return engine
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("loading {task.description}"), BarColumn(), TimeElapsedColumn(),
                  transient=True, console=_stderr_console()) as progress:
        task = progress.add_task(model.rsplit("/", 1)[-1], total=1.0)
        return load(model, mmproj, verbose=False,
                    progress_callback=lambda p: progress.update(task, completed=p), **opts)


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def run_chat(*, prompt: str | None, model: str, mmproj: str, images: list[str], system: str | None,
             gen: dict, load_options: dict, max_pixels: int, show_stats: bool, as_json: bool,
             verbose: bool, image_tokens: int | None = None, tiles: str | int = "auto",
             evict: str = "summary", summary_prompt: str | None = None, merge: str = "off") -> int:
    from .merge import NO_GRID, MergeSpec

    spec = MergeSpec.parse(merge)  # bad values fail before the model loads
    engine = _load(model, mmproj, verbose, system=system, merge=merge, **load_options)
    if spec.enabled and engine.backend.proj_info.projector_type in NO_GRID:
        print(f"note: --merge ignored: {engine.backend.proj_info.projector_type} tokens are not on a "
              f"spatial grid", file=sys.stderr)
    engine.max_image_pixels = max_pixels
    engine.image_tokens = image_tokens
    engine.tiles = tiles
    engine.session.enabled = evict == "summary"
    if summary_prompt:
        engine.session.summary_prompt = summary_prompt
    try:
        if prompt is not None:
            return _one_shot(engine, prompt, images, gen, show_stats, as_json)
        loop = ChatLoop(engine, gen, interactive=sys.stdin.isatty(), show_stats=show_stats)
        loop.queued = list(images)
        return loop.run()
    finally:
        engine.close()


def _one_shot(engine: Engine, prompt: str, images: list[str], gen: dict, show_stats: bool,
              as_json: bool) -> int:
    loaded = engine.load_images(images)  # bad images fail before any work
    for img in loaded:
        for note in img.notes:
            print(f"note: {img.source}: {note}", file=sys.stderr)
    if as_json:
        try:
            result = engine.chat(prompt, loaded, **gen)
        except KeyboardInterrupt:
            return 130
        flush_notices(engine)
        print(json.dumps({"text": result.text.strip(), "stats": result.stats.to_dict()}))
        return 0
    started = False
    stream = engine.stream(prompt, loaded, **gen)
    try:
        for resp in stream:
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
    if show_stats and engine.last_stats:
        print(engine.last_stats.footer(), file=sys.stderr)
    return 0


def flush_notices(engine: Engine) -> None:
    for notice in engine.notices:
        print(f"note: {notice}", file=sys.stderr)
    engine.notices.clear()


__all__ = ["run_chat", "flush_notices", "EdgeVLMError"]
