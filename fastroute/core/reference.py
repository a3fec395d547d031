"""Pure NumPy/Python twins of the compiled kernels: the oracle of the differential tests.

Each function takes the same table array and candidate list as its compiled counterpart and a
``Rng`` that reproduces the compiled splitmix64 stream, so for equal inputs and seeds the picks
must be identical, not just similarly distributed.

The prefix tree (``_tree.PrefixTree``) has a twin of its meaning rather than of its structure
(``tree_match``, ``tree_pick``, ``held_bytes``): the longest common prefix over every text each
target was given, which the radix tree must reproduce byte for byte; ties are a set of allowed
targets, since the tree breaks them with its own RNG.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np

from fastroute.core.table import (
    COL_CIRCUIT,
    COL_HEALTHY,
    COL_IN_FLIGHT,
    COL_IN_FLIGHT_TOKENS,
    COL_ORDER_KEY,
    COL_OTHERS_EST,
    COL_OTHERS_EST_TOKENS,
    COL_OTHERS_IN_FLIGHT,
    COL_OTHERS_OPEN,
    COL_OTHERS_TOKENS,
    COL_POLLED_AT,
    COL_POLLED_KV_QUEUE,
    COL_POLLED_MAX_TOKENS,
    COL_POLLED_TOKENS,
    COL_POLLED_UNCACHED,
    COL_TOKENS_AT_POLL,
)
from fastroute.names import CIRCUIT_OPEN, LOAD_METRIC_CODE

M64 = (1 << 64) - 1


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
    return [int(t) for t in cands if _row_eligible(tab, t)]


def _row_eligible(tab: np.ndarray, t) -> bool:
    """``_layout.row_eligible``: healthy, circuit not open (half-open may take a probe), and not
    open at another replica."""
    return bool(tab[t, COL_HEALTHY] == 1 and tab[t, COL_CIRCUIT] != CIRCUIT_OPEN and tab[t, COL_OTHERS_OPEN] == 0)


def requests(tab: np.ndarray, t) -> int:
    """``_layout.row_requests``: this host's in-flight requests plus the other replicas'
    (published, and estimated since the last sync)."""
    return int(tab[t, COL_IN_FLIGHT]) + int(tab[t, COL_OTHERS_IN_FLIGHT]) + int(tab[t, COL_OTHERS_EST])


def tokens_in_flight(tab: np.ndarray, t) -> int:
    """``_layout.row_tokens``: this host's in-flight input tokens plus the other replicas'."""
    return int(tab[t, COL_IN_FLIGHT_TOKENS]) + int(tab[t, COL_OTHERS_TOKENS]) + int(tab[t, COL_OTHERS_EST_TOKENS])


def pending(tab: np.ndarray, t) -> int:
    """``_layout.row_pending``: the input tokens a demand cost charges: in flight, or a
    prefill's polled uncached waiting tokens moved by the bookings and releases since."""
    live = tokens_in_flight(tab, t)
    polled = int(tab[t, COL_POLLED_UNCACHED])
    if polled < 0 or tab[t, COL_POLLED_AT] < 0:
        return live
    return max(0, polled + live - int(tab[t, COL_TOKENS_AT_POLL]))


def round_robin(tab: np.ndarray, cands, cursor: list[int]) -> int:
    n = len(cands)
    for k in range(n):
        c = (cursor[0] + k) % n
        t = int(cands[c])
        if _row_eligible(tab, t):
            cursor[0] = (c + 1) % n
            return t
    return -1


def random_pick(tab: np.ndarray, cands, rng: Rng) -> int:
    el = _eligible(tab, cands)
    return el[rng.below(len(el))] if el else -1


def power_of_two(tab: np.ndarray, cands, metric: str, rng: Rng) -> int:
    if metric not in LOAD_METRIC_CODE:
        raise ValueError(f"unknown load metric {metric!r}")
    el = _eligible(tab, cands)
    if metric == "least_requests":
        polled = [t for t in el if tab[t, COL_POLLED_AT] >= 0]
        pool = polled if polled else el
        best, best_key, ties = -1, None, 0
        for t in pool:
            key = (requests(tab, t), int(tab[t, COL_POLLED_TOKENS]) if polled else 0)
            if best < 0 or key < best_key:  # type: ignore[operator]  # set once best >= 0
                best, best_key, ties = t, key, 1
            elif key == best_key:
                ties += 1
                if rng.below(ties) == 0:
                    best = t
        return best
    if len(cands) >= 2:
        i = _sample_eligible(tab, cands, -1, rng)
        if i >= 0:
            j = _sample_eligible(tab, cands, i, rng)
            if j >= 0:
                return _p2c_pair(tab, int(cands[i]), int(cands[j]), metric)
    if not el:
        return -1
    if len(el) == 1:
        return el[0]
    i = rng.below(len(el))
    j = rng.below(len(el) - 1)
    if j >= i:
        j += 1
    return _p2c_pair(tab, el[i], el[j], metric)


