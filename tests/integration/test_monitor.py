"""Monitor over real loopback HTTP: per-rank load fan-out, fallbacks, unknown-on-failure, health."""

from __future__ import annotations

import asyncio

from fakeworker import FakeWorker, Plane, make_config, run, wait_until

from fastroute.control.monitor import parse_get_load, parse_v1_loads
from fastroute.core.table import (
    COL_HEALTHY,
    COL_POLLED_AT,
    COL_POLLED_MAX_TOKENS,
    COL_POLLED_RUNNING,
    COL_POLLED_TOKENS,
    COL_POLLED_WAITING,
)

LOADS4 = [{"num_running_reqs": r, "num_waiting_reqs": r % 2, "num_used_tokens": 1000 * (r + 1)} for r in range(4)]


def polled(table, t: int) -> tuple[int, int, int] | None:
    if table.get(t, COL_POLLED_AT) < 0:
        return None
    return (table.get(t, COL_POLLED_RUNNING), table.get(t, COL_POLLED_WAITING), table.get(t, COL_POLLED_TOKENS))


def test_v1_loads_fan_out_per_rank_one_call_per_server():
    async def body():
        fw = await FakeWorker(dp_size=4, loads=LOADS4).start()
        async with Plane(make_config(pd_disaggregation=True, dp_aware=True, api_key="k")) as p:
            w = await p.add(fw, "decode")
            assert [polled(p.table, t) for t in w.targets] == [None] * 4
            await p.monitor.poll_once()
            polls = [r for r in fw.requests if r.path == "/v1/loads"]
            assert len(polls) == 1  # one per physical server, not per rank
            assert polls[0].query == "include=core,disagg" and polls[0].headers["authorization"] == "Bearer k"
            assert [polled(p.table, t) for t in w.targets] == [(0, 0, 1000), (1, 1, 2000), (2, 0, 3000), (3, 1, 4000)]
            assert p.table.get(w.targets[0], COL_POLLED_MAX_TOKENS) == 100000
            # New values replace old ones on the next poll.
            fw.loads[2] = {"num_running_reqs": 9, "num_used_tokens": 5}
            await p.monitor.poll_once()
            assert polled(p.table, w.targets[2]) == (9, 0, 5)
        await fw.stop()

    run(body)


def test_fallback_to_get_load_is_remembered():
    async def body():
        fw = await FakeWorker(
            dp_size=2,
            load_mode="get_load",
            loads=[
                {"num_running_reqs": 2, "num_waiting_reqs": 3, "num_used_tokens": 70},
                {"num_running_reqs": 1, "num_used_tokens": 10},
            ],
        ).start()
        async with Plane(make_config(dp_aware=True)) as p:
            w = await p.add(fw)
            await p.monitor.poll_once()
            await p.monitor.poll_once()
            # /v1/loads asked once (404), then only /get_load.
            assert [x for x in fw.paths() if x in ("/v1/loads", "/get_load")] == ["/v1/loads", "/get_load", "/get_load"]
            # num_reqs = running + waiting on /get_load: running is recovered as 5 - 3.
            assert [polled(p.table, t) for t in w.targets] == [(2, 3, 70), (1, 0, 10)]
            assert p.table.get(w.targets[0], COL_POLLED_MAX_TOKENS) == -1
            assert p.monitor.polls[(fw.url, "get_load")] == 2
        await fw.stop()

    run(body)


def test_failed_poll_marks_unknown_never_zero():
    async def body():
        fw = await FakeWorker(dp_size=2, loads=LOADS4[:2]).start()
        async with Plane(make_config(dp_aware=True)) as p:
            w = await p.add(fw)
            await p.monitor.poll_once()
            assert all(polled(p.table, t) is not None for t in w.targets)
            fw.load_mode = "error"  # HTTP 500
            await p.monitor.poll_once()
            assert [polled(p.table, t) for t in w.targets] == [None, None]
            assert w.load_path == "/v1/loads"  # a 500 is not a reason to switch endpoint
            fw.load_mode = "v1"
            await p.monitor.poll_once()
            assert polled(p.table, w.targets[1]) == (1, 1, 2000)
            await fw.stop()  # connection refused
            await p.monitor.poll_once()
            assert [polled(p.table, t) for t in w.targets] == [None, None]
            assert p.monitor.polls[(fw.url, "failed")] == 2

    run(body)


