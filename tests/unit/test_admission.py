"""Admission control (fastroute.dataplane.admission): limit, FIFO queue, rejection, expiry, cancel."""

from __future__ import annotations

from fastroute.control.metrics import Stats
from fastroute.dataplane.admission import Admission
from fastroute.dataplane.telemetry import RequestTelemetry


def make(limit: int = 2, queue: int = 2, timeout: float = 5.0) -> Admission:
    a = Admission(limit, queue, timeout, loop=None)  # no loop: waiters start inline
    a.tel = RequestTelemetry(Stats(), "regular")
    return a


def test_unlimited_never_queues_and_counts_nothing() -> None:
    for limit in (-1, 0):
        a = make(limit=limit)
        for _ in range(10_000):
            assert a.try_enter()
        assert a.active == 10_000 and not a.queue and a.tel.stats.rate_limit == {}


def test_over_limit_waits_fifo_and_a_freed_slot_goes_to_the_oldest() -> None:
    a = make(limit=2, queue=3)
    started: list[str] = []
    assert a.try_enter() and a.try_enter()
    assert not a.try_enter()
    w1 = a.wait(lambda: started.append("a"), lambda: None, 0.0)
    w2 = a.wait(lambda: started.append("b"), lambda: None, 0.0)
    assert w1 is not None and w2 is not None
    assert not a.try_enter()  # nobody overtakes the queue
    a.leave()
    assert started == ["a"] and a.active == 2
    a.leave()
    assert started == ["a", "b"] and a.active == 2 and not a.queue
    a.leave()
    a.leave()
    assert a.active == 0
    assert a.try_enter()
    assert a.tel.stats.rate_limit == {"allowed": 3, "queued": 2, "dequeued": 2}


def test_full_queue_rejects() -> None:
    a = make(limit=1, queue=1)
    assert a.try_enter()
    assert a.wait(lambda: None, lambda: None, 0.0) is not None
    assert a.wait(lambda: None, lambda: None, 0.0) is None
    assert a.tel.stats.rate_limit["rejected"] == 1
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
    assert a.tel.stats.rate_limit["timeout"] == 2


def test_cancelled_waiter_never_starts_and_frees_its_queue_place() -> None:
    a = make(limit=1, queue=1)
    started: list[int] = []
    assert a.try_enter()
    w = a.wait(lambda: started.append(1), lambda: None, 0.0)
    assert a.cancel(w) and not a.cancel(w)
    assert a.wait(lambda: started.append(2), lambda: None, 0.0) is not None
    a.leave()
    assert started == [2] and a.active == 1


# ---------------------------------------------------------------- --rate-limit-tokens-per-second


class _Clock:
    """Just enough of an event loop: a settable clock, call_soon inline, one-shot timers."""

    def __init__(self) -> None:
        self.now = 0.0
        self.timers: list[tuple[float, object]] = []

    def time(self) -> float:
        return self.now

    def call_soon(self, fn) -> None:
        fn()

    def call_later(self, delay: float, fn):
        self.timers.append((self.now + delay, fn))
        return fn

    def advance(self, dt: float) -> None:
        self.now += dt
        due = [t for t in self.timers if t[0] <= self.now + 1e-12]
        self.timers = [t for t in self.timers if t[0] > self.now + 1e-12]
        for _, fn in due:
            fn()


def test_rate_bucket_admits_a_burst_then_the_refill_rate_through_the_queue() -> None:
    clock = _Clock()
    a = Admission(4, 10, 5.0, loop=clock, rate=2.0)  # burst 4, then 2 requests per second
    a.tel = RequestTelemetry(Stats(), "regular")
    assert all(a.try_enter() for _ in range(4))
    for _ in range(4):
        a.leave()  # slots free, but the tokens are spent
    assert not a.try_enter()
    started: list[int] = []
    for i in range(3):
        assert a.wait(lambda i=i: started.append(i), lambda: None, clock.now) is not None
    assert started == [] and len(clock.timers) == 1  # one wake-up timer, not one per waiter
    clock.advance(0.5)
    assert started == [0]
    clock.advance(0.5)
    assert started == [0, 1]
    clock.advance(0.5)
    assert started == [0, 1, 2] and not a.queue
    assert a.tel.stats.rate_limit == {"allowed": 4, "queued": 3, "dequeued": 3}


def test_rate_limited_queue_full_is_429_and_waiting_too_long_is_408() -> None:
    clock = _Clock()
    a = Admission(-1, 1, 2.0, loop=clock, rate=1.0)  # unlimited slots: burst = 1 s of rate
    assert a.enabled
    assert a.try_enter() and not a.try_enter()
    expired: list[int] = []
    assert a.wait(lambda: None, lambda: expired.append(1), clock.now) is not None
    assert a.wait(lambda: None, lambda: None, clock.now) is None  # queue full: 429
    a2 = Admission(-1, 5, 0.5, loop=clock, rate=0.1)
    assert a2.try_enter() and not a2.try_enter()
    a2.wait(lambda: None, lambda: expired.append(2), clock.now)
    clock.now += 1.0
    assert a2.expire(clock.now) == 1 and expired == [2]  # waited too long: 408
