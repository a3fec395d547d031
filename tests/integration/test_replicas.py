"""Router replicas balancing as one through a real Redis (``--replica-sync``), over real sockets.

Three replicas share one 8-rank fake worker: A is a real router process (so it can be
SIGKILLed), B and C are in-process Servers. Requests are held in the worker by its gate, so
in-flight counts stay put while the test looks at where they landed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from typing import Any

import redis

from fastroute.core.table import CIRCUIT_OPEN, COL_CIRCUIT, COL_OTHERS_EST, COL_OTHERS_IN_FLIGHT, COL_OTHERS_OPEN
from fastroute.sim.redisproc import free_port
from tests.integration.conftest import DataWorker, RawClient, Router, call, get, post, run, until, workers
from tests.integration.redis_fixture import redis_server  # noqa: F401  (the fixture)
from tests.integration.test_multiproc import MultiRouter

TTL_MS = 1000
TURN = 0.15  # seconds between one replica's requests taken one at a time (> two 20 ms ticks)
SYNC = dict(
    dp_aware=True,
    policy="power_of_two",
    p2c_load_metric="least_requests",
    replica_sync_interval_ms=20,
    replica_ttl_ms=TTL_MS,
)


def replica(worker: DataWorker, redis_url: str, **kw: Any) -> Router:
    return Router(worker_urls=[worker.url], replica_sync=redis_url, **{**SYNC, **kw})


def others(r: Router, col: int = COL_OTHERS_IN_FLIGHT) -> int:
    return sum(r.server.table.get(t, col) for wk in r.server.registry.workers for t in wk.targets)


class ProcessReplica:
    """``python -m fastroute`` with replica sync, as a subprocess (SIGKILL-able)."""

    def __init__(self, worker: DataWorker, redis_url: str) -> None:
        self.port = free_port()
        self.args = [
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            "--worker-urls",
            worker.url,
            "--dp-aware",
            "--policy",
            "power_of_two",
            "--p2c-load-metric",
            "least_requests",
            "--worker-startup-check-interval",
            "1",
            "--disable-health-check",
            "--log-level",
            "warning",
            "--replica-sync",
            redis_url,
            "--replica-id",
            "A",
            "--replica-sync-interval-ms",
            "20",
            "--replica-ttl-ms",
            str(TTL_MS),
        ]
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> ProcessReplica:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fastroute", *self.args, env={**os.environ, "PYTHONPATH": os.getcwd()}
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20
        while True:
            try:
                if (await call(self.port, get("/readiness"), timeout=1.0)).status == 200:
                    return self
            except (OSError, asyncio.TimeoutError):
                pass
            assert loop.time() < deadline, "replica A never became ready"
            await asyncio.sleep(0.05)

    def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)

    async def close(self) -> None:
        self.kill()
        if self.proc is not None:
            await self.proc.wait()


async def send_held(port: int, n: int, spacing: float = 0.0) -> list[RawClient]:
    """n requests to one replica; ``spacing`` > 0 waits between them (longer than two sync
    ticks: a replica that places several requests at once plans them as a burst shared with the
    other replicas, see docs/operations.md "Bursts", so one-at-a-time turns need the gap)."""
    out = []
    for i in range(n):
        if i and spacing:
            await asyncio.sleep(spacing)
        c = await RawClient(port).connect()
        c.send(post("/generate", {"text": f"held {i}"}))
        out.append(c)
    return out


def ranks(w: DataWorker, start: int = 0) -> list[int]:
    return [rec.json["data_parallel_rank"] for rec in w.inference()[start:]]


def test_three_replicas_balance_as_one_survive_a_kill_and_a_redis_outage(redis_server, caplog):
    caplog.set_level(logging.INFO, logger="fastroute.replica")

    async def body() -> None:
        (w,) = await workers(1, dp_size=8)
        a = await ProcessReplica(w, redis_server.url).start()
        try:
            async with (
                replica(w, redis_server.url, replica_id="B") as b,
                replica(w, redis_server.url, replica_id="C") as c,
            ):
                for r in (b, c):
                    await until(lambda r=r: r.server.replica.peers == 2, 10, "three live replicas")
                w.hold()
                held = await send_held(a.port, 3, TURN)
                await until(lambda: w.held == 3, 5, "A's 3 requests held")
                await until(lambda: others(b) == 3, 5, "B sees A's 3 requests")
                held += await send_held(b.port, 3, TURN)
                await until(lambda: w.held == 6, 5, "B's 3 requests held")
                await until(lambda: others(c) == 6, 5, "C sees A's and B's 6 requests")
                held += await send_held(c.port, 2, TURN)
                await until(lambda: w.held == 8, 5, "C's 2 requests held")
                first = ranks(w)
                assert sorted(first) == list(range(8)), first  # 8 distinct ranks
                a_ranks = set(first[:3])

                # A dies with its 3 requests: after the TTL its load leaves B's view.
                a.kill()
                await until(
                    lambda: b.server.replica.peers == 1 and others(b) == 2,
                    TTL_MS / 1000 + 5,
                    "A dropped out of B's view",
                )
                held_b = await send_held(b.port, 3, TURN)
                await until(lambda: len(w.inference()) == 11, 5, "B's next 3 requests arrived")
                assert set(ranks(w, 8)) == a_ranks

                # Redis gone: every request still succeeds, on local counts.
                redis_server.stop()
                w.release()
                for cl in held[3:] + held_b:
                    assert (await cl.response(timeout=5)).status == 200
                    cl.close()
                for cl in held[:3]:
                    cl.close()
                for r in (b, c):
                    for _ in range(8):
                        assert (await call(r.port, post("/generate", {"text": "x"}))).status == 200
                await until(lambda: b.server.replica.errors > 0 and not b.server.replica.up, 5, "B noticed the outage")
                # the last view ages out after the TTL: stale load is not kept
                await until(
                    lambda: others(b) == 0 and b.server.replica.peers == 0, TTL_MS / 1000 + 5, "B's stale view cleared"
                )
                assert (await call(b.port, post("/generate", {"text": "x"}))).status == 200
                metrics = b.server.metrics.render().decode()
                assert "fastroute_replica_sync_errors_total" in metrics
                assert "fastroute_replica_peers 0.0" in metrics

                # Redis back on the same port: both replicas find each other again.
                redis_server.start()
                for r in (b, c):
                    await until(lambda r=r: r.server.replica.up and r.server.replica.peers == 1, 10, "sync resumed")
        finally:
            await a.close()
            await w.stop()

    run(body(), timeout=90)
    msgs = [(rec.levelname, rec.getMessage()) for rec in caplog.records if rec.name == "fastroute.replica"]
    # One warning when the link dropped and one info when it returned, per replica.
    assert sum(1 for lvl, m in msgs if lvl == "WARNING" and "unreachable" in m) == 2, msgs
    assert sum(1 for lvl, m in msgs if lvl == "INFO" and "is back" in m) == 2, msgs


def test_an_open_circuit_at_one_replica_is_avoided_by_all(redis_server):
    async def body() -> None:
        w1, w2 = await workers(2)
        try:
            kw = dict(
                policy="round_robin",
                replica_sync=redis_server.url,
                replica_sync_interval_ms=20,
                replica_ttl_ms=TTL_MS,
                cb_failure_threshold=2,
                cb_timeout_duration_secs=60,
                disable_retries=True,
            )
            async with (
                Router(worker_urls=[w1.url, w2.url], replica_id="B", **kw) as b,
                Router(worker_urls=[w1.url, w2.url], replica_id="C", **kw) as c,
            ):
                w1.status = 500
                for _ in range(6):
                    await call(b.port, post("/generate", {"text": "x"}))
                t1 = b.server.registry.find(w1.url).targets[0]
                assert b.server.table.get(t1, COL_CIRCUIT) == CIRCUIT_OPEN
                await until(lambda: others(c, COL_OTHERS_OPEN) == 1, 5, "C sees B's open circuit")
                n1 = len(w1.inference())
                for _ in range(10):
                    assert (await call(c.port, post("/generate", {"text": "x"}))).status == 200
                assert len(w1.inference()) == n1  # C never tried the failing worker
        finally:
            await w1.stop()
            await w2.stop()

    run(body(), timeout=60)


def test_workers_2_publishes_the_host_once(redis_server):
    async def body() -> None:
        (w,) = await workers(1, dp_size=4)
        try:
            async with MultiRouter(
                "--worker-urls",
                w.url,
                "--dp-aware",
                "--replica-sync",
                redis_server.url,
                "--replica-id",
                "host1",
                "--replica-sync-interval-ms",
                "20",
            ) as m:
                w.hold()
                held = []
                for _ in range(6):
                    held += await send_held(m.port, 1)
                await until(lambda: w.held == 6, 10, "6 requests held")
                client = redis.Redis(port=redis_server.port)
                try:

                    def published() -> tuple[list[bytes], int]:
                        ids = sorted(client.zrange("fastroute:{replicas}:beat", 0, -1))
                        rows = client.hgetall("fastroute:{replicas}:rows:host1")  # name -> r, k, open
                        return ids, sum(int(v.split(b"\t")[0]) for v in rows.values())

                    await until(
                        lambda: published() == ([b"host1"], 6),
                        5,
                        "one entry for the host, holding both processes' requests",
                    )
                finally:
                    client.close()
                w.release()
                for cl in held:
                    assert (await cl.response(timeout=5)).status == 200
                    cl.close()
        finally:
            await w.stop()

    run(body(), timeout=60)


def optimal_max(counts: list[int], extra: int) -> int:
    """The busiest rank's count after placing ``extra`` requests one by one on the least loaded."""
    c = sorted(counts)
    for _ in range(extra):
        c[0] += 1
        c.sort()
    return max(c)


