"""What ``GET /status`` and ``GET /metrics`` say of a server: the plan, slots, queue, the host
memory planned beside the RSS measured, and the request counters."""

from __future__ import annotations

import os
import time
from typing import Any, Protocol

import psutil

from ..model.audio import piece_samples
from ..model.projectors import encoder_patches
from ..plan.devices import format_size
from ..runtime.model import LoadedModel
from ..runtime.scheduler import Scheduler
from .options import ServeOptions
from .responses_store import ResponseStore
from .service import ChatService


class Server(Protocol):
    """What the views read of ``app.Server`` (named here: the app imports this module)."""

    options: ServeOptions
    started: float
    error: BaseException | None
    model: LoadedModel | None
    service: ChatService | None
    responses: ResponseStore

    @property
    def state(self) -> str: ...


__all__ = ["host_memory", "image_cache_bound", "metrics", "scheduler_status", "status"]


def status(server: Server) -> dict[str, Any]:
    """``GET /status``: the plan, slots, queue, memory predicted and measured, counters."""
    out: dict[str, Any] = {
        "model": server.options.model_id,
        "state": server.state,
        "uptime_s": round(time.time() - server.started, 1),
    }
    if server.error is not None:
        out["error"] = str(server.error)
    model = server.model
    if model is None or server.service is None:
        return out
    worker = server.service.worker
    sched = model.scheduler
    plan = model.plan
    rss = psutil.Process().memory_info().rss
    out.update(
        # the model files by name, not where they sit on the server's disk
        plan={**(p := plan.to_dict()), **{k: os.path.basename(p[k]) for k in ("model", "mmproj") if p.get(k)}}
        if plan is not None
        else None,
        # a slot is what the scheduler calls one: a KV sequence (running a request, or idle and
        # keeping a conversation's cells); at most max_running of them generate at once
        slots={"total": sched.n_slots, "busy": worker.running, "max_running": sched.max_running},
        kv=scheduler_status(sched),
        # the scheduler's profile, and the threads of the encoder's and the decoder's ggml teams
        profile=sched.options.profile,
        threads=sched.encoder.to_dict(),
        # admitted: every request in, from its body's last byte to its last event (the door's count);
        # reading: bodies still arriving (they hold host allowance for their whole length, no place)
        queue={
            "waiting": worker.queued,
            "limit": server.options.queue,
            "admitted": server.service.admitted,
            "reading": server.service.reading,
        },
        context={"n_ctx": sched.n_ctx, "cells_used": sched.cells_used()},
        memory={
            "predicted": {d.name: d.predicted.total for d in plan.devices} if plan is not None else {},
            "host": host_memory(server, rss),
            "measured": {"process_rss_bytes": rss, "process_rss": format_size(rss), "free": _free_now(model)},
        },
        requests=vars(worker.counters).copy(),
        images_cached=len(sched.images),
    )
    return out


def scheduler_status(sched: Scheduler) -> dict[str, Any]:
    """What runs and what is kept in the scheduler (``kv``)."""
    return {
        "running": sched.busy,
        "max_running": sched.max_running,
        "sequences": sched.n_slots,
        "conversations": sched.conversations,
        "cells_used": sched.cells_used(),
        "n_ctx": sched.n_ctx,
        "host_cache": sched.host_cache.to_dict(),
        "encoding": sched.encoder.pending,
        "evicted": {"conversations": sched.placer.evicted, "cells": sched.placer.evicted_cells},
        "steps": dict(sched.counters),
        "llama_ms": round(sched.llama_ms, 1),  # decode and sampling in llama.cpp (the step loop's batches)
        "encode_ms": round(sched.encoder.total_ms, 1),  # pictures in mtmd's encoder (steps of their own)
        "step_ms": sched.costs.to_dict(),
    }


