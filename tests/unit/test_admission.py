"""Admission control (fastroute.dataplane.admission): limit, FIFO queue, rejection, expiry, cancel."""
from __future__ import annotations

from fastroute.dataplane.admission import Admission
from fastroute.control.metrics import Stats


def make(limit: int = 2, queue: int = 2, timeout: float = 5.0) -> Admission:
    a = Admission(limit, queue, timeout, loop=None)  # no loop: waiters start inline
    a.stats = Stats()
    return a


def test_unlimited_never_queues_and_counts_nothing() -> None:
    for limit in (-1, 0):
        a = make(limit=limit)
        for _ in range(10_000):
            assert a.try_enter()
        assert a.active == 10_000 and not a.queue and a.stats.rate_limit == {}


def test_over_limit_waits_fifo_and_a_freed_slot_goes_to_the_oldest() -> None:
    a = make(limit=2, queue=3)
    started: list[str] = []
    assert a.try_enter() and a.try_enter()
    assert not a.try_enter()
    w1 = a.wait(lambda: started.append("a"), lambda: None, 0.0)
    w2 = a.wait(lambda: started.append("b"), lambda: None, 0.0)
    assert w1 is not None and w2 is not None
    assert not a.try_enter()         # nobody overtakes the queue
    a.leave()
    assert started == ["a"] and a.active == 2
    a.leave()
    assert started == ["a", "b"] and a.active == 2 and not a.queue
    a.leave()
    a.leave()
    assert a.active == 0
    assert a.try_enter()
    assert a.stats.rate_limit == {"allowed": 3, "queued": 2, "dequeued": 2}


def test_full_queue_rejects() -> None:
    a = make(limit=1, queue=1)
    assert a.try_enter()
    assert a.wait(lambda: None, lambda: None, 0.0) is not None
    assert a.wait(lambda: None, lambda: None, 0.0) is None
    assert a.stats.rate_limit["rejected"] == 1
    z = make(limit=1, queue=0)
    assert z.try_enter()
    assert z.wait(lambda: None, lambda: None, 0.0) is None


def test_expiry_times_out_only_due_waiters_in_order() -> None:
    a = make(limit=1, queue=5, timeout=5.0)
    assert a.try_enter()
    out: list[str] = []
    a.wait(lambda: None, lambda: out.append("x"), 0.0)
    a.wait(lambda: None, lambda: out.append("y"), 3.0)
    assert a.expire(4.9) == 0
    assert a.expire(5.0) == 1 and out == ["x"]
    assert a.expire(100.0) == 1 and out == ["x", "y"]
    assert not a.queue and a.active == 1
    assert a.stats.rate_limit["timeout"] == 2


def test_cancelled_waiter_never_starts_and_frees_its_queue_place() -> None:
    a = make(limit=1, queue=1)
    started: list[int] = []
    assert a.try_enter()
    w = a.wait(lambda: started.append(1), lambda: None, 0.0)
    assert a.cancel(w) and not a.cancel(w)
    assert a.wait(lambda: started.append(2), lambda: None, 0.0) is not None
    a.leave()
    assert started == [2] and a.active == 1
