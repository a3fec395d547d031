"""The precise prefix index (core/kvindex.py): chains of blocks by token ids, bounds, freshness
and the cost rule of the pick, on a real target table."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastroute.core.kvindex import KvIndex, chain
from fastroute.core.table import COL_IN_FLIGHT_TOKENS, TargetTable

BS = 4


@dataclass
class Ev:
    kind: str
    block_hashes: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    block_size: int = BS
    parent_block_hash: int | None = None


def ids(n_blocks: int, salt: int = 0) -> list[int]:
    return [salt * 10_000 + i for i in range(n_blocks * BS)]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def table(n: int = 4) -> TargetTable:
    tab = TargetTable(capacity=8)
    for _ in range(n):
        t = tab.alloc()
        tab.set_healthy(t, True)
    return tab


def test_keys_do_not_depend_on_the_engine_hashes_and_chain_through_parents() -> None:
    idx = KvIndex(seed=1)
    idx.attach(0, BS)
    idx.attach(1, BS)
    p = ids(5)
    # Rank 0 stores 5 blocks in one event; rank 1 the same tokens in two chained events with
    # other engine hashes.
    idx.apply(0, [Ev("stored", [1, 2, 3, 4, 5], p)])
    idx.apply(1, [Ev("stored", [70, 71], p[: 2 * BS]), Ev("stored", [72, 73, 74], p[2 * BS :], parent_block_hash=71)])
    assert idx.hits(p, [0, 1]) == [5, 5]
    assert idx.hits(p[: 3 * BS] + [-1] * BS, [0, 1]) == [3, 3]
    assert idx.hits(ids(5, salt=9), [0, 1]) == [0, 0]
    assert len(chain(p, BS)) == 5 and chain(p + [1], BS) == chain(p, BS)
    # Removal by engine hash; the blocks after a hole no longer count as a prefix.
    idx.apply(0, [Ev("removed", [3])])
    assert idx.hits(p, [0]) == [2]
    idx.apply(1, [Ev("cleared")])
    assert idx.hits(p, [1]) == [0] and idx.blocks(1) == 0


def test_an_orphan_is_not_indexed_and_the_bound_drops_the_oldest() -> None:
    idx = KvIndex(max_blocks=3)
    idx.attach(0, BS)
    idx.apply(0, [Ev("stored", [9], ids(1), parent_block_hash=12345)])
    assert idx.blocks(0) == 0 and idx.ranks[0].orphans == 1
    idx.apply(0, [Ev("stored", [1, 2, 3, 4, 5], ids(5))])
    assert idx.blocks(0) == 3 and idx.ranks[0].evicted == 2
    assert idx.hits(ids(5), [0]) == [0]  # the first blocks went first: no prefix left


def test_freshness_cold_stale_and_warm_up() -> None:
    clock = Clock()
    idx = KvIndex(warmup_secs=10.0, clock=clock)
    assert idx.state(0) == "off"
    idx.attach(0, BS)
    assert idx.state(0) == "warming"
    idx.mark_whole(0, cold=True)
    assert idx.state(0) == "fresh" and idx.covers([0]) is None
    idx.apply(0, [Ev("stored", [1], ids(1))])
    idx.mark_stale(0)
    assert idx.state(0) == "stale" and idx.blocks(0) == 0
    assert idx.covers([0]) == "stale" and idx.fallbacks["stale"] == 1
    idx.mark_whole(0)
    clock.now += 9.9
    assert idx.state(0) == "warming"
    clock.now += 0.2
    assert idx.state(0) == "fresh"


def test_a_hit_wins_while_it_saves_more_than_the_queue_it_waits_behind() -> None:
    tab = table()
    idx = KvIndex(seed=2)
    for t in range(4):
        idx.attach(t, BS)
        idx.mark_whole(t, cold=True)
        idx.set_queue(t, 0)
    p = ids(10)  # 40 tokens
    idx.apply(2, [Ev("stored", list(range(1, 9)), p[: 8 * BS])])  # 32 of them on rank 2
    assert idx.pick(p, [0, 1, 2, 3], len(p), tab.array) == (2, 8)
    idx.set_queue(2, 31)  # 31 queued < 32 saved: the hit still wins
    assert idx.pick(p, [0, 1, 2, 3], len(p), tab.array)[0] == 2
    idx.set_queue(2, 33)  # 33 queued > 32 saved: an idle miss wins
    assert idx.pick(p, [0, 1, 2, 3], len(p), tab.array)[0] != 2
    # What a pick sends to a rank counts as queued there until the rank's next stat.
    idx.set_queue(2, 0)
    assert idx.pick(p, [2], len(p), tab.array) == (2, 8)
    assert idx.queue(2, tab.array) == len(p) - 8 * BS  # its uncached 8 tokens
    idx.set_queue(2, 0)
    assert idx.queue(2, tab.array) == 0
    # A rank that never pushed a stat: the router's own count from the table.
    tab.cells.add(3, COL_IN_FLIGHT_TOKENS, 40)
    assert idx.queue(3, tab.array) == 0  # rank 3 pushed a stat in the setup
    idx.ranks[3].queue_tokens = -1
    assert idx.queue(3, tab.array) == 40
    assert idx.picks == 4 and sum(idx.hit_counts) == 4


def test_the_pushed_capacity_bounds_the_index() -> None:
    idx = KvIndex(max_blocks=1000)
    idx.attach(0, BS)
    idx.set_queue(0, 0, capacity=3 * BS)  # 3 blocks of KV (+1 of slack)
    idx.apply(0, [Ev("stored", list(range(1, 11)), ids(10))])
    assert idx.blocks(0) == 4 and idx.ranks[0].evicted == 6
