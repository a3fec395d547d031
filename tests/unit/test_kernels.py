"""Policy kernels: edge cases, the seeds' cases, differential tests against the NumPy twins,
and 10^5-pick simulations whose shares must match the expected ones."""

from __future__ import annotations

import numpy as np
import pytest

from fastroute.core import _policy
from fastroute.core import reference as R
from fastroute.core import table as T
from fastroute.core.routing import build_ring
from fastroute.core.table import (
    COL_CIRCUIT,
    COL_HEALTHY,
    COL_IN_FLIGHT,
    COL_IN_FLIGHT_TOKENS,
    COL_POLLED_AT,
    COL_POLLED_TOKENS,
    NCOLS,
)
from fastroute.names import LOAD_METRIC_CODE

METRIC = LOAD_METRIC_CODE


def table(n: int) -> np.ndarray:
    tab = np.zeros((n, NCOLS), dtype=np.int64)
    tab[:, COL_HEALTHY] = 1
    tab[:, COL_POLLED_AT] = -1
    return tab


def state(seed: int) -> np.ndarray:
    return np.array([seed], dtype=np.uint64)


def all_kernels(tab, cands, seed=1):
    s = state(seed)
    return {
        "round_robin": _policy.round_robin(tab, cands, np.zeros(1, dtype=np.int64)),
        "random": _policy.random_pick(tab, cands, s),
        "p2c_tokens": _policy.power_of_two(tab, cands, METRIC["tokens"], s),
        "p2c_requests": _policy.power_of_two(tab, cands, METRIC["requests"], s),
        "least_requests": _policy.power_of_two(tab, cands, METRIC["least_requests"], s),
        "demand": _policy.demand(tab, cands, 100, 1000, s),
    }


# ---- edge cases -------------------------------------------------------------------------------


def test_no_healthy_target_gives_minus_one():
    tab = table(4)
    tab[:, COL_HEALTHY] = 0
    assert set(all_kernels(tab, np.arange(4)).values()) == {-1}
    assert set(all_kernels(tab, np.zeros(0, dtype=np.int64)).values()) == {-1}


def test_open_circuit_is_not_eligible_but_half_open_is():
    tab = table(2)
    tab[0, COL_CIRCUIT] = 1
    tab[1, COL_CIRCUIT] = 2
    assert set(all_kernels(tab, np.arange(2)).values()) == {1}


def test_one_target_is_always_picked():
    tab = table(5)
    cands = np.array([3])
    assert set(all_kernels(tab, cands).values()) == {3}


def test_unhealthy_targets_are_skipped():
    tab = table(8)
    tab[::2, COL_HEALTHY] = 0
    for seed in range(50):
        for name, t in all_kernels(tab, np.arange(8), seed).items():
            assert t % 2 == 1, name


def test_wrappers_check_every_index_they_are_given():
    tab = table(4)
    s = state(1)
    bad = np.array([0, 4])
    for call in (
        lambda c: _policy.round_robin(tab, c, np.zeros(1, dtype=np.int64)),
        lambda c: _policy.random_pick(tab, c, s),
        lambda c: _policy.power_of_two(tab, c, METRIC["least_requests"], s),
        lambda c: _policy.demand(tab, c, 1, 0, s),
        lambda c: _policy.kv_fit(tab, c, 1, 1, False, 0, s),
    ):
        with pytest.raises(IndexError):
            call(bad)
        with pytest.raises(IndexError):
            call(np.array([-1]))
        assert call(np.arange(4)) in (-2, 0, 1, 2, 3)  # -2: kv_fit without known capacity
    with pytest.raises(IndexError):
        _policy.free_kv(tab, 4)
    with pytest.raises(IndexError):
        _policy.ring_lookup(tab, np.array([1, 2], np.uint64), np.array([0, 9]), 1)
    with pytest.raises(ValueError):
        _policy.ring_lookup(tab, np.array([1, 2], np.uint64), np.array([0]), 1)
    with pytest.raises(ValueError):
        _policy.round_robin(tab, np.arange(4), np.array([-3], dtype=np.int64))
    with pytest.raises(ValueError):
        _policy.round_robin(tab, np.arange(4), np.zeros(0, dtype=np.int64))
    with pytest.raises(ValueError):
        _policy.power_of_two(tab, np.arange(4), 7, s)
    with pytest.raises(ValueError):
        _policy.random_pick(np.zeros((4, 8), np.int64), np.arange(4), s)
    with pytest.raises(TypeError):
        _policy.random_pick(tab, np.arange(4), np.zeros(2, np.uint64))