P2C_TRIES = 8  # _policy's draws per candidate before the scan


def _sample_eligible(tab: np.ndarray, cands, skip: int, rng: Rng) -> int:
    """``_policy._sample_eligible``: the slot of a random eligible candidate other than ``skip``
    in at most P2C_TRIES draws, or -1."""
    span = len(cands) - (1 if skip >= 0 else 0)
    for _ in range(P2C_TRIES):
        i = rng.below(span)
        if 0 <= skip <= i:
            i += 1
        if _row_eligible(tab, int(cands[i])):
            return i
    return -1


def _p2c_pair(tab: np.ndarray, a: int, b: int, metric: str) -> int:
    """``_policy._p2c_pair``: the less loaded of a and b; a wins exact ties."""
    ra, rb = requests(tab, a), requests(tab, b)
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
        cost = pending(tab, t) + tokens + weight * requests(tab, t)
        if best < 0 or cost < best_cost:
            best, best_cost, ties = t, cost, 1
        elif cost == best_cost:
            ties += 1
            if rng.below(ties) == 0:
                best = t
    return best


INDEX_MIN_CANDS = 64  # _index.pxd: a Picker indexes a least_requests or demand pick from here up


def index_key(tab: np.ndarray, t: int, kind: str, weight: int = 0) -> tuple[int, int, int] | None:
    """``_index.leaf_key``: a candidate's key in a Picker's load index (``kind`` least_requests,
    demand or kv_fit), None when it is not eligible (or, for kv_fit, of unknown capacity).  An
    eligible polled candidate's class (0) beats an unpolled one's (1): the scan's "only polled
    rows when any is"; kv_fit's key is (0, requests, -free KV)."""
    if not _row_eligible(tab, t):
        return None
    if kind == "kv_fit":
        free = free_kv(tab, t)
        return None if free is None else (0, requests(tab, t), -free)
    if kind == "demand":
        return (0, pending(tab, t) + weight * requests(tab, t), 0)
    if tab[t, COL_POLLED_AT] >= 0:
        return (0, requests(tab, t), int(tab[t, COL_POLLED_TOKENS]))
    return (1, requests(tab, t), 0)


def index_ties(tab: np.ndarray, cands, kind: str, weight: int = 0, need: int = 0) -> list[int]:
    """What a load index draws from, in candidate order: the candidates tied at the least key;
    for kv_fit those among the ones where ``need`` fits, or if none fits, those with the most
    free KV."""
    keys = [(int(t), index_key(tab, int(t), kind, weight)) for t in cands]
    live = [(t, k) for t, k in keys if k is not None]
    if kind == "kv_fit":
        fit = [(t, k) for t, k in live if -k[2] >= need]
        if not fit:
            most = max((-k[2] for _, k in live), default=None)
            return [t for t, k in live if -k[2] == most]
        live = fit
    if not live:
        return []
    low = min(k for _, k in live)
    return [t for t, k in live if k == low]


def indexed_pick(tab: np.ndarray, cands, kind: str, weight: int, rng: Rng, need: int = 0) -> int:
    """A Picker's pick through its load index: the r-th of ``index_ties`` in candidate order,
    r drawn once below their number (no draw when there is none: -1, or for kv_fit -2 when no
    eligible candidate has a known capacity)."""
    ties = index_ties(tab, cands, kind, weight, need)
    if not ties:
        return -2 if kind == "kv_fit" else -1
    return ties[rng.below(len(ties))]


def ring_lookup(tab: np.ndarray, ring_hash: np.ndarray, ring_target: np.ndarray, key: int) -> int:
    n = len(ring_hash)
    if n == 0:
        return -1
    lo = int(np.searchsorted(ring_hash, np.uint64(key), side="left"))
    for k in range(n):
        t = int(ring_target[(lo + k) % n])
        if _row_eligible(tab, t):
            return t
    return -1


def free_kv(tab: np.ndarray, t: int) -> int | None:
    cap = int(tab[t, COL_POLLED_MAX_TOKENS])
    if cap <= 0 or tab[t, COL_POLLED_AT] < 0:
        return None
    live = tokens_in_flight(tab, t)
    used = max(int(tab[t, COL_POLLED_TOKENS]) + live - int(tab[t, COL_TOKENS_AT_POLL]), live)
    if tab[t, COL_POLLED_KV_QUEUE] > 0:
        used = max(used, cap)  # a prealloc/retracted queue at the poll: no KV free
    return cap - used


