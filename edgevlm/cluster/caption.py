"""Captioning on Ray: the images read by Ray Data, captioned by a pool of actors, the records
written on the driver by the same ``CaptionJob`` as ``edgevlm caption`` (same schema, same
atomic appends, same resume).

    with connect("local") as cluster:
        job = CaptionJob(items, settings, model="m.gguf", mmproj="p.gguf", out="captions.jsonl").open()
        summary = caption_on_ray(job, ActorSpec("m.gguf", "p.gguf", Wishes()), layout(cluster))
        job.close()

What makes it safe to kill anything at any time:

- the driver decides what is left before Ray starts: an image whose record (same settings) has
  the same size and mtime is done; one that changed is sent with its old record, and the actor
  skips it if its sha256 is unchanged;
- Ray restarts a killed actor and sends its batch again (Ray Data's defaults for actor pools);
- the driver writes a record only if its ``custom_id`` (path, image sha256, settings) is not in
  the log yet, so a batch that ran twice leaves one record per image;
- records are appended and fsync-ed as batches arrive: a killed driver loses only the batches in
  flight, which a rerun captions.

``caption_dataset`` is the Ray Data way for a pipeline of your own: a Dataset of ``bytes`` and
``path`` rows in, a Dataset of records out (the Parquet columns), nothing written, no resume.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

from ..caption.inputs import InputItem
from ..caption.job import CaptionJob, CaptionSummary
from ..caption.outputs import CaptionRecord
from ..caption.parquet import parquet_row
from ..caption.prepare import Preparer
from ..caption.runner import Captioner, CaptionResult
from ..caption.settings import CaptionSettings, model_identity
from ..errors import ClusterError, EdgeVLMError
from ..jobs.stop import StopToken
from .actors import ActorSpec, CaptionActor, decode_result
from .connect import DEFAULT_BATCH, READ_CPUS, ActorLayout, ray_module

__all__ = ["caption_dataset", "caption_on_ray", "ray_failure"]


def _remote(path: str) -> bool:
    """A URI for a pyarrow filesystem (s3://, gs://, hdfs://), not a local path (C:\\ included)."""
    scheme = path.split("://", 1)[0] if "://" in path else ""
    return len(scheme) > 1


def _map(
    ds: Any,
    spec: ActorSpec,
    lay: ActorLayout,
    settings: CaptionSettings,
    model_name: str,
    digest: str,
    previous: list[dict[str, Any]],
    batch_size: int,
) -> Any:
    ray = ray_module()
    return ds.map_batches(
        CaptionActor,
        fn_constructor_kwargs=dict(
            spec=spec, settings=settings, model_name=model_name, digest=digest, previous=previous
        ),
        batch_size=batch_size,
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=lay.actors),
        num_cpus=lay.num_cpus,
        num_gpus=lay.num_gpus or None,
    )  # Ray Data restarts actors and retries by default


def ray_failure(exc: BaseException) -> EdgeVLMError:
    """An actor's error as edgevlm's: its own ``EdgeVLMError`` when it raised one (a model that
    does not fit, a bad file), else one line saying what Ray reported."""
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, EdgeVLMError):
            return e
        cause = getattr(e, "cause", None)
        e = cause if isinstance(cause, BaseException) else (e.__cause__ or e.__context__)
    text = str(exc).strip().splitlines()
    tail = next((ln.strip() for ln in reversed(text) if ln.strip()), type(exc).__name__)
    return ClusterError(f"the Ray run failed: {tail[:300]}")