def test_ring_skips_unhealthy_and_handles_empty():
    tab = table(4)
    h, o = build_ring([0, 1, 2, 3], [f"w{i}" for i in range(4)])
    assert _policy.ring_lookup(tab, np.zeros(0, np.uint64), np.zeros(0, np.int64), 5) == -1
    key = _policy.hash64(b"session-1")
    first = _policy.ring_lookup(tab, h, o, key)
    tab[first, COL_HEALTHY] = 0
    second = _policy.ring_lookup(tab, h, o, key)
    assert second not in (-1, first)
    tab[:, COL_HEALTHY] = 0
    assert _policy.ring_lookup(tab, h, o, key) == -1


def test_all_tied_least_requests_and_demand_spread_evenly():
    # Ties broken at random, never first-index: rank 0 must not win every tie.
    tab = table(8)
    s = state(7)
    for kernel in (
        lambda: _policy.power_of_two(tab, np.arange(8), METRIC["least_requests"], s),
        lambda: _policy.demand(tab, np.arange(8), 10, 0, s),
    ):
        counts = np.bincount([kernel() for _ in range(80_000)], minlength=8)
        assert np.all(np.abs(counts / 80_000 - 1 / 8) < 0.01), counts


# ---- the seeds' own cases ---------------------------------------------------------------------


def test_requests_prefers_fewer_in_flight_over_lower_token_load():
    # seed 001: requests compares in-flight requests first, polled tokens only on ties.
    tab = table(2)
    tab[:, COL_POLLED_AT] = 1
    tab[0, COL_POLLED_TOKENS], tab[0, COL_IN_FLIGHT] = 100, 5  # few tokens, many requests
    tab[1, COL_POLLED_TOKENS], tab[1, COL_IN_FLIGHT] = 50_000, 1  # many tokens, few requests
    s = state(3)
    assert {_policy.power_of_two(tab, np.arange(2), METRIC["requests"], s) for _ in range(200)} == {1}
    assert {_policy.power_of_two(tab, np.arange(2), METRIC["tokens"], s) for _ in range(200)} == {0}


def test_requests_breaks_ties_by_polled_tokens():
    tab = table(2)
    tab[:, COL_POLLED_AT] = 1
    tab[:, COL_IN_FLIGHT] = 3
    tab[0, COL_POLLED_TOKENS], tab[1, COL_POLLED_TOKENS] = 900, 100
    s = state(4)
    assert {_policy.power_of_two(tab, np.arange(2), METRIC["requests"], s) for _ in range(100)} == {1}


def test_tokens_falls_back_to_in_flight_when_unpolled_or_equal():
    tab = table(2)
    tab[0, COL_IN_FLIGHT], tab[1, COL_IN_FLIGHT] = 4, 2
    s = state(5)
    assert {_policy.power_of_two(tab, np.arange(2), METRIC["tokens"], s) for _ in range(100)} == {1}
    tab[:, COL_POLLED_AT] = 1
    tab[:, COL_POLLED_TOKENS] = 777
    assert {_policy.power_of_two(tab, np.arange(2), METRIC["tokens"], s) for _ in range(100)} == {1}


