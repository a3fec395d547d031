"""The other replicas' columns (--replica-sync): every kernel that reads in-flight counts adds
them, a circuit open at another replica makes a target ineligible, KV fit counts their tokens,
and the compiled kernels still match their NumPy twins pick for pick with nonzero "others"."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from fastroute.core import _ledger, _policy
from fastroute.core import reference as R
from fastroute.core.cache_aware import CacheAwarePolicy
from fastroute.core.table import (
    COL_CIRCUIT,
    COL_HEALTHY,
    COL_IN_FLIGHT,
    COL_IN_FLIGHT_TOKENS,
    COL_OTHERS_IN_FLIGHT,
    COL_OTHERS_OPEN,
    COL_OTHERS_TOKENS,
    COL_POLLED_AT,
    COL_POLLED_MAX_TOKENS,
    COL_POLLED_TOKENS,
    COL_TOKENS_AT_POLL,
    NCOLS,
    NHDR,
    TargetTable,
)
from fastroute.names import LOAD_METRIC_CODE as METRIC


def table(n: int) -> np.ndarray:
    tab = np.zeros((n, NCOLS), dtype=np.int64)
    tab[:, COL_HEALTHY] = 1
    tab[:, COL_POLLED_AT] = -1
    return tab


def state(seed: int) -> np.ndarray:
    return np.array([seed], dtype=np.uint64)


def test_least_requests_and_p2c_add_the_others_requests():
    tab = table(2)
    tab[0, COL_IN_FLIGHT], tab[0, COL_OTHERS_IN_FLIGHT] = 0, 3  # idle here, busy elsewhere
    tab[1, COL_IN_FLIGHT] = 1
    cands = np.arange(2, dtype=np.int64)
    for metric in ("least_requests", "requests", "tokens"):
        assert {_policy.power_of_two(tab, cands, METRIC[metric], state(s)) for s in range(20)} == {1}


def test_demand_adds_the_others_tokens_and_requests():
    tab = table(2)
    tab[0, COL_OTHERS_TOKENS], tab[0, COL_OTHERS_IN_FLIGHT] = 5_000, 1
    tab[1, COL_IN_FLIGHT_TOKENS], tab[1, COL_IN_FLIGHT] = 1_000, 1
    assert _policy.demand(tab, np.arange(2, dtype=np.int64), 10, 0, state(1)) == 1
    tab[1, COL_IN_FLIGHT] = 3  # with a request weight, the others' one request counts too
    assert _policy.demand(tab, np.arange(2, dtype=np.int64), 10, 10_000, state(1)) == 0


def test_open_at_another_replica_is_not_eligible():
    tab = table(3)
    tab[0, COL_OTHERS_OPEN] = 1
    tab[1, COL_CIRCUIT] = 1
    cands = np.arange(3, dtype=np.int64)
    s = state(3)
    picks = {_policy.random_pick(tab, cands, s) for _ in range(50)}
    picks |= {_policy.power_of_two(tab, cands, m, s) for m in METRIC.values() for _ in range(20)}
    picks.add(_policy.round_robin(tab, cands, np.zeros(1, dtype=np.int64)))
    picks.add(_policy.demand(tab, cands, 1, 1, s))
    assert picks == {2}
    assert not R._row_eligible(tab, 0) and R._row_eligible(tab, 2)


def test_kv_free_counts_the_others_tokens_and_the_poll_stamps_them():
    tab = table(1)
    tab[0, COL_POLLED_MAX_TOKENS] = 100_000
    tab[0, COL_IN_FLIGHT_TOKENS], tab[0, COL_OTHERS_TOKENS] = 10_000, 30_000
    _ledger.store_polled(tab, 0, 2, 0, 50_000, 100_000, 1)
    assert tab[0, COL_TOKENS_AT_POLL] == 40_000
    assert _policy.free_kv(tab, 0) == R.free_kv(tab, 0) == 50_000
    tab[0, COL_OTHERS_TOKENS] = 50_000  # another replica booked 20k since the poll
    assert _policy.free_kv(tab, 0) == R.free_kv(tab, 0) == 30_000
    # Never credited with less than every replica's in-flight tokens:
    _ledger.store_polled(tab, 0, 0, 0, 0, 100_000, 2)
    assert _policy.free_kv(tab, 0) == R.free_kv(tab, 0) == 100_000 - 60_000


def test_kv_fit_avoids_ranks_the_others_filled():
    tab = table(2)
    tab[:, COL_POLLED_MAX_TOKENS] = 100_000
    tab[:, COL_POLLED_AT] = 1
    tab[0, COL_OTHERS_TOKENS] = 90_000
    cands = np.arange(2, dtype=np.int64)
    assert _policy.kv_fit(tab, cands, 20_000, 20_000, False, 0, state(1)) == 1


def test_cache_aware_balance_sees_the_others_requests():
    tab = TargetTable(8)
    try:
        ids = [tab.alloc() for _ in range(2)]
        cfg = SimpleNamespace(
            cache_threshold=0.3,
            balance_abs_threshold=4,
            balance_rel_threshold=1.5,
            eviction_interval_secs=60,
            max_tree_size=1 << 20,
        )
        pol = CacheAwarePolicy(tab, cfg, seed=1)
        pol.set_targets(ids, [f"http://w{i}:8000" for i in ids])
        text = "shared system prompt " * 20
        owner = pol.pick(text, ids)
        tab.cells.store(owner, COL_OTHERS_IN_FLIGHT, 50)  # busy at the other replicas
        assert pol.pick(text, ids) != owner and pol.last_reason == "balance"
        tab.cells.store(owner, COL_OTHERS_OPEN, 1)
        assert {pol.pick(text + str(i), ids) for i in range(10)} == {ids[1 - ids.index(owner)]}
    finally:
        tab.unlink()


@pytest.mark.parametrize("seed", range(30))
def test_compiled_matches_reference_with_others(seed):
    rs = np.random.default_rng(1000 + seed)
    n = int(rs.integers(1, 32))
    tab = table(n)
    tab[:, COL_HEALTHY] = rs.random(n) < 0.9
    tab[:, COL_CIRCUIT] = rs.choice([0, 0, 0, 1, 2], n)
    tab[:, COL_OTHERS_OPEN] = rs.random(n) < 0.15
    tab[:, COL_POLLED_AT] = np.where(rs.random(n) < 0.7, 1, -1)
    tab[:, COL_POLLED_MAX_TOKENS] = np.where(rs.random(n) < 0.9, 100_000, -1)
    hi = 4 if rs.random() < 0.5 else 10_000
    for col, top in (
        (COL_IN_FLIGHT, hi),
        (COL_OTHERS_IN_FLIGHT, hi),
        (COL_POLLED_TOKENS, hi * 10),
        (COL_IN_FLIGHT_TOKENS, hi * 10),
        (COL_OTHERS_TOKENS, hi * 10),
        (COL_TOKENS_AT_POLL, hi * 10),
    ):
        tab[:, col] = rs.integers(0, top, n)
    cands = np.sort(rs.choice(n, int(rs.integers(1, n + 1)), replace=False)).astype(np.int64)
    s, ref = state(seed * 31 + 7), R.Rng(seed * 31 + 7)
    for step in range(240):
        op = step % 6
        if op < 3:
            m = ("tokens", "requests", "least_requests")[op]
            got, want = (_policy.power_of_two(tab, cands, METRIC[m], s), R.power_of_two(tab, cands, m, ref))
        elif op == 3:
            w = int(rs.choice([0, 1000]))
            got, want = _policy.demand(tab, cands, 50, w, s), R.demand(tab, cands, 50, w, ref)
        else:
            need = int(rs.integers(0, 80_000))
            got = _policy.kv_fit(tab, cands, need // 2, need, op == 5, 1000, s)
            want = R.kv_fit(tab, cands, need // 2, need, op == 5, 1000, ref)
        assert got == want, (step, op)
        for t in cands:
            assert _policy.free_kv(tab, int(t)) == R.free_kv(tab, int(t))
        if got >= 0:
            tab[got, COL_IN_FLIGHT] += 1
            tab[got, COL_IN_FLIGHT_TOKENS] += 50
        if step % 17 == 0:  # a sync tick rewrites the others' view
            t = int(rs.integers(0, n))
            tab[t, COL_OTHERS_IN_FLIGHT] = rs.integers(0, hi)
            tab[t, COL_OTHERS_TOKENS] = rs.integers(0, hi * 10)
            tab[t, COL_OTHERS_OPEN] = rs.random() < 0.15


def test_a_fresh_row_has_no_others():
    tab = TargetTable(2)
    try:
        t = tab.alloc()
        for col in (COL_OTHERS_OPEN, COL_OTHERS_IN_FLIGHT, COL_OTHERS_TOKENS):
            tab.cells.store(t, col, 5)
        tab.free(t)
        t = tab.alloc()
        assert [tab.get(t, c) for c in (COL_OTHERS_OPEN, COL_OTHERS_IN_FLIGHT, COL_OTHERS_TOKENS)] == [0] * 3
        assert tab.header.shape == (NHDR,)
    finally:
        tab.unlink()


def test_the_picker_books_only_local_counts():
    """The others' counts steer the pick but a lease never touches them."""
    tab = TargetTable(4)
    try:
        ids = [tab.alloc() for _ in range(2)]
        tab.cells.store(ids[0], COL_OTHERS_IN_FLIGHT, 2)
        p = _ledger.Picker(tab.array, tab.header, "power_of_two", "least_requests", seed=3)
        p.set_candidates(ids)
        leases = [p.acquire(10) for _ in range(2)]
        # ids[0] counts 0 + 2 others: the first two picks both go to ids[1]
        assert [lease.target for lease in leases] == [ids[1], ids[1]]
        assert tab.in_flight(ids[0]) == 0 and tab.get(ids[0], COL_OTHERS_IN_FLIGHT) == 2
        assert tab.in_flight_tokens(ids[1]) == 20
        for lease in leases:
            lease.release()
        assert tab.in_flight(ids[0]) == tab.in_flight(ids[1]) == 0
    finally:
        tab.unlink()


def test_reference_helpers_are_the_sums():
    tab = table(1)
    tab[0, [COL_IN_FLIGHT, COL_OTHERS_IN_FLIGHT, COL_IN_FLIGHT_TOKENS, COL_OTHERS_TOKENS]] = [1, 2, 3, 4]
    assert R.requests(tab, 0) == 3 and R.tokens_in_flight(tab, 0) == 7
