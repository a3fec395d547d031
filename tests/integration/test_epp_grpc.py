"""The picker's gRPC listener as a hostile or careless client meets it: over real sockets, the
EppServer in this event loop and a fake worker, the client a grpc.aio channel of the test."""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
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
from fastroute.epp.options import GrpcTls  # noqa: E402
from fastroute.epp.server import EppServer  # noqa: E402
from fastroute.runtime.startup import StartupError  # noqa: E402
from tests.integration.certs import make_ca, make_leaf  # noqa: E402
from tests.integration.conftest import DataWorker, get, run, until, workers  # noqa: E402
from tests.integration.conftest import call as call_http  # noqa: E402
from tests.integration.envoy_harness import free_port  # noqa: E402


async def start_epp(worker: DataWorker, server_kw: dict[str, Any] | None = None, **kw: Any) -> EppServer:
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
    server = EppServer(cfg, free_port(), **(server_kw or {}))
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


async def scrape(server: EppServer) -> bytes:
    return (await call_http(server.parts.metrics.port, get("/metrics"))).body


async def picked_on_headers(ch: Any) -> Any:
    """A stream whose request is picked on its headers (round robin needs no body)."""
    call = pb_grpc.ExternalProcessorStub(ch).Process()
    await call.write(headers_msg())
    ans = await asyncio.wait_for(call.read(), 5)
    assert ans.request_headers.response.header_mutation.set_headers[0].header.key == HEADER, ans
    return call


def test_a_silent_picked_stream_loses_its_lease_and_a_talking_one_keeps_it() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        epp = await start_epp(w, {"silent_timeout": 1.0}, policy="round_robin")
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.grpc_port}") as ch:
                silent = await picked_on_headers(ch)  # headers, then nothing (the attack)
                talking = await picked_on_headers(ch)  # Envoy's stream: response headers come
                assert in_flight(epp) == 2
                answered = 0
                for _ in range(12):  # 3.6 s, three times the bound
                    await asyncio.sleep(0.3)
                    await talking.write(pb.ProcessingRequest(response_headers=pb.HttpHeaders()))
                    ans = await asyncio.wait_for(talking.read(), 5)
                    answered += ans.WhichOneof("response") == "response_headers"
                assert answered == 12
                # the silent one was released; the one that talks still holds its lease
                assert in_flight(epp) == 1 and epp.decider.in_flight == 1
                assert b'fastroute_leases_reclaimed_total{reason="silent"} 1.0' in await scrape(epp)
                # its end releases it once, and the late end of the silent one releases nothing
                await talking.write(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
                await asyncio.wait_for(talking.read(), 5)
                await until(lambda: in_flight(epp) == 0, 5, "talking stream released at its end")
                silent.cancel()
                talking.cancel()
            await until(lambda: epp.processor.streams == 0, 5, "streams gone")
            assert in_flight(epp) == 0 and epp.decider.in_flight == 0
            assert b'fastroute_leases_reclaimed_total{reason="silent"} 1.0' in await scrape(epp)
        finally:
            await epp.stop(grace=0.5)

    run(body(), 60)


def _pki(d: str) -> dict[str, Any]:
    ca, ca_cert, ca_key = make_ca(d)
    other, other_cert, other_key = make_ca(d, "another CA")
    return {
        "ca": ca,
        "server": make_leaf(d, "picker", ca_cert, ca_key),
        "client": make_leaf(d, "envoy", ca_cert, ca_key, server=False),
        "stranger": make_leaf(d, "stranger", other_cert, other_key, server=False),
    }


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


async def health_over(port: int, creds: Any) -> str:
    """The whole server's gRPC health over a channel with ``creds`` (None: plaintext), or the
    status code of the failure."""
    target = f"127.0.0.1:{port}"
    ch = grpc.aio.insecure_channel(target) if creds is None else grpc.aio.secure_channel(target, creds)
    async with ch:
        try:
            r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3.0)
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)


