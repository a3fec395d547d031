"""The load index of least_requests and demand pickers (issue #52, core/_index.pxd).

A Picker over 64 or more candidates keeps a tournament tree of their keys, fed by every writer of
the shared table through the header's feed.  These tests drive the real writers (leases, the
monitor's poll store, health, breaker and replica cells) on a real shared-memory table and check
the index against a full scan by the NumPy twin: the same tied minimum after any sequence, the
same pick draw for draw, in one process and in two processes writing the same table."""

from __future__ import annotations

import multiprocessing as mp
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastroute.core import _ledger
from fastroute.core import reference as R
from fastroute.core.table import (
    CIRCUIT_CLOSED,
    CIRCUIT_OPEN,
    COL_IN_FLIGHT,
    COL_OTHERS_EST,
    COL_OTHERS_IN_FLIGHT,
    COL_OTHERS_OPEN,
    COL_OTHERS_TOKENS,
    HDR_FEED_AT,
    HDR_FEED_SLOTS,
    TargetTable,
)

N = 96  # above R.INDEX_MIN_CANDS, not a power of two (padding leaves)


@pytest.fixture
def table():
    tab = TargetTable(256)
    for _ in range(200):
        tab.alloc()
    yield tab
    tab.close()
    tab.unlink()


def picker(tab: TargetTable, cands, kind: str = "least_requests", weight: int = 0, seed: int = 7):
    if kind == "kv_fit":
        p = _ledger.Picker(tab.array, tab.header, "power_of_two", "tokens", kv_fit=2, kv_reserve=weight, seed=seed)
    elif kind == "demand":
        p = _ledger.Picker(tab.array, tab.header, "random", "tokens", demand=2, weight=weight, seed=seed)
    else:
        p = _ledger.Picker(tab.array, tab.header, "power_of_two", "least_requests", seed=seed)
    p.set_candidates(np.asarray(cands, dtype=np.int64))
    return p


def ties(tab: TargetTable, cands, kind: str = "least_requests", weight: int = 0, need: int = 0) -> list[int]:
    return R.index_ties(tab.snapshot(), cands, kind, 0 if kind == "kv_fit" else weight, need)


def test_index_is_kept_only_where_it_pays():
    tab = TargetTable(128)
    try:
        for _ in range(100):
            tab.alloc()
        assert picker(tab, range(100)).indexed == "least_requests"
        assert picker(tab, range(100), "demand", 3).indexed == "demand"
        assert picker(tab, range(R.INDEX_MIN_CANDS - 1)).indexed is None  # small: the scan
        p = _ledger.Picker(tab.array, tab.header, "power_of_two", "tokens", seed=1)
        p.set_candidates(np.arange(100))
        assert p.indexed is None and p.indexed_ties() is None  # power_of_two samples two
        assert picker(tab, range(100), "kv_fit").indexed == "kv_fit"
        p = _ledger.Picker(tab.array, tab.header, "power_of_two", "least_requests", kv_fit=1, seed=1)
        p.set_candidates(np.arange(100))
        assert p.indexed == "least_requests"  # KV fit in shadow: the pick is least_requests'
        p = _ledger.Picker(tab.array, tab.header, "random", demand=2, kv_fit=2, seed=1)
        p.set_candidates(np.arange(100))
        assert p.indexed is None  # KV fit ranked by demand: scanned
        p = picker(tab, list(range(80)) + [3])
        assert p.indexed is None  # a row twice: no leaf of its own
    finally:
        tab.close()
        tab.unlink()


@pytest.mark.parametrize(
    "kind,weight", [("least_requests", 0), ("demand", 0), ("demand", 50), ("kv_fit", 0), ("kv_fit", 600)]
)
@pytest.mark.parametrize("seed", range(4))
def test_picks_match_the_twin_draw_for_draw(table, kind, weight, seed):
    # (kv_fit: weight is the KV reserve; capacities tight enough that some ranks do not fit)
    rs = np.random.default_rng(seed)
    cands = rs.choice(200, N, replace=False)
    for t in cands:
        if rs.random() < 0.7:
            used = int(rs.integers(0, 3)) * 100
            table.set_polled(int(t), 0, 0, used, int(rs.integers(1, 4)) * 400, uncached=int(rs.integers(-1, 2)) * 50)
    p = picker(table, cands, kind, weight, seed=seed)
    rng = R.Rng(seed)
    leases = []
    for i in range(300):
        tokens = int(rs.integers(0, 200))
        want = R.indexed_pick(table.snapshot(), cands, kind, 0 if kind == "kv_fit" else weight, rng, tokens + weight)
        if want == -2:  # KV fit: no capacity known, the usual pick decides (not the index's)
            break
        lease = p.acquire(tokens)
        assert (lease.target if lease else -1) == want, i
        leases.append(lease)
        if rs.random() < 0.4:
            leases.pop(int(rs.integers(0, len(leases)))).release()
        if rs.random() < 0.1:
            table.set_healthy(int(rs.choice(cands)), bool(rs.random() < 0.5))


