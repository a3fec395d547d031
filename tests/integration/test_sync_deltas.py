"""Replica sync by deltas against a real redis-server: a tick publishes only the names whose
load changed since the last one, and views built from deltas (replicas that keep following
each other through random bookings, releases, circuit opens, a replica that joins late and one
that dies) hold exactly what views built from full snapshots hold."""

from __future__ import annotations

import asyncio
import random

import redis

from fastroute.control.replica import BEAT_KEY, LOAD_KEY, OWNER_KEY, ReplicaSync
from fastroute.control.syncdelta import LOG_KEY, SEQ_KEY
from fastroute.core.table import (
    CIRCUIT_OPEN,
    COL_CIRCUIT,
    COL_IN_FLIGHT,
    COL_IN_FLIGHT_TOKENS,
    COL_OTHERS_IN_FLIGHT,
    COL_OTHERS_OPEN,
    COL_OTHERS_TOKENS,
    TargetTable,
)
from tests.integration.conftest import run
from tests.integration.redis_fixture import redis_server  # noqa: F401  (the fixture)

N = 64  # targets, the same names at every replica


class _Targets:
    """A registry's naming of rows (what the sync reads of it)."""

    def __init__(self, n: int) -> None:
        self.target_info = [("w", r) for r in range(n)]
        self.background = None
        self.renamed: dict[int, str] = {}

    def target_name(self, t: int) -> str:
        return self.renamed.get(t) or f"http://10.1.0.{t // 8}:30000@{t % 8}"


class _Replica:
    def __init__(self, url: str, rid: str, ttl: float = 5.0) -> None:
        self.table = TargetTable(N)
        for _ in range(N):
            self.table.alloc()
        self.sync = ReplicaSync(url, rid, self.table, _Targets(N), 0.01, ttl)

    def local(self, t: int) -> tuple[int, int, int]:
        g = self.table.get
        return g(t, COL_IN_FLIGHT), g(t, COL_IN_FLIGHT_TOKENS), int(g(t, COL_CIRCUIT) == CIRCUIT_OPEN)

    def others(self, t: int) -> tuple[int, int, int]:
        g = self.table.get
        return g(t, COL_OTHERS_IN_FLIGHT), g(t, COL_OTHERS_TOKENS), g(t, COL_OTHERS_OPEN)

    async def close(self) -> None:
        await self.sync.client.aclose()
        self.table.close()
        self.table.unlink()


def _expected(me: _Replica, live: list[_Replica]) -> list[tuple[int, int, int]]:
    out = []
    for t in range(N):
        loads = [r.local(t) for r in live if r is not me]
        out.append((sum(x[0] for x in loads), sum(x[1] for x in loads), int(any(x[2] for x in loads))))
    return out


def _churn(rs: random.Random, reps: list[_Replica], moves: int) -> None:
    for r in reps:
        for _ in range(moves):
            t = rs.randrange(N)
            r.table.cells.store(t, COL_IN_FLIGHT, rs.randrange(0, 4))
            r.table.cells.store(t, COL_IN_FLIGHT_TOKENS, rs.randrange(0, 4) * 1000)
            if rs.random() < 0.1:
                r.table.cells.store(t, COL_CIRCUIT, CIRCUIT_OPEN if rs.random() < 0.5 else 0)


def test_a_tick_publishes_only_the_names_that_changed(redis_server):  # noqa: F811
    async def body():
        a, b = _Replica(redis_server.url, "a"), _Replica(redis_server.url, "b")
        client = redis.Redis.from_url(redis_server.url)
        try:
            for t in range(N):
                a.table.cells.store(t, COL_IN_FLIGHT, 2)
            await a.sync.tick()
            await b.sync.tick()
            first = [e for e in client.xrange(LOG_KEY) if e[1][b"i"] == b"a"]
            assert len(first) == 1 and first[0][1][b"d"].count(b"\n") == N  # the first tick: all
            for t in (3, 17, 40):
                a.table.cells.store(t, COL_IN_FLIGHT, 5)
            await a.sync.tick()
            await a.sync.tick()  # nothing changed since: nothing appended
            entries = [e for e in client.xrange(LOG_KEY) if e[1][b"i"] == b"a"]
            assert len(entries) == 2
            lines = entries[1][1][b"d"].decode().splitlines()
            assert sorted(line.split("\t")[0] for line in lines) == sorted(
                _Targets(N).target_name(t) for t in (3, 17, 40)
            )
            await b.sync.tick()
            assert [b.others(t)[0] for t in range(N)] == [5 if t in (3, 17, 40) else 2 for t in range(N)]
            assert b.sync._view.seq == {b"a": 3}  # b followed a's entry (2, 3), not its whole payload
        finally:
            await a.close()
            await b.close()

    run(body(), 30)


