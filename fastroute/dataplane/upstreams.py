"""Where a pick goes: the routing groups by role, a route per target, the keep-alive pools, the
circuit breakers' outcomes and the retry backoff.

One :class:`Upstreams` per proxy process. It keeps one :class:`~fastroute.dataplane.route.Route`
per target the groups can pick, rebuilt when the registry's target set changes (its targets
listener), so an attempt is ``group(role).acquire(...)`` then ``routes[lease.target]``, never a
look at the registry. Routes whose worker, rank and framing inputs are unchanged are kept (one
worker joining must not rebuild the other 999); a removed worker's pool is retired with it.

``outcome`` is the one call site of the circuit breakers (which statuses count as failures is
``Breakers.status``'s rule); ``retry_later`` schedules an attempt after the exponential backoff
with jitter of protocol.md 7.2, or the worker's Retry-After when that is longer.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

from fastroute.dataplane.route import Route, rank_port
from fastroute.dataplane.telemetry import NULL_TELEMETRY, Telemetry
from fastroute.dataplane.upstream import Pool
from fastroute.tls import client_context

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable

    from fastroute.config import Config
    from fastroute.core.breaker import Breakers


class Upstreams:
    """The targets' side of the data plane (module docstring).

    ``breakers`` (a ``fastroute.core.breaker.Breakers``) is built by the runtime; None runs
    without circuit breakers. ``worker_tls`` is the TLS client context for https:// workers
    (made by the runtime from ``--ca-cert-paths`` and the client certificate; made with the
    system CAs on first need when None). ``route`` is the class of the routes (default
    :class:`~fastroute.dataplane.route.Route`; tracing hands in a subclass).
    """

    __slots__ = (
        "routes",
        "room_rng",
        "tel",
        "stats",
        "worker_tls",
        "_registry",
        "_groups",
        "_roles",
        "_breakers",
        "_loop",
        "_pools",
        "_pool_idle",
        "_api_key",
        "_rank_field",
        "_row_owner",
        "_backoff_initial",
        "_backoff_max",
        "_backoff_mult",
        "_backoff_jitter",
        "_retry_rng",
        "_route",
    )

    def __init__(
        self,
        config: Config,
        registry: Any,
        loop: asyncio.AbstractEventLoop,
        breakers: Breakers | None = None,
        room_rng: random.Random | None = None,
        worker_tls: Any = None,
        route: type[Route] | None = None,
    ) -> None:
        pd = bool(config.pd_disaggregation)
        self._registry = registry
        self._roles = ("prefill", "decode") if pd else ("regular",)
        self._loop = loop
        self._breakers = breakers
        self.tel: Telemetry = NULL_TELEMETRY  # App.stats swaps in the counting one
        self.stats: Any = None  # fastroute.control.metrics.Stats, to forget a removed worker's series
        self.worker_tls = worker_tls
        # The class of each target's route: Route, or a subclass that adds to it (--enable-trace).
        self._route = route if route is not None else Route
        # The bootstrap room of a PD pair (pd.py) is drawn from here.
        self.room_rng = room_rng if room_rng is not None else random.Random(config.seed)
        self._pools: dict[Any, Pool] = {}  # by (worker identity, port): a re-added URL is a new worker
        self._pool_idle = float(config.upstream_pool_idle_timeout_secs)
        self._api_key = config.api_key
        # The body key carrying the DP rank of a target split per rank: the regular request
        # under --dp-aware, the decode leg under PD (the prefill's rank travels in the room).
        self._rank_field: str | None = (
            config.rank_field("decode") if pd else config.rank_field("regular") if config.dp_aware else None
        )
        # Retries (protocol.md 7.2): exponential backoff with jitter between attempts.
        self._backoff_initial = float(config.retry_initial_backoff_ms) / 1000.0
        self._backoff_max = float(config.retry_max_backoff_ms) / 1000.0
        self._backoff_mult = float(config.retry_backoff_multiplier)
        self._backoff_jitter = float(config.retry_jitter_factor)
        self._retry_rng = random.Random(config.seed)
        # role -> the registry's group, asked once: a Registry makes its groups when it is built
        # and never replaces them, so a pick costs a dict lookup, not a Python call.
        self._groups: dict[str, Any] = {}
        self._row_owner: dict[int, Any] = {}
        self.routes: dict[int, Route] = {}  # target row -> Route (targets_changed)
        registry.add_listener(self.targets_changed)
        self.targets_changed("")

    def group(self, role: str) -> Any:
        """The registry's group of ``role`` (``registry.group``, remembered)."""
        g = self._groups.get(role)
        if g is None:
            g = self._groups[role] = self._registry.group(role)
        return g

    # -- outcomes and retries -----------------------------------------------------
    def outcome(self, target: int, result: int | BaseException) -> None:
        """Record what ``target``'s worker did: a response status, or a failure (connect error,
        broken stream, ``TIMEOUT``). The one call site of the breakers."""
        br = self._breakers
        if br is not None:
            if type(result) is int:
                br.status(target, result)
            else:
                br.failure(target)
        if type(result) is not int or result >= 500:
            self.tel.worker_error(self._registry, target, result)

    def retry_later(self, retry: int, wait: float, callback: Callable[[], None]) -> asyncio.TimerHandle:
        """Call ``callback`` after the backoff before retry number ``retry`` (0-based, with
        jitter), or after ``wait`` seconds (a worker's Retry-After; < 0: none) when longer."""
        delay = min(self._backoff_initial * self._backoff_mult**retry, self._backoff_max)
        j = self._backoff_jitter
        if j:
            delay *= self._retry_rng.uniform(1.0 - j, 1.0 + j)
        if wait > delay:
            delay = wait
        return self._loop.call_later(delay, callback)

    # -- targets and routes -------------------------------------------------------
    def targets_changed(self, role: str) -> None:
        """The registry's targets listener: routes for exactly the targets the groups can pick."""
        registry = self._registry
        info = registry.target_info
        breakers = self._breakers
        if breakers is not None:
            # A table row handed to another worker starts with clean breaker cells
            # (TargetTable.alloc zeroes the row); here only this process's cached
            # metric labels for the row are dropped.  Resetting the shared cells would
            # let a restarted proxy process close circuits the others opened.
            owners = self._row_owner
            moved = False
            for t, entry in enumerate(info):
                w = entry[0] if entry is not None else None
                if owners.get(t) is not w:
                    owners[t] = w
                    moved = True
                    breakers.forget_names(t)
            if moved and self.stats is not None:
                names = (registry.target_name(t) for t, e in enumerate(info) if e is not None)
                self.stats.forget_workers({n for n in names if n is not None})
        # Targets of a removed worker drop out (their in-flight requests already hold their
        # connections), and so does the worker's pool: a worker re-added under the same URL is
        # a new worker with a new pool, framed with its own key.
        routes: dict[int, Route] = {}
        old = self.routes
        for r in self._roles:
            for t in registry.group(r).targets:
                entry = info[t] if t < len(info) else None
                if entry is not None:
                    route = old.get(t)
                    if route is None or not _same_route(route, *entry):
                        route = self._build_route(*entry)
                    routes[t] = route
        self.routes = routes
        live = {(id(route.worker), route.port) for route in routes.values()}
        for key in [k for k in self._pools if (id(k[0]), k[1]) not in live]:
            self._pools.pop(key).retire()

    def _build_route(self, worker: Any, rank: int | None) -> Route:
        port = rank_port(worker, rank)
        key = worker.api_key or self._api_key
        if port is not None:  # a per-rank-port server: the rank's own port
            return self._route(worker, rank, self.pool_for(worker, port), key, self._rank_field, port)
        return self._route(worker, rank, self.pool_for(worker), key, self._rank_field)

    def pool_for(self, worker: Any, port: int | None = None) -> Pool:
        """The keep-alive pool of ``worker`` on ``port`` (default its own; one per worker
        object and port, made on first use)."""
        port = int(worker.port) if port is None else port
        pool = self._pools.get((worker, port))
        if pool is None:
            if worker.url.startswith("https://"):
                if self.worker_tls is None:
                    self.worker_tls = client_context()
                pool = Pool(worker.host, port, self._pool_idle, self._loop, self.worker_tls)
            else:
                pool = Pool(worker.host, port, self._pool_idle, self._loop)
            self._pools[(worker, port)] = pool
        return pool

    def close(self) -> None:
        """Close every pool (end of the shutdown grace period)."""
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
        self.routes.clear()


def _same_route(route: Route, worker: Any, rank: int | None) -> bool:
    """``route`` was built for this worker object and rank, with its current dp_size (the
    other framing inputs are fixed for a worker object)."""
    return (
        route.worker is worker
        and route.index == rank
        and route.prefill_dp_size == (int(worker.dp_size) if rank is not None else 1)
    )
