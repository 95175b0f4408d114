"""A hostile client beside two innocent ones: the harness of the server's abuse tests (#59).

``Innocents(url)`` runs well-behaved clients in threads while a test misbehaves against the same
server: each sends a small chat request with a picture (temperature 0, a few tokens) in a loop
and records what came back. A test asks ``served(k)`` — every innocent got ``k`` more answers
since that moment — while its hostile requests are still in flight, so "nothing stalls" is a
count of answers under a deadline, never a latency threshold that moves with the machine's load.
Leaving the ``with`` block stops them and fails the test when any innocent got anything but
200 (a 503, a reset connection, a server gone)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import httpx
import psutil

from edgevlm_testkit.waiting import until

from .test_serve import data_uri, png, user

__all__ = ["Innocents", "peak_rss_mib", "rss_mib"]

INNOCENT_PICTURE = data_uri(png(96, 72, seed=7))


@dataclass
class Innocent:
    """One well-behaved client's record."""

    answers: int = 0
    failures: list[str] = field(default_factory=list)


class Innocents:
    """``n`` innocent clients looping a small chat request against ``url`` (module doc)."""

    def __init__(self, url: str, n: int = 2, key: str | None = None, timeout_s: float = 300):
        self.url = url
        self.clients = [Innocent() for _ in range(n)]
        self.headers = {"authorization": f"Bearer {key}"} if key else {}
        self.timeout_s = timeout_s
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._loop, args=(c, i), daemon=True) for i, c in enumerate(self.clients)
        ]

    def body(self, i: int) -> dict:
        return {
            "model": "m",
            "messages": [user(f"innocent {i}: what is in the picture?", INNOCENT_PICTURE)],
            "max_tokens": 4,
            "temperature": 0,
        }

    def _loop(self, me: Innocent, i: int) -> None:
        with httpx.Client(timeout=self.timeout_s, headers=self.headers) as http:
            while not self._stop.is_set():
                try:
                    r = http.post(self.url + "/v1/chat/completions", json=self.body(i))
                except httpx.HTTPError as exc:
                    me.failures.append(f"{type(exc).__name__}: {exc}")
                    return
                if r.status_code != 200:
                    me.failures.append(f"{r.status_code}: {r.text[:300]}")
                    return
                me.answers += 1

    def __enter__(self) -> Innocents:
        for t in self._threads:
            t.start()
        self.served(1, "answering before the test begins", 120)
        return self

    def served(self, k: int = 2, what: str = "answered beside the hostile client", timeout: float = 180) -> None:
        """Until every innocent got ``k`` more answers than it had when this was called."""
        start = [c.answers for c in self.clients]

        def done() -> bool:
            bad = [f for c in self.clients for f in c.failures]
            assert not bad, f"an innocent client failed: {bad}"
            return all(c.answers >= s + k for c, s in zip(self.clients, start, strict=True))

        until(done, f"every innocent client {what} ({k} more each; had {start})", timeout)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(self.timeout_s)
        bad = [f for c in self.clients for f in c.failures]
        if exc[0] is None:
            assert not bad, f"an innocent client failed: {bad}"


def rss_mib(pid: int) -> float:
    """A process's resident memory now, in MiB."""
    return psutil.Process(pid).memory_info().rss / 2**20


def peak_rss_mib(pid: int, stop: threading.Event, every_s: float = 0.05) -> list[float]:
    """Sample ``pid``'s RSS until ``stop`` is set, in a thread; the list holds the peak so far
    (``[0]``)."""
    peak = [rss_mib(pid)]

    def sample() -> None:
        while not stop.wait(every_s):
            try:
                peak[0] = max(peak[0], rss_mib(pid))
            except psutil.Error:
                return

    threading.Thread(target=sample, daemon=True).start()
    return peak
