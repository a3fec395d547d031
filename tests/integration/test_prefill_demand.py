"""Prefill input demand end to end (``--prefill-input-demand``) and the SGLang 0.5.23
``/v1/loads`` fields that feed placement.

* A DP-8 simulated prefill that holds every request (a long fixed prefill time): 4 requests of
  40k input tokens, then 8 small ones. Under least_requests alone the small ones fill the four
  free ranks and then tie with the large ranks, so some queue behind a 40k prefill; with prefill
  input demand on, each prefill rank costs the input tokens waiting there, and no small request
  ever shares a rank with a large one.
* Under prefill demand a prefill's input tokens are given back when its answer ends; the
  request itself stays booked until the exchange ends.
* The monitor stores a prefill's ``num_waiting_uncached_tokens`` (and only a prefill's), and a
  decode rank whose poll shows a prealloc queue has no free KV for KV fit.
"""

from __future__ import annotations

import asyncio
import json

from fastroute.core import _policy
from fastroute.core.table import COL_IN_FLIGHT, COL_IN_FLIGHT_TOKENS, COL_POLLED_UNCACHED
from fastroute.sim.engine import SimParams
from fastroute.sim.http import HttpConnection
from fastroute.sim.worker import SimCluster, start_cluster
from tests.integration.conftest import Router, run, until
from tests.integration.fakeworker import FakeWorker, Plane, make_config
from tests.integration.fakeworker import run as run_plain

H = "127.0.0.1"
LARGE, SMALL = 40_000, 100


def _body(n_in: int, n_out: int = 100_000) -> bytes:
    # 4 ASCII bytes weigh one token for both the router and the simulator
    return json.dumps({"text": "tok " * n_in, "sampling_params": {"max_new_tokens": n_out}, "stream": True}).encode()


class Client:
    """One streaming request through the router, held open until ``close``."""

    def __init__(self, port: int, n_in: int) -> None:
        self.conn = HttpConnection(H, port)
        self.task = asyncio.ensure_future(self.conn.request("POST", "/generate", _body(n_in), on_chunk=lambda c: None))

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.conn.close()


def _router(cluster: SimCluster, **kw) -> Router:
    p, d = cluster.prefills[0], cluster.decodes[0]
    return Router(
        pd_disaggregation=True,
        prefill=[(p.url, p.bootstrap_port)],
        decode=[d.url],
        dp_aware=True,
        policy="power_of_two",
        p2c_load_metric="least_requests",
        load_monitor_interval=3600.0,
        seed=7,
        **kw,
    )


def _prefill_queues(cluster: SimCluster) -> list[tuple[int, int]]:
    """(requests, input tokens) on each prefill rank, running or queued."""
    eng = cluster.prefills[0].prefill
    return [(r.running + r.waiting, r.tokens + r.wait_tokens) for r in eng.ranks]


async def _large_then_small(demand: str) -> tuple[list[tuple[int, int]], list[int], list[int], int]:
    # The prefill holds each request 60 s (longer than the test), so the queues stay put.
    cluster = await start_cluster(
        1, 1, SimParams(dp_size=8, time_scale=1.0), SimParams(dp_size=8, prefill_base_ms=60_000.0)
    )
    clients: list[Client] = []
    try:
        async with _router(cluster, prefill_input_demand=demand) as r:
            for k, n in enumerate([LARGE] * 4 + [SMALL] * 8):
                clients.append(Client(r.port, n))
                await until(
                    lambda: sum(q for q, _ in _prefill_queues(cluster)) == k + 1, 10.0, "request at the prefill"
                )
            queues = _prefill_queues(cluster)
            await r.server.monitor.poll_once()
            ptargets = list(r.server.registry.find(cluster.prefills[0].url).targets)
            dtargets = list(r.server.registry.find(cluster.decodes[0].url).targets)
            tab = r.server.table.array
            eng = cluster.prefills[0].prefill
            polled = [int(tab[t, COL_POLLED_UNCACHED]) for t in ptargets]
            assert polled == [eng.waiting_uncached(i) for i in range(8)]
            assert [int(tab[t, COL_POLLED_UNCACHED]) for t in dtargets] == [-1] * 8
            g = r.server.registry.group("prefill")
            decided = g.shadow_agree + g.shadow_disagree
            return queues, polled, [int(tab[t, COL_IN_FLIGHT]) for t in ptargets], decided
    finally:
        for c in clients:
            await c.close()
        await cluster.stop()


