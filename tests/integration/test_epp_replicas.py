"""``fastroute epp --replica-sync``: a picker shares its in-flight counts through a real
redis-server with another picker and with a proxy replica, exactly as proxy replicas do.

A DP-8 fake worker; the picker's EppServer and a proxy Server run in this event loop, each with
its own target table; the picker's picks are asked over its real gRPC ext_proc listener (the
streams stay open, so their bookings hold until the test ends them)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

pytest.importorskip("grpc")
pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")

import grpc  # noqa: E402
from envoy.config.core.v3 import base_pb2  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc  # noqa: E402

from fastroute.config import Config  # noqa: E402
from fastroute.epp.server import EppServer  # noqa: E402
from tests.integration.conftest import DataWorker, run, until, workers  # noqa: E402
from tests.integration.envoy_harness import free_port  # noqa: E402
from tests.integration.redis_fixture import redis_server  # noqa: E402,F401  (the fixture)
from tests.integration.test_replicas import SYNC, TTL_MS, TURN, others, ranks, replica, send_held  # noqa: E402


async def start_epp(worker: DataWorker, redis_url: str, replica_id: str) -> EppServer:
    cfg = Config(
        host="127.0.0.1",
        worker_urls=[worker.url],
        worker_startup_check_interval=1,
        disable_health_check=True,
        shutdown_grace_period_secs=1,
        prometheus_host="127.0.0.1",
        prometheus_port=0,
        dp_rank_field="data_parallel_rank",
        replica_sync=redis_url,
        replica_id=replica_id,
        **SYNC,
    )
    server = EppServer(cfg, free_port())
    await server.start()
    await until(server.ready, 10, "picker ready")
    return server


class Held:
    """One request held open on the picker's ext_proc stream: its booking lasts until close."""

    def __init__(self, server: EppServer) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}")
        self.call: Any = None
        self.rank = -1

    async def pick(self, text: str) -> Held:
        self.call = pb_grpc.ExternalProcessorStub(self.channel).Process()
        hm = pb.HttpHeaders(end_of_stream=False)
        for k, v in {":method": "POST", ":path": "/generate", ":authority": "gw"}.items():
            hm.headers.headers.append(base_pb2.HeaderValue(key=k, raw_value=v.encode()))
        await self.call.write(pb.ProcessingRequest(request_headers=hm))
        ans = await asyncio.wait_for(self.call.read(), 5)
        assert ans.WhichOneof("response") == "request_headers", ans
        body = json.dumps({"text": text}).encode()
        await self.call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
        ans = await asyncio.wait_for(self.call.read(), 5)
        assert ans.WhichOneof("response") == "request_body", ans
        self.rank = json.loads(ans.request_body.response.body_mutation.body)["data_parallel_rank"]
        return self

    async def close(self) -> None:
        self.call.cancel()  # the ext_proc stream dies: the picker releases the booking
        await self.channel.close()


def in_flight(server: EppServer) -> int:
    return sum(server.table.in_flight(t) for wk in server.registry.workers for t in wk.targets)


def test_a_synced_picker_and_a_proxy_replica_fill_the_ranks_as_one(redis_server: Any) -> None:
    async def body() -> None:
        (w,) = await workers(1, dp_size=8)
        epp = await start_epp(w, redis_server.url, "picker-A")
        held: list[Held] = []
        clients: list[Any] = []
        try:
            async with replica(w, redis_server.url, replica_id="proxy-B") as b:
                await until(lambda: b.server.replica.peers == 1, 10, "the proxy sees the picker")
                await until(lambda: epp.replica is not None and epp.replica.peers == 1, 10, "and back")
                for i in range(3):
                    if i:
                        await asyncio.sleep(TURN)
                    held.append(await Held(epp).pick(f"picker {i}"))
                assert in_flight(epp) == 3
                await until(lambda: others(b) == 3, 5, "the proxy sees the picker's 3 bookings")
                w.hold()
                clients = await send_held(b.port, 5, TURN)
                await until(lambda: w.held == 5, 5, "the proxy's 5 requests held")
                placed = [h.rank for h in held] + ranks(w)
                assert sorted(placed) == list(range(8)), placed  # one per rank, as one router would

                # The picker's streams end: its bookings leave the proxy's view.
                for h in held:
                    await h.close()
                held = []
                await until(lambda: in_flight(epp) == 0, 5, "the picker released its bookings")
                await until(lambda: others(b) == 0, 5, "the proxy sees them gone")
                await until(lambda: others(epp_as_router(epp)) == 5, 5, "the picker sees the proxy's 5")
                w.release()

                # A stopping picker withdraws its entry: the proxy drops it at once, not after the TTL.
                await epp.stop(grace=0.5)
                await until(lambda: b.server.replica.peers == 0, TTL_MS / 2000, "the picker withdrew")
        finally:
            for h in held:
                await h.close()
            for c in clients:
                c.close()
            await epp.stop(grace=0.5)

    run(body(), timeout=60)


class epp_as_router:  # noqa: N801  (others() reads .server.table and .server.registry)
    def __init__(self, epp: EppServer) -> None:
        self.server = epp


def test_a_picker_with_redis_gone_still_picks_from_its_own_counts(redis_server: Any) -> None:
    async def body() -> None:
        (w,) = await workers(1, dp_size=8)
        epp = await start_epp(w, redis_server.url, "picker-A")
        held: list[Held] = []
        try:
            redis_server.stop()
            await asyncio.sleep(TTL_MS / 1000 + 0.3)
            for i in range(8):
                held.append(await Held(epp).pick(f"alone {i}"))
            assert sorted(h.rank for h in held) == list(range(8))
            assert epp.replica is not None and epp.replica.peers == 0
            for h in held:
                await h.close()
            held = []
            await until(lambda: in_flight(epp) == 0, 5, "every booking released")
        finally:
            for h in held:
                await h.close()
            await epp.stop(grace=0.5)

    run(body(), timeout=60)
