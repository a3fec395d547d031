"""KV-fit decode placement: free-KV accounting between polls, filtering, fallback, shadow."""

from __future__ import annotations

import numpy as np
import pytest

from fastroute.core import _policy
from fastroute.core import reference as R
from fastroute.core.routing import Router
from fastroute.core.table import (
    COL_HEALTHY,
    COL_IN_FLIGHT,
    COL_IN_FLIGHT_TOKENS,
    COL_POLLED_AT,
    COL_POLLED_KV_QUEUE,
    COL_POLLED_MAX_TOKENS,
    COL_POLLED_TOKENS,
    COL_POLLED_UNCACHED,
    COL_TOKENS_AT_POLL,
    NCOLS,
    TargetTable,
)


@pytest.fixture
def tt():
    tab = TargetTable(16)
    ids = [tab.alloc() for _ in range(4)]
    yield tab, ids
    tab.unlink()


def test_free_kv_follows_bookings_between_polls(tt):
    tab, ids = tt
    t = ids[0]
    assert _policy.free_kv(tab.array, t) is None  # never polled: unknown, not empty
    tab.set_polled(t, 2, 0, 30_000, 100_000)  # engine: 30k used of 100k
    assert _policy.free_kv(tab.array, t) == 70_000
    g = Router(tab, seed=1).group([t], "round_robin")
    lease = g.acquire(20_000)  # booked after the poll
    assert _policy.free_kv(tab.array, t) == 50_000
    tab.set_polled(t, 3, 0, 50_000, 100_000)  # the next poll sees it allocated
    assert _policy.free_kv(tab.array, t) == 50_000  # ...and it is not counted twice
    lease.release()  # finished: its KV is freed
    assert _policy.free_kv(tab.array, t) == 70_000
    tab.set_polled(t, 2, 0, 30_000, 100_000)
    assert _policy.free_kv(tab.array, t) == 70_000
    tab.mark_unpolled(t)
    assert _policy.free_kv(tab.array, t) is None


def test_requests_not_yet_allocated_still_count(tt):
    # Engine reports little used (requests still in prefill / prealloc), router knows better.
    tab, ids = tt
    t = ids[0]
    g = Router(tab, seed=1).group([t], "round_robin")
    leases = [g.acquire(30_000) for _ in range(3)]
    tab.set_polled(t, 0, 3, 1_000, 100_000)
    assert _policy.free_kv(tab.array, t) == 10_000
    for lease in leases:
        lease.release()


def test_full_rank_is_skipped_and_least_requests_applies_among_the_rest(tt):
    tab, ids = tt
    for t, used in zip(ids, [95_000, 10_000, 20_000, 30_000]):
        tab.set_polled(t, 1, 0, used, 100_000)
    g = Router(tab, seed=2).group(ids, "power_of_two", load_metric="least_requests", kv_fit="on")
    # rank 0 has the fewest requests but no room for 10k tokens
    hold = [g.book_target(t, 0) for t in ids[1:] for _ in range(2)]
    assert g.pick(10_000) in ids[1:]
    # among ranks that fit, least requests: book one more on ids[1]; ids[2] and ids[3] tie on
    # requests and the tie goes to more free KV (ids[2]: 80k free, ids[3]: 70k)
    hold.append(g.book_target(ids[1], 0))
    assert {g.pick(10_000) for _ in range(40)} == {ids[2]}
    tab.set_polled(ids[3], 1, 0, 20_000, 100_000)  # now an exact tie: random
    assert {g.pick(10_000) for _ in range(60)} == {ids[2], ids[3]}
    for lease in hold:
        lease.release()


def test_no_rank_fits_falls_back_to_most_headroom(tt):
    tab, ids = tt
    for t, used in zip(ids, [99_000, 97_000, 98_000, 99_500]):
        tab.set_polled(t, 1, 0, used, 100_000)
    g = Router(tab, seed=3).group(ids, "power_of_two", load_metric="least_requests", kv_fit="on")
    assert {g.pick(10_000) for _ in range(20)} == {ids[1]}


