"""The HTTP app (Starlette): ``create_app(model, options)``.

Routes: ``GET /`` (the web page, ``static/``), ``POST /v1/chat/completions`` (text and images,
streamed or not, JSON output by grammar, tool calls), ``POST /v1/responses`` (OpenAI's Responses
API; ``GET``/``DELETE /v1/responses/{id}``: the responses kept for ``previous_response_id``),
``POST /v1/messages`` (Anthropic's Messages API; ``/v1/messages/count_tokens``),
``POST /v1/audio/transcriptions`` (``transcribe``),
``POST /v1/edgevlm/budget`` (what a picture will cost), ``GET /v1/models``, ``GET /health`` (503
while the model loads), ``GET /status`` (the plan, slots, queue, memory predicted and measured,
counters) and ``GET /metrics`` (Prometheus text); Ollama's API under ``/api/``
(``ollama_routes``). Every API route asks for the API key, when one is set, in its API's own
header, and answers errors in its own shape (a ``Dialect``: OpenAI's ``{"error": {"message",
"type", "param", "code"}}``, Anthropic's ``{"type": "error", "error": {...}}``, Ollama's
``{"error": "..."}``), with a 4xx for anything the client sent. All of them share one admission
path (``Server.accept``) and one request model (``request.ChatRequest``).

Work per request: its place and a lease on the host allowance are taken at the door, the body
is read (at most ``max_body_bytes``, at the server's pace: else 408; the lease growing with the
bytes that arrive), parsed (whatever the API cannot read is a 400), its pictures fetched,
decoded, budgeted and run past the guard in a thread (so the event loop keeps serving), then
the worker renders, queues and runs it on the shared scheduler. A refusal (4xx, 503, a client
gone) is one line in the log (``edgevlm.serve``); a fault in one request is that request's 500
(its traceback in the log once); every other request goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import (
    FileResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from ..errors import shown
from ..plan.host import Lease
from ..runtime.model import LoadedModel
from . import anthropic, anthropic_reply, ollama, ollama_models
from .api_errors import ClientGone, InvalidAPIKey, ModelLoading, NotFound, ServerStopping
from .http import BodyPace, Dialect, bearer, error_response, event_stream, parse_json, parsed, read_body
from .job import Job
from .ollama_routes import ollama_routes
from .openai import parse_chat_request
from .openai_reply import completion_body, error_body, error_for, model_object, stream_events
from .options import ServeOptions
from .request import ChatRequest
from .responses import ResponsesCall, parse_responses_request
from .responses_reply import reply_body, stream_response
from .responses_store import ResponseStore
from .service import ChatService, model_name
from .status import metrics as metrics_text
from .status import status as status_of
from .transcribe import transcription_routes

__all__ = ["Server", "create_app"]

Handler = Callable[[HTTPRequest], Awaitable[Response]]
STATIC = Path(__file__).resolve().parent / "static"  # the web page: plain HTML, CSS, JS
SMALL_BODY_BYTES = 64 * 1024  # the body of a route that runs no model work (/api/show): a name


class Server:
    """The model (loaded in a thread while the app already answers) and its chat service."""

    def __init__(
        self,
        model: LoadedModel | Callable[[], LoadedModel],
        options: ServeOptions,
        on_error: Callable[[BaseException], None] | None = None,
    ):
        self.options = options
        self.started = time.time()
        self.model: LoadedModel | None = model if isinstance(model, LoadedModel) else None
        self.service: ChatService | None = None
        self.error: BaseException | None = None
        self.stopping = False  # ``drain``: the server is stopping
        self._load = None if isinstance(model, LoadedModel) else model
        self._on_error = on_error
        self.responses = ResponseStore(options.responses_store, options.responses_store_bytes)

    @property
    def state(self) -> str:
        ready = "stopping" if self.stopping else "ready"
        return ready if self.service is not None else "error" if self.error is not None else "loading"

    def start(self) -> None:
        if self._load is None:
            assert self.model is not None  # given loaded
            self._ready(self.model)
            return
        threading.Thread(target=self._load_in_thread, name="edgevlm-load", daemon=True).start()

    def _load_in_thread(self) -> None:
        load = self._load
        assert load is not None  # (start runs this thread only then)
        try:
            self._ready(load())
        except BaseException as exc:  # reported on /health and to the CLI
            self.error = exc
            if self._on_error is not None:
                self._on_error(exc)

    def _ready(self, model: LoadedModel) -> None:
        self.model = model
        service = ChatService(model, self.options)
        service.start()
        self.service = service

    def drain(self, since: float | None = None) -> None:
        """The server stops (a signal at ``since``): 503 from here on (``ChatService.drain``)."""
        self.stopping = True
        if self.service is not None:
            self.service.drain(since)

    def stop(self) -> None:
        if self.service is not None:
            self.service.stop()
        if self._load is not None and self.model is not None:  # ours: loaded here
            self.model.close()

    # --- one request, any API ------------------------------------------------------------------
    async def accept(
        self, request: HTTPRequest, parse: Callable[[Any], ChatRequest], count_only: bool = False
    ) -> tuple[Job, ChatRequest]:
        """Read a request's body (under a lease on the host allowance, its whole size taken
        before it is read), parse it with its API's ``parse`` (body → ``ChatRequest``), take its
        place (``ChatService.admit``: only once the body is in) and queue it: the one admission
        path of every route. Returns once the worker accepted it."""
        service = self.service
        assert service is not None
        lease = service.lease("this request")
        try:
            req = parsed(parse, await self.read_json(request, lease))
            service.admit(lease)
            job = await service.submit(req, request.is_disconnected, lease, count_only)
        except BaseException:
            lease.release()
            raise
        return job, req

    async def read_json(self, request: HTTPRequest, lease: Lease) -> Any:
        """A request's body as JSON (``read``); the bytes are dropped once parsed, and the lease
        keeps what the parsed body holds (about as much)."""
        body = await self.read(request, lease, self.options.max_body_bytes)
        data = parse_json(body)
        lease.resize(len(body))
        del body
        return data

    async def small_json(self, request: HTTPRequest) -> Any:
        """The body of a route that runs no model work (Ollama's ``/api/show``), read as any
        other (``read``) but at most ``SMALL_BODY_BYTES``; nothing is held once it is parsed.
        An empty body is ``{}``."""
        service = self.service
        assert service is not None
        with service.lease("this request") as lease:
            body = await self.read(request, lease, SMALL_BODY_BYTES, "this route's bodies only name a model")
            return parse_json(body or b"{}")

    async def read(
        self, request: HTTPRequest, lease: Lease, limit: int, limit_is: str = "the server's --max-body"
    ) -> bytes:
        """A request's body, at most ``limit`` bytes, read under ``lease`` (its whole size held
        before the first byte: ``http.read_body``) at the server's pace (``http.BodyPace``: else
        408), counted on /status while it arrives. A client that leaves meanwhile is counted as
        cancelled."""
        service, o = self.service, self.options
        assert service is not None
        pace = BodyPace(o.body_timeout_s, o.body_min_rate, o.timeout_s)
        service.reading += 1
        try:
            return await read_body(
                request, limit, lease, o.host_wait_s, pace, min(limit, o.chunked_body_bytes), limit_is
            )
        except ClientGone:
            service.worker.count_cancelled()
            raise
        finally:
            service.reading -= 1

    async def chat(self, request: HTTPRequest) -> Response:
        service = self.service
        assert service is not None
        job, req = await self.accept(request, lambda d: parse_chat_request(d, self.options.sampling))
        if req.stream:
            return event_stream(
                stream_events(service.deltas(job, req), req, job.id, service.model_name(req), job.created),
                finish=functools.partial(service.finish, job),
            )
        return JSONResponse(completion_body(await service.whole(job, req, request.is_disconnected)))

    async def messages(self, request: HTTPRequest) -> Response:
        """Anthropic's ``POST /v1/messages``."""
        service = self.service
        assert service is not None
        job, req = await self.accept(request, lambda d: anthropic.parse_messages_request(d, self.options.sampling))
        if req.stream:
            return event_stream(
                anthropic_reply.stream_events(
                    service.deltas(job, req), job.id, service.model_name(req), job.prompt_cells
                ),
                finish=functools.partial(service.finish, job),
            )
        return JSONResponse(anthropic_reply.message_body(await service.whole(job, req, request.is_disconnected)))

    async def count_tokens(self, request: HTTPRequest) -> Response:
        """Anthropic's ``POST /v1/messages/count_tokens``: the prompt's tokens, pictures, tools and
        system included, rendered as a request would be (nothing is run)."""
        service = self.service
        assert service is not None

        def parse(data: Any) -> ChatRequest:
            if isinstance(data, dict) and data.get("max_tokens") is None:
                data = {**data, "max_tokens": 1}  # (no reply is asked for)
            return anthropic.parse_messages_request(data, self.options.sampling)

        job, _ = await self.accept(request, parse, count_only=True)
        service.finish(job)
        return JSONResponse({"input_tokens": job.prompt_cells})

    async def create_response(self, request: HTTPRequest) -> Response:
        """OpenAI's ``POST /v1/responses``: the conversation (an earlier response's, by
        ``previous_response_id``, then this input) is kept with its reply unless ``store`` is false."""
        service = self.service
        assert service is not None
        calls: list[ResponsesCall] = []

        def parse(data: Any) -> ChatRequest:
            calls.append(parse_responses_request(data, self.options.sampling, self.responses))
            return calls[-1].request

        job, req = await self.accept(request, parse)
        call, model = calls[-1], service.model_name(req)
        keep = functools.partial(self.responses.keep, call)
        if req.stream:
            events = stream_response(service.deltas(job, req), call, model, job.created, keep)
            return event_stream(events, finish=functools.partial(service.finish, job))
        reply = await service.whole(job, req, request.is_disconnected)
        return JSONResponse(keep(reply, reply_body(call, model, job.created, reply)))

    async def stored_response(self, request: HTTPRequest) -> Response:
        """``GET /v1/responses/{id}`` (a stored response) and ``DELETE`` (forget it)."""
        rid = request.path_params["response_id"]
        if request.method == "DELETE" and self.responses.delete(rid):
            return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})
        stored = self.responses.get(rid) if request.method == "GET" else None
        if stored is None:
            raise NotFound(f"no response {shown(rid)} is stored here", "response_id")
        return JSONResponse(stored.body)

    async def ollama_reply(self, request: HTTPRequest, generate: bool = False) -> Response:
        """Ollama's ``POST /api/chat`` (and ``/api/generate``): NDJSON when streamed, its default."""
        service = self.service
        assert service is not None
        started = time.monotonic()
        parse = ollama.parse_generate if generate else ollama.parse_chat
        try:
            job, req = await self.accept(request, lambda d: parse(d, self.options.sampling))
        except ollama.LoadOnly as load:  # (no messages: "load the model", which is loaded)
            return JSONResponse(ollama.load_body(model_name(load.model, self.options.model_id), generate))
        model = service.model_name(req)
        if req.stream:
            events = ollama.stream_events(service.deltas(job, req), model, generate, started)
            return event_stream(events, ollama.MEDIA_TYPE, functools.partial(service.finish, job))
        reply = await service.whole(job, req, request.is_disconnected)
        return JSONResponse(ollama.reply_body(reply, generate, started))

    @functools.cached_property
    def ollama_facts(self) -> ollama_models.ModelFacts:
        """What Ollama's listings say of the model (read once, when the model is ready)."""
        assert self.model is not None
        return ollama_models.facts_of(self.model, self.options.model_id)

    async def budget(self, request: HTTPRequest) -> Response:
        """What a picture or a clip will cost before anything is encoded (the ``edgevlm budget``
        view, from the one intake): ``{"image_url": {"url": ...}, "detail": ...}`` → the plan of
        its views; ``{"video_url": {"url": ...}, "max_tokens": N}`` → the frames chosen under the
        room a request with that reply has, with thumbnails of the kept ones. Admitted like any
        request: under the queue limit and the host allowance."""
        service = self.service
        assert service is not None
        lease = service.lease("this picture")
        try:
            body = await self.read_json(request, lease)
            service.admit(lease)
            return JSONResponse(await run_in_threadpool(service.budget, body, lease))
        finally:
            lease.release()

    # --- the rest --------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        return status_of(self)

    def metrics(self) -> str:
        return metrics_text(self)


