"""cache_aware under --dp-aware: the rank slack (bounded-load affinity), which leg gets it by
default, and the compiled pick against the oracle with a slack."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastroute.config.cli import parse_args
from fastroute.core import reference as R
from fastroute.core.cache_aware import CacheAwarePolicy, leg_rank_slack
from fastroute.core.routing import Router
from fastroute.core.table import COL_IN_FLIGHT, TargetTable
from tests.stubs import StubMeta

PD = ["--pd-disaggregation", "--prefill", "http://p:30000", "8998", "--decode", "http://d:30000"]
DEFAULTS = dict(
    cache_threshold=0.3,
    balance_abs_threshold=64,
    balance_rel_threshold=1.5,
    eviction_interval_secs=60,
    max_tree_size=67108864,
)


@pytest.fixture
def tab():
    t = TargetTable(64)
    yield t
    t.unlink()


def legs(argv: list[str]) -> tuple[int, int, int]:
    c = parse_args(argv)
    return tuple(leg_rank_slack(c, role) for role in ("prefill", "decode", "regular"))


def test_default_policy_balances_pd_decode_ranks_only():
    # the default (no policy flag) and an explicit --policy cache_aware: decode ranks balanced
    assert legs(PD + ["--dp-aware"]) == (-1, 0, -1)
    assert legs(PD + ["--dp-aware", "--policy", "cache_aware"]) == (-1, 0, -1)
    # affinity on decode asked for explicitly: kept
    assert legs(PD + ["--dp-aware", "--decode-policy", "cache_aware"]) == (-1, -1, -1)
    # without --dp-aware the decode targets are whole servers: unchanged
    assert legs(PD) == (-1, -1, -1)
    # the flag sets every leg that decodes, never the prefill leg
    assert legs(PD + ["--dp-aware", "--decode-policy", "cache_aware", "--cache-aware-rank-slack", "2"]) == (-1, 2, 2)
    assert legs(["--worker-urls", "http://w:1", "--dp-aware", "--cache-aware-rank-slack", "1"]) == (-1, 1, 1)


def test_negative_slack_is_refused():
    with pytest.raises(SystemExit):
        parse_args(PD + ["--cache-aware-rank-slack", "-1"])


def test_slack_zero_sends_a_cached_prompt_to_the_least_loaded_rank(tab):
    ids = [tab.alloc() for _ in range(4)]
    pol = CacheAwarePolicy(tab, None, seed=3, rank_slack=0)
    pol.set_targets(ids, [f"w@{i}" for i in ids])
    text = "the same long system prompt " * 20
    for t, n in zip(ids, (3, 3, 1, 3)):
        tab.cells.store(t, COL_IN_FLIGHT, n)
    assert pol.pick(text, ids) == ids[2] and pol.last_reason == "least_loaded"
    # the prompt is now held by ids[2] only; a second rank becomes least loaded: the hit loses
    tab.cells.store(ids[2], COL_IN_FLIGHT, 4)
    tab.cells.store(ids[0], COL_IN_FLIGHT, 0)
    assert pol.pick(text, ids) == ids[0]
    # two holders within the slack: the hit goes to the less loaded holder
    pol2 = CacheAwarePolicy(tab, None, seed=3, rank_slack=2)
    pol2.set_targets(ids, [f"w@{i}" for i in ids])
    for t in ids[:2]:
        pol2.tree.insert(text, t)
    for t, n in zip(ids, (2, 1, 0, 0)):
        tab.cells.store(t, COL_IN_FLIGHT, n)
    assert pol2.pick(text, ids) == ids[1] and pol2.last_reason == "cache_hit"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    loads=st.lists(st.lists(st.integers(0, 30), min_size=8, max_size=8), min_size=1, max_size=30),
    slack=st.integers(0, 3),
    seed=st.integers(0, 2**32),
)
def test_default_decode_pick_never_exceeds_min_plus_slack(tab, loads, slack, seed):
    """The pick through the Group (what the decode leg runs) never lands on a rank holding more
    in-flight requests than the least-loaded rank + the slack, whatever the prompts share."""
    if tab.generation == 0:
        for _ in range(8):
            tab.alloc()
    ids = list(range(8))
    g = Router(tab, seed=seed).group(ids, "cache_aware", rank_slack=slack, names=[f"http://d:1@{i}" for i in ids])
    rng = random.Random(seed)
    shared = ["conversation %d " % k * 40 for k in range(3)]
    try:
        for row in loads:
            for t in ids:
                tab.cells.store(t, COL_IN_FLIGHT, row[t])
            text = rng.choice(shared) + str(rng.random())
            lease = g.acquire(10, None, StubMeta(text))
            assert lease is not None
            assert row[lease.target] <= min(row) + slack, (row, lease.target)
            lease.release()
    finally:
        for t in ids:
            tab.cells.store(t, COL_IN_FLIGHT, 0)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    reqs=st.lists(
        st.tuples(
            st.sampled_from([None, b"abc", b"abcdef", b"abxyz", b"q" * 9]),
            st.lists(st.integers(0, 6), min_size=4, max_size=4),
        ),
        min_size=1,
        max_size=30,
    ),
    slack=st.integers(0, 2),
)
def test_pick_with_slack_matches_oracle(tab, reqs, slack):
    ids = list(range(4))
    if tab.generation == 0:
        for _ in ids:
            tab.alloc()
    cfg = SimpleNamespace(**DEFAULTS, rank_slack=slack)
    pol = CacheAwarePolicy(tab, cfg, seed=5, rank_slack=slack)
    pol.set_targets(ids, [str(t) for t in ids])
    held: dict[int, list[bytes]] = {t: [] for t in ids}
    try:
        for text, loads in reqs:
            for t in ids:
                tab.cells.store(t, COL_IN_FLIGHT, loads[t])
            sizes = {t: R.held_bytes(held[t]) for t in ids}
            reason, allowed = R.tree_pick(held, sizes, dict(zip(ids, loads)), set(ids), text, cfg)
            got = pol.pick(text, ids)
            assert (pol.last_reason, got in allowed) == (reason, True), (text, loads, allowed)
            if text:
                held[got].append(text)
    finally:
        for t in ids:
            tab.cells.store(t, COL_IN_FLIGHT, 0)
