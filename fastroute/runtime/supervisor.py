"""Multi-process serving (``--workers N``): one supervisor, N proxy processes, one target table.

Owns everything that exists only when the router runs as several processes:

* the **supervisor** (the process the CLI started) creates the shared target table and one
  per-process *ledger* table per proxy slot, registers workers (the ordinary
  :class:`~fastroute.control.registry.Registry`), runs the load monitor and health checks, serves
  ``/metrics`` once for all processes, and starts, watches and restarts the proxy processes;
* the **proxy processes** (``python -P -m fastroute.runtime.child DIR SLOT``) attach the table
  by name, listen on the same port with ``SO_REUSEPORT`` (the kernel spreads connections across
  them), and serve requests with a :class:`~fastroute.control.follower.FollowerRegistry`: a
  registry that never registers or monitors anything itself but mirrors the supervisor's worker
  set.

Worker-set sync: the supervisor writes a JSON snapshot of its workers (``workers.json`` in a
private 0700 state directory, replaced atomically) whenever it changes and then bumps the table's
generation header.  Every proxy process checks the generation every ``SYNC_INTERVAL`` seconds
(one atomic load, off the request path) and re-reads the snapshot when it moved.  Requests that
change the worker set (POST/PUT/DELETE ``/workers``, ``/add_worker``, ``/remove_worker``) arrive
at whichever process accepted the connection; it forwards them to the supervisor's loopback
control listener (guarded by a per-run secret) and applies the snapshot version the supervisor
answers with before it replies, so the caller's next request sees the change on that process.

Lease accounting across processes: a proxy process books each lease twice, in the shared table
(what every policy reads) and in its own ledger row for the same target (what only this process
holds).  If the process dies, the supervisor subtracts exactly the dead process's ledger from the
table, counts those leases in ``fastroute_leases_reclaimed_total{reason="process_exit"}`` and
starts a replacement.  Order matters for a kill between the two bookings: the table is booked
before the ledger and the ledger released before the table, so such a kill can leak one booking
but never makes the supervisor subtract a booking that another process owns.

Statistics: each proxy process pickles its :class:`~fastroute.control.metrics.Stats` into the state
directory every ``STATS_INTERVAL`` seconds and when it exits; the supervisor merges them (plus
the last report of dead processes) at scrape time.  Counts made by a killed process since its
last report are lost; everything else is exact.

Shared memory is created by the supervisor only, so its ``multiprocessing`` resource tracker
removes the segments even if the supervisor itself is killed; the normal exit paths unlink them
explicitly.  Proxy processes ask the kernel for SIGTERM when the supervisor dies.

Where the pieces live: the follower registry and the snapshot format in
:mod:`fastroute.control.follower`, crash reclaim in :mod:`fastroute.control.leases`, the Stats
merge and the per-process collector in :mod:`fastroute.control.metrics`, the proxy process's
entry in :mod:`fastroute.runtime.child`; this module supervises.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pickle
import secrets
import shutil
import signal
import socket
import sys
import tempfile
from typing import Any

from fastroute.auth import matches
from fastroute.config import Config
from fastroute.control.discovery import Discovery, start_discovery
from fastroute.control.follower import CONTROL_HEADER, VERSION_HEADER, snapshot_doc
from fastroute.control.kvevents import KvEvents
from fastroute.control.leases import Reconciler, reclaim
from fastroute.control.metrics import MetricsServer, ProcessCollector, Stats, merge_stats, new_stats
from fastroute.control.monitor import Monitor
from fastroute.control.registry import Registry
from fastroute.control.replica import ReplicaSync, start_replica_sync
from fastroute.core.table import TargetTable
from fastroute.runtime.assemble import assemble, stop_in_order
from fastroute.runtime.probe import ProbeServer
from fastroute.runtime.startup import announce, bind_error, new_table, own_listeners, start_probe, tls_context

log = logging.getLogger("fastroute.supervisor")

PUBLISH_INTERVAL = 0.1  # seconds between the supervisor's snapshot change checks
RECONCILE_TICKS = 50  # reconcile the table with the engines' polls every 5 s
RESTART_BACKOFF = (0.05, 5.0)  # first and largest delay before restarting a crashed process
HEAD_LIMIT_SECS = 10  # a control request's head and body must arrive within this


def child_command(state_dir: str, slot: int, module: str = "fastroute.runtime.child") -> list[str]:
    """How a proxy process starts (``module``: its entry, whose ``main(state_dir, slot)``
    serves), without the current directory on ``sys.path``: ``-m`` would put it first, so a
    ``fastroute/`` directory there (the uncompiled source tree after ``pip install .``, or a
    planted package) would be imported instead of the installed one."""
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", module, state_dir, str(slot)]
    return [sys.executable, "-c", _CHILD_BOOT % module, state_dir, str(slot)]


# Python < 3.11 has no -P: `-c` puts '' (the current directory) first; drop it before importing.
_CHILD_BOOT = "import sys; del sys.path[0]; from %s import main; sys.exit(main(sys.argv[1], int(sys.argv[2])))"


def resolve_processes(config: Config) -> int:
    """The number of proxy processes ``config.workers`` asks for."""
    return max(1, int(config.workers))


# ---------------------------------------------------------------------------------- supervisor


class _Child:
    """Book-keeping of one proxy slot."""

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.proc: asyncio.subprocess.Process | None = None
        self.watch: asyncio.Task | None = None
        self.restarts = 0
        self.reported_ready = False
        self.stats: Stats | None = None
        self.delay = RESTART_BACKOFF[0]
        self.version = -1

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


class Supervisor:
    """The control-plane process of a multi-process router (see module docstring)."""

    child_module = "fastroute.runtime.child"  # the serving processes' entry (epp: its own)
    child_files: dict[str, Any] = {}  # more JSON files for them in the state directory

    def __init__(self, config: Config, processes: int | None = None) -> None:
        self.config = config
        self.n = resolve_processes(config) if processes is None else int(processes)
        self.table: TargetTable | None = None
        self.ledgers: list[TargetTable] = []
        self.registry: Registry | None = None
        self.monitor: Monitor | None = None
        self.kv_events: KvEvents | None = None
        self.metrics: MetricsServer | None = None
        self.probe: ProbeServer | None = None
        self.reconciler: Reconciler | None = None
        self.discovery: Discovery | None = None
        self.replica: ReplicaSync | None = None  # once for the host: the table is here
        self.children = [_Child(i) for i in range(self.n)]
        self.port = 0
        self.state_dir = ""
        self.version = 0
        self._last_doc = ""
        self._secret = secrets.token_hex(16)
        self._reserve: socket.socket | None = None
        self._control: asyncio.AbstractServer | None = None
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._stopped = asyncio.Event()
        self.stats: Stats | None = None  # the supervisor's own (reclaims)
        self.retired: Stats | None = None  # final reports of processes that exited
        self.stats_views: list[Stats] = []  # what the metrics collector merges

    # ---- start --------------------------------------------------------------------------------
    async def start(self) -> None:
        cfg = self.config
        tls_context(cfg)  # checked once here: the proxy processes load the same files
        self.state_dir = tempfile.mkdtemp(prefix="fastroute-")  # 0700: holds worker API keys
        try:
            self.table = new_table(cfg, copies=1 + self.n)
            for _ in range(self.n):
                self.ledgers.append(TargetTable(capacity=self.table.capacity))
            self.port = self._reserve_port()
            self.stats, self.retired = new_stats(cfg), new_stats(cfg)
            self.stats_views = [self.stats, self.retired]
            # No App here: the proxy processes serve. The one reconciler of the shared table
            # runs here, so a mismatch is counted once, not once per process.
            parts = await assemble(cfg, self.table, serve=False, stats=self.stats)
            self.registry, self.monitor, self.metrics = parts.registry, parts.monitor, parts.metrics
            self.kv_events = parts.kv_events
            self.reconciler = parts.reconciler
            assert self.metrics is not None and self.monitor is not None
            self.metrics.collector.stats = self.stats_views  # merged at scrape time
            self.metrics.registry.register(ProcessCollector(self))
            self.probe = start_probe(cfg, self.probe_ready)
            self._control = await asyncio.start_server(self._control_conn, "127.0.0.1", 0)
            control_port = self._control.sockets[0].getsockname()[1]
            own_listeners(self.registry, cfg, self.port, self.metrics, self.probe)
            self.registry.own.add("127.0.0.1", control_port, "control listener")
            with open(os.path.join(self.state_dir, "config.pickle"), "wb") as f:
                pickle.dump(cfg, f)
            with open(os.path.join(self.state_dir, "child.json"), "w") as f:
                json.dump(
                    {
                        "table": self.table.name,
                        "ledgers": [x.name for x in self.ledgers],
                        "port": self.port,
                        "control_url": f"http://127.0.0.1:{control_port}",
                        "secret": self._secret,
                    },
                    f,
                )
            for name, doc in self.child_files.items():
                with open(os.path.join(self.state_dir, name), "w") as f:
                    json.dump(doc, f)
            self.publish(force=True)
            for child in self.children:
                await self._spawn(child)
            await self.registry.start()
            self.discovery = await start_discovery(cfg, self.registry, self.stats)
            self.monitor.start()
            self.replica = await start_replica_sync(cfg, self.table, self.registry, self.metrics, self.port)
            loop = asyncio.get_running_loop()
            self._tasks.append(loop.create_task(self._publish_loop(), name="snapshot publisher"))
        except BaseException:
            await self._teardown()
            raise
        announce(cfg, self.port, self.n)

    def _reserve_port(self) -> int:
        """Hold the listening port (bound, never listening, so it takes no connections) for the
        whole run: with ``--port 0`` all processes need one concrete port, and a restarted
        process must find it still free."""
        cfg = self.config
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        port = int(cfg.port)
        # First without SO_REUSEPORT: a port another router (or anything) holds must stop this
        # start, not be shared with it. The reservation itself needs the option (the proxy
        # processes bind beside it).
        for reuse_port in (False, True):
            s = socket.socket(family, socket.SOCK_STREAM)
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if reuse_port:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
                s.bind((cfg.host, port))
            except OSError as exc:
                s.close()
                raise bind_error("--port", cfg.host, port, exc) from None
            if not reuse_port:
                port = s.getsockname()[1]  # --port 0: keep the port the kernel chose
                s.close()
        self._reserve = s
        return port

    async def _spawn(self, child: _Child) -> None:
        env = dict(os.environ)
        pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        child.reported_ready = False
        child.stats = None
        child.version = -1
        child.proc = await asyncio.create_subprocess_exec(
            *child_command(self.state_dir, child.slot, self.child_module), stdin=asyncio.subprocess.DEVNULL, env=env
        )
        child.watch = asyncio.get_running_loop().create_task(self._watch(child), name=f"proxy {child.slot}")
        log.info("proxy process %d started (pid %d)", child.slot, child.proc.pid)

    async def _watch(self, child: _Child) -> None:
        """Wait for the process to exit; reclaim its leases and start a replacement."""
        proc = child.proc
        assert proc is not None
        code = await proc.wait()
        self._retire(child, proc.pid)
        if self._stopping:
            return
        log.error(
            "proxy process %d (pid %d) exited with %s; restarting in %.2fs", child.slot, proc.pid, code, child.delay
        )
        await asyncio.sleep(child.delay)
        # Back off while it keeps crashing; a process that lived a while starts over fast.
        child.delay = min(child.delay * 2, RESTART_BACKOFF[1])
        if self._stopping:
            return
        child.restarts += 1
        await self._spawn_replacement(child)

    async def _spawn_replacement(self, child: _Child) -> None:
        try:
            await self._spawn(child)
        except OSError:
            log.exception("cannot restart proxy process %d", child.slot)

    def _retire(self, child: _Child, pid: int) -> None:
        """A process exited: keep its last statistics, give back what it had booked."""
        assert self.table is not None and self.stats is not None and self.retired is not None  # after start()
        report = self._read_report(child.slot, pid)
        if report is not None:
            merge_stats(self.retired, report["stats"])
        child.stats = None
        child.reported_ready = False
        try:
            os.unlink(self._report_path(child.slot))
        except FileNotFoundError:
            pass
        reqs, toks = reclaim(self.table, self.ledgers[child.slot])
        if reqs:
            self.stats.count(self.stats.reclaimed, "process_exit", reqs)
            log.warning("reclaimed %d leases (%d tokens) of proxy process %d", reqs, toks, child.slot)
        self._refresh_views()

    def _report_path(self, slot: int) -> str:
        return os.path.join(self.state_dir, f"stats-{slot}.pickle")

    def _read_report(self, slot: int, pid: int) -> dict[str, Any] | None:
        try:
            with open(self._report_path(slot), "rb") as f:
                report = pickle.load(f)
        except (OSError, EOFError, pickle.UnpicklingError):
            return None
        return report if report.get("pid") == pid else None

    def _refresh_views(self) -> None:
        for child in self.children:
            if child.alive and child.proc is not None:
                report = self._read_report(child.slot, child.proc.pid)
                if report is not None:
                    child.stats = report["stats"]
                    child.version = int(report["version"])
                    child.reported_ready = bool(report["ready"]) and report["version"] >= 0
                    if child.reported_ready:
                        child.delay = RESTART_BACKOFF[0]
        self.stats_views[2:] = [c.stats for c in self.children if c.stats is not None]

    # ---- snapshot -----------------------------------------------------------------------------
    def publish(self, force: bool = False) -> bool:
        """Write the worker snapshot if it changed, then bump the table generation."""
        assert self.table is not None  # publishing starts once start() made the table
        doc = snapshot_doc(self.registry, 0) if self.registry is not None else {"workers": []}
        body = json.dumps(doc["workers"], sort_keys=True, default=str)
        if body == self._last_doc and not force:
            return False
        self._last_doc = body
        self.version += 1
        doc["version"] = self.version
        path = os.path.join(self.state_dir, "workers.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(doc, f, default=str)
        os.replace(tmp, path)
        self.table.bump_generation()
        return True

    async def _publish_loop(self) -> None:
        ticks = 0
        while True:
            await asyncio.sleep(PUBLISH_INTERVAL)
            try:
                self.publish()
                ticks += 1
                if ticks % 2 == 0:
                    self._refresh_views()
                if ticks % RECONCILE_TICKS == 0:
                    assert self.reconciler is not None and self.registry is not None  # set by start()
                    self.reconciler.check(self.registry.target_info, asyncio.get_running_loop().time())
            except Exception:  # keep publishing whatever one tick did
                log.exception("snapshot publisher")

    # ---- control listener (proxy processes -> supervisor) -----------------------------------
    async def _control_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One forwarded admin request from a proxy process (HTTP/1.1, one per connection).

        The secret is checked on the head, before any body byte is read, and the body is
        bounded by the router's payload limit (the proxy process accepted no more than that)."""
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_LIMIT_SECS)
            lines = head.decode("latin-1").split("\r\n")
            method, target = lines[0].split(" ")[:2]
            headers: dict[str, str] = {}
            for line in lines[1:]:
                k, sep, v = line.partition(":")
                if sep:
                    headers[k.strip().lower()] = v.strip()
            n = int(headers.get("content-length", "0") or 0)
            got = headers.get(CONTROL_HEADER)
            if not matches(self._secret.encode(), None if got is None else got.encode("latin-1")):
                status, rbody, ctype = 403, b"forbidden", b"text/plain"
            elif not 0 <= n <= int(self.config.max_payload_size):
                status, rbody, ctype = 413, b"request body too large", b"text/plain"
            else:
                body = await asyncio.wait_for(reader.readexactly(n), HEAD_LIMIT_SECS) if n else b""
                path, _, query = target.partition("?")
                assert self.registry is not None
                status, rbody, ctype = await self.registry.admin.handle_admin(method, path, query, body, headers)
                self.publish()
            if isinstance(ctype, str):
                ctype = ctype.encode("latin-1")
            writer.write(
                b"HTTP/1.1 %d X\r\nContent-Type: %b\r\nContent-Length: %d\r\n%b: %d\r\n"
                b"Connection: close\r\n\r\n%b"
                % (status, ctype, len(rbody), VERSION_HEADER.encode(), self.version, rbody)
            )
            await writer.drain()
        except (
            asyncio.TimeoutError,
            asyncio.IncompleteReadError,
            ConnectionError,
            ValueError,
            asyncio.LimitOverrunError,
        ):
            pass
        finally:
            writer.close()

    # ---- stop ---------------------------------------------------------------------------------
    def probe_ready(self) -> bool:
        """Readiness on --health-check-port: the workers', and 503 once the drain started (the
        proxy processes answer 503 on the main port from their SIGTERM on)."""
        return not self._stopping and self.registry is not None and self.registry.ready()

    async def stop(self, grace: float | None = None, linger: float = 0.0) -> None:
        """Drain every proxy process (SIGTERM; each keeps serving with readiness 503 while
        requests are in flight, up to the grace period), then stop the control plane and remove
        the shared memory. The probe port answers 503 from the start of the drain."""
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        if grace is None:
            grace = float(self.config.shutdown_grace_period_secs)
        try:
            procs = [c.proc for c in self.children if c.proc is not None and c.proc.returncode is None]
            for p in procs:
                try:
                    p.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
            if procs:
                # The processes enforce the grace period themselves; the margin covers start-up.
                _, pending = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs], timeout=grace + 5.0)
                for p in procs:
                    if p.returncode is None:
                        log.warning("proxy process pid %d did not drain in time; killing it", p.pid)
                        p.kill()
                if pending:
                    await asyncio.wait(pending, timeout=5.0)
            watches = [c.watch for c in self.children if c.watch is not None]
            if watches:
                await asyncio.wait(watches, timeout=5.0)
        finally:
            await self._teardown()
            self._stopped.set()

    async def _teardown(self) -> None:
        for t in self._tasks:
            t.cancel()
        for c in self.children:
            if c.watch is not None and not c.watch.done():
                c.watch.cancel()
            if c.alive and c.proc is not None:  # only after a failed start or a stuck drain
                c.proc.kill()
                try:
                    await asyncio.wait_for(c.proc.wait(), 5.0)
                except asyncio.TimeoutError:
                    pass
        try:
            await stop_in_order(self.discovery, self.replica, self.monitor, self.kv_events, self.registry, self.metrics)
            if self._control is not None:
                self._control.close()
            if self.probe is not None:
                self.probe.stop()
        finally:
            if self._reserve is not None:
                self._reserve.close()
            for seg in [self.table, *self.ledgers]:
                if seg is not None:
                    seg.close()
                    seg.unlink()
            if self.state_dir:
                shutil.rmtree(self.state_dir, ignore_errors=True)

    async def wait_stopped(self) -> None:
        await self._stopped.wait()
