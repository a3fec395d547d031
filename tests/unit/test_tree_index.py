"""cache_aware's load index (issue #52): a PrefixTree over 64 or more candidates reads min and max
in-flight requests, the least-loaded draw, each holder's eligibility at the walk and the smallest
tree from two tournament trees (core/_index.pxd) fed by the table header's feed, not from a scan
of every candidate per pick.

These tests drive the real writers (leases, the poll store, health, circuit and replica cells) on
a real shared-memory table, in one process and in two, and check the index path's choice set
(``PrefixTree.choices``) against the scan path's on the same tree, and each pick against it."""

from __future__ import annotations

import multiprocessing as mp
import random
from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastroute.core import _ledger, _policy, _tree
from fastroute.core import reference as R
from fastroute.core.cache_aware import CacheAwarePolicy
from fastroute.core.routing import Router
from fastroute.core.table import (
    CIRCUIT_CLOSED,
    CIRCUIT_OPEN,
    COL_IN_FLIGHT,
    COL_OTHERS_EST,
    COL_OTHERS_IN_FLIGHT,
    COL_OTHERS_OPEN,
    COL_OTHERS_TOKENS,
    COL_POLLED_TOKENS,
    TargetTable,
)
from tests.stubs import StubMeta

N = 96  # above INDEX_MIN_CANDS (64), not a power of two (padding leaves)
ROWS = 200


@pytest.fixture
def table():
    tab = TargetTable(256)
    for _ in range(ROWS):
        tab.alloc()
    yield tab
    tab.close()
    tab.unlink()


def tree(tab: TargetTable, seed: int = 7, slack: int = -1, **kw) -> _tree.PrefixTree:
    kw.setdefault("balance_abs_threshold", 3)
    t = _tree.PrefixTree(tab.array, seed=seed, header=tab.header, **kw)
    t.rank_slack = slack
    return t


def booker(tab: TargetTable) -> _ledger.Picker:
    """Books leases on chosen rows, as a Group's kernel does after the tree picked."""
    return _ledger.Picker(tab.array, tab.header, "random", seed=1)


def reset(tab: TargetTable) -> None:
    for t in range(ROWS):
        tab.set_healthy(t, True)
        tab.set_circuit(t, CIRCUIT_CLOSED)
        tab.mark_unpolled(t)
        for col in (COL_OTHERS_IN_FLIGHT, COL_OTHERS_TOKENS, COL_OTHERS_OPEN, COL_OTHERS_EST):
            tab.cells.store(t, col, 0)


def same_choices(tr: _tree.PrefixTree, text, cands) -> tuple[int, list[int]]:
    got = tr.choices(text, cands)
    assert tr.indexed
    want = tr.choices(text, cands, scan=True)
    assert got == want, (text, got, want)
    return want


def test_index_is_kept_only_for_a_stable_list_of_enough_distinct_rows(table):
    cands = list(range(100))
    tr = tree(table)
    tr.pick("abc", cands)
    assert not tr.indexed  # a list seen once (cache_aware's KV-fit narrowing): scanned
    tr.pick("abc", cands)
    assert tr.indexed and tr.index_rebuilds == 1
    small = list(range(63))
    tr.pick("abc", small)
    tr.pick("abc", small)
    assert not tr.indexed  # fewer than 64: the scan is as cheap
    twice = list(range(80)) + [3]
    tr.pick("abc", twice)
    tr.pick("abc", twice)
    assert not tr.indexed  # a row twice: no leaf of its own
    plain = _tree.PrefixTree(table.array, seed=1)  # no header: no feed to read
    plain.pick("abc", cands)
    plain.pick("abc", cands)
    assert not plain.indexed
    pol = CacheAwarePolicy(table, None, seed=3)  # the policy hands the tree the header
    pol.set_targets(cands)
    pol.pick("abc", cands)
    pol.pick("abc", cands)
    assert pol.tree.indexed


TEXT = st.binary(min_size=1, max_size=10).map(lambda b: bytes(97 + (x % 3) for x in b))

OPS = st.lists(
    st.tuples(
        st.sampled_from(
            [
                "pick",
                "pick",
                "release",
                "book",
                "poll",
                "health",
                "circuit",
                "others",
                "open",
                "estimate",
                "insert",
                "evict",
            ]
        ),
        st.integers(0, 10_000),
        st.one_of(st.none(), TEXT),
    ),
    min_size=1,
    max_size=50,
)


