"""Bridge between the proxy and the compiled kernels: groups of targets with a policy.

The proxy never touches arrays: it asks a ``Group`` for a lease with ``acquire(tokens, key, meta)``
and gets back a ``Lease`` (plain ints and an idempotent ``release()``) or None when no target is
eligible.  For the compiled policies ``Group.acquire`` *is* the compiled ``Picker.acquire``, so a
pick costs one Python call, and ``meta`` (the request, anything with ``routing_text()``) is not
looked at; only cache_aware asks it for its text, so the proxy never branches on a policy.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import numpy as np

from fastroute.core import _ledger, _manual, _policy
from fastroute.core.cache_aware import CacheAwarePolicy
from fastroute.core.table import HDR_REPLICAS, TargetTable
from fastroute.names import ASSIGNMENT_MODE_CODE, LOAD_METRICS, MODE_CODE, POLICIES

log = logging.getLogger("fastroute.routing")

RING_POINTS_PER_TARGET = 160


def hash64(data: bytes) -> int:
    """The 64-bit hash the ring uses for target names and routing keys."""
    return _policy.hash64(data)


def build_ring(
    targets: Sequence[int], names: Sequence[str], points: int = RING_POINTS_PER_TARGET
) -> tuple[np.ndarray, np.ndarray]:
    """Ring of ``points`` positions per target name, sorted by position.  Positions depend only on
    the name, so removing a target moves only the keys that lived on it."""
    if len(targets) != len(names):
        raise ValueError("targets and names differ in length")
    hashes = np.empty(len(targets) * points, dtype=np.uint64)
    owners = np.empty(len(targets) * points, dtype=np.int64)
    k = 0
    for t, name in zip(targets, names):
        base = name.encode()
        for i in range(points):
            hashes[k] = hash64(base + b"#" + str(i).encode())
            owners[k] = t
            k += 1
    order = np.argsort(hashes, kind="stable")
    return hashes[order], owners[order]


def _manual_keys(router: Router, seed: int) -> _manual.KeyTable:
    """The manual policy's key table, configured from --assignment-mode / --max-idle-secs /
    --max-manual-keys."""
    cfg = router.config
    mode = getattr(cfg, "assignment_mode", "random")
    max_idle = float(getattr(cfg, "max_idle_secs", 4 * 3600))
    every = float(getattr(cfg, "eviction_interval_secs", 60))
    bound = int(getattr(cfg, "max_manual_keys", 1_000_000))
    return _manual.KeyTable(router.table.array.shape[0], ASSIGNMENT_MODE_CODE[mode], max_idle, every, seed, bound)


class Group:
    """A candidate set (e.g. all decode ranks) with its policy; see module docstring."""

    def __init__(
        self,
        router: Router,
        policy: str,
        load_metric: str,
        demand: str,
        request_weight: int,
        seed: int,
        kv_fit: str = "off",
        kv_reserve: int = 0,
        rank_slack: int = -1,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; fastroute implements {', '.join(POLICIES)}")
        if load_metric not in LOAD_METRICS:
            raise ValueError(f"unknown load metric {load_metric!r}")
        if demand not in MODE_CODE:
            raise ValueError(f"decode input demand must be off, shadow or on, not {demand!r}")
        if request_weight and demand == "off":
            raise ValueError("a decode request weight needs decode input demand shadow or on")
        if kv_fit not in MODE_CODE:
            raise ValueError(f"decode KV fit must be off, shadow or on, not {kv_fit!r}")
        self.kv_fit = kv_fit
        self.rank_slack = int(rank_slack) if policy == "cache_aware" else -1
        self.policy = policy
        self.load_metric = load_metric
        self.demand = demand
        self.request_weight = int(request_weight)
        self.targets: list[int] = []
        self.names: list[str] = []
        compiled = "random" if policy in ("cache_aware", "manual") else policy
        # cache_aware bounded to the least-loaded ranks is least_requests with the tree breaking
        # ties; with synced replicas the compiled picker plans bursts with the others
        # (_policy.pick_coordinated) and the tree only learns the text.
        self._coordinate = policy == "cache_aware" and self.rank_slack == 0
        if self._coordinate:
            compiled, picker_metric = "power_of_two", "least_requests"
        else:
            picker_metric = load_metric
        self._header = router.table.header
        self._picker = _ledger.Picker(
            router.table.array,
            router.table.header,
            compiled,
            picker_metric,
            MODE_CODE[demand],
            self.request_weight,
            seed,
            MODE_CODE[kv_fit],
            int(kv_reserve),
        )
        # Set for the flavours that read them (cache_aware, manual), which are bound only then.
        self._text_policy: CacheAwarePolicy = None  # type: ignore[assignment]
        self._tab = router.table.array
        self._cands = np.zeros(0, dtype=np.int64)
        self.kv_reserve = int(kv_reserve)
        # cache_aware's own decision counters (the compiled picker's stay 0 under it).
        self._ca_demand = [0, 0]  # agree, disagree
        self._ca_kv = [0, 0, 0]  # agree, disagree, fallback
        self._keys: _manual.KeyTable = None  # type: ignore[assignment]
        if policy == "manual":
            self._keys = _manual_keys(router, seed)
            self.acquire = self._acquire_manual  # type: ignore[method-assign]  # bound per instance to its flavour
        elif policy == "cache_aware":
            self._text_policy = CacheAwarePolicy(router.table, router.config, seed=seed, rank_slack=self.rank_slack)
            if demand != "off" or kv_fit != "off":
                self.acquire = self._acquire_text_narrowed  # type: ignore[method-assign]  # bound per instance to its flavour
            else:
                self.acquire = self._acquire_text  # type: ignore[method-assign]  # bound per instance to its flavour
        elif demand == "shadow":
            self.acquire = self._acquire_shadow  # type: ignore[method-assign]  # bound per instance to its flavour
        else:
            self.acquire = self._picker.acquire  # type: ignore[method-assign, assignment]  # bound per instance; the kernel names meta 'text'

    # The acquire flavours share one signature:
    # (tokens=0, key=None, meta=None, out_tokens=0) -> Lease | None.
    def acquire(self, tokens: int = 0, key: bytes | None = None, meta=None, out_tokens: int = 0):
        raise NotImplementedError  # replaced per instance in __init__

    def _acquire_shadow(self, tokens: int = 0, key: bytes | None = None, meta=None, out_tokens: int = 0):
        lease = self._picker.acquire(tokens, key, None, out_tokens)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "decode_demand legacy=%s demand=%s weight=%s tokens=%s",
                self._picker.last_legacy,
                self._picker.last_demand,
                self.request_weight,
                tokens,
            )
        return lease

    def _acquire_coordinated(self, tokens: int, key: bytes | None, meta, out_tokens: int):
        lease = self._picker.acquire(tokens, key, None, out_tokens)
        text = meta.routing_text() if meta is not None and lease is not None else None
        if text and lease is not None:
            self._text_policy.tree.insert(text, lease.target)
        return lease

    def _acquire_text(self, tokens: int = 0, key: bytes | None = None, meta=None, out_tokens: int = 0):
        if self._coordinate and self._header[HDR_REPLICAS] > 1:
            return self._acquire_coordinated(tokens, key, meta, out_tokens)
        # The request's text is computed here, only for this policy (it costs a join for chat).
        t = self._text_policy.pick(meta.routing_text() if meta is not None else None, self.targets)
        if t < 0:
            return None
        return self._picker.book_target(t, tokens)

    def _acquire_manual(self, tokens: int = 0, key: bytes | None = None, meta=None, out_tokens: int = 0):
        t = self._keys.pick_bound(key)
        if t < 0:
            return None
        return self._picker.book_target(t, tokens)

    def _acquire_text_narrowed(self, tokens: int = 0, key: bytes | None = None, meta=None, out_tokens: int = 0):
        """cache_aware with KV fit and/or demand (see docs/balancing.md): KV fit is a
        feasibility filter applied first; demand ``on`` narrows to the demand-argmin ties, among
        which the prefix tree chooses (so demand decides, the tree breaks ties and still learns
        the text); shadow modes let the tree pick from the unnarrowed set and count whether the
        pick is one the filter would also have allowed (one decision per pick)."""
        if self._coordinate and self._header[HDR_REPLICAS] > 1:
            return self._acquire_coordinated(tokens, key, meta, out_tokens)
        cands = self.targets
        fits: list[int] | None
        ties: list[int] | None = None
        arr = self._cands
        tab = self._tab
        kv = self.kv_fit
        if kv != "off":
            fits, roomiest = _policy.kv_feasible(tab, arr, tokens + out_tokens + self.kv_reserve)
            if not roomiest:
                self._ca_kv[2] += 1  # no capacity known: the usual policy decides
                fits = None
            elif not fits:
                fits = roomiest  # nothing fits: the most free KV (as the kernel)
            if kv == "on" and fits is not None:
                cands = fits
                arr = np.asarray(fits, dtype=np.int64)
        else:
            fits = None
        if self.demand != "off":
            ties = _policy.demand_ties(tab, arr, tokens, self.request_weight)
            if self.demand == "on":
                cands = ties
        t = self._text_policy.pick(meta.routing_text() if meta is not None else None, cands)
        if t < 0:
            return None
        if kv == "shadow" and fits is not None:
            self._ca_kv[0 if t in fits else 1] += 1
        if self.demand == "shadow":
            self._ca_demand[0 if ties is not None and t in ties else 1] += 1
        return self._picker.book_target(t, tokens)

    def pick(self, tokens: int = 0, key: bytes | None = None, out_tokens: int = 0) -> int:
        """The target the compiled policy would choose now, without booking (tests).  For
        cache_aware that is the random fallback, not the prefix-tree pick."""
        return self._picker.pick(tokens, key, out_tokens)

    def set_targets(self, targets: Sequence[int], names: Sequence[str] | None = None) -> None:
        targets = [int(t) for t in targets]
        names = list(names) if names is not None else [str(t) for t in targets]
        if len(names) != len(targets):
            raise ValueError("targets and names differ in length")
        self._cands = np.asarray(targets, dtype=np.int64)
        self._picker.set_candidates(self._cands)
        if self.policy == "consistent_hashing":
            self._picker.set_ring(*build_ring(targets, names))
        if self._text_policy is not None:
            self._text_policy.set_targets(targets, names)
        if self._keys is not None:
            # Keys of a target that left are dropped now, so they are re-assigned on their next
            # request and a row handed to another worker does not inherit them.
            self._keys.bind(self._tab, np.asarray(targets, dtype=np.int64))
        self.targets = targets
        self.names = names

    def track_in(self, ledger: TargetTable) -> None:
        """Also book every lease of this group in ``ledger``: a proxy process's private ledger,
        from which the supervisor reclaims exactly what the process held if it dies."""
        self._picker.set_own_ledger(ledger.array)

    @property
    def kv_counts(self) -> dict[str, int]:
        """KV-fit decisions: agree/disagree (shadow) and fallback (no rank had known capacity)."""
        p, c = self._picker, self._ca_kv
        return {"agree": p.kv_agree + c[0], "disagree": p.kv_disagree + c[1], "fallback": p.kv_fallback + c[2]}

    @property
    def tokens_until_answer(self) -> bool:
        return bool(self._picker.tokens_until_answer)

    @property
    def shadow_agree(self) -> int:
        return self._picker.shadow_agree + self._ca_demand[0]

    @property
    def shadow_disagree(self) -> int:
        return self._picker.shadow_disagree + self._ca_demand[1]


class Router:
    """Owns the per-process RNG seeds and builds groups over one target table."""

    def __init__(self, table: TargetTable, seed: int | None = None, config=None) -> None:
        self.table = table
        self.config = config
        self._seed = int.from_bytes(os.urandom(8), "little") if seed is None else int(seed)
        self._groups = 0

    def group(
        self,
        targets: Sequence[int],
        policy: str,
        *,
        load_metric: str = "tokens",
        demand: str = "off",
        request_weight: int = 0,
        names: Sequence[str] | None = None,
        kv_fit: str = "off",
        kv_reserve: int = 0,
        rank_slack: int = -1,
        tokens_until_answer: bool = False,
    ) -> Group:
        # Each group gets its own RNG stream, derived from the router seed and its creation order.
        seed = (self._seed + 0x9E3779B97F4A7C15 * (self._groups + 1)) & 0xFFFFFFFFFFFFFFFF
        self._groups += 1
        g = Group(self, policy, load_metric, demand, request_weight, seed, kv_fit, kv_reserve, rank_slack)
        # A PD prefill's input tokens are its work until it answers (Lease.answered).
        g._picker.tokens_until_answer = bool(tokens_until_answer)
        g.set_targets(targets, names)
        return g
