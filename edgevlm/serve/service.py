"""A chat-completions request from parsed body to answer, without HTTP: the path the server and
batch files (``edgevlm batch``, its Ray actors) share, so a batch line's body is exactly what
``edgevlm serve`` answers.

    service = ChatService(engine, ServeOptions())
    service.start()
    body = await service.complete(parse_chat_request(data))   # a chat.completion dict
    service.stop()

Work per request: its pictures are fetched, decoded, budgeted and run past the guard in a thread
(``prepare``), a JSON grammar is built when asked for, then the worker renders, queues and runs
it on the engine's one scheduler beside every other request in flight.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from ..backend.system import json_grammar
from ..runtime.conversation import Conversation, Message, Picture
from ..runtime.engine import Engine
from ..vision.budget import render_views
from .media import fetch_image
from .openai import ChatRequest, completion_body
from .options import ServeOptions
from .worker import Job, Worker

__all__ = ["ChatService", "LOW_DETAIL_TOKENS", "next_event"]

LOW_DETAIL_TOKENS = 256  # image_url.detail = "low": a dynamic encoder's budget, and no tiles
Gone = Callable[[], Awaitable[bool]]  # whether the client went away (HTTP disconnect)


class ChatService:
    """An engine's scheduler behind the worker thread, taking parsed chat requests."""

    def __init__(self, engine: Engine, options: ServeOptions):
        self.engine = engine
        self.options = options
        self.worker = Worker(engine, options)

    def start(self) -> None:
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop()

    @property
    def capacity(self) -> int:
        """Requests the worker takes at once (running and queued) before it answers 503."""
        return self.engine.scheduler.n_slots + self.options.queue

    def prepare(self, req: ChatRequest) -> tuple[Conversation, list[int], list[str]]:
        """Fetch, decode and budget the request's pictures and run them past the guard
        (blocking: called in a thread). Returns the conversation (pictures numbered from 1),
        each message's place in the request, and notices. With ``evict`` older pictures may
        give way to summaries, so only the last message's must fit the image room."""
        eng, opts = self.engine, self.options
        notices: list[str] = []
        room = eng.scheduler.budget.image_room(req.max_tokens or opts.max_tokens)
        low = replace(eng.image_budget, tiles="off",
                      tokens=min(eng.image_budget.tokens or LOW_DETAIL_TOKENS, LOW_DETAIL_TOKENS))
        conv, places = Conversation(), []
        for i, m in enumerate(req.messages):
            views, labels, numbers = [], [], []
            last = i == len(req.messages) - 1
            for ref in m.images:
                n = len(conv.pictures) + 1
                img = fetch_image(ref, opts, eng.options.max_image_pixels, ref.name or f"image {n}")
                plan = (low if ref.detail == "low" else eng.image_budget).plan(img)
                notices += [f"image {n}: {note}" for note in plan.notes]
                conv.pictures.append(Picture(n, replace(img, source=ref.name), plan.total_tokens))
                for label, view in render_views(img, plan):
                    if eng.guard is not None:
                        adm = eng.guard.admit(view, room if (last or not req.evict) else eng.n_ctx)
                        if last or not req.evict:
                            room -= adm.tokens
                        view = adm.image
                        if adm.notice:
                            notices.append(adm.notice)
                    views.append(view)
                    labels.append(label)
                    numbers.append(n)
            conv.messages.append(Message(m.role, m.text, views, labels=labels, pictures=numbers))
            places.append(m.index)
        return conv, places, notices

    async def submit(self, req: ChatRequest, gone: Gone | None = None) -> Job:
        """Prepare the request and queue it; returns once the worker accepted it (an error it
        refuses with — 400 too long, 503 busy — is raised)."""
        self.worker.check_capacity()  # before any work
        loop = asyncio.get_running_loop()
        grammar = None
        if req.response_format != "text":
            grammar = await loop.run_in_executor(None, json_grammar, req.json_schema)
        conv, places, notices = await loop.run_in_executor(None, self.prepare, req)
        sched = self.engine.scheduler
        job = Job(conv, req.system, replace(req.sampling, grammar=grammar),
                  req.max_tokens or self.options.max_tokens, req.stop + tuple(sched.default_stops),
                  time.monotonic() + self.options.timeout_s, loop, notices, evict=req.evict, places=places)
        self.worker.submit(job)
        try:
            kind, value = await next_event(job, self.worker, gone)
        except BaseException:
            self.worker.cancel(job)
            raise
        if kind == "error":
            raise value
        return job

    async def whole(self, job: Job, req: ChatRequest, gone: Gone | None = None) -> dict[str, Any]:
        """Wait for the whole reply; the ``chat.completion`` body."""
        parts: list[str] = []
        try:
            while True:
                kind, value = await next_event(job, self.worker, gone)
                if kind == "text":
                    parts.append(value.text)
                elif kind == "error":
                    raise value
                elif kind == "done":
                    break
        except BaseException:
            self.worker.cancel(job)
            raise
        seq = value
        finish = "length" if job.timed_out else seq.finish_reason
        return completion_body(job.id, self.model_name(req), "".join(parts), finish, seq.stats,
                               job.extension(), job.created)

    async def complete(self, req: ChatRequest) -> dict[str, Any]:
        """A non-streaming request from start to answer."""
        return await self.whole(await self.submit(req), req)

    def model_name(self, req: ChatRequest) -> str:
        return req.model or self.options.model_id


async def next_event(job: Job, worker: Worker, gone: Gone | None = None) -> tuple[str, Any]:
    """The job's next event; a client that goes away meanwhile cancels it."""
    while True:
        try:
            return await asyncio.wait_for(job.events.get(), timeout=0.25)
        except asyncio.TimeoutError:
            if gone is not None and await gone():
                worker.cancel(job)
                raise asyncio.CancelledError("client disconnected") from None
