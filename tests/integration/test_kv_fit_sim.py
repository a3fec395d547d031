"""KV-fit decode placement end to end: the in-process router (PD, --dp-aware, --decode-kv-fit)
in front of the simulated prefill + decode over loopback sockets.

* the router's free-KV estimate per rank reconciles with the simulator's true free KV: right
  after a poll they agree within the tokens generated since; between polls bookings and
  releases move the estimate by the requests' input tokens; the next poll absorbs the rest;
* a rank that is full (in the simulator, learnt by a poll) is skipped;
* when no rank fits, the rank with the most headroom gets the request (it then waits in that
  rank's prealloc queue, reported in /v1/loads).

Load polls are triggered by the test (``monitor.poll_once``) and the periodic monitor runs once
an hour, so the test decides what the router has seen. Requests stream with long outputs at a
slow step, so they stay on their ranks while the test looks; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastroute.core import _policy
from fastroute.sim.engine import SimParams
from fastroute.sim.http import HttpConnection
from fastroute.sim.worker import SimCluster, start_cluster
from tests.integration.conftest import Router, run, until

H = "127.0.0.1"


def _body(n_in: int, n_out: int) -> bytes:
    # text of 4 * n ASCII bytes weighs n tokens for both the router and the simulator
    return json.dumps({"text": "tok " * n_in, "sampling_params": {"max_new_tokens": n_out}, "stream": True}).encode()


class Client:
    """One streaming request through the router, held open until ``close``."""

    def __init__(self, port: int, n_in: int, n_out: int = 100_000) -> None:
        self.conn = HttpConnection(H, port)
        self.chunks: list[bytes] = []
        self.task = asyncio.ensure_future(
            self.conn.request("POST", "/generate", _body(n_in, n_out), on_chunk=self.chunks.append)
        )

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.conn.close()


async def _setup(cap: int, dp: int) -> tuple[SimCluster, Router]:
    # A slow decode (steps of ~100 ms) so that few tokens are generated while the test reads
    # both sides; a fast prefill so that requests reach their rank quickly.
    params = SimParams(dp_size=dp, max_total_num_tokens=cap, time_scale=3.0)
    cluster = await start_cluster(1, 1, params, SimParams(dp_size=dp, time_scale=0.1))
    p, d = cluster.prefills[0], cluster.decodes[0]
    router = Router(
        pd_disaggregation=True,
        prefill=[(p.url, p.bootstrap_port)],
        decode=[d.url],
        dp_aware=True,
        policy="power_of_two",
        p2c_load_metric="least_requests",
        prefill_policy="round_robin",
        decode_kv_fit="on",
        load_monitor_interval=3600.0,
        seed=7,
    )
    return cluster, router


def _decode_targets(r: Router, cluster: SimCluster) -> list[int]:
    return list(r.server.registry.find(cluster.decodes[0].url).targets)


def _estimates(r: Router, targets: list[int]) -> list[Any]:
    return [_policy.free_kv(r.server.table.array, t) for t in targets]


def _true_free(cluster: SimCluster) -> list[int]:
    eng = cluster.decodes[0].decode
    return [eng.free_kv(i) for i in range(eng.p.dp_size)]


def _placed(cluster: SimCluster) -> list[int]:
    return list(cluster.decodes[0].decode.placed)


def test_free_kv_estimate_reconciles_with_the_engine_between_and_at_polls() -> None:
    async def body() -> None:
        cap, dp = 400_000, 2
        cluster, router = await _setup(cap, dp)
        clients: list[Client] = []
        try:
            async with router as r:
                targets = _decode_targets(r, cluster)
                eng = cluster.decodes[0].decode
                await r.server.monitor.poll_once()
                assert _estimates(r, targets) == [cap] * dp  # polled empty: all free, known
                # Book four requests (2 per rank under least_requests); they run in the sim.
                ins = [30_000, 50_000, 70_000, 90_000]
                for k, n in enumerate(ins):
                    clients.append(Client(r.port, n))
                    await until(lambda: sum(_placed(cluster)) == k + 1, 10.0, "request placed")
                await until(lambda: all(len(rk.running) + len(rk.ready) == 2 for rk in eng.ranks), 10.0, "all running")
                # Between polls the router knows the inputs it booked: the estimate is the true
                # free KV plus exactly what the engine generated since the (empty) poll, which
                # the router does not track. (No await between the reads: one consistent view.)
                est, true = _estimates(r, targets), _true_free(cluster)
                gen = [sum(q.generated for q in rk.running) for rk in eng.ranks]
                assert [e - t for e, t in zip(est, true)] == gen, (est, true, gen)
                assert sum(cap - e for e in est) == sum(ins)
                # A poll folds the generated tokens in: the two agree up to the tokens of the
                # steps since the simulator answered (2 running per rank).
                s0 = eng.steps
                await r.server.monitor.poll_once()
                est, true = _estimates(r, targets), _true_free(cluster)
                for e, t in zip(est, true):
                    assert 0 <= e - t <= 2 * (eng.steps - s0), (est, true, eng.steps - s0)
                # Two finish (client gone): the router releases their input at once; the
                # engine frees input + generated, so until the next poll the estimate may be
                # short by the generated tokens of the finished requests, never long by more
                # than the tokens generated since the poll.
                s0 = eng.steps
                for c in (clients[0], clients[3]):
                    await c.close()
                await until(lambda: sum(len(rk.running) for rk in eng.ranks) == 2, 10.0, "aborted in sim")
                await until(lambda: sum(r.server.table.in_flight(t) for t in targets) == 2, 10.0, "released")
                est, true = _estimates(r, targets), _true_free(cluster)
                for e, t in zip(est, true):
                    assert e is not None and e - t <= 2 * (eng.steps - s0 + 1), (est, true)
                assert sum(cap - e for e in est) >= ins[1] + ins[2]  # still holds the live inputs
                s0 = eng.steps
                await r.server.monitor.poll_once()
                est, true = _estimates(r, targets), _true_free(cluster)
                for e, t in zip(est, true):
                    assert 0 <= e - t <= eng.steps - s0, (est, true)  # one request per rank now
        finally:
            for c in clients:
                await c.close()
            await cluster.stop()

    run(body(), 60.0)


def test_a_full_rank_is_skipped_end_to_end() -> None:
    async def body() -> None:
        cap, dp = 300_000, 4
        cluster, router = await _setup(cap, dp)
        clients: list[Client] = []
        try:
            async with router as r:
                targets = _decode_targets(r, cluster)
                eng = cluster.decodes[0].decode
                await r.server.monitor.poll_once()
                # The rank that gets a 250k-token request is nearly full.
                clients.append(Client(r.port, 250_000, 40_000))
                await until(lambda: sum(_placed(cluster)) == 1, 10.0, "big request placed")
                full = _placed(cluster).index(1)
                await until(lambda: eng.ranks[full].running, 10.0, "big request running")
                await r.server.monitor.poll_once()
                assert _estimates(r, targets)[full] <= cap - 250_000
                # Two small requests on every other rank (10k input + 100k output do not fit
                # the full rank either), so the full rank is the one least_requests would pick.
                for k in range(2 * (dp - 1)):
                    clients.append(Client(r.port, 10_000))
                    await until(lambda: sum(_placed(cluster)) == k + 2, 10.0, "placed")
                before = _placed(cluster)
                assert before[full] == 1 and all(n == 2 for i, n in enumerate(before) if i != full), before
                ins_flight = [r.server.table.in_flight(t) for t in targets]
                assert min(ins_flight) == ins_flight[full] == 1
                # 60k requests: the fewest in flight is the full rank, but 60k does not fit there.
                for k in range(6):
                    clients.append(Client(r.port, 60_000, 10))
                    await until(lambda: sum(_placed(cluster)) == 2 * dp + k, 10.0, "placed")
                after = _placed(cluster)
                assert after[full] == 1, after
                assert sum(after) == 2 * dp - 1 + 6
        finally:
            for c in clients:
                await c.close()
            await cluster.stop()

    run(body(), 60.0)


def test_no_rank_fits_falls_back_to_the_most_headroom() -> None:
    async def body() -> None:
        cap, dp = 200_000, 3
        cluster, router = await _setup(cap, dp)
        clients: list[Client] = []
        try:
            async with router as r:
                targets = _decode_targets(r, cluster)
                eng = cluster.decodes[0].decode
                await r.server.monitor.poll_once()
                # Ranks end up with 150k (1 request), 40k + 40k (2) and 170k (1): the two
                # 40k share a rank because the second fits nowhere else.
                for k, n in enumerate([150_000, 40_000, 170_000, 40_000]):
                    clients.append(Client(r.port, n, 20_000))
                    await until(lambda: sum(_placed(cluster)) == k + 1, 10.0, "placed")
                await until(lambda: sum(len(rk.running) for rk in eng.ranks) == 4, 10.0, "running")
                two = _placed(cluster).index(2)
                assert sorted(q.input_tokens for q in eng.ranks[two].running) == [40_000, 40_000]
                await r.server.monitor.poll_once()
                est = _estimates(r, targets)
                assert max(range(dp), key=lambda i: est[i]) == two  # ~120k free vs ~50k and ~30k
                # 130k fits nowhere. least_requests alone would pick a rank with 1 in flight;
                # the fallback takes the most headroom, where it waits in the prealloc queue
                # (the engine also holds back the 40k requests' outputs).
                clients.append(Client(r.port, 130_000, 10))
                await until(lambda: sum(_placed(cluster)) == 5, 10.0, "placed")
                assert _placed(cluster)[two] == 3, _placed(cluster)
                await until(lambda: len(eng.ranks[two].prealloc) == 1, 10.0, "parked in prealloc")
                loads = cluster.decodes[0].loads_json({"core", "disagg"}, two)["loads"][0]
                assert loads["disaggregation"]["decode_prealloc_queue_reqs"] == 1
                assert loads["num_waiting_reqs"] == 1 and loads["num_running_reqs"] == 2
        finally:
            for c in clients:
                await c.close()
            await cluster.stop()

    run(body(), 60.0)
