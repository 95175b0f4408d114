"""Waiting in tests on what a server says, never on the clock alone.

``until(condition, what)`` polls a condition until it holds (its value), failing with ``what``
after a deadline; ``until_async`` is the same inside an event loop. ``wait_status(status, what)``
polls an edgevlm server's ``/status`` (any callable returning it as a dict) until ``what(st)``
holds; ``wait_idle`` and ``wait_busy`` are its two common questions: no sequence running and
nothing waiting, or exactly ``n`` sequences running at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["POLL_S", "until", "until_async", "wait_busy", "wait_idle", "wait_status"]

POLL_S = 0.02  # between two looks: well under any step of a reply, light on a loaded machine

T = TypeVar("T")
Status = Callable[[], dict[str, Any]]


def until(condition: Callable[[], T], what: str, timeout: float = 30.0, each: Callable[[], object] | None = None) -> T:
    """Poll ``condition`` until it is truthy and return its value; fail after ``timeout`` seconds
    with "still not {what}". ``each()`` runs on every round (e.g. a trickle of bytes)."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"still not {what} after {timeout:g} s")
        if each is not None:
            each()
        time.sleep(POLL_S)  # WAIT: a poll of a condition, inside the deadline
    return value


async def until_async(condition: Callable[[], T], what: str, timeout: float = 30.0) -> T:
    """``until`` inside an event loop: the loop runs between two looks."""
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        if time.monotonic() >= deadline:
            raise AssertionError(f"still not {what} after {timeout:g} s")
        await asyncio.sleep(POLL_S)  # WAIT: a poll of a condition, inside the deadline
    return value


def wait_status(status: Status, what: Callable[[dict[str, Any]], bool], name: str, timeout: float = 30.0) -> dict:
    """Poll ``status()`` until ``what(st)`` holds; the status that held. The failure names the
    last status seen."""
    seen: list[dict[str, Any]] = [{}]

    def look() -> bool:
        seen[0] = status()
        return what(seen[0])

    try:
        until(look, name, timeout)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; last /status: {seen[0]}") from None
    return seen[0]


def wait_idle(status: Status, timeout: float = 30.0) -> dict:
    """Until the server runs no sequence and nothing waits (every place given back)."""
    return wait_status(status, lambda st: st["slots"]["busy"] == 0 and st["queue"]["waiting"] == 0, "idle", timeout)


def wait_busy(status: Status, n: int, timeout: float = 30.0) -> dict:
    """Until exactly ``n`` sequences run at once."""
    return wait_status(status, lambda st: st["slots"]["busy"] == n, f"{n} running", timeout)
