"""The compiled reading of replica-sync lines (``_ledger.sync_decode``) takes what the Python
reference (``control.replica.decode``) takes, skips what it skips and sums the same, over random
payloads that mix good lines, out-of-range and negative counts, and garbage;
``_ledger.sync_store`` stores the capped sums over peers into the others columns of every row
of a name; and ``_ledger.sync_encode`` finds and writes this replica's changed lines as the
Python formatting (``control.syncdelta._line``) does."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastroute.control.replica import COUNT_LIMIT, decode
from fastroute.control.syncdelta import _line
from fastroute.core import _ledger
from fastroute.core.table import (
    CIRCUIT_CLOSED,
    CIRCUIT_HALF_OPEN,
    CIRCUIT_OPEN,
    COL_CIRCUIT,
    COL_IN_FLIGHT,
    COL_IN_FLIGHT_TOKENS,
    COL_OTHERS_EST,
    COL_OTHERS_IN_FLIGHT,
    COL_OTHERS_OPEN,
    COL_OTHERS_TOKENS,
    HDR_FEED_AT,
    HDR_FEED_ON,
    TargetTable,
)

NAMES = ["http://a:1@0", "http://a:1@1", "http://b:2", "x"]
COUNTS = st.one_of(
    st.integers(0, 5000),
    st.integers(-(10**19), 10**20),
    st.sampled_from([COUNT_LIMIT - 1, COUNT_LIMIT, -1, 0]),
)
FIELD = st.one_of(COUNTS.map(str), st.sampled_from(["", "z", "1.5", "--1", "+7", "-", "007"]))
LINE = st.one_of(
    st.tuples(st.sampled_from(NAMES + ["unknown", ""]), FIELD, FIELD, FIELD).map("\t".join),
    st.sampled_from(["", "garbage", "a\tb", "n\t1\t2\t3\t4"]),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(LINE, max_size=12), st.booleans())
def test_compiled_decode_agrees_with_the_reference(lines, trailing):
    payload = ("\n".join(lines) + ("\n" if trailing and lines else "")).encode()
    want: dict[str, list[int]] = {}
    want_counts = decode(payload, want)
    index = _ledger.NameIndex(n.encode() for n in NAMES)
    vals = np.zeros((len(NAMES), 2, 3), np.int64)
    into = vals[:, 1]
    mark = np.zeros(len(NAMES), np.uint8)
    touched: list[int] = []
    got_counts = _ledger.sync_decode(payload, index, vals, 1, mark, touched, True, COUNT_LIMIT)
    assert got_counts == want_counts
    got = {NAMES[i]: into[i].tolist() for i in touched}
    assert got == {n: v for n, v in want.items() if n in NAMES}
    assert sorted(touched) == sorted(set(touched)) and all(mark[i] for i in touched)


def test_compiled_store_caps_sums_over_peers_and_writes_every_row_of_a_name():
    tab = TargetTable(8)
    try:
        rows = [tab.alloc() for _ in range(3)]
        tab.header[HDR_FEED_ON] = 1  # a picker keeps a load index: writers publish changed rows
        start = int(tab.header[HDR_FEED_AT])
        assert start == 0
        vals = np.zeros((2, 3, 3), np.int64)  # name x peer slot x (requests, tokens, open)
        vals[0, 0] = (COUNT_LIMIT - 1, 5, 0)
        vals[0, 1] = (COUNT_LIMIT - 1, 7, 1)
        vals[0, 2] = (COUNT_LIMIT - 1, 9, 0)
        vals[1, 0] = (2, 20, 0)
        # name 0 has rows 0 and 2 (a removed worker's row still draining), name 1 row 1
        starts = np.array([0, 2, 3], np.int64)
        by_name = np.array([rows[0], rows[2], rows[1]], np.int64)
        _ledger.sync_store(
            tab.array,
            tab.header,
            vals,
            np.array([0, 1, 2], np.int64),
            np.array([0, 1], np.int64),
            starts,
            by_name,
            COUNT_LIMIT,
        )
        cols = (COL_OTHERS_IN_FLIGHT, COL_OTHERS_TOKENS, COL_OTHERS_OPEN)
        assert tab.header[HDR_FEED_AT] == 3  # every row that changed told the load indexes
        assert [[tab.get(t, c) for c in cols] for t in rows] == [
            [COUNT_LIMIT - 1, 21, 1],
            [2, 20, 0],
            [COUNT_LIMIT - 1, 21, 1],
        ]
        # a slot no longer read (a peer gone) leaves the sums
        _ledger.sync_store(
            tab.array, tab.header, vals, np.array([0], np.int64), np.array([0], np.int64), starts, by_name, COUNT_LIMIT
        )
        assert [tab.get(rows[0], c) for c in cols] == [COUNT_LIMIT - 1, 5, 0]
        assert tab.header[HDR_FEED_AT] == 5  # name 0's two rows; name 1 was not stored
    finally:
        tab.close()
        tab.unlink()


def test_compiled_decode_takes_digits_only():
    """What a replica writes is digits with an optional sign: Python's int() extras (spaces,
    underscores) are skipped as malformed lines."""
    vals = np.zeros((1, 1, 3), np.int64)
    got = _ledger.sync_decode(
        b"x\t 1\t0\t0\nx\t1_0\t0\t0\nx\t3\t4\t-2\n",
        _ledger.NameIndex([b"x"]),
        vals,
        0,
        np.zeros(1, np.uint8),
        [],
        True,
        COUNT_LIMIT,
    )
    assert got == (1, 2) and vals[:, 0].tolist() == [[3, 4, 1]]


INT64 = st.one_of(st.integers(-5, 5000), st.integers(-(2**63), 2**63 - 1), st.sampled_from([-(2**63), 2**63 - 1]))
ROW = st.tuples(
    st.text(max_size=12),  # a name (any UTF-8)
    INT64,  # requests
    INT64,  # tokens
    st.sampled_from([CIRCUIT_CLOSED, CIRCUIT_OPEN, CIRCUIT_HALF_OPEN]),
    st.integers(0, 3),  # the others' estimate
    st.booleans(),  # seen holds the current values
    st.tuples(st.integers(-3, 3), st.integers(-3, 3), st.integers(0, 1)),  # else these
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ROW, max_size=10, unique_by=lambda r: r[0]), st.booleans(), st.randoms(use_true_random=False))
def test_compiled_encode_agrees_with_the_reference(rows, every, rnd):
    tab = TargetTable(16)
    try:
        at = [tab.alloc() for _ in range(16)]
        rnd.shuffle(at)  # name i's row is any row
        at = at[: len(rows)]
        seen = np.zeros((len(rows), 3), np.int64)
        for i, (_, r, k, circuit, est, same, other) in enumerate(rows):
            t = at[i]
            for col, v in (
                (COL_IN_FLIGHT, r),
                (COL_IN_FLIGHT_TOKENS, k),
                (COL_CIRCUIT, circuit),
                (COL_OTHERS_EST, est),
            ):
                tab.cells.store(t, col, v)
            seen[i] = (r, k, int(circuit == CIRCUIT_OPEN)) if same else other
        # the reference: Python over the same rows
        want_seen, want_lines, want_held = seen.copy(), [], []
        for i, (name, r, k, circuit, est, _, _) in enumerate(rows):
            cur = [r, k, int(circuit == CIRCUIT_OPEN)]
            changed = cur != want_seen[i].tolist()
            want_seen[i] = cur
            if est:
                want_held.append(at[i])
            if any(cur) if every else changed:
                want_lines.append(_line(name, cur))
        utf8 = [n.encode() for n, *_ in rows]
        offsets = np.zeros(len(rows) + 1, np.int64)
        offsets[1:] = np.cumsum([len(b) for b in utf8])
        args = (tab.array, np.array(at, np.int64), seen, [], b"".join(utf8), offsets)
        if rows:
            short = np.zeros(int(offsets[-1]) + 64 * len(rows) - 1, np.uint8)
            before = seen.copy()
            assert _ledger.sync_encode(*args, short, every) is None
            assert (seen == before).all() and args[3] == []  # nothing done with a short buffer
        out = np.zeros(int(offsets[-1]) + 64 * len(rows), np.uint8)
        got = _ledger.sync_encode(*args, out, every)
        assert got == "".join(want_lines).encode()
        assert seen.tolist() == want_seen.tolist()
        assert args[3] == want_held
    finally:
        tab.close()
        tab.unlink()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=6), max_size=40, unique=True), st.lists(st.binary(max_size=6), max_size=20))
def test_name_index_finds_what_a_dict_finds(names, probes):
    """The compiled name table (hashes checked against the bytes, linear probing) answers as a
    dict of the same names, for names that are prefixes of each other, empty, or absent."""
    index = _ledger.NameIndex(names)
    want = {n: i for i, n in enumerate(names)}
    assert len(index) == len(names) and index.utf8 == b"".join(names)
    for p in names + probes:
        assert index.find(p) == want.get(p)
    if names:
        with pytest.raises(ValueError):
            _ledger.NameIndex([*names, names[0]])