def test_output_reserve_counts_toward_the_fit(tt):
    tab, ids = tt
    tab.set_polled(ids[0], 0, 0, 0, 100_000)  # 100k free, 0 requests
    tab.set_polled(ids[1], 0, 0, 0, 20_000)  # 20k free
    r = Router(tab, seed=4)
    g = r.group(ids[:2], "power_of_two", load_metric="least_requests", kv_fit="on", kv_reserve=5_000)
    lease = g.book_target(ids[0], 0)  # ids[0] now holds a request
    assert g.pick(10_000, None, 0) == ids[1]  # 10k + 5k reserve fits in 20k
    assert g.pick(10_000, None, 8_000) == ids[0]  # + 8k output no longer fits ids[1]
    lease.release()


def test_unpolled_everywhere_uses_the_usual_policy(tt):
    tab, ids = tt
    g = Router(tab, seed=5).group(ids, "power_of_two", load_metric="least_requests", kv_fit="on")
    picks = {g.pick(1000) for _ in range(100)}
    assert picks == set(ids)
    assert g.kv_counts["fallback"] == 100


def test_shadow_dispatches_the_usual_pick_and_counts(tt):
    tab, ids = tt
    for t, used in zip(ids, [99_000, 10_000, 10_000, 10_000]):
        tab.set_polled(t, 1, 0, used, 100_000)
    r = Router(tab, seed=6)
    shadow = r.group(ids, "round_robin", kv_fit="shadow")
    plain = Router(tab, seed=6).group(ids, "round_robin")
    assert [shadow.pick(5_000) for _ in range(8)] == [plain.pick(5_000) for _ in range(8)]
    c = shadow.kv_counts
    # round robin lands on the full rank ids[0] twice in 8 picks: those are the disagreements
    assert (c["agree"], c["disagree"]) == (6, 2)


def test_kv_fit_with_demand_cost(tt):
    tab, ids = tt
    for t in ids:
        tab.set_polled(t, 0, 0, 0, 100_000)
    r = Router(tab, seed=7)
    g = r.group(ids, "power_of_two", demand="on", request_weight=1_000_000, kv_fit="on")
    held = [g.acquire(1_000) for _ in range(8)]
    assert [tab.in_flight(t) for t in ids] == [2, 2, 2, 2]
    for lease in held:
        lease.release()


@pytest.mark.parametrize("seed", range(30))
def test_kv_fit_matches_reference(seed):
    rs = np.random.default_rng(seed)
    n = int(rs.integers(1, 24))
    tab = np.zeros((n, NCOLS), dtype=np.int64)
    tab[:, COL_HEALTHY] = rs.random(n) < 0.9
    tab[:, COL_POLLED_AT] = np.where(rs.random(n) < 0.8, 1, -1)
    tab[:, COL_POLLED_MAX_TOKENS] = np.where(rs.random(n) < 0.9, 100_000, -1)
    tab[:, COL_POLLED_TOKENS] = rs.integers(0, 100_000, n)
    tab[:, COL_IN_FLIGHT] = rs.integers(0, 5, n)
    tab[:, COL_IN_FLIGHT_TOKENS] = rs.integers(0, 60_000, n)
    tab[:, COL_TOKENS_AT_POLL] = rs.integers(0, 60_000, n)
    tab[:, COL_POLLED_KV_QUEUE] = np.where(rs.random(n) < 0.2, 1, 0)
    tab[:, COL_POLLED_UNCACHED] = np.where(rs.random(n) < 0.5, rs.integers(0, 50_000, n), -1)
    cands = np.arange(n, dtype=np.int64)
    s, ref = np.array([seed + 1], dtype=np.uint64), R.Rng(seed + 1)
    for step in range(200):
        need = int(rs.integers(0, 80_000))
        use_demand = bool(step % 2)
        got = _policy.kv_fit(tab, cands, need // 2, need, use_demand, 1000, s)
        want = R.kv_fit(tab, cands, need // 2, need, use_demand, 1000, ref)
        assert got == want, step
        for t in range(n):
            assert _policy.free_kv(tab, t) == R.free_kv(tab, t)
        if got >= 0:
            tab[got, COL_IN_FLIGHT] += 1
            tab[got, COL_IN_FLIGHT_TOKENS] += need // 2
