"""A worker restarted with another dp_size is followed: under --dp-aware the
router re-reads /server_info when polls suggest a restart and rebuilds that worker's rank
targets; leases held on ranks that are gone are released normally. Real router and fake
workers over loopback."""

from __future__ import annotations

import asyncio

from fastroute.core.table import COL_ALLOCATED
from tests.integration.conftest import Router, _WorkerConn, call, post, run, until, workers
from tests.integration.test_replicas import ranks, send_held


def test_dp_size_4_to_2_from_the_load_polls_keeps_held_leases():
    async def body():
        (w,) = await workers(1, dp_size=4)
        async with Router(worker_urls=[w.url], dp_aware=True, load_monitor_interval=0.1) as r:
            reg, tab = r.server.registry, r.server.table
            wk = reg.find(w.url)
            old = list(wk.targets)
            assert len(old) == 4
            w.hold()
            held = await send_held(r.port, 4)
            await until(lambda: w.held == 4, 5, "4 requests held, one per rank")
            assert sorted(ranks(w)) == [0, 1, 2, 3]
            w.dp_size = 2  # restarted with --dp-size 2 (same URL)
            await until(lambda: len(wk.targets) == 2, 15, "ranks rebuilt")
            assert wk.dp_size == 2 and wk.targets == old[:2]
            assert wk.names == [f"{w.url}@0", f"{w.url}@1"]
            # the leases on ranks 2 and 3 are still held: their rows wait for them
            assert [tab.in_flight(t) for t in old] == [1, 1, 1, 1]
            assert all(tab.get(t, COL_ALLOCATED) for t in old[2:])
            w.release()
            for c in held:
                assert (await c.response(timeout=5)).status == 200
                c.close()
            await until(
                lambda: not any(tab.get(t, COL_ALLOCATED) for t in old[2:]),
                5,
                "the rows of the gone ranks freed once released",
            )
            assert [tab.in_flight(t) for t in old[:2]] == [0, 0]
            n = len(w.inference())
            for _ in range(6):
                assert (await call(r.port, post("/generate", {"text": "x"}))).status == 200
            assert set(ranks(w, n)) == {0, 1}
        await w.stop()

    run(body(), 60)


def test_dp_size_2_to_8_after_a_restart_seen_by_health_checks():
    async def body():
        (w,) = await workers(1, dp_size=2)
        async with Router(
            worker_urls=[w.url],
            dp_aware=True,
            disable_load_monitoring=True,
            disable_health_check=False,
            health_check_interval_secs=1,
            health_failure_threshold=1,
            health_success_threshold=1,
        ) as r:
            wk = r.server.registry.find(w.url)
            assert len(wk.targets) == 2
            port = w.port
            await w.stop()
            await until(lambda: not wk.healthy, 10, "the restart seen as a failure")
            w.dp_size = 8
            w._server = await asyncio.get_running_loop().create_server(lambda: _WorkerConn(w), "127.0.0.1", port)
            await until(lambda: wk.healthy and len(wk.targets) == 8, 10, "8 ranks")
            n = len(w.inference())
            for _ in range(16):
                assert (await call(r.port, post("/generate", {"text": "x"}))).status == 200
            assert sorted(set(ranks(w, n))) == list(range(8))
            m = r.server.metrics.render().decode()
            assert f'target="{w.url}@7"' in m
        await w.stop()

    run(body(), 60)