@settings(max_examples=70, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, slack=st.sampled_from([-1, -1, 0, 2]), seed=st.integers(0, 2**32))
def test_index_path_chooses_from_the_scan_paths_sets_after_any_writes(table, ops, slack, seed):
    # The group: 96 of the 200 rows, in a shuffled order; some rows outside it get written too.
    cands = random.Random(seed).sample(range(ROWS), N)
    tr = tree(table, seed=seed, slack=slack, max_tree_size=24)
    tr.set_targets(cands)
    kernel = booker(table)
    leases = []
    queries = [None, b"a", b"ab", b"abcab", b"cccc", b"bacbac"]
    try:
        tr.choices(None, cands)
        for op, a, text in ops:
            t = a % ROWS
            if op == "pick":
                want = same_choices(tr, text, cands)
                got = tr.pick(text, cands)
                assert (tr.last_reason, got in want[1]) == (want[0], True), (text, got, want)
                leases.append(kernel.book_target(got, a % 50))
            elif op == "book":
                leases.append(kernel.book_target(t, a % 50))
            elif op == "release" and leases:
                leases.pop(a % len(leases)).release()
            elif op == "poll":
                table.set_polled(t, 1, 0, a % 300, 1_000)
            elif op == "health":
                table.set_healthy(t, a % 3 != 0)
            elif op == "circuit":
                table.set_circuit(t, CIRCUIT_OPEN if a % 2 else CIRCUIT_CLOSED)
            elif op == "others":
                table.cells.store(t, COL_OTHERS_IN_FLIGHT, a % 7)
            elif op == "open":
                table.cells.store(t, COL_OTHERS_OPEN, a % 2)
            elif op == "estimate":
                table.cells.add(t, COL_OTHERS_EST, 1)
            elif op == "insert":
                tr.insert(text or b"abc", cands[a % N])
            elif op == "evict":
                tr.evict(a % 8)
            for q in queries:
                same_choices(tr, q, cands)
        tr.check()
    finally:
        for lease in leases:
            lease.release()
        reset(table)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    reqs=st.lists(
        st.tuples(
            st.one_of(st.none(), TEXT),
            st.lists(st.tuples(st.integers(0, 69), st.integers(0, 12)), max_size=6),
            st.lists(st.integers(0, 69), max_size=3),
        ),
        min_size=1,
        max_size=40,
    ),
    threshold=st.sampled_from([0.0, 0.3, 0.9]),
    slack=st.sampled_from([-1, 1]),
)
def test_indexed_policy_picks_as_the_reference_tree(table, reqs, threshold, slack):
    # The pure-Python twin (reference.tree_pick) at 70 candidates: the index's picks land in the
    # set it allows, for the reason it gives, through the policy the Group uses.
    ids = list(range(70))
    cfg = SimpleNamespace(
        cache_threshold=threshold,
        balance_abs_threshold=8,
        balance_rel_threshold=1.5,
        eviction_interval_secs=60,
        max_tree_size=1 << 20,
        rank_slack=slack,
    )
    pol = CacheAwarePolicy(table, cfg, seed=5, rank_slack=slack)
    pol.set_targets(ids)
    held: dict[int, list[bytes]] = {t: [] for t in ids}
    loads = dict.fromkeys(ids, 0)
    unhealthy: set[int] = set()
    try:
        pol.pick(None, ids)
        for text, changes, flips in reqs:
            for t, n in changes:
                table.cells.store(t, COL_IN_FLIGHT, n)
                loads[t] = n
            for t in flips:
                unhealthy ^= {t}
                table.set_healthy(t, t not in unhealthy)
            sizes = {t: R.held_bytes(held[t]) for t in ids}
            reason, allowed = R.tree_pick(held, sizes, loads, set(ids) - unhealthy, text, cfg)
            got = pol.pick(text, ids)
            assert pol.tree.indexed
            if reason == "none":
                assert got == -1
                continue
            assert (pol.last_reason, got in allowed) == (reason, True), (text, got, allowed)
            if text:
                held[got].append(text)
        assert pol.tree.index_fallbacks == 0
    finally:
        for t in ids:
            table.cells.store(t, COL_IN_FLIGHT, 0)
        reset(table)


