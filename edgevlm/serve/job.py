"""A request on its way through the server's worker (``Job``: its ``Turn``, where its events go,
its lifecycle and ``Progress``), the one way its events reach its event loop (``Outbox``), and
the worker's counters."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from ..plan.host import Lease
from ..runtime.intake import Turn
from ..runtime.items import Prompt
from ..runtime.scheduler import Sequence
from .request import new_id

__all__ = ["Counters", "Event", "Job", "Outbox", "Progress"]

# What the worker tells a job's coroutine, (kind, value): ("accepted", None), ("text", a
# GenerationResponse), ("done", the finished Sequence or None), ("error", the exception)
Event = tuple[str, Any]


class Outbox:
    """The one way events reach the coroutines waiting on jobs: put by the worker, handed to
    their event loop once per worker iteration (one wake-up of the loop per step, not one per
    token and request)."""

    def __init__(self) -> None:
        self._items: list[tuple[Job, Event]] = []

    def put(self, job: Job, event: Event) -> None:
        self._items.append((job, event))

    def flush(self) -> None:
        if not self._items:
            return
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue[Event], Event]]] = {}
        for job, event in self._items:
            by_loop.setdefault(job.loop, []).append((job.events, event))
        self._items = []
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:  # that event loop is gone (its side ended): nobody listens
                pass


def _deliver(items: list[tuple[asyncio.Queue[Event], Event]]) -> None:
    for queue, event in items:
        queue.put_nowait(event)


@dataclass
class Progress:
    """What the worker knows of a job on its way: its prompt (until admitted), its sequence,
    sizes and times, reply text not handed out yet, and what the session did to its history."""

    prompt: Prompt | None = None
    seq: Sequence | None = None
    prompt_cells: int = 0  # its prompt's tokens (kept once the prompt itself is let go)
    new_cells: int = 0  # what its prompt evaluates past the caches (when it was queued)
    queued_at: float = 0.0
    unsent: list[str] = field(default_factory=list)
    sent_at: float = 0.0  # when text was last handed out
    summaries: list[dict[str, Any]] = field(default_factory=list)  # what the session replaced
    dropped: list[int] = field(default_factory=list)  # request messages dropped to make room
    notices: list[str] = field(default_factory=list)  # what the worker tells besides the turn's


@dataclass(eq=False)
class Job:
    """One request on its way through the worker: the ``Turn``, where its events go (``events``
    in its event loop ``loop``, through the worker's ``Outbox``), and its lifecycle."""

    turn: Turn
    deadline: float
    loop: asyncio.AbstractEventLoop
    lease: Lease | None = None  # the host memory and the place it holds (released when it ends)
    count_only: bool = False  # rendered and counted, never run (Anthropic's count_tokens)
    id: str = field(default_factory=new_id)
    created: int = field(default_factory=lambda: int(time.time()))
    events: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    cut: str = ""  # why the server cut it short: "timeout" (its --timeout) or "stop" (--shutdown-grace ran out)
    ended: bool = False  # its final event ("done" or "error") was put
    progress: Progress = field(default_factory=Progress)

    @property
    def prompt_cells(self) -> int:
        return self.progress.prompt_cells

    def end(self) -> None:
        """Its final event is on its way: what it held is dropped (also if nobody reads it)."""
        self.ended = True
        self.turn = self.turn.without_views()  # its pictures are not needed any more
        self.progress.prompt = None
        if self.lease is not None:
            self.lease.release()

    def extension(self) -> dict[str, Any]:
        """The reply's ``edgevlm`` object: notices, and what the session did to the history."""
        ext: dict[str, Any] = {}
        notices = [*self.turn.notes, *self.turn.notices, *self.progress.notices]
        if notices:
            ext["notices"] = notices
        if self.progress.summaries:
            ext["summaries"] = list(self.progress.summaries)
        if self.progress.dropped:
            ext["dropped_messages"] = self.progress.dropped
        seq = self.progress.seq
        if seq is not None and seq.c["cached_n"]:  # where its cached tokens were (the page shows it)
            ext["cache"] = {"tokens": seq.c["cached_n"], "source": seq.c["cache_source"]}
        return ext


@dataclass
class Counters:
    served: int = 0
    cancelled: int = 0  # clients that went away
    failed: int = 0
    rejected: int = 0
    peak_running: int = 0  # most requests generated together
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
