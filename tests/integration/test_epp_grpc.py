"""The picker's gRPC listener as a hostile or careless client meets it: over real sockets, the
EppServer in this event loop and a fake worker, the client a grpc.aio channel of the test."""

from __future__ import annotations

import asyncio
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


async def start_epp(worker: DataWorker, **kw: Any) -> EppServer:
    cfg = Config(
        host="127.0.0.1",
        worker_urls=[worker.url],
        worker_startup_check_interval=1,
        disable_health_check=True,
        shutdown_grace_period_secs=1,
        prometheus_host="127.0.0.1",
        prometheus_port=0,
        **kw,
    )
    server = EppServer(cfg, free_port())
    await server.start()
    await until(server.ready, 10, "picker ready")
    return server


def headers_msg(eos: bool = False, **extra: str) -> Any:
    hm = pb.HttpHeaders(end_of_stream=eos)
    for k, v in {":method": "POST", ":path": "/generate", ":authority": "gw", **extra}.items():
        hm.headers.headers.append(base_pb2.HeaderValue(key=k, raw_value=v.encode()))
    return pb.ProcessingRequest(request_headers=hm)


def in_flight(server: EppServer) -> int:
    return sum(server.table.in_flight(t) for wk in server.registry.workers for t in wk.targets)


def test_a_streamed_body_is_refused_as_soon_as_it_passes_the_limit() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        epp = await start_epp(w, policy="cache_aware", max_payload_size=1 << 20)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.grpc_port}") as ch:
                call = pb_grpc.ExternalProcessorStub(ch).Process()
                await call.write(headers_msg())  # no Content-Length: nothing to judge yet
                ans = await asyncio.wait_for(call.read(), 5)
                assert ans.WhichOneof("response") == "request_headers"
                piece = b"x" * (64 << 10)
                answers = []
                for _ in range(32):  # 2 MiB offered in 64 KiB messages, never end_of_stream
                    await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=piece)))
                    ans = await asyncio.wait_for(call.read(), 5)
                    answers.append(ans.WhichOneof("response"))
                    if answers[-1] != "request_body":
                        break
                # refused on the message that passed 1 MiB (the 17th), not at the end of the stream
                assert answers == ["request_body"] * 16 + ["immediate_response"], answers
                assert ans.immediate_response.status.code == 413
                assert b"payload_too_large" in ans.immediate_response.body
                assert await asyncio.wait_for(call.read(), 5) is grpc.aio.EOF  # the stream is over
            assert epp.decider.in_flight == 0 and in_flight(epp) == 0
            assert w.inference() == []
        finally:
            await epp.stop(grace=0.5)

    run(body(), 60)
