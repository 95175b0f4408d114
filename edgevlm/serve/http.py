"""The HTTP edge every API route shares: reading a body under the host allowance and at a pace
(``BodyPace``), parsing it as JSON, a streamed reply, and each API's conventions (``Dialect``:
where its key is, its error shape)."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse

from ..errors import EdgeVLMError
from ..plan.host import Lease
from .api_errors import TABLE, APIError, BodyTooSlow, ClientGone, RequestTooLarge, kind_of
from .request import ChatRequest

__all__ = [
    "BODY_COPIES",
    "MAX_DEPTH",
    "BodyPace",
    "Dialect",
    "bearer",
    "error_response",
    "event_stream",
    "parse_json",
    "parsed",
    "read_body",
]

log = logging.getLogger("edgevlm.serve")

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
MAX_DEPTH = 128  # arrays and objects a body may nest (serde_json's limit): deeper is a 400


@dataclass(frozen=True)
class BodyPace:
    """How fast a body must arrive (as Apache's ``mod_reqtimeout`` ``body=20,MinRate=...``): all
    of it within ``timeout_s`` of the first read, a second more for every ``min_rate`` bytes that
    arrived, never past ``most_s``. A body that misses it ends with 408 (``BodyTooSlow``), and
    its lease and place are given back at once. Time spent waiting for the host allowance (the
    server's doing, not the client's) does not count. (The defaults: ``ServeOptions``.)"""

    timeout_s: float
    min_rate: int  # bytes a second
    most_s: float

    def deadline(self, start: float, received: int) -> float:
        """When a body that began at ``start`` (``time.monotonic()``) and has ``received`` bytes
        so far must be complete."""
        return start + min(self.most_s, self.timeout_s + received / max(1, self.min_rate))


async def read_body(
    request: HTTPRequest,
    limit: int,
    lease: Lease | None = None,
    host_wait_s: float | None = None,
    pace: BodyPace | None = None,
) -> bytes:
    """The request body (at most ``limit`` bytes, arriving at ``pace``). With ``lease``, the
    memory it takes is held as it arrives: ``BODY_COPIES`` × each chunk (what its join and its
    parse will take too) before the chunk is kept, waiting at most ``host_wait_s`` for the
    allowance. A body that only declares a large ``Content-Length`` holds nothing it has not
    sent; one over ``limit`` (declared or counted) is a 413 at once; a client that leaves while
    it sends is ``ClientGone``."""
    too_big = RequestTooLarge(f"the request body is larger than {limit:,} bytes (the server's --max-body)")
    declared = request.headers.get("content-length")
    known = int(declared) if declared and declared.isdigit() else None
    if known is not None and known > limit:
        raise too_big
    start, waited = time.monotonic(), 0.0
    chunks, n = [], 0
    stream = request.stream()
    while True:
        left = None if pace is None else pace.deadline(start + waited, n) - time.monotonic()
        try:
            if left is not None and left <= 0:
                raise asyncio.TimeoutError
            chunk = await _within(stream.__anext__(), left)
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            assert pace is not None  # (only a pace sets a deadline)
            raise BodyTooSlow(
                f"the request body did not arrive in time: {n:,} of {known or 'more'} bytes came in "
                f"{time.monotonic() - start - waited:.1f} s (the server asks for all of it within "
                f"{pace.timeout_s:g} s plus 1 s per {pace.min_rate:,} bytes)"
            ) from None
        except ClientDisconnect:
            raise ClientGone(
                f"the client went away while its body was sent ({n:,} of {known or '?'} bytes came)"
            ) from None
        n += len(chunk)
        if n > limit:
            raise too_big
        if lease is not None and chunk:
            t = time.monotonic()
            await _hold(lease, len(chunk) * BODY_COPIES, host_wait_s)
            waited += time.monotonic() - t
        chunks.append(chunk)
    return b"".join(chunks)


if sys.version_info >= (3, 11):

    async def _within(step: Awaitable[bytes], left: float | None) -> bytes:
        """``await step`` for at most ``left`` seconds (``asyncio.TimeoutError`` after). No Task per
        chunk, as ``wait_for`` makes: those small objects, made between one body's chunks, kept
        the freed chunks' heap from shrinking (the idle RSS grew with every large body)."""
        async with asyncio.timeout(left):
            return await step
else:  # pragma: no cover - Python 3.10

    async def _within(step: Awaitable[bytes], left: float | None) -> bytes:
        return await asyncio.wait_for(step, left)


async def _hold(lease: Lease, n: int, wait_s: float | None) -> None:
    """``lease.grow`` without blocking the event loop when it has to wait (at most ``wait_s``)."""
    if not lease.try_grow(n):
        deadline = None if wait_s is None else time.monotonic() + wait_s
        await run_in_threadpool(lease.grow, n, deadline)


def parse_json(body: bytes) -> Any:
    """A body as JSON; anything that is not JSON, or nests deeper than ``MAX_DEPTH``, is a 400
    saying so (never a ``RecursionError``: every later step walks the body recursively)."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise APIError(f"the body nests arrays and objects too deeply (at most {MAX_DEPTH} levels)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(f"the body is not valid JSON ({exc})") from None
    if _depth_over(data, MAX_DEPTH):
        raise APIError(f"the body nests arrays and objects too deeply (at most {MAX_DEPTH} levels)")
    return data


def _depth_over(data: Any, most: int) -> bool:
    """Whether ``data`` nests more than ``most`` arrays and objects (walked without recursion)."""
    todo: list[tuple[Any, int]] = [(data, 1)]
    while todo:
        item, depth = todo.pop()
        if isinstance(item, dict):
            item = item.values()
        elif not isinstance(item, list):
            continue
        if depth > most:
            return True
        todo.extend((v, depth + 1) for v in item if isinstance(v, (dict, list)))
    return False


def parsed(parse: Callable[[Any], ChatRequest], data: Any) -> ChatRequest:
    """``parse(data)``, an API's body → ``ChatRequest``: whatever the body's shape makes it
    fail on is a 400 saying what is wrong, never a 500."""
    try:
        return parse(data)
    except EdgeVLMError:
        raise
    except RecursionError:
        raise APIError("the body nests arrays and objects too deeply") from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        raise APIError(f"the body is not a request this API reads ({type(exc).__name__}: {exc})") from None


def error_response(
    exc: BaseException, dialect: Dialect, retry_after_s: int, request: HTTPRequest | None = None
) -> JSONResponse:
    """``exc`` as ``dialect``'s error response, logged once to ``edgevlm.serve``: a refusal the
    error table names (4xx, 503 busy or memory, a client gone ...) as one line, a fault (what
    falls to the table's catch-all rows) with its traceback, unless the worker logged it."""
    status, body, headers = dialect.error(exc, retry_after_s)
    where = f"{request.method} {request.url.path}" if request is not None else "a request"
    if getattr(exc, "edgevlm_logged", False):
        pass
    elif kind_of(exc) in (TABLE[EdgeVLMError], TABLE[BaseException]):  # what the table does not name
        log.error("%s failed", where, exc_info=exc)
    else:
        code = getattr(exc, "code", None) or type(exc).__name__
        log.warning("%s: %d %s: %s", where, status, code, str(exc).splitlines()[0] if str(exc) else "")
    if isinstance(exc, BodyTooSlow):  # (the rest of the body is not read: the connection ends)
        headers["connection"] = "close"
    return JSONResponse(body, status, headers=headers)


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
