"""The error table at the HTTP edge: what every exception becomes, for every API, in one place.

``TABLE`` maps an exception class to its HTTP status, OpenAI's error ``type``, Anthropic's
error ``type`` and whether a client should retry (a ``retry-after`` of the server's
``ServeOptions.retry_after_s``, or ``x-should-retry: false``). Each API's formatter (``openai``,
``anthropic``, ``ollama``) reads it through ``failure_of`` and only puts the result in its own
shape, so a status never differs between APIs.

The recurring refusals are named classes (``ServerBusy``, ``ClientGone``, ``NotFound`` ...):
a call site raises ``ServerBusy("...")`` and never spells a status, a type or a header.
``APIError`` is a request refused at the edge, not an ``InputError`` (a 503 is no bad input);
its 4xx cases still exit 2 where a command reports them, as bad input does.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import (
    DoesNotFit,
    DownloadError,
    EdgeVLMError,
    ImageError,
    InputError,
    MediaRefused,
    MediaTimedOut,
    MemoryBusy,
    clipped,
)
from ..plan.host import LeaseReleased
from .options import ServeOptions

__all__ = [
    "APIError",
    "BodyTooSlow",
    "ClientGone",
    "Failure",
    "InvalidAPIKey",
    "Kind",
    "ModelLoading",
    "NotFound",
    "RETRY_AFTER_S",
    "RequestTimedOut",
    "RequestTooLarge",
    "ServerBusy",
    "ServerStopping",
    "TABLE",
    "WorkerStopped",
    "failure_of",
    "kind_of",
]

RETRY_AFTER_S = ServeOptions.retry_after_s  # (ServeOptions' default; a server passes its own)


class APIError(EdgeVLMError):
    """A request an API refuses (400 unless a subclass says otherwise: see ``TABLE``), with the
    field it names (``param``) and a machine-readable ``code`` for the error body."""

    exit_code = 2  # (a 4xx: the caller's request; the 5xx subclasses say 1)

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        if code is not None:
            self.code = code


class InvalidAPIKey(APIError):
    """The request's API key is missing or wrong (401)."""

    code = "invalid_api_key"


class NotFound(APIError):
    """What the request names is not here: a model, a stored response (404)."""

    code = "not_found"


class RequestTooLarge(APIError):
    """The request body is over the server's ``--max-body`` (413)."""

    code = "request_too_large"


class BodyTooSlow(APIError):
    """The request body did not arrive within the server's pace (408: ``http.BodyPace``,
    ``--body-timeout`` and ``--body-min-rate``); the connection is closed after the reply."""

    code = "body_timeout"


class ClientGone(APIError):
    """The client disconnected before its reply (499, nginx's convention: nobody reads it)."""

    code = "cancelled"


class ServerBusy(APIError):
    """Every sequence and queue place is taken: retry shortly (503)."""

    exit_code = 1
    code = "server_busy"


class ServerStopping(APIError):
    """The server is shutting down (503: another instance may answer)."""

    exit_code = 1
    code = "server_stopping"


class ModelLoading(APIError):
    """The model is not loaded (yet, or it failed to load) (503)."""

    exit_code = 1
    code = "model_loading"


class RequestTimedOut(APIError):
    """The request got no sequence or no answer within the server's timeout (503)."""

    exit_code = 1
    code = "timeout"


class WorkerStopped(APIError):
    """The model's worker thread is gone (500: the server needs a restart)."""

    exit_code = 1
    code = "worker_stopped"


@dataclass(frozen=True)
class Kind:
    """A row of the table: the status, each API's error type, and the retry advice (True: a
    ``retry-after``; False: ``x-should-retry: false``; None: none, the client's own policy)."""

    status: int
    openai: str
    anthropic: str
    retry: bool | None


_CLIENT = "invalid_request_error"
_BUSY = Kind(503, "server_error", "overloaded_error", True)

# Looked up along the exception's MRO: the most specific class listed wins.
TABLE: dict[type[BaseException], Kind] = {
    InvalidAPIKey: Kind(401, "authentication_error", "authentication_error", False),
    NotFound: Kind(404, _CLIENT, "not_found_error", False),
    RequestTooLarge: Kind(413, _CLIENT, "request_too_large", False),
    BodyTooSlow: Kind(408, _CLIENT, "timeout_error", None),  # (a slow link may do better next time)
    ClientGone: Kind(499, _CLIENT, _CLIENT, False),
    LeaseReleased: Kind(499, _CLIENT, _CLIENT, False),  # (the request ended: its client is gone)
    ServerBusy: _BUSY,
    ServerStopping: _BUSY,
    ModelLoading: _BUSY,
    RequestTimedOut: _BUSY,
    MediaTimedOut: _BUSY,  # (a request's time ran out while its URLs were fetched)
    MemoryBusy: _BUSY,  # may work once memory frees up
    WorkerStopped: Kind(500, "server_error", "api_error", None),
    APIError: Kind(400, _CLIENT, _CLIENT, False),
    ImageError: Kind(400, _CLIENT, _CLIENT, False),
    InputError: Kind(400, _CLIENT, _CLIENT, False),
    DoesNotFit: Kind(507, "server_error", "api_error", None),
    DownloadError: Kind(502, "server_error", "api_error", None),
    EdgeVLMError: Kind(500, "server_error", "api_error", None),
    BaseException: Kind(500, "server_error", "api_error", None),  # a bug: the log has the rest
}


def kind_of(exc: BaseException) -> Kind:
    """The table's row for ``exc``: its class's, or the nearest listed base class's."""
    for cls in type(exc).__mro__:
        if cls in TABLE:
            return TABLE[cls]
    return TABLE[BaseException]


@dataclass(frozen=True)
class Failure:
    """An exception as every API's error needs it, in no API's shape yet."""

    status: int
    message: str
    openai_type: str
    anthropic_type: str
    code: str | None = None
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)


def failure_of(exc: BaseException, retry_after_s: int = RETRY_AFTER_S) -> Failure:
    """``exc`` through the table; ``retry_after_s``: the server's ``ServeOptions.retry_after_s``.
    Anything that is not an ``EdgeVLMError`` says only its class (the log has the rest)."""
    kind = kind_of(exc)
    ours = isinstance(exc, EdgeVLMError)
    headers = (
        {"retry-after": str(retry_after_s)}
        if kind.retry
        else {"x-should-retry": "false"}
        if kind.retry is False
        else {}
    )
    return Failure(
        kind.status,
        clipped(str(exc)) if ours else f"internal error ({type(exc).__name__})",
        kind.openai,
        kind.anthropic,
        exc.code if isinstance(exc, EdgeVLMError) else None,
        exc.param if isinstance(exc, (APIError, MediaRefused)) else None,
        headers,
    )