def caption_on_ray(
    job: CaptionJob,
    spec: ActorSpec,
    lay: ActorLayout,
    *,
    batch_size: int = DEFAULT_BATCH,
    stop: StopToken | None = None,
    on_result: Callable[[CaptionResult, CaptionSummary], None] | None = None,
) -> CaptionSummary:
    """Caption the job's images on the connected Ray cluster; ``job`` is open (its log read)."""
    ray = ray_module()
    stop = stop or StopToken()
    items = {it.path: it for it in job.items}
    settled: list[CaptionResult] = []
    todo: list[str] = []
    previous: list[dict[str, Any]] = []
    here: list[InputItem] = []  # missing, unreadable, a folder: their error records are made here
    prep = Preparer(None, job.settings, job.digest, job.deliverable, job.index, job.conflicts)
    for it in job.items:
        prev = job.index.get(it.path)
        if prev is not None and prep.settled(it):
            settled.append(CaptionResult("skipped", it, reason="done", previous=prev.data))
            continue
        if _remote(it.path) or (os.path.isfile(it.path) and os.access(it.path, os.R_OK)):
            todo.append(it.path)
            if prev is not None:
                previous.append(prev.data)
        else:
            here.append(it)

    def results() -> Iterator[CaptionResult]:
        yield from settled
        local = Captioner(None, job.settings, job.model_name, job.digest, index=job.index)
        yield from local.run(here)
        if not todo:
            return
        seen: set[str] = set()
        # one read block per actor batch: an actor call then takes one block and its records come
        # back when it ends (a call over several blocks would return them all at its end)
        ds = ray.data.read_binary_files(
            todo,
            include_paths=True,
            num_cpus=READ_CPUS,
            ignore_missing_paths=True,
            override_num_blocks=max(1, -(-len(todo) // batch_size)),
        )
        ds = _map(ds, spec, lay, job.settings, job.model_name, job.digest, previous, batch_size)
        try:
            for batch in ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=0):
                for path, text in zip(batch["path"], batch["result"], strict=True):
                    seen.add(str(path))
                    yield _result(job, items[str(path)], decode_result(str(text)))
                if stop.requested:
                    return
        except (KeyboardInterrupt, GeneratorExit):
            raise
        except Exception as exc:  # Ray wraps whatever an actor raised
            raise ray_failure(exc) from None
        gone = [items[p] for p in todo if p not in seen]  # deleted after the run started
        yield from local.run(gone)

    return job.consume(results(), stop=stop, on_result=on_result)


def _result(job: CaptionJob, item: InputItem, d: dict[str, Any]) -> CaptionResult:
    if d["record"] is None:  # skipped in the actor: unchanged bytes, the earlier record stands
        prev = job.index.get(item.path)
        return CaptionResult("skipped", item, reason=d["reason"], previous=prev.data if prev else None)
    rec = CaptionRecord(**{**d["record"], "notes": tuple(d["record"].get("notes") or ())})
    prev = job.index.get(item.path)
    if prev is not None and prev.data.get("custom_id") != rec.custom_id:
        job.index.supersede(prev)  # the file changed: its old record goes at the end
    return CaptionResult(d["status"], item, rec)


def caption_dataset(
    ds: Any,
    *,
    model: str,
    mmproj: str | None = None,
    settings: CaptionSettings | None = None,
    spec: ActorSpec | None = None,
    actors: int = 1,
    num_cpus: float = 1.0,
    num_gpus: float = 0.0,
    batch_size: int = DEFAULT_BATCH,
) -> Any:
    """A Ray Dataset of ``bytes`` + ``path`` rows (``ray.data.read_binary_files(...,
    include_paths=True)``) → a Dataset of caption records (``PARQUET_COLUMNS``), lazily, on
    ``actors`` actors. Write it wherever Ray Data writes (``.write_parquet("s3://...")``)."""
    from ..caption.parquet import PARQUET_COLUMNS
    from ..hub.download import file_identity
    from ..plan.planner import Wishes

    ray_module()
    missing = {"bytes", "path"} - set(ds.schema().names)
    if missing:
        raise EdgeVLMError(
            f"the dataset needs 'bytes' and 'path' columns (read_binary_files(..., "
            f"include_paths=True)); it has no {', '.join(sorted(missing))}"
        )
    settings = settings or CaptionSettings()
    settings.validate()
    spec = spec or ActorSpec(model, mmproj, Wishes())
    ident = "+".join(file_identity(model, mmproj))
    name = model_identity(model, mmproj or "")[0] if os.path.isfile(model) else os.path.basename(model)
    lay = ActorLayout(actors, num_cpus, num_gpus, spec.threads)
    out = _map(ds, spec, lay, settings, name, settings.digest(ident), [], batch_size)

    def records(batch: dict[str, Any]) -> dict[str, list[Any]]:
        rows = [parquet_row(decode_result(str(t))["record"] or {}) for t in batch["result"]]
        return {k: [r[k] for r in rows] for k in PARQUET_COLUMNS}

    return out.map_batches(records, batch_format="numpy", batch_size=None)
