"""Circuit breaker state machine (fastroute.core.breaker) over a real shared target table.

Single-object tests use a fake clock; the sharing tests run two ``Breakers`` over one
table (two proxy processes in one interpreter), and one test runs real spawned
processes that attach the table by name and race on the same rows.
"""

from __future__ import annotations

import multiprocessing as mp
from types import SimpleNamespace

import pytest

from fastroute.control.metrics import Stats
from fastroute.core import _ledger, _policy
from fastroute.core import table as T
from fastroute.core.breaker import CLOSED, HALF_OPEN, OPEN, Breakers
from fastroute.core.table import TargetTable


@pytest.fixture
def tables():
    made: list[TargetTable] = []

    def new(capacity: int = 8) -> TargetTable:
        tab = TargetTable(capacity)
        made.append(tab)
        return tab

    yield new
    for tab in made:
        tab.unlink()
        tab.close()


def make(tab: TargetTable, clock=None, **kw):
    clock = clock or SimpleNamespace(now=100.0)
    stats = Stats()
    kw.setdefault("failure_threshold", 3)
    kw.setdefault("success_threshold", 2)
    kw.setdefault("timeout_secs", 10.0)
    br = Breakers(tab, tab.capacity, stats=stats, name_of=lambda t: f"w{t}", clock=lambda: clock.now, **kw)
    return br, stats, clock


def circuit(tab: TargetTable, t: int) -> int:
    return tab.get(t, T.COL_CIRCUIT)


def test_breaker_columns_mirror_the_compiled_layout() -> None:
    layout = _policy.layout()
    for name in ("COL_CIRCUIT", "COL_CB_FAILS", "COL_CB_OKS", "COL_CB_OPENED_AT"):
        assert getattr(T, name) == layout[name], name
    assert (layout["CIRCUIT_CLOSED"], layout["CIRCUIT_OPEN"], layout["CIRCUIT_HALF_OPEN"]) == (CLOSED, OPEN, HALF_OPEN)
    cols = {T.COL_CB_FAILS, T.COL_CB_OKS, T.COL_CB_OPENED_AT}
    assert len(cols) == 3 and max(cols) < T.NCOLS
    assert not cols & {
        T.COL_IN_FLIGHT,
        T.COL_IN_FLIGHT_TOKENS,
        T.COL_POLLED_RUNNING,
        T.COL_POLLED_WAITING,
        T.COL_POLLED_TOKENS,
        T.COL_POLLED_AT,
        T.COL_HEALTHY,
        T.COL_PICKS,
        T.COL_CIRCUIT,
        T.COL_POLLED_MAX_TOKENS,
        T.COL_ALLOCATED,
        T.COL_TOKENS_AT_POLL,
    }


def test_cas_changes_the_cell_only_from_the_expected_value(tables) -> None:
    tab = tables()
    assert tab.cells.cas(2, T.COL_CIRCUIT, 0, OPEN) is True
    assert tab.cells.cas(2, T.COL_CIRCUIT, 0, HALF_OPEN) is False
    assert circuit(tab, 2) == OPEN
    cells = _ledger.Cells(tab.array)
    assert cells.cas(2, T.COL_CIRCUIT, OPEN, HALF_OPEN) and not cells.cas(2, T.COL_CIRCUIT, OPEN, 0)
    assert cells.rows_where(T.COL_CIRCUIT, HALF_OPEN) == [2]
    assert cells.add(2, T.COL_CB_FAILS, 5) == 5 and cells.add(2, T.COL_CB_FAILS, 2) == 7
    assert cells.ok_closed(2) == HALF_OPEN and cells.load(2, T.COL_CB_FAILS) == 7  # not closed
    cells.store(2, T.COL_CIRCUIT, CLOSED)
    assert cells.ok_closed(2) == CLOSED and cells.load(2, T.COL_CB_FAILS) == 0  # streak ended


def test_opens_after_consecutive_failures_only(tables) -> None:
    tab = tables()
    br, stats, _ = make(tab)
    br.failure(1)
    br.failure(1)
    br.success(1)  # breaks the streak
    assert br.failures(1) == 0
    br.failure(1)
    br.failure(1)
    assert br.state_of(1) == CLOSED and circuit(tab, 1) == CLOSED
    br.failure(1)
    assert br.state_of(1) == OPEN and circuit(tab, 1) == OPEN
    assert stats.cb_outcomes == {("w1", "failure"): 5, ("w1", "success"): 1}
    assert stats.cb_transitions == {("w1", "closed", "open"): 1}
    br.failure(1)  # already open: no second transition, the count is frozen
    assert stats.cb_transitions == {("w1", "closed", "open"): 1} and br.failures(1) == 3


