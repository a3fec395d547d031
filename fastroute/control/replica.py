"""Router replicas that balance as one: per-target load shared through Redis (``--replica-sync``).

Owns the target table's "others" columns (``COL_OTHERS_OPEN``, ``COL_OTHERS_IN_FLIGHT``,
``COL_OTHERS_TOKENS``; the estimates below are reset here, booked by the pickers) and the
header's replica count and slot, and nothing else. Every ``--replica-sync-interval-ms`` one asyncio task
publishes this host's per-target in-flight requests and input tokens and the targets whose
circuit it has open, keyed by target *name* (``url`` or ``url@rank``, never a table row: rows
differ between replicas), reads every other live replica's entry, sums them per name and stores
the sums into the others columns with the table's atomics. The kernels add those columns to
their own exact counts (``_layout.row_requests`` / ``row_tokens``), so a pick costs no network
I/O and nothing more than two extra loads; the view is at most one interval plus one round trip
old. It runs once per host, where the table is owned: the single-process server, or the
supervisor under ``--workers N`` (whose table holds every proxy process's bookings).

Redis layout: keys under one hash tag (one cluster slot), ``fastroute:{replicas}:beat`` (a
sorted set: replica id -> Redis server time in ms of its last publish),
``fastroute:{replicas}:rows:<id>`` (a hash per replica: target name -> ``requests\\ttokens\\topen``
for each target that has anything to say, built by the script from the replica's changes),
``fastroute:{replicas}:log`` (a stream: each tick's changed lines per replica, numbered in
``fastroute:{replicas}:seq``; see control/syncdelta.py), ``fastroute:{replicas}:load`` (read
only: a payload of such lines per id, for entries written by hand). One Lua script per tick,
atomic on the server and timed by the server's clock (hosts' clocks never compared), stores this
replica's heartbeat and changes, drops every replica silent for ``--replica-ttl-ms`` (killed or
partitioned) and returns the live replicas with the whole state of those this replica does not
follow yet and the changes of those it does. The keys expire after ten TTLs of silence. Ticks
follow the change rate (control/syncpace.py). A restarted replica gets
a new id (the default contains the pid) and starts from its own empty table; a stopping replica
deletes its entry so the others drop it at once.

Bursts (the replicas' coordination). Between two syncs every replica sees the same others'
counts, so a burst spread over the replicas would send each one's share to the same
least-loaded ranks. Each tick therefore also stores the number of live replicas and this one's
place among their sorted ids in the table header (``HDR_REPLICAS``, ``HDR_REPLICA_SLOT``) and a
tie-break order shared by all of them per target (``COL_ORDER_KEY``, a hash of its name). The
least-requests, demand and KV-fit pickers then plan the next N placements as one router would
(``_policy.pick_coordinated``), take their own place in that sequence and count the other places
as the others' estimated placements (``COL_OTHERS_EST``, ``COL_OTHERS_EST_TOKENS``, added to the
loads like the published counts) until what the others publish replaces them (at most two
ticks: see ``_age_estimate``). A failed tick turns this off at once (the estimates are dropped).

Shared circuit opens: a target whose circuit is open at any other live replica is ineligible
here (``COL_OTHERS_OPEN``, checked by ``row_eligible``); the local breaker's cells and CAS state
machine are never written. Only *open* is published, not half-open: once the opener's timeout
passes every replica may send traffic again and each one's own breaker judges the worker, so a
replica that gets no traffic can never keep a worker fenced off for the others.

Input from Redis is not trusted (any client of that Redis can write it): only replicas with a live heartbeat are read (a
load field without one is never counted); an entry over ``MAX_ENTRY_BYTES`` is not even sent
by the script (its length is) and is skipped; a line with a count past ``COUNT_LIMIT`` is
skipped, a negative count is 0 and sums are capped, so nothing can overflow the int64 cells;
a sync key of the wrong type (WRONGTYPE) is deleted by the script and rebuilt. All of it is
counted in ``fastroute_replica_sync_skipped_total{what}`` and warned once. Each instance
stores a random nonce under its id in ``fastroute:{replicas}:owner``: finding another one's
there after its own tick means two live replicas share a ``--replica-id`` (one ERROR,
``fastroute_replica_id_conflicts_total``). The loop runs supervised (control/background.py):
any failure marks the sync down (``fastroute_replica_peers`` 0 at once) and backs off.

Redis slow or gone: requests never wait for it (the task is the only client). A failed tick is
counted in ``fastroute_replica_sync_errors_total``; the first failure logs one WARNING, the first
success after it one INFO; retries back off from 0.1 s doubling to 5 s. The last view stays in
the columns for one TTL after the last good tick (a blip does not make every replica herd onto
the targets the others were loading), then the columns are cleared and routing uses local counts
and the polled engine loads alone, so a dead link cannot freeze stale load.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import sys
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from fastroute.control.background import cancel_all
from fastroute.control.syncdelta import LOG_KEY, ROWS_PREFIX, SEQ_KEY, TICK, Names, Published, View
from fastroute.control.syncpace import WAKE_CHANNEL, Pace
from fastroute.core.routing import hash64
from fastroute.core.table import (
    CIRCUIT_OPEN,
    COL_ALLOCATED,
    COL_CIRCUIT,
    COL_IN_FLIGHT,
    COL_IN_FLIGHT_TOKENS,
    COL_ORDER_KEY,
    COL_OTHERS_EST,
    COL_OTHERS_EST_TOKENS,
    COL_OTHERS_IN_FLIGHT,
    COL_OTHERS_OPEN,
    COL_OTHERS_TOKENS,
    TargetTable,
)

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
else:  # redis-py depends on it below 3.11.3
    from async_timeout import timeout as _timeout  # type: ignore[import-not-found]

log = logging.getLogger("fastroute.replica")

__all__ = ["ReplicaSync", "start_replica_sync", "default_replica_id", "encode", "decode"]

BEAT_KEY = "fastroute:{replicas}:beat"
LOAD_KEY = "fastroute:{replicas}:load"
OWNER_KEY = "fastroute:{replicas}:owner"
BACKOFF_INITIAL = 0.1
BACKOFF_MAX = 5.0
# A payload line per target is ~60 bytes: 256 KiB is thousands of targets. A bigger entry is
# garbage (or hostile) and is neither sent by Redis nor decoded on the loop: skipped, counted.
MAX_ENTRY_BYTES = 256 * 1024
# Counts are stored into int64 table cells: a number a replica cannot mean is skipped (a line),
# a sum over replicas is capped, and a negative count is 0.
COUNT_LIMIT = 1 << 62


def default_replica_id(port: int) -> str:
    """host:port:pid: unique per running router, and new after a restart."""
    return f"{socket.gethostname()}:{port}:{os.getpid()}"


def encode(counts: dict[str, tuple[int, int, bool]]) -> bytes:
    """The payload of one replica: a line per target name with requests, tokens and open."""
    return "".join(f"{n}\t{r}\t{k}\t{int(o)}\n" for n, (r, k, o) in counts.items()).encode()


def decode(payload: bytes, into: dict[str, list[int]]) -> tuple[int, int]:
    """Add one replica's payload to ``into`` (name -> [requests, tokens, open]); a malformed
    line (another version, a hand-edited key, a number past COUNT_LIMIT) is skipped rather
    than failing the whole view, a negative count is 0 and sums stay below COUNT_LIMIT.
    Returns (good lines, skipped lines)."""
    good = bad = 0
    cap = COUNT_LIMIT - 1
    for line in payload.decode("utf-8", "replace").splitlines():
        parts = line.split("\t")
        if len(parts) != 4 or max(len(parts[1]), len(parts[2]), len(parts[3])) > 19:
            bad += 1  # (19 digits: int() of a huge digit string is itself slow)
            continue
        try:
            r, k, o = int(parts[1]), int(parts[2]), int(parts[3])
        except ValueError:
            bad += 1
            continue
        if r >= COUNT_LIMIT or k >= COUNT_LIMIT:
            bad += 1
            continue
        good += 1
        r, k, o = max(r, 0), max(k, 0), 1 if o else 0
        acc = into.get(parts[0])
        if acc is None:
            into[parts[0]] = [r, k, o]
        else:
            acc[0] = min(acc[0] + r, cap)
            acc[1] = min(acc[1] + k, cap)
            acc[2] |= o
    return good, bad


class ReplicaSync:
    """The sync task of one host (see module docstring)."""

    def __init__(
        self, url: str, replica_id: str, table: TargetTable, registry: Any, interval: float, ttl: float
    ) -> None:
        self.url = url
        self.id = replica_id
        self.table = table
        self.registry = registry
        self.interval = interval
        self.ttl = ttl
        self.errors = 0
        self.peers = 0
        self.up: bool | None = None  # None until the first tick
        # Input the tick skipped rather than trusted: "oversize" entries, "bad_line"s of a
        # payload, "repaired" keys of the wrong type; and ticks that found another live
        # replica under this id (fastroute_replica_id_conflicts_total).
        self.skipped: dict[str, int] = {}
        self.conflicts = 0
        self.nonce = os.urandom(8).hex()  # this instance, told apart from a same-id twin
        self._published = False  # a tick of ours went through (set the nonce)
        self._conflict_logged = False
        self._skip_logged: set[str] = set()
        self._bg = getattr(registry, "background", None)
        self._last_ok = 0.0
        self._cleared = True  # the others columns hold nothing
        self._order_keys: dict[str, int] = {}
        self._est_kept: dict[int, int] = {}  # row -> estimate left at the last tick
        self._task: asyncio.Task | None = None
        timeout = self._deadline = max(0.05, min(1.0, ttl / 2))
        # Deferred: redis adds ~6 MB of RSS at import and only --replica-sync uses it.
        import hiredis
        import redis.asyncio as aioredis
        from redis.asyncio.retry import Retry  # the asyncio client's own (redis.retry's is converted)
        from redis.backoff import NoBackoff
        from redis.exceptions import NoScriptError, RedisError
        from redis.exceptions import TimeoutError as RedisTimeout

        # What a failed tick or withdrawal raises (RedisError known only once redis is loaded).
        self._failures = (RedisError, OSError, asyncio.TimeoutError)
        self._timed_out = RedisTimeout
        self._no_script = NoScriptError
        self._pack = hiredis.pack_command
        # No retries inside the client: this task retries with its own backoff. A tick's call
        # is bounded as a whole (``_deadline``), not per socket operation: redis-py bounds each
        # send with a task of its own (asyncio.wait_for), a good share of a tick's CPU.
        self.client = aioredis.from_url(
            url,
            socket_timeout=None,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
            retry_on_timeout=False,
            health_check_interval=0,
        )
        self._script = self.client.register_script(TICK)
        self._conn: Any = None  # the connection ticks run on, held between ticks
        # What changed since the last tick, both ways (control/syncdelta.py).
        self._names = Names()
        self._pub = Published()
        self._view = View(self._names)
        self._pace = Pace(self.client, replica_id, interval, ttl)  # control/syncpace.py
        self._renew_at = 0.0  # loop time the keys' expiry is renewed next

    # ---- lifecycle --------------------------------------------------------------------------
    def start(self) -> None:
        if self._bg is None:
            from fastroute.control.background import Background

            self._bg = Background()
        self._task = self._bg.spawn("replica sync", self._loop, initial=BACKOFF_INITIAL, cap=BACKOFF_MAX)
        self._pace.start()
        log.info("replica sync: %s as %r every %.0f ms (ttl %.1f s)", self.url, self.id, self.interval * 1000, self.ttl)

    async def stop(self) -> None:
        """Stop syncing, withdraw this replica's entry (best effort) and clear the columns."""
        if self._task is not None:
            await cancel_all([self._task])
            self._task = None
        await self._pace.stop()
        if self.up:
            try:
                pipe = self.client.pipeline(transaction=True)
                pipe.zrem(BEAT_KEY, self.id)
                pipe.hdel(LOAD_KEY, self.id)
                pipe.hdel(OWNER_KEY, self.id)
                pipe.hdel(SEQ_KEY, self.id)
                pipe.delete(ROWS_PREFIX + self.id)
                await asyncio.wait_for(pipe.execute(), self.ttl)
            except self._failures:
                pass  # the entry ages out after the TTL instead
        self._clear()
        await self.client.aclose()

    # ---- one tick ---------------------------------------------------------------------------
    def local_counts(self) -> dict[str, tuple[int, int, bool]]:
        """This host's load per target name (rows of one name summed: a removed worker's row
        that still drains counts until its last lease ends)."""
        cells = self.table.cells
        out: dict[str, tuple[int, int, bool]] = {}
        for t, info in enumerate(self.registry.target_info):
            if info is None:
                continue
            r = cells.load(t, COL_IN_FLIGHT)
            k = cells.load(t, COL_IN_FLIGHT_TOKENS)
            o = cells.load(t, COL_CIRCUIT) == CIRCUIT_OPEN
            if not (r or k or o):
                continue  # absent means zero: payloads stay small on idle targets
            name = self.registry.target_name(t)
            prev = out.get(name)
            out[name] = (r, k, o) if prev is None else (prev[0] + r, prev[1] + k, prev[2] or o)
        return out

    async def tick(self, force: bool = True) -> int | None:
        """Publish what changed, read what the live replicas changed (whole where this view
        does not follow them), store the others' sums; returns the live peers. Unless
        ``force``, a tick with nothing to send and nothing due (control/syncpace.py) calls no
        Redis and returns None."""
        now = asyncio.get_running_loop().time()
        try:
            if self._names.refresh(self.table, self.registry):
                # names are indexed per host: a new index starts a new view, read whole
                self._view = View(self._names)
                self._store_order_keys()
            delta = self._pub.update(self.table, self._names)
            if not (force or delta or self._pub.reset or self._pub.held or self._est_kept or self._pace.due(now)):
                self.table.count_sync_tick()  # a sync that found nothing new: the view is current
                return None
            view = self._view
            try:
                async with _timeout(self._deadline):
                    reply = await self._eval(
                        (BEAT_KEY, LOAD_KEY, OWNER_KEY, LOG_KEY, SEQ_KEY, ROWS_PREFIX + self.id),
                        (
                            self.id,
                            ROWS_PREFIX,
                            int(self.ttl * 1000),
                            self.nonce,
                            MAX_ENTRY_BYTES,
                            delta,
                            view.cursor,
                            view.known(),
                            2 if self._pub.reset else 1 if delta else 0,
                            WAKE_CHANNEL,
                            1 if now >= self._renew_at else 0,
                        ),
                    )
            except asyncio.TimeoutError:  # (the builtin on 3.11+, its own class on 3.10)
                raise self._timed_out(f"replica sync tick: no answer within {self._deadline:.2f} s") from None
            self._pub.reset = False
            peers, ids = self._read(reply)
            stored = self._apply_view()
        except BaseException:
            # Unknown what reached Redis or this view: publish and read everything whole next tick.
            self._pub, self._view = Published(), View(self._names)
            raise
        own = self.id.encode()
        ids.sort()
        self.table.set_replicas(len(ids), ids.index(own))
        if now >= self._renew_at:
            self._renew_at = now + self.ttl  # the keys' expiry was renewed (ten TTLs)
        self.table.count_sync_tick()
        self._pace.ticked(now, bool(delta or stored))
        return peers

    async def _eval(self, keys: tuple, args: tuple) -> Any:
        """One call of the tick's script on a connection held between ticks (redis-py's
        command path around it, a pool checkout and its retry wrapper, is most of a tick's
        client cost); loaded again when Redis lost it (restart, SCRIPT FLUSH)."""
        conn = self._conn
        if conn is None:
            conn = self._conn = await self.client.connection_pool.get_connection()
        # packed by hiredis in one call (redis-py's packer encodes argument by argument)
        call = self._pack(("EVALSHA", self._script.sha, len(keys), *keys, *args))
        try:
            try:
                await conn.send_packed_command(call, check_health=False)
                return await conn.read_response()
            except self._no_script:
                await conn.send_command("SCRIPT", "LOAD", TICK, check_health=False)
                await conn.read_response()
                await conn.send_packed_command(call, check_health=False)
                return await conn.read_response()
        except BaseException:
            self._conn = None  # unknown state (a reply may still come): a new connection next tick
            await conn.disconnect(nowait=True)
            await self.client.connection_pool.release(conn)
            raise

    def _read(self, reply: list) -> tuple[int, list[bytes]]:
        """Take one tick's reply into the view: payloads of the peers read whole, then the
        new entries of the peers it follows. Returns (live peers, sorted ids with this one)."""
        repaired, prev, cursor, nlive, lost = reply[0], reply[1], reply[2], int(reply[3]), reply[4]
        if lost:  # this replica's entries were dropped (taken for dead, deleted): republish whole
            self._pub.reset = True
        if repaired:
            self._skip(
                "repaired",
                f"{repaired} sync key(s) of the wrong type were deleted (something else wrote them)",
                repaired,
            )
        self._check_twin(prev)
        view = self._view
        own = self.id.encode()
        ids, peers, live, whole, now_seq = [own], 0, set(), set(), {}
        end = 5 + 4 * nlive
        for i in range(5, end, 4):
            pid, seq, kind, value = reply[i : i + 4]
            if pid == own:
                continue
            live.add(pid)
            if kind == 0:  # followed: its entries come below
                peers += 1
                ids.append(pid)
                now_seq[pid] = int(seq)
                continue
            if kind == 2:  # Redis sent its length only: too big to use
                self._skip("oversize", f"replica {pid!r} has a {value}-byte entry (limit {MAX_ENTRY_BYTES})")
                view.forget(pid)
                continue
            good, bad = view.set_all(pid, value, COUNT_LIMIT)
            if bad:
                self._skip("bad_line", f"replica {pid!r} sent {bad} malformed or out-of-range line(s)", bad)
            if not good and bad:  # garbage only is not a router replica
                view.forget(pid)
                continue
            peers += 1
            ids.append(pid)
            whole.add(pid)
            if seq:
                view.seq[pid] = int(seq)
            else:  # no entries to follow (written by hand): read whole every tick
                view.seq.pop(pid, None)
        for pid in [p for p in (*view.slot, *view.seq) if p not in live]:
            view.forget(pid)  # gone: its counts leave the sums
        for what, why, n in view.follow(reply, end, whole, COUNT_LIMIT, MAX_ENTRY_BYTES):
            self._skip(what, why, n)
        for pid, n in now_seq.items():
            if view.seq.get(pid) != n:  # entries this view did not get (trimmed, Redis restarted)
                view.seq.pop(pid, None)
        view.cursor = cursor
        return peers, ids

    def _apply_view(self) -> bool:
        """Store the sums of the names that changed (all of them on a new view) and age the
        estimates of every row that holds one; True when some name was stored."""
        cells = self.table.cells
        held = {t for t in (*self._est_kept, *self._pub.held) if t < self.table.capacity}
        before = {t: cells.load(t, COL_OTHERS_IN_FLIGHT) for t in held}
        stored = self._view.store(self.table, COUNT_LIMIT)
        for t, prev in before.items():
            self._age_estimate(t, max(0, cells.load(t, COL_OTHERS_IN_FLIGHT) - prev))
        self._cleared = False  # (cleared again, at no cost when empty, if Redis goes away)
        return bool(stored)

    def _store_order_keys(self) -> None:
        """The shared tie-break order of every row in use (a hash of its name)."""
        for name, rows in self._names.rows.items():
            key = self._order_key(name)
            for t in rows:
                self._store(t, COL_ORDER_KEY, key)

    def _skip(self, what: str, why: str, n: int = 1) -> None:
        """Count skipped input; warned once per kind for the life of the sync."""
        self.skipped[what] = self.skipped.get(what, 0) + n
        if what not in self._skip_logged:
            self._skip_logged.add(what)
            log.warning(
                "replica sync: %s; skipped (counted in fastroute_replica_sync_skipped_total{what=%r}, logged once)",
                why,
                what,
            )

    def _check_twin(self, prev: Any) -> None:
        """Another live instance wrote its nonce under this id since our last tick: two
        replicas run with the same --replica-id and overwrite each other's entry."""
        if prev is not None and self._published and prev != self.nonce.encode():
            self.conflicts += 1
            if not self._conflict_logged:
                self._conflict_logged = True
                log.error(
                    "replica sync: another router replica publishes as %r too (its entry "
                    "overwrites this one's); give every replica its own --replica-id",
                    self.id,
                )
        self._published = True

    def apply(self, others: dict[str, list[int]]) -> None:
        """Store the others' sums into every row of this host's table (zero where absent).
        A cell is written only when it changes, so the kernels' cache lines in the proxy
        processes are not invalidated for nothing."""
        cells = self.table.cells
        zero = (0, 0, 0)
        for t, info in enumerate(self.registry.target_info):
            if info is None or cells.load(t, COL_ALLOCATED) == 0:
                continue
            name = self.registry.target_name(t)
            r, k, o = others.get(name, zero)
            prev = cells.load(t, COL_OTHERS_IN_FLIGHT)
            self._store(t, COL_OTHERS_IN_FLIGHT, r)
            self._store(t, COL_OTHERS_TOKENS, k)
            self._store(t, COL_OTHERS_OPEN, 1 if o else 0)
            self._age_estimate(t, max(0, r - prev))
            self._store(t, COL_ORDER_KEY, self._order_key(name))
        self._cleared = not others

    def _age_estimate(self, t: int, published: int) -> None:
        """What the others newly published replaces the placements the pickers estimated for
        them. An estimate lives at most two ticks: those kept at the last tick go now; the ones
        made since then stay unless the publication already covers them (a tick in the middle
        of a burst must not forget the rest of the burst's plan)."""
        cells = self.table.cells
        est = cells.load(t, COL_OTHERS_EST)
        old = min(self._est_kept.get(t, 0), est)
        young = est - old
        keep = max(0, young - max(0, published - old))
        if keep != est:
            tokens = cells.load(t, COL_OTHERS_EST_TOKENS)
            # relative adds: a picker in another process may add to the cells meanwhile
            cells.add(t, COL_OTHERS_EST, keep - est)
            cells.add(t, COL_OTHERS_EST_TOKENS, (tokens * keep // est if est else 0) - tokens)
        if keep:
            self._est_kept[t] = keep
        else:
            self._est_kept.pop(t, None)

    def _order_key(self, name: str) -> int:
        key = self._order_keys.get(name)
        if key is None:
            if len(self._order_keys) > 65536:
                self._order_keys.clear()
            key = self._order_keys[name] = hash64(name.encode()) >> 1
        return key

    def _store(self, t: int, col: int, v: int) -> None:
        cells = self.table.cells
        if cells.load(t, col) != v:
            cells.store(t, col, v)

    def _stop_coordinating(self) -> None:
        """No fresh view: the pickers stop planning for the others and drop their estimates
        (which only a sync replaces), routing on their own counts plus the last view."""
        if self.table.cells is None or self.table.replicas[0] <= 1:
            return
        self.table.set_replicas(0, 0)
        for t in range(self.table.capacity):
            self._store(t, COL_OTHERS_EST, 0)
            self._store(t, COL_OTHERS_EST_TOKENS, 0)
        self._est_kept.clear()

    def _clear(self) -> None:
        if self.table.cells is None:
            return
        for t in range(self.table.capacity):
            for col in (
                COL_OTHERS_IN_FLIGHT,
                COL_OTHERS_TOKENS,
                COL_OTHERS_OPEN,
                COL_OTHERS_EST,
                COL_OTHERS_EST_TOKENS,
            ):
                self._store(t, col, 0)
        self.table.set_replicas(0, 0)
        self._est_kept.clear()
        self._view = View(self._names)  # the columns are empty: the next view starts whole
        self._cleared = True

    async def _loop(self, st: Any) -> None:
        """Tick forever; any failure (Redis, or input nothing expected) is counted, marks the
        view down and backs off; the supervisor (background.py) restarts a crashed loop."""
        loop = asyncio.get_running_loop()
        backoff = BACKOFF_INITIAL
        while True:
            try:
                peers = await self.tick(force=False)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # nothing may end the sync (and leave up at 1)
                self.errors += 1
                redis_down = isinstance(exc, self._failures)
                if self.up is not False and redis_down:
                    log.warning(
                        "replica sync: Redis at %s unreachable (%s); routing on this "
                        "replica's own counts until it returns",
                        self.url,
                        exc or type(exc).__name__,
                    )
                st.fail(exc, logged=redis_down)
                self.up = False
                self._stop_coordinating()
                self.peers = 0  # unknown while down, not the last count
                if not self._cleared and loop.time() - self._last_ok > self.ttl:
                    self._clear()  # the last view is older than the TTL: stale, not load
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX)
                continue
            if peers is None:  # nothing changed anywhere, no heartbeat due: no Redis call
                await asyncio.sleep(self.interval)
                continue
            self.peers = peers
            if self.up is False:
                log.info("replica sync: Redis at %s is back (%d other replicas live)", self.url, self.peers)
            self.up = True
            st.ok()
            self._last_ok = loop.time()
            backoff = BACKOFF_INITIAL
            await asyncio.sleep(self.interval)


class ReplicaCollector:
    """Prometheus families of the sync, read at scrape time."""

    def __init__(self, sync: ReplicaSync) -> None:
        self.sync = sync

    def collect(self):
        errors = CounterMetricFamily(
            "fastroute_replica_sync_errors", "Replica sync ticks that failed (Redis unreachable or slow)"
        )
        errors.add_metric([], float(self.sync.errors))
        peers = GaugeMetricFamily(
            "fastroute_replica_peers", "Other router replicas live in the last sync (0 while Redis is down)"
        )
        peers.add_metric([], float(self.sync.peers))
        up = GaugeMetricFamily("fastroute_replica_sync_up", "1 when the last sync tick succeeded")
        up.add_metric([], 1.0 if self.sync.up else 0.0)
        skipped = CounterMetricFamily(
            "fastroute_replica_sync_skipped",
            "Replica-sync input skipped: oversize entries, malformed or "
            "out-of-range payload lines, sync keys of the wrong type",
            labels=["what"],
        )
        for what, n in sorted(self.sync.skipped.items()):
            skipped.add_metric([what], float(n))
        twins = CounterMetricFamily(
            "fastroute_replica_id_conflicts",
            "Sync ticks that found another live replica publishing under this --replica-id",
        )
        twins.add_metric([], float(self.sync.conflicts))
        yield from (errors, peers, up, skipped, twins)


async def start_replica_sync(
    config: Any, table: TargetTable, registry: Any, metrics: Any, port: int
) -> ReplicaSync | None:
    """Start the sync where the table is owned; None when ``--replica-sync`` is off."""
    if config.replica_sync is None:
        return None
    sync = ReplicaSync(
        config.replica_sync,
        config.replica_id or default_replica_id(port),
        table,
        registry,
        config.replica_sync_interval_ms / 1000.0,
        config.replica_ttl_ms / 1000.0,
    )
    if metrics is not None:
        metrics.registry.register(ReplicaCollector(sync))
    sync.start()
    return sync
