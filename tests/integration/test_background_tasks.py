"""Background tasks under hostile input (a task that dies silently leaves a stale view): the health
checker, the load monitor and the replica sync keep running, count what they skipped or what failed,
say when their view is stale and come back. Real routers over loopback, fake workers, a real
redis-server."""

from __future__ import annotations

import json
import logging

import redis

from fastroute.control import monitor as monitor_mod
from fastroute.control.monitor import Monitor
from fastroute.control.replica import BEAT_KEY, LOAD_KEY, MAX_ENTRY_BYTES
from fastroute.control.syncdelta import ROWS_PREFIX
from fastroute.core.table import COL_OTHERS_IN_FLIGHT, COL_OTHERS_TOKENS, COL_POLLED_AT
from tests.integration.conftest import Router, call, get, run, until, workers
from tests.integration.redis_fixture import redis_server  # noqa: F401  (the fixture)
from tests.integration.test_replicas import others, replica


def metric(r: Router, line_start: str) -> float | None:
    for line in r.server.metrics.render().decode().splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def errors_logged(caplog, task: str) -> list[str]:
    return [x.getMessage() for x in caplog.records if x.levelno >= logging.ERROR and task in x.getMessage()]


def test_health_checker_and_load_monitor_survive_crashing_ticks(caplog, monkeypatch):
    crashes = {"health": 0, "load": 0}
    real_check, real_parse = Monitor.check_once, monitor_mod.parse_v1_loads

    async def check_once(self):
        if crashes["health"] < 3:
            crashes["health"] += 1
            raise RuntimeError("health bug")
        await real_check(self)

    def parse(doc):
        if crashes["load"] < 3:
            crashes["load"] += 1
            raise TypeError("load bug")
        return real_parse(doc)

    monkeypatch.setattr(Monitor, "check_once", check_once)
    monkeypatch.setattr(monitor_mod, "parse_v1_loads", parse)

    async def body():
        (w,) = await workers(1)
        async with Router(
            worker_urls=[w.url], disable_health_check=False, health_check_interval_secs=1, load_monitor_interval=0.1
        ) as r:
            bg = r.server.registry.background
            await until(lambda: crashes["load"] == 3 and bg.tasks["load monitor"].up, 10, "the load monitor back")
            await until(lambda: crashes["health"] >= 1, 10, "a health crash")
            if crashes["health"] < 3:
                doc = json.loads((await call(r.port, get("/readiness"))).body)
                assert "health checks" in doc["stale"]
            await until(lambda: crashes["health"] == 3 and bg.tasks["health checks"].up, 10, "the health checker back")
            for task in ("health checks", "load monitor"):
                assert metric(r, f'fastroute_background_errors_total{{task="{task}"}}') == 3
                assert metric(r, f'fastroute_background_task_up{{task="{task}"}}') == 1
                assert len(errors_logged(caplog, task)) == 1
            t = r.server.registry.find(w.url).targets[0]
            await until(lambda: r.server.table.get(t, COL_POLLED_AT) >= 0, 5, "loads polled again")
            assert "stale" not in json.loads((await call(r.port, get("/readiness"))).body)
        await w.stop()

    with caplog.at_level(logging.INFO, logger="fastroute"):
        run(body(), 60)


