"""Circuit breaker state machine (fastroute.breaker), with a fake clock and a recording table."""
from __future__ import annotations

from types import SimpleNamespace

from fastroute.breaker import CLOSED, HALF_OPEN, OPEN, Breakers
from fastroute.metrics import Stats


class Table:
    def __init__(self) -> None:
        self.circuit: dict[int, int] = {}

    def set_circuit(self, t: int, state: int) -> None:
        self.circuit[t] = state


def make(**kw):
    clock = SimpleNamespace(now=100.0)
    tab = Table()
    stats = Stats()
    kw.setdefault("failure_threshold", 3)
    kw.setdefault("success_threshold", 2)
    kw.setdefault("timeout_secs", 10.0)
    br = Breakers(tab, 8, stats=stats, name_of=lambda t: f"w{t}", clock=lambda: clock.now, **kw)
    return br, tab, stats, clock


def test_opens_after_consecutive_failures_only() -> None:
    br, tab, stats, _ = make()
    br.failure(1)
    br.failure(1)
    br.success(1)          # breaks the streak
    br.failure(1)
    br.failure(1)
    assert br.state[1] == CLOSED and 1 not in tab.circuit
    br.failure(1)
    assert br.state[1] == OPEN and tab.circuit[1] == OPEN
    assert stats.cb_outcomes == {("w1", "failure"): 5, ("w1", "success"): 1}
    assert stats.cb_transitions == {("w1", "closed", "open"): 1}


def test_backpressure_statuses_are_neutral_and_server_errors_fail() -> None:
    br, tab, stats, _ = make(failure_threshold=2)
    for s in (503, 429, 408, 503, 429):
        br.status(2, s)
    assert br.state[2] == CLOSED and br.fails[2] == 0
    assert stats.cb_outcomes == {}
    br.status(2, 500)
    br.status(2, 503)      # neutral: does not reset the streak either
    br.status(2, 504)
    assert br.state[2] == OPEN
    br2, _, _, _ = make(failure_threshold=1)
    br2.status(0, 502)
    assert br2.state[0] == OPEN
    br3, _, _, _ = make(failure_threshold=1)
    for s in (200, 400, 404, 422):
        br3.status(0, s)
    assert br3.state[0] == CLOSED


def test_half_open_after_timeout_then_closes_after_successes() -> None:
    br, tab, stats, clock = make()
    for _ in range(3):
        br.failure(4)
    assert br.state[4] == OPEN
    clock.now += 9.9
    br.tick()
    assert br.state[4] == OPEN
    clock.now += 0.2
    br.tick()
    assert br.state[4] == HALF_OPEN and tab.circuit[4] == HALF_OPEN
    br.success(4)
    assert br.state[4] == HALF_OPEN
    br.success(4)
    assert br.state[4] == CLOSED and tab.circuit[4] == CLOSED
    assert br.fails[4] == 0
    assert stats.cb_transitions == {("w4", "closed", "open"): 1, ("w4", "open", "half_open"): 1,
                                    ("w4", "half_open", "closed"): 1}


def test_failure_in_half_open_reopens_and_restarts_the_timer() -> None:
    br, tab, _, clock = make()
    for _ in range(3):
        br.failure(0)
    clock.now += 10
    br.tick()
    br.success(0)
    br.failure(0)
    assert br.state[0] == OPEN
    clock.now += 5
    br.tick()
    assert br.state[0] == OPEN      # timer restarted at the half-open failure
    clock.now += 5
    br.tick()
    assert br.state[0] == HALF_OPEN


def test_disabled_breaker_never_opens_but_counts_outcomes() -> None:
    br, tab, stats, _ = make(enabled=False)
    for _ in range(1000):
        br.failure(3)
    assert br.state[3] == CLOSED and not tab.circuit
    assert stats.cb_outcomes[("w3", "failure")] == 1000


def test_reset_forgets_history_of_a_reused_row() -> None:
    br, tab, stats, _ = make()
    for _ in range(3):
        br.failure(5)
    br.reset(5)
    assert br.state[5] == CLOSED and tab.circuit[5] == CLOSED and not br.open
    br.failure(5)
    br.failure(5)
    assert br.state[5] == CLOSED