def test_least_loaded_and_smallest_tree_ties_are_uniform(table):
    cands = list(range(128))
    tr = tree(table, seed=11)
    tr.set_targets(cands)
    tr.choices(None, cands)
    for t in range(0, 128, 2):
        table.cells.add(t, COL_OTHERS_IN_FLIGHT, 1)  # the odd rows are the least loaded
    counts = Counter(tr.pick(None, cands) for _ in range(64 * 400))
    assert tr.indexed and set(counts) == set(range(1, 128, 2))
    # 64 tied rows, 400 expected each: a uniform draw stays well inside +-30%
    assert min(counts.values()) > 280 and max(counts.values()) < 520, counts
    reset(table)
    seen: Counter[int] = Counter()
    for i in range(64 * 200):
        tr.evict(0)  # every tree empty, then the even rows hold one text: the odd are smallest
        for t in range(0, 128, 2):
            tr.insert(b"x", t)
        seen[tr.pick(b"q%d" % i, cands)] += 1
        assert tr.last_reason == _tree.REASON_SMALLEST
    assert set(seen) == set(range(1, 128, 2))
    assert min(seen.values()) > 140 and max(seen.values()) < 260, seen


def test_the_smallest_tree_follows_eligibility_from_the_feed(table):
    # The smallest-tree index learns a leaf's eligibility from the feed drain: an unhealthy
    # empty target is passed over, and chosen again once it is healthy.
    cands = list(range(100))
    tr = tree(table)
    tr.set_targets(cands)
    for t in cands:
        if t != 42:
            tr.insert(b"held by %d" % t, t)
    tr.choices(None, cands)
    assert same_choices(tr, b"zzz", cands) == (_tree.REASON_SMALLEST, [42])
    table.set_healthy(42, False)
    reason, who = same_choices(tr, b"zzz", cands)
    assert (reason, who) == (_tree.REASON_SMALLEST, list(range(10)))  # "held by 0".."held by 9"
    table.set_healthy(42, True)
    assert same_choices(tr, b"zzz", cands) == (_tree.REASON_SMALLEST, [42])
    assert tr.pick(b"zzz", cands) == 42


def test_a_holder_made_ineligible_is_no_hit(table):
    cands = list(range(100))
    tr = tree(table)
    tr.set_targets(cands)
    tr.insert(b"shared prefix", 7)
    tr.choices(None, cands)
    assert same_choices(tr, b"shared prefix!", cands) == (_tree.REASON_HIT, [7])
    table.set_circuit(7, CIRCUIT_OPEN)
    assert same_choices(tr, b"shared prefix!", cands)[0] == _tree.REASON_SMALLEST
    table.set_circuit(7, CIRCUIT_CLOSED)
    table.cells.store(7, COL_OTHERS_IN_FLIGHT, 2)
    tr.rank_slack = 1  # above min + slack: not a holder this pick may use
    assert same_choices(tr, b"shared prefix!", cands)[0] == _tree.REASON_LEAST
    tr.rank_slack = 2
    assert same_choices(tr, b"shared prefix!", cands) == (_tree.REASON_HIT, [7])
    reset(table)


def test_a_row_written_without_its_notice_is_caught_at_the_pick(table):
    # A writer that died between its write and its notice: the pick checks the row of what it
    # chose, corrects the leaf and picks again by scan.
    cands = list(range(100))
    tr = tree(table)
    tr.set_targets(cands)
    for t in range(1, 100):
        table.cells.add(t, COL_OTHERS_IN_FLIGHT, 1)
    tr.choices(None, cands)
    assert tr.choices(None, cands) == (_tree.REASON_NO_TEXT, [0])
    table.array[0, COL_IN_FLIGHT] += 5  # no notice
    assert tr.pick(None, cands) != 0
    assert tr.index_fallbacks == 1
    assert same_choices(tr, None, cands) == (_tree.REASON_NO_TEXT, list(range(1, 100)))
    table.array[0, COL_IN_FLIGHT] -= 5
    reset(table)


def test_a_tree_behind_the_feed_rebuilds_both_indexes(table):
    cands = list(range(100))
    tr = tree(table)
    tr.set_targets(cands)
    for t in cands[1:]:
        tr.insert(b"t%d" % t, t)
    tr.choices(None, cands)
    built = tr.index_rebuilds
    kernel = booker(table)
    leases = [kernel.book_target(t % 100, 1) for t in range(5000)]  # more than the ring holds
    table.set_healthy(0, False)
    assert same_choices(tr, b"new", cands)[1] != [0]
    assert tr.index_rebuilds == built + 1
    for lease in leases:
        lease.release()
    table.set_healthy(0, True)
    assert same_choices(tr, b"new", cands) == (_tree.REASON_SMALLEST, [0])


