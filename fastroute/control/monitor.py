"""Load monitor and health checker: the only writer of polled load and health into the table.

Owns two background loops over the *physical* workers of the :class:`~fastroute.control.registry.Registry`
(one HTTP call per server per tick, however many rank targets it has):

* load polling (protocol.md 4.4, 5.1, 5.2) every ``load_monitor_interval`` seconds:
  ``GET /v1/loads?include=core,disagg`` (core only after a 400), falling back to
  ``GET /get_load`` when the worker answers 404 (the working endpoint is remembered per worker).
  Entries are parsed defensively and fanned out by ``dp_rank`` to the rank targets with
  ``table.set_polled``. Anything missing or failed becomes ``table.mark_unpolled`` -- unknown,
  never zero, so a policy cannot mistake a dead or mute worker for an idle one.
* health checks (protocol.md 7.1) every ``health_check_interval_secs`` seconds on
  ``health_check_endpoint`` with ``health_check_timeout_secs``; a worker turns unhealthy after
  ``health_failure_threshold`` consecutive failures and healthy again after
  ``health_success_threshold`` consecutive successes; the verdict goes to every target of it.

Invariant: results are written only if the worker is still ``ready`` after the await, because
a removed worker's rows may already be reallocated to another worker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

from fastroute.config import Config
from fastroute.control import httpclient, loadwire
from fastroute.control.background import cancel_all
from fastroute.control.engine import EngineLoads
from fastroute.control.httpclient import HttpClientError
from fastroute.control.registry import Registry
from fastroute.control.worker import Worker
from fastroute.core.table import TargetTable

log = logging.getLogger("fastroute.monitor")

V1_LOADS = "/v1/loads"
GET_LOAD = "/get_load"
_V1_QUERY = "/v1/loads?include=core,disagg"
_V1_CORE = "/v1/loads?include=core"  # a server that refuses the disagg section (400)

# One parsed rank entry: (running, waiting, used tokens, max tokens or -1, uncached tokens
# waiting for prefill or -1, decode prealloc + retracted queue requests).
RankLoad = tuple[int, int, int, int, int, int]
# Polled counts are written to int64 table cells (and summed over ranks): a value a worker
# cannot mean is garbage, like a negative one, not an OverflowError in every poll.
_COUNT_LIMIT = 1 << 62
# More ready workers than this are polled spread over SPREAD_SHARE of the interval, at most
# POLL_CONCURRENCY at a time (a fleet's polls arriving together delayed the requests' loop).
SPREAD_FROM = 16
SPREAD_SHARE = 0.8
POLL_CONCURRENCY = 64
# Under --dp-aware a worker's dp_size is re-read this often even when nothing suggests a
# restart (one /server_info per worker per interval).
DP_RECHECK_SECS = 60.0


def _count(v: Any) -> int | None:
    """A count in [0, 2^62) from JSON, or None when absent/garbage/out of range."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return int(v) if 0 <= v < _COUNT_LIMIT else None


def parse_v1_loads(doc: Any) -> list[tuple[int | None, RankLoad | None]]:
    """``/v1/loads`` body (its JSON or its typed reading) -> [(dp_rank or None, load or None if
    unusable)]."""
    if isinstance(doc, loadwire.V1Loads):
        return loadwire.rank_loads(doc)
    entries = doc.get("loads") if isinstance(doc, dict) else None
    out: list[tuple[int | None, RankLoad | None]] = []
    if not isinstance(entries, list):
        return out
    for e in entries:
        if not isinstance(e, dict):
            continue
        waiting = _count(e.get("num_waiting_reqs"))
        running = _count(e.get("num_running_reqs"))
        if running is None:
            total = _count(e.get("num_total_reqs"))
            if total is not None:
                running = max(total - (waiting or 0), 0)
        tokens = _count(e.get("num_used_tokens"))
        mx = _count(e.get("max_total_num_tokens"))
        usage = e.get("token_usage")
        if mx and isinstance(usage, (int, float)) and not isinstance(usage, bool) and 0 <= usage <= 1:
            # token_usage (SGLang 0.5.23) is the fullest pool's share: never credit the rank
            # with more free KV than it says
            tokens = max(tokens or 0, int(usage * mx))
        uncached = _count(e.get("num_waiting_uncached_tokens"))
        disagg = e.get("disaggregation")
        queued = 0
        if isinstance(disagg, dict):
            for name in ("decode_prealloc_queue_reqs", "decode_retracted_queue_reqs"):
                queued += _count(disagg.get(name)) or 0
        load = None
        if running is not None and tokens is not None:
            load = (
                running,
                waiting or 0,
                tokens,
                -1 if mx is None else mx,
                -1 if uncached is None else uncached,
                queued,
            )
        out.append((_count(e.get("dp_rank")), load))
    return out


