"""Bridge between the proxy and the compiled kernels: groups of targets with a policy.

The proxy never touches arrays: it asks a ``Group`` for a lease with
``acquire(tokens, key, meta, out_tokens)`` and gets back a ``Lease`` (plain ints and an
idempotent ``release()``) or None when no target is eligible. ``Group.acquire`` is the bound
``acquire`` of the group's policy object (core/policies.py, built by ``make_policy``); for the
compiled policies that object is the compiled kernel (``_ledger.Picker``) itself, so a pick costs
one call. Only cache_aware reads ``meta`` (its ``routing_text()``), so the proxy never branches
on a policy. A group also owns its candidate list (kept in the kernel and handed to policies
with per-target state) and the ring of consistent_hashing.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from fastroute.core import _ledger, _manual, _policy
from fastroute.core.kvindex import KvIndex
from fastroute.core.policies import ManualKeys, Policy, PrefixTree, make_policy
from fastroute.core.speed import SpeedBook
from fastroute.core.speedplace import SpeedDecode, SpeedPrefill
from fastroute.core.table import TargetTable
from fastroute.names import LOAD_METRICS, MODE_CODE, POLICIES, SPEED_POLICIES

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
        kv_index: KvIndex | None = None,
        speed_role: str | None = None,
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
        # The engine's KV events (core/kvindex.py): read by cache_aware only.
        self.kv_index = kv_index if policy == "cache_aware" else None
        self.policy = policy
        self.load_metric = load_metric
        self.demand = demand
        self.request_weight = int(request_weight)
        self.targets: list[int] = []
        self.names: list[str] = []
        compiled = "random" if policy in ("cache_aware", "manual") else policy
        # cache_aware bounded to the least-loaded ranks is least_requests with the tree breaking
        # ties; with synced replicas the compiled kernel plans bursts with the others
        # (_policy.pick_coordinated) and the tree only learns the text.
        coordinate = policy == "cache_aware" and self.rank_slack == 0
        if coordinate:
            compiled, kernel_metric = "power_of_two", "least_requests"
        else:
            kernel_metric = load_metric
        # The compiled kernel: candidates, booking, and the pick of the compiled policies.
        self.kernel = _ledger.Picker(
            router.table.array,
            router.table.header,
            compiled,
            kernel_metric,
            MODE_CODE[demand],
            self.request_weight,
            seed,
            MODE_CODE[kv_fit],
            int(kv_reserve),
        )
        self._cands = np.zeros(0, dtype=np.int64)
        self._ring: tuple[np.ndarray, np.ndarray] | None = None  # consistent_hashing's whole ring
        self._allowed: tuple[int, ...] | None = None  # restrict(): the rows picked among
        self.kv_reserve = int(kv_reserve)
        # The group's policy (core/policies.py): the kernel itself for the compiled policies,
        # else an object that holds the kernel. ``acquire`` is its bound method: one call.
        self.policy_impl: Policy = make_policy(
            router.table,
            router.config,
            policy,
            self.kernel,
            demand,
            self.request_weight,
            seed,
            kv_fit,
            kv_reserve,
            self.rank_slack,
            coordinate,
            self.kv_index,
        )
        # --speed-aware (core/speedplace.py): the group's policy decides what the fits do not.
        book, mode = router.speed, getattr(router.config, "speed_aware", "off")
        if book is not None and speed_role == "decode":
            self.policy_impl = SpeedDecode(
                self.kernel,
                self.policy_impl,
                book,
                router.table.array,
                mode,
                kv_fit,
                demand,
                self.request_weight,
                int(kv_reserve),
                seed ^ 0x5EED,
            )
        elif book is not None and speed_role == "prefill" and policy in SPEED_POLICIES:
            self.policy_impl = SpeedPrefill(self.kernel, self.policy_impl, book, router.table.array, mode)
        self.acquire = self.policy_impl.acquire
        self._on_targets = getattr(self.policy_impl, "set_targets", None)

    def pick(self, tokens: int = 0, key: bytes | None = None, out_tokens: int = 0) -> int:
        """The target the compiled kernel would choose now, without booking (tests).  For
        cache_aware that is the random fallback, not the prefix-tree pick."""
        return self.kernel.pick(tokens, key, out_tokens)

    def book_target(self, t: int, tokens: int = 0) -> _ledger.Lease:
        """Book target ``t`` chosen elsewhere (a gateway's sidecar, tests): its Lease."""
        return self.kernel.book_target(t, tokens)

    def set_targets(self, targets: Sequence[int], names: Sequence[str] | None = None) -> None:
        targets = [int(t) for t in targets]
        names = list(names) if names is not None else [str(t) for t in targets]
        if len(names) != len(targets):
            raise ValueError("targets and names differ in length")
        self._cands = np.asarray(targets, dtype=np.int64)
        self._allowed = None
        self.kernel.set_candidates(self._cands)
        if self.policy == "consistent_hashing":
            self._ring = build_ring(targets, names)
            self.kernel.set_ring(*self._ring)
        if self._on_targets is not None:
            self._on_targets(targets, names, self._cands)
        self.targets = targets
        self.names = names

    def restrict(self, rows: Sequence[int] | None) -> None:
        """Pick only among ``rows``, a subset of the targets (None: all of them again), until
        the next call or the next change of targets: flow control leaves its saturated ranks
        out of the pick this way (dataplane/saturation.py). The candidate arrays the policies
        scan are swapped, so the pick itself does no more work; consistent_hashing keeps its
        ring, less the left-out ranks' points (their keys move clockwise, the others stay);
        manual keeps a key on its bound target."""
        allowed = None if rows is None else tuple(int(t) for t in rows)
        if allowed == self._allowed:
            return
        self._allowed = allowed
        cands = self._cands if allowed is None else np.asarray(allowed, dtype=np.int64)
        self.kernel.set_candidates(cands)
        if self._ring is not None:
            hashes, owners = self._ring
            if allowed is not None:
                keep = np.isin(owners, cands)
                hashes, owners = hashes[keep], owners[keep]
            self.kernel.set_ring(hashes, owners)
        impl: object = self.policy_impl
        while impl is not None:
            if isinstance(impl, PrefixTree):
                impl.targets = self.targets if allowed is None else list(allowed)
            if isinstance(impl, (PrefixTree, SpeedDecode, SpeedPrefill)):
                impl.rows = cands
            impl = getattr(impl, "inner", None)

    def track_in(self, ledger: TargetTable) -> None:
        """Also book every lease of this group in ``ledger``: a proxy process's private ledger,
        from which the supervisor reclaims exactly what the process held if it dies (its
        bookings, and the feed uses of its load indexes)."""
        self.kernel.set_own_ledger(ledger.array, ledger.header)

    @property
    def kv_counts(self) -> dict[str, int]:
        """KV-fit decisions: agree/disagree (shadow) and fallback (no rank had known capacity)."""
        k = self.kernel
        c = self.policy_impl.kv_counts if isinstance(self.policy_impl, PrefixTree) else (0, 0, 0)
        return {"agree": k.kv_agree + c[0], "disagree": k.kv_disagree + c[1], "fallback": k.kv_fallback + c[2]}

    @property
    def key_table(self) -> _manual.KeyTable | None:
        """The manual policy's key table (None under any other policy)."""
        return self.policy_impl.keys if isinstance(self.policy_impl, ManualKeys) else None

    @property
    def tokens_until_answer(self) -> bool:
        return bool(self.kernel.tokens_until_answer)

    def _tree_demand(self, i: int) -> int:
        return self.policy_impl.demand_counts[i] if isinstance(self.policy_impl, PrefixTree) else 0

    @property
    def shadow_agree(self) -> int:
        return self.kernel.shadow_agree + self._tree_demand(0)

    @property
    def shadow_disagree(self) -> int:
        return self.kernel.shadow_disagree + self._tree_demand(1)


class Router:
    """Owns the per-process RNG seeds and builds groups over one target table."""

    def __init__(self, table: TargetTable, seed: int | None = None, config=None) -> None:
        self.table = table
        self.config = config
        self._seed = int.from_bytes(os.urandom(8), "little") if seed is None else int(seed)
        self._groups = 0
        # The precise prefix index of this process (--kv-events auto): fed by the engine's KV
        # events (control/kvevents.py), read by the cache_aware groups that place prefills.
        self.kv_index: KvIndex | None = None
        if config is not None and getattr(config, "kv_events", "off") != "off":
            self.kv_index = KvIndex(
                max_blocks=int(config.kv_index_max_blocks),
                warmup_secs=float(config.kv_events_stale_secs),
                seed=self._seed ^ 0x6B76,
            )
        # Each server's measured speed (--speed-aware): fed by the relay, read by the groups.
        self.speed: SpeedBook | None = None
        if config is not None and getattr(config, "speed_aware", "off") != "off":
            self.speed = SpeedBook(table.array)
            self.speed.refuse_unmet = getattr(config, "speed_slo_unmet", "best_effort") == "refuse"

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
        kv_index: KvIndex | None = None,
        speed_role: str | None = None,
    ) -> Group:
        # Each group gets its own RNG stream, derived from the router seed and its creation order.
        seed = (self._seed + 0x9E3779B97F4A7C15 * (self._groups + 1)) & 0xFFFFFFFFFFFFFFFF
        self._groups += 1
        g = Group(
            self,
            policy,
            load_metric,
            demand,
            request_weight,
            seed,
            kv_fit,
            kv_reserve,
            rank_slack,
            kv_index,
            speed_role,
        )
        # A PD prefill's input tokens are its work until it answers (Lease.answered).
        g.kernel.tokens_until_answer = bool(tokens_until_answer)
        g.set_targets(targets, names)
        return g
