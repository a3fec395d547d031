"""The manual policy's compiled key table against its twin (fastroute.core.reference.ManualKeys),
pick for pick, plus its rules one by one: stickiness, assignment modes, idle expiry, re-assignment
of a key whose target left or went unhealthy."""

from __future__ import annotations

import random

import numpy as np
import pytest

from fastroute.core import _manual
from fastroute.core import reference as R
from fastroute.core.table import COL_CIRCUIT, COL_HEALTHY, COL_IN_FLIGHT, NCOLS
from fastroute.names import ASSIGNMENT_MODE_CODE, ASSIGNMENT_MODES, CIRCUIT_OPEN


def table(n: int) -> np.ndarray:
    tab = np.zeros((n, NCOLS), dtype=np.int64)
    tab[:, COL_HEALTHY] = 1
    return tab


def keys(mode: str, max_idle: float = 100.0, every: float = 10.0, seed: int = 7, rows: int = 16):
    return _manual.KeyTable(rows, ASSIGNMENT_MODE_CODE[mode], max_idle, every, seed)


@pytest.mark.parametrize("mode", ASSIGNMENT_MODES)
def test_differential_against_the_twin(mode: str) -> None:
    rnd = random.Random(mode)
    tab = table(16)
    cands = np.arange(8, dtype=np.int64)
    kt = keys(mode, max_idle=30.0, every=5.0, seed=42)
    twin = R.ManualKeys(mode, 30.0, 5.0, 42)
    now = 0.0
    for step in range(20000):
        now += rnd.random() * 0.05
        r = rnd.random()
        if r < 0.02:  # health and circuits flip
            t = rnd.randrange(16)
            tab[t, COL_HEALTHY] = rnd.random() < 0.8
            tab[t, COL_CIRCUIT] = CIRCUIT_OPEN if rnd.random() < 0.1 else 0
        elif r < 0.05:  # load moves
            tab[rnd.randrange(16), COL_IN_FLIGHT] = rnd.randrange(5)
        elif r < 0.055:  # targets join and leave
            cands = np.array(sorted(rnd.sample(range(16), rnd.randrange(1, 10))), dtype=np.int64)
            kt.sweep(cands, now)
            twin.sweep(cands, now)
        key = None if rnd.random() < 0.05 else b"key-%d" % rnd.randrange(300)
        a = kt.pick(tab, cands, key, now)
        b = twin.pick(tab, cands, key, now)
        assert a == b, (step, mode, key)
    assert kt.count == len(twin.keys) and kt.reassigned == twin.reassigned
    for t in range(16):
        assert kt.keys_of(t) == twin.per_target.get(t, 0)


def test_a_key_sticks_and_new_keys_spread_by_min_load() -> None:
    tab = table(4)
    cands = np.arange(4, dtype=np.int64)
    kt = keys("min_load")
    owners = {}
    for i in range(4):
        t = kt.pick(tab, cands, b"k%d" % i, 1.0)
        tab[t, COL_IN_FLIGHT] += 1  # the lease the group books
        owners[i] = t
    assert sorted(owners.values()) == [0, 1, 2, 3]
    for _ in range(10):
        for i in range(4):
            assert kt.pick(tab, cands, b"k%d" % i, 2.0) == owners[i]


def test_min_group_counts_keys_not_load() -> None:
    tab = table(2)
    tab[0, COL_IN_FLIGHT] = 100
    cands = np.arange(2, dtype=np.int64)
    kt = keys("min_group")
    got = [kt.pick(tab, cands, b"k%d" % i, 1.0) for i in range(10)]
    assert got.count(0) == got.count(1) == 5


def test_idle_keys_expire_and_left_targets_reassign() -> None:
    tab = table(4)
    kt = keys("random", max_idle=10.0, every=1.0)
    cands = np.arange(4, dtype=np.int64)
    t = kt.pick(tab, cands, b"a", 0.0)
    assert kt.owner_of(b"a") == t and kt.count == 1
    kt.pick(tab, cands, b"b", 20.0)  # the sweep at 20 s drops "a" (idle 20 > 10)
    assert kt.owner_of(b"a") == -1 and kt.count == 1
    # the worker of "b" leaves: the key is dropped and re-assigned among the rest
    tb = kt.owner_of(b"b")
    rest = np.array([x for x in range(4) if x != tb], dtype=np.int64)
    kt.sweep(rest, 20.5)
    assert kt.owner_of(b"b") == -1
    assert kt.pick(tab, rest, b"b", 21.0) in rest
    # unhealthy owner: re-assigned, counted
    tb = kt.owner_of(b"b")
    tab[tb, COL_HEALTHY] = 0
    t2 = kt.pick(tab, rest, b"b", 21.5)
    assert t2 != tb and t2 in rest and kt.reassigned == 1 and kt.keys_of(tb) == 0