def test_missing_rank_entry_is_unknown_others_kept():
    async def body():
        fw = await FakeWorker(dp_size=3, loads=LOADS4[:3]).start()
        async with Plane(make_config(dp_aware=True)) as p:
            w = await p.add(fw)
            fw.dp_size = 2  # the server now reports only ranks 0 and 1
            await p.monitor.poll_once()
            assert [polled(p.table, t) for t in w.targets] == [(0, 0, 1000), (1, 1, 2000), None]
        await fw.stop()

    run(body)


def test_unsplit_worker_sums_its_ranks():
    async def body():
        fw = await FakeWorker(dp_size=2, loads=LOADS4[:2]).start()
        async with Plane(make_config()) as p:  # not dp-aware: one target for the server
            w = await p.add(fw)
            await p.monitor.poll_once()
            assert polled(p.table, w.targets[0]) == (1, 1, 3000)
            assert p.table.get(w.targets[0], COL_POLLED_MAX_TOKENS) == 200000
        await fw.stop()

    run(body)


def test_parsers_are_defensive():
    assert parse_v1_loads({"loads": "x"}) == []
    assert parse_v1_loads([1, 2]) == []
    assert parse_v1_loads({"loads": [{"dp_rank": 0, "num_running_reqs": 1}]}) == [(0, None)]
    assert parse_v1_loads(
        {
            "loads": [
                {
                    "dp_rank": 1,
                    "num_total_reqs": 4,
                    "num_waiting_reqs": 1,
                    "num_used_tokens": 9.0,
                    "max_total_num_tokens": None,
                }
            ]
        }
    ) == [(1, (3, 1, 9, -1, -1, 0))]
    assert parse_v1_loads({"loads": [{"dp_rank": True, "num_running_reqs": -1, "num_used_tokens": 3}]}) == [
        (None, None)
    ]
    # A fork reporting pages instead of tokens: unknown, not zero.
    assert parse_get_load([{"dp_rank": 0, "num_reqs": 2, "num_waiting_reqs": 0, "num_pages": 4}]) == [(0, None)]
    assert parse_get_load({"dp_rank": 0, "num_reqs": 2, "num_tokens": 5}) == [(0, (2, 0, 5, -1, -1, 0))]
    assert parse_get_load("garbage") == []


def test_garbage_body_marks_unknown():
    async def body():
        fw = await FakeWorker(dp_size=1).start()
        async with Plane(make_config()) as p:
            w = await p.add(fw)
            await p.monitor.poll_once()
            assert polled(p.table, w.targets[0]) == (0, 0, 0)
            original = fw.handle

            async def broken(rec):
                if rec.path == "/v1/loads":
                    return 200, b"{not json", "application/json"
                return await original(rec)

            fw.handle = broken
            await p.monitor.poll_once()
            assert polled(p.table, w.targets[0]) is None
        await fw.stop()

    run(body)


def test_health_thresholds_one_probe_per_server():
    async def body():
        fw = await FakeWorker(dp_size=4).start()
        cfg = make_config(dp_aware=True, health_failure_threshold=2, health_success_threshold=2)
        async with Plane(cfg) as p:
            w = await p.add(fw)
            before = fw.count("/health")
            fw.health_status = 503
            await p.monitor.check_once()
            assert fw.count("/health") == before + 1  # one probe for 4 rank targets
            assert w.healthy and all(p.table.get(t, COL_HEALTHY) == 1 for t in w.targets)
            await p.monitor.check_once()
            assert not w.healthy and all(p.table.get(t, COL_HEALTHY) == 0 for t in w.targets)
            assert not p.registry.ready()
            fw.health_status = 200
            await p.monitor.check_once()
            assert not w.healthy  # one success is below the success threshold
            await p.monitor.check_once()
            assert w.healthy and all(p.table.get(t, COL_HEALTHY) == 1 for t in w.targets)
            assert p.registry.ready()
            # A failure streak broken by a success starts over.
            fw.health_status = 500
            await p.monitor.check_once()
            fw.health_status = 200
            await p.monitor.check_once()
            fw.health_status = 500
            await p.monitor.check_once()
            assert w.healthy
        await fw.stop()

    run(body)


