"""The precise prefix index: what each rank's KV cache holds, as the engine reports it.

SGLang (0.5.23 and later, ``--kv-events-config``) publishes per DP rank the blocks its radix
cache stores and evicts (``fastroute.control.kvevents`` subscribes and feeds this index). A block
is ``block_size`` token ids; the engine names it by an opaque 64-bit hash and links it to its
parent block. No engine hash function is assumed here: each block gets a key of our own, the
Python hash of ``(parent key, its token ids)``, so a key names the whole prefix up to the block,
and a request's token ids give the same keys by the same chain (``chain``). The engine's hashes
serve only to find a stored block's parent and a removed block's key.

Per target row (one DP rank), a :class:`RankIndex` keeps ``engine hash -> key`` and ``key ->
count`` (a key may arrive under two engine hashes). A rank's index is bounded by
``max_blocks`` and by the rank's KV capacity where its LoadStat gives it: past that the oldest
entries go (counted), so the index can only under-report what the rank holds.

Freshness: a rank is used for placement only while its stream is whole; the subscriber marks
it stale (and clears it) after a gap that replay could not fill, a publisher restart or
silence, and the rank is used again once it has been whole for ``warmup_secs``.

Placement (:meth:`KvIndex.pick`): among the candidates, the cost of a rank is the prefill work
ahead of this request's first token there, in tokens: what is waiting on the rank (the
engine's pushed ``num_waiting_uncached_tokens``, on a PD prefill plus the KV of the batch it is
computing, and the uncached tokens of the requests this index sent there since that stat; else
the router's own estimate from the table) plus this request's tokens the
rank does not hold (input minus the cached prefix). The cheapest rank wins; ties go to the
longest hit, then the fewest requests in flight, then at random. A hit therefore wins exactly
while the tokens it saves exceed the extra queue it sits behind.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fastroute.core import reference
from fastroute.core.table import COL_IN_FLIGHT

# The key of the root (no parent): any constant; the chain mixes it with the first block.
ROOT = 0x5EED
# A request's chain is walked at most this many blocks (and stops at the first block no
# candidate holds, so a miss costs one block's hash).
MAX_BLOCKS = 4096
# Histogram buckets of the prefix-hit blocks of each precise pick (upper bounds, +Inf last).
HIT_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)

FRESH, WARMING, STALE, OFF = "fresh", "warming", "stale", "off"


def chain(ids: Sequence[int], block_size: int, n_blocks: int | None = None) -> list[int]:
    """Keys of the leading full blocks of ``ids`` (tests and tools; placement walks lazily)."""
    keys: list[int] = []
    h = ROOT
    end = len(ids) - block_size + 1
    for i in range(0, max(end, 0), block_size):
        if n_blocks is not None and len(keys) >= n_blocks:
            break
        h = hash((h, tuple(ids[i : i + block_size])))
        keys.append(h)
    return keys


class RankIndex:
    """One rank's blocks (see the module docstring)."""

    __slots__ = (
        "block_size",
        "by_hash",
        "keys",
        "state",
        "whole_since",
        "queue_tokens",
        "booked",
        "evicted",
        "orphans",
        "cap_blocks",
    )

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.by_hash: dict[int, int] = {}
        self.keys: dict[int, int] = {}
        self.state = WARMING
        self.whole_since = time.monotonic()
        self.queue_tokens = -1  # the engine's waiting uncached tokens (-1: never pushed)
        self.booked = 0  # uncached tokens of the requests this index sent there since that stat
        self.evicted = 0  # entries dropped to stay within max_blocks
        self.orphans = 0  # stored blocks whose parent this index never saw
        self.cap_blocks = 0  # the engine's KV capacity in blocks (pushed; 0: unknown)

    def clear(self) -> None:
        self.by_hash.clear()
        self.keys.clear()

    def store(self, hashes: Sequence[int], parent: int | None, tokens: Sequence[int], block_size: int) -> int:
        """Index blocks ``hashes`` (consecutive, the first under ``parent``); their token ids
        are ``tokens``, ``block_size`` per block. Returns the blocks indexed."""
        if parent is None:
            key = ROOT
        else:
            found = self.by_hash.get(parent)
            if found is None:
                self.orphans += len(hashes)
                return 0
            key = found
        by_hash, keys = self.by_hash, self.keys
        done = 0
        for i, eh in enumerate(hashes):
            chunk = tokens[i * block_size : (i + 1) * block_size]
            if not chunk:
                self.orphans += len(hashes) - i
                break
            key = hash((key, tuple(chunk)))
            old = by_hash.get(eh)
            if old == key:
                continue
            if old is not None:
                self._unkey(old)
            by_hash[eh] = key
            keys[key] = keys.get(key, 0) + 1
            done += 1
        return done

    def remove(self, hashes: Sequence[int]) -> None:
        pop = self.by_hash.pop
        for eh in hashes:
            key = pop(eh, None)
            if key is not None:
                self._unkey(key)

    def _unkey(self, key: int) -> None:
        n = self.keys.get(key, 0) - 1
        if n > 0:
            self.keys[key] = n
        else:
            self.keys.pop(key, None)

    def bound(self, max_blocks: int) -> None:
        """Drop the oldest entries beyond ``max_blocks`` (dict order is insertion order)."""
        extra = len(self.by_hash) - max_blocks
        if extra <= 0:
            return
        by_hash = self.by_hash
        for eh in list(by_hash)[:extra]:
            self._unkey(by_hash.pop(eh))
        self.evicted += extra