def test_ties_are_uniform_over_the_exact_minimum(table):
    cands = np.arange(128)
    p = picker(table, cands, seed=3)
    for t in range(0, 128, 2):
        table.cells.add(t, COL_OTHERS_IN_FLIGHT, 1)  # the odd rows are the minimum
    counts = Counter(p.pick() for _ in range(64 * 400))
    assert set(counts) == set(range(1, 128, 2))
    # 64 tied rows, 400 expected each: a uniform draw stays well inside +-30%
    assert min(counts.values()) > 280 and max(counts.values()) < 520, counts


OPS = st.lists(
    st.tuples(
        st.sampled_from(["book", "release", "poll", "unpoll", "health", "circuit", "others", "open", "estimate"]),
        st.integers(0, 10_000),
        st.integers(0, 400),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, weight=st.sampled_from([0, 7]), need=st.sampled_from([0, 300, 900]))
def test_index_agrees_with_a_full_scan_after_any_writes(table, ops, weight, need):
    lr_cands = np.arange(0, 128)
    dm_cands = np.arange(64, 200)[::-1]  # another group, overlapping, in another order
    kv_cands = np.arange(30, 200, 2)
    lr = picker(table, lr_cands)
    dm = picker(table, dm_cands, "demand", weight)
    kv = picker(table, kv_cands, "kv_fit")
    leases = []
    try:
        for op, a, b in ops:
            t = a % 200
            if op == "book":
                lease = (lr if a % 2 else dm).acquire(b)
                if lease is not None:
                    leases.append(lease)
            elif op == "release" and leases:
                leases.pop(a % len(leases)).release()
            elif op == "poll":
                table.set_polled(
                    t, 1, 0, b, 1_000 if a % 2 else -1, uncached=(b if a % 3 == 0 else -1), kv_queue=a % 7 // 6
                )
            elif op == "unpoll":
                table.mark_unpolled(t)
            elif op == "health":
                table.set_healthy(t, b % 3 != 0)
            elif op == "circuit":
                table.set_circuit(t, CIRCUIT_OPEN if b % 2 else CIRCUIT_CLOSED)
            elif op == "others":
                table.cells.store(t, COL_OTHERS_IN_FLIGHT, b % 5)
                table.cells.store(t, COL_OTHERS_TOKENS, b)
            elif op == "open":
                table.cells.store(t, COL_OTHERS_OPEN, b % 2)
            else:
                table.cells.add(t, COL_OTHERS_EST, 1)
            assert lr.indexed_ties() == ties(table, lr_cands)
            assert kv.indexed_ties(need) == ties(table, kv_cands, "kv_fit", need=need)
        assert dm.indexed_ties() == ties(table, dm_cands, "demand", weight)
    finally:
        for lease in leases:
            lease.release()
        for t in range(200):  # back to the fixture's state for the next example
            table.set_healthy(t, True)
            table.set_circuit(t, CIRCUIT_CLOSED)
            table.mark_unpolled(t)
            for col in (COL_OTHERS_IN_FLIGHT, COL_OTHERS_TOKENS, COL_OTHERS_OPEN, COL_OTHERS_EST):
                table.cells.store(t, col, 0)


def test_a_picker_behind_the_feed_rebuilds(table):
    cands = np.arange(100)
    behind = picker(table, cands)
    busy = picker(table, cands, seed=9)
    built = behind.index_rebuilds
    leases = [busy.acquire(1) for _ in range(HDR_FEED_SLOTS)]  # more notices than the ring holds
    for lease in leases[::3]:
        lease.release()
    assert behind.indexed_ties() == ties(table, cands)
    assert behind.index_rebuilds == built + 1


def test_a_notice_never_written_holds_back_nothing_after_it(table):
    # A writer that took a feed position and died before writing its notice: the notices after
    # it are still read; once the ring has moved half its length past it, the index is rebuilt.
    cands = np.arange(100)
    p = picker(table, cands)
    table._hcells.add(0, HDR_FEED_AT, 1)
    lease = p.acquire(5)
    assert p.indexed_ties() == ties(table, cands) and lease.target not in p.indexed_ties()
    lease.release()
    assert p.indexed_ties() == ties(table, cands) == list(range(100))
    built = p.index_rebuilds
    for _ in range(HDR_FEED_SLOTS // 4 + 1):
        p.acquire(0).release()
    assert p.indexed_ties() == ties(table, cands)
    assert p.index_rebuilds == built + 1


def test_a_row_written_without_its_notice_is_caught_at_the_pick(table):
    # The pick checks the leaf it descends to against the row: a writer between its write and
    # its notice (here: a raw write that never publishes) cannot make it pick a loaded row.
    cands = np.arange(100)
    p = picker(table, cands)
    for t in range(1, 100):
        table.cells.add(t, COL_OTHERS_IN_FLIGHT, 1)
    assert p.indexed_ties() == [0]
    table.array[0, COL_IN_FLIGHT] += 5  # no notice
    assert p.pick() != 0
    table.array[0, COL_IN_FLIGHT] -= 5


def _writer(name: str, seed: int, rounds: int, barrier, out) -> None:
    tab = TargetTable.attach(name)
    rs = np.random.default_rng(seed)
    lr = picker(tab, np.arange(0, 160), seed=seed)
    dm = picker(tab, np.arange(40, 200), "demand", 5, seed=seed + 1)
    kv = picker(tab, np.arange(0, 200, 2), "kv_fit", seed=seed + 2)
    leases = []
    for _ in range(rounds):
        r = rs.random()
        if r < 0.45:
            lease = (lr, dm, kv)[int(rs.integers(0, 3))].acquire(int(rs.integers(1, 300)))
            if lease is not None:
                leases.append(lease)
        elif r < 0.85 and leases:
            leases.pop(int(rs.integers(0, len(leases)))).release()
        elif r < 0.95:
            tab.set_polled(int(rs.integers(0, 200)), 1, 0, int(rs.integers(0, 4)) * 100, 2_000)
        else:
            tab.set_healthy(int(rs.integers(0, 200)), bool(rs.random() < 0.7))
    barrier.wait()  # both writers done: the table is quiet
    out.put(
        (
            seed,
            lr.indexed_ties() == R.index_ties(tab.snapshot(), np.arange(0, 160), "least_requests"),
            dm.indexed_ties() == R.index_ties(tab.snapshot(), np.arange(40, 200), "demand", 5),
            kv.indexed_ties(700) == R.index_ties(tab.snapshot(), np.arange(0, 200, 2), "kv_fit", need=700),
            len(leases),
        )
    )
    barrier.wait()  # the other has checked too: now release
    for lease in leases:
        lease.release()
    del lr, dm, kv
    tab.close()


def test_two_processes_writing_one_table_leave_every_index_true(table):
    cands = np.arange(0, 160)
    mine = picker(table, cands, seed=11)  # this process's index, fed by the two writers
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(table.name, s, 3000, barrier, out)) for s in (1, 2)]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=60) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    assert all(r[1] and r[2] and r[3] for r in results), results
    assert sum(r[4] for r in results) > 0  # they held bookings while checking
    # Everything released: this process's index agrees too, and every count is back to zero.
    assert mine.indexed_ties() == ties(table, cands)
    assert all(table.in_flight(t) == 0 for t in range(200))
    assert table.underflows == 0


