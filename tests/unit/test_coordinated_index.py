"""Synced replicas' plan from the coordinated index (issue #52, core/_coindex.pxd).

A Picker over 64 or more candidates plans the next n placements of synced replicas from a
tournament tree instead of n scans (``_policy.pick_coordinated``), and tells an idle view from
one cell instead of a scan.  These tests write a real shared-memory table through its real
writers (leases, the poll store, health, the replica columns through ``Cells`` and
``sync_store``) and compare the indexed plan with the scan's, placement for placement."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastroute.core import _ledger, _policy
from fastroute.core.table import (
    CIRCUIT_CLOSED,
    CIRCUIT_OPEN,
    COL_IN_FLIGHT,
    COL_ORDER_KEY,
    COL_OTHERS_EST,
    COL_OTHERS_EST_TOKENS,
    COL_OTHERS_IN_FLIGHT,
    COL_OTHERS_OPEN,
    COL_OTHERS_TOKENS,
    TargetTable,
)

ROWS = 200
# (label, policy, metric, demand, kv_fit): the pickers that plan with synced replicas
MODES = {
    "least_requests": ("power_of_two", "least_requests", 0, 0),
    "demand": ("random", "tokens", 2, 0),
    "kv_fit": ("power_of_two", "tokens", 0, 2),
    "kv_fit_demand": ("random", "tokens", 2, 2),
}


@pytest.fixture(scope="module")
def table():
    tab = TargetTable(256)
    for _ in range(ROWS):
        tab.alloc()
    yield tab
    tab.close()
    tab.unlink()


def picker(tab: TargetTable, cands, mode: str, weight: int = 0, seed: int = 1) -> _ledger.Picker:
    policy, metric, demand, kv = MODES[mode]
    p = _ledger.Picker(tab.array, tab.header, policy, metric, demand=demand, weight=weight, kv_fit=kv, seed=seed)
    p.set_candidates(np.asarray(cands, dtype=np.int64))
    return p


def scan(tab: TargetTable, cands, mode: str, weight: int, tokens: int, need: int, n: int, slot: int, strict: bool):
    _, _, demand, kv = MODES[mode]
    return _policy.coordinated(
        tab.snapshot(), np.asarray(cands, dtype=np.int64), tokens, need, demand == 2, weight, kv == 2, n, slot, strict
    )


def scramble(tab: TargetTable, rs: np.random.Generator, rows, order_keys: int) -> None:
    """Random loads, estimates, order keys (with ties), health, circuits and KV, through the
    table's own writers."""
    cells = tab.cells
    for t in rows:
        t = int(t)
        cells.store(t, COL_ORDER_KEY, int(rs.integers(0, order_keys)))
        cells.store(t, COL_OTHERS_IN_FLIGHT, int(rs.integers(0, 4)))
        cells.store(t, COL_OTHERS_TOKENS, int(rs.integers(0, 3)) * 100)
        cells.store(t, COL_OTHERS_EST, int(rs.integers(0, 2)))
        cells.store(t, COL_OTHERS_EST_TOKENS, int(rs.integers(0, 2)) * 50)
        cells.store(t, COL_OTHERS_OPEN, int(rs.random() < 0.05))
        tab.set_healthy(t, bool(rs.random() > 0.1))
        tab.set_circuit(t, CIRCUIT_OPEN if rs.random() < 0.05 else CIRCUIT_CLOSED)
        if rs.random() < 0.7:
            tab.set_polled(
                t,
                0,
                0,
                int(rs.integers(0, 8)) * 100,
                int(rs.integers(1, 4)) * 500,
                uncached=int(rs.integers(-1, 3)) * 40,
            )
        else:
            tab.mark_unpolled(t)