def test_no_eligible_target_and_growth() -> None:
    tab = table(2)
    tab[:, COL_HEALTHY] = 0
    kt = keys("min_load")
    assert kt.pick(tab, np.arange(2, dtype=np.int64), b"x", 1.0) == -1 and kt.count == 0
    tab[:, COL_HEALTHY] = 1
    for i in range(1000):
        kt.pick(tab, np.arange(2, dtype=np.int64), b"g%d" % i, 1.0)
    assert kt.count == 1000 and kt.capacity >= 2000
    assert kt.keys_of(0) + kt.keys_of(1) == 1000


def test_checked_entry_refuses_bad_rows() -> None:
    kt = keys("random", rows=4)
    with pytest.raises(IndexError):
        kt.pick(table(8), np.array([5], dtype=np.int64), b"k", 0.0)
    with pytest.raises(ValueError):
        _manual.KeyTable(4, 9, 1.0, 1.0, 0)


def test_bound_picks_match_checked_picks() -> None:
    tab = table(8)
    cands = np.arange(8, dtype=np.int64)
    bound, checked = keys("min_group", seed=3), keys("min_group", seed=3)
    with pytest.raises(RuntimeError):
        bound.pick_bound(b"k")
    bound.bind(tab, cands)
    checked.sweep(cands, 0.0)
    for i in range(200):
        k = b"k%d" % (i % 50)
        assert bound.pick_bound(k) == checked.pick(tab, cands, k, 1.0)
    with pytest.raises(IndexError):
        bound.bind(tab, np.array([99], dtype=np.int64))


@pytest.mark.parametrize("mode", ASSIGNMENT_MODES)
def test_differential_with_the_key_bound(mode: str) -> None:
    """Past max_keys the least recently used eighth goes, in both twins, pick for pick."""
    rnd = random.Random("bound" + mode)
    tab = table(16)
    cands = np.arange(8, dtype=np.int64)
    kt = _manual.KeyTable(16, ASSIGNMENT_MODE_CODE[mode], 1000.0, 5.0, 3, 40)
    twin = R.ManualKeys(mode, 1000.0, 5.0, 3, 40)
    now = 0.0
    for step in range(20000):
        now += rnd.random() * 0.05 if rnd.random() < 0.7 else 0.0  # ties in last use too
        if rnd.random() < 0.01:
            tab[rnd.randrange(16), COL_HEALTHY] = rnd.random() < 0.8
        key = b"key-%d" % rnd.randrange(400)
        a = kt.pick(tab, cands, key, now)
        b = twin.pick(tab, cands, key, now)
        assert a == b, (step, mode, key)
        assert kt.count <= 40
    assert kt.evicted == twin.evicted > 1000
    assert kt.count == len(twin.keys)
    for t in range(16):
        assert kt.keys_of(t) == twin.per_target.get(t, 0)


def test_bound_keeps_memory_flat_and_recent_keys_sticky() -> None:
    tab = table(4)
    cands = np.arange(4, dtype=np.int64)
    kt = _manual.KeyTable(4, ASSIGNMENT_MODE_CODE["random"], 0.0, 1e9, 1, 1000)
    hot = kt.pick(tab, cands, b"hot", 0.0)
    for i in range(100_000):
        kt.pick(tab, cands, b"k%d" % i, float(i))
        if i % 100 == 0:
            assert kt.pick(tab, cands, b"hot", float(i)) == hot  # used often: never evicted
        assert kt.count <= 1000
    assert kt.capacity <= 2048 and kt.evicted >= 100_000 - 1000
    assert sum(kt.keys_of(t) for t in range(4)) == kt.count


def test_bad_bound_is_refused() -> None:
    with pytest.raises(ValueError):
        _manual.KeyTable(4, 0, 1.0, 1.0, 0, -1)