def test_views_from_deltas_equal_full_snapshots(redis_server):  # noqa: F811
    async def body():
        rs = random.Random(52)
        reps = [_Replica(redis_server.url, f"r{i}", ttl=1.0) for i in range(4)]
        late: _Replica | None = None
        try:
            for rnd in range(40):
                live = [r for r in reps if r is not None]
                _churn(rs, live, rs.randrange(0, 12))
                for r in rs.sample(live, len(live)):  # ticks in any order
                    await r.sync.tick()
                if rnd == 30:  # a tick that fails after Redis ran it (the client timed out)
                    pauser = redis.Redis.from_url(redis_server.url)
                    pauser.execute_command("CLIENT", "PAUSE", 600, "WRITE")
                    try:
                        await reps[0].sync.tick()
                        raise AssertionError("the tick did not time out")
                    except redis.exceptions.TimeoutError:
                        pass
                    await asyncio.sleep(0.15)  # the pause ends: Redis runs the tick it held
                    for t in range(N):  # then the replica that failed falls idle: its next
                        reps[0].table.cells.store(t, COL_IN_FLIGHT, 0)  # delta is empty
                        reps[0].table.cells.store(t, COL_IN_FLIGHT_TOKENS, 0)
                        reps[0].table.cells.store(t, COL_CIRCUIT, 0)
                if rnd == 10:  # a replica joins late: it reads everyone whole once
                    late = _Replica(redis_server.url, "late", ttl=1.0)
                    reps.append(late)
                if rnd == 20:  # one dies: its counts leave every view after the TTL
                    dead = reps.pop(1)
                    await dead.close()
                    for _ in range(12):  # the others go on ticking past its TTL
                        await asyncio.sleep(0.1)
                        for r in reps:
                            await r.sync.tick()
                # two passes without changes: every view has seen every replica's last tick
                # (a view that found an entry missing reads that replica whole at its next)
                live = list(reps)
                for _ in range(2):
                    for r in live:
                        await r.sync.tick()
                # the oracle: a fresh reader that knows nobody reads every replica whole
                whole = _Replica(redis_server.url, f"whole{rnd}", ttl=1.0)
                try:
                    await whole.sync.tick()
                    assert [whole.others(t) for t in range(N)] == _expected(whole, live)
                finally:
                    # gone at once, as a stopping replica withdraws (not a peer of the others)
                    await whole.sync.client.zrem(BEAT_KEY, whole.sync.id)
                    for key in (LOAD_KEY, OWNER_KEY, SEQ_KEY):
                        await whole.sync.client.hdel(key, whole.sync.id)
                    await whole.close()
                for r in live:
                    assert [r.others(t) for t in range(N)] == _expected(r, live), (rnd, r.sync.id)
            assert late is not None and late in reps
        finally:
            for r in reps:
                await r.close()

    run(body(), 60)


def test_a_renamed_row_moves_its_load_to_the_new_name(redis_server):  # noqa: F811
    """A worker resized to dp_size 1 keeps its row 0 under a new name (url@0 -> url); the
    registry tells by the table's generation, and the replica publishes the row's load under
    the new name, which a replica that only ever knew the new name reads."""

    async def body():
        a = _Replica(redis_server.url, "a")
        b: _Replica | None = None
        try:
            a.table.cells.store(0, COL_IN_FLIGHT, 3)
            await a.sync.tick()
            a.sync.registry.renamed[0] = "http://10.1.0.0:30000"
            a.table.bump_generation()
            b = _Replica(redis_server.url, "b")
            b.sync.registry.renamed[0] = "http://10.1.0.0:30000"
            await a.sync.tick()
            await b.sync.tick()
            assert b.others(0) == (3, 0, 0)
            a.table.cells.store(0, COL_IN_FLIGHT, 1)
            await a.sync.tick()
            await b.sync.tick()
            assert b.others(0) == (1, 0, 0)
        finally:
            await a.close()
            if b is not None:
                await b.close()

    run(body(), 30)
