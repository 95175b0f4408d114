"""The HTTP edge every API route shares: reading a body under the host allowance, a streamed
reply, and each API's conventions (``Dialect``: where its key is, its error shape)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HTTPRequest
from starlette.responses import StreamingResponse

from ..plan.host import Lease
from .api_errors import RequestTooLarge

__all__ = ["BODY_COPIES", "Dialect", "bearer", "event_stream", "read_body"]

ErrorMap = Callable[[BaseException, int], "tuple[int, dict[str, Any], dict[str, str]]"]  # (exc, retry-after s)


@dataclass(frozen=True)
class Dialect:
    """An API's conventions at the HTTP edge: the API key a request carries, and the status,
    body and headers an exception becomes."""

    name: str
    key: Callable[[Mapping[str, str]], str]
    error: ErrorMap
    key_hint: str = "Authorization: Bearer KEY"


def bearer(headers: Mapping[str, str]) -> str:
    """The key of ``Authorization: Bearer KEY``."""
    auth = headers.get("authorization", "")
    return auth[7:] if auth.lower().startswith("bearer ") else ""


BODY_COPIES = 3  # a body held while read: its chunks, their join, and the parsed JSON


async def read_body(
    request: HTTPRequest, limit: int, lease: Lease | None = None, deadline: float | None = None
) -> bytes:
    """The request body (at most ``limit`` bytes); with ``lease``, the memory it takes is held
    before it is read (the declared length up front, else chunk by chunk)."""
    too_big = RequestTooLarge(f"the request body is larger than {limit:,} bytes (the server's --max-body)")
    declared = request.headers.get("content-length")
    known = int(declared) if declared and declared.isdigit() else None
    if known is not None and known > limit:
        raise too_big
    if lease is not None and known:
        await _hold(lease, known * BODY_COPIES, deadline)
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise too_big
        if lease is not None and (known is None or n > known):
            await _hold(lease, len(chunk) * BODY_COPIES, deadline)
        chunks.append(chunk)
    return b"".join(chunks)


async def _hold(lease: Lease, n: int, deadline: float | None) -> None:
    """``lease.grow`` without blocking the event loop when it has to wait."""
    if not lease.try_grow(n):
        await run_in_threadpool(lease.grow, n, deadline)


def event_stream(
    events: AsyncIterator[str], media_type: str = "text/event-stream", finish: Callable[[], None] | None = None
) -> StreamingResponse:
    """A streamed reply (server-sent events, or Ollama's NDJSON), never buffered by a proxy.
    ``finish`` runs once the response is over, however it ended — also for a client gone before
    the first event, when ``events`` never started and its own cleanup never runs."""
    return StreamingResponse(
        events,
        media_type=media_type,
        headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
        background=BackgroundTask(finish) if finish is not None else None,
    )
