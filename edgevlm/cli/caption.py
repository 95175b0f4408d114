"""``edgevlm caption``: the click command (batch captioning of image folders)."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections import deque
from typing import Any

import click

from .common import (
    AutoInt,
    CLIError,
    Merge,
    Size,
    Tiles,
    handle_errors,
    json_schema_option,
    max_pixels_option,
    plan_options,
    sampling_options,
)

EXIT_CODES = """\b
Exit codes: 0 every image has a caption · 4 some images failed (their records have "error") ·
2 bad input (no images, bad options, unusable model files) · 1 llama.cpp or the disk failed
the run · 130 interrupted (Ctrl-C, SIGTERM): run the same command again to continue."""


@click.command(epilog=EXIT_CODES)
@click.argument("inputs", nargs=-1)
@click.option("--model", "-m",
              help="GGUF path, registry name (llava-1.5-7b), hf:owner/repo/file.gguf, or demo "
                   "(default: the largest registry model that fits; $EDGEVLM_MODEL).")
@click.option("--mmproj", help="Vision projector (path or hf: spec); found automatically for names.")
@click.option("--recursive", "-r", is_flag=True, help="Enter subdirectories.")
@click.option("--from-list", "from_list", metavar="FILE", help="Read input paths from FILE (- = stdin).")
@click.option("--null", "-0", is_flag=True, help="The list is NUL-separated (find -print0).")
@click.option("--include", multiple=True, metavar="PATTERN", help="Only files matching (repeatable).")
@click.option("--exclude", multiple=True, metavar="PATTERN", help="Skip files / folders matching (repeatable).")
@click.option("--shard", metavar="I/N", help="Caption only shard I of N (1-based; deterministic split).")
@click.option("--out", "-o", metavar="PATH",
              help="Record file [default: captions.jsonl, captions.csv with --format csv]; "
                   "{shard} becomes I-of-N with --shard.")
@click.option("--format", "fmt", type=click.Choice(["jsonl", "csv", "txt", "metadata"]), default="jsonl",
              show_default=True, help="txt: <stem>.txt beside each image; metadata: HF imagefolder metadata.jsonl.")
@click.option("--existing", type=click.Choice(["skip", "overwrite", "append", "prepend"]), default="skip",
              show_default=True, help="txt / metadata: what to do with a caption already there.")
@click.option("--separator", default=" ", show_default=True, help="Joins old and new caption (append/prepend).")
@click.option("--root", type=click.Path(file_okay=False),
              help="metadata: the dataset folder [default: the folder holding all the images].")
@click.option("--sidecar-ext", default=".txt", show_default=True, help="txt: caption file extension.")
@click.option("--prompt", "-p", default=None, help="Instruction; may use {name} {filename} {path} {existing}.")
@click.option("--system", help="System prompt (evaluated once, reused for every image).")
@click.option("--prefix", default="", help="Text put before every caption (trigger words).")
@click.option("--suffix", default="", help="Text put after every caption.")
@click.option("--clean", is_flag=True, help='Strip preambles ("The image shows ..."), quotes, line breaks.')
@sampling_options(max_tokens=128, temp=0.0)
@click.option("--tiles", type=Tiles(), default="auto", show_default=True,
              help="Detail tiles for fixed-size encoders (LLaVA-1.5) within --image-tokens.")
@click.option("--merge", "merge", type=Merge(), default="off", show_default=True,
              help="Merge similar adjacent image tokens: off, threshold:T, ratio:R or tokens:N.")
@json_schema_option("each caption (the parsed object goes into the record as \"json\")")
@plan_options
@click.option("--threads", type=click.IntRange(1), help="CPU threads (default: physical cores, ≤ 8).")
@max_pixels_option("Images with more pixels get an error record (decompression-bomb guard).")
@click.option("--max-file-size", type=Size(), default="1GiB", show_default=True,
              help="Larger files get an error record.")
@click.option("--retry-errors", is_flag=True, help="Caption again the images whose earlier record is an error.")
@click.option("--parallel", type=AutoInt(), default="auto", show_default=True,
              help="Images in flight, their captions generated in one batch (auto: up to 4, as "
                   "many as the context holds; 1: one at a time).")
@click.option("--prefetch", default=2, show_default=True, type=click.IntRange(1, 64),
              help="Images decoded ahead of the model.")
@click.option("--progress", type=click.Choice(["auto", "bar", "json", "none"]), default="auto",
              show_default=True, help="auto: a bar when stderr is a terminal; json: one object per line.")
@click.option("--quiet", "-q", is_flag=True, help="No progress and no summary (errors still show).")
@click.option("--dry-run", is_flag=True, help="List the images this run would work on, and stop.")
@click.option("--verbose", "-v", is_flag=True, help="Show llama.cpp's own logs.")
@handle_errors
def caption(inputs, model, mmproj, recursive, from_list, null, include, exclude, shard, out, fmt,
            existing, separator, root, sidecar_ext, prompt, system, prefix, suffix, clean, max_tokens,
            temp, top_k, top_p, min_p, seed, stop, tiles, merge, json_schema, planning, threads, max_pixels,
            max_file_size, retry_errors,
            parallel, prefetch, progress, quiet, dry_run, verbose) -> None:
    """Caption images in bulk: files, folders, globs or a list; resumable.

    \b
    edgevlm caption -m model.gguf --mmproj mmproj.gguf photos/ --recursive
    edgevlm caption -m ... --mmproj ... photos/ --format txt --prefix "ohwx, " --clean
    find . -name '*.jpg' | edgevlm caption -m ... --mmproj ... --from-list - --format csv
    edgevlm caption -m ... --mmproj ... photos/ -r --shard 2/4 --out part2.jsonl

    Run the same command again after a crash or Ctrl-C: images already captioned (same image
    bytes, prompt, model and settings) are skipped; each record is written atomically.
    """
    from ..caption import DEFAULT_PROMPT, CaptionJob, CaptionSettings, StopToken, caption_slots
    from ..caption.inputs import discover, parse_shard
    from ..caption.outputs import RecordLog

    if not inputs and from_list is None:
        raise CLIError("give images, folders or globs to caption, or --from-list FILE", 2)
    if parallel is not None and parallel < 1:
        raise CLIError(f"--parallel {parallel}: give 1 or more images in flight, or auto", 2)
    if from_list == "-" and "-" in inputs:
        raise CLIError("'-' is not an input; use --from-list - to read paths from stdin", 2)
    settings = CaptionSettings(
        prompt=prompt if prompt is not None else DEFAULT_PROMPT, system=system, prefix=prefix,
        suffix=suffix, clean=clean, max_tokens=max_tokens, temperature=temp, top_k=top_k,
        top_p=top_p, min_p=min_p, seed=seed, stop=tuple(stop), image_tokens=planning.wishes.image_tokens,
        tiles=tiles, merge=str(merge), max_pixels=max_pixels, max_file_bytes=max_file_size,
        json_schema=json.dumps(json_schema, sort_keys=True) if json_schema else None)
    settings.validate()
    shard_ix = parse_shard(shard) if shard else None
    if out and "{shard}" in out:
        if shard_ix is None:
            raise CLIError(f"--out {out}: {{shard}} needs --shard I/N", 2)
        out = out.replace("{shard}", f"{shard_ix[0]}-of-{shard_ix[1]}")
    found = discover(inputs, recursive=recursive, from_list=from_list, null=null, include=include,
                     exclude=exclude, shard=shard_ix)
    ui = ProgressView("none" if quiet else progress, quiet)
    for pattern in found.unmatched:
        ui.note(f"note: {pattern}: no match")
    if not found.items:
        if found.sharded_out:
            ui.note(f"shard {shard}: no images in this shard ({found.sharded_out} in others)")
            return
        hints = []
        if found.ignored:
            hints.append(f"{found.ignored} file(s) are not images")
        if found.dirs_not_entered:
            hints.append(f"{found.dirs_not_entered} folder(s) not entered (use --recursive)")
        raise CLIError("no images found" + (f": {'; '.join(hints)}" if hints else ""), 2)

    if not dry_run:  # a dry run downloads nothing
        from .loading import model_paths

        model, mmproj = model_paths(model, mmproj, quiet=quiet, probe_args=planning.probe_args,
                                    wishes=planning.wishes)
    job = CaptionJob(found.items, settings, model=model or "(auto)", mmproj=mmproj, out=out, fmt=fmt,
                     existing=existing, separator=separator, root=root or found.root,
                     sidecar_ext=sidecar_ext,
                     retry_errors=retry_errors)
    if dry_run:
        have = {e.data.get("path") for e in RecordLog.peek(job.out, job.log.fmt)
                if e.data.get("settings") == job.digest}
        for it in found.items:
            click.echo(it.path)
        ui.note(f"{len(found.items)} image(s), {sum(1 for it in found.items if it.path in have)} with a "
                f"record in {job.out}" + (f", {found.ignored} other file(s) ignored" if found.ignored else ""))
        return
    job.open()
    token = StopToken()
    sig = _signals(token, ui)
    engine = None
    try:
        with sig:
            try:
                if job.index.other_settings:
                    ui.note(f"note: {job.out} also holds {job.index.other_settings} record(s) made with "
                            "other settings (prompt, model, ...): they are kept, new ones are added beside them")
                if job.needs_model():
                    from .loading import load_engine

                    engine = load_engine(model, mmproj, verbose, system=settings.system, merge=merge,
                                         wishes=planning.wishes, n_threads=threads, **planning.probe_args,
                                         n_seq_max=lambda plan: caption_slots(
                                             plan.n_ctx, plan.image_max_tokens, settings, parallel))
                    if merge.enabled and not engine.merging:
                        ui.note(f"note: --merge ignored: {engine.backend.proj_info.projector_type} tokens "
                                f"are not on a spatial grid")
                    if parallel and engine.scheduler.n_slots < parallel:
                        ui.note(f"note: --parallel {parallel}: the context ({engine.n_ctx} tokens) holds "
                                f"{engine.scheduler.n_slots} image(s) in flight; use a larger --ctx for more")
                ui.start(job, fmt)
                sig.running = True
                summary = job.run(engine, stop=token, prefetch=prefetch, on_result=ui.update)
            except KeyboardInterrupt:  # stopped while the model was loading
                summary = job.summary
                summary.interrupted = True
            finally:
                sig.closing = True  # from here on we stop anyway: later signals are ignored
                ui.stop()
                if engine is not None:
                    engine.close()
            ui.finish(summary, job)
    finally:
        job.close()
    sys.exit(summary.exit_code)


class _signals:
    """Ctrl-C / SIGTERM. First: finish the images in progress (one, or up to --parallel), then
    stop (exit 130, summary). Second: abandon them at the next token. Third, or second while the model loads: exit
    at once — safe, since every record on disk is complete (the kernel drops the lock)."""

    def __init__(self, token, ui):
        self.token = token
        self.ui = ui
        self.saved: dict[int, Any] = {}
        self.closing = False
        self.running = False  # the caption loop has started (it checks the token)
        self.count = 0

    def _handler(self, signum, frame):
        if self.closing:
            return
        self.count += 1
        if self.count == 1:
            self.token.request()
            self.ui.note("finishing the image(s) in progress, then stopping (Ctrl-C again to stop now)"
                         if self.running else "stopping once the model has loaded (Ctrl-C again to quit now)")
        elif self.count == 2 and self.running:
            self.token.abandon()
            self.ui.note("stopping now: the image(s) in progress are left for the next run")
        else:
            self.ui.stop()
            print("stopped", file=sys.stderr, flush=True)
            os._exit(130)

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.saved[sig] = signal.signal(sig, self._handler)
        return self

    def __exit__(self, *exc):
        # We are exiting anyway: a late Ctrl-C must not turn exit code 130 into a traceback.
        self.closing = True
        for sig in self.saved:
            signal.signal(sig, signal.SIG_IGN)


class ProgressView:
    """stderr output: a rich bar (terminal), JSON lines (``--progress json``), or only
    failures and the summary."""

    def __init__(self, mode: str, quiet: bool):
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "none"
        self.mode = mode
        self.quiet = quiet
        self.bar = None
        self.task = None
        self.events: deque[tuple[float, int]] = deque(maxlen=32)  # (time, images processed)
        self.n = 0
        self.total = 0

    def _emit(self, obj: dict) -> None:
        sys.stderr.write(json.dumps(obj, ensure_ascii=False) + "\n")
        sys.stderr.flush()

    def note(self, msg: str) -> None:
        if self.quiet:
            return
        if self.mode == "json":
            self._emit({"event": "note", "message": msg})
        elif self.bar is not None:
            self.bar.console.print(msg, markup=False, highlight=False)
        else:
            print(msg, file=sys.stderr, flush=True)

    def error(self, msg: str) -> None:
        if self.mode == "json":
            return  # carried by the image event
        if self.bar is not None:
            from rich.text import Text

            self.bar.console.print(Text(msg, style="red"))  # a style= would colour the bar too
        else:
            print(msg, file=sys.stderr, flush=True)

    def start(self, job, fmt: str) -> None:
        self.total = len(job.items)
        if self.mode == "json":
            self._emit({"event": "start", "total": self.total, "todo": job.todo(), "out": job.out,
                        "format": fmt, "model": job.model_name, "settings": job.digest,
                        "metadata": job.metadata_path})
        elif self.mode == "bar":
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn

            self.bar = Progress(
                SpinnerColumn(), TextColumn("captioning"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[rate]} img/s · ETA {task.fields[eta]} · {task.fields[counts]}"),
                console=Console(stderr=True), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("caption", total=self.total, rate="-", eta="-",
                                          counts="")
        self.t0 = time.monotonic()

    def _rate(self) -> float | None:
        if len(self.events) < 2:
            return None
        (t0, n0), (t1, n1) = self.events[0], self.events[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else None

    def update(self, res, summary) -> None:
        self.n += 1
        if res.status != "skipped":
            self.events.append((time.monotonic(), summary.done + summary.failed))
        rate = self._rate()
        left = self.total - self.n
        eta = left / rate if rate else None
        rec = res.record
        if res.status == "failed" and rec is not None:
            self.error(f"failed: {rec.path}: {rec.error}")
        if self.mode == "json":
            ev = {"event": "image", "n": self.n, "total": self.total, "path": res.item.path,
                  "status": res.status, "done": summary.done, "skipped": summary.skipped,
                  "failed": summary.failed, "images_per_s": round(rate, 3) if rate else None,
                  "eta_s": round(eta, 1) if eta is not None else None}
            if res.reason:
                ev["reason"] = res.reason
            if rec is not None:
                ev["custom_id"] = rec.custom_id
                if rec.error:
                    ev["error"] = rec.error
                else:
                    st = rec.stats or {}
                    ev.update(predicted_n=st.get("predicted_n"), cached_n=st.get("cached_n"),
                              ms=st.get("total_ms"))
            self._emit(ev)
        elif self.bar is not None:
            counts = f"done {summary.done} · skipped {summary.skipped} · failed {summary.failed}"
            self.bar.update(self.task, completed=self.n, rate=f"{rate:.2f}" if rate else "-",
                            eta=_fmt_eta(eta), counts=counts)

    def finish(self, summary, job) -> None:
        self.stop()
        if self.mode == "json":
            self._emit({"event": "summary", **summary.to_dict()})
            return
        if self.quiet:
            return
        for line in summary.lines():
            print(line, file=sys.stderr)
        where = job.metadata_path or ("caption files beside the images" if job.fmt == "txt" else None)
        print(f"records: {job.out}" + (f" · captions: {where}" if where else ""), file=sys.stderr)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def _fmt_eta(eta: float | None) -> str:
    if eta is None:
        return "-"
    eta = int(eta)
    return f"{eta // 3600}:{eta % 3600 // 60:02d}:{eta % 60:02d}" if eta >= 3600 else f"{eta // 60}:{eta % 60:02d}"


__all__ = ["caption"]
