"""Batch files on Ray: the driver reads the file, decides what is left (the output file's
resume rules), answers lines that are not requests itself, and sends the rest to a pool of
``BatchActor``s; each answer is written as it arrives, once per ``custom_id``."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ..jobs.stop import StopToken
from ..runtime.engine import EngineOptions
from ..serve.batchfile import BatchLine, BatchOutput, BatchSummary, error_line
from ..serve.options import ServeOptions
from .actors import ActorSpec, BatchActor
from .caption import ray_failure
from .connect import DEFAULT_BATCH, ActorLayout, ray_module

__all__ = ["answer_on_ray"]


def answer_on_ray(
    out: BatchOutput,
    spec: ActorSpec,
    lay: ActorLayout,
    options: ServeOptions,
    engine_options: EngineOptions,
    *,
    batch_size: int = DEFAULT_BATCH,
    stop: StopToken | None = None,
    on_line: Callable[[dict[str, Any], BatchLine], None] | None = None,
) -> BatchSummary:
    """Answer what is left of ``out``'s batch file (``out`` is open) on the connected cluster."""
    ray = ray_module()
    stop = stop or StopToken()
    todo = out.todo()
    by_id = {ln.custom_id: ln for ln in todo}

    def emit(d: dict[str, Any], line: BatchLine) -> None:
        if out.write(d) and on_line is not None:
            on_line(d, line)

    for line in todo:
        if not line.ok:
            emit(error_line(line), line)
    good = [ln for ln in todo if ln.ok]
    if not good or stop.requested:
        out.summary.interrupted = bool(good)
        return out.summary
    ds = ray.data.from_items(
        [{"line": json.dumps(ln.to_dict())} for ln in good], override_num_blocks=max(1, -(-len(good) // batch_size))
    )  # a block per call
    ds = ds.map_batches(
        BatchActor,
        fn_constructor_kwargs=dict(spec=spec, options=options, engine_options=engine_options),
        batch_size=batch_size,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=lay.actors),
        num_cpus=lay.num_cpus,
        num_gpus=lay.num_gpus or None,
    )  # Ray Data restarts actors and retries by default
    try:
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=0):
            for text in batch["answer"]:
                d = json.loads(str(text))
                emit(d, by_id[d["custom_id"]])
            if stop.requested:
                break
    except KeyboardInterrupt:
        out.summary.interrupted = True
    except Exception as exc:  # Ray wraps whatever an actor raised
        raise ray_failure(exc) from None
    if out.summary.remaining:
        out.summary.interrupted = out.summary.interrupted or stop.requested
    return out.summary