def kv_fit(tab: np.ndarray, cands, tokens: int, need: int, use_demand: bool, weight: int, rng: Rng) -> int:
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
            key = (pending(tab, t) + tokens + weight * requests(tab, t), 0)
        else:
            key = (requests(tab, t), -free)
        if best < 0 or key < best_key:  # type: ignore[operator]  # set once best >= 0
            best, best_key, ties = t, key, 1
        elif key == best_key:
            ties += 1
            if rng.below(ties) == 0:
                best = t
    if not known:
        return -2
    return best if best >= 0 else room


# ---- the prefix tree, by meaning ----------------------------------------------------------------


def coordinated(
    tab: np.ndarray,
    cands,
    tokens: int,
    need: int,
    use_demand: bool,
    weight: int,
    kv: bool,
    n: int,
    slot: int,
    strict: bool = False,
) -> tuple[int, list[int]]:
    """``_policy.pick_coordinated``: the next n placements as one router would make them (each
    the best by (fits, least requests or demand cost, shared order key), or the most free KV
    when nothing fits), and this replica's: the slot-th when ``strict``, else the slot-th modulo
    the placements as good as the first."""
    el = _eligible(tab, cands)
    if kv and not any(free_kv(tab, t) is not None for t in el):
        kv = False
    extra_r = {t: 0 for t in el}
    extra_k = {t: 0 for t in el}
    picks: list[int] = []
    levels: list[tuple] = []
    for _ in range(n):
        best, best_key = -1, None
        for t in el:
            free = 0
            fits = True
            if kv:
                f = free_kv(tab, t)
                if f is None:
                    continue
                free = f - extra_k[t]
                fits = free >= need
            r = requests(tab, t) + extra_r[t]
            cost = pending(tab, t) + extra_k[t] + tokens + weight * r if use_demand else r
            key = (0, cost, int(tab[t, COL_ORDER_KEY])) if fits else (1, -free, int(tab[t, COL_ORDER_KEY]))
            if best_key is None or key < best_key:
                best, best_key = t, key
        if best < 0:
            return -1, []
        picks.append(best)
        levels.append(best_key[:2])  # type: ignore[index]  # best >= 0: set
        extra_r[best] += 1
        extra_k[best] += tokens
    ties = sum(1 for lv in levels if lv == levels[0])
    return picks[slot if strict else slot % ties], picks


