"""Multi-process serving (``--workers N``): one supervisor, N proxy processes, one target table.

Owns everything that exists only when the router runs as several processes:

* the **supervisor** (the process the CLI started) creates the shared target table and one
  per-process *ledger* table per proxy slot, registers workers (the ordinary
  :class:`~fastroute.control.workers.Registry`), runs the load monitor and health checks, serves
  ``/metrics`` once for all processes, and starts, watches and restarts the proxy processes;
* the **proxy processes** (``python -m fastroute.runtime.supervisor --child DIR SLOT``) attach the table
  by name, listen on the same port with ``SO_REUSEPORT`` (the kernel spreads connections across
  them), and serve requests with a :class:`FollowerRegistry`: a registry that never registers
  or monitors anything itself but mirrors the supervisor's worker set.

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
"""
from __future__ import annotations

import asyncio
import ctypes
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

import numpy as np

from fastroute.control import httpclient
from fastroute.control.httpclient import HttpClientError
from fastroute.core.table import COL_ALLOCATED, COL_IN_FLIGHT, COL_IN_FLIGHT_TOKENS, COL_PICKS
from fastroute.control.workers import Registry, Worker, _header

log = logging.getLogger("fastroute.supervisor")

SYNC_INTERVAL = 0.1          # seconds between a proxy process's generation checks
STATS_INTERVAL = 0.25        # seconds between a proxy process's Stats reports
PUBLISH_INTERVAL = 0.1       # seconds between the supervisor's snapshot change checks
RECONCILE_TICKS = 50          # reconcile the table with the engines' polls every 5 s
RESTART_BACKOFF = (0.05, 5.0)  # first and largest delay before restarting a crashed process

_CONTROL_HEADER = "x-fastroute-control"
_VERSION_HEADER = "x-fastroute-snapshot"
# Admin requests that change the worker set: served by the supervisor, wherever they arrive.
_FORWARD_PATHS = ("/add_worker", "/remove_worker")
_WORKER_FIELDS = ("url", "role", "id", "host", "port", "bootstrap_port", "dp_size", "targets",
                  "names", "model_id", "server_info", "model_info", "healthy", "status",
                  "priority", "cost", "labels", "api_key", "requested_model_id", "error",
                  "server_info_path", "model_info_path")


def resolve_processes(config: Any) -> int:
    """The number of proxy processes ``config.workers`` asks for (``auto`` -> CPU count)."""
    n = getattr(config, "workers", 1)
    if n == "auto":
        return os.cpu_count() or 1
    return max(1, int(n))


# ---------------------------------------------------------------------------------- leases


def reclaim(table: Any, ledger: Any) -> tuple[int, int]:
    """Subtract everything ``ledger`` (a dead process's bookings) holds from ``table`` and zero
    the ledger -> (requests, tokens) reclaimed.  Only call once the ledger's owner is gone."""
    snap = ledger.snapshot()
    rows = np.nonzero((snap[:, COL_IN_FLIGHT] != 0) | (snap[:, COL_IN_FLIGHT_TOKENS] != 0))[0]
    reqs = toks = 0
    for t in rows.tolist():
        r = int(snap[t, COL_IN_FLIGHT])
        k = int(snap[t, COL_IN_FLIGHT_TOKENS])
        # The table holds at least these bookings (booked there first, released there last).
        table.cells.add(t, COL_IN_FLIGHT, -r)
        table.cells.add(t, COL_IN_FLIGHT_TOKENS, -k)
        ledger.cells.store(t, COL_IN_FLIGHT, 0)
        ledger.cells.store(t, COL_IN_FLIGHT_TOKENS, 0)
        reqs += r
        toks += k
    return reqs, toks


# ---------------------------------------------------------------------------------- snapshot


def snapshot_doc(registry: Registry, version: int) -> dict[str, Any]:
    """The worker set as the proxy processes need it (every worker, any status)."""
    return {"version": version,
            "workers": [{f: getattr(w, f) for f in _WORKER_FIELDS} for w in registry.workers]}


