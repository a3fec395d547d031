"""Benchmarks of the per-request proxy path with a mock transport (no sockets).

Opt-in: ``python -m pytest tests/bench/test_bench_proxy.py --benchmark-only``.

Each round is one complete request on a keep-alive client connection: parse the
client bytes, parse the JSON body, pick (stub group), frame the upstream request,
relay the upstream head and body back, release the lease. The worker side is
played by calling the leg callbacks, so this measures the router's own CPU per
request: what the data path adds on top of the kernel's socket work.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fastroute.config import Config
from fastroute.dataplane.protocol import ClientProtocol
from tests.stubs import PoolStandIn, StubConn, StubRegistry, StubTransport, stand_in_app


class _Pool(PoolStandIn):
    authority = b"127.0.0.1:9"
    auth = b""

    def __init__(self) -> None:
        super().__init__()
        self.last: Any = None
        self.conn = StubConn()

    def send(self, request: bytes, leg: Any, fresh: bool = False, body: bytes | None = None) -> StubConn:
        leg.conn = self.conn
        self.last = leg
        return self.conn


def _setup(metrics: Any = None, **cfg: Any) -> tuple[ClientProtocol, _Pool, asyncio.AbstractEventLoop]:
    """A connection of an App on stand-in routes; ``metrics``: the process's Stats (True: a new
    one; None: metrics off), set before the connection is made, as the server does."""
    loop = asyncio.new_event_loop()
    pool = _Pool()
    app = stand_in_app(Config(**cfg), StubRegistry(record=False), loop, pool)
    if metrics is not None:
        from fastroute.control.metrics import Stats

        app.stats = Stats() if metrics is True else metrics
    proto = app.protocol_factory()
    proto.connection_made(StubTransport())
    return proto, pool, loop


BODY = b'{"text": "The capital of France is", "sampling_params": {"max_new_tokens": 16, "temperature": 0}}'
REQ = (
    b"POST /generate HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
    b"User-Agent: python-requests/2.31\r\nAccept: */*\r\nX-Request-Id: bench-1\r\n"
    b"Content-Length: %d\r\n\r\n%b" % (len(BODY), BODY)
)
SSE_REQ_BODY = BODY[:-1] + b', "stream": true}'
SSE_REQ = (
    b"POST /generate HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
    b"Content-Length: %d\r\n\r\n%b" % (len(SSE_REQ_BODY), SSE_REQ_BODY)
)
JSON_HEAD = [
    (b"date", b"Sun, 29 Nov 2026 00:00:00 GMT"),
    (b"server", b"uvicorn"),
    (b"content-length", b"120"),
    (b"content-type", b"application/json"),
]
SSE_HEAD = [
    (b"date", b"Sun, 29 Nov 2026 00:00:00 GMT"),
    (b"server", b"uvicorn"),
    (b"content-type", b"text/event-stream"),
    (b"transfer-encoding", b"chunked"),
]
JSON_BODY = b'{"text": " Paris.", "meta_info": {"id": "x", "prompt_tokens": 6, "completion_tokens": 2}}'.ljust(120)
EVENT = b'data: {"text": " tok", "output_ids": [21], "meta_info": {"id": "x"}, "index": 0}\n\n'


def _json_round(proto: ClientProtocol, pool: _Pool) -> None:
    """One regular JSON request: client bytes in, the worker's answer played to the leg."""
    proto.data_received(REQ)
    leg = pool.last
    leg.up_head(200, JSON_HEAD)
    leg.up_body(JSON_BODY)
    leg.up_done()


@pytest.mark.benchmark(group="proxy")
def test_bench_regular_json_request(benchmark) -> None:
    proto, pool, loop = _setup(worker_urls=["http://127.0.0.1:9"])
    benchmark(_json_round, proto, pool)
    assert not proto.busy and not proto.live.exchanges
    loop.close()


@pytest.mark.benchmark(group="proxy-metrics")
@pytest.mark.parametrize("metrics", ["off", "on", "on-without-pick-overhead-histograms"])
def test_bench_regular_json_request_metrics(benchmark, metrics: str) -> None:
    """Same request as test_bench_regular_json_request, with the process's Stats off, on, and on
    with fastroute_pick_seconds / fastroute_router_overhead_seconds replaced by bucket-less
    ones: the difference of the last two is what their bucket searches cost per request."""
    from fastroute.control.metrics import Hist, Stats

    st = None
    if metrics != "off":
        st = Stats()
        if metrics != "on":
            st.pick_seconds, st.overhead_seconds = Hist(()), Hist(())  # no bounds: one bucket
    proto, pool, loop = _setup(st, worker_urls=["http://127.0.0.1:9"])
    benchmark(_json_round, proto, pool)
    assert not proto.busy and not proto.live.exchanges
    loop.close()


@pytest.mark.benchmark(group="proxy")
def test_bench_regular_sse_8_events(benchmark) -> None:
    proto, pool, loop = _setup(worker_urls=["http://127.0.0.1:9"])

    def one() -> None:
        proto.data_received(SSE_REQ)
        leg = pool.last
        leg.up_head(200, SSE_HEAD)
        for _ in range(8):
            leg.up_body(EVENT)
            leg.up_flush()  # worst case: one upstream read per event
        leg.up_body(b"data: [DONE]\n\n")
        leg.up_done()

    benchmark(one)
    assert not proto.busy
    loop.close()


