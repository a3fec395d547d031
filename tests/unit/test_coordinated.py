"""Synced replicas' coordinated pick (``_policy.pick_coordinated`` and the Picker around it):
the compiled kernel against its twin, the placements of a burst spread over replicas that see
the same view, and the estimates the Picker books for the others."""

from __future__ import annotations

import numpy as np
import pytest

from fastroute.core import _ledger, _policy
from fastroute.core import reference as R
from fastroute.core.routing import Router
from fastroute.core.table import (
    COL_HEALTHY,
    COL_IN_FLIGHT,
    COL_ORDER_KEY,
    COL_OTHERS_EST,
    COL_OTHERS_EST_TOKENS,
    COL_OTHERS_IN_FLIGHT,
    COL_POLLED_AT,
    COL_POLLED_MAX_TOKENS,
    COL_POLLED_TOKENS,
    NCOLS,
    TargetTable,
)


def table(n: int) -> np.ndarray:
    tab = np.zeros((n, NCOLS), dtype=np.int64)
    tab[:, COL_HEALTHY] = 1
    tab[:, COL_POLLED_AT] = -1
    tab[:, COL_ORDER_KEY] = np.random.default_rng(7).permutation(n) * 1000 + 5
    return tab


@pytest.mark.parametrize("seed", range(40))
def test_kernel_matches_twin(seed):
    rng = np.random.default_rng(seed)
    n_t = int(rng.integers(1, 12))
    tab = table(n_t)
    tab[:, COL_IN_FLIGHT] = rng.integers(0, 4, n_t)
    tab[:, COL_OTHERS_IN_FLIGHT] = rng.integers(0, 3, n_t)
    tab[:, COL_OTHERS_EST] = rng.integers(0, 2, n_t)
    tab[:, COL_HEALTHY] = rng.random(n_t) > 0.15
    tab[:, COL_ORDER_KEY] = rng.integers(0, 4, n_t)  # ties in the order key too
    kv = bool(rng.integers(0, 2))
    if kv:
        tab[:, COL_POLLED_AT] = np.where(rng.random(n_t) > 0.2, 1, -1)
        tab[:, COL_POLLED_MAX_TOKENS] = 10_000
        tab[:, COL_POLLED_TOKENS] = rng.integers(0, 10_000, n_t)
    cands = np.arange(n_t, dtype=np.int64)
    n = int(rng.integers(1, 6))
    slot = int(rng.integers(0, n))
    args = (
        int(rng.integers(0, 3000)),
        int(rng.integers(0, 6000)),
        bool(rng.integers(0, 2)),
        int(rng.integers(0, 5000)),
        kv,
        n,
        slot,
        bool(rng.integers(0, 2)),
    )
    assert _policy.coordinated(tab, cands, *args) == R.coordinated(tab, cands, *args)


def test_a_burst_over_three_replicas_fills_distinct_ranks():
    """Three replicas that last synced the same view (5 of 8 ranks hold a request) each take 3
    requests of a burst before the next sync. Each plans the same 3-placement rounds and takes
    its own place, so the 9 land as one router would place them: every rank at 1, then six
    distinct ranks at 2, never a rank at 3."""
    n_ranks, n_rep = 8, 3
    base = np.zeros(n_ranks, dtype=np.int64)
    base[[1, 3, 4, 6, 7]] = 1
    placed = np.zeros(n_ranks, dtype=np.int64)
    views = []
    for _slot in range(n_rep):
        tab = table(n_ranks)
        tab[:, COL_OTHERS_IN_FLIGHT] = base  # the synced view (own counts are zero here)
        views.append(tab)
    cands = np.arange(n_ranks, dtype=np.int64)
    for _k in range(3):
        for slot, tab in enumerate(views):
            mine, seq = _policy.coordinated(tab, cands, 100, 0, False, 0, False, n_rep, slot)
            tab[mine, COL_IN_FLIGHT] += 1  # booked, live here
            for s, t in enumerate(seq):
                if s != slot:
                    tab[t, COL_OTHERS_EST] += 1  # the others' expected share
            placed[mine] += 1
    total = base + placed
    assert total.max() == 2 and total.min() == 1, total
    # what every replica believes is what happened
    for tab in views:
        seen = tab[:, COL_IN_FLIGHT] + tab[:, COL_OTHERS_IN_FLIGHT] + tab[:, COL_OTHERS_EST]
        assert (seen == total).all(), (seen, total)


