"""Per-rank-port servers (SGLang's Rust HTTP server layout) end to end over loopback sockets.

The simulated servers listen on one port per DP rank (base port + rank) and run every request
on the rank of the port it arrived at, so where a request ran shows where the router sent it.

* regular mode: the router, given any one rank's URL, registers all the ranks and sends each
  request to the port of the rank it picked;
* least_requests spreads 16 held streams over a DP-8 per-rank-port decode 2 per rank, and the
  in-flight counts return to 0 once the clients go;
* PD through a per-rank-port prefill and decode: each prefill rank's port gets its requests,
  and the decode is told the prefill rank (the simulated decode refuses a wrong one);
* a rank port that goes down turns its rank unhealthy alone, the other ranks keep serving;
* POST /workers with one rank URL registers all the ranks (a second rank URL is a duplicate),
  and a deployment_info that cannot be a layout fails the registration with its reason;
* prefill input demand keeps small requests off the prefill ranks holding large ones, through a
  per-rank-port prefill (the classic-layout version is in test_prefill_demand);
* Kubernetes discovery: each pod serving rank ports is one worker with all its ranks, and
  leaves with all of them;
* under ``--workers 2`` every proxy process sends to the rank ports (the snapshot carries them).
"""

from __future__ import annotations

import json

import pytest

from fastroute.config import Config
from fastroute.core.table import COL_HEALTHY
from fastroute.runtime.server import Server
from fastroute.sim.engine import SimParams
from fastroute.sim.http import fetch
from fastroute.sim.server import SimWorker
from fastroute.sim.worker import start_cluster
from tests.integration.conftest import DataWorker, Router, call, get, post, run, until
from tests.integration.kubeapi import KubeApi, pod
from tests.integration.test_multiproc import MultiRouter, views_current
from tests.integration.test_prefill_demand import LARGE, SMALL, Client, _prefill_queues, _router

H = "127.0.0.1"


def _gen(n_out: int = 2) -> bytes:
    return json.dumps({"text": "hello world", "sampling_params": {"max_new_tokens": n_out}}).encode()


async def _regular(dp: int = 4) -> SimWorker:
    w = SimWorker("regular", SimParams(dp_size=dp, time_scale=0.01), H, rank_ports=True)
    await w.start()
    return w


def test_requests_go_to_the_port_of_the_picked_rank() -> None:
    async def body() -> None:
        w = await _regular(4)
        try:
            # Rank 2's URL is enough: the router finds the other three ports.
            async with Router(worker_urls=[w.rank_url(2)], policy="round_robin") as r:
                reg = r.server.registry
                (worker,) = reg.workers
                assert worker.url == w.url and worker.names == [w.rank_url(i) for i in range(4)]
                assert reg.find(w.rank_url(3)) is worker
                for _ in range(8):
                    status, _ = await fetch(H, r.port, "POST", "/generate", _gen())
                    assert status == 200
                assert w.port_requests == [2, 2, 2, 2]
                assert w.decode is not None and w.decode.placed == [2, 2, 2, 2]
                st, doc = await fetch(H, r.port, "GET", "/workers")
                (entry,) = json.loads(doc)["workers"]
                assert [d["url"] for d in entry["dp_ranks"]] == worker.names
                assert entry["rank_ports"] is True
        finally:
            await w.stop()

    run(body(), 30.0)


def test_least_requests_spreads_held_streams_two_per_rank_port() -> None:
    async def body() -> None:
        cluster = await start_cluster(
            1, 1, SimParams(dp_size=8, time_scale=1.0), SimParams(dp_size=8, time_scale=0.01), rank_ports=True
        )
        p, d = cluster.prefills[0], cluster.decodes[0]
        clients: list[Client] = []
        try:
            async with Router(
                pd_disaggregation=True,
                prefill=[(p.url, None)],
                decode=[d.url],
                policy="power_of_two",
                p2c_load_metric="least_requests",
                load_monitor_interval=3600.0,
                seed=7,
            ) as r:
                for _ in range(16):
                    clients.append(Client(r.port, SMALL))
                assert d.decode is not None
                await until(lambda: sum(d.port_requests) == 16, 10.0, "16 streams at the decode")
                assert d.port_requests == [2] * 8
                assert d.decode.placed == [2] * 8  # each ran on its port's rank
                assert r.rank_in_flight(d) == [2] * 8
                for c in clients:
                    await c.close()
                clients = []
                await until(
                    lambda: r.rank_in_flight(d) == [0] * 8 and r.rank_in_flight(p) == [0] * 8,
                    10.0,
                    "in-flight back to 0",
                )
        finally:
            for c in clients:
                await c.close()
            await cluster.stop()

    run(body(), 60.0)