def test_a_burst_over_synced_replicas_is_placed_as_one_router_would(redis_server):
    """Three synced replicas, a burst of 9 requests (3 to each, round robin, faster than a sync)
    onto 8 ranks of which 5 already hold a request. Each replica knows only the last synced
    view, in which the same 3 ranks are empty: without coordination all three send their 3
    there (3 requests on each of them, where one router would have made no rank exceed 2)."""
    slow = dict(replica_sync_interval_ms=3000, replica_ttl_ms=10_000)

    async def body() -> None:
        (w,) = await workers(1, dp_size=8)
        try:
            async with (
                replica(w, redis_server.url, replica_id="A", **slow) as a,
                replica(w, redis_server.url, replica_id="B", **slow) as b,
                replica(w, redis_server.url, replica_id="C", **slow) as c,
            ):
                for r in (a, b, c):
                    await until(lambda r=r: r.server.replica.peers == 2, 15, "three live replicas")
                w.hold()
                held = await send_held(a.port, 5)
                await until(lambda: w.held == 5, 5, "5 requests held")
                await until(lambda: others(b) == 5 and others(c) == 5, 10, "B and C see them")
                # A's own estimates of the others are gone after its next tick too.
                await until(lambda: others(a, COL_OTHERS_EST) == 0, 10, "A synced again")
                before = [0] * 8
                for rk in ranks(w):
                    before[rk] += 1
                for _ in range(3):
                    for r in (a, b, c):
                        cl = await RawClient(r.port).connect()
                        cl.send(post("/generate", {"text": "burst"}))
                        held.append(cl)
                await until(lambda: w.held == 14, 5, "the burst arrived")
                after = [0] * 8
                for rk in ranks(w):
                    after[rk] += 1
                assert max(after) == optimal_max(before, 9), (before, after)
                w.release()
                for cl in held:
                    assert (await cl.response(timeout=5)).status == 200
                    cl.close()
        finally:
            await w.stop()

    run(body(), timeout=90)


def test_a_replica_whose_peers_are_idle_spreads_sequential_requests(redis_server):
    """Two synced replicas, B idle; A gets 40 requests one after another (each answered before
    the next). Every rank is equally empty at each pick: the shared tie order of the replicas'
    plan would send all 40 to the same rank, a router alone breaks the tie at random."""

    async def body() -> None:
        (w,) = await workers(1, dp_size=4)
        try:
            async with (
                replica(w, redis_server.url, replica_id="A", seed=3) as a,
                replica(w, redis_server.url, replica_id="B", seed=4) as b,
            ):
                for r in (a, b):
                    await until(lambda r=r: r.server.replica.peers == 1, 15, "two live replicas")
                start = len(w.inference())
                for i in range(40):
                    res = await call(a.port, post("/generate", {"text": f"one at a time {i}"}))
                    assert res.status == 200, res.body
                got = ranks(w, start)
                assert len(got) == 40
                counts = [got.count(rk) for rk in range(4)]
                assert min(counts) > 0 and max(counts) < 30, counts
        finally:
            await w.stop()

    run(body(), timeout=60)
