"""Routing policies: one interface, built by one factory.

A policy is an object with ``acquire(tokens, key, meta, out_tokens) -> Lease | None``: pick a
target of its group and book the request on it, or answer None when no target is eligible.
``tokens`` are the request's input tokens, ``key`` its routing key (bytes or None), ``meta`` the
parsed request (anything with ``routing_text()``; only the prefix tree reads it) and
``out_tokens`` its output budget (KV fit's need). The arguments are plain values rather than the
request object so that the compiled kernel takes them without attribute reads, and so that the
gateway picker and the tests can ask for a pick without a request.

:func:`make_policy` builds the one a group runs:

* the compiled kernel itself (``_ledger.Picker``) for round_robin, random, power_of_two,
  consistent_hashing, with decode input demand off or on and KV fit in any mode: a pick is one
  C call;
* :class:`ShadowDemand`: the kernel's pick, with the demand-cost pick it would have made logged
  (``--decode-input-demand shadow``);
* :class:`PrefixTree`: cache_aware, the prefix tree choosing among the candidates that KV fit
  and demand leave (``_policy.narrow``, one kernel for both), or with synced replicas the
  kernel's coordinated pick while the tree only learns the text;
* :class:`ManualKeys`: the manual policy's key table (a key keeps its target).

Policies that keep per-target state besides the kernel's candidates (the tree, the key table)
also have ``set_targets(targets, names, rows)``; the group calls it when its targets change.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from fastroute.core import _ledger, _manual, _policy, reference
from fastroute.core.cache_aware import CacheAwarePolicy
from fastroute.core.kvindex import KvIndex
from fastroute.core.table import HDR_REPLICAS, TargetTable
from fastroute.names import ASSIGNMENT_MODE_CODE, MODE_CODE

log = logging.getLogger("fastroute.routing")

_SHADOW = MODE_CODE["shadow"]
FALL_BACK = -2  # the precise index does not decide this pick: the approximate tree does


class Policy(Protocol):
    def acquire(
        self, tokens: int = 0, key: bytes | None = None, meta: Any = None, out_tokens: int = 0
    ) -> _ledger.Lease | None: ...


class ShadowDemand:
    """The kernel's usual pick; the demand-cost pick it was compared with goes to the debug log
    (the kernel counts agreement itself)."""

    __slots__ = ("kernel",)

    def __init__(self, kernel: _ledger.Picker) -> None:
        self.kernel = kernel

    def acquire(
        self, tokens: int = 0, key: bytes | None = None, meta: Any = None, out_tokens: int = 0
    ) -> _ledger.Lease | None:
        k = self.kernel
        lease = k.acquire(tokens, key, None, out_tokens)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "decode_demand legacy=%s demand=%s weight=%s tokens=%s", k.last_legacy, k.last_demand, k.weight, tokens
            )
        return lease


class ManualKeys:
    """The manual policy: a routing key is bound to a target on first sight (--assignment-mode)
    and keeps it while the target serves; the kernel books the chosen target."""

    __slots__ = ("kernel", "keys", "tab")

    def __init__(self, kernel: _ledger.Picker, keys: _manual.KeyTable, tab: np.ndarray) -> None:
        self.kernel = kernel
        self.keys = keys
        self.tab = tab

    def acquire(
        self, tokens: int = 0, key: bytes | None = None, meta: Any = None, out_tokens: int = 0
    ) -> _ledger.Lease | None:
        t = self.keys.pick_bound(key)
        return self.kernel.book_target(t, tokens) if t >= 0 else None

    def set_targets(self, targets: Sequence[int], names: Sequence[str], rows: np.ndarray) -> None:
        # Keys of a target that left are dropped now, so they are re-assigned on their next
        # request and a row handed to another worker does not inherit them.
        self.keys.bind(self.tab, rows)


class PrefixTree:
    """cache_aware: the target most likely to hold the prompt's prefix (core/cache_aware.py).

    With KV fit or decode input demand on (or in shadow), the tree chooses among what
    ``_policy.narrow`` leaves: the ranks where the request fits, then those of least demand
    cost; shadow modes let the tree choose from the unnarrowed set and count whether its choice
    is one the filter allowed. With synced replicas and a rank slack of 0 the kernel's
    coordinated pick places the request and the tree only learns its text."""

    __slots__ = (
        "kernel",
        "tree_policy",
        "tab",
        "header",
        "coordinate",
        "kv_fit",
        "demand",
        "weight",
        "kv_reserve",
        "narrowing",
        "targets",
        "rows",
        "demand_counts",
        "kv_counts",
        "kv_index",
    )

    def __init__(
        self,
        kernel: _ledger.Picker,
        tree_policy: CacheAwarePolicy,
        tab: np.ndarray,
        header: np.ndarray,
        coordinate: bool,
        kv_fit: str,
        demand: str,
        weight: int,
        kv_reserve: int,
        kv_index: KvIndex | None = None,
    ) -> None:
        self.kernel = kernel
        self.tree_policy = tree_policy
        self.kv_index = kv_index
        self.tab = tab
        self.header = header
        self.coordinate = coordinate
        self.kv_fit = MODE_CODE[kv_fit]
        self.demand = MODE_CODE[demand]
        self.weight = int(weight)
        self.kv_reserve = int(kv_reserve)
        self.narrowing = kv_fit != "off" or demand != "off"
        self.targets: list[int] = []
        self.rows = np.zeros(0, dtype=np.int64)
        self.demand_counts = [0, 0]  # agree, disagree (demand shadow)
        self.kv_counts = [0, 0, 0]  # agree, disagree (KV fit shadow), fallback (no capacity known)

    def set_targets(self, targets: list[int], names: Sequence[str], rows: np.ndarray) -> None:
        self.tree_policy.set_targets(targets, names)
        self.targets = targets  # the group's own list and rows (Group.set_targets), not copies
        self.rows = rows

    def acquire(
        self, tokens: int = 0, key: bytes | None = None, meta: Any = None, out_tokens: int = 0
    ) -> _ledger.Lease | None:
        if self.coordinate and self.header[HDR_REPLICAS] > 1:
            lease = self.kernel.acquire(tokens, key, None, out_tokens)
            if lease is not None and meta is not None:
                text = meta.routing_text()
                if text:
                    self.tree_policy.tree.insert(text, lease.target)
            return lease
        cands: Any = self.targets
        fits = ties = None
        if self.narrowing:
            need = tokens + out_tokens + self.kv_reserve
            tree = self.tree_policy.tree
            # KV fit alone and every eligible rank fits (the tree's free-KV index says so): the
            # filter would keep them all, so the tree picks over the group's own list (its load
            # index) and the chosen row is checked (a notice may have been lost); else filter.
            if not self.demand and tree.kv_all_fit(cands, need):
                t = self._choose(meta, cands, tokens)
                if t >= 0 and tree.kv_check(t, need):
                    if self.kv_fit == _SHADOW:
                        self.kv_counts[0] += 1
                    return self.kernel.book_target(t, tokens)
            choose, fits, ties, no_capacity = _policy.narrow(
                self.tab, self.rows, tokens, need, self.kv_fit, self.demand, self.weight
            )
            if no_capacity:
                self.kv_counts[2] += 1  # no capacity known: the usual policy decides
            if choose is not None:
                cands = choose
        t = self._choose(meta, cands, tokens)
        if t < 0:
            return None
        if fits is not None and self.kv_fit == _SHADOW:
            self.kv_counts[0 if t in fits else 1] += 1
        if ties is not None and self.demand == _SHADOW:
            self.demand_counts[0 if t in ties else 1] += 1
        return self.kernel.book_target(t, tokens)

    def _choose(self, meta: Any, cands: Any, tokens: int) -> int:
        """The engine-reported pick, or the tree's: a target, or -1 when none is eligible."""
        t = self._precise(meta, cands, tokens) if self.kv_index is not None else FALL_BACK
        if t == FALL_BACK:
            # The request's text is computed here, only for this policy (a join for chat).
            t = self.tree_policy.pick(meta.routing_text() if meta is not None else None, cands)
        return t

    def _precise(self, meta: Any, cands: Sequence[int], tokens: int) -> int:
        """The engine-reported pick (core/kvindex.py) among ``cands``: a target, -1 when none
        is eligible, FALL_BACK when the request has no token ids or a candidate's index is not
        fresh (the approximate tree decides)."""
        idx = self.kv_index
        assert idx is not None
        if not idx.ranks:
            return FALL_BACK  # no worker publishes: nothing to count
        ids = meta.routing_ids() if meta is not None else None
        if not ids:
            idx.fallbacks["no_ids"] += 1
            return FALL_BACK
        if idx.covers(cands) is not None:
            return FALL_BACK
        return idx.pick(ids, self._balanced(cands), tokens, self.tab)[0]

    def _balanced(self, cands: Sequence[int]) -> list[int]:
        """The eligible candidates a prefix hit may choose among: cache_aware's rules on
        in-flight requests (the abs/rel imbalance escape, then the rank slack)."""
        tab = self.tab
        live = [int(t) for t in cands if reference._row_eligible(tab, t)]
        if len(live) < 2:
            return live
        load = [reference.requests(tab, t) for t in live]
        lo, hi = min(load), max(load)
        tp = self.tree_policy
        if hi - lo > tp.balance_abs_threshold and hi > lo * tp.balance_rel_threshold:
            return [t for t, n in zip(live, load) if n == lo]
        if tp.rank_slack >= 0:
            return [t for t, n in zip(live, load) if n <= lo + tp.rank_slack]
        return live


