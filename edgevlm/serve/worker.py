"""The server's one worker thread: it drives the model's scheduler for the server (nothing else
in the server touches llama.cpp), turns prepared requests into prompts, admits them as cells
free up, steps every request in flight in one batch, and hands each request's text to the
coroutine waiting for it.

A request goes: ``submit`` (refused with 503 when the queue is full) → rendered here (refused
with 400 when it can never fit the context, or when the model's chat template refuses its
messages) → waiting, in arrival order, until the scheduler has a sequence and the cells for it
→ running → done. A client that goes away, or a request past its time, is cancelled at the next
step and its sequence freed.

Failure isolation: whatever goes wrong while one request is rendered, admitted or run ends that
request alone — it gets an error event (a 4xx for what it sent, a 500 for anything unexpected,
whose traceback goes to the log once), and every other request goes on. Every job gets exactly
one final event ("done" or "error"), also when the server stops.

Replies are remembered by their text (the exact token ids generated; ``recall``), so a client
that sends its history back gets the same tokens and reuses its KV prefix (``cached_tokens``).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from ..backend.sampling import SamplingParams
from ..errors import ContextExceeded, EdgeVLMError
from ..runtime.conversation import Conversation, Message
from ..runtime.intake import ReplySpec
from ..runtime.model import LoadedModel
from ..runtime.placement import SHORT_PROMPT
from ..runtime.scheduler import WAIT, Client, GenerationResponse, Sequence
from ..runtime.session import Footprint, SessionOptions, Summaries, make_room
from .api_errors import ClientGone, RequestTimedOut, ServerStopping
from .job import Counters, Job, Outbox
from .options import ServeOptions
from .recall import ReplyRecall

__all__ = ["Worker"]

log = logging.getLogger("edgevlm.serve")


class Worker:
    def __init__(self, model: LoadedModel, options: ServeOptions):
        self.model = model
        self.sched = model.scheduler
        if not self.sched.throughput:  # a request that arrives cuts a batch of picture rows short
            self.sched.arrivals = lambda: bool(self._inbox)
        self.options = options
        self.client = Client("server")
        self.counters = Counters()
        self._inbox: deque[Job] = deque()  # submitted, not rendered yet
        self._waiting: deque[Job] = deque()  # rendered, waiting for a sequence and cells
        self._running: dict[int, Job] = {}
        self.recall = ReplyRecall()  # replies by text, for clients that resend their history
        self._session = SessionOptions()
        self._summaries = Summaries()  # by picture content: one summary per picture
        self._cond = threading.Condition()
        self._stop = False
        self._drain_at: float | None = None  # the server stops: replies in progress are cut then
        self._outbox = Outbox()
        self._thread = threading.Thread(target=self._run, name="edgevlm-serve", daemon=True)

    # --- what the HTTP side calls ----------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify()
        self._thread.join(timeout=30)

    def drain(self, until: float) -> None:
        """The server is stopping: no new jobs; the ones not started end at once (503
        ``ServerStopping``); replies in progress go on until ``until`` (monotonic), then end as
        cut short (finish "length", a notice) — each with its last event."""
        with self._cond:
            self._drain_at = until
            self._cond.notify()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def queued(self) -> int:
        return len(self._inbox) + len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running)

    def submit(self, job: Job) -> None:
        """Queue ``job`` (its place was taken at the door: ``ChatService.admit``)."""
        with self._cond:
            if self._stop or self._drain_at is not None or not self.alive:
                raise ServerStopping("the server is stopping")
            self._inbox.append(job)
            self._cond.notify()

    def _emit(self, job: Job, kind: str, value: Any = None) -> None:
        """An event for ``job``'s coroutine (through the outbox); after its final one, none."""
        if job.ended:
            return
        if kind in ("done", "error"):
            job.end()
        self._outbox.put(job, (kind, value))

    def cancel(self, job: Job) -> None:
        job.cancelled = True
        with self._cond:
            self._cond.notify()

    def count_cancelled(self) -> None:
        """One more request ended because its client went away (from either thread: the HTTP
        side counts those that leave before their job gets here)."""
        with self._cond:
            self.counters.cancelled += 1

    # --- the thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while True:
                self._outbox.flush()
                with self._cond:
                    while not (self._stop or self._inbox or self._waiting or self._running):
                        self._cond.wait()
                    if self._stop:
                        break
                    new = list(self._inbox)
                    self._inbox.clear()
                if self._drain_at is not None:  # stopping: what has not started ends now
                    self._turn_away(new)
                    new = []
                try:
                    for job in new:
                        self._guarded(job, self._prepare)
                    self._admit()
                    if self._running:
                        self._step()
                        self._forward_all()
                    elif self._waiting:
                        with self._cond:  # nothing runs and the first cannot start: wait for news
                            self._cond.wait(0.05)
                except Exception as exc:  # a fault outside any one request: what runs ends, the worker goes on
                    log.error("the server's worker loop failed", exc_info=exc)
                    for job in list(self._running.values()):
                        self._drop(job)
                        self._fail(job, exc)
        finally:
            self._shutdown()

    def _guarded(self, job: Job, what: Callable[[Job], object]) -> bool:
        """Run ``what(job)``; anything it raises ends that job alone. False if it failed."""
        try:
            what(job)
            return True
        except Exception as exc:
            self._drop(job)
            self._fail(job, exc)
            return False

    def _drop(self, job: Job) -> None:
        """Take a job out of every queue, its sequence cancelled and its prompt let go."""
        self._running.pop(id(job), None)
        if job in self._waiting:
            self._waiting.remove(job)
        if job.progress.seq is not None and not job.progress.seq.done:
            self.sched.cancel(job.progress.seq)
        if job.progress.prompt is not None:
            job.progress.prompt.release()

    def _fail(self, job: Job, exc: BaseException) -> None:
        self.counters.failed += 1
        if not isinstance(exc, EdgeVLMError):  # a fault, not the request: its traceback once
            log.error("request %s failed", job.id, exc_info=exc)
            with contextlib.suppress(AttributeError):
                # a mark on any exception (read back with getattr): the HTTP side does not log it again
                setattr(exc, "edgevlm_logged", True)  # noqa: B010
        self._emit(job, "error", exc)

    def _step(self) -> None:
        """One scheduler step. The scheduler ends a failing sequence by itself; should the step
        raise anyway (a fault in the scheduler), the requests in flight end with that error —
        their sequences cancelled, so their slots are free — and the worker goes on."""
        try:
            self.sched.step()
        except Exception as exc:
            log.error("a scheduler step failed", exc_info=exc)
            for job in list(self._running.values()):
                self._drop(job)
                self._emit(job, "error", exc)
                self.counters.failed += 1

    def _shutdown(self) -> None:
        """The thread ends (the server stops): every job still here gets its final event."""
        gone = ServerStopping("the server is stopping")
        with self._cond:
            jobs = list(self._inbox) + list(self._waiting) + list(self._running.values())
            self._inbox.clear()
        for job in jobs:
            self._drop(job)
            self._emit(job, "error", gone)
        self._outbox.flush()
        self.sched.cancel_client(self.client)

    def _turn_away(self, jobs: list[Job]) -> None:
        """The server is stopping: ``jobs`` and the waiting ones (none started) end with 503."""
        for job in [*jobs, *self._waiting]:
            self._drop(job)
            self._emit(job, "error", ServerStopping("the server is stopping; the request had not started"))

    def _prepare(self, job: Job) -> None:
        """Render the request (exact reply tokens where known) and check it can ever fit; with
        ``evict``, the session policy makes room first (old pictures → summaries)."""
        if job.cancelled:
            self.count_cancelled()
            self._emit(job, "error", ClientGone("the client went away"))
            return
        turn, pro = job.turn, job.progress
        conv = turn.conversation()  # (the worker's own copy: token ids go in, the session rewrites it)
        for m in conv.messages:
            if m.role == "assistant" and m.tokens is None and not m.tool_calls:
                m.tokens = self.recall.tokens(m.text.strip())
        budget = self.sched.budget
        reserve = budget.reply_reserve(turn.reply.max_tokens) if turn.reply.reserve is None else turn.reply.reserve
        if turn.evict:
            self._make_room(job, conv, reserve, budget.image_room(reserve))  # (a reserve is a reply of that many)
        # (a text too long stops at its tokens, before they become items; counted ones are not stopped)
        limit = None if job.count_only else budget.n_ctx - reserve
        pro.prompt = prompt = turn.render(self.model.render, conv.messages, limit=limit)
        del conv
        job.turn = turn.without_views()  # the prompt holds what it needs: the views' pixels can go
        pro.prompt_cells = prompt.cells
        if job.count_only:  # counted: nothing more to do
            prompt.release()
            self._emit(job, "accepted")
            self._emit(job, "done", None)
            return
        budget.check(prompt.cells, reserve)  # (the one context check: ContextExceeded, a 400)
        pro.new_cells, pro.queued_at = self.sched.new_cells(prompt), time.monotonic()
        self._waiting.append(job)

    def _make_room(self, job: Job, conv: Conversation, reserve: int, image_room: int) -> None:
        """The session policy over the request's history (``conv``, the worker's copy of the
        turn's); what it replaced or dropped goes into the reply, so the client can send the
        shorter history next time (and reuse its cache)."""
        place = {id(m): job.turn.places[i] for i, m in enumerate(conv.messages)}
        holder = {n: m for m in conv.messages for n in m.pictures}

        def measure(messages: list[Message]) -> Footprint:
            p = job.turn.render(self.model.render, messages)
            return Footprint(p.cells, p.image_cells, p)

        rep = make_room(
            conv,
            n_ctx=self.sched.n_ctx,
            reserve=reserve,
            image_room=image_room,
            measure=measure,
            ask=lambda q, msgs: self._ask(job, q, msgs),
            options=self._session,
            memory=self._summaries,
            notices=job.progress.notices,
        )
        kept = {id(m) for m in conv.messages}
        job.progress.dropped = sorted(idx for key, idx in place.items() if key not in kept)
        for pic in rep.summarized:
            m = holder[pic.number]
            if id(m) in kept:
                job.progress.summaries.append(
                    {"message": place[id(m)], "picture": pic.number, "summary": pic.summary, "content": m.content_text}
                )

    def _ask(self, job: Job, question: str, messages: list[Message]) -> str:
        """A greedy question to the model now (for a summary), in between the steps of the
        requests in flight (until the request's own deadline)."""
        opts = self._session
        prompt = self.model.render(messages + [Message("user", question)], job.turn.system)  # (no tools: a summary)
        req = ReplySpec(opts.summary_tokens, SamplingParams(0.0), tuple(self.sched.default_stops)).request(prompt)
        while (seq := self.sched.submit(req, self.client)) == WAIT:
            if not self._running or time.monotonic() > job.deadline:
                prompt.release()
                raise ContextExceeded("no room to summarise an old picture (the context is busy with other requests)")
            self._step()
            self._forward_all()
        assert isinstance(seq, Sequence)  # submit gives a Sequence or WAIT
        return "".join(r.text for r in self.sched.stream(seq))

    def _in_order(self, now: float) -> list[Job]:
        """Who starts first: requests that have waited ``fair_wait_s`` (oldest first), then the
        others by the least prompt to evaluate — a follow-up turn whose history is cached goes
        before a new picture, and no request waits behind shorter ones for long."""
        if not self.options.follow_ups_first:
            return list(self._waiting)
        fair = self.options.fair_wait_s
        return sorted(
            self._waiting,
            key=lambda j: (
                (0, j.progress.queued_at, 0)
                if now - j.progress.queued_at >= fair
                else (1, j.progress.new_cells, j.progress.queued_at)
            ),
        )

    def _admit(self) -> None:
        """Start waiting requests while the scheduler takes them (``_in_order``); once one must
        wait, only short ones (the scheduler's short lane: a follow-up's few rows) are tried —
        unless follow-ups do not go first: then nothing more, and never past --parallel."""
        now = time.monotonic()
        blocked = False
        follow_ups = self.options.follow_ups_first
        for job in self._in_order(now):
            if blocked and job.progress.new_cells > SHORT_PROMPT:
                continue
            if job.cancelled:
                self._waiting.remove(job)
                self._drop(job)
                self.count_cancelled()
                self._emit(job, "error", ClientGone("the client went away"))
                continue
            if now > job.deadline:
                self._waiting.remove(job)
                self._drop(job)
                self._fail(
                    job,
                    RequestTimedOut(f"the request waited {self.options.timeout_s:g} s without a free sequence"),
                )
                continue
            if not follow_ups and not self.sched.has_free_slot():
                return
            try:
                assert job.progress.prompt is not None  # rendered before it waits; dropped only once it ends
                prompt = job.progress.prompt
                seq = self.sched.submit(job.turn.reply.request(prompt, new_images=frozenset(prompt.units)), self.client)
            except Exception as exc:
                self._waiting.remove(job)
                self._drop(job)
                self._fail(job, exc)
                continue
            if seq == WAIT:
                if not follow_ups:
                    return
                blocked = True
                continue
            assert isinstance(seq, Sequence)  # submit gives a Sequence or WAIT
            self._waiting.remove(job)
            job.progress.seq = seq
            # accepted once it runs: a request that ends while it waits (its --timeout, a stop) is
            # then still its API's status code (503), not an error inside a stream already begun
            self._emit(job, "accepted")
            self._running[id(job)] = job
            self.counters.peak_running = max(self.counters.peak_running, len(self._running))

    def _forward_all(self) -> None:
        now = time.monotonic()
        self.client.take_finished()  # (each job reads its own sequence below)
        for job in list(self._running.values()):
            self._guarded(job, lambda j: self._forward(j, now))
        self._outbox.flush()

    def _forward(self, job: Job, now: float) -> None:
        pro = job.progress
        seq = pro.seq
        assert seq is not None  # a running job has its sequence
        stop = self._drain_at is not None and now >= self._drain_at
        if not seq.done and (job.cancelled or stop or now > job.deadline):
            if not job.cancelled:
                job.cut = "stop" if stop else "timeout"
            self.sched.cancel(seq)
        while seq.out:
            r: GenerationResponse = seq.out.popleft()
            if r.text:
                pro.unsent.append(r.text)
        # text goes out at most every stream_interval_s (the first piece at once): under load a
        # chunk carries the tokens of a few steps instead of waking the event loop per token
        if pro.unsent and (seq.done or not pro.sent_at or now - pro.sent_at >= self.options.stream_interval_s):
            self._emit(job, "text", GenerationResponse("".join(pro.unsent)))
            pro.unsent.clear()
            pro.sent_at = now
        if seq.done:
            del self._running[id(job)]
            self._finish(job)

    def _finish(self, job: Job) -> None:
        seq = job.progress.seq
        assert seq is not None  # a running job has its sequence
        if seq.error is not None:
            self._fail(job, seq.error)
            return
        st = seq.stats
        assert st is not None  # done: the scheduler's _finish made them
        self.recall.remember(seq.reply.strip(), seq.tokens)  # (the APIs trim a reply's ends)
        c = self.counters
        if job.cancelled:
            self.count_cancelled()
        else:
            c.served += 1
        c.prompt_tokens += st.prompt_n + st.cached_n
        c.cached_tokens += st.cached_n
        c.generated_tokens += st.predicted_n
        if job.cut == "stop":
            job.progress.notices.append(
                f"stopped: the server is shutting down (its --shutdown-grace of {self.options.shutdown_grace_s:g} s)"
            )
        elif job.cut == "timeout":
            job.progress.notices.append(f"stopped after {self.options.timeout_s:g} s (the server's --timeout)")
        elif seq.finish_reason == "context":  # short of max_tokens: said, in every API's shape
            job.progress.notices.append(self.sched.budget.cut_notice(len(seq.tokens), job.turn.reply.max_tokens))
        self._emit(job, "done", seq)