def reset(tab: TargetTable) -> None:
    for t in range(ROWS):
        tab.set_healthy(t, True)
        tab.set_circuit(t, CIRCUIT_CLOSED)
        tab.mark_unpolled(t)
        for col in (COL_OTHERS_IN_FLIGHT, COL_OTHERS_TOKENS, COL_OTHERS_OPEN, COL_OTHERS_EST, COL_OTHERS_EST_TOKENS):
            tab.cells.store(t, col, 0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    seed=st.integers(0, 2**32 - 1),
    mode=st.sampled_from(sorted(MODES)),
    n_cands=st.integers(64, 190),
    order_keys=st.sampled_from([3, 40, 10**9]),
    weight=st.sampled_from([0, 1, 7]),
)
def test_the_indexed_plan_is_the_scans_placement_for_placement(table, seed, mode, n_cands, order_keys, weight):
    rs = np.random.default_rng(seed)
    cands = rs.choice(ROWS, n_cands, replace=False)
    reset(table)
    scramble(table, rs, range(ROWS), order_keys)
    p = picker(table, cands, mode, weight)
    leases = []
    try:
        for _ in range(12):
            tokens = int(rs.integers(0, 400))
            need = tokens + int(rs.integers(0, 600))
            n = int(rs.integers(1, 9))
            slot = int(rs.integers(0, n))
            strict = bool(rs.integers(0, 2))
            assert p.coordinated_plan(tokens, need, n, slot, strict) == scan(
                table, cands, mode, weight, tokens, need, n, slot, strict
            )
            # the table moves between two plans: the index follows it through the feed
            scramble(table, rs, rs.choice(ROWS, 6, replace=False), order_keys)
            lease = _ledger.book(table.array, table.header, int(rs.choice(cands)), int(rs.integers(0, 300)))
            leases.append(lease)
            if rs.random() < 0.4:
                leases.pop(int(rs.integers(0, len(leases)))).release()
        assert p.coordinated_rebuilds == 1  # never fell back to a rebuild
    finally:
        for lease in leases:
            lease.release()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_synced_picks_through_the_index_book_what_the_scan_plans(table, mode):
    """The Picker's own path: replicas = 8, a burst of picks on one view (the first one a lone
    pick, the later ones strict), each the scan's choice for the table as it stands, the
    others' places booked as their estimate."""
    rs = np.random.default_rng(3)
    cands = np.arange(0, 160)
    reset(table)
    scramble(table, rs, range(ROWS), 50)
    table.set_replicas(8, 5)
    table.count_sync_tick()
    p = picker(table, cands, mode, 3, seed=2)
    leases = []
    try:
        for i in range(40):
            tokens = int(rs.integers(1, 300))
            want = scan(table, cands, mode, 3, tokens, tokens, 8, 5, i > 0)[0]
            lease = p.acquire(tokens)
            leases.append(lease)
            assert lease is not None and lease.target == want, i
        assert p.coordinated_indexed and p.coordinated_picks == 40
    finally:
        table.set_replicas(0, 0)
        for lease in leases:
            if lease is not None:
                lease.release()


def test_the_idle_test_reads_one_cell_and_follows_every_writer(table):
    """Idle: nothing in flight here, at the others, or estimated for them, on any candidate
    (healthy or not).  Each writer of those cells moves the index's answer: a lease, the
    replica sync's compiled store, the picker's own estimate and its ageing."""
    reset(table)
    cands = np.arange(0, 128)
    p = picker(table, cands, "least_requests")
    assert p.coordinated_plan(0, 0, 2, 0) is not None
    assert p.coordinated_idle is True
    lease = _ledger.book(table.array, table.header, 70, 10)
    assert p.coordinated_idle is False
    lease.release()
    assert p.coordinated_idle is True
    # the replica sync's store of the others' sums (syncdelta's path)
    vals = np.zeros((1, 2, 3), dtype=np.int64)  # (names, peer slots, values)
    vals[0, 1] = (2, 100, 0)
    starts = np.array([0, 1], dtype=np.int64)
    rows = np.array([127], dtype=np.int64)
    _ledger.sync_store(table.array, table.header, vals, np.array([1]), np.array([0]), starts, rows, 1 << 40)
    assert table.array[127, COL_OTHERS_IN_FLIGHT] == 2 and p.coordinated_idle is False
    vals[0, 1] = (0, 0, 0)
    _ledger.sync_store(table.array, table.header, vals, np.array([1]), np.array([0]), starts, rows, 1 << 40)
    assert p.coordinated_idle is True
    table.set_healthy(3, False)
    table.cells.add(3, COL_OTHERS_EST, 1)  # an estimate on an unhealthy rank still counts
    assert p.coordinated_idle is False
    table.cells.add(3, COL_OTHERS_EST, -1)
    assert p.coordinated_idle is True
    table.cells.add(200, COL_OTHERS_EST, 1)  # not a candidate
    assert p.coordinated_idle is True
    table.cells.add(200, COL_OTHERS_EST, -1)


