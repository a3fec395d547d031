"""A finished request leaves nothing for the garbage collector.

Every object a request creates (the parsed request, its exchange, the PD legs, their buffers)
must be freed by reference counting when the request ends. A reference cycle left behind
makes the collector run every few hundred requests and walk the whole heap, which showed up
as about a tenth of the PD CPU per request before the PD exchange let go of its legs.
The worker side is played by calling the leg callbacks (no sockets), as in
tests/bench/test_bench_proxy.py.
"""
from __future__ import annotations

import asyncio
import gc
from types import SimpleNamespace
from typing import Any

from fastroute.config import Config
from fastroute.control.metrics import Stats
from fastroute.dataplane.app import App
from fastroute.dataplane.protocol import ClientProtocol
from tests.stubs import StubGroup


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.out: list[bytes] = []

    def write(self, data: Any) -> None:
        self.out.append(bytes(data))

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class _Conn:
    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def abort(self) -> None:
        pass


class _Registry:
    def __init__(self) -> None:
        w = SimpleNamespace(url="http://127.0.0.1:9", host="127.0.0.1", port=9, api_key=None,
                            bootstrap_port=8998, dp_size=1)
        self.target_info = [(w, None), (w, 3)]
        self.groups = {"regular": StubGroup(0), "prefill": StubGroup(0), "decode": StubGroup(1)}

    def ready(self) -> bool:
        return True

    def group(self, role: str) -> StubGroup:
        return self.groups[role]


def _client(**cfg: Any) -> tuple[ClientProtocol, _Transport, list, asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    app = App(Config(**cfg), _Registry(), loop)
    app.stats = Stats()  # metrics on: their per-request bookkeeping is checked too
    legs: list = []

    class _Pool:
        authority = b"127.0.0.1:9"
        auth = b""

        def send(self, request: bytes, leg: Any) -> _Conn:
            leg.conn = _Conn()
            legs.append(leg)
            return leg.conn

    pool = _Pool()
    app.pool_for = lambda worker: pool  # type: ignore[method-assign]
    proto = ClientProtocol(app)
    t = _Transport()
    proto.connection_made(t)
    return proto, t, legs, loop


BODY = b'{"text": "hi", "stream": true, "sampling_params": {"max_new_tokens": 4}}'
REQ = b"POST /generate HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n%b" % (len(BODY), BODY)
HEAD = [(b"content-type", b"text/event-stream"), (b"transfer-encoding", b"chunked")]
EVENT = b'data: {"text": "x"}\n\n'


def _garbage_after(run_one: Any, n: int = 200) -> int:
    """Objects the collector finds after ``n`` requests run with the collector off."""
    gc.collect()
    gc.disable()
    try:
        for _ in range(n):
            run_one()
        return gc.collect()
    finally:
        gc.enable()


def test_pd_request_leaves_no_cycle() -> None:
    proto, t, legs, loop = _client(pd_disaggregation=True,
                                   prefill=[("http://127.0.0.1:9", 8998)],
                                   decode=["http://127.0.0.1:10"], dp_aware=True)

    def one() -> None:
        legs.clear()
        proto.data_received(REQ)
        p, d = legs
        p.up_head(200, HEAD)
        d.up_head(200, HEAD)
        p.up_body(EVENT)
        p.up_done()
        d.up_body(EVENT)
        d.up_flush()
        d.up_done()

    try:
        assert _garbage_after(one) == 0
        assert not proto.busy and not proto.app.exchanges
        assert t.out[-1].endswith(b"0\r\n\r\n")  # every stream ended cleanly
        groups = proto.app.registry.groups
        leases = groups["prefill"].leases + groups["decode"].leases
        assert len(leases) == 400 and all(lease.releases == 1 for lease in leases)
    finally:
        loop.close()


def test_pd_request_failed_by_the_decode_leaves_no_cycle() -> None:
    proto, t, legs, loop = _client(pd_disaggregation=True,
                                   prefill=[("http://127.0.0.1:9", 8998)],
                                   decode=["http://127.0.0.1:10"], dp_aware=True)

    def one() -> None:
        legs.clear()
        proto.data_received(REQ)
        p, d = legs
        d.up_head(400, [(b"content-type", b"application/json"), (b"content-length", b"2")])
        d.up_body(b"{}")
        d.up_done()

    try:
        assert _garbage_after(one) == 0
        assert b" 400 " in t.out[-1].split(b"\r\n", 1)[0]
        assert not proto.app.exchanges
    finally:
        loop.close()


def test_regular_request_leaves_no_cycle() -> None:
    proto, t, legs, loop = _client(worker_urls=["http://127.0.0.1:9"])

    def one() -> None:
        legs.clear()
        proto.data_received(REQ)
        (leg,) = legs
        leg.up_head(200, HEAD)
        leg.up_body(EVENT)
        leg.up_flush()
        leg.up_done()

    try:
        assert _garbage_after(one) == 0
        assert t.out[-1].endswith(b"0\r\n\r\n")
    finally:
        loop.close()