def _forge(client: redis.Redis, rid: str, payload: bytes, beat: bool = True) -> None:
    """A peer entry written by hand (live for a minute when ``beat``)."""
    if beat:
        sec, usec = client.time()
        client.zadd(BEAT_KEY, {rid: sec * 1000 + usec // 1000 + 60_000})
    client.hset(LOAD_KEY, rid, payload)


def test_sync_skips_out_of_range_negative_and_garbage_peer_entries(redis_server):
    async def body():
        (w,) = await workers(1, dp_size=4)
        client = redis.Redis.from_url(redis_server.url)
        async with replica(w, redis_server.url, replica_id="B") as b:
            sync = b.server.replica
            names = b.server.registry.find(w.url).names
            rows = b.server.registry.find(w.url).targets
            await until(lambda: sync.up, 5, "sync up")
            # past int64 (ended every reader's sync before), past the cells' range, negative
            _forge(
                client,
                "evil",
                (
                    f"{names[0]}\t{10**20}\t1\t0\n"
                    f"{names[1]}\t{(1 << 63) - 1}\t1\t0\n"
                    f"{names[2]}\t3\t-70\t0\n"
                    f"{names[3]}\t-5\t9\t0\n"
                ).encode(),
            )
            await until(lambda: b.server.table.get(rows[2], COL_OTHERS_IN_FLIGHT) == 3, 5, "the good line applied")
            beat = client.zscore(BEAT_KEY, "B")
            await until(lambda: client.zscore(BEAT_KEY, "B") > beat, 5, "B's heartbeat goes on")
            assert sync.up and sync.peers == 1
            assert [b.server.table.get(t, COL_OTHERS_IN_FLIGHT) for t in rows] == [0, 0, 3, 0]
            assert b.server.table.get(rows[2], COL_OTHERS_TOKENS) == 0  # -70 -> 0
            assert b.server.table.get(rows[3], COL_OTHERS_TOKENS) == 9
            assert sync.skipped.get("bad_line", 0) >= 2
            # a load field with no heartbeat is never counted, however long it stays
            client.delete(LOAD_KEY, BEAT_KEY)
            _forge(client, "ghost", f"{names[0]}\t7\t7\t0\n".encode(), beat=False)
            # an entry over the size cap is skipped (not even sent by Redis), garbage is no peer
            _forge(client, "huge", (f"{names[1]}\t1\t1\t0\n" * 60_000).encode())
            _forge(client, "junk", b"hello\nworld\n")
            await until(lambda: sync.skipped.get("oversize", 0) >= 2, 5, "oversize skipped")
            assert len(client.hget(LOAD_KEY, "huge")) > MAX_ENTRY_BYTES
            assert sync.peers == 0 and others(b) == 0 and sync.up
            assert metric(b, "fastroute_replica_peers") == 0
            assert metric(b, 'fastroute_replica_sync_skipped_total{what="oversize"}') >= 2
        await w.stop()

    run(body(), 60)


def test_sync_keys_of_the_wrong_type_are_repaired(redis_server):
    async def body():
        (w,) = await workers(1, dp_size=2)
        client = redis.Redis.from_url(redis_server.url)
        async with replica(w, redis_server.url, replica_id="B") as b, replica(w, redis_server.url, replica_id="C") as c:
            for r in (b, c):
                await until(lambda r=r: r.server.replica.peers == 1, 5, "two replicas")
            for key in (LOAD_KEY, BEAT_KEY, ROWS_PREFIX + "B"):
                client.delete(key)
                client.set(key, "a plain string")  # WRONGTYPE for every command
                await until(lambda: client.type(key) != b"string", 5, f"{key} repaired")
                for r in (b, c):
                    await until(
                        lambda r=r: r.server.replica.up and r.server.replica.peers == 1,
                        5,
                        "sync back with the other replica",
                    )
            # counted where the reply arrived (a tick that timed out on a loaded host may have
            # repaired without hearing back)
            assert b.server.replica.skipped.get("repaired", 0) + c.server.replica.skipped.get("repaired", 0) >= 1
            assert client.type(BEAT_KEY) == b"zset"
            assert client.type(LOAD_KEY) in (b"hash", b"none") and client.type(ROWS_PREFIX + "B") in (b"hash", b"none")
        await w.stop()

    run(body(), 60)


def test_two_replicas_with_one_id_notice_each_other(redis_server, caplog):
    async def body():
        (w,) = await workers(1, dp_size=2)
        async with (
            replica(w, redis_server.url, replica_id="same") as b,
            replica(w, redis_server.url, replica_id="same") as c,
        ):
            await until(
                lambda: b.server.replica.conflicts > 0 and c.server.replica.conflicts > 0, 5, "both noticed the twin"
            )
            assert metric(b, "fastroute_replica_id_conflicts_total") > 0
        client = redis.Redis.from_url(redis_server.url)
        async with replica(w, redis_server.url, replica_id="alone") as d:
            beat = client.zscore(BEAT_KEY, "alone") or 0
            for _ in range(3):  # a few ticks of its own: no twin
                await until(lambda: (client.zscore(BEAT_KEY, "alone") or 0) > beat, 5, "a tick")
                beat = client.zscore(BEAT_KEY, "alone")
            assert d.server.replica.conflicts == 0
        await w.stop()

    with caplog.at_level(logging.ERROR, logger="fastroute.replica"):
        run(body(), 60)
    msgs = [r.getMessage() for r in caplog.records if "publishes as 'same'" in r.getMessage()]
    assert len(msgs) == 2  # one per replica, not one per tick


def test_peers_gauge_is_zero_and_the_view_stale_while_redis_is_down(redis_server):
    async def body():
        (w,) = await workers(1, dp_size=2)
        async with replica(w, redis_server.url, replica_id="B") as b, replica(w, redis_server.url, replica_id="C") as c:
            await until(lambda: b.server.replica.peers == 1, 5, "two replicas")
            assert metric(b, "fastroute_replica_peers") == 1
            redis_server.stop()
            await until(lambda: b.server.replica.errors > 0, 5, "the outage noticed")
            assert metric(b, "fastroute_replica_peers") == 0  # at once, not after the TTL
            assert metric(b, 'fastroute_background_task_up{task="replica sync"}') == 0
            doc = json.loads((await call(b.port, get("/readiness"))).body)
            assert "replica sync" in doc["stale"]
            redis_server.start()
            await until(lambda: b.server.replica.peers == 1 and c.server.replica.peers == 1, 10, "back")
            assert metric(b, 'fastroute_background_task_up{task="replica sync"}') == 1
        await w.stop()

    run(body(), 60)