def test_an_idle_view_is_picked_alone_and_a_busy_one_is_planned(table):
    reset(table)
    cands = np.arange(0, 100)
    table.set_replicas(4, 1)
    p = picker(table, cands, "least_requests")
    try:
        lease = p.acquire(5)  # idle: this replica's own pick, no plan, no estimate
        assert p.coordinated_picks == 0 and table.array[:ROWS, COL_OTHERS_EST].sum() == 0
        lease2 = p.acquire(5)  # its own first booking makes the view busy: planned
        assert p.coordinated_picks == 1 and table.array[:ROWS, COL_OTHERS_EST].sum() == 3
        for t in (lease, lease2):
            t.release()
    finally:
        table.set_replicas(0, 0)
        reset(table)


def test_a_row_written_without_its_notice_is_caught_by_the_plan(table):
    # A writer between its write and its notice: the plan checks each leaf it reaches against
    # its row and plans again; the result is the scan's for the table as it is.
    reset(table)
    cands = np.arange(0, 100)
    p = picker(table, cands, "least_requests")
    for t in range(1, 100):
        table.cells.add(t, COL_OTHERS_IN_FLIGHT, 1)
    assert p.coordinated_plan(0, 0, 1, 0) == (0, [0])
    table.array[0, COL_IN_FLIGHT] += 5  # no notice
    try:
        got = p.coordinated_plan(0, 0, 3, 0, True)
        assert got == scan(table, cands, "least_requests", 0, 0, 0, 3, 0, True) and 0 not in got[1]
    finally:
        table.array[0, COL_IN_FLIGHT] -= 5
        reset(table)


def test_a_burst_over_three_replicas_of_a_fleet_fills_distinct_ranks():
    """test_coordinated's burst at fleet size, through real indexed Pickers: three replicas,
    each with its own table holding the same synced view of 96 ranks (60 of them busy with
    one request), take 20 requests each before the next sync; the 60 land as one router would
    place them: every idle rank gets one, then distinct busy ones, never a rank at 3."""
    n_ranks, n_rep, per = 96, 3, 20
    base = np.zeros(n_ranks, dtype=np.int64)
    base[np.random.default_rng(4).choice(n_ranks, 60, replace=False)] = 1
    tabs, pickers = [], []
    try:
        for slot in range(n_rep):
            tab = TargetTable(n_ranks)
            for t in range(n_ranks):
                tab.alloc()
                tab.set_healthy(t, True)
                tab.cells.store(t, COL_ORDER_KEY, (t * 7919) % 1009)
                tab.cells.store(t, COL_OTHERS_IN_FLIGHT, int(base[t]))
            tab.set_replicas(n_rep, slot)
            tab.count_sync_tick()
            tabs.append(tab)
            pickers.append(picker(tab, range(n_ranks), "least_requests", seed=slot))
        placed = np.zeros(n_ranks, dtype=np.int64)
        for _ in range(per):
            for p in pickers:
                placed[p.acquire(10).target] += 1
        assert all(p.coordinated_indexed and p.coordinated_picks == per for p in pickers)
        total = base + placed
        assert total.max() == 2 and total.min() == 1, total
        for tab in tabs:  # what each replica believes is what happened
            arr = tab.array
            seen = arr[:n_ranks, COL_IN_FLIGHT] + arr[:n_ranks, COL_OTHERS_IN_FLIGHT] + arr[:n_ranks, COL_OTHERS_EST]
            assert (seen == total).all()
    finally:
        del pickers
        for tab in tabs:
            tab.close()
            tab.unlink()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_look_without_booking_leaves_the_index_as_the_rows_are(table, mode):
    """A booked plan keeps its charges in the tree (the bookings post those rows); a pick that
    books nothing must not: the next plan is still the scan's."""
    rs = np.random.default_rng(9)
    cands = np.arange(20, 180)
    reset(table)
    scramble(table, rs, range(ROWS), 30)
    table.set_replicas(8, 2)
    p = picker(table, cands, mode, 2)
    try:
        for _ in range(5):
            p.pick(80)
        assert p.coordinated_indexed
        assert p.coordinated_plan(80, 80, 8, 2, True) == scan(table, cands, mode, 2, 80, 80, 8, 2, True)
        lease = p.acquire(80)  # booked: the charges stay, and the rows now say the same
        assert lease is not None
        assert p.coordinated_plan(80, 80, 8, 2, True) == scan(table, cands, mode, 2, 80, 80, 8, 2, True)
        lease.release()
    finally:
        table.set_replicas(0, 0)
        reset(table)


