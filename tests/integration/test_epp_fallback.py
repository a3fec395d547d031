"""``fastroute epp --fallback-endpoints``: the endpoint picker protocol's fallback list through a
real Envoy (the printed bootstrap: override_host over the --worker-urls, retries on a refused
connection). A worker that stops listening after registration (health checks off, so the picker
still picks it) refuses the connection; Envoy takes the next endpoint of the picker's list
without a second decision, reports the endpoint that served, and the lease follows it."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.conftest import call, post, run, workers
from tests.integration.envoy_harness import Gateway

HEADER = "x-gateway-destination-endpoint"


def test_the_next_endpoint_serves_when_the_picked_one_refuses() -> None:
    async def body() -> None:
        a, b, c = await workers(3)
        addr = {w: f"127.0.0.1:{w.port}" for w in (a, b, c)}
        async with Gateway([a.url, b.url, c.url], "--policy", "round_robin", "--fallback-endpoints", "2") as g:
            for i in range(3):  # everyone answers: one each, each header a list of three
                r = await call(g.port, post("/generate", {"text": f"warm {i}"}), timeout=10)
                assert r.status == 200, r.body
            for w in (a, b, c):
                (rec,) = w.inference()
                listed = rec.headers[HEADER].split(",")
                assert listed[0] == addr[w] and sorted(listed) == sorted(addr.values()), listed

            await c.stop()  # refuses connections from now on; still picked (no health checks)
            a.stream_gate = asyncio.Event()
            b.stream_gate = asyncio.Event()
            reqs = [
                asyncio.create_task(call(g.port, post("/generate", {"text": f"r{i}", "stream": True}), timeout=30))
                for i in range(6)
            ]
            # Round robin picked c for two of the six; Envoy served them at a or b, said so with
            # the response headers, and the picker moved their leases: c holds none.
            held = await g.until_in_flight(
                lambda f: f.get(a.url, 0) + f.get(b.url, 0) == 6, 15, "six streams booked where they run"
            )
            assert held.get(c.url, 0) == 0, held
            m = await g.metrics()
            assert m["fastroute_epp_fallback_served_total"] == 2, m.get("fastroute_epp_fallback_served_total")
            a.stream_gate.set()
            b.stream_gate.set()
            for r in await asyncio.gather(*reqs):
                assert r.status == 200, r.body
            recs = a.inference()[1:] + b.inference()[1:]
            assert len(recs) == 6 and c.inference()[1:] == []
            fell_back = [rec for rec in recs if rec.headers[HEADER].split(",")[0] == addr[c]]
            assert len(fell_back) == 2  # picked c, served by the next of its list
            for rec in fell_back:
                assert rec.headers[HEADER].split(",")[1:] and addr[c] not in rec.headers[HEADER].split(",")[1:]
            await g.until_in_flight(lambda f: set(f.values()) == {0.0}, 10, "every lease released")

    run(body(), 90)


@pytest.mark.parametrize(
    "flags, why",
    [
        (("--fallback-endpoints", "17"), "from 0 to 16"),
        (("--fallback-endpoints", "x"), "not a whole number"),
        (("--fallback-endpoints", "1", "--pd-disaggregation", "--sidecar-port", "9"), "not built for PD"),
    ],
)
def test_fallback_endpoints_refused_by_name(flags: tuple[str, ...], why: str) -> None:
    import subprocess
    import sys

    argv = [sys.executable, "-m", "fastroute", "epp", "--grpc-port", "22999", *flags]
    if "--pd-disaggregation" in flags:
        argv += ["--prefill", "http://127.0.0.1:22998", "--decode", "http://127.0.0.1:22997"]
    else:
        argv += ["--worker-urls", "http://127.0.0.1:22998"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert "--fallback-endpoints" in p.stderr and why in p.stderr, p.stderr