def parse_get_load(doc: Any) -> list[tuple[int | None, RankLoad | None]]:
    """Legacy ``/get_load`` body (array per rank; ``num_reqs`` = running + waiting) -> as above.

    A build that reports ``num_pages`` instead of ``num_tokens`` gives no token count: unknown.
    """
    if isinstance(doc, dict):
        doc = doc.get("loads", [doc])
    out: list[tuple[int | None, RankLoad | None]] = []
    if not isinstance(doc, list):
        return out
    for e in doc:
        if not isinstance(e, dict):
            continue
        total = _count(e.get("num_reqs"))
        waiting = _count(e.get("num_waiting_reqs")) or 0
        tokens = _count(e.get("num_tokens"))
        load = None
        if total is not None and tokens is not None:
            load = (max(total - waiting, 0), waiting, tokens, -1, -1, 0)
        out.append((_count(e.get("dp_rank")), load))
    return out


def max_running_of(doc: Any) -> dict[int | None, int]:
    """``/v1/loads`` body (JSON or typed) -> {dp_rank: max_running_requests, 0 when absent}."""
    if isinstance(doc, loadwire.V1Loads):
        return loadwire.max_running(doc)
    per_rank: dict[int | None, int] = {}
    for e in doc.get("loads") or () if isinstance(doc, dict) else ():
        if isinstance(e, dict):
            per_rank[_count(e.get("dp_rank"))] = _count(e.get("max_running_requests")) or 0
    return per_rank


async def spread(workers: list[Worker], period: float, visit: Callable[[Worker], Awaitable[None]]) -> None:
    """``visit`` every worker once: up to SPREAD_FROM of them at once, more spread evenly over
    SPREAD_SHARE of ``period`` with at most POLL_CONCURRENCY visits in flight.

    A visit's task is made only when its turn comes: a fleet's thousand tasks made together at
    the start of a tick each held the loop for a step, and sleeping through most of the
    interval they lived long enough to reach the collector's oldest generation, whose full
    collections (tens of milliseconds over a fleet's objects) then came every second."""
    if len(workers) <= SPREAD_FROM:
        await asyncio.gather(*(visit(w) for w in workers))
        return
    loop = asyncio.get_running_loop()
    gate = asyncio.Semaphore(POLL_CONCURRENCY)
    span = period * SPREAD_SHARE / len(workers)
    started = loop.time()
    tasks: list[asyncio.Task[None]] = []

    async def gated(w: Worker) -> None:
        try:
            await visit(w)
        finally:
            gate.release()

    try:
        for i, w in enumerate(workers):
            due = started + span * i - loop.time()
            if due > 0:
                await asyncio.sleep(due)
            await gate.acquire()
            tasks.append(loop.create_task(gated(w)))
        await asyncio.gather(*tasks)
    finally:
        for t in tasks:
            t.cancel()  # a no-op on the finished ones; a cancelled tick leaves no visit behind


