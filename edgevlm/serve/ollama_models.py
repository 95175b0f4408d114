"""Ollama's model listings of the one model a server has: ``/api/tags``, ``/api/show`` and
``/api/ps`` bodies from the loaded model's GGUF headers and its plan (pure functions)."""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from .ollama import timestamp

if TYPE_CHECKING:
    from ..runtime.model import LoadedModel

__all__ = ["ModelFacts", "facts_of", "model_name", "parameter_size", "ps_body", "show_body", "tags_body"]

FOREVER = timedelta(days=365 * 292)  # (Ollama's expires_at for a model kept loaded for good)


def model_name(model_id: str) -> str:
    """The name Ollama's clients list: ``name:tag`` (``:latest`` when the id has no tag)."""
    return model_id if ":" in model_id.rsplit("/", 1)[-1] else model_id + ":latest"


@dataclass(frozen=True)
class ModelFacts:
    """What Ollama's model listings say of the one model a server has."""

    name: str  # name:tag
    model_id: str
    path: str
    size: int  # the model's and the projector's files
    digest: str
    modified_at: float
    family: str
    parameter_count: int
    quantization: str
    n_ctx: int
    n_ctx_train: int
    template: str
    info: Mapping[str, Any]  # model_info: the GGUF's numbers
    thinking: bool  # the template knows <think>
    vision: bool  # the projector has a vision encoder
    audio: bool  # ... an audio encoder
    size_loaded: int  # the plan's buffers (weights, KV, compute) on every device
    size_vram: int  # ... on the GPUs

    def matches(self, name: str) -> bool:
        return name in (self.name, self.model_id) or model_name(name) == self.name

    @property
    def details(self) -> dict[str, Any]:
        return {
            "parent_model": "",
            "format": "gguf",
            "family": self.family,
            "families": [self.family, "clip"],
            "parameter_size": parameter_size(self.parameter_count),
            "quantization_level": self.quantization,
        }


def parameter_size(n: int) -> str:
    """As Ollama writes it: 7.2B, 8B, 135M."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            v = n / scale
            return f"{int(v)}{unit}" if v == math.floor(v) else f"{v:.1f}{unit}"
    return str(n)


@lru_cache(maxsize=8)
def _parameter_count(path: str, size: int, mtime: float) -> int:
    from ..model.gguf_info import read_gguf

    return sum(t.n_elements for t in read_gguf(path).tensors)


def facts_of(model: LoadedModel, model_id: str) -> ModelFacts:
    """The facts of a loaded model (its GGUF headers, read once, and its plan)."""
    be = model.backend
    text, proj = be.text_info, be.proj_info
    st = os.stat(text.path)
    size = text.file_size + proj.file_size
    digest = hashlib.sha256(f"{text.path}\0{text.file_size}\0{proj.path}\0{proj.file_size}".encode()).hexdigest()
    plan = model.plan
    if plan is not None:
        loaded = sum(d.predicted.total for d in plan.devices)
        vram = sum(d.predicted.total for d in plan.devices if d.kind != "cpu")
    else:
        loaded, vram = size, 0
    fmt = model.scheduler.formatter
    params = _parameter_count(text.path, text.file_size, st.st_mtime)
    arch = text.arch
    info = {
        "general.architecture": arch,
        "general.name": text.name,
        "general.parameter_count": params,
        "general.file_type": text.file_type,
        f"{arch}.context_length": model.n_ctx,  # the server's context (what a request can use)
        f"{arch}.embedding_length": text.n_embd,
        f"{arch}.block_count": text.n_layer,
        f"{arch}.attention.head_count": text.n_head,
        f"{arch}.attention.head_count_kv": text.n_head_kv,
        f"{arch}.vocab_size": text.n_vocab,
        "clip.projector_type": proj.projector_type,
        "clip.vision.image_size": proj.image_size,
        "clip.vision.patch_size": proj.patch_size,
        "edgevlm.context_length_trained": text.n_ctx_train,
    }
    return ModelFacts(
        name=model_name(model_id),
        model_id=model_id,
        path=text.path,
        size=size,
        digest=digest,
        modified_at=st.st_mtime,
        family=arch,
        parameter_count=params,
        quantization=text.file_type,
        n_ctx=model.n_ctx,
        n_ctx_train=text.n_ctx_train,
        template=fmt.template,
        info=info,
        thinking=fmt.caps.thinking,
        vision=proj.has_vision_encoder,
        audio=proj.audio is not None,
        size_loaded=loaded,
        size_vram=vram,
    )


def _entry(f: ModelFacts) -> dict[str, Any]:
    return {
        "name": f.name,
        "model": f.name,
        "modified_at": timestamp(f.modified_at),
        "size": f.size,
        "digest": f.digest,
        "details": f.details,
    }


def tags_body(f: ModelFacts) -> dict[str, Any]:
    """``GET /api/tags``: the one model."""
    return {"models": [_entry(f)]}


def ps_body(f: ModelFacts, started: float) -> dict[str, Any]:
    """``GET /api/ps``: the model, loaded since the server started and kept for good."""
    entry = _entry(f)
    del entry["modified_at"]
    entry.update(
        expires_at=(datetime.fromtimestamp(started, timezone.utc) + FOREVER).isoformat(),
        size=f.size_loaded,
        size_vram=f.size_vram,
        context_length=f.n_ctx,
    )
    return {"models": [entry]}


def show_body(f: ModelFacts, options: Any) -> dict[str, Any]:
    """``POST /api/show``: details, the GGUF's numbers, capabilities, the chat template and the
    server's defaults as Modelfile parameters."""
    s = options.sampling
    params = [("num_ctx", f.n_ctx), ("num_predict", options.max_tokens), ("temperature", s.temperature)]
    params += [("top_k", s.top_k), ("top_p", s.top_p), ("min_p", s.min_p)]
    caps = ["completion", *(["vision"] if f.vision else []), *(["audio"] if f.audio else []), "tools"]
    caps += ["thinking"] if f.thinking else []
    return {
        "license": "",
        "modelfile": f"# Modelfile of edgevlm's model {f.model_id}\nFROM {os.path.basename(f.path)}\n",
        "parameters": "\n".join(f"{k:<30} {v}" for k, v in params),
        "template": f.template,
        "details": f.details,
        "model_info": dict(f.info),
        "capabilities": caps,
        "modified_at": timestamp(f.modified_at),
    }