def test_backpressure_statuses_are_neutral_and_server_errors_fail(tables) -> None:
    tab = tables()
    br, stats, _ = make(tab, failure_threshold=2)
    for s in (503, 429, 408, 503, 429):
        br.status(2, s)
    assert br.state_of(2) == CLOSED and br.failures(2) == 0
    assert stats.cb_outcomes == {}
    br.status(2, 500)
    br.status(2, 503)  # neutral: does not reset the streak either
    br.status(2, 504)
    assert br.state_of(2) == OPEN
    br2, _, _ = make(tables(), failure_threshold=1)
    br2.status(0, 502)
    assert br2.state_of(0) == OPEN
    br3, _, _ = make(tables(), failure_threshold=1)
    for s in (200, 400, 404, 422):
        br3.status(0, s)
    assert br3.state_of(0) == CLOSED


def test_half_open_after_timeout_then_closes_after_successes(tables) -> None:
    tab = tables()
    br, stats, clock = make(tab)
    for _ in range(3):
        br.failure(4)
    assert br.state_of(4) == OPEN
    clock.now += 9.9
    br.tick()
    assert br.state_of(4) == OPEN
    clock.now += 0.2
    br.tick()
    assert br.state_of(4) == HALF_OPEN and circuit(tab, 4) == HALF_OPEN
    br.success(4)
    assert br.state_of(4) == HALF_OPEN
    br.success(4)
    assert br.state_of(4) == CLOSED and circuit(tab, 4) == CLOSED
    assert br.failures(4) == 0 and tab.get(4, T.COL_CB_OKS) == 0
    assert stats.cb_transitions == {
        ("w4", "closed", "open"): 1,
        ("w4", "open", "half_open"): 1,
        ("w4", "half_open", "closed"): 1,
    }


def test_success_while_open_changes_nothing(tables) -> None:
    tab = tables()
    br, stats, clock = make(tab)
    for _ in range(3):
        br.failure(6)
    for _ in range(5):
        br.success(6)  # responses that were in flight when it opened
    assert br.state_of(6) == OPEN and tab.get(6, T.COL_CB_OKS) == 0
    clock.now += 10
    br.tick()
    br.success(6)
    assert br.state_of(6) == HALF_OPEN  # the probe window starts from zero


def test_failure_in_half_open_reopens_and_restarts_the_timer(tables) -> None:
    tab = tables()
    br, stats, clock = make(tab)
    for _ in range(3):
        br.failure(0)
    clock.now += 10
    br.tick()
    br.success(0)
    br.failure(0)
    assert br.state_of(0) == OPEN
    assert stats.cb_transitions[("w0", "half_open", "open")] == 1
    clock.now += 5
    br.tick()
    assert br.state_of(0) == OPEN  # timer restarted at the half-open failure
    clock.now += 5
    br.tick()
    assert br.state_of(0) == HALF_OPEN
    br.success(0)  # the earlier probe's success does not carry over
    assert br.state_of(0) == HALF_OPEN


def test_disabled_breaker_never_opens_but_counts_outcomes(tables) -> None:
    tab = tables()
    br, stats, _ = make(tab, enabled=False)
    for _ in range(1000):
        br.failure(3)
    assert br.state_of(3) == CLOSED and circuit(tab, 3) == CLOSED
    assert br.failures(3) == 1000
    assert stats.cb_outcomes[("w3", "failure")] == 1000


def test_reset_forgets_history_of_a_reused_row(tables) -> None:
    tab = tables()
    br, stats, _ = make(tab)
    for _ in range(3):
        br.failure(5)
    br.reset(5)
    assert br.state_of(5) == CLOSED and circuit(tab, 5) == CLOSED
    assert [tab.get(5, c) for c in (T.COL_CB_FAILS, T.COL_CB_OKS, T.COL_CB_OPENED_AT)] == [0, 0, 0]
    br.failure(5)
    br.failure(5)
    assert br.state_of(5) == CLOSED
    br.reset(tab.capacity + 3)  # out of range: ignored


def test_without_a_table_state_is_private(tables) -> None:
    clock = SimpleNamespace(now=0.0)
    br = Breakers(None, 4, failure_threshold=2, clock=lambda: clock.now)
    br.failure(1)
    br.failure(1)
    assert br.state_of(1) == OPEN and br.state_of(0) == CLOSED


# -- two processes' breakers over one table -----------------------------------------------------