class FollowerRegistry(Registry):
    """A proxy process's view of the supervisor's registry (see module docstring).

    Reads (``/workers`` GET, ``/get_loads``, ``/readiness``, info endpoints) are answered from
    the mirrored workers and the shared table; changes are forwarded to the supervisor."""

    def __init__(self, config: Any, table: Any, router: Any, ledger: Any, state_dir: str,
                 control_url: str, secret: str) -> None:
        super().__init__(config, table, router)
        self.ledger = ledger
        self.state_dir = state_dir
        self.control_url = control_url
        self._secret = secret
        self.version = -1
        self._seen_generation = -1
        for g in self._groups.values():
            g.track_in(ledger)

    async def start(self) -> None:
        """Nothing to register: the supervisor does that."""

    async def stop(self) -> None:
        """No tasks of its own."""

    def poll(self) -> bool:
        """Re-read the snapshot if the table's generation moved; True when it was applied."""
        gen = self.table.generation
        if gen == self._seen_generation:
            return False
        self._seen_generation = gen
        return self.sync()

    def sync(self) -> bool:
        """Read the current snapshot file and apply it if it is newer than the view."""
        try:
            with open(os.path.join(self.state_dir, "workers.json"), "rb") as f:
                doc = json.loads(f.read())
        except (OSError, ValueError) as exc:
            log.warning("cannot read the worker snapshot: %s", exc)
            return False
        if int(doc.get("version", -1)) <= self.version:
            return False
        self.apply(doc)
        return True

    def apply(self, doc: dict[str, Any]) -> None:
        """Replace the view with ``doc``; groups change only for roles whose targets changed."""
        before = {r: (list(g.targets), list(g.names)) for r, g in self._groups.items()}
        by_id = {w.id: w for w in self.workers}
        workers: list[Worker] = []
        for d in doc["workers"]:
            w = by_id.get(d["id"])
            if w is None or w.url != d["url"]:
                w = Worker(url=d["url"], role=d["role"], id=d["id"])
            for f in _WORKER_FIELDS:
                setattr(w, f, d[f])
            workers.append(w)
        info: list[tuple[Worker, int | None] | None] = [None] * self.table.capacity
        for w in workers:
            if w.status == "ready":
                split = len(w.targets) > 1
                for r, t in enumerate(w.targets):
                    info[t] = (w, r if split else None)
        # Like the supervisor's registry, keep a removed worker's rows resolvable while the row
        # is still allocated (requests in flight on it), so a late lookup finds its worker.
        for t, old in enumerate(self.target_info):
            if old is not None and info[t] is None and self.table.get(t, COL_ALLOCATED):
                info[t] = old
        # Swap in one synchronous step: a request sees the old view or the new one, not a mix.
        self.workers = workers
        self.target_info = info
        for role, g in self._groups.items():
            targets: list[int] = []
            names: list[str] = []
            for w in workers:
                if w.role == role and w.status == "ready":
                    targets.extend(w.targets)
                    names.extend(w.names)
            if (targets, names) != before[role]:
                self._sync_group(role)
        self.version = int(doc["version"])
        self.invalidate_ready()     # Registry.ready() recomputes once, on the next request

    async def handle_admin(self, method: str, path: str, query: str, body: bytes,
                           headers: Any) -> tuple[int, bytes, bytes]:
        if (path in _FORWARD_PATHS
                or (method in ("POST", "PUT", "DELETE") and (path == "/workers"
                                                              or path.startswith("/workers/")))):
            return await self._forward(method, path, query, body, headers)
        return await super().handle_admin(method, path, query, body, headers)

    async def _forward(self, method: str, path: str, query: str, body: bytes,
                       headers: Any) -> tuple[int, bytes, bytes]:
        fwd = {_CONTROL_HEADER: self._secret}
        auth = _header(headers, "authorization")
        if auth is not None:
            fwd["authorization"] = auth
        url = self.control_url + path + ("?" + query if query else "")
        # /add_worker waits for registration: allow the whole startup timeout.
        timeout = float(self.config.worker_startup_timeout_secs) + 10.0
        try:
            status, rhdrs, rbody = await httpclient.request(method, url, body, fwd, timeout=timeout)
        except HttpClientError as exc:
            from fastroute.errors import error_response
            return 503, error_response(503, "supervisor_unreachable", str(exc)), b"application/json"
        version = httpclient.header(rhdrs, _VERSION_HEADER)
        if version is not None and int(version) > self.version:
            self.sync()     # written before the supervisor answered
        ctype = httpclient.header(rhdrs, "content-type") or "application/json"
        return status, rbody, ctype.encode("latin-1")



