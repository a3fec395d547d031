"""``fastroute epp --workers N`` (N > 1): N picker processes over one target table and ledger.

The proxy's multi-process layout (:mod:`fastroute.runtime.supervisor`), with picker processes
in place of proxy processes:

* the **supervisor** (:class:`EppSupervisor`, the process the CLI started) is the proxy's: it
  creates the shared table and one ledger per process, registers and monitors the workers,
  serves ``/metrics`` (merged) and ``--health-check-port``, runs ``--replica-sync`` once for the
  host, holds the gRPC port (bound, not listening) and restarts a picker process that dies,
  giving back the leases in its ledger;
* each **picker process** (``python -P -m fastroute.epp.child STATE_DIR SLOT``,
  :class:`EppChild`) attaches the table and its ledger, follows the supervisor's worker set
  (:class:`~fastroute.control.follower.FollowerRegistry`) and serves ext_proc and gRPC health on
  the same port with ``SO_REUSEPORT``: the kernel spreads Envoy's connections over them. Every
  lease is booked in the shared table, which every pick reads, so N processes balance as one.

The picker's own options travel in ``epp.json`` in the supervisor's private state directory.
Per process, as in the proxy: admission (``--max-concurrent-requests`` is per process) and
``--max-grpc-streams``; the ``fastroute_epp_streams_*`` series are not merged into the
supervisor's ``/metrics`` (the in-flight, pick and reclaim series are).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import pickle
import sys
from typing import Any

import uvloop

from fastroute.config import Config
from fastroute.control.follower import SYNC_INTERVAL, FollowerRegistry
from fastroute.control.metrics import group_decisions
from fastroute.core.routing import Router
from fastroute.core.table import TargetTable
from fastroute.epp.options import GrpcTls
from fastroute.epp.server import EppServer
from fastroute.log import configure_logging
from fastroute.runtime.assemble import assemble
from fastroute.runtime.child import SEED_STRIDE, STATS_INTERVAL, _die_with_parent, _load_config
from fastroute.runtime.startup import stop_on_signals
from fastroute.runtime.supervisor import Supervisor

log = logging.getLogger("fastroute.epp")

OPTIONS_FILE = "epp.json"


class EppSupervisor(Supervisor):
    """The supervisor of ``fastroute epp --workers N`` (see module docstring): the proxy's, with
    the gRPC port as its port and picker processes as its children."""

    child_module = "fastroute.epp.child"

    def __init__(self, config: Config, grpc_port: int, grpc_host: str | None, options: dict[str, Any]) -> None:
        host = grpc_host if grpc_host is not None else config.host
        super().__init__(dataclasses.replace(config, port=int(grpc_port), host=host))
        self._lease_rows: Any = None  # --epp-mode http: the shared lease rows (leaseslots)
        if options.get("mode") == "http":
            from fastroute.epp import leaseslots

            self._lease_rows = leaseslots.create(self.n)
            options = {**options, "lease_rows": self._lease_rows.name}
        self.child_files = {OPTIONS_FILE: options}

    def _retire(self, child: Any, pid: int) -> None:
        if self._lease_rows is not None:  # its leases end here, before its ledger is subtracted
            from fastroute.epp.leaseslots import retire

            retire(self._lease_rows, child.slot)
        super()._retire(child, pid)

    async def _teardown(self) -> None:
        try:
            await super()._teardown()
        finally:
            if self._lease_rows is not None:
                try:
                    self._lease_rows.close()
                except BufferError:  # a view still held: the mapping goes with the process
                    pass
                self._lease_rows.unlink()
                self._lease_rows = None


def child_options(
    sidecar_port: int | None,
    tls: GrpcTls | None,
    silent_timeout: float,
    max_streams: int,
    fallbacks: int,
    mode: str = "grpc",
) -> dict[str, Any]:
    """The picker options a picker process needs, as JSON (``epp.json``)."""
    return {
        "sidecar_port": sidecar_port,
        "tls": dataclasses.asdict(tls) if tls is not None else None,
        "silent_timeout": float(silent_timeout),
        "max_streams": int(max_streams),
        "fallbacks": int(fallbacks),
        "mode": mode,
    }


class EppChild(EppServer):
    """One picker process of ``--workers N`` (see module docstring)."""

    def __init__(self, config: Config, state_dir: str, slot: int, options: dict[str, Any]) -> None:
        tls = options.get("tls")
        super().__init__(
            config,
            int(config.port),
            sidecar_port=options.get("sidecar_port"),
            tls=GrpcTls(**tls) if tls else None,
            silent_timeout=float(options["silent_timeout"]),
            max_streams=int(options["max_streams"]),
            fallbacks=int(options["fallbacks"]),
            mode=str(options.get("mode", "grpc")),
        )
        self._lease_rows = options.get("lease_rows")  # --epp-mode http: the shared lease rows' name
        self._ledger_names: list[str] = []
        self.state_dir = state_dir
        self.slot = slot
        self._owns_table = False  # the supervisor's: never unlinked here
        self._ledger: TargetTable | None = None
        self._sync: asyncio.Task | None = None
        self.orphaned: Any = None  # called when the supervisor is gone

    async def start(self) -> None:
        cfg = self.config
        loop = asyncio.get_running_loop()
        with open(os.path.join(self.state_dir, "child.json")) as f:
            info = json.load(f)
        self.table = table = TargetTable.attach(info["table"])
        self._ledger = ledger = TargetTable.attach(info["ledgers"][self.slot])
        self._ledger_names = list(info["ledgers"])

        def follower(router: Router) -> FollowerRegistry:
            registry = FollowerRegistry(cfg, table, router, ledger, self.state_dir, info["control_url"], info["secret"])
            registry.poll()  # the current worker set before the first pick
            return registry

        seed = None if cfg.seed is None else int(cfg.seed) + SEED_STRIDE * (self.slot + 1)
        try:
            self.parts = parts = await assemble(
                cfg, table, serve=False, picks=True, seed=seed, registry_factory=follower, monitor=False, metrics=False
            )
            if self.mode == "http":
                address = await self._serve_http(parts, reuse_port=True)
            else:
                address = await self._serve_grpc(parts, reuse_port=True)
        except BaseException:
            await self._close_half_started()
            raise
        self._announce(address)
        self._health = loop.create_task(self._health_loop())
        self._sweeper = loop.create_task(self._sweep())
        self._sync = loop.create_task(self._follow(os.getppid()))
        self._freeze(parts.registry)

    def _http_processor(self, decider: Any) -> Any:
        from fastroute.epp.leaseslots import LeaseSlots, SharedHttpProcessor

        assert self._lease_rows is not None and self.table is not None
        slots = LeaseSlots(self._lease_rows, self.slot, self.table, self._ledger_names)
        return SharedHttpProcessor(decider, slots)

    def report(self) -> None:
        """This process's Stats for the supervisor's ``/metrics`` and its readiness."""
        parts = self.parts
        if parts is None:
            return
        registry = parts.registry
        assert isinstance(registry, FollowerRegistry)
        parts.stats.decisions = group_decisions(registry._groups)
        doc = {"pid": os.getpid(), "version": registry.version, "ready": self.ready(), "stats": parts.stats}
        path = os.path.join(self.state_dir, f"stats-{self.slot}.pickle")
        tmp = f"{path}.{os.getpid()}"
        with open(tmp, "wb") as f:
            pickle.dump(doc, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)

    async def _follow(self, parent: int) -> None:
        """Follow the supervisor's worker set; report; notice the supervisor's end."""
        assert self.parts is not None
        registry = self.parts.registry
        assert isinstance(registry, FollowerRegistry)
        every = max(1, round(STATS_INTERVAL / SYNC_INTERVAL))
        tick = 0
        while True:
            await asyncio.sleep(SYNC_INTERVAL)
            try:
                if registry.poll():
                    self._health_due.set()
                tick += 1
                if tick % every == 0:
                    self.report()
                if os.getppid() != parent and self.orphaned is not None:
                    self.orphaned()
            except Exception:
                log.exception("picker process %d background tick", self.slot)

    async def stop(self, grace: float | None = None) -> None:
        if self._sync is not None:
            self._sync.cancel()
        try:
            await super().stop(grace)
        finally:
            try:
                self.report()
            except OSError:
                pass
            if self._ledger is not None:
                self._ledger.close()


async def serve_child(state_dir: str, slot: int) -> int:
    """Serve as picker process ``slot`` until SIGTERM/SIGINT or the supervisor's end."""
    cfg = _load_config(state_dir)
    with open(os.path.join(state_dir, OPTIONS_FILE)) as f:
        options = json.load(f)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    stop_on_signals(loop, stop.set)
    server = EppChild(cfg, state_dir, slot, options)
    server.orphaned = stop.set
    await server.start()
    await stop.wait()
    await server.stop()
    return 0


def main(state_dir: str, slot: int) -> int:
    """Entry point of one picker process."""
    _die_with_parent()
    cfg = _load_config(state_dir)
    configure_logging(cfg.log_level, cfg.log_dir, json_lines=cfg.log_json)
    return uvloop.run(serve_child(state_dir, slot))


async def serve_many(config: Config, grpc_port: int, options: dict[str, Any]) -> int:
    """Run the supervisor and its picker processes until SIGTERM/SIGINT/SIGHUP/SIGQUIT."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    stop_on_signals(loop, stop.set)
    sup = EppSupervisor(config, grpc_port, None, options)
    await sup.start()
    await stop.wait()
    log.info("shutdown: draining the picker processes (grace %ss)", config.shutdown_grace_period_secs)
    await sup.stop()
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3:
        sys.exit(main(sys.argv[1], int(sys.argv[2])))
    sys.exit("usage: python -m fastroute.epp.child STATE_DIR SLOT")