def _writer(name: str, seed: int, rounds: int, done) -> None:
    tab = TargetTable.attach(name)
    rs = np.random.default_rng(seed)
    kernel = booker(tab)
    leases = []
    for _ in range(rounds):
        r = rs.random()
        if r < 0.45:
            leases.append(kernel.book_target(int(rs.integers(0, ROWS)), int(rs.integers(1, 30))))
        elif r < 0.85 and leases:
            leases.pop(int(rs.integers(0, len(leases)))).release()
        elif r < 0.95:
            tab.cells.store(int(rs.integers(0, ROWS)), COL_OTHERS_IN_FLIGHT, int(rs.integers(0, 3)))
        else:
            tab.set_healthy(int(rs.integers(0, ROWS)), bool(rs.random() < 0.7))
    # Leave some bookings and some unhealthy rows behind: the parent's index must show them.
    for lease in leases[: len(leases) // 2]:
        lease.release()
    done.put(len(leases) - len(leases) // 2)
    tab.close()


def test_a_tree_in_one_process_follows_writes_from_another(table):
    cands = list(range(0, ROWS, 2)) + list(range(1, ROWS, 2))
    tr = tree(table, seed=3)
    tr.set_targets(cands)
    rnd = random.Random(4)
    texts = [bytes(rnd.choice(b"abc") for _ in range(8)) for _ in range(50)]
    tr.choices(None, cands)
    ctx = mp.get_context("spawn")
    done = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(table.name, s, 4000, done)) for s in (1, 2)]
    for proc in procs:
        proc.start()
    picks = 0
    while any(p.is_alive() for p in procs) or picks < 200:
        got = tr.pick(rnd.choice(texts), cands)  # picks while the others write
        assert got in cands
        picks += 1
    held = [done.get(timeout=60) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    assert sum(held) > 0
    for q in [None, *texts[:10], b"zz"]:
        same_choices(tr, q, cands)
    # The writers' bookings are visible through the index: the least-loaded set has no booked row.
    least = tr.choices(None, cands)[1]
    assert least and all(table.in_flight(t) == min(table.in_flight(u) for u in least) for t in least)
    assert table.underflows == 0


def test_a_fleet_sized_group_never_rebuilds_in_steady_state():
    n = 8192
    tab = TargetTable(n)
    try:
        for _ in range(n):
            tab.alloc()
        cands = list(range(n))
        tr = tree(tab, seed=9)
        tr.set_targets(cands)
        kernel = booker(tab)
        tr.choices(None, cands)
        tr.choices(None, cands)  # the list's second use: indexed
        built = tr.index_rebuilds
        assert tr.indexed and built == 1
        rs = random.Random(2)
        held = []
        for i in range(3000):
            text = b"prefix %d" % rs.randrange(40) + b" tail" * rs.randrange(3)
            held.append(kernel.book_target(tr.pick(text if i % 5 else None, cands), 10))
            if len(held) > 300:
                held.pop(rs.randrange(len(held))).release()
        assert tr.index_rebuilds == built and tr.index_fallbacks == 0
        for q in (None, b"prefix 7", b"prefix 7 tail tail", b"unseen"):
            same_choices(tr, q, cands)
        for lease in held:
            lease.release()
        same_choices(tr, b"prefix 3", cands)
    finally:
        tab.close()
        tab.unlink()


# ---- cache_aware with KV fit: the filter skipped when every eligible rank fits ----------------


def all_fit(tab: TargetTable, cands, need: int) -> bool:
    """From the rows: every eligible candidate has a known capacity with ``need`` free (and one
    is eligible), i.e. ``_policy.narrow`` keeps every eligible candidate."""
    live = [t for t in cands if R._row_eligible(tab.array, t)]
    free = [_policy.free_kv(tab.array, t) for t in live]
    return bool(live) and all(f is not None and f >= need for f in free)


KV_OPS = st.lists(
    st.tuples(
        st.sampled_from(["book", "release", "poll", "unpoll", "health", "circuit", "others", "queue"]),
        st.integers(0, 10_000),
        st.integers(0, 900),
    ),
    min_size=1,
    max_size=50,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=KV_OPS, seed=st.integers(0, 2**32))
def test_the_free_kv_index_says_all_fit_exactly_when_the_filter_keeps_all(table, ops, seed):
    cands = random.Random(seed).sample(range(ROWS), N)
    for t in range(ROWS):
        table.set_polled(t, 0, 0, 0, 2_000)  # every rank known, 2,000 tokens free
    tr = tree(table)
    kernel = booker(table)
    leases = []
    try:
        for op, a, b in ops:
            t = a % ROWS
            if op == "book":
                leases.append(kernel.book_target(t, b))
            elif op == "release" and leases:
                leases.pop(a % len(leases)).release()
            elif op == "poll":
                table.set_polled(t, 1, 0, b, 1_000 if a % 4 else -1)
            elif op == "unpoll":
                table.mark_unpolled(t)
            elif op == "health":
                table.set_healthy(t, a % 3 != 0)
            elif op == "circuit":
                table.set_circuit(t, CIRCUIT_OPEN if a % 2 else CIRCUIT_CLOSED)
            elif op == "others":
                table.cells.store(t, COL_OTHERS_TOKENS, b)
            else:
                table.set_kv_queue(t, a % 2)
            for need in (0, 300, 900, 1_500):
                want = all_fit(table, cands, need)
                assert tr.kv_all_fit(cands, need) == want, (op, need)
                if want:  # the filter's own answer: every eligible candidate fits
                    fits = _policy.narrow(table.array, np.asarray(cands), 0, need, 2, 0, 0)[1]
                    assert sorted(fits) == sorted(t for t in cands if R._row_eligible(table.array, t))
    finally:
        for lease in leases:
            lease.release()
        reset(table)


def test_kv_fit_on_keeps_the_tree_indexed_while_every_rank_fits_and_filters_when_not(table):
    ids = list(range(96))
    for t in ids:
        table.set_polled(t, 0, 0, 0, 10_000)
    g = Router(table, seed=3).group(ids, "cache_aware", kv_fit="on")
    tr = g.policy_impl.tree_policy.tree
    held = [g.acquire(100, None, StubMeta(text=f"prompt {i % 7}")) for i in range(200)]
    assert tr.indexed  # the group's own list every pick: the filter was skipped
    for lease in held:
        lease.release()
    for t in ids[8:]:
        table.set_polled(t, 0, 0, 9_950, 10_000)  # 50 free: a 100-token request fits only 0..7
    for i in range(100):
        lease = g.acquire(100, None, StubMeta(text=f"prompt {i % 7}"))
        assert lease.target < 8, i
        lease.release()
    assert not tr.indexed  # filtered: the tree was handed the fitting ranks


def test_kv_fit_shadow_counts_agreement_on_the_skipped_filter(table):
    ids = list(range(80))
    for t in ids:
        table.set_polled(t, 0, 0, 0, 10_000)
    g = Router(table, seed=3).group(ids, "cache_aware", kv_fit="shadow")
    for i in range(50):
        g.acquire(10, None, StubMeta(text=f"p{i}")).release()
    assert g.policy_impl.kv_counts == [50, 0, 0]


def test_a_rank_that_stopped_fitting_without_a_notice_is_not_chosen(table):
    # A writer that died between its write and its notice: the free-KV index still says the rank
    # fits; the tree chooses it (the only empty tree), the check reads its row and the filter
    # decides instead.
    ids = list(range(80))
    for t in ids:
        table.set_polled(t, 0, 0, 0, 10_000)
    g = Router(table, seed=3).group(ids, "cache_aware", kv_fit="on")
    tr = g.policy_impl.tree_policy.tree
    for t in ids[1:]:
        tr.insert(b"held %d" % t, t)
    g.acquire(1, None, StubMeta(text="warm")).release()
    g.acquire(1, None, StubMeta(text="held 5")).release()
    assert tr.kv_all_fit(g.policy_impl.targets, 500)
    assert tr.choices(b"a new prompt", g.policy_impl.targets)[1] == [0]
    table.array[0, COL_POLLED_TOKENS] = 9_900  # 100 free, no notice
    lease = g.acquire(400, None, StubMeta(text="a new prompt"))
    assert lease.target != 0 and _policy.free_kv(table.array, lease.target) >= 400
    lease.release()
    assert not tr.kv_all_fit(g.policy_impl.targets, 500)  # the leaf was corrected