def test_small_requests_never_queue_behind_a_large_prefill_under_demand() -> None:
    queues, polled, booked, _ = run(_large_then_small("on"), 60.0)
    large = [q for q, tok in queues if tok >= LARGE]
    assert len(large) == 4 and large == [1, 1, 1, 1], queues
    assert sum(q for q, _ in queues) == 12 and booked == [q for q, _ in queues]
    # each small rank holds two small requests, one of them waiting (uncached, reported)
    assert sorted(q for q, tok in queues if tok < LARGE) == [2, 2, 2, 2]
    assert sum(polled) > 0


def test_least_requests_alone_queues_small_requests_behind_large_ones() -> None:
    queues, _, _, decided = run(_large_then_small("off"), 60.0)
    assert sum(q for q, _ in queues) == 12 and decided == 0
    assert any(q > 1 for q, tok in queues if tok >= LARGE), queues
    # shadow dispatches least_requests' picks and counts every decision (its demand pick
    # draws from the same RNG, so the ties fall otherwise than above, not the rule)
    shadow, _, _, decided = run(_large_then_small("shadow"), 60.0)
    assert decided == 12 and any(q > 1 for q, tok in shadow if tok >= LARGE), shadow


def test_prefill_tokens_are_given_back_when_the_prefill_answers() -> None:
    async def body(demand: str) -> tuple[int, int, int, int]:
        # a quick prefill, a decode that streams for long
        cluster = await start_cluster(1, 1, SimParams(dp_size=2, time_scale=3.0), SimParams(dp_size=2, time_scale=0.1))
        client = None
        try:
            async with _router(cluster, prefill_input_demand=demand) as r:
                ptargets = list(r.server.registry.find(cluster.prefills[0].url).targets)
                tab = r.server.table.array
                client = Client(r.port, 5_000)
                await until(lambda: cluster.prefills[0].prefill.completed == 1, 10.0, "prefilled")
                await until(lambda: sum(cluster.decodes[0].decode.placed) == 1, 10.0, "decoding")
                held = (
                    sum(int(tab[t, COL_IN_FLIGHT]) for t in ptargets),
                    sum(int(tab[t, COL_IN_FLIGHT_TOKENS]) for t in ptargets),
                )
                await client.close()
                client = None
                await until(lambda: sum(int(tab[t, COL_IN_FLIGHT]) for t in ptargets) == 0, 10.0, "released")
                after = (
                    sum(int(tab[t, COL_IN_FLIGHT]) for t in ptargets),
                    sum(int(tab[t, COL_IN_FLIGHT_TOKENS]) for t in ptargets),
                )
                assert r.server.table.underflows == 0
                return held + after
        finally:
            if client is not None:
                await client.close()
            await cluster.stop()

    # demand on: the request stays booked (1), its 5,000 tokens went back with the answer
    assert run(body("on"), 60.0) == (1, 0, 0, 0)
    # demand off: as before, both are held until the exchange ends
    assert run(body("off"), 60.0) == (1, 5_000, 0, 0)


def test_a_decode_rank_with_a_prealloc_queue_is_skipped_by_kv_fit() -> None:
    async def body() -> None:
        queue = {
            "mode": "decode",
            "decode_prealloc_queue_reqs": 2,
            "decode_transfer_queue_reqs": 0,
            "decode_retracted_queue_reqs": 0,
        }
        fw = await FakeWorker(dp_size=4, loads=[{}, {}, {"disaggregation": queue}, {}]).start()
        cfg = make_config(
            pd_disaggregation=True,
            dp_aware=True,
            policy="power_of_two",
            p2c_load_metric="least_requests",
            decode_kv_fit="on",
        )
        async with Plane(cfg) as p:
            w = await p.add(fw, "decode")
            await p.monitor.poll_once()
            tab = p.table.array
            free = [_policy.free_kv(tab, t) for t in w.targets]
            # all four report 0 of 100,000 tokens used; rank 2's requests wait for KV anyway
            assert free == [100_000, 100_000, 0, 100_000]
            g = p.registry.group("decode")
            leases = [g.acquire(1_000, None, None, 100) for _ in range(9)]
            assert w.targets[2] not in {lease.target for lease in leases}
            for lease in leases:
                lease.release()
            # the queue drains: the next poll gives the rank its free KV back
            fw.loads[2] = {}
            await p.monitor.poll_once()
            assert _policy.free_kv(tab, w.targets[2]) == 100_000
        await fw.stop()

    run_plain(body)