def test_least_requests_picks_global_minimum_skipping_never_polled():
    tab = table(8)
    tab[:, COL_POLLED_AT] = 1
    tab[:, COL_IN_FLIGHT] = [5, 4, 6, 3, 7, 5, 4, 6]
    tab[2, COL_IN_FLIGHT] = 0
    tab[2, COL_POLLED_AT] = -1  # the emptiest target was never polled: skipped
    s = state(6)
    picks = {_policy.power_of_two(tab, np.arange(8), METRIC["least_requests"], s) for _ in range(200)}
    assert picks == {3}
    tab[:, COL_POLLED_AT] = -1  # none polled: every healthy target competes
    picks = {_policy.power_of_two(tab, np.arange(8), METRIC["least_requests"], s) for _ in range(200)}
    assert picks == {2}


def test_least_requests_ties_by_polled_tokens_then_random():
    tab = table(4)
    tab[:, COL_POLLED_AT] = 1
    tab[:, COL_IN_FLIGHT] = 2
    tab[:, COL_POLLED_TOKENS] = [500, 100, 100, 900]
    s = state(8)
    counts = np.bincount(
        [_policy.power_of_two(tab, np.arange(4), METRIC["least_requests"], s) for _ in range(20_000)], minlength=4
    )
    assert counts[0] == counts[3] == 0
    assert abs(counts[1] / 20_000 - 0.5) < 0.02


def test_request_weight_balances_requests_held():
    # seed 000: rank 0 holds 1 long request, rank 1 holds 4 short ones.  Tokens alone prefer
    # rank 1; a large request weight prefers the rank holding fewer requests.
    tab = table(2)
    tab[0, COL_IN_FLIGHT], tab[0, COL_IN_FLIGHT_TOKENS] = 1, 40_000
    tab[1, COL_IN_FLIGHT], tab[1, COL_IN_FLIGHT_TOKENS] = 4, 8_000
    s = state(9)
    assert _policy.demand(tab, np.arange(2), 1000, 0, s) == 1
    assert _policy.demand(tab, np.arange(2), 1000, 1_000_000, s) == 0


# ---- differential: compiled == reference, pick for pick --------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_compiled_matches_reference(seed):
    rs = np.random.default_rng(seed)
    n = int(rs.integers(1, 40))
    tab = table(n)
    tab[:, COL_HEALTHY] = rs.random(n) < 0.85
    tab[:, COL_CIRCUIT] = rs.choice([0, 0, 0, 1, 2], n)
    tab[:, COL_POLLED_AT] = np.where(rs.random(n) < 0.7, 1, -1)
    small = rs.random() < 0.5  # small values make ties frequent
    hi = 4 if small else 10_000
    tab[:, COL_IN_FLIGHT] = rs.integers(0, hi, n)
    tab[:, COL_IN_FLIGHT_TOKENS] = rs.integers(0, hi * 10, n)
    tab[:, COL_POLLED_TOKENS] = rs.integers(0, hi * 10, n)
    # a prefill's polled uncached tokens (-1 unknown) enter the demand cost
    tab[:, T.COL_POLLED_UNCACHED] = np.where(rs.random(n) < 0.5, rs.integers(0, hi * 10, n), -1)
    tab[:, T.COL_TOKENS_AT_POLL] = rs.integers(0, hi * 10, n)
    cands = np.sort(rs.choice(n, int(rs.integers(1, n + 1)), replace=False)).astype(np.int64)
    s, ref = state(seed * 7919 + 1), R.Rng(seed * 7919 + 1)
    cur_c, cur_r = np.zeros(1, dtype=np.int64), [0]
    names = [f"http://w{i}:8000@{i % 8}" for i in cands]
    ring_h, ring_t = build_ring(cands, names, points=16)
    for step in range(300):
        op = step % 6
        if op == 0:
            got, want = _policy.random_pick(tab, cands, s), R.random_pick(tab, cands, ref)
        elif op == 1:
            got, want = (
                _policy.power_of_two(tab, cands, METRIC["tokens"], s),
                R.power_of_two(tab, cands, "tokens", ref),
            )
        elif op == 2:
            got, want = (
                _policy.power_of_two(tab, cands, METRIC["requests"], s),
                R.power_of_two(tab, cands, "requests", ref),
            )
        elif op == 3:
            got, want = (
                _policy.power_of_two(tab, cands, METRIC["least_requests"], s),
                R.power_of_two(tab, cands, "least_requests", ref),
            )
        elif op == 4:
            w = int(rs.choice([0, 1000, 1_000_000]))
            got, want = _policy.demand(tab, cands, 50, w, s), R.demand(tab, cands, 50, w, ref)
        else:
            got, want = _policy.round_robin(tab, cands, cur_c), R.round_robin(tab, cands, cur_r)
        assert got == want, (step, op)
        key = int(rs.integers(0, 2**63))
        assert _policy.ring_lookup(tab, ring_h, ring_t, key) == R.ring_lookup(tab, ring_h, ring_t, key)
        if got >= 0:  # the table evolves like a live one
            tab[got, COL_IN_FLIGHT] += 1
            tab[got, COL_IN_FLIGHT_TOKENS] += 50


