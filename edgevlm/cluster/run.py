"""The Python API for runs on Ray, files in and files out (the CLI's ``--ray`` calls the same
pieces):

    from edgevlm.cluster import caption_files, answer_batch_file
    summary = caption_files(["photos/"], model="llava-1.5-7b", out="captions.parquet",
                            fmt="parquet", recursive=True, address="auto")
    summary = answer_batch_file("requests.jsonl", "results.jsonl", model="llava-1.5-7b")

Both resume: run them again and only what is left is done. For a Ray Dataset in and a Dataset
out, see ``caption_dataset``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import replace

from ..caption.inputs import discover
from ..caption.job import CaptionJob, CaptionSummary
from ..caption.settings import CaptionSettings
from ..errors import InputError
from ..hub.download import file_identity
from ..plan.planner import Wishes
from ..runtime.engine import EngineOptions
from ..serve.batchfile import BatchOutput, BatchSummary, read_batch_file
from ..serve.options import ServeOptions
from .actors import ActorSpec
from .batch import answer_on_ray
from .caption import caption_on_ray
from .connect import DEFAULT_BATCH, connect, layout

__all__ = ["answer_batch_file", "caption_files"]


def _paths(model: str, mmproj: str | None) -> tuple[str, str | None]:
    """Local files as absolute paths (the actors' working folder is not ours)."""

    def one(p: str | None) -> str | None:
        return os.path.abspath(p) if p is not None and os.path.isfile(p) else p

    return one(model), one(mmproj)  # type: ignore[return-value]


def caption_files(
    inputs: Iterable[str] = (),
    *,
    model: str,
    mmproj: str | None = None,
    out: str | None = None,
    fmt: str = "jsonl",
    settings: CaptionSettings | None = None,
    address: str = "local",
    actors: int | None = None,
    threads: int | None = None,
    parallel: int | None = None,
    wishes: Wishes | None = None,
    recursive: bool = False,
    from_list: str | None = None,
    retry_errors: bool = False,
    batch_size: int = DEFAULT_BATCH,
    on_result: Callable | None = None,
    verbose: bool = False,
) -> CaptionSummary:
    """Caption images (paths, folders, globs, and/or the paths in ``from_list``) on Ray into
    ``out`` (JSONL, CSV or Parquet shards), resuming what an earlier run did."""
    if fmt not in ("jsonl", "csv", "parquet"):
        raise InputError(f"fmt {fmt!r}: on Ray, records go to jsonl, csv or parquet")
    found = discover(list(inputs), recursive=recursive, from_list=from_list)
    if not found.items:
        raise InputError("no images found")
    model, mmproj = _paths(model, mmproj)
    m, p = file_identity(model, mmproj)
    job = CaptionJob(
        found.items,
        settings or CaptionSettings(),
        model=model,
        mmproj=mmproj or "",
        out=out,
        fmt=fmt,
        retry_errors=retry_errors,
        identity=(m.rsplit(":", 1)[0], f"{m}+{p}"),
    )
    spec = ActorSpec(model, mmproj, wishes or Wishes(), parallel=parallel, verbose=verbose)
    with job:
        if not job.needs_model():
            return job.run(None, on_result=on_result)
        with connect(address, verbose=verbose) as cluster:
            lay = layout(cluster, actors, threads)
            return caption_on_ray(
                job, replace(spec, threads=lay.threads), lay, batch_size=batch_size, on_result=on_result
            )


def answer_batch_file(
    requests: str,
    out: str,
    *,
    model: str,
    mmproj: str | None = None,
    address: str = "local",
    actors: int | None = None,
    threads: int | None = None,
    parallel: int | None = None,
    wishes: Wishes | None = None,
    options: ServeOptions | None = None,
    engine_options: EngineOptions | None = None,
    batch_size: int = DEFAULT_BATCH,
    verbose: bool = False,
) -> BatchSummary:
    """Answer an OpenAI batch file on Ray into ``out``, resuming what an earlier run did."""
    data = read_batch_file(requests)
    model, mmproj = _paths(model, mmproj)
    folder = os.path.dirname(os.path.abspath(requests))
    options = options or ServeOptions(path_base=os.getcwd(), allow_paths=(folder, os.getcwd()), follow_ups_first=False)
    spec = ActorSpec(model, mmproj, wishes or Wishes(), parallel=parallel, verbose=verbose)
    with BatchOutput(data, out) as output:
        if not output.todo():
            return output.summary
        with connect(address, verbose=verbose) as cluster:
            lay = layout(cluster, actors, threads)
            return answer_on_ray(
                output,
                replace(spec, threads=lay.threads),
                lay,
                options,
                engine_options or EngineOptions(),
                batch_size=batch_size,
            )