def _synced_writer(name: str, seed: int, rounds: int, barrier, out) -> None:
    """Another proxy process of the same replica: synced pickers booking and releasing (with
    the others' estimates) and the others' counts moving, all on one shared table."""
    tab = TargetTable.attach(name)
    rs = np.random.default_rng(seed)
    pickers = [picker(tab, np.arange(0, 150), mode, 2, seed=seed + i) for i, mode in enumerate(sorted(MODES))]
    leases = []
    for _ in range(rounds):
        r = rs.random()
        if r < 0.5:
            lease = pickers[int(rs.integers(0, len(pickers)))].acquire(int(rs.integers(1, 200)))
            if lease is not None:
                leases.append(lease)
        elif r < 0.9 and leases:
            leases.pop(int(rs.integers(0, len(leases)))).release()
        else:
            tab.cells.store(int(rs.integers(0, ROWS)), COL_OTHERS_IN_FLIGHT, int(rs.integers(0, 3)))
    barrier.wait()  # both writers done: the table is quiet
    snap = tab.snapshot()
    agree = all(
        p.coordinated_plan(50, 50, 8, 3, True)
        == _policy.coordinated(snap, np.arange(0, 150), 50, 50, MODES[m][2] == 2, 2, MODES[m][3] == 2, 8, 3, True)
        for p, m in zip(pickers, sorted(MODES))
    )
    out.put((seed, agree, all(p.coordinated_picks > 0 for p in pickers)))
    barrier.wait()  # the other has checked too
    for lease in leases:
        lease.release()
    del pickers
    tab.close()


def test_two_processes_planning_on_one_table_leave_every_coordinated_index_true():
    import multiprocessing as mp

    tab = TargetTable(256)
    for t in range(ROWS):
        tab.alloc()
        tab.set_polled(t, 0, 0, (t % 5) * 100, 2_000)
        tab.cells.store(t, COL_ORDER_KEY, (t * 7919) % 211)
        tab.cells.store(t, COL_OTHERS_IN_FLIGHT, t % 2)
    tab.set_replicas(8, 3)
    tab.count_sync_tick()
    mine = picker(tab, np.arange(0, 150), "least_requests", seed=5)  # fed by the two writers
    assert mine.coordinated_plan(0, 0, 8, 3) is not None
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_synced_writer, args=(tab.name, s, 2000, barrier, out)) for s in (1, 2)]
    try:
        for proc in procs:
            proc.start()
        results = [out.get(timeout=60) for _ in procs]
        for proc in procs:
            proc.join(timeout=60)
            assert proc.exitcode == 0
        assert all(r[1] and r[2] for r in results), results
        snap = tab.snapshot()
        assert mine.coordinated_plan(50, 50, 8, 3, True) == _policy.coordinated(
            snap, np.arange(0, 150), 50, 50, False, 0, False, 8, 3, True
        )
        assert tab.underflows == 0  # (this index fell a ring behind: it was rebuilt)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        del mine
        tab.close()
        tab.unlink()