def test_slow_health_within_timeout_stays_healthy():
    async def body():
        fw = await FakeWorker(health_delay=0.15).start()
        cfg = make_config(health_failure_threshold=1, health_check_timeout_secs=2.0)
        async with Plane(cfg) as p:
            w = await p.add(fw)
            for _ in range(3):
                assert await p.monitor.check_worker(w)
            assert w.healthy
            p.config.health_check_timeout_secs = 0.05  # now the same delay exceeds the timeout
            assert not await p.monitor.check_worker(w)
            assert not w.healthy and p.table.get(w.targets[0], COL_HEALTHY) == 0
        await fw.stop()

    run(body)


def test_health_endpoint_auth_rules():
    async def body():
        fw = await FakeWorker().start()
        async with Plane(make_config(api_key="k")) as p:
            w = await p.add(fw)
            await p.monitor.check_worker(w)
            assert "authorization" not in fw.requests[-1].headers  # never on /health
            p.config.health_check_endpoint = "/health_generate"
            assert await p.monitor.check_worker(w)
            assert fw.requests[-1].path == "/health_generate"
            assert fw.requests[-1].headers["authorization"] == "Bearer k"
        await fw.stop()

    run(body)


def test_background_loops_poll_and_check_until_stopped():
    async def body():
        fw = await FakeWorker(dp_size=2, loads=LOADS4[:2]).start()
        cfg = make_config(
            dp_aware=True, load_monitor_interval=0.1, health_check_interval_secs=0.05, health_failure_threshold=2
        )
        async with Plane(cfg) as p:
            w = await p.add(fw)
            p.monitor.start()
            await wait_until(lambda: polled(p.table, w.targets[1]) == (1, 1, 2000))
            fw.health_status = 503
            await wait_until(lambda: not w.healthy)
            await p.monitor.stop()
            n = len(fw.requests)
            await asyncio.sleep(0.25)
            assert len(fw.requests) == n  # nothing polls after stop()
        await fw.stop()

    run(body)


def test_disabled_loops_do_not_run():
    async def body():
        fw = await FakeWorker().start()
        cfg = make_config(disable_load_monitoring=True, disable_health_check=True)
        async with Plane(cfg) as p:
            w = await p.add(fw)
            n = len(fw.requests)
            p.monitor.start()
            await asyncio.sleep(0.3)
            assert len(fw.requests) == n and polled(p.table, w.targets[0]) is None
        await fw.stop()

    run(body)


def test_removed_worker_results_are_not_written():
    async def body():
        fw = await FakeWorker(health_delay=0.2).start()
        cfg = make_config(health_failure_threshold=1, health_success_threshold=1, health_check_timeout_secs=2.0)
        async with Plane(cfg) as p:
            w = await p.add(fw)
            t = w.targets[0]
            probe = asyncio.ensure_future(p.monitor.check_worker(w))  # slow, will succeed
            await wait_until(lambda: fw.count("/health") == 2)
            p.registry.remove_worker(w)
            # The row is reused by a new worker, which turns unhealthy, before the slow probe returns.
            other = await FakeWorker().start()
            w2 = await p.add(other)
            assert w2.targets[0] == t
            other.health_status = 503
            assert not await p.monitor.check_worker(w2)
            assert await probe
            # The removed worker's success must not mark the reused row healthy.
            assert p.table.get(t, COL_HEALTHY) == 0 and not w2.healthy
            await other.stop()
        await fw.stop()

    run(body)
