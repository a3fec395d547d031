"""The table header's feed is on while some picker keeps an index, and only then (issue #52).

``HDR_FEED_ON`` counts the load and coordinated indexes the pickers of every process keep: a
picker takes a use when it builds one and gives it back when it drops it (new candidates, alone
again, garbage collected), and a dead proxy process's uses are given back with its leases from
its own ledger.  Writers publish changed rows while the count is above zero.  These tests run
the real writers on a real shared-memory table, and real processes for the dead-process case."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastroute.control.leases import reclaim
from fastroute.core import _ledger, _policy
from fastroute.core import reference as R
from fastroute.core.table import (
    COL_ORDER_KEY,
    COL_OTHERS_EST,
    COL_OTHERS_IN_FLIGHT,
    HDR_FEED_AT,
    HDR_FEED_ON,
    TargetTable,
)

REPO = Path(__file__).resolve().parents[2]
ROWS = 200


def make_table() -> TargetTable:
    tab = TargetTable(256)
    for t in range(ROWS):
        tab.alloc()
        tab.cells.store(t, COL_ORDER_KEY, (t * 7919) % 503)
    return tab


def lr(tab: TargetTable, cands, seed: int = 1) -> _ledger.Picker:
    p = _ledger.Picker(tab.array, tab.header, "power_of_two", "least_requests", seed=seed)
    p.set_candidates(np.asarray(cands, dtype=np.int64))
    return p


def published(tab: TargetTable) -> int:
    return int(tab.header[HDR_FEED_AT])


def test_writers_stop_publishing_after_the_last_index_is_gone_and_resume_with_the_next():
    tab = make_table()
    try:
        a = lr(tab, range(100))
        b = _ledger.Picker(tab.array, tab.header, "random", demand=2, weight=2, seed=2)
        b.set_candidates(np.arange(50, 180))
        assert tab.feed_uses == 2 and a.feed_uses == b.feed_uses == 1
        at = published(tab)
        _ledger.book(tab.array, tab.header, 7, 10).release()
        assert published(tab) == at + 2  # book and release both posted
        a.set_candidates(np.arange(10))  # too few to index: its use is given back
        assert tab.feed_uses == 1 and a.feed_uses == 0
        del b
        gc.collect()
        assert tab.feed_uses == 0
        at = published(tab)
        lease = _ledger.book(tab.array, tab.header, 7, 10)
        tab.set_healthy(8, False)
        tab.set_polled(9, 1, 0, 100, 1000)
        tab.cells.add(11, COL_OTHERS_EST, 1)
        assert published(tab) == at  # no index anywhere: nothing posted
        c = lr(tab, range(ROWS))  # a new index reads the rows, and the feed from then on
        assert tab.feed_uses == 1
        assert c.indexed_ties() == R.index_ties(tab.snapshot(), range(ROWS), "least_requests")
        lease.release()
        assert published(tab) == at + 1
        assert c.indexed_ties() == R.index_ties(tab.snapshot(), range(ROWS), "least_requests")
    finally:
        tab.close()
        tab.unlink()


def test_a_coordinated_index_is_dropped_when_the_replica_is_alone_again():
    tab = make_table()
    try:
        p = lr(tab, range(120))
        tab.cells.store(5, COL_OTHERS_IN_FLIGHT, 1)  # a peer is busy
        tab.set_replicas(4, 1)
        p.acquire(1).release()
        assert p.coordinated_indexed and p.feed_uses == 2 and tab.feed_uses == 2
        tab.set_replicas(0, 0)
        p.acquire(1).release()
        assert not p.coordinated_indexed and p.feed_uses == 1 and tab.feed_uses == 1
        p.set_candidates(np.arange(5))
        assert tab.feed_uses == 0
    finally:
        tab.close()
        tab.unlink()


def pick_all(pickers: list[_ledger.Picker]) -> None:
    for p in pickers:
        p.pick(3)


def check(tab: TargetTable, pickers: list[_ledger.Picker], cands: list[np.ndarray], t: int) -> None:
    # the count is exactly the indexes kept
    assert tab.feed_uses == sum(p.feed_uses for p in pickers)
    assert all(p.feed_uses == (p.indexed is not None) + p.coordinated_indexed for p in pickers)
    # with none kept a write posts nothing
    if tab.feed_uses == 0:
        at = published(tab)
        tab.cells.add(t, COL_OTHERS_EST, 1)
        tab.cells.add(t, COL_OTHERS_EST, -1)
        assert published(tab) == at
    # every index kept agrees with a scan of the table as it is
    snap = tab.snapshot()
    for p, c in zip(pickers, cands):
        if p.indexed is not None:
            assert p.indexed_ties() == R.index_ties(snap, c, "least_requests")
        if p.coordinated_indexed:
            assert p.coordinated_plan(3, 3, 4, 1, True) == _policy.coordinated(
                snap, c, 3, 3, False, 0, False, 4, 1, True
            )


OPS = st.lists(
    st.tuples(
        st.sampled_from(["new", "drop", "shrink", "grow", "sync", "alone", "book", "release", "others", "health"]),
        st.integers(0, 10_000),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_the_count_is_the_indexes_kept_and_no_index_is_ever_stale(ops):
    tab = make_table()
    pickers: list[_ledger.Picker] = []
    cands: list[np.ndarray] = []
    leases = []
    try:
        for op, a in ops:
            t = a % ROWS
            if op == "new":
                c = np.arange(a % 50, a % 50 + 60 + a % 90)
                pickers.append(lr(tab, c, seed=a))
                cands.append(c)
            elif op == "drop" and pickers:
                i = a % len(pickers)
                del pickers[i], cands[i]
                gc.collect()
            elif op in ("shrink", "grow") and pickers:
                i = a % len(pickers)
                cands[i] = np.arange(0, 20 if op == "shrink" else 64 + a % 100)
                pickers[i].set_candidates(cands[i])
            elif op == "sync":
                tab.set_replicas(2 + a % 6, a % 2)
                pick_all(pickers)  # a synced pick builds the coordinated index
            elif op == "alone":
                tab.set_replicas(0, 0)
                pick_all(pickers)  # ... and a pick alone drops it
            elif op == "book":
                leases.append(_ledger.book(tab.array, tab.header, t, a % 300))
            elif op == "release" and leases:
                leases.pop(a % len(leases)).release()
            elif op == "others":
                tab.cells.store(t, COL_OTHERS_IN_FLIGHT, a % 3)
            elif op == "health":
                tab.set_healthy(t, a % 4 != 0)
            check(tab, pickers, cands, t)
    finally:
        for lease in leases:
            lease.release()
        del pickers
        gc.collect()
        assert int(tab.header[HDR_FEED_ON]) == 0  # every picker gone: every use given back
        tab.close()
        tab.unlink()


def _proxy(table_name: str, ledger_name: str, ready) -> None:
    """A proxy process's pickers: tracked in its own ledger, then killed with them alive."""
    from fastroute.core.routing import Router

    tab = TargetTable.attach(table_name)
    ledger = TargetTable.attach(ledger_name)
    g = Router(tab, seed=3).group(list(range(100)), "power_of_two", load_metric="least_requests")
    g.track_in(ledger)
    g2 = Router(tab, seed=4).group(list(range(150)), "power_of_two", load_metric="least_requests")
    g2.track_in(ledger)
    lease = g.acquire(5)
    ready.put((g.kernel.feed_uses + g2.kernel.feed_uses, lease.target))
    signal.pause()


