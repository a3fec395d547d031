"""Speed-aware placement end to end: the in-process router (PD, --dp-aware, --speed-aware on)
in front of one simulated prefill and two simulated decode servers, one 1.6 times slower
(``--speed-factor``), over loopback sockets.

The router learns each decode server's step from the token gaps of the streams it relays; once
both are measured it places long streams so that the predicted time per output token stays
lowest, which fills the fast server well past the slow one's load. The split is compared with
the speed-optimal one computed from the simulator's true step curves, and with least_requests'
even split (the same run with --speed-aware off). /get_loads shows the fits.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from fastroute.sim.engine import SimParams
from fastroute.sim.http import HttpConnection
from fastroute.sim.worker import SimCluster, start_cluster
from tests.integration.conftest import Router, run, until

H = "127.0.0.1"
DP = 2
SLOW = 1.6
FIRST, MORE = 4, 20


def _body(n_out: int) -> bytes:
    return json.dumps({"text": "tok " * 8, "sampling_params": {"max_new_tokens": n_out}, "stream": True}).encode()


class Client:
    def __init__(self, port: int, n_out: int = 100_000) -> None:
        self.conn = HttpConnection(H, port)
        self.chunks: list[bytes] = []
        self.task = asyncio.ensure_future(
            self.conn.request("POST", "/generate", _body(n_out), on_chunk=self.chunks.append)
        )

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.conn.close()


def _optimal_split(p: SimParams, start: list[list[int]], more: int) -> list[int]:
    """Requests per server after placing ``more`` one by one where the true step at the
    busiest rank's new count is lowest (fewer requests first on a tie): the speed-optimal split."""
    counts = [list(c) for c in start]
    factors = (1.0, SLOW)

    def step(k: int, n: int) -> float:
        return factors[k] * (p.step_base_ms + p.step_request_ms * n)

    for _ in range(more):
        best = min(
            (step(k, max(max(counts[k]), counts[k][r] + 1)), counts[k][r], k, r) for k in (0, 1) for r in range(DP)
        )
        counts[best[2]][best[3]] += 1
    return [sum(c) for c in counts]


async def _scenario(mode: str) -> tuple[list[int], list[list[int]], dict[str, Any] | None]:
    fast = SimParams(dp_size=DP)
    slow = SimParams(dp_size=DP, speed_factor=SLOW)
    cluster: SimCluster = await start_cluster(
        1, 2, fast, SimParams(dp_size=DP, time_scale=0.1), decode_params=[fast, slow]
    )
    p = cluster.prefills[0]
    clients: list[Client] = []
    try:
        async with Router(
            pd_disaggregation=True,
            prefill=[(p.url, p.bootstrap_port)],
            decode=[d.url for d in cluster.decodes],
            dp_aware=True,
            policy="power_of_two",
            p2c_load_metric="least_requests",
            prefill_policy="round_robin",
            speed_aware=mode,
            load_monitor_interval=3600.0,
            seed=47,
        ) as r:
            book = r.server.registry.router.speed
            urls = [d.url for d in cluster.decodes]
            for _ in range(FIRST):
                clients.append(Client(r.port))
                await asyncio.sleep(0.05)
            await until(
                lambda: all(sum(d.decode.rank_loads()[i][0] for i in range(DP)) for d in cluster.decodes),
                10.0,
                "first streams decoding",
            )
            if book is not None:
                await until(lambda: all(book.predict(u, 1) is not None for u in urls), 10.0, "both servers measured")
            start = [[ld[0] for ld in d.decode.rank_loads()] for d in cluster.decodes]
            for _ in range(MORE):
                clients.append(Client(r.port))
                await asyncio.sleep(0.1)
            await until(
                lambda: sum(ld[0] for d in cluster.decodes for ld in d.decode.rank_loads()) == FIRST + MORE,
                10.0,
                "every stream decoding",
            )
            split = [sum(ld[0] for ld in d.decode.rank_loads()) for d in cluster.decodes]
            loads = None
            if book is not None:
                conn = HttpConnection(H, r.port)
                try:
                    status, _, body = await conn.request("GET", "/get_loads", b"")
                finally:
                    conn.close()
                assert status == 200
                loads = json.loads(body)
            return split, start, loads
    finally:
        for c in clients:
            await c.close()
        await cluster.stop()