@pytest.mark.benchmark(group="proxy")
def test_bench_pd_sse_8_events_dp_aware(benchmark) -> None:
    proto, pool, loop = _setup(
        pd_disaggregation=True, prefill=[("http://127.0.0.1:9", 8998)], decode=["http://127.0.0.1:10"], dp_aware=True
    )
    ex_legs: list = []
    pool.send = lambda request, leg, *rest: (setattr(leg, "conn", StubConn()), ex_legs.append(leg))  # type: ignore[method-assign]

    def one() -> None:
        ex_legs.clear()
        proto.data_received(SSE_REQ)
        p, d = ex_legs
        p.up_head(200, SSE_HEAD)
        d.up_head(200, SSE_HEAD)
        p.up_body(EVENT)
        p.up_done()
        for _ in range(8):
            d.up_body(EVENT)
            d.up_flush()
        d.up_body(b"data: [DONE]\n\n")
        d.up_done()

    benchmark(one)
    assert not proto.busy
    loop.close()


@pytest.mark.benchmark(group="proxy")
def test_bench_health_inline(benchmark) -> None:
    proto, _pool, loop = _setup(worker_urls=["http://127.0.0.1:9"])
    req = b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n"
    benchmark(proto.data_received, req)
    loop.close()


# ---------------------------------------------------------------------------------------------
# Script mode: loopback throughput, router vs direct.
#
#   python tests/bench/test_bench_proxy.py [--seconds 5] [--conns 32] [--stream]
#
# Starts a minimal fixed-answer worker (httptools, one process), the router as a subprocess
# (``python -m fastroute``), and N keep-alive client connections in this process; reports
# completed requests per second through the router and directly against the worker.  On a
# 2-core machine all three share the cores, so absolute numbers are a lower bound.


def _worker_main(port: int, stream: bool) -> None:
    import httptools
    import uvloop

    if stream:
        events = b"".join(b"%x\r\n%b\r\n" % (len(EVENT), EVENT) for _ in range(8))
        done = b"data: [DONE]\n\n"
        answer = (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            + events
            + b"%x\r\n%b\r\n0\r\n\r\n" % (len(done), done)
        )
    else:
        answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b" % (
            len(JSON_BODY),
            JSON_BODY,
        )
    info = b'{"model_path": "/m/fake", "dp_size": 1}'
    info_answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b" % (
        len(info),
        info,
    )

    class W(asyncio.Protocol):
        def connection_made(self, t: Any) -> None:
            self.t = t
            self.url = b""
            self.p = httptools.HttpRequestParser(self)

        def data_received(self, data: bytes) -> None:
            self.p.feed_data(data)

        def on_url(self, url: bytes) -> None:
            self.url = url

        def on_message_complete(self) -> None:
            if self.url.startswith((b"/generate", b"/v1/")) and self.p.get_method() == b"POST":
                self.t.write(answer)
            else:
                self.t.write(info_answer)

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(W, "127.0.0.1", port)
        await server.serve_forever()

    uvloop.run(main())


async def _load(port: int, conns: int, seconds: float, body: bytes) -> int:
    import httptools

    req = b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (
        len(body),
        body,
    )
    count = 0
    loop = asyncio.get_running_loop()
    stop_at = loop.time() + seconds

    class C(asyncio.Protocol):
        def __init__(self) -> None:
            self.p = httptools.HttpResponseParser(self)
            self.fin: asyncio.Future = loop.create_future()

        def connection_made(self, t: Any) -> None:
            self.t = t
            t.write(req)

        def data_received(self, data: bytes) -> None:
            self.p.feed_data(data)

        def on_message_complete(self) -> None:
            nonlocal count
            count += 1
            if loop.time() < stop_at:
                self.t.write(req)
            elif not self.fin.done():
                self.fin.set_result(None)

        def connection_lost(self, exc: Any) -> None:
            if not self.fin.done():
                self.fin.set_result(None)

    protos = []
    for _ in range(conns):
        _t, pr = await loop.create_connection(C, "127.0.0.1", port)
        protos.append(pr)
    await asyncio.gather(*(p.fin for p in protos))
    for p in protos:
        p.t.close()
    return count


def _script() -> None:
    import argparse
    import multiprocessing
    import socket
    import subprocess
    import sys
    import time

    import uvloop

    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--conns", type=int, default=32)
    ap.add_argument("--stream", action="store_true")
    args = ap.parse_args()

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    wport, rport = free_port(), free_port()
    worker = multiprocessing.Process(target=_worker_main, args=(wport, args.stream), daemon=True)
    worker.start()
    router = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fastroute",
            "--host",
            "127.0.0.1",
            "--port",
            str(rport),
            "--worker-urls",
            f"http://127.0.0.1:{wport}",
            "--policy",
            "round_robin",
            "--disable-health-check",
            "--disable-load-monitoring",
            "--prometheus-port",
            str(free_port()),
            "--log-level",
            "warn",
        ]
    )
    body = SSE_REQ_BODY if args.stream else BODY
    try:
        deadline = time.time() + 15
        while True:
            try:
                if uvloop.run(_load(rport, 1, 0.01, body)) > 0:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                raise SystemExit("router did not become ready")
            time.sleep(0.2)
        for name, port in (("direct", wport), ("router", rport)):
            n = uvloop.run(_load(port, args.conns, args.seconds, body))
            print(f"{name:7s} {'sse' if args.stream else 'json'} conns={args.conns}: {n / args.seconds:10.0f} req/s")
    finally:
        router.terminate()
        router.wait(10)
        worker.terminate()


if __name__ == "__main__":
    _script()
