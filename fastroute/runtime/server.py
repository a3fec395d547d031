"""Router process lifecycle: assemble the pieces, listen, drain on SIGTERM.

Owns the order of start-up (target table -> router -> registry -> monitor ->
metrics -> listener, then background worker registration) and of shutdown
(stop accepting -> wait for in-flight requests up to
``shutdown_grace_period_secs`` -> abort the rest -> stop control plane ->
unlink the shared table). The listener starts before any worker is registered:
inference requests get 503 until the registry reports ready (protocol.md 2).

``Server`` is the in-process form used by tests; ``run(config)`` is what the
CLI calls (uvloop, signal handlers, blocking until shutdown). With ``--workers N``
(N > 1) ``run`` delegates to :mod:`fastroute.runtime.supervisor`, which runs this same
proxy code in N processes over one shared target table.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from typing import Any

from fastroute.dataplane.app import App

log = logging.getLogger("fastroute.server")


class Server:
    """One router process: table, router, registry, monitor, metrics and the HTTP listener."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.table: Any = None
        self.router: Any = None
        self.registry: Any = None
        self.monitor: Any = None
        self.metrics: Any = None
        self.app: App | None = None
        self.listener: asyncio.AbstractServer | None = None
        self.port = 0
        self._stopped = asyncio.Event()
        self._stopping = False

    async def start(self) -> None:
        """Build everything and start listening; worker registration continues in the background."""
        from fastroute.control.metrics import start_metrics
        from fastroute.control.monitor import Monitor, Reconciler
        from fastroute.core.breaker import Breakers
        from fastroute.core.routing import Router
        from fastroute.core.table import TargetTable
        from fastroute.control.workers import Registry

        cfg = self.config
        loop = asyncio.get_running_loop()
        self.table = TargetTable()
        try:
            self.router = Router(self.table, seed=cfg.seed, config=cfg)
            self.registry = Registry(cfg, self.table, self.router)
            self.monitor = Monitor(cfg, self.registry, self.table)
            self.metrics = await start_metrics(cfg, self.table, self.registry)
            # The data plane imports no NumPy/compiled code: the breakers (shared cells in the
            # table) and this process's reconciler are built here and handed in.
            breakers = Breakers(self.table, int(self.table.capacity), cfg.cb_failure_threshold,
                                cfg.cb_success_threshold, cfg.cb_timeout_duration_secs,
                                not cfg.disable_circuit_breaker, name_of=self.registry.target_name,
                                clock=loop.time)
            reconciler = Reconciler(self.table, float(cfg.request_timeout_secs))
            self.app = App(cfg, self.registry, loop, breakers=breakers, reconciler=reconciler)
            self.app.stats = self.metrics.stats
            self.listener = await loop.create_server(
                self.app.protocol_factory, cfg.host, cfg.port,
                reuse_address=True, reuse_port=hasattr(socket, "SO_REUSEPORT"), backlog=4096)
        except BaseException:
            self.table.close()
            self.table.unlink()
            raise
        self.port = self.listener.sockets[0].getsockname()[1]
        self.app.start()
        log.info("fastroute listening on %s:%d (%s mode)", cfg.host, self.port,
                 "PD" if cfg.pd_disaggregation else "regular")
        await self.registry.start()
        self.monitor.start()

    async def stop(self, grace: float | None = None) -> None:
        """Graceful drain: stop accepting, wait for in-flight requests, then close everything."""
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        if grace is None:
            grace = float(self.config.shutdown_grace_period_secs)
        app = self.app
        try:
            if self.listener is not None:
                self.listener.close()
            if app is not None:
                app.stop_accepting()
                loop = asyncio.get_running_loop()
                deadline = loop.time() + grace
                # Control-plane wait (not per request): poll the in-flight count.
                while app.active and loop.time() < deadline:
                    await asyncio.sleep(0.05)
                if app.active:
                    log.warning("shutdown: aborting %d requests still in flight", app.active)
                app.close()
            if self.monitor is not None:
                await self.monitor.stop()
            if self.registry is not None:
                await self.registry.stop()
            if self.metrics is not None:
                await self.metrics.stop()
        finally:
            if self.table is not None:
                self.table.close()
                self.table.unlink()
            self._stopped.set()

    async def wait_stopped(self) -> None:
        await self._stopped.wait()


async def serve(config: Any, factory: Any = None) -> int:
    """Run until SIGTERM/SIGINT, then drain; returns the exit status.

    ``factory`` builds what runs (``Server`` by default; the supervisor passes its own class):
    anything with ``start()`` and ``stop()``."""
    loop = asyncio.get_running_loop()
    server = (factory or Server)(config)
    await server.start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not the main thread
            pass
    await stop.wait()
    log.info("shutdown: draining (grace %ss)", config.shutdown_grace_period_secs)
    await server.stop()
    return 0


def run(config: Any) -> int:
    """Blocking entry point used by the CLI: uvloop event loop + ``serve``.

    ``--workers N`` with N > 1 (or ``auto`` on a multi-core machine) hands over to
    :mod:`fastroute.runtime.supervisor`; one process keeps this single-process path unchanged."""
    import uvloop

    from fastroute.runtime.supervisor import resolve_processes

    if resolve_processes(config) > 1:
        from fastroute.runtime import supervisor

        return supervisor.run(config)
    return uvloop.run(serve(config))