def test_two_decode_servers_of_speed_ratio_1_6_get_the_speed_optimal_split() -> None:
    split, start, loads = run(_scenario("on"), 45.0)
    assert start == [[1, 1], [1, 1]]  # the first streams were spread before any fit existed
    best = _optimal_split(SimParams(), start, MORE)
    assert best[0] >= 20  # (the optimum fills the fast server: 1.6 x its base is 10 requests)
    assert abs(split[0] - best[0]) <= 2, (split, best)
    assert loads is not None
    servers = loads["speed"]["decode_servers"]
    fast_url, slow_url = sorted(servers, key=lambda u: servers[u]["base_seconds"] or 0)
    ratio = servers[slow_url]["base_seconds"] / servers[fast_url]["base_seconds"]
    assert ratio == pytest.approx(SLOW, rel=0.1)
    assert loads["speed"]["placements"]["agree"] == 0 and loads["speed"]["placements"]["disagree"] == 0


def test_least_requests_splits_the_same_streams_evenly() -> None:
    split, _, loads = run(_scenario("off"), 45.0)
    assert loads is None
    assert split == [12, 12]


async def _non_streaming() -> tuple[float | None, int]:
    one = SimParams(dp_size=1)
    cluster = await start_cluster(1, 1, one, SimParams(dp_size=1, time_scale=0.1))
    p = cluster.prefills[0]
    try:
        async with Router(
            pd_disaggregation=True,
            prefill=[(p.url, p.bootstrap_port)],
            decode=[cluster.decodes[0].url],
            policy="power_of_two",
            p2c_load_metric="least_requests",
            prefill_policy="round_robin",
            speed_aware="shadow",
            load_monitor_interval=3600.0,
        ) as r:
            body = json.dumps({"text": "tok " * 8, "sampling_params": {"max_new_tokens": 40}}).encode()
            conn = HttpConnection(H, r.port)
            try:
                for _ in range(4):
                    status, _, answer = await conn.request("POST", "/generate", body)
                    assert status == 200 and json.loads(answer)["meta_info"]["completion_tokens"] == 40
            finally:
                conn.close()
            book = r.server.registry.router.speed
            url = cluster.decodes[0].url
            return book.predict(url, 1), book.steps[url].samples
    finally:
        await cluster.stop()


def test_a_non_streaming_answer_is_one_sample_of_decode_time_over_output_tokens() -> None:
    step, samples = run(_non_streaming(), 30.0)
    p = SimParams()
    assert samples == 4
    # 40 steps of a one-request batch (29.3 ms each) over 40 tokens; the wait for the first
    # step and the relay add a little.
    assert step == pytest.approx((p.step_base_ms + p.step_request_ms) / 1000, rel=0.15)


async def _slowdown() -> tuple[float, float, float]:
    d = SimParams(dp_size=DP, slowdown_at=2.0, slowdown_factor=2.0)
    cluster = await start_cluster(1, 1, d, SimParams(dp_size=DP, time_scale=0.1))
    p = cluster.prefills[0]
    clients: list[Client] = []
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
            url = cluster.decodes[0].url
            loop = asyncio.get_running_loop()
            for _ in range(2 * DP):
                clients.append(Client(r.port))
            await until(lambda: book.predict(url, 2) is not None, 10.0, "measured")
            before = book.predict(url, 2)
            # The engine slows down 2 s after it started; wait for the fit to double.
            t_slow = cluster.decodes[0].decode._t0 + 2.0
            await until(lambda: (book.predict(url, 2) or 0.0) > 1.9 * before, 15.0, "the slowdown followed")
            return before, book.predict(url, 2), time.monotonic() - t_slow + 0 * loop.time()
    finally:
        for c in clients:
            await c.close()
        await cluster.stop()


def test_a_server_slowing_down_mid_run_is_followed_within_3_seconds() -> None:
    before, after, lag = run(_slowdown(), 40.0)
    p = SimParams()
    assert before == pytest.approx((p.step_base_ms + 2 * p.step_request_ms) / 1000, rel=0.1)
    assert after == pytest.approx(2 * before, rel=0.1)
    assert lag <= 3.0
