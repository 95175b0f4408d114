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
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, StreamingResponse

from ..errors import EdgeVLMError, clipped
from ..plan.host import Lease
from ..runtime.jsonrules import nests_deeper
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
    "hold",
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
    chunked_limit: int | None = None,
    limit_is: str = "the server's --max-body",
) -> bytes:
    """The request body (at most ``limit`` bytes, arriving at ``pace``). With ``lease``, the
    memory it will take is held whole before its first byte is read: ``BODY_COPIES`` × its
    ``Content-Length`` (what its chunks, their join and its parse take), waiting at most
    ``host_wait_s`` for the allowance — so bodies half read never wait on each other for the
    rest. A body without a ``Content-Length`` (chunked) may hold at most ``chunked_limit``
    bytes (default ``limit``), taken the same way. One over its limit (declared or counted) is
    a 413 at once (``limit_is``: what sets ``limit``, as the error says); a client that leaves
    while it sends is ``ClientGone``."""
    declared = request.headers.get("content-length")
    known = int(declared) if declared and declared.isdigit() else None
    if known is not None and known > limit:
        raise RequestTooLarge(f"the request body is larger than {limit:,} bytes ({limit_is})")
    most = known if known is not None else min(limit, chunked_limit or limit)
    too_big = RequestTooLarge(
        f"the request body is larger than {limit:,} bytes ({limit_is})"
        if known is not None or most == limit
        else f"a request body without a Content-Length may hold at most {most:,} bytes (send its "
        f"Content-Length for a larger one, up to {limit:,}: {limit_is})"
    )
    if lease is not None:
        await hold(lease, most * BODY_COPIES, host_wait_s)
    start = time.monotonic()
    chunks, n = [], 0
    stream = request.stream()
    while True:
        left = None if pace is None else pace.deadline(start, n) - time.monotonic()
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
                f"{time.monotonic() - start:.1f} s (the server asks for all of it within "
                f"{pace.timeout_s:g} s plus 1 s per {pace.min_rate:,} bytes)"
            ) from None
        except ClientDisconnect:
            raise ClientGone(
                f"the client went away while its body was sent ({n:,} of {known or '?'} bytes came)"
            ) from None
        n += len(chunk)
        if n > most:
            raise too_big
        chunks.append(chunk)
    return b"".join(chunks)


HOLD_POLL_S = 0.02  # a body waiting for host allowance looks again this often (no thread held)


async def hold(lease: Lease, n: int, wait_s: float | None) -> None:
    """``lease.grow(n)`` inside the event loop: taken at once when free, else looked for again
    every ``HOLD_POLL_S`` until ``wait_s`` has passed (then ``MemoryBusy``, a 503) — without a
    thread per waiter, so bodies waiting for memory never hold the threads others need. More
    than the whole allowance is refused at once (``InputError``)."""
    if lease.try_grow(n):
        return
    if lease.held + n > lease.allowance.total:
        lease.grow(n)  # (raises: more than the whole allowance)
    end = None if wait_s is None else time.monotonic() + wait_s
    while True:
        await asyncio.sleep(HOLD_POLL_S)  # WAIT: for another request to give memory back, by ``end``
        if lease.try_grow(n):
            lease.allowance.count_wait()
            return
        if end is not None and time.monotonic() >= end:
            lease.grow(n, time.monotonic())  # (takes it if it just came free, else MemoryBusy, counted)
            lease.allowance.count_wait()
            return


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


def parse_json(body: bytes) -> Any:
    """A body as JSON; anything that is not JSON, or nests deeper than ``MAX_DEPTH``, is a 400
    saying so (never a ``RecursionError``: every later step walks the body recursively)."""
    try:
        data = json.loads(body)
    except RecursionError:
        raise APIError(f"the body nests arrays and objects too deeply (at most {MAX_DEPTH} levels)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(f"the body is not valid JSON ({exc})") from None
    if nests_deeper(data, MAX_DEPTH):
        raise APIError(f"the body nests arrays and objects too deeply (at most {MAX_DEPTH} levels)")
    return data


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
        log.warning("%s: %d %s: %s", where, status, code, clipped(str(exc).splitlines()[0]) if str(exc) else "")
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
