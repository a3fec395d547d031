"""Router process lifecycle: assemble the pieces, listen, drain on SIGTERM.

Owns the order of start-up (target table -> router -> registry -> monitor ->
metrics -> listener, then background worker registration) and of shutdown
(readiness 503 -> keep serving while requests are in flight, up to
``shutdown_grace_period_secs`` -> close the listener -> abort the rest -> stop control plane ->
unlink the shared table). The listener starts before any worker is registered:
inference requests get 503 until the registry reports ready (protocol.md 2).

``Server`` is the in-process form used by tests. ``run(config, factory)`` is what the
CLI calls (uvloop, signal handlers, blocking until shutdown) with the process to run: a
``Server``, or under ``--workers N`` (N > 1) the
:class:`~fastroute.runtime.supervisor.Supervisor`, which runs this same proxy code in N
processes over one shared target table. The pieces are built by
:func:`fastroute.runtime.assemble.assemble` in both cases.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

import uvloop

from fastroute.config import Config
from fastroute.config.checks import ConfigError, open_admin_problem
from fastroute.control.discovery import Discovery, start_discovery
from fastroute.control.kvevents import KvEvents
from fastroute.control.metrics import MetricsServer
from fastroute.control.monitor import Monitor
from fastroute.control.registry import Registry
from fastroute.control.replica import ReplicaSync, start_replica_sync
from fastroute.core.routing import Router
from fastroute.core.table import TargetTable
from fastroute.dataplane.app import App
from fastroute.runtime.assemble import DRAIN_LINGER, assemble, drain, freeze_heap, listen, stop_in_order
from fastroute.runtime.heap import Refreezer
from fastroute.runtime.probe import ProbeServer
from fastroute.runtime.startup import announce, new_table, own_listeners, start_probe, stop_on_signals, tls_context

log = logging.getLogger("fastroute.server")


class Process(Protocol):
    """What ``serve`` runs: a Server or a Supervisor."""

    async def start(self) -> None: ...

    async def stop(self, grace: float | None = None, linger: float = 0.0) -> None: ...

    @property
    def registry(self) -> Registry | None: ...


class Server:
    """One router process: table, router, registry, monitor, metrics and the HTTP listener."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.table: TargetTable | None = None
        self.router: Router | None = None
        self.registry: Registry | None = None
        self.monitor: Monitor | None = None
        self.kv_events: KvEvents | None = None
        self.metrics: MetricsServer | None = None
        self.discovery: Discovery | None = None
        self.replica: ReplicaSync | None = None
        self.app: App | None = None
        self.listener: asyncio.AbstractServer | None = None
        self.probe: ProbeServer | None = None
        self.port = 0
        self._stopped = asyncio.Event()
        self._stopping = False

    def probe_ready(self) -> bool:
        """Readiness on --health-check-port: the workers', and 503 once the drain started."""
        return not self._stopping and self.registry is not None and self.registry.ready()

    async def start(self) -> None:
        """Build everything and start listening; worker registration continues in the background."""
        cfg = self.config
        tls = tls_context(cfg)  # a TLS file that cannot be used stops the start here
        self.table = new_table(cfg)
        try:
            parts = await assemble(cfg, self.table)
            self.router, self.registry, self.monitor = parts.router, parts.registry, parts.monitor
            self.metrics, self.app = parts.metrics, parts.app
            self.kv_events = parts.kv_events
            assert self.app is not None and self.monitor is not None
            self.listener = await listen(self.app, cfg.host, cfg.port, tls=tls)
            self.probe = start_probe(cfg, self.probe_ready)
            own_listeners(self.registry, cfg, self.listener.sockets[0].getsockname()[1], self.metrics, self.probe)
            self.discovery = await start_discovery(cfg, self.registry, parts.stats)
        except BaseException:
            await self._close_listeners()
            self.table.close()
            self.table.unlink()
            raise
        self.port = self.listener.sockets[0].getsockname()[1]
        self.app.start()
        announce(cfg, self.port, 1)
        await self.registry.start()
        self.monitor.start()
        self.replica = await start_replica_sync(cfg, self.table, self.registry, self.metrics, self.port)

    async def _close_listeners(self) -> None:
        """Undo a start that failed half-way (a later listener could not bind)."""
        if self.listener is not None:
            self.listener.close()
        if self.metrics is not None:
            await self.metrics.stop()
            self.metrics = None
        if self.probe is not None:
            self.probe.stop()
            self.probe = None

    async def stop(self, grace: float | None = None, linger: float = 0.0) -> None:
        """Graceful drain (:func:`~fastroute.runtime.assemble.drain`): readiness 503 on both
        ports at once, requests served until nothing has been in flight for ``linger`` seconds
        or ``grace`` ends, then the listeners close and everything stops."""
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        if grace is None:
            grace = float(self.config.shutdown_grace_period_secs)
        try:
            if self.app is not None:
                await drain(self.app, grace, log, listener=self.listener, linger=linger)
            elif self.listener is not None:
                self.listener.close()
            if self.probe is not None:
                self.probe.stop()
            await stop_in_order(self.discovery, self.replica, self.monitor, self.kv_events, self.registry, self.metrics)
        finally:
            if self.table is not None:
                self.table.close()
                self.table.unlink()
            self._stopped.set()


async def serve(config: Config, factory: Callable[[Config], Process] = Server) -> int:
    """Run ``factory(config)`` until SIGTERM/SIGINT/SIGHUP/SIGQUIT, then drain; returns the
    exit status."""
    loop = asyncio.get_running_loop()
    server = factory(config)
    # Handlers first: a SIGTERM while starting (the listener may already accept) stops the
    # router cleanly once it is up, instead of killing it with its shared table left behind.
    stop = asyncio.Event()
    stop_on_signals(loop, stop.set)
    await server.start()
    freeze_heap()
    refreeze = Refreezer(loop)
    if server.registry is not None:
        server.registry.add_listener(refreeze.changed)
    await stop.wait()
    refreeze.close()
    log.info("shutdown: draining (grace %ss): /readiness 503, requests still served", config.shutdown_grace_period_secs)
    await server.stop(linger=DRAIN_LINGER)
    return 0


def run(config: Config, factory: Callable[[Config], Process] = Server) -> int:
    """Blocking entry point used by the CLI: uvloop event loop + ``serve``. Raises ConfigError
    (naming --allow-open-admin) before anything starts when the admin API would be open to
    other machines (checks.open_admin_problem), unless ``factory`` closes it instead."""
    if not getattr(factory, "closes_open_admin", False):
        problem = open_admin_problem(config)
        if problem is not None:
            raise ConfigError("--allow-open-admin", problem)
    return uvloop.run(serve(config, factory))
