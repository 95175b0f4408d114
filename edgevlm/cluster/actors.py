"""The stateful Ray actors: each loads its model once and then takes batches of rows.

``CaptionActor`` gets rows of image bytes and paths (Ray Data's ``read_binary_files``) and
returns one caption record per row; ``BatchActor`` gets batch-file lines and returns their
output lines. Both load through ``ActorSpec``: the model files are made local on the node once
(the hub cache under a machine-wide lock, or a path every node shares), and actors on one node
load one after another, each planning from the memory its node has free at that moment — so the
second actor's plan sees what the first one took.
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import dataclass, replace
from typing import Any

from filelock import FileLock

from ..api import load
from ..caption.inputs import InputItem
from ..caption.prepare import ResumeIndex
from ..caption.runner import Captioner
from ..caption.settings import CaptionSettings, caption_slots
from ..hub.download import local_files
from ..jobs.records import Entry
from ..plan.planner import Wishes
from ..runtime.engine import EngineOptions
from ..runtime.model import LoadedModel
from ..runtime.scheduler import THROUGHPUT
from ..serve.batchfile import BatchLine
from ..serve.batchrun import answer_lines
from ..serve.options import ServeOptions, serve_layout
from ..serve.service import ChatService
from ..vision.merge import MergeSpec

__all__ = ["ActorSpec", "BatchActor", "CaptionActor", "decode_result", "encode_result"]


@dataclass(frozen=True)
class ActorSpec:
    """How every actor gets its model (pickled to each of them)."""

    model: str  # a path every node sees, a registry name or an hf: spec
    mmproj: str | None
    wishes: Wishes
    threads: int | None = None
    parallel: int | None = None  # requests / images in flight per actor (None: what the context holds)
    verbose: bool = False


def _load_lock() -> FileLock:
    return FileLock(os.path.join(tempfile.gettempdir(), "edgevlm-ray-load.lock"))


def _load(spec: ActorSpec, **kw: Any) -> LoadedModel:
    with _load_lock():  # one download, and one measurement-then-load at a time, per node
        model, mmproj = local_files(spec.model, spec.mmproj)
        return load(
            model,
            mmproj,
            wishes=spec.wishes,
            n_threads=spec.threads,
            verbose=spec.verbose,
            scheduler_options=THROUGHPUT,  # batch work: nobody watches a stream
            **kw,
        )


def encode_result(res: Any) -> str:
    return json.dumps(
        {
            "status": res.status,
            "reason": res.reason,
            "record": res.record.to_dict() if res.record is not None else None,
        },
        ensure_ascii=False,
    )


def decode_result(text: str) -> dict[str, Any]:
    return json.loads(text)


class CaptionActor:
    """Captions image rows (``bytes``, ``path``) with one model, several images in flight."""

    def __init__(
        self,
        spec: ActorSpec,
        settings: CaptionSettings,
        model_name: str,
        digest: str,
        previous: list[dict[str, Any]] | None = None,
    ):
        self.model = _load(
            spec,
            options=EngineOptions(system=settings.system, merge=MergeSpec.parse(settings.merge)),
            n_seq_max=lambda plan: caption_slots(plan.n_ctx, plan.image_max_tokens, settings, spec.parallel),
        )
        self.settings = settings
        self.model_name = model_name
        self.digest = digest
        # earlier records of files that changed (or could not be checked) on the driver: an
        # unchanged image (same sha256) is skipped here instead of captioned again
        self.index = ResumeIndex([Entry(d, b"") for d in previous or []], digest)
        self.parallel = spec.parallel

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[str]]:
        items = [
            InputItem(str(p), str(p), True, data=bytes(b)) for p, b in zip(batch["path"], batch["bytes"], strict=True)
        ]
        cap = Captioner(
            self.model, self.settings, self.model_name, self.digest, index=self.index, prefetch=2, slots=self.parallel
        )
        out: dict[str, list[str]] = {"path": [], "result": []}
        for res in cap.run(items):
            out["path"].append(res.item.path)
            out["result"].append(encode_result(res))
        return out


class BatchActor:
    """Answers batch-file lines with one model and its chat service, many in flight."""

    def __init__(self, spec: ActorSpec, options: ServeOptions, engine_options: EngineOptions):
        wishes = replace(spec.wishes, images=max(spec.wishes.images, spec.parallel or 1))
        layout = lambda plan: serve_layout(
            plan.n_ctx,
            plan.image_max_tokens,
            options.max_tokens,
            spec.parallel,
            wishes.sequences,
        )
        self.model = _load(
            replace(spec, wishes=wishes),
            options=engine_options,
            n_seq_max=lambda plan: layout(plan)[0],
            parallel=lambda plan: layout(plan)[1],
        )
        self.service = ChatService(self.model, options)
        self.service.start()

    def __call__(self, batch: dict[str, Any]) -> dict[str, list[str]]:
        import asyncio

        lines = []
        for text in batch["line"]:
            d = json.loads(str(text))
            lines.append(BatchLine(d["number"], d["custom_id"], d["body"]))
        answers: list[str] = []
        asyncio.run(answer_lines(self.service, lines, lambda out, line: answers.append(json.dumps(out))))
        return {"answer": answers}
