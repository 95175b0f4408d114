"""A chat-completions request from parsed body to answer, without HTTP: the path the server and
batch files (``edgevlm batch``, its Ray actors) share, so a batch line's body is exactly what
``edgevlm serve`` answers.

    service = ChatService(vlm, ServeOptions())       # vlm: a LoadedModel
    service.start()
    reply = await service.complete(parse_chat_request(data))  # a Reply (openai_reply.completion_body: its JSON)
    service.stop()

Work per request: the JSON grammar (when asked for) is built and parsed by llama.cpp first,
then its pictures are fetched, decoded, budgeted and run past the guard in a thread
(``prepare``), and the worker renders, queues and runs it on the model's one scheduler beside
every other request in flight.

Host memory: a request holds a lease on the service's host allowance (``plan.host``) for what
it keeps — its body, then each picture's full decode only while it is decoded (taken before
decoding), then its budgeted views, mtmd's preprocessed copy and their embeddings — and gives
it back when it ends. Views larger than the encoder needs are kept small (``compact_view``):
a queued request never holds a full decode. When the allowance is used up a request waits up
to ``host_wait_s``, then gets 503 with Retry-After.

Every wait has a deadline: a request that gets no event by its own deadline (plus a grace)
ends with a 503, and one whose worker is gone with a 500 — a batch line never hangs.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

from ..plan.host import HostAllowance, Lease, return_freed_memory, trim_freed_memory
from ..runtime.intake import Asked, Fetcher, MediaRef, ReplySpec, Turn
from ..runtime.model import LoadedModel
from ..runtime.requests import Sequence
from ..runtime.saved import binding_of
from .api_errors import APIError, ClientGone, RequestTimedOut, ServerBusy, ServerStopping, WorkerStopped
from .job import Event, Job
from .options import ServeOptions
from .prep import Preparation
from .recall import load_recall, save_recall
from .replies import ReplySplitter
from .request import ChatRequest, Delta, Reply, audio_uri
from .rules import ReplyRules
from .worker import Worker

__all__ = ["MODEL_NAME_MAX", "ChatService", "model_name", "next_event"]

NAME_MAX = 256  # characters of the budget route's 'name' (a label its answer repeats)
EVENT_GRACE_S = 30.0  # past its deadline, a request waits this much longer for its last event
Gone = Callable[[], Awaitable[bool]]  # whether the client went away (HTTP disconnect)


class ChatService:
    """A loaded model's scheduler behind the worker thread, taking parsed chat requests."""

    def __init__(self, model: LoadedModel, options: ServeOptions):
        self.model = model
        self.options = options
        self.worker = Worker(model, options)
        self.rules = ReplyRules(model, options)
        self.fetcher = Fetcher(options.fetch_rules)  # (image URLs on threads of their own)
        self.intake = model.intake(fetcher=self.fetcher, host_wait_s=options.host_wait_s)  # (never keeps a full decode)
        planned = model.plan.host_allowance if model.plan is not None else 0
        self.host = HostAllowance(planned or options.host_allowance, trim=trim_freed_memory)
        self.admitted = 0  # requests in, from their body's last byte to their last event (``admit``)
        self.reading = 0  # bodies arriving (counted by the HTTP edge, in the event loop)
        self.stopping = False  # the server is stopping (``drain``): every request gets 503
        self._places = threading.Lock()

    def start(self) -> None:
        return_freed_memory()  # RSS follows what requests hold (see plan.host)
        if self.options.cache_dir:  # the replies a server of this model handed out before a restart
            load_recall(self.worker.recall, self.options.cache_dir, binding_of(self.model.backend))
        self.worker.start()

    def stop(self) -> None:
        self.worker.stop()
        self.fetcher.close()
        # conversations still resident or in RAM go to the disk tier (--cache-dir), within the
        # grace, and the replies' exact ids with them
        self.model.scheduler.persist(time.monotonic() + self.options.shutdown_grace_s)
        if self.options.cache_dir:
            save_recall(self.worker.recall, self.options.cache_dir, binding_of(self.model.backend))

    def drain(self, since: float | None = None) -> None:
        """The server stops (a signal at ``since``, monotonic; default now): new requests get 503
        ``ServerStopping``, waiting ones too, and replies in progress go on for
        ``shutdown_grace_s``, then end with their last event (``Worker.drain``)."""
        self.stopping = True
        self.worker.drain((time.monotonic() if since is None else since) + self.options.shutdown_grace_s)

    @property
    def capacity(self) -> int:
        """Requests taken at once (prepared, queued and running) before a 503."""
        return self.model.scheduler.max_running + self.options.queue

    def lease(self, what: str = "this request") -> Lease:
        """A lease on the host allowance and no place yet: what a request's body is read under
        (``admit`` gives it a place once the body is in)."""
        if self.stopping:
            raise ServerStopping("the server is stopping; retry on another instance, or once it is back")
        return self.host.lease(what)

    def admit(self, lease: Lease | None = None, what: str = "this request") -> Lease:
        """The one capacity check: a request's place (refused with 503 + Retry-After when
        ``capacity`` requests are in, from their body's last byte to their last event), given
        to ``lease`` (or a new lease on the host allowance); releasing the lease gives the place
        back. A request takes its place only once its body is in: a client that sends its body
        slowly (or never) holds no place meanwhile."""
        with self._places:
            if self.stopping:
                raise ServerStopping("the server is stopping; retry on another instance, or once it is back")
            if self.admitted >= self.capacity:
                self.worker.counters.rejected += 1
                w = self.worker
                raise ServerBusy(
                    f"the server is busy: {w.running} request(s) running and {self.admitted - w.running} "
                    f"waiting (the queue holds {self.options.queue}); retry shortly"
                )
            self.admitted += 1
        lease = lease or self.host.lease(what)
        lease.on_release(self._leave)
        return lease

    def _leave(self) -> None:
        with self._places:
            self.admitted -= 1

    def prepare(self, req: ChatRequest, lease: Lease, fetched: dict[str, bytes], reply: ReplySpec) -> Turn:
        """The request's turn, built by the model's one intake (blocking: called in a thread):
        its pictures and clips made ready, holding ``lease`` for what they take. ``fetched``:
        the bytes of its image URLs, held on ``lease`` since they arrived
        (``intake.fetch.fetch_bytes``) and given back once the intake is done with them. With
        ``evict`` older pictures may give way to summaries, so only the last message's must fit
        the image room (``intake.turn.make_turn``)."""
        try:
            room = self.model.scheduler.budget.image_room(req.max_tokens or self.options.max_tokens)
            asked = [
                Asked(
                    m.role,
                    m.text,
                    tuple(
                        MediaRef(fetched.get(r.url, r.url), r.kind, r.detail, r.name, r.url in fetched)
                        for r in m.images
                    ),
                    tuple({"id": c.id, "name": c.name, "arguments": c.args} for c in m.tool_calls),
                    m.tool_call_id,
                    m.name,
                    place=m.index,
                )
                for m in req.messages
            ]
            return self.intake.turn(
                asked,
                reply,
                room,
                system=req.system,
                tools=[t.to_template() for t in req.offered_tools],
                tool_required=self.rules.forced_call(req),
                think=self.rules.think_switch(req),
                evict=req.evict,
                lease=lease,
            )
        finally:
            lease.shrink(sum(map(len, fetched.values())))

    def budget(self, body: Any, lease: Lease) -> dict[str, Any]:
        """``POST /v1/edgevlm/budget``'s answer (blocking): what a picture, clip or recording in
        ``body`` will cost (``{"input_audio": {"data", "format"}}``: a recording as a chat part
        carries it), from the one intake, holding ``lease`` for what it decodes."""
        url: Any
        if isinstance(body, dict) and "input_audio" in body:  # (as a chat part: base64 and its format)
            ref, kind = None, "audio"
            url = audio_uri(body["input_audio"], "input_audio")
        else:
            kind = "video" if isinstance(body, dict) and "video_url" in body else "image"
            ref = body.get(f"{kind}_url") if isinstance(body, dict) else None
            url = ref.get("url") if isinstance(ref, dict) else ref
        if not isinstance(url, str) or not url:
            raise APIError(
                f'give {{"{kind}_url": {{"url": ...}}}} or {{"input_audio": {{"data", "format"}}}}', f"{kind}_url"
            )
        detail = body.get("detail") or (ref.get("detail") if isinstance(ref, dict) else None) or "auto"
        name = body.get("name") if isinstance(body.get("name"), str) else ""
        if len(name) > NAME_MAX:
            raise APIError(f"'name' is a label of at most {NAME_MAX} characters, not {len(name):,}", "name")
        max_tokens = body.get("max_tokens")  # (the reply the request will ask for: its room)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            max_tokens = self.options.max_tokens
        room = self.model.scheduler.budget.image_room(max_tokens)
        made = self.intake.views(MediaRef(url, kind, detail, name), room, lease)
        return {**made.to_dict(), "key": made.key, "n_ctx": self.model.n_ctx, "image_room": room}

    def measure_text(self, req: ChatRequest) -> None:
        """The context check by size (``ContextBudget.check_text``), on the caller's thread before
        the worker tokenizes anything: the system prompt and the messages' text — with ``evict``
        only the last message's, older turns may be dropped to make room — against the context
        less the reply's reserve. A prompt that can never fit is a 400 at once, however long."""
        budget = self.model.scheduler.budget
        length, reserve = self.rules.reply_length(req)
        kept = req.messages[-1:] if req.evict else req.messages
        budget.check_text(
            budget.text_bytes(req.system, *(m.text for m in kept)),
            budget.reply_reserve(length) if reserve is None else reserve,
        )

    # --- requests ----------------------------------------------------------------------------
    async def submit(
        self,
        req: ChatRequest,
        gone: Gone | None = None,
        lease: Lease | None = None,
        count_only: bool = False,
        seen: Callable[[Turn], None] | None = None,
    ) -> Job:
        """Prepare the request and queue it; returns once the worker runs it (an error it
        refuses with — 400 too long, 503 busy — is raised). The job holds ``lease`` (or a new
        one) from here on; whoever ends the job releases it (``finish``). ``count_only``: the
        prompt is rendered and counted (``job.prompt_cells``), never run. ``seen``: told the
        turn as the intake made it, before the worker has it (a transcription reads its
        recording's pieces there)."""
        loop = asyncio.get_running_loop()
        lease = lease or self.admit()  # (the server's routes admitted it at the door)
        deadline = time.monotonic() + self.options.timeout_s  # (its preparation included)
        prep = Preparation(lease, deadline, self.options.timeout_s)
        try:
            self.measure_text(req)  # (too long by its size alone: refused before anything tokenizes it)
            grammar = await prep.run(None, self.rules.grammar, req)
            if grammar is not None:
                await prep.run(None, self.model.backend.check_grammar, grammar)
            urls = {r.url: f"messages[{m.index}]" for m in req.messages for r in m.images if Fetcher.remote(r.url)}
            calls = self.fetcher.calls(urls, deadline, lease)
            # on the fetch threads, a few of this request's at a time: its slow URLs leave the rest to others
            at_once = self.options.url_fetches_per_request
            fetched = dict(zip(urls, await prep.run_all(self.fetcher.pool, calls, at_once), strict=True))
            length, reserve = self.rules.reply_length(req)
            reply = ReplySpec(
                length,
                replace(req.sampling, grammar=grammar),
                req.stop + tuple(self.model.scheduler.default_stops),
                self.rules.think_cap(req),
                self.rules.preserved,
                reserve,
            )
            # (the turn goes straight into its job: nothing here keeps its pictures while it waits)
            job = Job(await prep.run(None, self.prepare, req, lease, fetched, reply), deadline, loop, lease, count_only)
            if seen is not None:
                seen(job.turn)
            self.worker.submit(job)
        except BaseException:
            prep.give_up()  # (the lease given back once no step of it runs)
            raise
        try:
            kind, value = await next_event(job, self.worker, gone)
        except BaseException:
            self.finish(job)
            raise
        if kind == "error":
            self.finish(job)
            raise value
        return job

    def finish(self, job: Job) -> None:
        """The caller is done with ``job``: cancel it if it still runs, give back its memory."""
        self.worker.cancel(job)
        if job.lease is not None:
            job.lease.release()

    # --- replies -------------------------------------------------------------------------------
    async def deltas(self, job: Job, req: ChatRequest, gone: Gone | None = None) -> AsyncIterator[Delta | Reply]:
        """The reply as it comes: ``Delta``s (answer text, reasoning, tool calls; the tokens that
        arrived meanwhile joined), then the ``Reply``. An error raises (``EdgeVLMError``); the
        job is finished (its memory given back) however the iteration ends."""
        split = self.rules.splitter(req)
        raw: list[str] = []
        held: Event | None = None  # an event taken while joining text, not handled yet
        try:
            while True:
                if held is not None:
                    (kind, value), held = held, None
                else:
                    kind, value = await next_event(job, self.worker, gone)
                if kind == "text":
                    pieces = [value.text]
                    while not job.events.empty():  # the tokens that came meanwhile, in one piece
                        more = job.events.get_nowait()
                        if more[0] != "text":
                            held = more
                            break
                        pieces.append(more[1].text)
                    text = "".join(pieces)
                    raw.append(text)
                    for d in _joined(split.feed(text)):
                        yield d
                elif kind == "error":
                    raise value
                elif kind == "done":
                    # (cut: max_tokens, the deadline, a stop; "context": the context ran out first)
                    finish = "length" if job.cut else value.finish_reason or "stop"
                    for d in split.finish(cut=finish in ("length", "context")):  # (a call cut off is no text)
                        yield d
                    yield self._reply(job, req, split, value, "".join(raw), finish)
                    return
        finally:
            self.finish(job)

    def _reply(self, job: Job, req: ChatRequest, split: ReplySplitter, seq: Sequence, raw: str, finish: str) -> Reply:
        if split.calls and finish == "stop":
            finish = "tool_calls"
        assert seq.stats is not None  # (a finished request has its stats)
        return Reply(
            job.id,
            job.created,
            self.model_name(req),
            split.text,
            finish,
            seq.stats,
            split.thought,
            tuple(split.calls),
            job.extension(),
            raw,
        )

    async def whole(self, job: Job, req: ChatRequest, gone: Gone | None = None) -> Reply:
        """Wait for the whole reply."""
        async for d in self.deltas(job, req, gone):
            if isinstance(d, Reply):
                return d
        raise AssertionError("a reply stream ends with its Reply")  # pragma: no cover

    async def complete(self, req: ChatRequest) -> Reply:
        """A non-streaming request from start to answer."""
        return await self.whole(await self.submit(req), req)

    def model_name(self, req: ChatRequest) -> str:
        """The model a reply names: the request's, as the APIs echo it, unless it names none or
        is longer than ``MODEL_NAME_MAX`` (then the server's own: a 10 MB name is not repeated in
        every chunk of a stream)."""
        return model_name(req.model, self.options.model_id)


