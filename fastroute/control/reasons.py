"""Why the groups picked what they picked, counted: ``fastroute_pick_reasons_total{role,
reason}`` and the live view's decisions per second (control/dashboard.py).

cache_aware counts its own rules (the engines' KV events found cached blocks: ``prefix_blocks``;
the prefix tree's match: ``prefix_hit``; its imbalance escape: ``load``; a miss placed by the
tree's fallback rule: ``prefix_miss``) in each process, and the children ship them with their
other decision totals (``Stats.decisions``, family ``pick``). Every other policy has one rule, so
its count is the picks of its targets in the shared table, the same in every process.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fastroute.core.table import COL_PICKS

FAMILY = "pick"
# The one rule of each policy that is not cache_aware.
RULE_REASON = {
    "random": "random",
    "round_robin": "round_robin",
    "power_of_two": "load",
    "least_requests": "load",
    "least_load": "load",
    "bucket": "load",
    "consistent_hashing": "key_hash",
    "manual": "key",
}


def tree_decisions(groups: dict) -> dict[tuple[str, str, str], int]:
    """The cache_aware groups' reason totals of this process, keyed as ``Stats.decisions``."""
    out: dict[tuple[str, str, str], int] = {}
    seen: set[int] = set()
    for role, g in groups.items():
        if getattr(g, "policy", None) != "cache_aware":
            continue
        tree = g.policy_impl.tree_policy.tree
        out[(role, FAMILY, "prefix_hit")] = int(tree.hits)
        out[(role, FAMILY, "load")] = int(tree.balanced)
        out[(role, FAMILY, "prefix_miss")] = int(tree.misses)
        idx = g.kv_index
        if idx is not None and id(idx) not in seen:  # (one index may serve several groups)
            seen.add(id(idx))
            out[(role, FAMILY, "prefix_blocks")] = int(idx.picks)
    return out


def reason_totals(decisions: dict, groups: dict, targets: list, snap: np.ndarray) -> dict[tuple[str, str], int]:
    """(role, reason) -> picks: the ``pick`` family of ``decisions`` (every process's merged)
    plus, for the other policies, their targets' picks in the table snapshot ``snap``
    (``targets``: the collector's (row, name, role, model) list)."""
    out: dict[tuple[str, str], int] = {}
    for (role, family, reason), n in decisions.items():
        if family == FAMILY:
            out[(role, reason)] = out.get((role, reason), 0) + int(n)
    for role, g in groups.items():
        policy: Any = getattr(g, "policy", None)
        if policy == "cache_aware" or policy is None:
            continue
        key = (role, RULE_REASON.get(policy, policy))
        out[key] = out.get(key, 0) + sum(int(snap[t, COL_PICKS]) for t, _n, r, _m in targets if r == role)
    return out