OPENAI = Dialect("openai", bearer, error_for)
ANTHROPIC = Dialect("anthropic", anthropic.api_key, anthropic_reply.error_for, "x-api-key: KEY")


def create_app(
    model: LoadedModel | Callable[[], LoadedModel],
    options: ServeOptions = ServeOptions(),
    *,
    on_error: Callable[[BaseException], None] | None = None,
) -> Starlette:
    """The app over a loaded model, or over a function that loads one (called in a thread at
    startup; ``/health`` says 503 until it returns, and ``on_error`` hears if it fails)."""
    server = Server(model, options, on_error)

    def guarded(handler: Handler, v1: bool = True, dialect: Dialect = OPENAI, key: bool | None = None) -> Handler:
        """``handler`` behind the API key (in ``dialect``'s header; ``key``: off the API routes too) and
        the model's readiness (``v1``); whatever it raises becomes ``dialect``'s error response."""
        keyed = v1 if key is None else key

        async def endpoint(request: HTTPRequest) -> Response:
            try:
                if keyed and options.api_key is not None:
                    token = dialect.key(request.headers)
                    if not hmac.compare_digest(token.encode(), options.api_key.encode()):
                        raise InvalidAPIKey(f"invalid or missing API key ({dialect.key_hint})")
                if v1 and server.state == "stopping":
                    raise ServerStopping("the server is stopping")
                if v1 and server.state != "ready":
                    raise ModelLoading(f"the model is {server.state}" + (f": {server.error}" if server.error else ""))
                return await handler(request)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                return error_response(exc, dialect, options.retry_after_s, request)

        return endpoint

    async def chat(request: HTTPRequest) -> Response:
        return await server.chat(request)

    async def messages(request: HTTPRequest) -> Response:
        return await server.messages(request)

    async def count_tokens(request: HTTPRequest) -> Response:
        return await server.count_tokens(request)

    async def create_response(request: HTTPRequest) -> Response:
        return await server.create_response(request)

    async def stored_response(request: HTTPRequest) -> Response:
        return await server.stored_response(request)

    async def page(request: HTTPRequest) -> Response:
        return FileResponse(STATIC / "index.html", headers={"cache-control": "no-cache"})

    def card() -> dict[str, Any]:
        return model_object(options.model_id, server.started, server.model)

    async def models(request: HTTPRequest) -> Response:
        return JSONResponse({"object": "list", "data": [card()]})

    async def model_card(request: HTTPRequest) -> Response:
        if request.path_params["model"] != options.model_id:
            raise NotFound(
                f"no model {shown(request.path_params['model'])} (this server has {shown(options.model_id)})",
                "model",
                "model_not_found",
            )
        return JSONResponse(card())

    async def health(request: HTTPRequest) -> Response:
        st = server.state
        body: dict[str, Any] = {"status": "ok" if st == "ready" else st}
        if server.error is not None:
            body["message"] = str(server.error)
        return JSONResponse(body, 200 if st == "ready" else 503)

    async def status(request: HTTPRequest) -> Response:
        return JSONResponse(server.status())

    async def metrics(request: HTTPRequest) -> Response:
        return PlainTextResponse(server.metrics(), media_type="text/plain; version=0.0.4")

    async def http_error(request: HTTPRequest, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        if request.url.path.startswith("/api/"):  # Ollama's clients read {"error": "..."}
            return JSONResponse({"error": f"{request.method} {request.url.path}: {exc.detail}"}, exc.status_code)
        return JSONResponse(
            error_body(f"{request.method} {request.url.path}: {exc.detail}", code=code), exc.status_code
        )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        server.start()
        try:
            yield
        finally:
            await run_in_threadpool(server.stop)

    app = Starlette(
        routes=[
            Route("/", page, methods=["GET"]),
            Mount("/static", StaticFiles(directory=STATIC), name="static"),
            Route("/v1/chat/completions", guarded(chat), methods=["POST"]),
            Route("/v1/messages", guarded(messages, dialect=ANTHROPIC), methods=["POST"]),
            Route("/v1/messages/count_tokens", guarded(count_tokens, dialect=ANTHROPIC), methods=["POST"]),
            Route("/v1/responses", guarded(create_response), methods=["POST"]),
            Route("/v1/responses/{response_id}", guarded(stored_response), methods=["GET", "DELETE"]),
            Route("/v1/edgevlm/budget", guarded(server.budget), methods=["POST"]),
            *transcription_routes(server, guarded),
            Route("/v1/models", guarded(models), methods=["GET"]),
            Route("/v1/models/{model}", guarded(model_card), methods=["GET"]),
            *ollama_routes(server, guarded),
            Route("/health", guarded(health, v1=False), methods=["GET"]),  # open: a load balancer's probe
            Route("/status", guarded(status, v1=False, key=True), methods=["GET"]),
            Route("/metrics", guarded(metrics, v1=False, key=True), methods=["GET"]),
            Route("/favicon.ico", lambda _: FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml")),
        ],
        # starlette types every handler's exc as Exception, though it calls each with its own class
        exception_handlers={HTTPException: http_error},  # type: ignore[dict-item]
        lifespan=lifespan,
    )
    app.state.server = server
    return app