def test_a_dead_proxy_process_s_uses_are_given_back_with_its_leases():
    tab = make_table()
    ledger = TargetTable(256)
    ctx = mp.get_context("spawn")
    ready = ctx.Queue()
    proc = ctx.Process(target=_proxy, args=(tab.name, ledger.name, ready))
    try:
        mine = lr(tab, range(ROWS))  # this process keeps an index of its own
        proc.start()
        uses, target = ready.get(timeout=60)
        assert uses == 2 and tab.feed_uses == 3 and ledger.feed_uses == 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(timeout=30)
        assert reclaim(tab, ledger) == (1, 5)
        assert tab.feed_uses == 1 and ledger.feed_uses == 0 and tab.in_flight(target) == 0
        assert mine.indexed_ties() == R.index_ties(tab.snapshot(), range(ROWS), "least_requests")
        del mine
        gc.collect()
        assert tab.feed_uses == 0
    finally:
        if proc.is_alive():
            proc.kill()
        for t in (tab, ledger):
            t.close()
            t.unlink()


_HOLDERS = {
    "picker": (
        "from fastroute.core import _ledger\n"
        "p = _ledger.Picker(tab.array, tab.header, 'power_of_two', 'least_requests', seed=1)\n"
        "p.set_candidates(np.arange(100))\n"
        "assert p.feed_uses == 1\n"
    ),
    "tree": (
        "from fastroute.core import _tree\n"
        "p = _tree.PrefixTree(tab.array, seed=1, header=tab.header)\n"
        "cands = list(range(100))\n"  # indexed from the same list's second pick
        "p.pick('x', cands)\n"
        "p.pick('x', cands)\n"
        "assert p.indexed and tab.feed_uses == 1\n"
    ),
}


@pytest.mark.parametrize("holder", sorted(_HOLDERS))
def test_an_index_that_outlives_its_table_s_mapping_leaves_without_a_crash(holder: str) -> None:
    """A table closed (unmapped) while a picker or a cache_aware tree with an index still holds
    it: giving back its feed use must not write into the unmapped segment (a crash at
    collection)."""
    script = (
        "import gc, numpy as np\n"
        "from fastroute.core.table import TargetTable\n"
        "tab = TargetTable(128)\n"
        "[tab.alloc() for _ in range(100)]\n" + _HOLDERS[holder] + "tab.close()\n"
        "tab.unlink()\n"
        "del p\n"
        "gc.collect()\n"
        "print('left')\n"
    )
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "left", out


def test_cache_aware_trees_hold_uses_of_their_own():
    """A PrefixTree's load index (and its free-KV index) counts in HDR_FEED_ON like a picker's:
    a tree indexing its candidates keeps writers publishing after every picker's index is gone,
    and gives its uses back with new candidates and when collected."""
    from fastroute.core import _tree

    tab = make_table()
    try:
        p = lr(tab, range(100))
        tree = _tree.PrefixTree(tab.array, seed=3, header=tab.header)
        cands = list(range(ROWS))
        for _ in range(2):  # indexed from the list's second pick
            tree.pick("x", cands)
        assert tree.indexed and tab.feed_uses == 2
        p.set_candidates(np.arange(10))  # the picker's index is gone; the tree's is not
        assert tab.feed_uses == 1
        at = published(tab)
        tab.set_healthy(5, False)
        assert published(tab) == at + 1  # still posted: the tree reads it
        tree.pick("y", cands)
        assert 5 not in tree.choices("y", cands, scan=False)
        tree.pick("z", cands[:10])  # too few to index: its use is given back
        assert not tree.indexed and tab.feed_uses == 0
        for _ in range(2):
            tree.pick("x", cands)
        assert tab.feed_uses == 1
        del tree
        gc.collect()
        assert tab.feed_uses == 0
    finally:
        tab.close()
        tab.unlink()