def test_without_coordination_the_same_burst_piles_up():
    """The same burst through the plain least-requests kernel (what every replica did before):
    each replica's 3 requests go to the 3 ranks its view shows empty, the same 3 for all."""
    n_ranks = 8
    base = np.zeros(n_ranks, dtype=np.int64)
    base[[1, 3, 4, 6, 7]] = 1
    placed = np.zeros(n_ranks, dtype=np.int64)
    for slot in range(3):
        tab = table(n_ranks)
        tab[:, COL_OTHERS_IN_FLIGHT] = base
        st = np.array([slot + 1], dtype=np.uint64)
        for _ in range(3):
            t = _policy.power_of_two(tab, np.arange(n_ranks, dtype=np.int64), 2, st)
            tab[t, COL_IN_FLIGHT] += 1
            placed[t] += 1
    assert list(placed) == [3, 0, 3, 0, 0, 3, 0, 0]  # ranks 0, 2, 5 get all nine
    assert (base + placed).max() == 3


def test_kv_fit_is_respected_in_the_plan():
    tab = table(4)
    tab[:, COL_POLLED_AT] = 1
    tab[:, COL_POLLED_MAX_TOKENS] = 10_000
    tab[:, COL_POLLED_TOKENS] = [9_500, 0, 0, 0]  # rank 0 cannot take 1,000 more tokens
    mine, seq = _policy.coordinated(tab, np.arange(4, dtype=np.int64), 1000, 1000, False, 0, True, 4, 0)
    assert 0 not in seq[:3] and sorted(seq[:3]) == [1, 2, 3]
    assert seq[3] in (1, 2, 3)  # the plan's 4th also avoids the full rank


def test_picker_books_the_others_estimate_only_when_it_books():
    tt = TargetTable(8)
    try:
        for _ in range(4):
            t = tt.alloc()
            tt.set_healthy(t, True)
        g = Router(tt, seed=1).group([0, 1, 2, 3], "power_of_two", load_metric="least_requests")
        # alone: no plan, no estimate
        lease = g.acquire(50)
        assert tt.array[:4, COL_OTHERS_EST].sum() == 0
        lease.release()
        tt.set_replicas(3, 1)
        tt.array[3, COL_OTHERS_IN_FLIGHT] = 1  # a peer is busy: there is a burst to share out
        g.pick(50)  # a look without booking writes nothing
        assert tt.array[:4, COL_OTHERS_EST].sum() == 0
        lease = g.acquire(50)
        assert tt.array[:4, COL_OTHERS_EST].sum() == 2
        assert tt.array[:4, COL_OTHERS_EST_TOKENS].sum() == 100
        assert tt.array[lease.target, COL_OTHERS_EST] == 0  # its own place is its booking
        lease.release()  # a release undoes the booking only
        assert tt.array[:4, COL_IN_FLIGHT].sum() == 0 and tt.array[:4, COL_OTHERS_EST].sum() == 2
        assert g.kernel.coordinated_picks == 1
        # Peers idle, nothing in flight or estimated: this replica picks on its own.
        tt.array[:4, COL_OTHERS_IN_FLIGHT] = 0
        tt.array[:4, COL_OTHERS_EST] = 0
        tt.array[:4, COL_OTHERS_EST_TOKENS] = 0
        g.acquire(50).release()
        assert tt.array[:4, COL_OTHERS_EST].sum() == 0 and g.kernel.coordinated_picks == 1
    finally:
        tt.close()
        tt.unlink()


@pytest.fixture
def synced():
    """Four healthy ranks in a shared order, a least_requests group over them, and this
    replica at slot 2 of 3 synced ones."""
    tt = TargetTable(8)
    for _ in range(4):
        tt.set_healthy(tt.alloc(), True)
    tt.array[:4, COL_ORDER_KEY] = [10, 20, 30, 40]
    g = Router(tt, seed=1).group([0, 1, 2, 3], "power_of_two", load_metric="least_requests")
    tt.set_replicas(3, 2)
    yield tt, g
    tt.close()
    tt.unlink()


def test_later_picks_between_two_syncs_keep_their_exact_place(synced):
    """The first pick after a sync stays on the least-loaded level (slot modulo the ties); a
    second pick on the same view is part of a burst and takes its exact place in the plan; the
    next sync tick makes the next pick a first one again."""
    tt, g = synced
    arr = tt.array
    arr[1:4, COL_OTHERS_IN_FLIGHT] = 1  # rank 0 alone is empty
    cands = np.arange(4, dtype=np.int64)
    tt.count_sync_tick()
    first = g.acquire(10)
    assert first.target == 0  # 2 % 1 tie: the one empty rank
    loose = R.coordinated(arr, cands, 10, 0, False, 0, False, 3, 2)[0]
    exact = R.coordinated(arr, cands, 10, 0, False, 0, False, 3, 2, True)[0]
    assert loose != exact
    second = g.acquire(10)
    assert second.target == exact
    tt.count_sync_tick()
    loose = R.coordinated(arr, cands, 10, 0, False, 0, False, 3, 2)[0]
    third = g.acquire(10)
    assert third.target == loose
    for lease in (first, second, third):
        lease.release()