def common_prefix(a: bytes, b: bytes) -> int:
    """Length in bytes of the longest common prefix of a and b."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def held_bytes(texts: Iterable[bytes]) -> int:
    """Bytes a target holds after these inserts, without eviction: its distinct non-empty
    prefixes."""
    return len({s[:k] for s in texts for k in range(1, len(s) + 1)})


def tree_match(held: dict[int, list[bytes]], query: bytes, eligible: set[int]) -> tuple[int, list[int]]:
    """``PrefixTree.match``: (longest match among the eligible targets' texts, sorted targets
    holding it); (0, []) when nothing matches."""
    best, who = 0, []
    for t, texts in held.items():
        if t not in eligible:
            continue
        m = max((common_prefix(s, query) for s in texts), default=0)
        if m > best:
            best, who = m, [t]
        elif m == best and m > 0:
            who.append(t)
    return best, sorted(who)


def tree_pick(
    held: dict[int, list[bytes]],
    sizes: dict[int, int],
    loads: dict[int, int],
    eligible: set[int],
    text: bytes | None,
    cfg: Any,
) -> tuple[str, set[int]]:
    """``PrefixTree.pick`` as (reason, the set of targets it may choose): the reasons are those of
    ``cache_aware.REASONS``, "none" with an empty set when no target is eligible.  ``cfg`` has
    cache_threshold, balance_abs_threshold and balance_rel_threshold, and optionally rank_slack
    (-1 = off; N >= 0: only targets within min + N in-flight requests may be chosen)."""
    if not eligible:
        return "none", set()
    lo = min(loads[t] for t in eligible)
    hi = max(loads[t] for t in eligible)
    least = {t for t in eligible if loads[t] == lo}
    slack = getattr(cfg, "rank_slack", -1)
    if slack >= 0:
        eligible = {t for t in eligible if loads[t] <= lo + slack}
    if not text:
        return "no_text", least
    if hi - lo > cfg.balance_abs_threshold and hi > lo * cfg.balance_rel_threshold:
        return "balance", least
    m, who = tree_match(held, text, eligible)
    if who and m > cfg.cache_threshold * len(text):
        if slack >= 0:
            low = min(loads[t] for t in who)
            return "cache_hit", {t for t in who if loads[t] == low}
        return "cache_hit", set(who)
    if slack >= 0:
        return "least_loaded", least
    small = min(sizes[t] for t in eligible)
    return "smallest_tree", {t for t in eligible if sizes[t] == small}


# --------------------------------------------------------------------------- manual policy

MANUAL_MODES = ("random", "min_load", "min_group")


def key_hash(key: bytes) -> int:
    """``_manual._key_hash``: hash64, with 0 (the empty-slot mark) stored as 1."""
    return hash64(key) or 1


class ManualKeys:
    """Twin of ``_manual.KeyTable``: a dict instead of open addressing, same decisions, same
    RNG draws and the same sweep schedule (first pick, then every ``sweep_every`` seconds)."""

    def __init__(self, mode: str, max_idle: float, sweep_every: float, seed: int, max_keys: int = 0) -> None:
        self.mode = MANUAL_MODES.index(mode)
        self.max_keys = max_keys
        self.evicted = 0
        self.max_idle = max_idle
        self.sweep_every = sweep_every
        self.next_sweep = 0.0
        self.rng = Rng(seed)
        self.keys: dict[int, list] = {}  # hash -> [target, last use]
        self.per_target: dict[int, int] = {}
        self.reassigned = 0

    def _assign(self, tab: np.ndarray, cands) -> int:
        el = _eligible(tab, cands)
        if not el:
            return -1
        if self.mode == 0:
            return el[self.rng.below(len(el))]
        best, best_score, ties = -1, 0, 0
        for t in el:
            score = int(tab[t, COL_IN_FLIGHT]) if self.mode == 1 else self.per_target.get(t, 0)
            if best < 0 or score < best_score:
                best, best_score, ties = t, score, 1
            elif score == best_score:
                ties += 1
                if self.rng.below(ties) == 0:
                    best = t
        return best

    def sweep(self, cands, now: float) -> None:
        self.next_sweep = now + self.sweep_every
        keep = {int(c) for c in cands}
        self.keys = {
            h: e for h, e in self.keys.items() if (self.max_idle <= 0 or now - e[1] <= self.max_idle) and e[0] in keep
        }
        self.per_target = {}
        for t, _ in self.keys.values():
            self.per_target[t] = self.per_target.get(t, 0) + 1

    def pick(self, tab: np.ndarray, cands, key: bytes | None, now: float) -> int:
        if now >= self.next_sweep:
            self.sweep(cands, now)
        if key is None:
            return self._assign(tab, cands)
        h = key_hash(key)
        e = self.keys.get(h)
        if e is not None:
            old = e[0]
            if old in {int(c) for c in cands} and _row_eligible(tab, old):
                e[1] = now
                return old
            t = self._assign(tab, cands)
            if t < 0:
                return -1
            self.per_target[old] -= 1
            self.per_target[t] = self.per_target.get(t, 0) + 1
            e[0], e[1] = t, now
            self.reassigned += 1
            return t
        t = self._assign(tab, cands)
        if t < 0:
            return -1
        if self.max_keys and len(self.keys) >= self.max_keys:
            # LRU: the oldest eighth by last use, ties by key hash (as _manual._evict).
            m = max(1, self.max_keys // 8)
            for old_h, (old_t, _) in sorted(self.keys.items(), key=lambda kv: (kv[1][1], kv[0]))[:m]:
                del self.keys[old_h]
                self.per_target[old_t] -= 1
            self.evicted += m
        self.keys[h] = [t, now]
        self.per_target[t] = self.per_target.get(t, 0) + 1
        return t


def demand_ties(tab: np.ndarray, cands, tokens: int, weight: int) -> list[int]:
    out: list[int] = []
    best = 0
    for t in _eligible(tab, cands):
        cost = pending(tab, t) + tokens + weight * requests(tab, t)
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


def narrow(
    tab: np.ndarray, cands, tokens: int, need: int, kv_mode: int, demand_mode: int, weight: int
) -> tuple[list[int] | None, list[int] | None, list[int] | None, bool]:
    """``_policy.narrow``: KV fit as a filter, then the demand ties among what it leaves."""
    choose: list[int] | None = None
    fits: list[int] | None = None
    ties: list[int] | None = None
    no_capacity = False
    if kv_mode:
        fits, roomiest = kv_feasible(tab, cands, need)
        if not roomiest:
            fits, no_capacity = None, True
        elif not fits:
            fits = roomiest
        if kv_mode == 2 and fits is not None:
            choose = fits
    if demand_mode:
        ties = demand_ties(tab, choose if choose is not None else cands, tokens, weight)
        if demand_mode == 2:
            choose = ties
    return choose, fits, ties, no_capacity
