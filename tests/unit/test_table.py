"""Target table layout, lifetime and ledger semantics (single process)."""
from __future__ import annotations

import numpy as np
import pytest

from fastroute.core import _ledger, _policy, table as T
from fastroute.core.table import TargetTable


@pytest.fixture
def tab():
    t = TargetTable(16)
    yield t
    t.unlink()
    t.close()


def test_python_layout_mirrors_compiled_layout():
    for name, value in _policy.layout().items():
        assert getattr(T, name) == value, name


def test_rows_are_cache_line_padded(tab):
    assert tab.array.strides[0] % 64 == 0
    assert tab.array.ctypes.data % 64 == 0


def test_alloc_resets_row_and_marks_never_polled(tab):
    t = tab.alloc()
    tab.cells.store(t, T.COL_IN_FLIGHT, 7)
    tab.free(t)
    t2 = tab.alloc()
    assert t2 == t
    assert tab.in_flight(t2) == 0
    assert tab.get(t2, T.COL_POLLED_AT) == -1
    assert tab.get(t2, T.COL_HEALTHY) == 1


def test_table_full_is_an_error():
    with TargetTable(2) as t:
        t.alloc(), t.alloc()
        with pytest.raises(RuntimeError, match="full"):
            t.alloc()


def test_set_polled_and_unknown(tab):
    t = tab.alloc()
    tab.set_polled(t, 3, 2, 500, 10_000)
    assert tab.get(t, T.COL_POLLED_RUNNING) == 3
    assert tab.get(t, T.COL_POLLED_WAITING) == 2
    assert tab.get(t, T.COL_POLLED_TOKENS) == 500
    assert tab.get(t, T.COL_POLLED_MAX_TOKENS) == 10_000
    assert tab.get(t, T.COL_POLLED_AT) > 0
    tab.mark_unpolled(t)
    assert tab.get(t, T.COL_POLLED_AT) == -1


def test_lease_books_and_releases_exactly_once(tab):
    t = tab.alloc()
    lease = _ledger.book(tab.array, tab.header, t, 120)
    assert (tab.in_flight(t), tab.in_flight_tokens(t), tab.get(t, T.COL_PICKS)) == (1, 120, 1)
    assert lease.release() is True
    assert lease.release() is False
    assert lease.release() is False
    assert (tab.in_flight(t), tab.in_flight_tokens(t)) == (0, 0)
    assert tab.get(t, T.COL_PICKS) == 1  # picks are a monotonic total
    assert tab.underflows == 0


def test_release_below_zero_is_counted_not_applied(tab):
    t = tab.alloc()
    lease = _ledger.book(tab.array, tab.header, t, 10)
    # Someone else (a buggy path) zeroes the counter behind the lease's back.
    tab.cells.store(t, T.COL_IN_FLIGHT, 0)
    assert lease.release() is True
    assert tab.in_flight(t) == 0          # never negative
    assert tab.underflows == 1            # and the bug is visible


def test_attach_by_name_sees_the_same_cells(tab):
    t = tab.alloc()
    other = TargetTable.attach(tab.name)
    try:
        _ledger.book(other.array, other.header, t, 5)
        assert tab.in_flight(t) == 1
        assert other.capacity == tab.capacity
    finally:
        other.close()


def test_attach_rejects_foreign_segment():
    from multiprocessing import shared_memory
    shm = shared_memory.SharedMemory(create=True, size=4096)
    try:
        with pytest.raises(ValueError, match="not a fastroute"):
            TargetTable.attach(shm.name)
    finally:
        shm.close()
        shm.unlink()


def test_snapshot_is_a_copy(tab):
    t = tab.alloc()
    snap = tab.snapshot(4)
    _ledger.book(tab.array, tab.header, t, 1)
    assert snap[t, T.COL_IN_FLIGHT] == 0
    assert isinstance(snap, np.ndarray) and snap.shape == (4, T.NCOLS)