def manual_keys(table: TargetTable, cfg: Any, seed: int) -> _manual.KeyTable:
    """The manual policy's key table, configured from --assignment-mode / --max-idle-secs /
    --max-manual-keys (``cfg``: the Config, or None for the defaults)."""
    mode = getattr(cfg, "assignment_mode", "random")
    max_idle = float(getattr(cfg, "max_idle_secs", 4 * 3600))
    every = float(getattr(cfg, "eviction_interval_secs", 60))
    bound = int(getattr(cfg, "max_manual_keys", 1_000_000))
    return _manual.KeyTable(table.array.shape[0], ASSIGNMENT_MODE_CODE[mode], max_idle, every, seed, bound)


def make_policy(
    table: TargetTable,
    config: Any,
    policy: str,
    kernel: _ledger.Picker,
    demand: str,
    request_weight: int,
    seed: int,
    kv_fit: str,
    kv_reserve: int,
    rank_slack: int,
    coordinate: bool,
    kv_index: KvIndex | None = None,
) -> Policy:
    """The policy object of a group over ``table`` whose compiled kernel is ``kernel`` (module
    docstring); ``config`` (the Config, or None for defaults) configures cache_aware and manual."""
    if policy == "manual":
        return ManualKeys(kernel, manual_keys(table, config, seed), table.array)
    if policy == "cache_aware":
        tree = CacheAwarePolicy(table, config, seed=seed, rank_slack=rank_slack)
        return PrefixTree(
            kernel,
            tree,
            table.array,
            table.header,
            coordinate,
            kv_fit,
            demand,
            request_weight,
            kv_reserve,
            kv_index,
        )
    if demand == "shadow":
        return ShadowDemand(kernel)
    return kernel