class KvIndex:
    """Every subscribed rank's :class:`RankIndex`, by target row, and the precise pick."""

    def __init__(
        self,
        max_blocks: int = 1 << 18,
        warmup_secs: float = 30.0,
        seed: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_blocks < 1:
            raise ValueError("max_blocks must be >= 1")
        self.max_blocks = int(max_blocks)
        self.warmup_secs = float(warmup_secs)
        self.ranks: dict[int, RankIndex] = {}
        self._clock = clock
        self._rng = random.Random(seed)
        # Picks: precise ones, fallbacks to the approximate tree by reason, hit-block histogram.
        self.picks = 0
        self.fallbacks: dict[str, int] = {"stale": 0, "no_ids": 0, "unsubscribed": 0}
        self.hit_counts = [0] * (len(HIT_BUCKETS) + 1)
        self.hit_sum = 0

    # ---- the subscriber's side ----------------------------------------------------------------
    def attach(self, t: int, block_size: int) -> RankIndex:
        """Start (or restart) indexing target row ``t``: an empty index, warming up."""
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        r = RankIndex(int(block_size))
        self.ranks[t] = r
        return r

    def detach(self, t: int) -> None:
        self.ranks.pop(t, None)

    def mark_stale(self, t: int) -> None:
        """The rank's stream is not whole: its index is cleared and not used until it has been
        whole again for ``warmup_secs``."""
        r = self.ranks.get(t)
        if r is not None:
            r.clear()
            r.state = STALE

    def mark_whole(self, t: int, cold: bool = False) -> None:
        """The rank's stream is whole from now on (``cold``: from the publisher's first batch,
        so the index holds everything the rank stored and is used at once)."""
        r = self.ranks.get(t)
        if r is None:
            return
        if cold:
            r.state = FRESH
        elif r.state == STALE:
            r.state = WARMING
            r.whole_since = self._clock()

    def state(self, t: int) -> str:
        r = self.ranks.get(t)
        if r is None:
            return OFF
        if r.state == WARMING and self._clock() - r.whole_since >= self.warmup_secs:
            r.state = FRESH
        return r.state

    def apply(self, t: int, events: Sequence[Any]) -> int:
        """Apply decoded events (objects with a ``kind`` of stored/removed/cleared, see
        control/kvevents.py) to row ``t``; returns the blocks they touched."""
        r = self.ranks.get(t)
        if r is None:
            return 0
        n = 0
        for ev in events:
            kind = ev.kind
            if kind == "stored":
                n += r.store(ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.block_size)
            elif kind == "removed":
                r.remove(ev.block_hashes)
                n += len(ev.block_hashes)
            else:
                n += len(r.by_hash)
                r.clear()
        r.bound(min(self.max_blocks, r.cap_blocks) if r.cap_blocks else self.max_blocks)
        return n

    def set_queue(self, t: int, uncached_tokens: int, capacity: int = 0) -> None:
        """A pushed stat: ``uncached_tokens`` wait on row ``t`` now; ``capacity`` is its KV in
        tokens (0: unknown), which bounds what its index can hold (the engine cannot cache more)."""
        r = self.ranks.get(t)
        if r is not None:
            if capacity > 0:
                r.cap_blocks = capacity // r.block_size + 1
            r.queue_tokens = int(uncached_tokens)
            r.booked = 0

    def blocks(self, t: int) -> int:
        r = self.ranks.get(t)
        return len(r.by_hash) if r is not None else 0

    # ---- the pick ---------------------------------------------------------------------------
    def queue(self, t: int, tab: np.ndarray) -> int:
        """Input tokens waiting ahead of a new request on row ``t`` (module docstring)."""
        r = self.ranks.get(t)
        if r is not None and r.queue_tokens >= 0:
            return r.queue_tokens + r.booked
        return reference.pending(tab, t)

    def covers(self, targets: Sequence[int]) -> str | None:
        """None when every target's index is fresh, else the reason the pick falls back."""
        for t in targets:
            s = self.state(t)
            if s != FRESH:
                self.fallbacks["unsubscribed" if s == OFF else "stale"] += 1
                return s
        return None

    def hits(self, ids: Sequence[int], targets: Sequence[int]) -> list[int]:
        """Leading blocks of ``ids`` each target holds (0 for a target not indexed)."""
        ranks = self.ranks
        by_size: dict[int, list[int]] = {}
        out = [0] * len(targets)
        for i, t in enumerate(targets):
            r = ranks.get(t)
            if r is not None and r.keys:
                by_size.setdefault(r.block_size, []).append(i)
        for bs, idx in by_size.items():
            alive = [(i, ranks[targets[i]].keys) for i in idx]
            h = ROOT
            end = min(len(ids) - bs + 1, MAX_BLOCKS * bs)
            for depth, start in enumerate(range(0, max(end, 0), bs), 1):
                h = hash((h, tuple(ids[start : start + bs])))
                alive = [(i, keys) for i, keys in alive if h in keys]
                if not alive:
                    break
                for i, _ in alive:
                    out[i] = depth
        return out

    def pick(self, ids: Sequence[int], targets: Sequence[int], tokens: int, tab: np.ndarray) -> tuple[int, int]:
        """(target, hit blocks) of the cheapest candidate (module docstring); (-1, 0) when
        ``targets`` is empty. The caller has checked ``covers``."""
        if not targets:
            return -1, 0
        hit = self.hits(ids, targets)
        ranks = self.ranks
        best: list[int] = []
        best_key: tuple[int, int, int] | None = None
        for i, t in enumerate(targets):
            r = ranks.get(t)
            saved = hit[i] * (r.block_size if r is not None else 0)
            cost = self.queue(t, tab) + max(tokens - saved, 0)
            key = (cost, -hit[i], int(tab[t, COL_IN_FLIGHT]))
            if best_key is None or key < best_key:
                best_key, best = key, [i]
            elif key == best_key:
                best.append(i)
        i = best[0] if len(best) == 1 else self._rng.choice(best)
        h = hit[i]
        r = ranks.get(targets[i])
        if r is not None:  # what it adds to the rank's queue until the next stat says
            r.booked += max(tokens - h * r.block_size, 0)
        self.picks += 1
        self.hit_sum += h
        b = 0
        while b < len(HIT_BUCKETS) and h > HIT_BUCKETS[b]:
            b += 1
        self.hit_counts[b] += 1
        return targets[i], h
