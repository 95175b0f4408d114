"""``edgevlm caption``: the click command (batch captioning of image folders)."""

from __future__ import annotations

import functools
import json
import sys
from dataclasses import dataclass

import click

from ..caption.inputs import parse_shard
from ..caption.settings import CaptionSettings
from ..errors import EdgeVLMError
from .common import (
    AutoInt,
    CLIError,
    Size,
    audio_options,
    check_writable,
    handle_errors,
    json_schema_option,
    max_pixels_option,
    merge_option,
    plan_options,
    ray_options,
    sampling_options,
    threads_option,
    tiles_option,
    video_options,
    yes_option,
)
from .progress import ProgressView
from .signals import StopSignals

EXIT_CODES = """\b
Exit codes: 0 every image has a caption · 4 some images failed (their records have "error") ·
2 bad input (no images, bad options, unusable model files) · 1 llama.cpp or the disk failed
the run · 130 interrupted (Ctrl-C, SIGTERM): run the same command again to continue."""


class Shard(click.ParamType):
    """``I/N``: shard I of N (1-based)."""

    name = "I/N"

    def convert(self, value, param, ctx):
        if isinstance(value, tuple):
            return value
        try:
            return parse_shard(value)
        except EdgeVLMError as exc:  # one line, as every bad input (not click's usage text)
            raise CLIError(str(exc), 2) from None


@dataclass(frozen=True)
class Selection:
    """Which files the inputs become (``caption.inputs.discover``'s arguments)."""

    recursive: bool
    from_list: str | None
    null: bool
    include: tuple[str, ...]
    exclude: tuple[str, ...]
    shard: tuple[int, int] | None


def selection_options(fn):
    @functools.wraps(fn)
    def wrapper(*args, recursive, from_list, null, include, exclude, shard, **kwargs):
        return fn(
            *args, selection=Selection(recursive, from_list, null, tuple(include), tuple(exclude), shard), **kwargs
        )

    for opt in reversed(
        [
            click.option("--recursive", "-r", is_flag=True, help="Enter subdirectories."),
            click.option("--from-list", "from_list", metavar="FILE", help="Read input paths from FILE (- = stdin)."),
            click.option("--null", "-0", is_flag=True, help="The list is NUL-separated (find -print0)."),
            click.option("--include", multiple=True, metavar="PATTERN", help="Only files matching (repeatable)."),
            click.option(
                "--exclude", multiple=True, metavar="PATTERN", help="Skip files / folders matching (repeatable)."
            ),
            click.option("--shard", type=Shard(), help="Caption only shard I of N (1-based; deterministic split)."),
        ]
    ):
        wrapper = opt(wrapper)
    return wrapper


@dataclass(frozen=True)
class Output:
    """Where the captions go (``CaptionJob``'s output arguments)."""

    out: str | None
    fmt: str
    existing: str
    separator: str
    root: str | None
    sidecar_ext: str


def output_options(fn):
    @functools.wraps(fn)
    def wrapper(*args, out, fmt, existing, separator, root, sidecar_ext, **kwargs):
        return fn(*args, output=Output(out, fmt, existing, separator, root, sidecar_ext), **kwargs)

    for opt in reversed(
        [
            click.option(
                "--out",
                "-o",
                metavar="PATH",
                help="Record file [default: captions.jsonl, captions.csv, captions.parquet/]; "
                "{shard} becomes I-of-N with --shard.",
            ),
            click.option(
                "--format",
                "fmt",
                type=click.Choice(["jsonl", "csv", "parquet", "txt", "metadata"]),
                default="jsonl",
                show_default=True,
                help="parquet: a folder of shards (pip install 'edgevlm[parquet]'); txt: "
                "<stem>.txt beside each image; metadata: HF imagefolder metadata.jsonl.",
            ),
            click.option(
                "--existing",
                type=click.Choice(["skip", "overwrite", "append", "prepend"]),
                default="skip",
                show_default=True,
                help="txt / metadata: what to do with a caption already there.",
            ),
            click.option(
                "--separator", default=" ", show_default=True, help="Joins old and new caption (append/prepend)."
            ),
            click.option(
                "--root",
                type=click.Path(file_okay=False),
                help="metadata: the dataset folder [default: the folder holding all the images].",
            ),
            click.option("--sidecar-ext", default=".txt", show_default=True, help="txt: caption file extension."),
        ]
    ):
        wrapper = opt(wrapper)
    return wrapper


