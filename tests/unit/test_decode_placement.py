"""Demand and KV fit under every decode policy, cache_aware (the default) included.

KV fit is a feasibility filter applied before the policy; demand ``on`` narrows to the
demand-argmin ties and the prefix tree chooses among them; shadow modes count one decision per
pick without changing it.
"""

from __future__ import annotations

import numpy as np
import pytest

from fastroute.core import _policy
from fastroute.core import reference as R
from fastroute.core.routing import POLICIES, Router
from fastroute.core.table import TargetTable


class _Meta:
    def __init__(self, text: str) -> None:
        self.text = text

    def routing_text(self) -> str:
        return self.text


@pytest.fixture
def tt():
    tab = TargetTable(16)
    ids = [tab.alloc() for _ in range(3)]
    yield tab, ids
    tab.unlink()


def _prime_tree(g, text: str, target: int) -> None:
    """Make the tree hold ``text`` under ``target`` (a real pick that lands there)."""
    for _ in range(50):
        lease = g.acquire(10, None, _Meta(text))
        lease.release()
        if g.policy_impl.tree_policy.tree.sizes().get(target):
            return
    raise AssertionError("could not prime the tree")


def test_demand_on_changes_the_cache_aware_pick(tt):
    tab, ids = tt
    g = Router(tab, seed=3).group(ids, "cache_aware", demand="on")
    text = "the same long prompt " * 20
    first = g.acquire(10, None, _Meta(text))
    first.release()
    hot = first.target
    # The tree now holds the prompt on `hot`; without demand it would keep going there.
    off = Router(tab, seed=3).group(ids, "cache_aware")
    _prime_tree(off, text, hot)
    assert off.acquire(10, None, _Meta(text)).target == hot
    # `hot` holds far more in-flight tokens than the others (the off group's lease stays booked
    # too): demand on moves the request away although the tree has its prefix there.
    big = g.book_target(hot, 1_000_000)
    for _ in range(20):
        lease = g.acquire(10, None, _Meta(text))
        assert lease.target != hot
        lease.release()
    big.release()


def test_shadow_modes_count_one_decision_per_pick_under_cache_aware(tt):
    tab, ids = tt
    for t in ids:
        tab.set_polled(t, 0, 0, 0, 100_000)
    g = Router(tab, seed=5).group(ids, "cache_aware", demand="shadow", kv_fit="shadow")
    leases = [g.acquire(100, None, _Meta("prompt %d" % i)) for i in range(30)]
    assert g.shadow_agree + g.shadow_disagree == 30
    kv = g.kv_counts
    assert kv["agree"] + kv["disagree"] == 30 and kv["fallback"] == 0
    for lease in leases:
        lease.release()


def test_kv_fit_filters_before_the_tree(tt):
    tab, ids = tt
    full, *rest = ids
    tab.set_polled(full, 0, 0, 99_000, 100_000)  # 1k free
    for t in rest:
        tab.set_polled(t, 0, 0, 0, 100_000)
    g = Router(tab, seed=7).group(ids, "cache_aware", kv_fit="on")
    text = "shared prefix " * 30
    off = Router(tab, seed=7).group([full], "cache_aware")  # teaches nothing to g's tree
    assert off.acquire(10, None, _Meta(text)).target == full
    for _ in range(20):
        lease = g.acquire(5_000, None, _Meta(text))
        assert lease.target != full  # 5k does not fit in its 1k
        lease.release()
    # unknown capacities everywhere: the tree decides and the fallback is counted
    for t in ids:
        tab.mark_unpolled(t)
    g.acquire(5_000, None, _Meta(text)).release()
    assert g.kv_counts["fallback"] == 1


# manual pins routing keys, so the config refuses demand and KV fit with it (test below).
@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "manual"])
def test_demand_on_and_kv_fit_on_compose_with_every_policy(tt, policy):
    tab, ids = tt
    for t in ids:
        tab.set_polled(t, 0, 0, 0, 100_000)
    g = Router(tab, seed=11).group(ids, policy, demand="on", kv_fit="on")
    heavy = g.book_target(ids[0], 50_000)
    for i in range(10):
        lease = g.acquire(100, b"k%d" % i, _Meta("p%d" % i))
        assert lease.target != ids[0]
        lease.release()
    heavy.release()


def test_helpers_match_their_reference_twins(tt):
    tab, ids = tt
    rng = np.random.default_rng(0)
    for _ in range(200):
        for t in ids:
            tab.set_polled(t, 0, 0, int(rng.integers(0, 90_000)), 100_000)
        leases = [
            tab_lease
            for t in ids
            for tab_lease in [Router(tab, seed=1).group([t], "random").book_target(t, int(rng.integers(0, 3)) * 1000)]
        ]
        cands = np.asarray(ids, dtype=np.int64)
        need, w = int(rng.integers(0, 60_000)), int(rng.integers(0, 3)) * 500
        for kv_mode in (0, 1, 2):
            for demand_mode in (0, 1, 2):
                args = (cands, 7, need, kv_mode, demand_mode, w)
                assert _policy.narrow(tab.array, *args) == R.narrow(tab.array, *args), (kv_mode, demand_mode)
        for lease in leases:
            lease.release()


@pytest.mark.parametrize(
    "flag,field", [("--decode-input-demand", "decode_input_demand"), ("--decode-kv-fit", "decode_kv_fit")]
)
def test_manual_policy_refuses_demand_and_kv_fit_by_name(flag, field):
    from fastroute.config import Config, ConfigError

    with pytest.raises(ConfigError) as exc:
        Config(pd_disaggregation=True, decode_policy="manual", **{field: "shadow"})
    assert exc.value.flag == flag and "power_of_two" in str(exc.value)
    with pytest.raises(ConfigError):
        Config(policy="manual", **{field: "on"})