def test_two_breakers_over_one_table_run_one_state_machine(tables) -> None:
    tab = tables()
    clock = SimpleNamespace(now=50.0)
    a, sa, _ = make(tab, clock, failure_threshold=4, success_threshold=3)
    b, sb, _ = make(tab, clock, failure_threshold=4, success_threshold=3)
    # Failures split across the processes open the circuit at the threshold total.
    a.failure(2)
    b.failure(2)
    a.failure(2)
    assert a.state_of(2) == b.state_of(2) == CLOSED and a.failures(2) == 3
    b.failure(2)
    assert circuit(tab, 2) == OPEN
    # A success in the other process ends the streak for both.
    a.failure(3)
    a.failure(3)
    a.failure(3)
    b.success(3)
    a.failure(3)
    assert circuit(tab, 3) == CLOSED and a.failures(3) == 1
    # Both sweeps run; the row moves to half-open once.
    clock.now += 5
    a.tick()
    b.tick()
    assert circuit(tab, 2) == OPEN
    clock.now += 5
    b.tick()
    a.tick()
    assert circuit(tab, 2) == HALF_OPEN
    # Successes from either process close it.
    a.success(2)
    b.success(2)
    assert circuit(tab, 2) == HALF_OPEN
    b.success(2)
    assert circuit(tab, 2) == CLOSED and a.failures(2) == 0
    # Each transition was performed (and counted) by exactly one of them.
    both: dict = {}
    for s in (sa, sb):
        for k, v in s.cb_transitions.items():
            both[k] = both.get(k, 0) + v
    assert both == {("w2", "closed", "open"): 1, ("w2", "open", "half_open"): 1, ("w2", "half_open", "closed"): 1}
    assert sb.cb_transitions == {
        ("w2", "closed", "open"): 1,
        ("w2", "open", "half_open"): 1,
        ("w2", "half_open", "closed"): 1,
    }
    # Outcome metrics stay per process.
    assert sa.cb_outcomes[("w2", "failure")] == 2 and sb.cb_outcomes[("w2", "failure")] == 2


def test_a_circuit_opened_elsewhere_is_skipped_and_ticked_here(tables) -> None:
    tab = tables()
    clock = SimpleNamespace(now=0.0)
    a, sa, _ = make(tab, clock, failure_threshold=1)
    b, sb, _ = make(tab, clock, failure_threshold=1)
    a.failure(7)
    b.failure(7)  # sees OPEN: no transition of its own
    assert sb.cb_transitions == {}
    clock.now += 10
    b.tick()  # b never saw the row open, it still moves it
    assert circuit(tab, 7) == HALF_OPEN and sb.cb_transitions == {("w7", "open", "half_open"): 1}
    a.failure(7)  # a failed probe in either process reopens it
    assert circuit(tab, 7) == OPEN and sa.cb_transitions[("w7", "half_open", "open")] == 1
    b.reset(7)
    assert a.state_of(7) == CLOSED


# -- real processes --------------------------------------------------------------------------

PROCS = 3
FAILS_EACH = 30_000


def _race(name_a: str, name_b: str, row_a: int, row_b: int, barrier, q) -> None:
    # One proxy process: attach the tables by name, then race the others through the same rows.
    # (Two tables because a breaker's tick covers every row of its table, and the two
    # scenarios need different timeouts.)
    tab_a, tab_b = TargetTable.attach(name_a), TargetTable.attach(name_b)
    sa, sb = Stats(), Stats()
    # Row a: the threshold is the grand total, so every failure must be counted.
    a = Breakers(tab_a, tab_a.capacity, failure_threshold=PROCS * FAILS_EACH, stats=sa)
    # Row b: every process crosses the threshold on its own; timeout 0 so ticks move it.
    b = Breakers(
        tab_b, tab_b.capacity, failure_threshold=FAILS_EACH // 2, success_threshold=2, timeout_secs=0.0, stats=sb
    )
    barrier.wait(60)
    for _ in range(FAILS_EACH):
        a.failure(row_a)
        b.failure(row_b)
    barrier.wait(60)
    b.tick()
    barrier.wait(60)
    for _ in range(5):
        b.success(row_b)
    barrier.wait(60)
    q.put((sa.cb_transitions, sb.cb_transitions, sa.cb_outcomes))
    tab_a.close()
    tab_b.close()


def test_processes_share_counts_and_each_transition_happens_once(tables) -> None:
    ctx = mp.get_context("spawn")
    tab_a, tab_b = tables(4), tables(4)
    row_a = tab_a.alloc()
    tab_b.alloc()
    row_b = tab_b.alloc()  # a different row number, so the metric keys differ
    barrier, q = ctx.Barrier(PROCS), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(tab_a.name, tab_b.name, row_a, row_b, barrier, q)) for _ in range(PROCS)]
    for p in procs:
        p.start()
    try:
        results = [q.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(10)
    total: dict = {}
    for ta, tb, outcomes in results:
        assert outcomes == {(str(row_a), "failure"): FAILS_EACH}
        for k, v in list(ta.items()) + list(tb.items()):
            total[k] = total.get(k, 0) + v
    ra, rb = str(row_a), str(row_b)
    # No failure lost: the shared count is exact, and the last one opened the circuit once.
    assert tab_a.get(row_a, T.COL_CB_FAILS) == PROCS * FAILS_EACH
    assert circuit(tab_a, row_a) == OPEN
    # Row b crossed its threshold in every process, yet each transition happened once.
    assert total == {
        (ra, "closed", "open"): 1,
        (rb, "closed", "open"): 1,
        (rb, "open", "half_open"): 1,
        (rb, "half_open", "closed"): 1,
    }
    assert circuit(tab_b, row_b) == CLOSED and tab_b.get(row_b, T.COL_CB_FAILS) == 0