def test_a_replica_whose_picks_come_in_bursts_keeps_its_place_from_the_first(synced):
    """After picks that came two per view (a bursty client spread over the replicas), the first
    pick after a sync is taken as part of a burst too: its exact place, not the least-loaded."""
    tt, g = synced
    arr = tt.array
    for _ in range(40):
        tt.count_sync_tick()
        for lease in (g.acquire(10), g.acquire(10)):
            lease.release()
    arr[:4, COL_OTHERS_EST] = 0
    arr[:4, COL_OTHERS_EST_TOKENS] = 0
    arr[1:4, COL_OTHERS_IN_FLIGHT] = 1  # rank 0 alone is empty
    cands = np.arange(4, dtype=np.int64)
    exact = R.coordinated(arr, cands, 10, 0, False, 0, False, 3, 2, True)[0]
    assert exact != 0
    tt.count_sync_tick()
    first = g.acquire(10)
    assert first.target == exact
    first.release()


def test_a_lone_pick_books_the_others_requests_but_not_their_tokens(synced):
    """The first pick after a sync, from a replica whose traffic is not bursty, books the others'
    places as requests only (phantom input tokens would hide free KV from KV fit); a second pick
    on the same view is a burst, and books their tokens as well."""
    tt, g = synced
    arr = tt.array
    arr[3, COL_OTHERS_IN_FLIGHT] = 1  # a peer is busy (an idle view is not planned)
    tt.count_sync_tick()
    first = g.acquire(1000)
    assert arr[:4, COL_OTHERS_EST].sum() == 2 and arr[:4, COL_OTHERS_EST_TOKENS].sum() == 0
    second = g.acquire(1000)
    assert arr[:4, COL_OTHERS_EST].sum() == 4 and arr[:4, COL_OTHERS_EST_TOKENS].sum() == 2000
    for lease in (first, second):
        lease.release()


def test_p2c_on_tokens_is_not_coordinated():
    tt = TargetTable(4)
    try:
        for _ in range(4):
            tt.set_healthy(tt.alloc(), True)
        tt.set_replicas(3, 0)
        g = Router(tt, seed=1).group([0, 1, 2, 3], "power_of_two", load_metric="tokens")
        g.acquire(10).release()
        assert tt.array[:4, COL_OTHERS_EST].sum() == 0 and g.kernel.coordinated_picks == 0
    finally:
        tt.close()
        tt.unlink()


def test_python_entry_point_checks_its_arguments():
    tab = table(2)
    with pytest.raises(ValueError):
        _policy.coordinated(tab, np.arange(2, dtype=np.int64), 0, 0, False, 0, False, 2, 2)
    with pytest.raises(IndexError):
        _policy.coordinated(tab, np.array([5], dtype=np.int64), 0, 0, False, 0, False, 1, 0)
    assert _ledger is not None


def test_default_decode_leg_plans_with_the_replicas_and_still_learns_the_text():
    """cache_aware with rank slack 0 (the PD decode leg's default under --dp-aware): alone, the
    tree picks among the least-loaded ranks; with synced replicas the compiled picker plans the
    burst with them, and the tree learns the prompt under the rank that got it."""
    from tests.stubs import StubMeta

    tt = TargetTable(8)
    try:
        for _ in range(4):
            tt.set_healthy(tt.alloc(), True)
        g = Router(tt, seed=2).group(
            [0, 1, 2, 3], "cache_aware", rank_slack=0, names=[f"http://d:1@{i}" for i in range(4)]
        )
        text = "a shared system prompt " * 10
        lease = g.acquire(20, None, StubMeta(text))
        assert tt.array[:4, COL_OTHERS_EST].sum() == 0 and g.kernel.coordinated_picks == 0
        lease.release()
        tt.set_replicas(2, 0)
        tt.array[3, COL_OTHERS_IN_FLIGHT] = 1  # the peer is busy
        lease = g.acquire(20, None, StubMeta(text + "turn 2"))
        assert g.kernel.coordinated_picks == 1 and tt.array[:4, COL_OTHERS_EST].sum() == 1
        lease.release()
        assert g.policy_impl.tree_policy.tree.match(text + "turn 2", [0, 1, 2, 3]) == (len(text) + 6, [lease.target])
    finally:
        tt.close()
        tt.unlink()
