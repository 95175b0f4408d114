"""A request's preparation off the event loop, under the request's own deadline.

Every step (the grammar, its check by llama.cpp, the fetches of image URLs, the intake) runs in
a thread; its wait ends by the request's deadline (``--timeout``, counted from ``submit``), then
the request ends with its timeout error. A thread cannot be stopped, so the lease stays held
until the last step still running ends (a fetch by its own deadline, capped at the request's);
a step that had not started by then does not run."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Executor
from typing import Any, TypeVar

from ..plan.host import Lease
from .api_errors import RequestTimedOut

__all__ = ["Preparation"]

T = TypeVar("T")


class Preparation:
    """The steps of one request's preparation, ending by ``deadline`` (a ``time.monotonic()``
    value; ``timeout_s`` is what the error says), holding ``lease``."""

    def __init__(self, lease: Lease, deadline: float, timeout_s: float):
        self.lease, self.deadline, self.timeout_s = lease, deadline, timeout_s
        self._lock = threading.Lock()
        self._running = 0  # steps handed to a thread and not ended
        self._given_up = False

    async def run(self, executor: Executor | None, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in ``executor`` (None: the loop's default), by the deadline."""
        result: T = (await self.run_all(executor, [(fn, *args)]))[0]  # (fn's own result)
        return result

    async def run_all(
        self, executor: Executor | None, calls: Iterable[tuple[Any, ...]], at_once: int | None = None
    ) -> list[Any]:
        """Each ``(fn, *args)`` of ``calls`` in ``executor`` — at most ``at_once`` of them at a
        time (None: all at once), the next starting as one ends — by the deadline; the first error
        raises (the others' results are dropped, and those not started never start)."""
        loop = asyncio.get_running_loop()
        todo = list(calls)
        if not todo:
            return []
        gate = asyncio.Semaphore(at_once or len(todo))

        async def one(fn: Callable[..., Any], args: list[Any]) -> Any:
            async with gate:
                with self._lock:
                    self._running += 1
                fut = loop.run_in_executor(executor, self._step, fn, args)
                fut.add_done_callback(_seen)
                # (shielded: a request that gives up leaves a started step to end on its own,
                # and that step gives the lease back if it is the last: ``_step``)
                return await asyncio.shield(fut)

        tasks = [asyncio.ensure_future(one(fn, args)) for fn, *args in todo]
        left = self.deadline - time.monotonic()
        done, pending = await asyncio.wait(tasks, timeout=max(0.0, left), return_when=asyncio.FIRST_EXCEPTION)
        for task in pending:
            task.cancel()  # (those waiting for the gate never start)
        errors = [e for e in (task.exception() for task in done) if e is not None]  # (each one retrieved)
        if errors:
            # the error's traceback runs through this frame: it must not keep the other steps'
            # results (a request's fetched pictures) alive until the cyclic GC comes by
            try:
                raise errors[0]
            finally:
                del errors, tasks, done, pending
        if pending:
            raise RequestTimedOut(
                f"the request was not prepared within its {self.timeout_s:g} s (the server's --timeout)"
            )
        return [task.result() for task in tasks]

    def _step(self, fn: Callable[..., Any], args: list[Any]) -> Any:
        try:
            if self._given_up:  # (the request ended before this step began)
                raise RequestTimedOut("the request ended before it was prepared")
            return fn(*args)
        finally:
            with self._lock:
                self._running -= 1
                last = self._given_up and self._running == 0
            if last:
                self.lease.release()

    def give_up(self) -> None:
        """The request ends unprepared: its lease is given back now, or when the last step still
        running in a thread ends."""
        with self._lock:
            self._given_up = True
            now = self._running == 0
        if now:
            self.lease.release()


def _seen(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()  # (retrieved: a step whose request gave up is not logged as lost)