def test_hash_matches_reference():
    for data in (b"", b"a", b"http://127.0.0.1:8000@3#17", bytes(range(256))):
        assert _policy.hash64(data) == R.hash64(data)


# ---- simulations: observed shares within tolerance of the expected ---------------------------

N = 100_000


def test_simulation_random_and_round_robin_are_uniform_over_healthy():
    tab = table(5)
    tab[4, COL_HEALTHY] = 0
    s = state(11)
    counts = np.bincount([_policy.random_pick(tab, np.arange(5), s) for _ in range(N)], minlength=5)
    assert counts[4] == 0
    assert np.all(np.abs(counts[:4] / N - 0.25) < 0.01)
    cur = np.zeros(1, dtype=np.int64)
    counts = np.bincount([_policy.round_robin(tab, np.arange(5), cur) for _ in range(N)], minlength=5)
    assert list(counts[:4]) == [N // 4] * 4


def test_simulation_p2c_tokens_shares():
    # Static loads: with two random candidates the least loaded of 4 wins whenever drawn
    # (probability 1/2), the 2nd when drawn without the 1st (1/3), the 3rd 1/6, the 4th never.
    tab = table(4)
    tab[:, COL_POLLED_AT] = 1
    tab[:, COL_POLLED_TOKENS] = [10, 20, 30, 40]
    s = state(12)
    counts = (
        np.bincount([_policy.power_of_two(tab, np.arange(4), METRIC["tokens"], s) for _ in range(N)], minlength=4) / N
    )
    assert np.allclose(counts, [1 / 2, 1 / 3, 1 / 6, 0], atol=0.01), counts


def test_simulation_least_requests_with_bookings_stays_exactly_even():
    tab = table(8)
    s = state(13)
    for _ in range(8 * 1000):
        t = _policy.power_of_two(tab, np.arange(8), METRIC["least_requests"], s)
        tab[t, COL_IN_FLIGHT] += 1
    assert list(tab[:, COL_IN_FLIGHT]) == [1000] * 8


def test_simulation_consistent_hashing_spread_and_minimal_movement():
    tab = table(8)
    names = [f"http://d:8000@{i}" for i in range(8)]
    h, o = build_ring(range(8), names)
    keys = [_policy.hash64(f"user-{i}".encode()) for i in range(20_000)]
    before = np.array([_policy.ring_lookup(tab, h, o, k) for k in keys])
    shares = np.bincount(before, minlength=8) / len(keys)
    assert np.all(np.abs(shares - 1 / 8) < 0.04), shares
    h2, o2 = build_ring([t for t in range(8) if t != 5], [n for i, n in enumerate(names) if i != 5])
    after = np.array([_policy.ring_lookup(tab, h2, o2, k) for k in keys])
    moved = before != after
    assert np.all(before[moved] == 5)  # only keys that lived on the removed target move
    assert not np.any(after == 5)
