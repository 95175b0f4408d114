"""``edgevlm batch``: answer an OpenAI batch file (``/v1/chat/completions`` lines), resumable."""

from __future__ import annotations

import os
import sys

import click

from ..serve.options import DEFAULT_PARALLEL, ServeOptions, serve_layout
from .common import (
    AutoInt,
    CLIError,
    audio_options,
    check_writable,
    echo_err,
    handle_errors,
    max_pixels_option,
    merge_option,
    plan_options,
    ray_options,
    request_defaults_options,
    threads_option,
    tiles_option,
    video_options,
    yes_option,
)
from .progress import StderrView
from .signals import StopSignals

__all__ = ["batch"]

EXIT_CODES = """\b
Exit codes: 0 every line answered · 4 some lines got an error (their output lines carry a 4xx/5xx
status_code or "error") · 2 the file is unusable (unreadable, not a batch file), bad options ·
1 llama.cpp, Ray or the disk failed the run · 130 interrupted: run the same command again."""


@click.command(epilog=EXIT_CODES)
@click.argument("requests", type=click.Path(dir_okay=False))
@click.option("--out", "-o", metavar="PATH", help="Output file [default: REQUESTS_output.jsonl].")
@click.option(
    "--model",
    "-m",
    help="GGUF path, registry name (llava-1.5-7b), hf:owner/repo/file.gguf, or demo "
    "(default: the registry's small default that fits, see edgevlm models; $EDGEVLM_MODEL).",
)
@click.option("--mmproj", help="Vision projector (path or hf: spec); found automatically for names.")
@request_defaults_options
@click.option(
    "--parallel",
    type=AutoInt(),
    default="auto",
    show_default=True,
    help="Requests generated together in one batch (auto: up to 4, as many as the context holds).",
)
@click.option(
    "--timeout",
    default=ServeOptions.timeout_s,
    show_default=True,
    type=click.FloatRange(1),
    help="Seconds one request may take (a 503 line when it does not finish; a rerun asks again).",
)
@click.option(
    "--allow-path",
    multiple=True,
    type=click.Path(file_okay=False, exists=True),
    help="Another folder whose images lines may name by path (the requests file's folder and the "
    "current one always are; relative paths are read from the current folder).",
)
@click.option(
    "--allow-private-urls",
    is_flag=True,
    help="Fetch image URLs that resolve to loopback, private or link-local addresses.",
)
@tiles_option
@video_options
@audio_options
@merge_option
@plan_options
@threads_option
@max_pixels_option("Images with more pixels get a 400 line (decompression-bomb guard).")
@ray_options("lines", "Answer")
@click.option(
    "--progress",
    type=click.Choice(["auto", "bar", "json", "none"]),
    default="auto",
    show_default=True,
    help="auto: a bar when stderr is a terminal; json: one object per line.",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress and no summary (errors still show).")
@click.option("--verbose", "-v", is_flag=True, help="Show llama.cpp's own logs.")
@yes_option
@handle_errors
def batch(
    requests,
    out,
    model,
    mmproj,
    max_tokens,
    sampling,
    reasoning_budget,
    parallel,
    timeout,
    allow_path,
    allow_private_urls,
    tiles,
    video,
    audio,
    merge,
    planning,
    threads,
    max_pixels,
    ray,
    progress,
    quiet,
    verbose,
    yes,
) -> None:
    """Answer an OpenAI batch file: one output line per custom_id, as `edgevlm serve` answers.

    \b
    edgevlm batch requests.jsonl --out results.jsonl -m llava-1.5-7b
    edgevlm batch requests.jsonl --out results.jsonl -m llava-1.5-7b --ray auto

    Lines: {"custom_id": ..., "method": "POST", "url": "/v1/chat/completions", "body": {...}}.
    Run the same command again after a crash or Ctrl-C: answered custom_ids are skipped.
    """

    from ..jobs.stop import StopToken
    from ..runtime.engine import EngineOptions
    from ..serve.batchfile import BatchOutput, read_batch_file
    from ..serve.options import ServeOptions

    if parallel is not None and parallel < 1:
        raise CLIError(f"--parallel {parallel}: give 1 or more, or auto", 2)
    data = read_batch_file(requests)
    out = out or os.path.splitext(requests)[0] + "_output.jsonl"
    if os.path.abspath(out) == os.path.abspath(requests):
        raise CLIError(f"--out {out}: is the requests file itself", 2)
    check_writable(out)
    ui = BatchView("none" if quiet else progress, quiet)
    for dup in data.duplicates:
        ui.note(f"note: line {dup.number}: custom_id {dup.custom_id!r} came on an earlier line; not answered")
    # conversations kept as `serve` keeps them (one KV layout for the same requests: a line is
    # answered as the server answers it)
    wishes = planning.serving(parallel, merge)
    folder = os.path.dirname(os.path.abspath(requests))
    options = ServeOptions(
        model_id="edgevlm",
        queue=parallel or DEFAULT_PARALLEL,
        follow_ups_first=False,  # lines in file order, as the server answers them one by one
        max_tokens=max_tokens,
        sampling=sampling,
        reasoning_budget=reasoning_budget,
        timeout_s=timeout,
        host_allowance=wishes.host_allowance,
        allow_private_urls=allow_private_urls,
        path_base=os.getcwd(),
        allow_paths=tuple(dict.fromkeys([folder, os.getcwd(), *map(os.path.abspath, allow_path)])),
    )
    engine_options = EngineOptions(
        image_tokens=wishes.image_tokens,
        tiles=tiles,
        merge=merge,
        max_image_pixels=max_pixels,
        video=video,
        audio=audio,
    )
    output = BatchOutput(data, out).open()
    token = StopToken()
    sig = StopSignals(token, ui, "request(s)")
    try:
        todo = output.todo()
        ui.start(output, len(todo))
        if not todo:
            pass
        elif ray.address is not None:
            _on_ray(
                output,
                ray.address,
                model,
                mmproj,
                wishes,
                planning,
                threads,
                parallel,
                ray.actors,
                ray.batch,
                verbose,
                options,
                engine_options,
                ui,
                sig,
            )
        else:
            _here(  # (a large download asks first; --yes skips the question)
                output,
                todo,
                model,
                mmproj,
                wishes,
                planning,
                threads,
                parallel,
                verbose,
                quiet,
                options,
                engine_options,
                ui,
                sig,
                yes,
            )
    finally:
        output.close()
    ui.finish(output.summary)
    sys.exit(output.summary.exit_code)


def _here(
    output,
    todo,
    model,
    mmproj,
    wishes,
    planning,
    threads,
    parallel,
    verbose,
    quiet,
    options,
    engine_options,
    ui,
    sig,
    yes=False,
) -> None:
    from ..serve.batchfile import error_line
    from ..serve.batchrun import run_lines
    from .loading import load_model, model_paths

    vlm = None
    spec = model
    with sig:
        try:
            if any(ln.ok for ln in todo):
                model, mmproj = model_paths(
                    model, mmproj, quiet=quiet, probe_args=planning.probe_args, wishes=wishes, yes=yes
                )
                layout = lambda plan: serve_layout(
                    plan.n_ctx,
                    plan.image_max_tokens,
                    options.max_tokens,
                    parallel,
                    wishes.sequences,
                )
                from ..runtime.scheduler import THROUGHPUT

                vlm = load_model(
                    model,
                    mmproj,
                    verbose,
                    wishes=wishes,
                    options=engine_options,
                    n_threads=threads,
                    n_seq_max=lambda plan: layout(plan)[0],
                    parallel=lambda plan: layout(plan)[1],
                    scheduler_options=THROUGHPUT,  # a batch file: nobody watches a stream
                    **planning.probe_args,
                )
                options = _named(options, spec, model)
            sig.running = True
            if vlm is None:  # only lines that are not requests: answered without a model
                for line in todo:
                    _emit(output, error_line(line), ui)
            else:
                run_lines(vlm, todo, lambda d, line: _emit(output, d, ui), options, sig.token)
        except KeyboardInterrupt:
            output.summary.interrupted = True
        finally:
            sig.closing = True
            ui.stop()
            if vlm is not None:
                vlm.close()
    if sig.token.requested and output.summary.remaining:
        output.summary.interrupted = True


def _named(options, spec: str | None, path: str):
    """The model name bodies carry when a request names none: the name given (a registry name),
    else the model file's stem — as ``edgevlm serve`` names it."""
    from dataclasses import replace

    name = spec if spec and not os.path.isfile(spec) else os.path.splitext(os.path.basename(path))[0]
    return replace(options, model_id=name)


def _emit(output, d, ui) -> None:
    if output.write(d):
        ui.update(d, output.summary)


def _on_ray(
    output,
    address,
    model,
    mmproj,
    wishes,
    planning,
    threads,
    parallel,
    actors,
    batch_size,
    verbose,
    options,
    engine_options,
    ui,
    sig,
) -> None:
    from dataclasses import replace

    from ..cluster.batch import answer_on_ray
    from ..cluster.connect import connect
    from .ray_run import ray_layout, ray_preflight, ray_spec

    spec_name = model
    _, model, mmproj = ray_preflight(model, mmproj, "jsonl", False)
    options = _named(options, spec_name, model)
    with connect(address, verbose=verbose) as cluster, sig:
        lay = ray_layout(cluster, actors, threads, ui)
        spec = replace(
            ray_spec(model, mmproj, replace(planning, wishes=wishes), parallel, verbose), threads=lay.threads
        )
        try:
            sig.running = True
            answer_on_ray(
                output,
                spec,
                lay,
                options,
                engine_options,
                batch_size=batch_size,
                stop=sig.token,
                on_line=lambda d, line: ui.update(d, output.summary),
            )
        except KeyboardInterrupt:
            output.summary.interrupted = True
        finally:
            sig.closing = True
            ui.stop()


class BatchView(StderrView):
    """A batch run's progress: answered / failed counts; a line that failed is always named."""

    def start(self, output, todo: int) -> None:
        s = output.summary
        if self.mode == "json":
            self._emit({"event": "start", "total": s.total, "todo": todo, "out": output.out})
        elif self.mode == "bar" and todo:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn

            self.bar = Progress(
                SpinnerColumn(),
                TextColumn("answering"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[counts]}"),
                console=Console(stderr=True),
                transient=True,
            )
            self.bar.start()
            self.task = self.bar.add_task("batch", total=todo, counts="")

    def update(self, d: dict, summary) -> None:
        self.n += 1
        resp = d.get("response") or {}
        status = resp.get("status_code")
        err = d.get("error") or ((resp.get("body") or {}).get("error") if status != 200 else None)
        message = (err or {}).get("message") if isinstance(err, dict) else None
        if self.mode == "json":
            ev = {
                "event": "line",
                "n": self.n,
                "custom_id": d.get("custom_id"),
                "status_code": status,
                "answered": summary.answered,
                "failed": summary.failed,
            }
            if message:
                ev["error"] = message
            self._emit(ev)
            return
        if message:
            self.error(
                f"failed: {d.get('custom_id') or '(no custom_id)'}: " + (f"{status} " if status else "") + message
            )
        if self.bar is not None:
            assert self.task is not None  # added with the bar
            self.bar.update(
                self.task, completed=self.n, counts=f"answered {summary.answered} · failed {summary.failed}"
            )

    def finish(self, summary) -> None:
        self.stop()
        if self.mode == "json":
            self._emit({"event": "summary", **summary.to_dict()})
            return
        if self.quiet:
            return
        for line in summary.lines():
            echo_err(line)
        echo_err(f"output: {summary.out}")
