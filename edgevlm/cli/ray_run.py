"""``--ray`` for ``caption`` and ``batch``: check what a cluster run needs before anything
starts, connect, size the actor pool, and run with the command's usual progress and summary."""

from __future__ import annotations

import os
from dataclasses import replace

from .common import CLIError

__all__ = ["caption_with_ray", "ray_layout", "ray_preflight", "ray_spec"]


def ray_preflight(model: str | None, mmproj: str | None, fmt: str, dry_run: bool):
    """((record name, identity), model, mmproj) for the driver, which never loads the model:
    local files as absolute paths (every node must see them), names and hf: specs as they are
    (each node fetches them once)."""
    from ..hub.download import file_identity

    if fmt in ("txt", "metadata"):
        raise CLIError(
            f"--format {fmt} writes beside each image and is not available with --ray (use jsonl, csv or parquet)", 2
        )
    if model is None:
        raise CLIError("--ray needs --model: a path every node sees, a registry name or an hf: spec", 2)
    if not dry_run:
        from ..cluster.connect import ray_module

        ray_module()  # one line now if Ray is missing, not after reading every image
    if os.path.isfile(model):
        model = os.path.abspath(model)
    if mmproj is not None and os.path.isfile(mmproj):
        mmproj = os.path.abspath(mmproj)
    m, p = file_identity(model, mmproj)
    return (m.rsplit(":", 1)[0], f"{m}+{p}"), model, mmproj


def ray_spec(model, mmproj, planning, parallel, verbose):
    from ..cluster.actors import ActorSpec

    return ActorSpec(model, mmproj, planning.wishes, parallel=parallel, verbose=verbose)


def ray_layout(cluster, actors, threads, ui):
    from ..cluster.connect import layout

    lay = layout(cluster, actors, threads)
    ui.note(f"ray: {cluster.describe()} · {lay.describe()}")
    return lay


def caption_with_ray(job, address, model, mmproj, planning, threads, parallel, actors, batch_size, verbose, ui, sig):
    """Caption the open ``job`` on Ray; returns its summary."""
    from ..cluster.caption import caption_on_ray
    from ..cluster.connect import connect

    if job.index.other_settings:
        ui.note(
            f"note: {job.out} also holds {job.index.other_settings} record(s) made with other settings "
            "(prompt, model, ...): they are kept, new ones are added beside them"
        )
    summary = None
    if not job.needs_model():  # a rerun of a finished job: no cluster needed
        ui.start(job, job.fmt)
        summary = job.run(None, stop=sig.token, on_result=ui.update)
    else:
        with connect(address, verbose=verbose) as cluster, sig:
            lay = ray_layout(cluster, actors, threads, ui)
            spec = replace(ray_spec(model, mmproj, planning, parallel, verbose), threads=lay.threads)
            try:
                ui.start(job, job.fmt)
                sig.running = True
                summary = caption_on_ray(job, spec, lay, batch_size=batch_size, stop=sig.token, on_result=ui.update)
            except KeyboardInterrupt:
                summary = job.summary
                summary.interrupted = True
            finally:
                sig.closing = True
                ui.stop()
    ui.finish(summary, job)
    return summary
