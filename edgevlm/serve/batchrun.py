"""Answering batch-file lines on a ``ChatService``: as many in flight as the scheduler has
sequences (plus a short queue whose pictures are decoded ahead), each answered exactly as
``edgevlm serve`` answers it. Used in this process (``edgevlm batch``) and inside Ray actors
(``edgevlm batch --ray``)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Any

from ..jobs.stop import StopToken
from ..runtime.model import LoadedModel
from .batchfile import BatchLine, error_line, response_line
from .openai import parse_chat_request
from .openai_reply import completion_body, error_for
from .options import ServeOptions
from .responses import parse_responses_request
from .responses_reply import reply_body
from .service import ChatService

__all__ = ["answer_line", "answer_lines", "run_lines"]

OnLine = Callable[[dict[str, Any], BatchLine], None]


async def answer_line(service: ChatService, line: BatchLine, order: asyncio.Lock | None = None) -> dict[str, Any]:
    """One line's output: the answer, or its error as the server would send it. ``order``: held
    while the line is prepared and queued, so lines that share it are queued in the order they
    took it (their pictures are decoded one after another; the replies still run together)."""
    if not line.ok:
        return error_line(line)
    assert line.custom_id is not None
    assert line.body is not None
    try:
        call = parse_responses_request(line.body, service.options.sampling) if line.responses else None
        req = call.request if call is not None else parse_chat_request(line.body, service.options.sampling)
        if order is None:
            job = await service.submit(req)
        else:
            async with order:
                job = await service.submit(req)
        reply = await service.whole(job, req)
        if call is not None:  # OpenAI's Batch API answers /v1/responses lines with response objects
            return response_line(line.custom_id, 200, reply_body(call, service.model_name(req), job.created, reply))
        return response_line(line.custom_id, 200, completion_body(reply))
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # every failure is an output line, never a crash
        status, body, _ = error_for(exc)
        return response_line(line.custom_id, status, body)


async def answer_lines(
    service: ChatService, lines: Iterable[BatchLine], on_line: OnLine, stop: StopToken | None = None
) -> None:
    """Answer ``lines``, up to the service's capacity at once; ``on_line`` hears each output
    line as it finishes. ``stop.requested``: start nothing new, finish what runs;
    ``stop.abandoned``: cancel what runs too (a rerun asks again)."""
    stop = stop or StopToken()
    order = asyncio.Lock()  # lines are queued in file order (asyncio's lock is first come, first served)
    window = max(1, service.capacity)
    source = iter(lines)
    running: dict[asyncio.Task[dict[str, Any]], BatchLine] = {}
    try:
        while True:
            while len(running) < window and not stop.requested:
                line = next(source, None)
                if line is None:
                    break
                if not line.ok:
                    on_line(error_line(line), line)
                    continue
                running[asyncio.ensure_future(answer_line(service, line, order))] = line
            if not running:
                return
            done, _ = await asyncio.wait(list(running), timeout=0.25, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                on_line(task.result(), running.pop(task))
            if stop.abandoned:
                return
    finally:
        for task in running:
            task.cancel()
        if running:
            await asyncio.gather(*running, return_exceptions=True)


def run_lines(
    model: LoadedModel,
    lines: Iterable[BatchLine],
    on_line: OnLine,
    options: ServeOptions,
    stop: StopToken | None = None,
) -> None:
    """Start a chat service on ``model``, answer ``lines``, stop it."""
    service = ChatService(model, options)
    service.start()
    try:
        asyncio.run(answer_lines(service, lines, on_line, stop))
    finally:
        service.stop()