def test_pd_through_per_rank_port_prefill_and_decode() -> None:
    async def body() -> None:
        cluster = await start_cluster(1, 1, SimParams(dp_size=4, time_scale=0.01), rank_ports=True)
        p, d = cluster.prefills[0], cluster.decodes[0]
        try:
            async with Router(
                pd_disaggregation=True, prefill=[(p.rank_url(1), None)], decode=[d.rank_url(3)], policy="round_robin"
            ) as r:
                pw = r.server.registry.find(p.url)
                assert pw is not None and pw.bootstrap_port == p.port  # served on the API port
                for _ in range(16):
                    status, out = await fetch(H, r.port, "POST", "/generate", _gen())
                    assert status == 200, out
                assert p.port_requests == [4] * 4 and d.port_requests == [4] * 4
                assert d.wrong_prefill_rank == 0
                # the decode body names the prefill rank whose port computed the room
                _, last = d.last_bodies[-1]
                sent = json.loads(last)
                assert sent["bootstrap_port"] == p.port
                assert sent["bootstrap_room"] % 4 == sent["disagg_prefill_dp_rank"]
        finally:
            await cluster.stop()

    run(body(), 30.0)


def test_a_rank_port_that_goes_down_is_unhealthy_alone() -> None:
    async def body() -> None:
        w = await _regular(4)
        try:
            async with Router(
                worker_urls=[w.url], policy="round_robin", health_failure_threshold=1, health_success_threshold=1
            ) as r:
                reg, tab, mon = r.server.registry, r.server.table, r.server.monitor
                (worker,) = reg.workers
                await w.stop_rank(2)
                await mon.check_once()
                assert [tab.get(t, COL_HEALTHY) for t in worker.targets] == [1, 1, 0, 1]
                assert worker.healthy and reg.ready()
                before = list(w.port_requests)
                for _ in range(9):
                    status, _ = await fetch(H, r.port, "POST", "/generate", _gen())
                    assert status == 200
                got = [a - b for a, b in zip(w.port_requests, before)]
                assert got == [3, 3, 0, 3], got
                st, doc = await fetch(H, r.port, "GET", "/workers")
                ranks = json.loads(doc)["workers"][0]["dp_ranks"]
                assert [x["is_healthy"] for x in ranks] == [True, True, False, True]
                await w.start_rank(2)
                await mon.check_once()
                assert all(tab.get(t, COL_HEALTHY) for t in worker.targets)
        finally:
            await w.stop()

    run(body(), 30.0)


def test_post_workers_with_one_rank_url_registers_every_rank() -> None:
    async def body() -> None:
        a, b = await _regular(2), await _regular(4)
        try:
            async with Router(worker_urls=[a.url], policy="round_robin") as r:
                reg = r.server.registry
                resp = await call(r.port, post("/workers", {"url": b.rank_url(3)}))
                assert resp.status == 202, resp.body
                await until(
                    lambda: reg.find(b.url) is not None and reg.find(b.url).status == "ready", 10.0, "b registered"
                )
                wb = reg.find(b.url)
                assert wb.url == b.url and len(wb.targets) == 4
                assert wb.names == [b.rank_url(i) for i in range(4)]
                # another rank's URL is the same server
                again = await call(r.port, post("/workers", {"url": b.rank_url(1)}))
                assert again.status == 409, again.body
                # the two servers' six ranks share the traffic through their own ports
                for _ in range(12):
                    status, _ = await fetch(H, r.port, "POST", "/generate", _gen())
                    assert status == 200
                assert a.port_requests == [2, 2] and b.port_requests == [2] * 4
                resp = await call(r.port, get("/workers"))
                urls = [x["url"] for x in resp.json["workers"]]
                assert urls == [a.url, b.url]
        finally:
            await a.stop()
            await b.stop()

    run(body(), 30.0)


class _BadLayout(DataWorker):
    """A worker whose /server_info names a rank outside its dp_size."""

    def control(self, path: str) -> tuple[int, bytes] | None:
        if path.startswith("/server_info"):
            return 200, json.dumps({"dp_size": 4, "deployment_info": {"dp_size": 4, "dp_rank": 9}}).encode()
        return super().control(path)


def test_a_deployment_info_that_cannot_be_a_layout_fails_registration() -> None:
    async def body() -> None:
        good = await _regular(2)
        bad = await _BadLayout().start()
        try:
            async with Router(worker_urls=[good.url], policy="round_robin") as r:
                reg = r.server.registry
                resp = await call(r.port, post("/workers", {"url": bad.url}))
                assert resp.status == 202, resp.body
                wid = resp.json["worker_id"]
                await until(lambda: reg.get(wid) is None, 10.0, "registration failed")
                assert [w.url for w in reg.workers] == [good.url]
                # no rows were taken for it
                assert sum(1 for e in reg.target_info if e is not None) == 2
        finally:
            await bad.stop()
            await good.stop()

    run(body(), 30.0)