def test_the_grpc_listener_serves_tls_and_mutual_tls(tmp_path: Any) -> None:
    pki = _pki(str(tmp_path))
    ca = _read(pki["ca"].cert)

    def client(name: str | None) -> Any:
        if name is None:
            return grpc.ssl_channel_credentials(root_certificates=ca)
        pem = pki[name]
        return grpc.ssl_channel_credentials(ca, _read(pem.key), _read(pem.cert))

    async def body() -> None:
        (w,) = await workers(1)
        server_pem = pki["server"]
        tls = GrpcTls(server_pem.cert, server_pem.key)
        epp = await start_epp(w, {"tls": tls}, policy="round_robin")
        try:
            assert await health_over(epp.grpc_port, None) == "UNAVAILABLE"  # plaintext refused
            assert await health_over(epp.grpc_port, client(None)) == "SERVING"
        finally:
            await epp.stop(grace=0.5)
        mutual = GrpcTls(server_pem.cert, server_pem.key, pki["ca"].cert)
        epp = await start_epp(w, {"tls": mutual}, policy="round_robin")
        try:
            assert await health_over(epp.grpc_port, None) == "UNAVAILABLE"
            assert await health_over(epp.grpc_port, client(None)) == "UNAVAILABLE"  # no certificate
            assert await health_over(epp.grpc_port, client("stranger")) == "UNAVAILABLE"  # another CA
            assert await health_over(epp.grpc_port, client("client")) == "SERVING"
            creds = client("client")
            async with grpc.aio.secure_channel(f"127.0.0.1:{epp.grpc_port}", creds) as ch:
                call = await picked_on_headers(ch)
                assert in_flight(epp) == 1
                call.cancel()
            await until(lambda: in_flight(epp) == 0, 5, "released")
        finally:
            await epp.stop(grace=0.5)

    run(body(), 60)


def test_tls_files_that_do_not_go_together_refuse_the_start(tmp_path: Any) -> None:
    pki = _pki(str(tmp_path))

    async def body() -> None:
        (w,) = await workers(1)
        cfg = Config(host="127.0.0.1", worker_urls=[w.url], prometheus_port=0, prometheus_host="127.0.0.1")
        for tls, flag in (
            (GrpcTls(pki["server"].cert, pki["client"].key), "--grpc-tls-cert-path"),
            (GrpcTls(pki["server"].cert, pki["server"].key, pki["server"].key), "--grpc-tls-client-ca-path"),
            (GrpcTls(str(tmp_path / "missing.pem"), pki["server"].key), "--grpc-tls-cert-path"),
        ):
            epp = EppServer(cfg, free_port(), tls=tls)
            with pytest.raises(StartupError, match=flag):
                await epp.start()
            await epp.stop(grace=0)

    run(body(), 60)


async def _burst(port: int, n: int, channels: int) -> tuple[Any, list[Any]]:
    """``n`` streams opened at once over ``channels`` connections, each sending its request
    headers and reading one answer; (outcome counts, the open calls). Bounded waits."""
    opts = [("grpc.use_local_subchannel_pool", 1)]  # one TCP connection per channel
    chans = [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts) for _ in range(channels)]
    calls: list[Any] = []

    async def one(i: int) -> str:
        call = pb_grpc.ExternalProcessorStub(chans[i % channels]).Process()
        calls.append(call)
        try:
            await call.write(headers_msg())
            ans = await call.read()
        except grpc.aio.AioRpcError as exc:
            return exc.code().name
        return "served" if ans is not grpc.aio.EOF and ans.HasField("request_headers") else "other"

    got = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(n))), 60)
    return Counter(got), [calls, chans]


async def _close(held: list[Any]) -> None:
    calls, chans = held
    for c in calls:
        c.cancel()
    for ch in chans:
        await ch.close()


def test_a_burst_of_4000_streams_is_served_whole() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        epp = await start_epp(w, policy="round_robin")
        held: list[Any] = [[], []]
        try:
            outcome, held = await _burst(epp.grpc_port, 4000, 1)
            # grpc core's queue of streams not yet taken failed the surplus past 3000, silently
            assert outcome == {"served": 4000}, outcome
            assert in_flight(epp) == 4000
        finally:
            await _close(held)
            await until(lambda: epp.processor.streams == 0, 20, "streams gone")
            assert in_flight(epp) == 0
            await epp.stop(grace=0.5)

    run(body(), 120)


def test_streams_over_the_bound_are_refused_logged_once_and_counted(caplog: Any) -> None:
    async def body() -> None:
        (w,) = await workers(1)
        epp = await start_epp(w, {"max_streams": 100}, policy="round_robin")
        held: list[Any] = [[], []]
        try:
            outcome, held = await _burst(epp.grpc_port, 160, 4)
            assert outcome == {"served": 100, "RESOURCE_EXHAUSTED": 60}, outcome
            assert in_flight(epp) == 100
            assert b'fastroute_epp_streams_refused_total{reason="too_many_streams"} 60.0' in await scrape(epp)
        finally:
            await _close(held)
            await until(lambda: epp.processor.streams == 0, 20, "streams gone")
            assert in_flight(epp) == 0
            await epp.stop(grace=0.5)

    with caplog.at_level(logging.WARNING, logger="fastroute.epp"):
        run(body(), 60)
    said = [r.getMessage() for r in caplog.records if r.name == "fastroute.epp" and r.levelno >= logging.WARNING]
    assert len(said) == 1 and "too_many_streams" in said[0], said
