"""Pure NumPy/Python twins of the compiled kernels: the oracle of the differential tests.

Each function takes the same table array and candidate list as its compiled counterpart and a
``Rng`` that reproduces the compiled splitmix64 stream, so for equal inputs and seeds the picks
must be identical, not just similarly distributed.
"""
from __future__ import annotations

import numpy as np

from fastroute.core.table import (COL_CIRCUIT, COL_HEALTHY, COL_IN_FLIGHT, COL_IN_FLIGHT_TOKENS,
                             COL_POLLED_MAX_TOKENS, COL_TOKENS_AT_POLL,
                             COL_POLLED_AT, COL_POLLED_TOKENS)

M64 = (1 << 64) - 1
METRICS = {"tokens": 0, "requests": 1, "least_requests": 2}


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


class Rng:
    """splitmix64, bit-for-bit the compiled ``rng_next`` / ``rng_below``."""

    def __init__(self, seed: int) -> None:
        self.state = seed & M64

    def next(self) -> int:
        self.state = (self.state + 0x9E3779B97F4A7C15) & M64
        return _mix(self.state)

    def below(self, n: int) -> int:
        return ((self.next() >> 32) * n) >> 32


def hash64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & M64
    return _mix(h)


def _eligible(tab: np.ndarray, cands) -> list[int]:
    return [int(t) for t in cands if tab[t, COL_HEALTHY] == 1 and tab[t, COL_CIRCUIT] != 1]


def round_robin(tab: np.ndarray, cands, cursor: list[int]) -> int:
    n = len(cands)
    for k in range(n):
        c = (cursor[0] + k) % n
        t = int(cands[c])
        if tab[t, COL_HEALTHY] == 1 and tab[t, COL_CIRCUIT] != 1:
            cursor[0] = (c + 1) % n
            return t
    return -1


def random_pick(tab: np.ndarray, cands, rng: Rng) -> int:
    el = _eligible(tab, cands)
    return el[rng.below(len(el))] if el else -1


def power_of_two(tab: np.ndarray, cands, metric: str, rng: Rng) -> int:
    el = _eligible(tab, cands)
    if METRICS[metric] == 2:
        polled = [t for t in el if tab[t, COL_POLLED_AT] >= 0]
        pool = polled if polled else el
        best, best_key, ties = -1, None, 0
        for t in pool:
            key = (int(tab[t, COL_IN_FLIGHT]), int(tab[t, COL_POLLED_TOKENS]) if polled else 0)
            if best < 0 or key < best_key:
                best, best_key, ties = t, key, 1
            elif key == best_key:
                ties += 1
                if rng.below(ties) == 0:
                    best = t
        return best
    if not el:
        return -1
    if len(el) == 1:
        return el[0]
    i = rng.below(len(el))
    j = rng.below(len(el) - 1)
    if j >= i:
        j += 1
    a, b = el[i], el[j]
    ra, rb = tab[a, COL_IN_FLIGHT], tab[b, COL_IN_FLIGHT]
    pa, pb = tab[a, COL_POLLED_AT] >= 0, tab[b, COL_POLLED_AT] >= 0
    ta, tb = tab[a, COL_POLLED_TOKENS], tab[b, COL_POLLED_TOKENS]
    if metric == "requests":
        if ra != rb:
            return a if ra < rb else b
        if pa and pb and ta != tb:
            return a if ta < tb else b
        return a
    if pa and pb and ta != tb:
        return a if ta < tb else b
    if ra != rb:
        return a if ra < rb else b
    return a


def demand(tab: np.ndarray, cands, tokens: int, weight: int, rng: Rng) -> int:
    best, best_cost, ties = -1, 0, 0
    for t in _eligible(tab, cands):
        cost = int(tab[t, COL_IN_FLIGHT_TOKENS]) + tokens + weight * int(tab[t, COL_IN_FLIGHT])
        if best < 0 or cost < best_cost:
            best, best_cost, ties = t, cost, 1
        elif cost == best_cost:
            ties += 1
            if rng.below(ties) == 0:
                best = t
    return best


def ring_lookup(tab: np.ndarray, ring_hash: np.ndarray, ring_target: np.ndarray, key: int) -> int:
    n = len(ring_hash)
    if n == 0:
        return -1
    lo = int(np.searchsorted(ring_hash, np.uint64(key), side="left"))
    for k in range(n):
        t = int(ring_target[(lo + k) % n])
        if tab[t, COL_HEALTHY] == 1 and tab[t, COL_CIRCUIT] != 1:
            return t
    return -1


def free_kv(tab: np.ndarray, t: int) -> int | None:
    cap = int(tab[t, COL_POLLED_MAX_TOKENS])
    if cap <= 0 or tab[t, COL_POLLED_AT] < 0:
        return None
    live = int(tab[t, COL_IN_FLIGHT_TOKENS])
    used = max(int(tab[t, COL_POLLED_TOKENS]) + live - int(tab[t, COL_TOKENS_AT_POLL]), live)
    return cap - used


def kv_fit(tab: np.ndarray, cands, tokens: int, need: int, use_demand: bool, weight: int,
           rng: Rng) -> int:
    best, best_key, ties = -1, None, 0
    room, room_free, room_ties = -1, 0, 0
    known = False
    for t in _eligible(tab, cands):
        free = free_kv(tab, t)
        if free is None:
            continue
        known = True
        if room < 0 or free > room_free:
            room, room_free, room_ties = t, free, 1
        elif free == room_free:
            room_ties += 1
            if rng.below(room_ties) == 0:
                room = t
        if free < need:
            continue
        if use_demand:
            key = (int(tab[t, COL_IN_FLIGHT_TOKENS]) + tokens + weight * int(tab[t, COL_IN_FLIGHT]), 0)
        else:
            key = (int(tab[t, COL_IN_FLIGHT]), -free)
        if best < 0 or key < best_key:
            best, best_key, ties = t, key, 1
        elif key == best_key:
            ties += 1
            if rng.below(ties) == 0:
                best = t
    if not known:
        return -2
    return best if best >= 0 else room


def demand_ties(tab: np.ndarray, cands, tokens: int, weight: int) -> list[int]:
    out: list[int] = []
    best = 0
    for t in _eligible(tab, cands):
        cost = int(tab[t, COL_IN_FLIGHT_TOKENS]) + tokens + weight * int(tab[t, COL_IN_FLIGHT])
        if not out or cost < best:
            out, best = [t], cost
        elif cost == best:
            out.append(t)
    return out


def kv_feasible(tab: np.ndarray, cands, need: int) -> tuple[list[int], list[int]]:
    fits: list[int] = []
    roomiest: list[int] = []
    room_free = 0
    for t in _eligible(tab, cands):
        free = free_kv(tab, t)
        if free is None:
            continue
        if not roomiest or free > room_free:
            roomiest, room_free = [t], free
        elif free == room_free:
            roomiest.append(t)
        if free >= need:
            fits.append(t)
    return fits, roomiest
