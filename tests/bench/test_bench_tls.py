"""TLS to the workers vs plain HTTP, same run: closed-loop requests through the router to one
plain and one https:// fake worker (private CA), alternating rounds so both see the same load.

Opt-in (the default testpaths leave tests/bench out)::

    python -m pytest -q -s tests/bench/test_bench_tls.py

Prints requests/s and p50/p99 latency for each, and the TLS overhead.  Keep-alive pools mean the
handshake is paid once per pooled connection; what remains per request is record encryption.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import pytest

pytest.importorskip("cryptography")

from tests.integration.certs import make_ca, make_leaf  # noqa: E402
from tests.integration.conftest import DataWorker, RawClient, Router, post, run  # noqa: E402
from tests.integration.test_tls_workers import TLSWorker, server_ctx  # noqa: E402

ROUNDS = 6
PER_ROUND = 400
CLIENTS = 8


async def _round(port: int, model_path: str, n: int) -> list[float]:
    lat: list[float] = []
    req = post(model_path, {"text": "hello world " * 20, "sampling_params": {"max_new_tokens": 8}})

    async def client(k: int) -> None:
        c = await RawClient(port).connect()
        try:
            for _ in range(n // CLIENTS):
                t0 = time.perf_counter()
                c.send(req)
                res = await c.response(timeout=10)
                assert res.status == 200
                lat.append(time.perf_counter() - t0)
        finally:
            c.close()

    await asyncio.gather(*(client(k) for k in range(CLIENTS)))
    return lat


def _report(name: str, lat: list[float], secs: float) -> float:
    lat.sort()
    rps = len(lat) / secs
    print(
        f"{name:6s} {rps:8.0f} req/s  p50 {1e3 * statistics.median(lat):6.2f} ms  "
        f"p99 {1e3 * lat[int(0.99 * (len(lat) - 1))]:6.2f} ms"
    )
    return rps


def test_tls_overhead(tmp_path) -> None:
    async def body() -> None:
        ca, ca_cert, ca_key = make_ca(str(tmp_path))
        leaf = make_leaf(str(tmp_path), "worker", ca_cert, ca_key)
        plain = await DataWorker().start()
        tls = await TLSWorker(server_ctx(leaf)).start()
        try:
            # Two routers in one process, one per worker, so each round measures one transport.
            async with (
                Router(worker_urls=[plain.url]) as rp,
                Router(worker_urls=[tls.url], ca_cert_paths=[ca.cert]) as rt,
            ):
                await _round(rp.port, "/generate", CLIENTS * 4)  # warm pools
                await _round(rt.port, "/generate", CLIENTS * 4)
                res: dict[str, tuple[list[float], float]] = {"plain": ([], 0.0), "tls": ([], 0.0)}
                for _ in range(ROUNDS):
                    for name, r in (("plain", rp), ("tls", rt)):
                        t0 = time.perf_counter()
                        lat = await _round(r.port, "/generate", PER_ROUND)
                        acc, secs = res[name]
                        res[name] = (acc + lat, secs + time.perf_counter() - t0)
                print()
                a = _report("plain", *res["plain"])
                b = _report("tls", *res["tls"])
                print(f"TLS overhead: {100 * (a - b) / a:+.1f}% throughput")
        finally:
            await plain.stop()
            await tls.stop()

    run(body(), timeout=300)
