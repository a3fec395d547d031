"""The replica-sync tick rate follows the change rate, against a real redis-server: replicas
whose loads do not move space their Redis ticks out to heartbeats (far fewer commands per
second than busy ones) and stay live for their peers, and a change made after a long quiet
spell still reaches a peer within about one configured interval (the changing tick wakes the
others through the wake channel)."""

from __future__ import annotations

import asyncio

import redis

from fastroute.core.table import COL_IN_FLIGHT, COL_OTHERS_IN_FLIGHT
from tests.integration.conftest import run, until
from tests.integration.redis_fixture import redis_server  # noqa: F401  (the fixture)
from tests.integration.sync_replicas import Replica

N = 16


def _replica(url: str, rid: str, interval: float, ttl: float) -> Replica:
    return Replica(url, rid, interval, ttl, N, "10.3.0")


def _commands(client: redis.Redis) -> int:
    """Commands Redis ran (those inside scripts too), this test's INFO calls left out."""
    stats = client.info("commandstats")
    return sum(int(v["calls"]) for name, v in stats.items() if name != "cmdstat_info")


def test_quiet_replicas_send_far_fewer_commands_than_busy_ones_and_stay_live(redis_server):  # noqa: F811
    async def body():
        reps = [_replica(redis_server.url, f"r{i}", 0.02, 3.0) for i in range(2)]
        client = redis.Redis.from_url(redis_server.url)
        try:
            for r in reps:
                r.sync.start()
            await until(lambda: all(r.sync.peers == 1 for r in reps), 5, "two replicas synced")
            await asyncio.sleep(2.0)  # quiet: the heartbeats space out to ttl / 3
            c0 = _commands(client)
            await asyncio.sleep(2.0)
            quiet = _commands(client) - c0
            assert all(r.sync.peers == 1 and r.sync.up for r in reps)  # still live for each other

            async def churn() -> None:
                for i in range(200):  # r0's load moves every 10 ms for 2 s
                    reps[0].table.cells.store(i % N, COL_IN_FLIGHT, 1 + i % 3)
                    await asyncio.sleep(0.01)

            c0 = _commands(client)
            await churn()
            busy = _commands(client) - c0
            assert quiet * 10 < busy, (quiet, busy)
            assert reps[1].table.get((199 % N), COL_OTHERS_IN_FLIGHT) in (1, 2, 3)
        finally:
            client.close()
            for r in reps:
                await r.close()

    run(body(), 40)


def test_a_change_after_a_quiet_spell_reaches_a_peer_within_about_one_interval(redis_server):  # noqa: F811
    async def body():
        interval = 0.25
        # ttl 30 s: quiet heartbeats may be up to 10 s apart, so only a wake explains a fast view
        a = _replica(redis_server.url, "a", interval, 30.0)
        b = _replica(redis_server.url, "b", interval, 30.0)
        try:
            for r in (a, b):
                r.sync.start()
            await until(lambda: a.sync.peers == 1 and b.sync.peers == 1, 5, "two replicas synced")
            await until(lambda: a.sync._pace._quiet >= 4.0 and b.sync._pace._quiet >= 4.0, 15, "both quiet")
            for value in (5, 2):
                a.table.cells.store(3, COL_IN_FLIGHT, value)
                # b's next heartbeat is seconds away: only a wake makes it tick this soon
                await until(lambda v=value: b.table.get(3, COL_OTHERS_IN_FLIGHT) == v, 6 * interval, f"b sees {value}")
                await until(lambda: b.sync._pace._quiet >= 4.0, 15, "b quiet again")
        finally:
            await a.close()
            await b.close()

    run(body(), 60)