# ---------------------------------------------------------------------------------- stats


def merge_stats(dst: Any, src: Any) -> None:
    """Add ``src``'s counters and histograms into ``dst`` (two ``metrics.Stats``).

    Generic over the attributes, so counters the proxy adds later are merged too: a dict of
    ints is a labelled counter, a dict of ``Hist`` a labelled histogram, a ``Hist`` a histogram.
    Plain ints (``connections_active``) are gauges of a live process and are not carried over."""
    from fastroute.control.metrics import Hist

    for attr, val in vars(src).items():
        if isinstance(val, Hist):
            mine = getattr(dst, attr, None)
            if isinstance(mine, Hist):
                _add_hist(mine, val)
        elif isinstance(val, dict):
            d = getattr(dst, attr, None)
            if not isinstance(d, dict):
                continue
            for k, v in val.items():
                if isinstance(v, Hist):
                    h = d.get(k)
                    if h is None:
                        h = d[k] = Hist(v.bounds)
                    _add_hist(h, v)
                elif isinstance(v, (int, float)):
                    d[k] = d.get(k, 0) + v


def _add_hist(dst: Any, src: Any) -> None:
    if dst.bounds != src.bounds:
        return
    for i, c in enumerate(src.counts):
        dst.counts[i] += c
    dst.sum += src.sum


class ProcessCollector:
    """Prometheus families about the proxy processes (read at scrape time from the ledgers)."""

    def __init__(self, sup: "Supervisor") -> None:
        self.sup = sup

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        sup = self.sup
        up = GaugeMetricFamily("fastroute_proxy_process_up",
                               "1 when the proxy process runs and reported a ready worker view",
                               labels=["process"])
        restarts = CounterMetricFamily("fastroute_proxy_process_restarts",
                                       "Proxy processes started again after they exited",
                                       labels=["process"])
        inflight = GaugeMetricFamily("fastroute_proxy_process_in_flight_requests",
                                     "Leases the proxy process holds", labels=["process"])
        picks = CounterMetricFamily("fastroute_proxy_process_picks",
                                    "Targets picked by the proxy process slot", labels=["process"])
        version = GaugeMetricFamily("fastroute_proxy_process_snapshot_version",
                                    "Worker snapshot version the proxy process last reported "
                                    "(the supervisor's own is process=\"supervisor\")",
                                    labels=["process"])
        version.add_metric(["supervisor"], float(sup.version))
        pid = GaugeMetricFamily("fastroute_proxy_process_pid",
                                "Operating-system pid of the running proxy process", labels=["process"])
        for slot, child in enumerate(sup.children):
            label = [str(slot)]
            up.add_metric(label, 1.0 if child.alive and child.reported_ready else 0.0)
            restarts.add_metric(label, float(child.restarts))
            snap = sup.ledgers[slot].snapshot()
            inflight.add_metric(label, float(snap[:, COL_IN_FLIGHT].sum()))
            picks.add_metric(label, float(snap[:, COL_PICKS].sum()))
            if child.alive and child.proc is not None:
                pid.add_metric(label, float(child.proc.pid))
                version.add_metric(label, float(child.version))
        yield from (up, restarts, inflight, picks, version, pid)


# ---------------------------------------------------------------------------------- supervisor


