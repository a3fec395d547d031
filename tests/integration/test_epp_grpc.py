"""The picker's gRPC listener as a hostile or careless client meets it: over real sockets, the
EppServer in this event loop and a fake worker, the client a grpc.aio channel of the test."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

pytest.importorskip("grpc")
pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")

import grpc  # noqa: E402
from envoy.config.core.v3 import base_pb2  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from fastroute.config import Config  # noqa: E402
from fastroute.epp.bootstrap import HEADER  # noqa: E402
from fastroute.epp.server import EppServer  # noqa: E402
from tests.integration.conftest import DataWorker, get, run, until, workers  # noqa: E402
from tests.integration.conftest import call as call_http  # noqa: E402
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


async def grpc_health(server: EppServer, service: str = "") -> str:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.grpc_port}") as ch:
        r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def test_grpc_health_follows_readiness_at_once() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        cfg = Config(
            host="127.0.0.1",
            worker_urls=[w.url],
            disable_health_check=True,
            prometheus_host="127.0.0.1",
            prometheus_port=0,
        )
        epp = EppServer(cfg, free_port())
        await epp.start()
        try:
            await until(epp.ready, 10, "picker ready")
            # ready now: gRPC health says so too, without waiting for a periodic sweep
            for service in ("", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
                assert await grpc_health(epp, service) == "SERVING"
            (worker,) = epp.registry.workers
            epp.registry.remove_worker(worker)
            assert not epp.ready()
            assert await grpc_health(epp) == "NOT_SERVING"
            assert await grpc_health(epp, "liveness") == "SERVING"
        finally:
            await epp.stop(grace=0.5)

    run(body(), 60)


def test_malformed_messages_are_logged_once_per_peer_and_counted(caplog: Any) -> None:
    async def body() -> None:
        (w,) = await workers(1)
        epp = await start_epp(w)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.grpc_port}") as ch:
                raw = ch.stream_stream("/envoy.service.ext_proc.v3.ExternalProcessor/Process")
                for _ in range(5):
                    call = raw()
                    await call.write(b"\xff\xff\xff\xff")  # not a ProcessingRequest
                    await call.done_writing()
                    assert await asyncio.wait_for(call.code(), 5) == grpc.StatusCode.INVALID_ARGUMENT
            r = await call_http(epp.parts.metrics.port, get("/metrics"))
            assert b'fastroute_epp_streams_refused_total{reason="malformed_message"} 5.0' in r.body
            assert epp.decider.in_flight == 0
            # a well-formed stream is served as before
            async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.grpc_port}") as ch:
                call = pb_grpc.ExternalProcessorStub(ch).Process()
                await call.write(headers_msg(eos=True))
                ans = await asyncio.wait_for(call.read(), 5)
                assert ans.request_headers.response.header_mutation.set_headers[0].header.key == HEADER
                call.cancel()
        finally:
            await epp.stop(grace=0.5)

    with caplog.at_level(logging.WARNING, logger="fastroute.epp"):
        run(body(), 60)
    said = [r for r in caplog.records if r.name == "fastroute.epp" and r.levelno >= logging.WARNING]
    assert len(said) == 1, [r.getMessage() for r in said]
    assert said[0].exc_info is None and "malformed" in said[0].getMessage()
