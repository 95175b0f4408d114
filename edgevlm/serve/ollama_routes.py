"""Ollama's API as routes (``/api/...``): ``ollama_routes`` for the main app, and ``ollama_app``,
the same routes alone for the ``--ollama-port`` listener (the bodies: ``ollama``,
``ollama_models``; the work: ``app.Server``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from . import ollama, ollama_models
from .api_errors import APIError
from .http import Dialect
from .options import ServeOptions


class Server(Protocol):
    """What the routes need of ``app.Server`` (a protocol: no import of the app)."""

    options: ServeOptions
    started: float

    async def ollama_reply(self, request: HTTPRequest, generate: bool = False) -> Response: ...

    async def small_json(self, request: HTTPRequest) -> Any: ...

    @property
    def ollama_facts(self) -> ollama_models.ModelFacts: ...


__all__ = ["OLLAMA", "ollama_app", "ollama_routes"]

OLLAMA = Dialect("ollama", ollama.api_key, ollama.error_for)


def ollama_routes(server: Server, guarded: Callable[..., Any]) -> list[Route]:
    """Ollama's API (``/api/...``), on the main port and on ``--ollama-port``: chat and generate
    behind the API key (``Authorization: Bearer``) with errors as ``{"error": ...}``; the model
    listings too; ``/api/version`` open, as a health check."""

    async def chat(request: HTTPRequest) -> Response:
        return await server.ollama_reply(request)

    async def generate(request: HTTPRequest) -> Response:
        return await server.ollama_reply(request, generate=True)

    async def facts() -> ollama_models.ModelFacts:
        return await run_in_threadpool(lambda: server.ollama_facts)

    async def tags(request: HTTPRequest) -> Response:
        return JSONResponse(ollama_models.tags_body(await facts()))

    async def ps(request: HTTPRequest) -> Response:
        return JSONResponse(ollama_models.ps_body(await facts(), server.started))

    async def show(request: HTTPRequest) -> Response:
        data = await server.small_json(request)
        name = (data.get("model") or data.get("name")) if isinstance(data, dict) else None
        if not isinstance(name, str) or not name:
            raise APIError("'model' must name a model", "model")
        f = await facts()
        if not f.matches(name):
            raise ollama.not_found(name)
        return JSONResponse(ollama_models.show_body(f, server.options))

    async def version(request: HTTPRequest) -> Response:
        return JSONResponse({"version": ollama.VERSION})

    return [
        Route("/api/chat", guarded(chat, dialect=OLLAMA), methods=["POST"]),
        Route("/api/generate", guarded(generate, dialect=OLLAMA), methods=["POST"]),
        Route("/api/tags", guarded(tags, dialect=OLLAMA), methods=["GET"]),
        Route("/api/show", guarded(show, dialect=OLLAMA), methods=["POST"]),
        Route("/api/ps", guarded(ps, dialect=OLLAMA), methods=["GET"]),
        Route("/api/version", guarded(version, v1=False, dialect=OLLAMA), methods=["GET"]),
    ]


def ollama_app(app: Starlette) -> Starlette:
    """Ollama's API alone, for a second listener (``edgevlm serve --ollama-port``): ``app``'s
    ``/api/...`` routes (the same server and model behind them: ``app``'s lifespan runs it, so
    this app needs none) and ``/`` answering "Ollama is running", as Ollama's root does."""
    routes = [r for r in app.routes if isinstance(r, Route) and r.path.startswith("/api/")]

    async def running(request: HTTPRequest) -> Response:
        return PlainTextResponse("Ollama is running")

    async def http_error(request: HTTPRequest, exc: HTTPException) -> Response:
        return JSONResponse({"error": f"{request.method} {request.url.path}: {exc.detail}"}, exc.status_code)

    out = Starlette(
        routes=[Route("/", running, methods=["GET"]), *routes],
        exception_handlers={HTTPException: http_error},  # type: ignore[dict-item]
    )
    out.state.server = app.state.server
    return out
