"""What a replica sync tick costs Redis and the wire, against a real redis-server: a tick sends
what changed, not the replica's whole state (which Redis keeps from the deltas), and a replica
whose state Redis lost publishes it whole again, so a newcomer still reads it all."""

from __future__ import annotations

import redis

from fastroute.control.replica import ReplicaSync
from fastroute.core.table import COL_IN_FLIGHT, COL_IN_FLIGHT_TOKENS, COL_OTHERS_IN_FLIGHT, TargetTable
from tests.integration.conftest import run
from tests.integration.redis_fixture import redis_server  # noqa: F401  (the fixture)

N = 512  # every target busy: a whole state is ~20 KB of lines


class _Targets:
    def __init__(self, n: int) -> None:
        self.target_info = [("w", r) for r in range(n)]
        self.background = None

    def target_name(self, t: int) -> str:
        return f"http://10.2.{t // 8 // 250}.{t // 8 % 250}:30000@{t % 8}"


class _Replica:
    def __init__(self, url: str, rid: str) -> None:
        self.table = TargetTable(N)
        for t in range(N):
            self.table.alloc()
            self.table.cells.store(t, COL_IN_FLIGHT, 1 + t % 3)
            self.table.cells.store(t, COL_IN_FLIGHT_TOKENS, 1000 + t)
        self.sync = ReplicaSync(url, rid, self.table, _Targets(N), 0.01, 5.0)

    async def close(self) -> None:
        await self.sync.client.aclose()
        self.table.close()
        self.table.unlink()


def _bytes_in(client: redis.Redis) -> int:
    return int(client.info("stats")["total_net_input_bytes"])


def test_a_tick_sends_what_changed_not_the_whole_state(redis_server):  # noqa: F811
    async def body():
        a, b = _Replica(redis_server.url, "a"), _Replica(redis_server.url, "b")
        client = redis.Redis.from_url(redis_server.url)
        try:
            for r in (a, b):
                await r.sync.tick()
            whole = sum(len(f"{_Targets(N).target_name(t)}\t1\t1000\t0\n") for t in range(N))
            for rnd in range(10):
                a.table.cells.store(rnd, COL_IN_FLIGHT, 7)  # one name changes per tick
                before = _bytes_in(client)
                await a.sync.tick()
                sent = _bytes_in(client) - before - 60  # minus the INFO command itself
                assert sent < whole // 10, (rnd, sent, whole)
            await b.sync.tick()
            assert [b.table.get(t, COL_OTHERS_IN_FLIGHT) for t in range(12)] == [
                7 if t < 10 else 1 + t % 3 for t in range(12)
            ]
        finally:
            client.close()
            await a.close()
            await b.close()

    run(body(), 30)


def test_a_replica_whose_state_redis_lost_publishes_it_whole_again(redis_server):  # noqa: F811
    async def body():
        a = _Replica(redis_server.url, "a")
        late: _Replica | None = None
        client = redis.Redis.from_url(redis_server.url)
        try:
            await a.sync.tick()
            a.table.cells.store(0, COL_IN_FLIGHT, 9)
            await a.sync.tick()
            # something deletes a's state (an operator's DEL, a key written over): a notices at
            # its next tick and publishes everything again at the one after
            client.delete("fastroute:{replicas}:rows:a")
            client.hdel("fastroute:{replicas}:seq", "a")
            await a.sync.tick()
            await a.sync.tick()
            late = _Replica(redis_server.url, "late")
            await late.sync.tick()
            assert [late.table.get(t, COL_OTHERS_IN_FLIGHT) for t in range(N)] == [
                9 if t == 0 else 1 + t % 3 for t in range(N)
            ]
        finally:
            client.close()
            await a.close()
            if late is not None:
                await late.close()

    run(body(), 30)


def test_a_peer_of_the_version_before_is_read_from_its_whole_payload(redis_server):  # noqa: F811
    """Mid-upgrade: a replica of the previous version numbers its entries but keeps its whole
    state only as a payload in the load hash (no rows hash); a new replica reads that."""

    async def body():
        client = redis.Redis.from_url(redis_server.url)
        me = _Replica(redis_server.url, "new")
        try:
            sec, usec = client.time()
            client.zadd("fastroute:{replicas}:beat", {"old": sec * 1000 + usec // 1000 + 60_000})
            client.hset("fastroute:{replicas}:seq", "old", 7)
            names = _Targets(N)
            client.hset("fastroute:{replicas}:load", "old", f"{names.target_name(0)}\t4\t40\t0\n".encode())
            assert await me.sync.tick() == 1
            assert me.table.get(0, COL_OTHERS_IN_FLIGHT) == 4
        finally:
            client.close()
            await me.close()

    run(body(), 30)