class _Child:
    """Book-keeping of one proxy slot."""

    def __init__(self, slot: int) -> None:
        self.slot = slot
        self.proc: asyncio.subprocess.Process | None = None
        self.watch: asyncio.Task | None = None
        self.restarts = 0
        self.reported_ready = False
        self.stats: Any = None
        self.delay = RESTART_BACKOFF[0]
        self.version = -1

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


class Supervisor:
    """The control-plane process of a multi-process router (see module docstring)."""

    def __init__(self, config: Any, processes: int | None = None) -> None:
        self.config = config
        self.n = resolve_processes(config) if processes is None else int(processes)
        self.table: Any = None
        self.ledgers: list[Any] = []
        self.registry: Any = None
        self.monitor: Any = None
        self.metrics: Any = None
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
        self.stats: Any = None                  # the supervisor's own (reclaims)
        self.retired: Any = None                # final reports of processes that exited
        self.stats_views: list[Any] = []        # what the metrics collector merges

    # ---- start --------------------------------------------------------------------------------
    async def start(self) -> None:
        from fastroute.control.metrics import DEFAULT_BUCKETS, Stats, start_metrics
        from fastroute.control.monitor import Monitor, Reconciler
        from fastroute.core.routing import Router
        from fastroute.core.table import TargetTable

        cfg = self.config
        self.state_dir = tempfile.mkdtemp(prefix="fastroute-")   # 0700: holds worker API keys
        try:
            self.table = TargetTable()
            for _ in range(self.n):
                self.ledgers.append(TargetTable(capacity=self.table.capacity))
            self.port = self._reserve_port()
            buckets = getattr(cfg, "prometheus_duration_buckets", None) or DEFAULT_BUCKETS
            self.stats, self.retired = Stats(buckets), Stats(buckets)
            self.stats_views = [self.stats, self.retired]
            router = Router(self.table, seed=cfg.seed, config=cfg)
            self.registry = Registry(cfg, self.table, router)
            self.monitor = Monitor(cfg, self.registry, self.table)
            # One reconciler for the shared table (the proxy processes run none): a mismatch is
            # a fact about the table, so it is counted once, not once per process.
            self.reconciler = Reconciler(self.table, float(cfg.request_timeout_secs),
                                         lambda name: self.stats.reclaim("reconcile_mismatch"))
            self.metrics = await start_metrics(cfg, self.table, self.registry, self.stats)
            self.metrics.collector.stats = self.stats_views   # merged at scrape time
            self.metrics.registry.register(ProcessCollector(self))
            self._control = await asyncio.start_server(self._control_conn, "127.0.0.1", 0)
            control_port = self._control.sockets[0].getsockname()[1]
            with open(os.path.join(self.state_dir, "config.pickle"), "wb") as f:
                pickle.dump(cfg, f)
            with open(os.path.join(self.state_dir, "child.json"), "w") as f:
                json.dump({"table": self.table.name, "ledgers": [x.name for x in self.ledgers],
                           "port": self.port, "control_url": f"http://127.0.0.1:{control_port}",
                           "secret": self._secret}, f)
            self.publish(force=True)
            for child in self.children:
                await self._spawn(child)
            await self.registry.start()
            self.monitor.start()
            loop = asyncio.get_running_loop()
            self._tasks.append(loop.create_task(self._publish_loop(), name="snapshot publisher"))
        except BaseException:
            await self._teardown()
            raise
        log.info("fastroute listening on %s:%d (%s mode, %d proxy processes)", cfg.host, self.port,
                 "PD" if cfg.pd_disaggregation else "regular", self.n)

    def _reserve_port(self) -> int:
        """Hold the listening port (bound, never listening, so it takes no connections) for the
        whole run: with ``--port 0`` all processes need one concrete port, and a restarted
        process must find it still free."""
        cfg = self.config
        family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind((cfg.host, int(cfg.port)))
        self._reserve = s
        return s.getsockname()[1]

    async def _spawn(self, child: _Child) -> None:
        env = dict(os.environ)
        pkg_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        child.reported_ready = False
        child.stats = None
        child.version = -1
        child.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fastroute.runtime.supervisor", "--child", self.state_dir, str(child.slot),
            stdin=asyncio.subprocess.DEVNULL, env=env)
        child.watch = asyncio.get_running_loop().create_task(self._watch(child),
                                                             name=f"proxy {child.slot}")
        log.info("proxy process %d started (pid %d)", child.slot, child.proc.pid)

    async def _watch(self, child: _Child) -> None:
        """Wait for the process to exit; reclaim its leases and start a replacement."""
        proc = child.proc
        assert proc is not None
        code = await proc.wait()
        self._retire(child, proc.pid)
        if self._stopping:
            return
        log.error("proxy process %d (pid %d) exited with %s; restarting in %.2fs", child.slot,
                  proc.pid, code, child.delay)
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
                    self.reconciler.check(self.registry.target_info,
                                          asyncio.get_running_loop().time())
            except Exception:  # keep publishing whatever one tick did
                log.exception("snapshot publisher")

    # ---- control listener (proxy processes -> supervisor) -----------------------------------
    async def _control_conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            lines = head.decode("latin-1").split("\r\n")
            method, target = lines[0].split(" ")[:2]
            headers: dict[str, str] = {}
            for line in lines[1:]:
                k, sep, v = line.partition(":")
                if sep:
                    headers[k.strip().lower()] = v.strip()
            n = int(headers.get("content-length", "0") or 0)
            body = await asyncio.wait_for(reader.readexactly(n), 10) if n else b""
            if not secrets.compare_digest(headers.get(_CONTROL_HEADER, ""), self._secret):
                status, rbody, ctype = 403, b"forbidden", b"text/plain"
            else:
                path, _, query = target.partition("?")
                status, rbody, ctype = await self.registry.handle_admin(method, path, query, body,
                                                                        headers)
                self.publish()
            if isinstance(ctype, str):
                ctype = ctype.encode("latin-1")
            writer.write(b"HTTP/1.1 %d X\r\nContent-Type: %b\r\nContent-Length: %d\r\n%b: %d\r\n"
                         b"Connection: close\r\n\r\n%b"
                         % (status, ctype, len(rbody), _VERSION_HEADER.encode(), self.version, rbody))
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, ValueError,
                asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    # ---- stop ---------------------------------------------------------------------------------
    async def stop(self, grace: float | None = None) -> None:
        """Drain every proxy process (SIGTERM; each finishes in-flight requests up to the grace
        period), then stop the control plane and remove the shared memory."""
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        if grace is None:
            grace = float(self.config.shutdown_grace_period_secs)
        try:
            procs = [c.proc for c in self.children if c.alive]
            for p in procs:
                try:
                    p.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
            if procs:
                # The processes enforce the grace period themselves; the margin covers start-up.
                _, pending = await asyncio.wait([asyncio.ensure_future(p.wait()) for p in procs],
                                                timeout=grace + 5.0)
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
            if c.alive and c.proc is not None:      # only after a failed start or a stuck drain
                c.proc.kill()
                try:
                    await asyncio.wait_for(c.proc.wait(), 5.0)
                except asyncio.TimeoutError:
                    pass
        try:
            if self.monitor is not None:
                await self.monitor.stop()
            if self.registry is not None:
                await self.registry.stop()
            if self.metrics is not None:
                await self.metrics.stop()
            if self._control is not None:
                self._control.close()
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


