"""The ``cache_aware`` policy (sglang-router's default): route a request to the target most likely
to hold its prompt prefix in KV cache, unless in-flight loads are out of balance.

One pick, over the group's eligible targets (healthy, circuit not open):

1. Imbalanced -- ``max - min > balance_abs_threshold`` and ``max > min * balance_rel_threshold``
   over their in-flight requests -- picks the least-loaded target.
2. Otherwise the longest prefix match in the shared tree wins if ``match / len(text) >
   cache_threshold`` (a random one of the targets holding that match).
3. Otherwise the target with the smallest tree (fewest bytes held), which spreads new prompts.

With a rank slack N >= 0 (``--cache-aware-rank-slack``; by default 0 on the PD decode leg under
``--dp-aware``, see ``leg_rank_slack``) the pick is bounded first: only targets holding at most
the least-loaded one's in-flight requests + N take part, a hit goes to the least-loaded holder of
the match and a miss to the least-loaded target. Under DP attention every step waits for the
busiest rank, so affinity may only choose among ranks that keep the batch even.

The text is then inserted under the chosen target.  No text picks the least-loaded target and
inserts nothing.  Every tie is broken at random.  The tree, matching and eviction live in
``fastroute.core._tree`` (see its docstring: bytes, per-target LRU lists, inline eviction that keeps
every target within ``max_tree_size`` bytes after every pick).

Each proxy process keeps its own tree: what a target caches is learned from the requests this
process routed, while the loads come from the shared table and so cover every process.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from fastroute.core import _tree
from fastroute.core.table import TargetTable

DEFAULTS = {
    "cache_threshold": 0.3,
    "balance_abs_threshold": 64,
    "balance_rel_threshold": 1.5,
    "eviction_interval_secs": 60,
    "max_tree_size": 67108864,
}
REASONS = {
    _tree.REASON_NONE: "none",
    _tree.REASON_NO_TEXT: "no_text",
    _tree.REASON_BALANCE: "balance",
    _tree.REASON_HIT: "cache_hit",
    _tree.REASON_SMALLEST: "smallest_tree",
    _tree.REASON_LEAST: "least_loaded",
}


def leg_rank_slack(config: Any, role: str) -> int:
    """The rank slack of a leg's cache_aware (-1: unbounded affinity). Under --dp-aware the PD
    decode leg that inherits cache_aware from --policy balances its ranks (0: only the
    least-loaded ranks; the tree breaks ties); the prefill leg, an explicit --decode-policy
    cache_aware and regular mode keep affinity. --cache-aware-rank-slack sets every cache_aware
    leg that decodes (PD decode, regular)."""
    if role == "prefill":
        return -1
    explicit = getattr(config, "cache_aware_rank_slack", None)
    if explicit is not None:
        return int(explicit)
    inherited = getattr(config, "_decode_inherited", False)
    return 0 if role == "decode" and getattr(config, "dp_aware", False) and inherited else -1


class CacheAwarePolicy:
    """Prefix-tree policy for one group of targets; ``pick`` does not book (the Group does)."""

    def __init__(
        self, table: TargetTable, config: Any = None, *, seed: int | None = None, rank_slack: int = -1
    ) -> None:
        params = {k: getattr(config, k, v) if config is not None else v for k, v in DEFAULTS.items()}
        if not 0.0 <= float(params["cache_threshold"]) <= 1.0:
            raise ValueError("cache_threshold must be within [0, 1]")
        if int(params["max_tree_size"]) < 1:
            raise ValueError("max_tree_size must be >= 1")
        if seed is None:
            seed = getattr(config, "seed", None)
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        # Accepted for sglang-router compatibility; eviction needs no timer here because it runs
        # on the insert that crosses max_tree_size, in time proportional to what it evicts.
        self.eviction_interval_secs = params["eviction_interval_secs"]
        self.tree = _tree.PrefixTree(
            table.array,
            float(params["cache_threshold"]),
            int(params["balance_abs_threshold"]),
            float(params["balance_rel_threshold"]),
            int(params["max_tree_size"]),
            int(seed) & 0xFFFFFFFFFFFFFFFF,
            header=table.header,
        )
        self.tree.rank_slack = int(rank_slack)
        self.rank_slack = int(rank_slack)
        # The imbalance escape's thresholds, for the precise pick (core/policies.py) too.
        self.balance_abs_threshold = int(params["balance_abs_threshold"])
        self.balance_rel_threshold = float(params["balance_rel_threshold"])
        self._names: dict[int, str] = {}
        # The per-request entry point is the compiled method itself: one call per pick.
        self.pick = self.tree.pick  # type: ignore[method-assign]  # the compiled method itself

    def pick(self, text: str | None, targets: list[int]) -> int:  # replaced in __init__
        """Target row for a request with this text, or -1 when no target is eligible."""
        return self.tree.pick(text, targets)

    def set_targets(self, targets: Sequence[int], names: Sequence[str] | None = None) -> None:
        """New candidate set.  A removed target's entries are dropped, and so are a kept row's
        when its name changed (the row was freed and reused for another worker)."""
        targets = [int(t) for t in targets]
        names = list(names) if names is not None else [str(t) for t in targets]
        if len(names) != len(targets):
            raise ValueError("targets and names differ in length")
        for t, name in zip(targets, names):
            old = self._names.get(t)
            if old is not None and old != name:
                self.tree.drop(t)
        self.tree.set_targets(targets)
        self._names = dict(zip(targets, names))

    @property
    def last_reason(self) -> str:
        """Why the last pick went where it did (a value of REASONS)."""
        return REASONS[self.tree.last_reason]