MODEL_NAME_MAX = 256  # characters of a request's model name a reply repeats


def model_name(asked: str | None, own: str) -> str:
    """``asked`` when it is a name a reply may repeat (``ChatService.model_name``), else ``own``."""
    return asked if asked and len(asked) <= MODEL_NAME_MAX else own


def _joined(deltas: list[Delta]) -> list[Delta]:
    """Consecutive text (or reasoning) deltas as one."""
    out: list[Delta] = []
    for d in deltas:
        if out and d.kind == out[-1].kind and d.kind != "tool_call":
            out[-1] = Delta(d.kind, out[-1].text + d.text)
        else:
            out.append(d)
    return out


if sys.version_info >= (3, 11):

    async def _get(queue: asyncio.Queue[Event], timeout: float) -> Event:
        async with asyncio.timeout(timeout):  # (no Task per wait, as wait_for makes)
            return await queue.get()
else:  # pragma: no cover - Python 3.10

    async def _get(queue: asyncio.Queue[Event], timeout: float) -> Event:
        return await asyncio.wait_for(queue.get(), timeout)


async def next_event(job: Job, worker: Worker, gone: Gone | None = None) -> Event:
    """The job's next event; a client that goes away meanwhile cancels it. Never waits past
    the job's deadline and a grace (the worker ends every job by then), nor on a worker that
    is gone."""
    while True:
        if not job.events.empty():  # (the common case under load: no timer per event)
            return job.events.get_nowait()
        try:
            return await _get(job.events, 0.25)
        except asyncio.TimeoutError:
            if gone is not None and await gone():
                worker.cancel(job)  # (the worker counts it cancelled)
                raise ClientGone("the client went away before its reply") from None
            if not worker.alive:
                worker.cancel(job)
                raise WorkerStopped("the server's model worker stopped") from None
            if time.monotonic() > job.deadline + EVENT_GRACE_S:
                worker.cancel(job)
                raise RequestTimedOut("the request got no answer in time") from None