async def serve(config: Any) -> int:
    """Supervise until SIGTERM/SIGINT, then drain every proxy process; returns the exit status."""
    from fastroute.runtime.server import serve as serve_with

    return await serve_with(config, Supervisor)


def run(config: Any) -> int:
    """Blocking entry point for ``--workers N`` (N > 1)."""
    import uvloop

    return uvloop.run(serve(config))


# ---------------------------------------------------------------------------------- child


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this process when the supervisor dies (no orphaned listeners)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


async def _child_serve(state_dir: str, slot: int) -> int:
    from fastroute.control.metrics import DEFAULT_BUCKETS, Stats, group_decisions
    from fastroute.core.breaker import Breakers
    from fastroute.dataplane.app import App
    from fastroute.core.routing import Router
    from fastroute.core.table import TargetTable

    with open(os.path.join(state_dir, "config.pickle"), "rb") as f:
        cfg = pickle.load(f)
    with open(os.path.join(state_dir, "child.json")) as f:
        info = json.load(f)
    parent = os.getppid()
    loop = asyncio.get_running_loop()
    table = TargetTable.attach(info["table"])
    ledger = TargetTable.attach(info["ledgers"][slot])
    # Distinct RNG streams per process (ties and random picks must not move in lockstep).
    seed = None if cfg.seed is None else int(cfg.seed) + 0x1000003 * (slot + 1)
    router = Router(table, seed=seed, config=cfg)
    registry = FollowerRegistry(cfg, table, router, ledger, state_dir, info["control_url"],
                                info["secret"])
    registry.poll()
    # No reconciler here: the supervisor reconciles the shared table once for all processes.
    breakers = Breakers(table, int(table.capacity), cfg.cb_failure_threshold,
                        cfg.cb_success_threshold, cfg.cb_timeout_duration_secs,
                        not cfg.disable_circuit_breaker, name_of=registry.target_name,
                        clock=loop.time)
    app = App(cfg, registry, loop, breakers=breakers)
    app.stats = Stats(getattr(cfg, "prometheus_duration_buckets", None) or DEFAULT_BUCKETS)
    listener = await loop.create_server(app.protocol_factory, cfg.host, int(info["port"]),
                                        reuse_address=True, reuse_port=True, backlog=4096)
    app.start()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    report_path = os.path.join(state_dir, f"stats-{slot}.pickle")

    def report() -> None:
        # Policy decision counters live in this process's compiled pickers: carry their
        # current totals in the report so the supervisor's /metrics includes them.
        app.stats.decisions = group_decisions(registry._groups)
        doc = {"pid": os.getpid(), "version": registry.version, "ready": registry.ready(),
               "stats": app.stats}
        tmp = f"{report_path}.{os.getpid()}"
        with open(tmp, "wb") as f:
            pickle.dump(doc, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, report_path)

    async def background() -> None:
        every = max(1, round(STATS_INTERVAL / SYNC_INTERVAL))
        tick = 0
        while True:
            await asyncio.sleep(SYNC_INTERVAL)
            try:
                registry.poll()
                tick += 1
                if tick % every == 0:
                    report()
                if os.getppid() != parent:      # supervisor gone (PDEATHSIG is the fast path)
                    stop.set()
            except Exception:
                log.exception("proxy process %d background tick", slot)

    bg = loop.create_task(background(), name="sync")
    await stop.wait()
    grace = float(cfg.shutdown_grace_period_secs)
    listener.close()
    app.stop_accepting()
    deadline = loop.time() + grace
    while app.active and loop.time() < deadline:   # control-plane wait, not per request
        await asyncio.sleep(0.05)
    if app.active:
        log.warning("proxy process %d: aborting %d requests still in flight", slot, app.active)
    app.close()
    bg.cancel()
    try:
        report()
    except OSError:
        pass
    table.close()
    ledger.close()
    return 0


def child_main(state_dir: str, slot: int) -> int:
    """Entry point of one proxy process."""
    import uvloop

    from fastroute.cli import configure_logging

    _die_with_parent()
    with open(os.path.join(state_dir, "config.pickle"), "rb") as f:
        cfg = pickle.load(f)
    configure_logging(cfg.log_level, cfg.log_dir)
    return uvloop.run(_child_serve(state_dir, slot))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        sys.exit(child_main(sys.argv[2], int(sys.argv[3])))
    sys.exit("usage: python -m fastroute.runtime.supervisor --child STATE_DIR SLOT")
