"""The proxy process's data-path object: it holds the dispatcher and answers the rest.

One :class:`App` per proxy process. It builds the :class:`~fastroute.dataplane.dispatch.Dispatcher`
(compiled; ``app.dispatch``), which every client connection (:mod:`fastroute.dataplane.protocol`)
and exchange holds and which takes an inference request from the parsed head to its exchange:
body parse, admission (``--max-concurrent-requests``, :mod:`fastroute.dataplane.admission`),
the exchange (:mod:`~fastroute.dataplane.exchange`, :mod:`~fastroute.dataplane.pd`).
As the dispatcher's owner App answers the rest (``handle_other``: CORS preflight, health, admin
calls handed to the registry's admin API, unknown paths), queues what admission holds back
(``wait``) and applies the admin rule at a call's head (``refuse_at_head``). It keeps one
:class:`~fastroute.dataplane.route.Route` per target in ``dispatch.routes``, rebuilt when
the registry's target set changes, so an attempt never looks at the registry
beyond ``group(role).acquire``; and the keep-alive pools they use.

It never imports NumPy or the core's compiled modules: the circuit breakers and the
reconciler are built by the runtime and handed in (``breakers=``,
``reconciler=``); the routing groups come from the registry.

``dispatch.exchanges`` is the set of live exchanges; ``App.sweeper``
(:mod:`fastroute.dataplane.sweep`) runs every deadline from one timer and the lease
safety net over them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from fastroute import errors as _errors
from fastroute.auth import (
    FORBIDDEN,
    OK,
    AdminAuth,
    audit,
    is_admin_path,
    is_management,
    parse_control_plane_keys,
)
from fastroute.dataplane import flowcontrol
from fastroute.dataplane._clock import monotonic
from fastroute.dataplane.dispatch import Dispatcher
from fastroute.dataplane.exchange import Relay
from fastroute.dataplane.pd import PDRelay
from fastroute.dataplane.protocol import INFERENCE, ClientProtocol
from fastroute.dataplane.request import Request
from fastroute.dataplane.route import Route, rank_port
from fastroute.dataplane.sweep import Sweeper
from fastroute.dataplane.telemetry import NULL_TELEMETRY, RequestTelemetry
from fastroute.dataplane.upstream import Pool
from fastroute.errors import RouterError
from fastroute.tls import client_context

if TYPE_CHECKING:
    from fastroute.config import Config
    from fastroute.control.leases import Reconciler
    from fastroute.core.breaker import Breakers

log = logging.getLogger("fastroute.proxy")

_HEALTH_KA = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: 2\r\n\r\nOK"
_HEALTH_KA10 = (  # an HTTP/1.0 request kept alive: the answer says so
    b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: 2\r\n"
    b"connection: keep-alive\r\n\r\nOK"
)
_HEALTH_CLOSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: 2\r\nconnection: close\r\n\r\nOK"
)

_DRAINING = b'{"status": "not ready", "reason": "draining: the router is shutting down"}'


class App:
    """Per-process data-path state shared by every client connection.

    ``breakers`` (a ``fastroute.core.breaker.Breakers``) and ``reconciler`` (a
    ``fastroute.control.leases.Reconciler``, only where this process audits the table, with its
    mismatch counter) are built by the runtime (``runtime.assemble``); None runs without them.
    """

    def __init__(
        self,
        config: Config,
        registry: Any,
        loop: asyncio.AbstractEventLoop | None = None,
        room_rng: Any = None,
        breakers: Breakers | None = None,
        reconciler: Reconciler | None = None,
    ) -> None:
        loop = loop or asyncio.get_event_loop()
        pd = bool(config.pd_disaggregation)
        # The one rule for admin paths (--api-key, or the control-plane keys with roles),
        # applied at head time when the call carries a body (protocol.on_headers_complete).
        self.admin_auth = AdminAuth(
            config.api_key, parse_control_plane_keys(config.control_plane_api_keys), config.admin_closed
        )
        guarded = self.admin_auth.api_key is not None or bool(self.admin_auth.keys) or self.admin_auth.closed
        self.config = config
        self.registry = registry
        self.loop = loop
        self.breakers = breakers
        self.dispatch = Dispatcher(self, config, registry, loop, PDRelay if pd else Relay, guarded, room_rng, breakers)
        # Flow control (priority classes, tenants, shedding): only with its flags; it replaces
        # dispatch.admission, so install it before the sweeper reads the admission's timeout.
        self.flow = flowcontrol.install(self.dispatch, config)
        self.pools: dict[Any, Pool] = {}  # by (worker identity, port): a re-added URL is a new worker
        self.tls_listener = False
        self.admin_tasks: set[asyncio.Task] = set()
        self.dp_aware = bool(config.dp_aware)
        self.pool_idle = float(config.upstream_pool_idle_timeout_secs)
        # TLS client context for https:// workers (set by the runtime from --ca-cert-paths and
        # the client certificate; made with the system CAs on first need when left None).
        self.worker_tls: Any = None
        # The body key carrying the DP rank of a target split per rank: the regular request
        # under --dp-aware, the decode leg under PD (the prefill's rank travels in the room).
        self.rank_field: str | None = (
            config.rank_field("decode") if pd else config.rank_field("regular") if self.dp_aware else None
        )
        # Set when the shutdown drain starts: /readiness answers 503 while requests are still
        # served (runtime.assemble.drain), so a load balancer stops sending new ones.
        self.draining = False
        self._stats: Any = None
        self.reconciler = reconciler
        self._row_owner: dict[int, Any] = {}
        add_listener = getattr(registry, "add_listener", None)
        if add_listener is not None:
            add_listener(self._targets_changed)
        # Every deadline and the lease safety net (sweep.py): one timer per process.
        self.sweeper = Sweeper(self.dispatch, reconciler)

    # fastroute.control.metrics.Stats of this process (set by the server when metrics
    # run): plain dict increments per request, turned into series at scrape time.
    @property
    def stats(self) -> Any:
        return self._stats

    @stats.setter
    def stats(self, stats: Any) -> None:
        self._stats = stats
        d = self.dispatch
        d.tel = RequestTelemetry(stats, d.backend) if stats is not None else NULL_TELEMETRY
        d.admission.tel = d.tel
        if stats is not None and self.flow is not None:  # its counters are the exported series
            stats.flow_refusals = self.flow.refusals
            stats.flow_admitted = self.flow.admitted
            stats.flow_top_n = int(self.config.priority_scheduler_tenant_metric_top_n)
        if self.breakers is not None:
            self.breakers.stats = stats

    # -- lifecycle ----------------------------------------------------------
    def start(self) -> None:
        """Start the periodic sweep (timeouts and the lease safety net, sweep.py)."""
        self.sweeper.start()

    def protocol_factory(self) -> ClientProtocol:
        proto = ClientProtocol(self.dispatch)
        if self.tls_listener:
            # connection_made comes only after the TLS handshake; a client that never sends
            # its ClientHello still holds a socket, so it is counted (and timed) from here.
            self.dispatch.handshaking[proto] = monotonic() + self.dispatch.header_timeout
            self.dispatch.tel.connections(1)
        return proto

    @property
    def active(self) -> int:
        """Requests being answered (proxied exchanges + admin calls + admission queue)."""
        return len(self.dispatch.exchanges) + len(self.admin_tasks) + len(self.dispatch.admission.queue)

    def stop_accepting(self) -> None:
        """Shutdown phase 1: from now on every response closes its connection. Idle connections
        stay open (one just accepted may carry a request in transit); they close at the end."""
        self.dispatch.accepting = False

    def busy_connections(self) -> int:
        """Client connections with a request being read, queued or answered."""
        return sum(1 for c in self.dispatch.connections if c.busy or c._req is not None or c.queue)

    def close(self) -> None:
        """Abort everything still open (end of the shutdown grace period)."""
        self.dispatch.accepting = False
        self.sweeper.stop()
        if self.dispatch.tokens is not None:
            self.dispatch.tokens.close()
        for ex in list(self.dispatch.exchanges):
            ex.cancel(503, "shutdown")
        for conn in list(self.dispatch.connections):
            if conn.transport is not None:
                conn.transport.close()
        for t in list(self.admin_tasks):
            t.cancel()
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()
        self.dispatch.routes.clear()

    # -- targets and routes -------------------------------------------------------
    def _targets_changed(self, role: str) -> None:
        info = self.registry.target_info
        if self.breakers is not None:
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
                    self.breakers.forget_names(t)
            if moved and self._stats is not None:
                names = (self.registry.target_name(t) for t, e in enumerate(info) if e is not None)
                self._stats.forget_workers({n for n in names if n is not None})
        # Routes for exactly the targets the groups can pick now. Targets of a removed worker
        # drop out (their in-flight requests already hold their connections), and so does the
        # worker's pool: a worker re-added under the same URL is a new worker with a new pool,
        # framed with its own key.
        # A route whose worker, rank and framing inputs are unchanged is kept: one worker
        # joining must not rebuild the other 999 (discovery adds them in bursts).
        routes: dict[int, Route] = {}
        old = self.dispatch.routes
        for r in ("prefill", "decode") if self.dispatch.pd else ("regular",):
            for t in self.registry.group(r).targets:
                entry = info[t] if t < len(info) else None
                if entry is not None:
                    route = old.get(t)
                    if route is None or not _same_route(route, *entry):
                        route = self._build_route(*entry)
                    routes[t] = route
        self.dispatch.routes = routes
        live = {(id(route.worker), route.port) for route in routes.values()}
        for key in [k for k in self.pools if (id(k[0]), k[1]) not in live]:
            self.pools.pop(key).retire()

    def route(self, t: int) -> Route:
        """The route of target ``t`` when the targets listener has not built it (a registry
        without listeners, e.g. in tests); built once, then found in ``routes``."""
        info = self.registry.target_info[t]
        assert info is not None, f"target {t} is not registered"
        route = self.dispatch.routes[t] = self._build_route(*info)
        return route

    def _build_route(self, worker: Any, rank: int | None) -> Route:
        port = rank_port(worker, rank)
        if port is not None:  # a per-rank-port server: the rank's own port
            return Route(
                worker, rank, self.pool_for(worker, port), worker.api_key or self.config.api_key, self.rank_field, port
            )
        return Route(worker, rank, self.pool_for(worker), worker.api_key or self.config.api_key, self.rank_field)

    def pool_for(self, worker: Any, port: int | None = None) -> Pool:
        """The keep-alive pool of ``worker`` on ``port`` (default its own; one per worker
        object and port, made on first use)."""
        port = int(worker.port) if port is None else port
        pool = self.pools.get((worker, port))
        if pool is None:
            if worker.url.startswith("https://"):
                if self.worker_tls is None:
                    self.worker_tls = client_context()
                pool = Pool(worker.host, port, self.pool_idle, self.loop, self.worker_tls)
            else:
                pool = Pool(worker.host, port, self.pool_idle, self.loop)
            self.pools[(worker, port)] = pool
        return pool

    # -- dispatch -----------------------------------------------------------
    def handle_other(self, proto: ClientProtocol, req: Request, path: bytes, query: bytes) -> None:
        """Everything but a POST to an inference path (Dispatcher.handle): CORS preflight, a wrong
        method on an inference path, health, admin calls, unknown paths."""
        if req.origin is not None and req.method == b"OPTIONS":
            # A CORS preflight (req.origin is only ever set with --cors-allowed-origins);
            # browsers send no credentials with it, so it is answered before any auth rule.
            ka = req.keep_alive and self.dispatch.accepting
            self.dispatch.tel.response(204, "", path)
            proto.reply(self.dispatch.cors.preflight(req.origin, req.acrh, ka, req.http11), ka)
        elif path in INFERENCE:  # any method but POST (Dispatcher.handle proxies those)
            proto.send_error(
                RouterError(
                    405,
                    "method_not_allowed",
                    "Method Not Allowed (%s %s)" % (req.method.decode("latin-1"), path.decode("latin-1")),
                ),
                req,
            )
        elif path == b"/health" or path == b"/liveness":
            ka = req.keep_alive and self.dispatch.accepting
            self.dispatch.tel.response(200, "", path)
            data = (_HEALTH_KA if req.http11 else _HEALTH_KA10) if ka else _HEALTH_CLOSE
            if req.origin is not None:
                cors = self.dispatch.cors.headers_for(req.origin)
                if cors:
                    head, sep, rest = data.partition(b"\r\n")
                    data = head + sep + cors + rest
            proto.reply(data, ka)
        elif path == b"/readiness" and self.draining and req.method == b"GET":
            proto.reply_simple(503, b"application/json", _DRAINING, req)
        elif is_admin_path(path):
            who = None
            if self.dispatch.guarded:
                verdict, who = self.admin_auth.check(req.method, path, req.auth)
                if verdict != OK:
                    proto.send_error(self._refusal(req.method, path, verdict, who), req)
                    return
            if req.too_large:  # a chunked body past --max-payload-size (no length at the head)
                proto.send_error(_errors.payload_too_large(req.body_len, self.dispatch.max_payload), req)
                return
            task = self.loop.create_task(self._admin(proto, req, path, query, who))
            self.admin_tasks.add(task)
            task.add_done_callback(self.admin_tasks.discard)
        else:
            proto.send_error(_errors.unknown_url(req.method.decode("latin-1"), path.decode("latin-1")), req)

    def refuse_at_head(self, method: bytes, url: bytes, auth: bytes | None) -> RouterError | None:
        """The error for an admin call refused by the auth rule, decided from its head alone
        (the protocol asks before it reads the body); None when it may proceed, or when the
        path is not an admin path (answered as usual once the request is complete)."""
        path = url.partition(b"?")[0]
        if not is_admin_path(path):
            return None
        verdict, who = self.admin_auth.check(method, path, auth)
        if verdict == OK:
            return None
        return self._refusal(method, path, verdict, who)

    def _refusal(self, method: bytes, path: bytes, verdict: int, who: Any) -> RouterError:
        """The answer to an admin call the auth rule refused; a refused management change is
        audited like an applied one (its body was never read, so its target is unknown)."""
        if verdict == FORBIDDEN:
            exc = _errors.insufficient_role(who.role) if who is not None else _errors.admin_closed()
        else:
            exc = _errors.invalid_api_key()
        if self.config.control_plane_audit_enabled and method not in (b"GET", b"HEAD") and is_management(path):
            audit(who, method.decode("latin-1"), path.decode("latin-1"), "-", "denied", exc.status)
        return exc

    async def _admin(self, proto: ClientProtocol, req: Request, path: bytes, query: bytes, who: Any = None) -> None:
        try:
            args = (
                req.method.decode("latin-1"),
                path.decode("latin-1"),
                query.decode("latin-1"),
                req.body,
                ((b"authorization", req.auth),) if req.auth is not None else (),
            )
            # The control-plane key that passed the check goes on to the handler's audit log.
            status, body, ctype = await (
                self.registry.admin.handle_admin(*args)
                if who is None
                else self.registry.admin.handle_admin(*args, principal=who)
            )
        except asyncio.CancelledError:
            raise
        except RouterError as exc:
            proto.send_error(exc, req)
            return
        except Exception:
            log.exception("admin handler failed for %s", path)
            proto.send_error(RouterError(500, "internal_error", "internal error"), req)
            return
        if isinstance(ctype, str):
            ctype = ctype.encode("latin-1")
        proto.reply_simple(status, ctype, body, req)

    def tenant_key(self, auth: bytes | None) -> bool:
        """Whether ``auth`` carries a --tenant-api-key (a data-plane key beside --api-key)."""
        return self.flow is not None and self.flow.tenants.by_key(auth) is not None

    def wait(self, proto: ClientProtocol, req: Request, path: bytes, meta: Any) -> None:
        """Over --max-concurrent-requests: queue (FIFO) or refuse with 429."""
        if self.flow is not None:  # flow control admits every request (its try_enter declines)
            self.flow.enqueue(proto, req, path, meta)
            return

        def start() -> None:
            proto.waiter = None
            if proto.closed:  # client left between the dequeue and this callback
                self.dispatch.admission.leave()
                return
            try:
                self.dispatch.begin(proto, req, path, meta)
            except Exception:
                log.exception("request handling failed")

        def expired() -> None:
            proto.waiter = None
            if not proto.closed:
                proto.send_error(_errors.queue_timeout(), req)

        waiter = self.dispatch.admission.wait(start, expired, self.loop.time())
        if waiter is None:
            proto.send_error(_errors.queue_full(), req)
            return
        proto.waiter = waiter


def _same_route(route: Route, worker: Any, rank: int | None) -> bool:
    """``route`` was built for this worker object and rank, with its current dp_size (the
    other framing inputs are fixed for a worker object)."""
    return (
        route.worker is worker
        and route.index == rank
        and route.prefill_dp_size == (int(worker.dp_size) if rank is not None else 1)
    )
