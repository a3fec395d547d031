"""The ``fastroute epp`` process: the router's control plane plus a gRPC ext_proc listener.

Built from the same pieces as the proxy (:func:`fastroute.runtime.assemble.assemble` with no
App: table, router and its groups, registry, monitor, metrics, the reconciler), plus an
:class:`~fastroute.dataplane.admission.Admission` for ``--max-concurrent-requests``, the
:class:`~fastroute.epp.decide.Decider`, the ext_proc servicer and the standard gRPC health
service (``grpc.health.v1.Health``: NOT_SERVING until the workers are ready and again once the
drain starts, for the whole server ``""``, the ext_proc service name and ``readiness``;
``liveness`` is SERVING while the process answers; the same readiness on
``--health-check-port``'s /readiness, as in the proxy). In-flight counts
are the proxy's: ``fastroute_target_in_flight_requests`` (and the smg families) on
``--prometheus-port``, read from the one target table the leases book into. Under
``--replica-sync`` several pickers (or pickers and proxies) share that table's in-flight counts
through Redis exactly as proxy replicas do (:mod:`fastroute.control.replica`): the sync owns
the table's "others" columns, the picks read them, no pick waits for Redis.

The gRPC listener binds ``--host`` like the proxy, plaintext or, with ``--grpc-tls-*``, TLS
(mutual with a client CA: :func:`grpc_credentials`); its receive limit is the body limit of the
printed bootstrap (:func:`fastroute.epp.bootstrap.body_limit`) plus headroom. Health follows the
registry's readiness as it changes (``_follow_readiness``).

A sweep, once a second, expires admission waiters, releases the leases of picked streams silent
past ``--silent-stream-timeout-secs``, runs the lease safety net and the reconciler, and keeps
the health status in step with the registry.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from typing import Any

import grpc
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from fastroute.config import Config
from fastroute.control.discovery import start_discovery
from fastroute.control.replica import ReplicaSync, start_replica_sync
from fastroute.core.table import TargetTable
from fastroute.dataplane.admission import Admission
from fastroute.dataplane.telemetry import RequestTelemetry
from fastroute.epp.decide import Decider
from fastroute.epp.fallback import Fallbacks, cluster_endpoints
from fastroute.epp.options import MAX_STREAMS, MESSAGE_HEADROOM, SILENT_TIMEOUT, GrpcTls
from fastroute.epp.service import ExternalProcessor
from fastroute.runtime.assemble import Assembly, assemble, freeze_heap, stop_in_order
from fastroute.runtime.heap import Refreezer
from fastroute.runtime.startup import StartupError, new_table, own_listeners, start_probe, stop_on_signals

log = logging.getLogger("fastroute.epp")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
# The health service names of the endpoint picker protocol: readiness follows the picker's
# readiness like the ext_proc service; liveness is SERVING while the process answers.
READINESS_SERVICE = "readiness"
LIVENESS_SERVICE = "liveness"
SWEEP_EVERY = 1.0
LEAK_EVERY = 5.0


def grpc_credentials(tls: GrpcTls) -> Any:
    """The gRPC listener's TLS credentials from the ``--grpc-tls-*`` files: a client CA makes it
    mutual (a client without a certificate signed by it is refused). Files that cannot be read
    or do not go together stop the start with a message naming the flag."""
    cert, key, ca = tls.cert, tls.key, tls.ca
    assert cert is not None and key is not None
    check = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        check.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise StartupError(f"--grpc-tls-cert-path {cert} / --grpc-tls-key-path {key}: cannot be used ({exc})") from None
    if ca is not None:
        try:
            check.load_verify_locations(cafile=ca)
        except (OSError, ssl.SSLError) as exc:
            raise StartupError(f"--grpc-tls-client-ca-path {ca}: cannot be used ({exc})") from None
    with open(cert, "rb") as f:
        chain = f.read()
    with open(key, "rb") as f:
        private = f.read()
    roots = None
    if ca is not None:
        with open(ca, "rb") as f:
            roots = f.read()
    return grpc.ssl_server_credentials(
        [(private, chain)], root_certificates=roots, require_client_auth=roots is not None
    )


class StreamCollector:
    """The picker's ext_proc streams on ``/metrics``: open now, and ended by the picker by
    reason (a malformed message, too many streams)."""

    def __init__(self, processor: ExternalProcessor) -> None:
        self.processor = processor

    def collect(self) -> Any:
        g = GaugeMetricFamily("fastroute_epp_streams_open", "ext_proc streams open on the picker")
        g.add_metric([], float(self.processor.streams))
        yield g
        c = CounterMetricFamily(
            "fastroute_epp_streams_refused",
            "ext_proc streams the picker ended without serving them, by reason",
            labels=["reason"],
        )
        for reason, n in sorted(self.processor.refused.items()):
            c.add_metric([reason], float(n))
        yield c
        fb = self.processor.decider.fallback
        if fb is not None:
            yield CounterMetricFamily(
                "fastroute_epp_fallback_served",
                "requests Envoy served at a fallback endpoint (the lease moved there)",
                value=float(fb.moved),
            )


class EppServer:
    """One endpoint-picker process (see module docstring)."""

    def __init__(
        self,
        config: Config,
        grpc_port: int,
        grpc_host: str | None = None,
        pool: str | None = None,
        pool_namespace: str | None = None,
        sidecar_port: int | None = None,
        tls: GrpcTls | None = None,
        silent_timeout: float = SILENT_TIMEOUT,
        max_streams: int = MAX_STREAMS,
        fallbacks: int = 0,
        mode: str = "grpc",
    ) -> None:
        self.config = config
        self.max_streams = int(max_streams)  # --max-grpc-streams
        self.fallbacks = int(fallbacks)  # --fallback-endpoints
        self.mode = mode  # --epp-mode: grpc (ext_proc streams) or http (fastroute.epp.httpmode)
        self.http: Any = None  # --epp-mode http: the HttpProcessor
        self.sidecar_port = sidecar_port
        self.tls = tls  # --grpc-tls-*: None serves plaintext
        self.silent_timeout = float(silent_timeout)
        self.pool_name = pool
        self.pool_namespace = pool_namespace
        self.pool: Any = None  # --inference-pool: fastroute.epp.pool.PoolDiscovery
        self.grpc_port = int(grpc_port)
        self.grpc_host = grpc_host if grpc_host is not None else config.host
        self.table: TargetTable | None = None
        self.parts: Assembly | None = None
        self.decider: Decider | None = None
        self.processor: ExternalProcessor | None = None
        self.health: Any = None
        self.grpc: Any = None
        self.discovery: Any = None
        self.probe: Any = None  # --health-check-port: /health, /liveness, /readiness
        self.replica: ReplicaSync | None = None  # --replica-sync
        self._sweeper: asyncio.Task | None = None
        self._refreeze: Refreezer | None = None  # refreezes the heap once the worker set settles
        self._serving: bool | None = None
        self._health_lock = asyncio.Lock()
        self._health_due = asyncio.Event()
        self._health: asyncio.Task | None = None  # follows readiness (_follow_readiness)
        self._stopping = False
        self._owns_table = True  # False in a picker process of --workers N (the supervisor's)

    @property
    def registry(self) -> Any:
        return self.parts.registry if self.parts is not None else None

    def ready(self) -> bool:
        return not self._stopping and self.registry is not None and self.registry.ready()

    async def start(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        self.table = new_table(cfg)
        try:
            self.parts = parts = await assemble(cfg, self.table, serve=False, picks=True)
            if self.mode == "http":
                address = await self._serve_http(parts)
            else:
                address = await self._serve_grpc(parts, reuse_port=False)
            self.probe = start_probe(cfg, self.ready)
            own_listeners(parts.registry, cfg, self.grpc_port, parts.metrics, self.probe)
            self.discovery = await start_discovery(cfg, parts.registry, parts.stats)
            if self.pool_name is not None:
                from fastroute.epp.pool import PoolDiscovery, namespace_or_default

                self.pool = PoolDiscovery(
                    cfg, parts.registry, parts.stats, self.pool_name, namespace_or_default(self.pool_namespace)
                )
                await self.pool.start()
        except BaseException:
            await self._close_half_started()
            raise
        self._announce(address)
        self._follow_readiness(parts.registry)
        self._health = loop.create_task(self._health_loop())
        await parts.registry.start()
        if parts.monitor is not None:
            parts.monitor.start()
        self.replica = await start_replica_sync(cfg, self.table, parts.registry, parts.metrics, self.grpc_port)
        self._sweeper = loop.create_task(self._sweep())
        self._freeze(parts.registry)

    def _freeze(self, registry: Any) -> None:
        """As the proxy: a collection walks what the streams made, not the start-up heap; the
        heap is frozen again once a changed worker set has settled (:mod:`fastroute.runtime.heap`)."""
        freeze_heap()
        self._refreeze = Refreezer(asyncio.get_running_loop())
        registry.add_listener(self._refreeze.changed)

    def _announce(self, address: str) -> None:
        cfg = self.config
        log.info(
            "fastroute epp: ext_proc on %s (%s), policy %s%s",
            address,
            "plaintext" if self.tls is None else "TLS" if self.tls.ca is None else "mutual TLS",
            cfg.policy,
            " (dp-aware)" if cfg.dp_aware else "",
        )

    def _address(self) -> str:
        host, port = self.grpc_host, self.grpc_port
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    async def _serve_http(self, parts: Assembly, reuse_port: bool = False) -> str:
        """--epp-mode http: the decider and the HTTP/1.1 listener on ``--grpc-port``
        (``reuse_port``: beside the other picker processes of ``--workers N``)."""
        self._make_decider(parts)
        assert self.decider is not None
        self.http = self._http_processor(self.decider)
        try:
            await self.http.start(self.grpc_host, self.grpc_port, reuse_port)
        except OSError as exc:
            raise StartupError(f"--grpc-port: cannot listen on {self._address()} ({exc})") from None
        return self._address() + " (HTTP/1.1)"

    def _http_processor(self, decider: Decider) -> Any:
        from fastroute.epp.httpmode import HttpProcessor

        return HttpProcessor(decider)

    def _make_decider(self, parts: Assembly) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        admission = Admission(
            int(cfg.max_concurrent_requests),
            int(cfg.queue_size),
            float(cfg.queue_timeout_secs),
            loop,
            rate=cfg.rate_limit_tokens_per_second,
        )
        admission.tel = RequestTelemetry(parts.stats, "regular")  # rate-limit verdicts
        self.decider = Decider(cfg, parts.registry, admission, parts.stats, loop)
        self.decider.sidecar_port = self.sidecar_port
        self.decider.silent_timeout = self.silent_timeout
        if self.fallbacks > 0:
            self.decider.fallback = Fallbacks(self.fallbacks, cluster_endpoints(cfg.worker_urls))

    async def _serve_grpc(self, parts: Assembly, reuse_port: bool) -> str:
        """The decider, the ext_proc and health services, and the gRPC listener on
        ``--grpc-port`` (``reuse_port``: beside the other picker processes of ``--workers N``,
        the kernel spreading connections over them); returns the address bound."""
        self._make_decider(parts)
        assert self.decider is not None
        creds = grpc_credentials(self.tls) if self.tls is not None else None
        self.processor = ExternalProcessor(self.decider, self.max_streams)
        if parts.metrics is not None:
            parts.metrics.registry.register(StreamCollector(self.processor))
        self.health = grpc_health.aio.HealthServicer()
        self.grpc = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 1 if reuse_port else 0),
                # the whole buffered body comes in one message: the limit the bootstrap prints
                ("grpc.max_receive_message_length", self.decider.max_payload + MESSAGE_HEADROOM),
                # grpc core holds new streams the server has not taken yet in a queue
                # and fails them silently past 1000 (soft) / 3000 (hard) by default: a
                # burst of streams failed with no log (the client even sees INTERNAL).
                # One connection may open --max-grpc-streams (HTTP/2 SETTINGS), the
                # queue holds twice that; Process refuses the streams over the bound.
                ("grpc.max_concurrent_streams", self.max_streams),
                ("grpc.server.max_pending_requests", 2 * self.max_streams),
                ("grpc.server.max_pending_requests_hard_limit", 2 * self.max_streams),
            ]
        )
        pb_grpc.add_ExternalProcessorServicer_to_server(self.processor, self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        await self._set_health(False)
        await self.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        address = self._address()
        try:
            if creds is None:
                bound = self.grpc.add_insecure_port(address)
            else:
                bound = self.grpc.add_secure_port(address, creds)
        except RuntimeError as exc:
            bound = 0
            why = str(exc)
        else:
            why = "address in use or not available"
        if not bound:
            raise StartupError(f"--grpc-port: cannot listen on {address} ({why})")
        await self.grpc.start()
        return address

    async def _close_half_started(self) -> None:
        if self.pool is not None:
            await self.pool.stop()
        if self.http is not None:
            await self.http.stop()
        if self.probe is not None:
            self.probe.stop()
            self.probe = None
        if self.grpc is not None:
            await self.grpc.stop(0)
        if self.parts is not None and self.parts.kv_events is not None:
            await self.parts.kv_events.stop()
        if self.parts is not None and self.parts.metrics is not None:
            await self.parts.metrics.stop()
        if self.table is not None:
            self.table.close()
            if self._owns_table:
                self.table.unlink()

    async def _set_health(self, serving: bool) -> None:
        async with self._health_lock:  # one writer at a time: the three services agree
            if serving is self._serving:
                return
            self._serving = serving
            if self.health is None:  # --epp-mode http: readiness on --health-check-port only
                return
            status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
            for service in ("", EXT_PROC_SERVICE, READINESS_SERVICE):
                await self.health.set(service, status)

    def _follow_readiness(self, registry: Any) -> None:
        """Wake the health task whenever the registry's readiness may have changed (its
        ``invalidate_ready``: a worker's status or health changed), so that gRPC health turns
        SERVING or NOT_SERVING as /readiness does, not at the next sweep."""
        invalidate = registry.invalidate_ready

        def invalidated() -> None:
            invalidate()
            self._health_due.set()

        registry.invalidate_ready = invalidated

    async def _health_loop(self) -> None:
        while True:
            await self._health_due.wait()
            self._health_due.clear()
            try:
                await self._set_health(self.ready())
            except Exception:  # the sweep keeps it in step meanwhile
                log.exception("epp health update failed")

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        next_leak = loop.time() + LEAK_EVERY
        while True:
            await asyncio.sleep(SWEEP_EVERY)
            try:
                now = loop.time()
                d = self.decider
                assert d is not None  # the sweep starts after start() built the decider
                if d.admission.queue:
                    d.admission.expire(now)
                if self.http is not None:  # before the silence bound: leases ended elsewhere
                    self.http.forget_closed()
                d.check_silent(now)
                await self._set_health(self.ready())
                if now >= next_leak:
                    next_leak = now + LEAK_EVERY
                    d.check_leaks(now)
                    rec = self.parts.reconciler if self.parts is not None and self._owns_table else None
                    if rec is not None:
                        rec.check(self.registry.target_info, now)
            except Exception:  # a bug here must not stop the sweep forever
                log.exception("epp sweep failed")

    async def stop(self, grace: float | None = None) -> None:
        """Health NOT_SERVING, the gRPC listener drained for ``grace`` seconds (streams in
        flight finish), every booking left released, the control plane stopped."""
        if self._stopping:
            return
        self._stopping = True
        if grace is None:
            grace = float(self.config.shutdown_grace_period_secs)
        try:
            if self.health is not None:
                await self._set_health(False)
            if self._sweeper is not None:
                self._sweeper.cancel()
            if self._refreeze is not None:
                self._refreeze.close()
            if self._health is not None:
                self._health.cancel()
            if self.grpc is not None:
                await self.grpc.stop(grace)
            if self.http is not None:
                await self.http.stop()
            if self.probe is not None:
                self.probe.stop()
            if self.decider is not None:
                for b in list(self.decider.bookings):
                    b.close("shutdown")
            p = self.parts
            if p is not None:
                await stop_in_order(
                    self.pool, self.discovery, self.replica, p.monitor, p.kv_events, p.registry, p.metrics
                )
        finally:
            if self.table is not None:
                self.table.close()
                if self._owns_table:
                    self.table.unlink()


async def serve(
    config: Config,
    grpc_port: int,
    pool: str | None = None,
    pool_namespace: str | None = None,
    sidecar_port: int | None = None,
    tls: GrpcTls | None = None,
    silent_timeout: float = SILENT_TIMEOUT,
    max_streams: int = MAX_STREAMS,
    fallbacks: int = 0,
    mode: str = "grpc",
) -> int:
    """Run the picker until SIGTERM/SIGINT/SIGHUP/SIGQUIT, then drain; the exit status."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    stop_on_signals(loop, stop.set)
    server = EppServer(
        config,
        grpc_port,
        pool=pool,
        pool_namespace=pool_namespace,
        sidecar_port=sidecar_port,
        tls=tls,
        silent_timeout=silent_timeout,
        max_streams=max_streams,
        fallbacks=fallbacks,
        mode=mode,
    )
    await server.start()
    await stop.wait()
    log.info("shutdown: draining the ext_proc streams (grace %ss)", config.shutdown_grace_period_secs)
    await server.stop()
    return 0
