"""The compiled reading of replica-sync lines (``_ledger.sync_decode``) takes what the Python
reference (``control.replica.decode``) takes, skips what it skips and sums the same, over random
payloads that mix good lines, out-of-range and negative counts, and garbage; and
``_ledger.sync_store`` stores the capped sums over peers into the others columns of every row
of a name."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastroute.control.replica import COUNT_LIMIT, decode
from fastroute.core import _ledger
from fastroute.core.table import (
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
    index = {n.encode(): i for i, n in enumerate(NAMES)}
    vals = np.zeros((2, len(NAMES), 3), np.int64)
    into = vals[1]
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
        vals = np.zeros((3, 2, 3), np.int64)
        vals[0, 0] = (COUNT_LIMIT - 1, 5, 0)
        vals[1, 0] = (COUNT_LIMIT - 1, 7, 1)
        vals[2, 0] = (COUNT_LIMIT - 1, 9, 0)
        vals[0, 1] = (2, 20, 0)
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
        b"x\t 1\t0\t0\nx\t1_0\t0\t0\nx\t3\t4\t-2\n", {b"x": 0}, vals, 0, np.zeros(1, np.uint8), [], True, COUNT_LIMIT
    )
    assert got == (1, 2) and vals[0].tolist() == [[3, 4, 1]]