def host_memory(server: Server, rss: int) -> dict[str, Any]:
    """What the host's memory is planned for, beside the RSS measured now: the model's
    buffers (the plan), the image cache's bound, the host KV cache of idle conversations
    (--cache-ram), the Responses store's and the reply recall's bounds, the process itself
    (--host-reserve) and the requests in flight and waiting (the allowance, and what they
    hold of it now)."""
    model, service = server.model, server.service
    assert model is not None
    assert service is not None
    plan = model.plan
    buffers = plan.host_buffers if plan is not None else 0
    reserve = plan.host_reserve if plan is not None else 0
    cache = image_cache_bound(model)
    kv_cache = model.scheduler.host_cache.max_bytes
    host = service.host.to_dict()
    stored = server.responses.max_bytes  # conversations kept for previous_response_id
    recall = service.worker.recall  # the generated ids of replies, for follow-ups that send them back
    limit = buffers + cache + kv_cache + reserve + host["allowance_bytes"] + stored + recall.max_bytes
    return {
        "buffers_bytes": buffers,
        "image_cache_bytes": cache,
        "kv_cache_bytes": kv_cache,
        "kv_cache_used_bytes": model.scheduler.host_cache.nbytes,
        "responses_store_bytes": stored,
        "responses_store_used_bytes": server.responses.nbytes,
        "reply_recall_bytes": recall.max_bytes,
        "reply_recall_used_bytes": recall.held,
        "process_reserve_bytes": reserve,
        **host,
        "limit_bytes": limit,
        "limit": format_size(limit),
        "rss_bytes": rss,
        "rss_within_limit": rss <= limit,
    }


def metrics(server: Server) -> str:
    """``GET /metrics``: the status's counters as Prometheus text."""
    st = status(server)
    lines = [f"edgevlm_ready {int(st['state'] == 'ready')}"]
    if st["state"] == "ready":
        r = st["requests"]
        lines += [
            f'edgevlm_requests_total{{outcome="served"}} {r["served"]}',
            f'edgevlm_requests_total{{outcome="cancelled"}} {r["cancelled"]}',
            f'edgevlm_requests_total{{outcome="failed"}} {r["failed"]}',
            f'edgevlm_requests_total{{outcome="rejected"}} {r["rejected"]}',
            f"edgevlm_prompt_tokens_total {r['prompt_tokens']}",
            f"edgevlm_cached_tokens_total {r['cached_tokens']}",
            f"edgevlm_generated_tokens_total {r['generated_tokens']}",
            f"edgevlm_slots_busy {st['slots']['busy']}",
            f"edgevlm_slots_total {st['slots']['total']}",
            f"edgevlm_slots_max_running {st['slots']['max_running']}",
            f"edgevlm_queue_waiting {st['queue']['waiting']}",
            f"edgevlm_kv_cells_used {st['context']['cells_used']}",
            f"edgevlm_conversations_kept {st['kv']['conversations']}",
            f"edgevlm_host_kv_cache_bytes {st['kv']['host_cache']['bytes']}",
            f"edgevlm_kv_cells_total {st['context']['n_ctx']}",
            f"edgevlm_process_rss_bytes {st['memory']['measured']['process_rss_bytes']}",
        ]
    return "\n".join(lines) + "\n"


def image_cache_bound(model: LoadedModel) -> int:
    """The most the image cache holds on the host: its units at the largest picture's embeddings
    (and merged copies) and mtmd's preprocessed pixels (a recording's piece: its samples and
    log-mel), within its byte bound."""
    sched, be = model.scheduler, model.backend
    proj = be.proj_info
    tokens = (model.plan.image_max_tokens if model.plan is not None else 0) or 4096
    embeddings = tokens * be.n_embd_inp * 4 * 2  # (a merged copy is at most as large again)
    pixels = encoder_patches(proj, tokens) * proj.patch_size**2 * 3 * 4 if proj.has_vision_encoder else 0
    if proj.audio is not None:  # a recording's piece: its samples and mtmd's log-mel of them
        pixels = max(pixels, piece_samples(proj.audio) * 4 + proj.audio.n_mel * 3000 * 4)
    opts = sched.options
    return min(opts.image_cache_bytes, opts.image_cache_units * embeddings) + opts.image_cache_units * pixels


def _free_now(model: LoadedModel) -> dict[str, int]:
    if model.guard is None:
        return {}
    pr = model.guard.measure()
    return {d.name: d.free_bytes for d in pr.devices}