@click.command(epilog=EXIT_CODES)
@click.argument("inputs", nargs=-1)
@click.option(
    "--model",
    "-m",
    help="GGUF path, registry name (llava-1.5-7b), hf:owner/repo/file.gguf, or demo "
    "(default: the registry's small default that fits, see edgevlm models; $EDGEVLM_MODEL).",
)
@click.option("--mmproj", help="Vision projector (path or hf: spec); found automatically for names.")
@selection_options
@output_options
@click.option("--prompt", "-p", default=None, help="Instruction; may use {name} {filename} {path} {existing}.")
@click.option("--system", help="System prompt (evaluated once, reused for every image).")
@click.option("--prefix", default="", help="Text put before every caption (trigger words).")
@click.option("--suffix", default="", help="Text put after every caption.")
@click.option("--clean", is_flag=True, help='Strip preambles ("The image shows ..."), quotes, line breaks.')
@sampling_options(CaptionSettings.max_tokens, CaptionSettings().sampling())
@tiles_option
@video_options
@audio_options
@merge_option
@json_schema_option('each caption (the parsed object goes into the record as "json")')
@plan_options
@threads_option
@max_pixels_option("Images with more pixels get an error record (decompression-bomb guard).")
@click.option(
    "--max-file-size", type=Size(), default="1GiB", show_default=True, help="Larger files get an error record."
)
@click.option("--retry-errors", is_flag=True, help="Caption again the images whose earlier record is an error.")
@click.option(
    "--parallel",
    type=AutoInt(),
    default="auto",
    show_default=True,
    help="Images in flight, their captions generated in one batch (auto: up to 4, as "
    "many as the context holds; 1: one at a time).",
)
@click.option(
    "--prefetch", default=2, show_default=True, type=click.IntRange(1, 64), help="Images decoded ahead of the model."
)
@click.option(
    "--progress",
    type=click.Choice(["auto", "bar", "json", "none"]),
    default="auto",
    show_default=True,
    help="auto: a bar when stderr is a terminal; json: one object per line.",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress and no summary (errors still show).")
@click.option("--dry-run", is_flag=True, help="List the images this run would work on, and stop.")
@ray_options("images", "Caption")
@click.option("--verbose", "-v", is_flag=True, help="Show llama.cpp's own logs.")
@yes_option
@handle_errors
def caption(
    inputs,
    model,
    mmproj,
    selection,
    output,
    prompt,
    system,
    prefix,
    suffix,
    clean,
    reply,
    tiles,
    video,
    audio,
    merge,
    json_schema,
    planning,
    threads,
    max_pixels,
    max_file_size,
    retry_errors,
    parallel,
    prefetch,
    progress,
    quiet,
    dry_run,
    ray,
    verbose,
    yes,
) -> None:
    """Caption images in bulk: files, folders, globs or a list; resumable.

    \b
    edgevlm caption -m model.gguf --mmproj mmproj.gguf photos/ --recursive
    edgevlm caption -m ... --mmproj ... photos/ --format txt --prefix "ohwx, " --clean
    find . -name '*.jpg' | edgevlm caption -m ... --mmproj ... --from-list - --format csv
    edgevlm caption -m ... --mmproj ... photos/ -r --shard 2/4 --out part2.jsonl
    edgevlm caption -m llava-1.5-7b photos/ -r --ray auto --format parquet

    Run the same command again after a crash or Ctrl-C: images already captioned (same image
    bytes, prompt, model and settings) are skipped; each record is written atomically.
    """
    from ..caption import (
        DEFAULT_PROMPT,
        CaptionJob,
        caption_slots,
    )
    from ..caption.inputs import discover
    from ..jobs.stop import StopToken

    sel, dest = selection, output
    out = dest.out
    if not inputs and sel.from_list is None:
        raise CLIError("give images, folders or globs to caption, or --from-list FILE", 2)
    if parallel is not None and parallel < 1:
        raise CLIError(f"--parallel {parallel}: give 1 or more images in flight, or auto", 2)
    if sel.from_list == "-" and "-" in inputs:
        raise CLIError("'-' is not an input; use --from-list - to read paths from stdin", 2)
    settings = CaptionSettings(
        prompt=prompt if prompt is not None else DEFAULT_PROMPT,
        system=system,
        prefix=prefix,
        suffix=suffix,
        clean=clean,
        max_tokens=reply.max_tokens,
        temperature=reply.sampling.temperature,
        top_k=reply.sampling.top_k,
        top_p=reply.sampling.top_p,
        min_p=reply.sampling.min_p,
        seed=reply.sampling.seed,
        stop=reply.stop,
        image_tokens=planning.wishes.image_tokens,
        tiles=tiles,
        video=video,
        audio=audio,
        merge=str(merge),
        max_pixels=max_pixels,
        max_file_bytes=max_file_size,
        json_schema=json.dumps(json_schema, sort_keys=True) if json_schema else None,
    )
    settings.validate()
    shard_ix = sel.shard
    if out and "{shard}" in out:
        if shard_ix is None:
            raise CLIError(f"--out {out}: {{shard}} needs --shard I/N", 2)
        out = out.replace("{shard}", f"{shard_ix[0]}-of-{shard_ix[1]}")
    found = discover(
        inputs,
        recursive=sel.recursive,
        from_list=sel.from_list,
        null=sel.null,
        include=sel.include,
        exclude=sel.exclude,
        shard=shard_ix,
    )
    ui = ProgressView("none" if quiet else progress, quiet)
    for pattern in found.unmatched:
        ui.note(f"note: {pattern}: no match")
    if not found.items:
        if found.sharded_out:
            ui.note(f"shard {shard_ix[0]}/{shard_ix[1]}: no images in this shard ({found.sharded_out} in others)")
            return
        hints = []
        if found.ignored:
            hints.append(f"{found.ignored} file(s) are not images")
        if found.dirs_not_entered:
            hints.append(f"{found.dirs_not_entered} folder(s) not entered (use --recursive)")
        raise CLIError("no images found" + (f": {'; '.join(hints)}" if hints else ""), 2)

    if out:  # where the records go, before any download or load
        check_writable(out, folder_ok=dest.fmt in ("parquet", "txt", "metadata"))
    identity = None
    if ray.address is not None:
        from .ray_run import ray_preflight

        identity, model, mmproj = ray_preflight(model, mmproj, dest.fmt, dry_run)
    elif not dry_run:  # a dry run downloads nothing
        from .loading import model_paths

        model, mmproj = model_paths(
            model, mmproj, quiet=quiet, probe_args=planning.probe_args, wishes=planning.wishes, yes=yes
        )
    else:  # the records' key needs the model's files: those already here, else none is checked
        model, mmproj = _files_here(model, mmproj)
        if mmproj is None:
            identity = (model or "(auto)", "")
    job = CaptionJob(
        found.items,
        settings,
        model=model or "(auto)",
        mmproj=mmproj,
        out=out,
        fmt=dest.fmt,
        existing=dest.existing,
        separator=dest.separator,
        root=dest.root or found.root,
        sidecar_ext=dest.sidecar_ext,
        retry_errors=retry_errors,
        identity=identity,
    )
    if dry_run:
        checked = identity is None or bool(identity[1])
        have = job.recorded_paths() if checked else set()
        for it in found.items:
            click.echo(it.path)
        ignored = f", {found.ignored} other file(s) ignored" if found.ignored else ""
        if checked:
            done = sum(1 for it in found.items if it.path in have)
            ui.note(f"{len(found.items)} image(s), {done} with a record in {job.out}{ignored}")
        else:
            ui.note(
                f"{len(found.items)} image(s){ignored}; records in {job.out} not checked: the model's "
                "files are not here (a dry run downloads nothing; give --model and --mmproj paths)"
            )
        return
    job.open()
    token = StopToken()
    sig = StopSignals(token, ui)
    if ray.address is not None:
        from .ray_run import caption_with_ray

        try:
            summary = caption_with_ray(
                job, ray.address, model, mmproj, planning, threads, parallel, ray.actors, ray.batch, verbose, ui, sig
            )
        finally:
            job.close()
        sys.exit(summary.exit_code)
    vlm = None
    try:
        with sig:
            try:
                if job.index.other_settings:
                    ui.note(
                        f"note: {job.out} also holds {job.index.other_settings} record(s) made with "
                        "other settings (prompt, model, ...): they are kept, new ones are added beside them"
                    )
                if job.needs_model():
                    from ..runtime.engine import EngineOptions
                    from ..runtime.scheduler import THROUGHPUT
                    from .loading import load_model

                    vlm = load_model(
                        model,
                        mmproj,
                        verbose,
                        options=EngineOptions(system=settings.system, merge=merge),
                        wishes=planning.wishes,
                        n_threads=threads,
                        **planning.probe_args,
                        n_seq_max=lambda plan: caption_slots(plan.n_ctx, plan.image_max_tokens, settings, parallel),
                        scheduler_options=THROUGHPUT,  # nobody watches a caption stream
                    )
                    if merge.enabled and not vlm.merging:
                        ui.note(
                            f"note: --merge ignored: {vlm.backend.proj_info.projector_type} tokens "
                            f"are not on a spatial grid"
                        )
                    if parallel and vlm.scheduler.max_running < parallel:
                        ui.note(
                            f"note: --parallel {parallel}: the context ({vlm.n_ctx} tokens) holds "
                            f"{vlm.scheduler.max_running} image(s) in flight; use a larger --ctx for more"
                        )
                ui.start(job, dest.fmt)
                sig.running = True
                summary = job.run(vlm, stop=token, prefetch=prefetch, on_result=ui.update)
            except KeyboardInterrupt:  # stopped while the model was loading
                summary = job.summary
                summary.interrupted = True
            finally:
                sig.closing = True  # from here on we stop anyway: later signals are ignored
                ui.stop()
                if vlm is not None:
                    vlm.close()
            ui.finish(summary, job)
    finally:
        job.close()
    sys.exit(summary.exit_code)


__all__ = ["caption"]


def _files_here(model: str | None, mmproj: str | None) -> tuple[str | None, str | None]:
    """``--model``/``--mmproj`` as files already on this machine (a name resolved without a
    download); (model, None) when they are not here or no model was named."""
    if model is None:
        return None, None
    from ..hub.registry import resolve

    try:
        r = resolve(model, mmproj)
    except EdgeVLMError:
        return model, None
    if not r.is_local or r.mmproj is None:
        return model, None
    return r.local_paths()