def test_small_requests_never_share_a_rank_port_with_a_large_prefill() -> None:
    async def body() -> list[tuple[int, int]]:
        cluster = await start_cluster(
            1, 1, SimParams(dp_size=8, time_scale=1.0), SimParams(dp_size=8, prefill_base_ms=60_000.0), rank_ports=True
        )
        clients: list[Client] = []
        try:
            async with _router(cluster, prefill_input_demand="on") as r:
                for k, n in enumerate([LARGE] * 4 + [SMALL] * 8):
                    clients.append(Client(r.port, n))
                    await until(
                        lambda: sum(q for q, _ in _prefill_queues(cluster)) == k + 1, 10.0, "request at the prefill"
                    )
                assert sum(cluster.prefills[0].port_requests) == 12
                return _prefill_queues(cluster)
        finally:
            for c in clients:
                await c.close()
            await cluster.stop()

    queues = run(body(), 60.0)
    large = [q for q, tok in queues if tok >= LARGE]
    assert large == [1, 1, 1, 1], queues
    assert sorted(q for q, tok in queues if tok < LARGE) == [2, 2, 2, 2], queues


async def _pod_sims(ips: list[str], dp: int) -> list[SimWorker]:
    """Per-rank-port regular servers on the loopback addresses ``ips`` (pod IPs), all on the
    same base port (discovery has one port for every pod)."""
    for _ in range(20):
        first = SimWorker("regular", SimParams(dp_size=dp, time_scale=0.01), ips[0], rank_ports=True)
        await first.start()
        out = [first]
        try:
            for ip in ips[1:]:
                w = SimWorker("regular", SimParams(dp_size=dp, time_scale=0.01), ip, first.port, rank_ports=True)
                await w.start()
                out.append(w)
            return out
        except OSError:
            for w in out:
                await w.stop()
    raise RuntimeError("no common free run of ports on the loopback addresses")


@pytest.fixture
def kubeconfig(tmp_path, monkeypatch):
    path = tmp_path / "kubeconfig"
    monkeypatch.setenv("KUBECONFIG", str(path))
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    return path


def test_kubernetes_pods_serving_rank_ports_become_one_worker_each(kubeconfig) -> None:
    async def body() -> None:
        api = await KubeApi().start()
        a, b = sims = await _pod_sims(["127.0.0.2", "127.0.0.3"], 4)
        kubeconfig.write_text(api.kubeconfig())
        await api.put(pod("a", a.host))
        await api.put(pod("b", b.host))
        server = Server(
            Config(
                host="127.0.0.1",
                port=0,
                policy="round_robin",
                worker_startup_check_interval=1,
                disable_health_check=True,
                shutdown_grace_period_secs=1,
                prometheus_host="127.0.0.1",
                prometheus_port=0,
                service_discovery=True,
                selector=["app=sglang"],
                service_discovery_namespace="team-a",
                service_discovery_port=a.port,
                discovery_check_interval_secs=30,
            )
        )
        await server.start()
        try:
            reg = server.registry
            await until(
                lambda: sorted(w.url for w in reg.workers if w.status == "ready") == [a.url, b.url],
                10.0,
                "both pods registered",
            )
            assert all(len(w.targets) == 4 for w in reg.workers)
            for _ in range(16):
                status, _ = await fetch(H, server.port, "POST", "/generate", _gen())
                assert status == 200
            assert a.port_requests == [2] * 4 and b.port_requests == [2] * 4
            # the pod goes: its server leaves with every rank
            await api.delete("team-a", "a")
            await until(lambda: [w.url for w in reg.workers] == [b.url], 10.0, "a removed")
            assert reg.find(a.rank_url(2)) is None
            for _ in range(4):
                status, _ = await fetch(H, server.port, "POST", "/generate", _gen())
                assert status == 200
            assert a.port_requests == [2] * 4 and b.port_requests == [3] * 4
        finally:
            await server.stop(grace=0.5)
            await api.stop()
            for w in sims:
                await w.stop()

    run(body(), 60.0)


def test_every_proxy_process_sends_to_the_rank_ports() -> None:
    async def body() -> None:
        w = await _regular(4)
        try:
            async with MultiRouter("--worker-urls", w.rank_url(1), "--policy", "round_robin") as r:
                await r.until_metric(views_current, 10.0, "both views current")
                for _ in range(16):
                    res = await call(r.port, post("/generate", {"text": "hi"}, keep_alive=False))
                    assert res.status == 200, res.body
                assert sum(w.port_requests) == 16 and all(n > 0 for n in w.port_requests), w.port_requests
                res = await call(r.port, get("/get_loads"))
                names = [e["name"] for e in res.json["loads"]]
                assert names == [w.rank_url(i) for i in range(4)]
        finally:
            await w.stop()

    run(body(), 60.0)
