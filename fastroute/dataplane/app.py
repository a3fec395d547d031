"""The proxy process's data path, assembled: one object of each concept, and the connection
factory.

One :class:`App` per proxy process. It builds, from the config and the parts the runtime hands
in, the objects a request meets, each given only what it reads:

* :class:`~fastroute.dataplane.limits.Limits`: the frozen settings;
* :class:`~fastroute.dataplane.live.Live`: the open connections and exchanges;
* :class:`~fastroute.dataplane.admission.Admission`: ``--max-concurrent-requests``, its queue and
  the token rate;
* :class:`~fastroute.dataplane.upstreams.Upstreams`: the groups, a route per target, the pools,
  the breakers' outcomes and the retry backoff;
* :class:`~fastroute.dataplane.endpoints.Endpoints`: what each path means, from a parsed request
  to its exchange;
* :class:`~fastroute.dataplane.sweep.Sweeper`: every deadline and the lease safety net, one timer.

A request then goes down once: protocol -> endpoints -> exchange -> upstreams -> route -> pool
(docs/design.md walks it). The App itself is off the request path: it makes the client
protocols (``protocol_factory``), swaps in the metrics when they run (``stats``), and drives
shutdown (``stop_accepting``, ``close``).

It never imports NumPy or the core's compiled modules: the circuit breakers and the reconciler
are built by the runtime and handed in; the routing groups come from the registry.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from fastroute.auth import AdminAuth, parse_control_plane_keys
from fastroute.dataplane import flowcontrol
from fastroute.dataplane._clock import monotonic
from fastroute.dataplane.admission import Admission
from fastroute.dataplane.endpoints import Endpoints
from fastroute.dataplane.headerflags import _F_FWD as F_FWD
from fastroute.dataplane.limits import Limits
from fastroute.dataplane.live import Live
from fastroute.dataplane.protocol import ClientProtocol
from fastroute.dataplane.speedmeter import SLO_HEADERS, metered
from fastroute.dataplane.sweep import Sweeper
from fastroute.dataplane.telemetry import NULL_TELEMETRY, RequestTelemetry, Telemetry
from fastroute.dataplane.upstreams import Upstreams

if TYPE_CHECKING:
    from fastroute.config import Config
    from fastroute.control.leases import Reconciler
    from fastroute.core.breaker import Breakers
    from fastroute.dataplane.tokenize import Tokens


class App:
    """One proxy process's data path (module docstring).

    ``breakers`` (a ``fastroute.core.breaker.Breakers``) and ``reconciler`` (a
    ``fastroute.control.leases.Reconciler``, only where this process audits the table) are built
    by the runtime (``runtime.assemble``); None runs without them. ``tokens`` is the tokenizer of
    ``--tokenizer-path`` (None without one); ``worker_tls`` the TLS client context for https://
    workers (None: the system CAs, made on first need). ``upstreams`` replaces the one built from the config
    (tests hand in one whose pools are stand-ins).
    """

    def __init__(
        self,
        config: Config,
        registry: Any,
        loop: asyncio.AbstractEventLoop | None = None,
        room_rng: Any = None,
        breakers: Breakers | None = None,
        reconciler: Reconciler | None = None,
        tokens: Tokens | None = None,
        upstreams: Upstreams | None = None,
        worker_tls: Any = None,
    ) -> None:
        loop = loop or asyncio.get_event_loop()
        # The one rule for admin paths (--api-key, or the control-plane keys with roles),
        # applied at head time when the call carries a body (protocol.on_headers_complete).
        admin_auth = AdminAuth(
            config.api_key, parse_control_plane_keys(config.control_plane_api_keys), config.admin_closed
        )
        guarded = admin_auth.api_key is not None or bool(admin_auth.keys) or admin_auth.closed
        self._backend = "pd" if config.pd_disaggregation else "regular"
        self._breakers = breakers
        self.tel: Telemetry = NULL_TELEMETRY
        self.limits = Limits(config, guarded)
        self.live = Live()
        # --enable-trace: exchanges and routes that add spans (tracing.py); off, nothing changes.
        exchange: Any = None
        route: Any = None
        self.tracer: Any = None
        if config.enable_trace:
            from fastroute.dataplane.tracing import traced_parts

            self.tracer, exchange, route = traced_parts(config, bool(config.pd_disaggregation))
        # --speed-aware: exchanges that time what they relay (speedmeter.py), the SLO headers
        # kept (and forwarded) for them to read. (checks.py refuses it with --enable-trace.)
        speed = getattr(getattr(registry, "router", None), "speed", None)
        if speed is not None:
            exchange = metered(speed, bool(config.pd_disaggregation))
            flags = self.limits.header_flags
            for name in SLO_HEADERS:
                flags[name] = flags.get(name, 0) | F_FWD
        self.upstreams = (
            upstreams
            if upstreams is not None
            else Upstreams(config, registry, loop, breakers, room_rng, worker_tls, route)
        )
        # Flow control (priority classes, tenants, shedding; dataplane/flowcontrol.py) only with
        # its flags: then it is the admission, else the plain concurrency limit is.
        self.flow = flowcontrol.install(config, loop, self.limits, self.upstreams, registry)
        self.admission = (
            self.flow
            if self.flow is not None
            else Admission(
                int(config.max_concurrent_requests),
                int(config.queue_size),
                float(config.queue_timeout_secs),
                loop,
                rate=config.rate_limit_tokens_per_second,
            )
        )
        self.endpoints = Endpoints(
            config,
            self.limits,
            self.upstreams,
            self.live,
            self.admission,
            registry,
            admin_auth,
            self.tel,
            loop,
            tokens,
            exchange,
        )
        if self.flow is not None:
            self.flow.begin = self.endpoints.begin
        self._top_n = int(config.priority_scheduler_tenant_metric_top_n)
        self.sweeper = Sweeper(self.live, self.limits, self.admission, loop, breakers, registry, reconciler)
        self.tls_listener = False
        self._stats: Any = None

    # fastroute.control.metrics.Stats of this process (set by the server when metrics
    # run): plain dict increments per request, turned into series at scrape time.
    @property
    def stats(self) -> Any:
        return self._stats

    @stats.setter
    def stats(self, stats: Any) -> None:
        self._stats = stats
        tel = RequestTelemetry(stats, self._backend) if stats is not None else NULL_TELEMETRY
        # Every holder of the telemetry, once; connections made from here on get it too.
        self.tel = self.endpoints.tel = self.admission.tel = self.upstreams.tel = self.sweeper.tel = tel
        self.upstreams.stats = stats
        if stats is not None and self.flow is not None:  # its counters are the exported series
            stats.flow_refusals = self.flow.refusals
            stats.flow_admitted = self.flow.admitted
            stats.flow_top_n = self._top_n
        if self._breakers is not None:
            self._breakers.stats = stats

    # -- lifecycle ----------------------------------------------------------
    def start(self) -> None:
        """Start the periodic sweep (timeouts and the lease safety net, sweep.py)."""
        self.sweeper.start()

    def protocol_factory(self) -> ClientProtocol:
        proto = ClientProtocol(self.endpoints, self.limits, self.live, self.tel)
        if self.tls_listener:
            # connection_made comes only after the TLS handshake; a client that never sends
            # its ClientHello still holds a socket, so it is counted (and timed) from here.
            self.live.handshaking[proto] = monotonic() + self.limits.header_timeout
            self.tel.connections(1)
        return proto

    @property
    def active(self) -> int:
        """Requests being answered (proxied exchanges + admin calls + admission queue)."""
        return len(self.live.exchanges) + len(self.endpoints.admin_tasks) + len(self.admission.queue)

    def stop_accepting(self) -> None:
        """Shutdown phase 1: from now on every response closes its connection. Idle connections
        stay open (one just accepted may carry a request in transit); they close at the end."""
        self.live.accepting = False

    def busy_connections(self) -> int:
        """Client connections with a request being read, queued or answered."""
        return sum(1 for c in self.live.connections if c.busy or c._req is not None or c.queue)

    def close(self) -> None:
        """Abort everything still open (end of the shutdown grace period)."""
        self.live.accepting = False
        self.sweeper.stop()
        tokens = self.endpoints.tokens
        if tokens is not None:
            tokens.close()
        for ex in list(self.live.exchanges):
            ex.cancel(503, "shutdown")
        for conn in list(self.live.connections):
            if conn.transport is not None:
                conn.transport.close()
        for t in list(self.endpoints.admin_tasks):
            t.cancel()
        self.upstreams.close()
        if self.tracer is not None:
            self.tracer.shutdown()  # the last spans, bounded: a collector that is down cannot hold the exit
