"""The host allowance's leases under threads (#59, case 11): a lease is given back once, however
many threads release it at once; a released lease takes nothing more; requests that hold memory
and all wait for more do not wait on each other until their deadlines (the youngest gives way);
the small lane keeps room for small takes. Real threads on a real ``HostAllowance``."""

from __future__ import annotations

import platform
import sys
import threading
import time

import pytest

from edgevlm.errors import InputError, MemoryBusy
from edgevlm.plan.host import STUCK_S, TRIM_AFTER, HostAllowance, LeaseReleased, trim_freed_memory
from edgevlm_testkit.waiting import until

MIB = 2**20


@pytest.fixture
def switchy():
    """Thread switches as often as the interpreter allows: races show within a few thousand tries."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(before)


def test_a_lease_released_by_two_threads_at_once_gives_back_once_over_thousands_of_leases(switchy):
    """Two threads release each of 5,000 leases at the same moment (a barrier), as the worker and
    the event loop both end a request: every lease's bytes come back exactly once (the
    allowance ends at 0, never below) and its ``on_release`` (a server's place) runs exactly once.
    Before, ``release`` read and cleared ``held`` and its callback without a lock: both threads
    gave the bytes back, and both gave the place back."""
    allowance = HostAllowance(64 * MIB)
    calls = [0] * 5000
    lowest = [0]
    for i in range(5000):
        lease = allowance.lease("r", lambda i=i: calls.__setitem__(i, calls[i] + 1))
        lease.grow(1000 + i)
        barrier = threading.Barrier(2)

        def end(lease=lease, barrier=barrier) -> None:
            barrier.wait()
            lease.release()
            lowest[0] = min(lowest[0], allowance.in_use)

        threads = [threading.Thread(target=end) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert allowance.in_use == 0
    assert lowest[0] == 0, lowest[0]
    assert set(calls) == {1}, sorted(set(calls))


def test_growing_and_releasing_from_many_threads_keeps_the_count_exact(switchy):
    """Eight threads grow, shrink and resize one lease while a ninth releases it midway: the
    allowance's count is what the lease says it holds at every end, and nothing is taken after
    the release (``grow`` raises ``LeaseReleased``, ``try_grow`` says False)."""
    allowance = HostAllowance(1024 * MIB)
    for _ in range(200):
        lease = allowance.lease("r")
        go = threading.Barrier(9)

        def churn(lease=lease, go=go) -> None:
            go.wait()
            for k in range(50):
                try:
                    lease.grow(100 + k)
                except LeaseReleased:
                    return
                lease.shrink(50)
                lease.try_grow(7)

        threads = [threading.Thread(target=churn) for _ in range(8)]
        for t in threads:
            t.start()
        go.wait()
        lease.release()
        for t in threads:
            t.join()
        assert lease.held == 0
        assert allowance.in_use == 0
    with pytest.raises(LeaseReleased):
        lease.grow(1)
    assert lease.try_grow(1) is False
    assert allowance.in_use == 0


def test_requests_that_hold_memory_and_all_wait_for_more_do_not_wait_until_their_deadlines():
    """Three requests each hold 30 MiB of a 120 MiB allowance (105 MiB of it for large takes) and
    each wants 20 MiB more: none can ever get it from the others, who wait too. Instead of all
    three waiting out their 600 s, the youngest gives way (``MemoryBusy``, a 503) once nothing
    has moved for ``STUCK_S``; with what it gives back the next gets its bytes, and so on: the
    oldest always finishes."""
    allowance = HostAllowance(120 * MIB)
    leases = [allowance.lease(f"request {i}") for i in range(3)]
    for lease in leases:
        lease.grow(30 * MIB)
    outcome: dict[int, str] = {}

    def want(i: int) -> None:
        try:
            leases[i].grow(20 * MIB, time.monotonic() + 600)
            outcome[i] = "got it"
        except MemoryBusy as exc:
            outcome[i] = str(exc)
        leases[i].release()

    started = time.monotonic()
    threads = [threading.Thread(target=want, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert outcome[0] == "got it"
    assert "the youngest gives way" in outcome[2], outcome
    assert allowance.gave_way >= 1
    assert allowance.in_use == 0
    assert time.monotonic() - started < 60  # (never the 600 s deadline)
    assert STUCK_S < 5


def test_a_request_that_holds_nothing_waits_while_those_under_way_wait():
    """While a request that holds memory waits for more, a new request (holding nothing) does not
    take what is given back: it goes to the one under way first."""
    allowance = HostAllowance(120 * MIB)  # (105 MiB of it for large takes)
    under_way, other = allowance.lease("under way"), allowance.lease("other")
    under_way.grow(40 * MIB)
    other.grow(50 * MIB)
    got = threading.Event()

    def more() -> None:
        under_way.grow(30 * MIB, time.monotonic() + 60)
        got.set()

    t = threading.Thread(target=more)
    t.start()
    until(lambda: allowance.waiting == 1, "the request under way waiting")
    newcomer = allowance.lease("new")
    other.release()  # 50 MiB back: 30 of them are the waiting request's
    assert not newcomer.try_grow(60 * MIB)  # (it would fit before the one under way took its 30)
    t.join(60)
    assert got.is_set()
    assert under_way.held == 70 * MIB


def test_the_small_lane_keeps_room_for_small_takes_and_what_never_fits_is_refused_at_once():
    """Large takes fill the allowance only up to its small lane; a small take still gets in. A take
    that, with what its lease holds, is more than the whole allowance is an ``InputError`` at once
    (waiting would only wait for itself)."""
    allowance = HostAllowance(80 * MIB)
    big = allowance.lease("big")
    big.grow(allowance.total - allowance.small_lane)
    assert not allowance.lease("large").try_grow(allowance.small_take + 1)
    small = allowance.lease("small")
    assert small.try_grow(allowance.small_take)
    t0 = time.monotonic()
    with pytest.raises(InputError, match="more than the whole allowance"):
        big.grow(allowance.small_lane + 1, time.monotonic() + 60)
    assert time.monotonic() - t0 < 5


def test_the_allowance_trims_when_it_empties_after_32_mib_came_back_and_not_before():
    """``trim`` (the server's ``malloc_trim``) runs when the allowance empties and at least
    ``TRIM_AFTER`` bytes came back since the last one: not while a lease still holds bytes,
    not for small requests coming and going, once per emptying."""
    calls: list[int] = []
    allowance = HostAllowance(256 * MIB, trim=lambda: calls.append(allowance.in_use))
    other = allowance.lease("a text request")
    other.grow(MIB)
    with allowance.lease("a picture") as big:
        big.grow(TRIM_AFTER)
    assert calls == []  # (the text request still holds its bytes)
    other.release()
    assert calls == [0]
    assert allowance.trims == 1
    for _ in range(31):  # 31 MiB coming and going: under TRIM_AFTER since the last trim
        with allowance.lease("a small one") as small:
            small.grow(MIB)
    assert calls == [0]
    with allowance.lease("the 32nd") as small:
        small.grow(MIB)
    assert calls == [0, 0]
    assert allowance.to_dict()["trims"] == 2


def test_trim_freed_memory_runs_on_glibc_and_is_harmless_elsewhere():
    """On Linux with glibc it calls ``malloc_trim``; elsewhere it says it did nothing."""
    ran = trim_freed_memory()
    assert ran == (sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc")