def test_a_fleet_sized_group_picks_as_the_twin_and_never_rebuilds_in_steady_state():
    # 8,192 candidates (a tree 13 levels deep); two groups booking and releasing on the same
    # table read each other's notices from the feed and never fall back to a rebuild.
    n = 8192
    tab = TargetTable(n)
    try:
        rs = np.random.default_rng(5)
        for t in range(n):
            tab.alloc()
            tab.set_polled(t, 0, 0, int(rs.integers(0, 4)), 1_000_000)
        lr = picker(tab, range(n), seed=21)
        dm = picker(tab, range(n - 1, -1, -1), "demand", 3, seed=22)
        built = lr.index_rebuilds, dm.index_rebuilds
        held = []
        for i in range(3000):
            held.append((lr if i % 2 else dm).acquire(int(rs.integers(0, 50))))
            if len(held) > 200:
                held.pop(int(rs.integers(0, len(held)))).release()
        assert (lr.index_rebuilds, dm.index_rebuilds) == built
        rng = R.Rng(77)
        check = picker(tab, range(n), seed=77)
        snap = tab.snapshot()
        assert [check.pick() for _ in range(20)] == [
            R.indexed_pick(snap, range(n), "least_requests", 0, rng) for _ in range(20)
        ]
        for lease in held:
            lease.release()
        assert lr.indexed_ties() == ties(tab, range(n))
    finally:
        tab.close()
        tab.unlink()


def test_a_rewrite_of_the_same_value_posts_no_notice(table):
    # A health round rewrites every target's health: posting each would overrun the ring of a
    # fleet (over HDR_FEED_SLOTS targets) every round and make every indexed picker rebuild.
    cands = np.arange(100)
    p = picker(table, cands)
    at = int(table.header[HDR_FEED_AT])
    for t in range(100):
        table.set_healthy(t, True)  # already healthy
    assert int(table.header[HDR_FEED_AT]) == at
    table.set_healthy(5, False)  # a change is still posted, and the index follows it
    assert int(table.header[HDR_FEED_AT]) == at + 1
    assert p.indexed_ties() == ties(table, cands) and 5 not in p.indexed_ties()
