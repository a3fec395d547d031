"""Per-request latency targets (llm-d's x-slo-ttft-ms / x-slo-tpot-ms) end to end: the in-process
router (PD, --dp-aware, --speed-aware on) in front of a simulated prefill and two simulated DP-2
decode servers, one 1.6 times slower, over loopback sockets.

* a TPOT target only the fast server meets sends the request there; a loose one that both meet
  goes to the slow server (the tightest fit keeps the fast one's headroom);
* with --speed-slo-unmet refuse, a target no server can meet is answered 503 slo_unattainable with
  Retry-After before any pick, and nothing stays booked; a malformed target is a 400;
* streams that carried a target are counted met or missed when they end (/get_loads).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastroute.sim.engine import SimParams
from fastroute.sim.http import HttpConnection
from fastroute.sim.worker import start_cluster
from tests.integration.conftest import Router, run, until

H = "127.0.0.1"
DP = 2


def _body(n_out: int) -> bytes:
    return json.dumps({"text": "tok " * 8, "sampling_params": {"max_new_tokens": n_out}, "stream": True}).encode()


class Client:
    def __init__(self, port: int, n_out: int = 100_000, headers: dict[str, str] | None = None) -> None:
        self.conn = HttpConnection(H, port)
        self.chunks: list[bytes] = []
        self.status = 0
        self.task = asyncio.ensure_future(
            self.conn.request("POST", "/generate", _body(n_out), headers, on_chunk=self.chunks.append)
        )

    async def close(self) -> None:
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)
        self.conn.close()


async def _get_json(port: int, path: str) -> Any:
    conn = HttpConnection(H, port)
    try:
        status, _, body = await conn.request("GET", path, b"")
    finally:
        conn.close()
    assert status == 200
    return json.loads(body)


async def _scenario() -> dict[str, Any]:
    fast = SimParams(dp_size=DP)
    slow = SimParams(dp_size=DP, speed_factor=1.6)
    cluster = await start_cluster(1, 2, fast, SimParams(dp_size=DP, time_scale=0.1), decode_params=[fast, slow])
    p = cluster.prefills[0]
    clients: list[Client] = []
    out: dict[str, Any] = {}
    try:
        async with Router(
            pd_disaggregation=True,
            prefill=[(p.url, p.bootstrap_port)],
            decode=[d.url for d in cluster.decodes],
            dp_aware=True,
            policy="power_of_two",
            p2c_load_metric="least_requests",
            prefill_policy="round_robin",
            speed_aware="on",
            speed_slo_unmet="refuse",
            load_monitor_interval=3600.0,
            seed=47,
        ) as r:
            book = r.server.registry.router.speed
            urls = [d.url for d in cluster.decodes]

            def running() -> list[int]:
                return [sum(ld[0] for ld in d.decode.rank_loads()) for d in cluster.decodes]

            for _ in range(4):  # one per rank, spread before any fit exists
                clients.append(Client(r.port))
                await asyncio.sleep(0.05)
            await until(lambda: running() == [2, 2], 10.0, "first streams decoding")
            await until(lambda: all(book.predict(u, 1) is not None for u in urls), 10.0, "both servers measured")
            # 40 ms: the fast server (~33 ms with one more) meets it, the slow one (~50 ms) does not.
            before = running()
            clients.append(Client(r.port, headers={"x-slo-tpot-ms": "40"}))
            await until(lambda: sum(running()) == sum(before) + 1, 10.0, "strict stream decoding")
            out["strict"] = [a - b for a, b in zip(running(), before)]
            # 60 ms: both meet it; the tightest fit is the slow server.
            before = running()
            clients.append(Client(r.port, headers={"X-SLO-TPOT-MS": "60"}))
            await until(lambda: sum(running()) == sum(before) + 1, 10.0, "loose stream decoding")
            out["loose"] = [a - b for a, b in zip(running(), before)]
            # 5 ms: nobody can; refused before any pick.
            held = [r.server.table.in_flight(t) for t in range(8)]
            conn = HttpConnection(H, r.port)
            try:
                status, headers, body = await conn.request("POST", "/generate", _body(8), {"x-slo-tpot-ms": "5"})
                out["refused"] = (status, headers, json.loads(body))
                status, _, body = await conn.request("POST", "/generate", _body(8), {"x-slo-ttft-ms": "soon"})
                out["malformed"] = (status, json.loads(body))
            finally:
                conn.close()
            out["held_same"] = held == [r.server.table.in_flight(t) for t in range(8)]
            # Short streams with a target the fast server meets are counted when they end.
            short = [Client(r.port, n_out=30, headers={"x-slo-tpot-ms": "45"}) for _ in range(3)]
            await asyncio.gather(*(c.task for c in short))
            for c in short:
                c.conn.close()
            loads = await _get_json(r.port, "/get_loads")
            out["slo"] = loads["speed"]["slo"]
    finally:
        for c in clients:
            await c.close()
        await cluster.stop()
    return out


def test_slo_targets_place_refuse_and_count() -> None:
    out = run(_scenario(), 45.0)
    assert out["strict"] == [1, 0]  # only the fast server meets 40 ms
    assert out["loose"] == [0, 1]  # both meet 60 ms: the slow one is the tightest fit
    status, headers, body = out["refused"]
    assert status == 503 and body["error"]["code"] == "slo_unattainable"
    assert headers.get(b"retry-after") == b"1"
    assert out["held_same"]  # nothing booked by the refused request
    status, body = out["malformed"]
    assert status == 400 and "x-slo-ttft-ms" in body["error"]["message"]
    tpot = out["slo"]["tpot"]
    assert tpot["refused"] == 1 and tpot["placed"] >= 5
    assert tpot.get("met", 0) + tpot.get("missed", 0) == 3 and tpot.get("met", 0) >= 2
