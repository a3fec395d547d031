"""Prefill rates and regular workers under --speed-aware, against the simulator over loopback:

* a DP-2 prefill whose ranks compute at different rates (``--prefill-rank-rates``) and push
  LoadStat over ZMQ: the router's per-rank rate comes from the pushed busy time over uncached
  tokens and matches each rank's configured rate;
* regular mode: two simulated regular workers, one 2.5 times slower, are measured from the
  streams relayed (the plain relay's meter), and /metrics exports the fits;
* with the mode off the App runs the plain exchange classes (the request path does no more work).
"""

from __future__ import annotations

import asyncio
import json

import pytest

from fastroute.dataplane.exchange import Relay
from fastroute.dataplane.pd import PDRelay
from fastroute.sim.engine import SimParams
from fastroute.sim.http import HttpConnection
from fastroute.sim.server import SimWorker
from fastroute.sim.worker import start_cluster
from tests.integration.conftest import Router, run, until

H = "127.0.0.1"


async def _pushed_rates() -> tuple[list[float | None], list[bool]]:
    prefill = SimParams(
        dp_size=2,
        prefill_base_ms=0.0,
        prefill_rank_rates="200000,50000",
        kv_events_port_base=-1,
        prefix_cache_tokens=64 * 512,
    )
    cluster = await start_cluster(1, 1, SimParams(dp_size=2, time_scale=0.05), prefill)
    p = cluster.prefills[0]
    try:
        async with Router(
            pd_disaggregation=True,
            prefill=[(p.url, p.bootstrap_port)],
            decode=[cluster.decodes[0].url],
            dp_aware=True,
            policy="power_of_two",
            p2c_load_metric="least_requests",
            prefill_policy="round_robin",
            speed_aware="shadow",
            load_monitor_interval=3600.0,
        ) as r:
            book = r.server.registry.router.speed
            targets = list(r.server.registry.find(p.url).targets)
            await until(lambda: all(t in book.rates for t in targets), 10.0, "LoadStat from both ranks")
            conn = HttpConnection(H, r.port)
            try:
                for k in range(6):  # round robin: 3 on each rank; distinct prompts (no cache hits)
                    body = json.dumps({"text": f"x{k:02d} " * 5000, "sampling_params": {"max_new_tokens": 2}})
                    status, _, _ = await conn.request("POST", "/generate", body.encode())
                    assert status == 200
            finally:
                conn.close()
            await until(lambda: all(book.rates[t].samples >= 3 for t in targets), 10.0, "rate samples")
            return [book.rate(t) for t in targets], [book.pushes(t) for t in targets]
    finally:
        await cluster.stop()


def test_prefill_rates_come_from_pushed_busy_time() -> None:
    rates, pushes = run(_pushed_rates(), 40.0)
    assert pushes == [True, True]
    assert rates[0] == pytest.approx(200_000, rel=0.15)
    assert rates[1] == pytest.approx(50_000, rel=0.15)


async def _regular() -> tuple[list[float | None], str, type, type]:
    fast, slow = SimParams(dp_size=1), SimParams(dp_size=1, speed_factor=2.5)
    workers = [SimWorker("regular", fast, H, 0), SimWorker("regular", slow, H, 0)]
    for w in workers:
        await w.start()
    clients: list[asyncio.Task] = []
    conns: list[HttpConnection] = []
    try:
        async with Router(
            worker_urls=[w.url for w in workers],
            policy="power_of_two",
            p2c_load_metric="least_requests",
            speed_aware="on",
            load_monitor_interval=3600.0,
        ) as r:
            book = r.server.registry.router.speed
            body = json.dumps({"text": "tok " * 8, "sampling_params": {"max_new_tokens": 100_000}, "stream": True})
            for _ in range(4):
                c = HttpConnection(H, r.port)
                conns.append(c)
                clients.append(asyncio.ensure_future(c.request("POST", "/generate", body.encode(), on_chunk=len)))
            urls = [w.url for w in workers]
            await until(lambda: all(book.predict(u, 1) is not None for u in urls), 10.0, "both measured")
            mc = HttpConnection(H, r.server.metrics.port)
            try:
                _, _, raw = await mc.request("GET", "/metrics", b"")
                text = raw.decode()
            finally:
                mc.close()
            return [book.predict(u, 2) for u in urls], text, r.server.app.endpoints.exchange, Relay
    finally:
        for t in clients:
            t.cancel()
        await asyncio.gather(*clients, return_exceptions=True)
        for c in conns:
            c.close()
        for w in workers:
            await w.stop()


def test_regular_workers_are_measured_from_the_relayed_streams() -> None:
    steps, metrics, exchange, relay = run(_regular(), 40.0)
    assert issubclass(exchange, relay) and exchange is not relay  # the metered relay runs
    p = SimParams()
    assert steps[0] == pytest.approx((p.step_base_ms + 2 * p.step_request_ms) / 1000, rel=0.1)
    assert steps[1] / steps[0] == pytest.approx(2.5, rel=0.1)
    for w in ("fastroute_server_step_seconds{", "fastroute_server_step_per_request_seconds{"):
        assert w in metrics


def test_with_the_mode_off_the_app_runs_the_plain_exchanges() -> None:
    async def go() -> tuple[object, object]:
        cluster = await start_cluster(1, 1, SimParams(dp_size=1), SimParams(dp_size=1))
        p = cluster.prefills[0]
        try:
            async with Router(
                pd_disaggregation=True, prefill=[(p.url, p.bootstrap_port)], decode=[cluster.decodes[0].url]
            ) as r:
                assert r.server.registry.router.speed is None
                return r.server.app.endpoints.exchange, r.server.app.limits.header_flags.get(b"x-slo-tpot-ms")
        finally:
            await cluster.stop()

    cls, flag = run(go(), 30.0)
    assert cls is PDRelay and flag is None