class Monitor:
    """Background load polling and health checking for every ready worker of a Registry."""

    def __init__(self, config: Config, registry: Registry, table: TargetTable) -> None:
        self.config = config
        self.registry = registry
        self.table = table
        self._tasks: list[asyncio.Task] = []
        # (worker url, "v1_loads" | "get_load" | "failed") -> polls; read by metrics.
        self.polls: dict[tuple[str, str], int] = {}
        # The last usable answer per worker, for smg's per-rank engine gauges.
        self.engine = EngineLoads()
        # (worker role, "success" | "failure") -> health probes; read by metrics.
        self.health_checks: dict[tuple[str, str], int] = {}
        # Workers whose last answer had unusable rank entries (warned once per episode).
        self._unusable: set[str] = set()
        # Workers whose last load poll failed (a restart may follow: dp_size is re-read).
        self._poll_failed: set[str] = set()
        # Rows whose engine pushes its loads (control/kvevents.py): the poll leaves them alone
        # but for the decode KV queue, which a LoadStat does not carry.
        self.pushed: Callable[[int], bool] | None = None
        # Load polls reuse one kept-alive connection per worker port.
        self._pool = httpclient.Pool()

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        """Start the loops on the running event loop (disabled ones are skipped)."""
        bg = self.registry.background
        if not self.config.disable_load_monitoring:
            self._tasks.append(bg.spawn("load monitor", self._load_loop))
        if not self.config.disable_health_check:
            self._tasks.append(bg.spawn("health checks", self._health_loop))

    async def stop(self) -> None:
        tasks, self._tasks = self._tasks, []
        await cancel_all(tasks)
        self._pool.close()

    async def _every(self, period: float, tick: Any, st: Any) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never let one bad tick end the loop
                st.fail(exc)  # logged once per episode, counted (background.py)
                log.debug("monitor tick failed", exc_info=True)
            else:
                st.ok()
            # A tick that overran its period starts the next one right away (no burst catch-up).
            await asyncio.sleep(max(period - (loop.time() - started), 0.0))

    async def _load_loop(self, st: Any) -> None:
        await self._every(float(self.config.load_monitor_interval), self.poll_once, st)

    async def _health_loop(self, st: Any) -> None:
        period = float(self.config.health_check_interval_secs)
        # The first probe comes one interval after start: registration has just checked /health.
        if st.restarts == 0:
            await asyncio.sleep(period)
        await self._every(period, self.check_once, st)

    # ---- load polling -------------------------------------------------------------------------
    def _poll_timeout(self) -> float:
        # A loaded engine may answer late; dropping its answer after 100 ms would discard the data
        # exactly when it matters, so allow at least 1 s (the next tick simply starts later).
        return max(float(self.config.load_monitor_interval), 1.0)

    async def poll_once(self) -> None:
        """Poll every ready worker once and write the results to the table. Up to SPREAD_FROM
        workers are polled at once; more are spread over SPREAD_SHARE of the interval (see
        :func:`spread`)."""
        workers = self.registry.ready_workers()
        self._forget_removed()
        if not workers:
            return
        timeout = self._poll_timeout()

        async def one(w: Worker) -> None:
            if w.status == "ready":
                await self.poll_worker(w, timeout)

        await spread(workers, float(self.config.load_monitor_interval), one)

    def _forget_removed(self) -> None:
        """Drop the poll counters and engine rows of workers no longer registered (a router
        that saw 10,000 workers come and go keeps none of theirs)."""
        workers = self.registry.workers
        known = {w.url for w in workers}
        ports = [u for w in workers for u in (w.rank_urls or [w.url])]
        if len(self._pool) > len(ports):  # connections to removed workers (or resized ones' ports)
            self._pool.keep_only(ports)
        if len(self.engine) > len(known) or len(self.polls) > 2 * len(known):
            self.engine.forget(known)
            for key in [k for k in self.polls if k[0] not in known]:
                del self.polls[key]

    async def poll_worker(self, w: Worker, timeout: float) -> bool:
        """One load poll of one physical worker (of each rank port of a per-rank-port
        server); True when usable data arrived."""
        if w.rank_ports:
            return await self._poll_rank_ports(w, timeout)
        entries, mode, doc = await self._fetch_loads(w, w.url, timeout)
        key = (w.url, mode)
        self.polls[key] = self.polls.get(key, 0) + 1
        if w.status != "ready":  # removed during the await: its rows may belong to someone else now
            self.engine.update(w.url, None, mode)
            return False
        self.engine.update(w.url, doc if entries else None, mode)  # smg_engine_* gauges
        if entries:
            self._note_unusable(w, entries)
        self._dp_hint(w, entries)
        ok = self._apply(w, entries)
        if ok and mode == "v1_loads":
            self._store_max_running(w, doc)
        return ok

    def _store_max_running(self, w: Worker, doc: Any) -> None:
        """Each rank's max_running_requests (flow control's capacity; 0 when not reported, and
        a server read as one target reports the sum only when every rank reports one)."""
        per_rank = max_running_of(doc)
        if not w.split:
            vals = list(per_rank.values())
            self.table.set_max_running(w.targets[0], sum(vals) if vals and all(vals) else 0)
            return
        for rank, t in enumerate(w.targets):
            self.table.set_max_running(t, per_rank.get(rank, 0))

    async def _poll_rank_ports(self, w: Worker, timeout: float) -> bool:
        """Poll every rank port of a per-rank-port server; each answer is its own rank's."""
        urls = list(w.rank_urls)
        got = await asyncio.gather(*(self._fetch_loads(w, u, timeout, typed=False) for u in urls))
        for _, mode, _ in got:
            key = (w.url, mode)
            self.polls[key] = self.polls.get(key, 0) + 1
        if w.status != "ready" or w.rank_urls != urls:  # removed or resized meanwhile
            self.engine.update(w.url, None, "failed")
            return False
        merged: list[Any] = []
        all_entries: list[tuple[int | None, RankLoad | None]] = []
        any_ok = False
        for i, (t, (entries, mode, doc)) in enumerate(zip(w.targets, got)):
            rank = w.rank_ids[i]
            # The port's own entry (an answer without dp_rank is the port's rank).
            load = next((ld for r, ld in entries or () if r in (rank, None)), None)
            if load is None:
                self._unpolled(t)
                continue
            all_entries.append((rank, load))
            self._store(w, t, load)
            any_ok = True
            if mode == "v1_loads" and isinstance(doc, dict) and isinstance(doc.get("loads"), list):
                merged += [e for e in doc["loads"] if isinstance(e, dict) and e.get("dp_rank", rank) == rank]
        self.engine.update(w.url, {"loads": merged} if merged else None, "v1_loads")
        if all_entries:
            self._note_unusable(w, all_entries)
        self._dp_hint(w, all_entries or None)
        return any_ok

    async def _fetch_loads(
        self, w: Worker, url: str, timeout: float, typed: bool = True
    ) -> tuple[list[tuple[int | None, RankLoad | None]] | None, str, Any]:
        """GET one port's load report -> (entries or None, mode, the answer: JSON, or with
        ``typed`` a well-formed /v1/loads answer's typed reading, loadwire.V1Loads)."""
        entries: list[tuple[int | None, RankLoad | None]] | None = None
        mode, doc = "failed", None
        headers = self.registry.auth_headers(w)
        try:
            if w.load_path != GET_LOAD:
                query = _V1_CORE if w.load_path == _V1_CORE else _V1_QUERY
                status, _, body = await httpclient.request(
                    "GET", url + query, headers=headers, timeout=timeout, pool=self._pool
                )
                if status == 400 and query == _V1_QUERY:
                    # An older /v1/loads without the disagg section: core only from now on.
                    w.load_path = query = _V1_CORE
                    status, _, body = await httpclient.request(
                        "GET", url + query, headers=headers, timeout=timeout, pool=self._pool
                    )
                if status == 200:
                    w.load_path = query if query == _V1_CORE else V1_LOADS
                    doc = (loadwire.decode(body) if typed else None) or json.loads(body)
                    entries, mode = parse_v1_loads(doc), "v1_loads"
                elif status == 404:
                    w.load_path = GET_LOAD  # older SGLang: remember, don't ask /v1/loads again
                else:
                    log.debug("load poll %s%s: HTTP %s", url, V1_LOADS, status)
            if entries is None and w.load_path == GET_LOAD:
                status, _, body = await httpclient.request(
                    "GET", url + GET_LOAD, headers=headers, timeout=timeout, pool=self._pool
                )
                if status == 200:
                    doc = json.loads(body)
                    entries, mode = parse_get_load(doc), "get_load"
                else:
                    if status == 404:
                        # Neither endpoint (or the server was replaced): probe both again next time.
                        w.load_path = None
                    log.debug("load poll %s%s: HTTP %s", url, GET_LOAD, status)
        except (HttpClientError, ValueError) as exc:  # ValueError: body is not JSON
            log.debug("load poll %s failed: %s", url, exc)
            entries = None
        return entries, mode, doc

    def _dp_hint(self, w: Worker, entries: list[tuple[int | None, RankLoad | None]] | None) -> None:
        """Under --dp-aware, ask the registry to re-read dp_size when the poll suggests the
        worker restarted with another one: a rank count unlike its targets', the first answer
        after failed polls; and on a slow schedule."""
        if not (self.config.dp_aware or w.rank_ports):
            return
        reg = self.registry
        if not entries:
            self._poll_failed.add(w.url)
            return
        ranks = len({r for r, _ in entries if r is not None} or entries)
        if ranks != len(w.targets) and not w.rank_ports:  # (a rank port reports one rank)
            reg.recheck_dp(w, f"/v1/loads reports {ranks} ranks", force=False)
        elif w.url in self._poll_failed:
            reg.recheck_dp(w, "answering load polls again")
        elif asyncio.get_running_loop().time() - w.dp_checked >= DP_RECHECK_SECS:
            reg.recheck_dp(w, "periodic check")
        self._poll_failed.discard(w.url)

    def _note_unusable(self, w: Worker, entries: list[tuple[int | None, RankLoad | None]]) -> None:
        """Warn once (not every poll) while a worker reports rank loads we cannot use."""
        bad = any(load is None for _, load in entries)
        if not bad:
            self._unusable.discard(w.url)
        elif w.url not in self._unusable:
            self._unusable.add(w.url)
            log.warning(
                "worker %s reports load entries with missing or out-of-range counts; "
                "those targets count as unpolled until it reports usable ones",
                w.url,
            )

    def _apply(self, w: Worker, entries: list[tuple[int | None, RankLoad | None]] | None) -> bool:
        if not entries:
            for t in w.targets:
                self._unpolled(t)
            return False
        if not w.split:
            # One target for the whole server: sum over its ranks; one unusable rank makes the
            # sum unknown (a partial sum would look lighter than the server is).
            t = w.targets[0]
            if any(load is None for _, load in entries):
                self._unpolled(t)
                return False
            running = waiting = tokens = mx = uncached = queued = 0
            for _, (r, q, k, m, u, b) in entries:  # type: ignore[misc]
                running += r
                waiting += q
                tokens += k
                mx = -1 if (m < 0 or mx < 0) else mx + m
                uncached = -1 if (u < 0 or uncached < 0) else uncached + u
                queued += b
            if max(running, waiting, tokens, mx, uncached, queued) >= _COUNT_LIMIT:
                self._unpolled(t)  # (sums of in-range counts)
                return False
            self._store(w, t, (running, waiting, tokens, mx, uncached, queued))
            return True
        by_rank: dict[int, RankLoad] = {}
        for rank, load in entries:
            if rank is not None and load is not None:
                by_rank[rank] = load
        any_ok = False
        for rank, t in enumerate(w.targets):
            load = by_rank.get(rank)
            if load is None:
                self._unpolled(t)
            else:
                self._store(w, t, load)
                any_ok = True
        return any_ok

    def _unpolled(self, t: int) -> None:
        if self.pushed is None or not self.pushed(t):
            self.table.mark_unpolled(t)

    def _store(self, w: Worker, t: int, load: RankLoad) -> None:
        if self.pushed is not None and self.pushed(t):
            self.table.set_kv_queue(t, load[5])
            return
        self.table.set_polled(t, load[0], load[1], load[2], load[3], self._uncached(w, load[4]), load[5])

    @staticmethod
    def _uncached(w: Worker, uncached: int) -> int:
        """Only a PD prefill's waiting uncached tokens enter its demand cost; a regular or
        decode worker's demand stays the router's own in-flight tokens."""
        return uncached if w.role == "prefill" else -1

    # ---- health checks ------------------------------------------------------------------------
    async def check_once(self) -> None:
        """Probe every ready worker once, concurrently, and apply the thresholds."""
        workers = self.registry.ready_workers()

        async def one(w: Worker) -> None:
            if w.status == "ready":
                await self.check_worker(w)

        if workers:
            await spread(workers, float(self.config.health_check_interval_secs), one)

    async def check_worker(self, w: Worker) -> bool:
        """One health probe of one physical worker (of each rank port of a per-rank-port
        server: a rank whose port fails turns unhealthy alone); returns the outcome (any
        rank port answered)."""
        if not w.rank_ports:
            return await self._probe(w, w.url, None)
        oks = await asyncio.gather(*(self._probe(w, u, i) for i, u in enumerate(list(w.rank_urls))))
        return any(oks)

    async def _probe(self, w: Worker, url: str, rank: int | None) -> bool:
        cfg = self.config
        path = cfg.health_check_endpoint or "/health"
        if not path.startswith("/"):
            path = "/" + path
        # The API key goes to workers on everything but /health (protocol.md 2).
        reg = self.registry
        headers = reg.health_headers(w) if path.split("?", 1)[0] == "/health" else reg.auth_headers(w)
        try:
            status, _, _ = await httpclient.request(
                "GET", url + path, headers=headers, timeout=float(cfg.health_check_timeout_secs)
            )
            ok = 200 <= status < 300
        except HttpClientError as exc:
            log.debug("health probe %s failed: %s", url, exc)
            ok = False
        key = (w.role, "success" if ok else "failure")
        self.health_checks[key] = self.health_checks.get(key, 0) + 1
        if w.status == "ready":
            if rank is None:
                self.record_health(w, ok)
            elif rank < len(w.rank_healthy) and w.rank_urls[rank] == url:
                self.record_rank_health(w, rank, ok)
        return ok

    def _threshold(self, healthy: bool, successes: int, failures: int, ok: bool) -> tuple[int, int, bool]:
        """One probe outcome applied to consecutive counters: (successes, failures, whether
        health flips at the configured thresholds)."""
        cfg = self.config
        if ok:
            successes += 1
            return successes, 0, not healthy and successes >= max(int(cfg.health_success_threshold), 1)
        failures += 1
        return 0, failures, healthy and failures >= max(int(cfg.health_failure_threshold), 1)

    def record_health(self, w: Worker, ok: bool) -> None:
        """Apply one probe outcome to the consecutive counters and flip health at the thresholds."""
        w.health_successes, w.health_failures, flip = self._threshold(
            w.healthy, w.health_successes, w.health_failures, ok
        )
        if flip:
            self._set_health(w, ok)

    def record_rank_health(self, w: Worker, i: int, ok: bool) -> None:
        """One probe outcome of rank port ``i`` of a per-rank-port server: the thresholds
        flip that rank's target alone; the worker is healthy while any rank is."""
        w.rank_successes[i], w.rank_failures[i], flip = self._threshold(
            w.rank_healthy[i], w.rank_successes[i], w.rank_failures[i], ok
        )
        if not flip:
            return
        w.rank_healthy[i] = ok
        self.table.set_healthy(w.targets[i], ok and w.healthy)
        if ok:
            log.info("rank %d of worker %s (%s) is healthy again", w.rank_ids[i], w.url, w.rank_urls[i])
        else:
            log.warning(
                "rank %d of worker %s (%s) is unhealthy after %d failed health checks; its other ranks keep serving",
                w.rank_ids[i],
                w.url,
                w.rank_urls[i],
                w.rank_failures[i],
            )
        if any(w.rank_healthy) != w.healthy:
            w.health_failures = 0 if ok else w.rank_failures[i]
            self._set_health(w, not w.healthy)
        elif ok:
            self.registry.recheck_dp(w, "a rank healthy again")

    def _set_health(self, w: Worker, ok: bool) -> None:
        w.healthy = ok
        self.registry.invalidate_ready()
        for i, t in enumerate(w.targets):
            self.table.set_healthy(t, w.target_healthy(i))
        if ok:
            log.info("worker %s is healthy again", w.url)
            self.registry.recheck_dp(w, "healthy again")  # restarted, maybe resized
        else:
            log.warning("worker %s is unhealthy after %d failed health checks", w.url, w.health_failures)
