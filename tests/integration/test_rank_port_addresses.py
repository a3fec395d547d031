"""Rank-port addresses pass the checks of ``POST /workers`` (issue 50, item 2), over loopback.

A per-rank-port server's other rank URLs are derived from one port's ``/server_info``, at
registration and again when its dp_size grows. A server whose layout reaches one of the
router's own listeners is refused with that reason before the router calls it (else the router
would become its own worker), and a grown layout that reaches another registered worker's port
is refused while the server keeps the ranks it had.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random

import pytest

from tests.integration.conftest import DataWorker, Router, _WorkerConn, call, post, run, until

H = "127.0.0.1"


class _RankPort(DataWorker):
    """One rank port of a simulated per-rank-port server: its /server_info says which rank of
    which dp_size it serves (rank None: a plain worker; ``layout`` is shared by the server's ports, so a restart with
    another dp_size changes what every port reports)."""

    def __init__(self, rank: int | None, layout: dict[str, int]) -> None:
        super().__init__()
        self.rank = rank
        self.layout = layout

    def control(self, path: str) -> tuple[int, bytes] | None:
        if self.rank is not None and path.startswith(("/server_info", "/get_server_info")):
            dp = self.layout["dp_size"]
            info = {
                "model_path": "/models/fake-model",
                "dp_size": dp,
                # layout may say nnodes / node_rank too (the defaults: one node)
                "deployment_info": {"nnodes": 1, "node_rank": 0, **self.layout, "dp_rank": self.rank},
            }
            return 200, json.dumps(info).encode()
        return super().control(path)

    async def start_at(self, port: int) -> _RankPort:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _WorkerConn(self), H, port)
        self.port = port
        return self


async def _consecutive(n: int, make: list[_RankPort]) -> int:
    """Start ``make[i]`` on base + i for a free run of ``n`` ports; -> base."""
    rng = random.Random()
    for _ in range(50):
        base = rng.randrange(20000, 32000 - n)
        started: list[_RankPort] = []
        try:
            for i, w in enumerate(make[:n]):
                started.append(await w.start_at(base + i))
            return base
        except OSError:
            for w in started:
                await w.stop()
    raise AssertionError("no free run of consecutive ports")


def test_rank_ports_that_reach_the_router_are_refused(caplog: pytest.LogCaptureFixture) -> None:
    """A server on the port beside the router's says it is rank 1 of 2: its rank 0 port would
    be the router itself. It is refused at once with that reason, and the router never calls
    its own port as a worker."""
    caplog.set_level(logging.INFO, logger="fastroute")

    async def body() -> None:
        (good,) = [await DataWorker().start()]
        async with Router(worker_urls=[good.url], worker_startup_timeout_secs=20) as r:
            reg = r.server.registry
            layout = {"dp_size": 2}
            hostile = None
            for rank, port in ((1, r.port + 1), (0, r.port - 1)):
                try:
                    hostile = await _RankPort(rank, layout).start_at(port)
                    break
                except OSError:
                    continue
            if hostile is None:
                pytest.skip("both ports beside the router's are taken")
            try:
                res = await call(r.port, post("/workers", {"url": hostile.url}))
                assert res.status == 202, res.body
                w = reg.get(res.json["worker_id"])
                assert w is not None
                # Refused for good well before --worker-startup-timeout-secs (20 s).
                await until(lambda: w.status == "failed", 5.0, "the registration refused")
                assert "this router itself" in (w.error or ""), w.error
                assert f"{H}:{r.port}" in (w.error or ""), w.error
                assert [x.url for x in reg.workers] == [good.url]
                assert sum(1 for e in reg.target_info if e is not None) == 1
            finally:
                await hostile.stop()
        await good.stop()

    run(body(), 40.0)
    assert any("failed to register" in m and "this router itself" in m for m in caplog.messages), caplog.messages


def test_a_grown_layout_onto_another_workers_port_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    """A DP-2 per-rank-port server on ports B, B+1 and a worker on B+2: the server restarts with
    dp_size 4, whose rank 2 would be the other worker's port. The grown layout is refused (and
    logged); the server keeps its two ranks and the other worker keeps its own."""
    caplog.set_level(logging.INFO, logger="fastroute")

    async def body() -> None:
        layout = {"dp_size": 2}
        other = _RankPort(None, layout)  # a plain worker: its /server_info names no rank
        ports = [_RankPort(0, layout), _RankPort(1, layout), other]
        base = await _consecutive(3, ports)
        try:
            async with Router(worker_urls=[f"http://{H}:{base}", other.url]) as r:
                reg = r.server.registry
                await until(lambda: len(reg.ready_workers()) == 2, 10.0, "both registered")
                srv = reg.find(f"http://{H}:{base}")
                assert srv is not None and srv.rank_ports and len(srv.targets) == 2
                layout["dp_size"] = 4  # a restart with --dp-size 4
                reg.recheck_dp(srv, "test restart")
                assert srv.dp_task is not None
                await srv.dp_task
                assert len(srv.targets) == 2 and srv.dp_size == 2
                assert srv.rank_urls == [f"http://{H}:{base}", f"http://{H}:{base + 1}"]
                assert reg.find(other.url) is not srv and reg.find(other.url).url == other.url
                # Requests still reach each of them.
                for _ in range(6):
                    assert (await call(r.port, post("/generate", {"text": "x"}))).status == 200
                assert len(other.inference()) == 2
        finally:
            for p in ports:
                await p.stop()

    run(body(), 40.0)
    assert any("is already worker" in m and "keeping its 2 ranks" in m for m in caplog.messages), caplog.messages


@pytest.mark.parametrize(
    "layout, reason",
    [
        ({"dp_size": 4, "nnodes": 0}, "nnodes 0: not a number of nodes"),
        ({"dp_size": 4, "nnodes": 2, "node_rank": 2}, "node_rank 2: not a node of nnodes 2"),
        ({"dp_size": 4, "nnodes": 2, "node_rank": -1}, "node_rank -1: not a node of nnodes 2"),
        ({"dp_size": 6, "nnodes": 4, "node_rank": 0}, "do not split evenly"),
    ],
    ids=["nnodes-0", "node-rank-past-the-nodes", "node-rank-negative", "uneven"],
)
def test_a_layout_that_cannot_be_is_refused_with_its_reason(layout: dict[str, int], reason: str) -> None:
    """A per-rank-port server whose deployment_info cannot be a layout fails registration at
    once, and the reason names what is wrong (nnodes 0 is not read as 1)."""

    async def body() -> None:
        good = await DataWorker().start()
        bad = await _RankPort(0, layout).start()
        try:
            async with Router(worker_urls=[good.url], worker_startup_timeout_secs=20) as r:
                res = await call(r.port, post("/workers", {"url": bad.url}))
                assert res.status == 202, res.body
                w = r.server.registry.get(res.json["worker_id"])
                assert w is not None
                await until(lambda: w.status == "failed", 5.0, "the registration refused")
                assert reason in (w.error or ""), w.error
        finally:
            await bad.stop()
            await good.stop()

    run(body(), 30.0)
