"""Target table layout, lifetime and ledger semantics (single process)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from fastroute import names
from fastroute.core import _ledger, _policy
from fastroute.core import table as T
from fastroute.core.table import TargetTable


@pytest.fixture
def tab():
    t = TargetTable(16)
    yield t
    t.unlink()
    t.close()


CORE = Path(T.__file__).parent
LAYOUT_NAME = re.compile(r"^(COL_\w+|HDR_\w+|NCOLS|NHDR)$")


def pxd_enums(name: str) -> dict[str, int]:
    """``NAME = value`` members of the cdef enums in a core .pxd file, read from the source."""
    text = (CORE / name).read_text()
    return {m[1]: int(m[2]) for m in re.finditer(r"^\s+([A-Z][A-Z0-9_]*) = (\d+)\b", text, re.M)}


def test_python_layout_mirrors_compiled_layout():
    compiled = _policy.layout()
    for name, value in compiled.items():
        if LAYOUT_NAME.match(name):
            assert getattr(T, name) == value, name


def test_every_layout_constant_is_mirrored_both_ways():
    source = pxd_enums("_layout.pxd")
    compiled = _policy.layout()
    python = {k: v for k, v in vars(T).items() if LAYOUT_NAME.match(k)}
    # The .pxd source, the compiled export and table.py hold the same names with the same values:
    # a constant added on one side only, or a renumbered one, fails here.
    assert {k: v for k, v in source.items() if LAYOUT_NAME.match(k)} == python
    assert {k: v for k, v in compiled.items() if LAYOUT_NAME.match(k)} == python
    assert len(python) == 38
    # Every enum member of _layout.pxd and _policy.pxd is exported (none forgotten in layout()).
    assert set(source) | set(pxd_enums("_policy.pxd")) == set(compiled)
    assert {k: v for k, v in compiled.items() if not LAYOUT_NAME.match(k)} == {
        **{k: v for k, v in pxd_enums("_layout.pxd").items() if k.startswith("CIRCUIT_")},
        **pxd_enums("_policy.pxd"),
    }


def test_compiled_codes_match_the_shared_names():
    compiled = _policy.layout()
    assert {k: v for k, v in compiled.items() if k.startswith("CIRCUIT_")} == {
        "CIRCUIT_CLOSED": names.CIRCUIT_CLOSED,
        "CIRCUIT_OPEN": names.CIRCUIT_OPEN,
        "CIRCUIT_HALF_OPEN": names.CIRCUIT_HALF_OPEN,
    }
    assert (T.CIRCUIT_CLOSED, T.CIRCUIT_OPEN, T.CIRCUIT_HALF_OPEN) == (0, 1, 2)
    assert {
        k[len("METRIC_") :].lower(): v for k, v in compiled.items() if k.startswith("METRIC_")
    } == names.LOAD_METRIC_CODE
    assert {k[len("MODE_") :].lower(): v for k, v in compiled.items() if k.startswith("MODE_")} == names.MODE_CODE


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
    assert tab.in_flight(t) == 0  # never negative
    assert tab.underflows == 1  # and the bug is visible


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


# ---- index checks at the Python boundary (the compiled loops run without bounds checks) ---------


def test_cells_reject_rows_and_columns_outside_the_view():
    big = np.zeros((4, T.NCOLS), dtype=np.int64)
    big[3, 0] = 42
    cells = _ledger.Cells(big[:2])
    assert (cells.rows, cells.cols) == (2, T.NCOLS)
    for bad in (2, 3, -1):
        with pytest.raises(IndexError):
            cells.load(bad, 0)
        with pytest.raises(IndexError):
            cells.store(bad, 0, 1)
        with pytest.raises(IndexError):
            cells.add(bad, 0, 1)
        with pytest.raises(IndexError):
            cells.cas(bad, 0, 0, 1)
        with pytest.raises(IndexError):
            cells.ok_closed(bad)
    for col in (T.NCOLS, -1, 1000):
        with pytest.raises(IndexError):
            cells.load(0, col)
        with pytest.raises(IndexError):
            cells.store(0, col, 1)
        with pytest.raises(IndexError):
            cells.add(0, col, 1)
        with pytest.raises(IndexError):
            cells.cas(0, col, 0, 1)
        with pytest.raises(IndexError):
            cells.rows_where(col, 0)
    assert big[3, 0] == 42 and not big[:2].any()  # nothing was written anywhere
    cells.store(1, T.NCOLS - 1, 7)
    assert cells.load(1, T.NCOLS - 1) == 7 and cells.add(1, T.NCOLS - 1, 1) == 8
    assert cells.cas(1, T.NCOLS - 1, 8, 9) and cells.rows_where(T.NCOLS - 1, 9) == [1]


def test_header_cells_check_the_header_width(tab):
    hcells = _ledger.Cells(tab.header.reshape(1, T.NHDR))
    assert hcells.load(0, T.HDR_CAPACITY) == 16
    with pytest.raises(IndexError):
        hcells.load(0, T.NHDR)
    with pytest.raises(IndexError):
        hcells.ok_closed(0)  # not a table row: no circuit cell


def test_store_polled_and_snapshot_check_their_ranges(tab):
    with pytest.raises(IndexError):
        _ledger.store_polled(tab.array, 16, 1, 1, 1, 1, 1)
    with pytest.raises(IndexError):
        _ledger.store_polled(tab.array, -1, 1, 1, 1, 1, 1)
    with pytest.raises(ValueError):
        _ledger.store_polled(np.zeros((4, 8), np.int64), 0, 1, 1, 1, 1, 1)
    with pytest.raises(ValueError):
        _ledger.snapshot(tab.array[:2], 3)
    with pytest.raises(ValueError):
        _ledger.snapshot(tab.array, -1)
    with pytest.raises(ValueError):
        tab.snapshot(17)
    assert _ledger.snapshot(tab.array[:2], 2).shape == (2, T.NCOLS)
    assert tab.snapshot(0).shape == (0, T.NCOLS)


def test_booking_entry_points_check_targets_and_shapes(tab):
    with pytest.raises(IndexError):
        _ledger.book(tab.array, tab.header, 16, 1)
    with pytest.raises(ValueError):
        _ledger.book(tab.array, tab.header[:2], 0, 1)
    with pytest.raises(IndexError):
        _ledger.stress_book_release(tab.array, tab.header, np.array([0, 16]), 1, 1)
    picker = _ledger.Picker(tab.array, tab.header, "consistent_hashing", seed=1)
    with pytest.raises(IndexError):
        picker.set_candidates([0, 16])
    with pytest.raises(IndexError):
        picker.set_ring(np.array([1, 2], np.uint64), np.array([0, 16]))
    with pytest.raises(ValueError):
        _ledger.Picker(tab.array, tab.header[:4], "random")
    with pytest.raises(ValueError):
        _ledger.Picker(np.zeros((4, 8), np.int64), tab.header, "random")
    assert tab.underflows == 0 and int(tab.array[:, T.COL_IN_FLIGHT].sum()) == 0
