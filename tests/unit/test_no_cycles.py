"""A finished request leaves nothing for the garbage collector.

Every object a request creates (the parsed request, its exchange, the PD legs, their buffers)
must be freed by reference counting when the request ends. A reference cycle left behind
makes the collector run every few hundred requests and walk the heap, which showed up as
about a tenth of the PD CPU per request before the PD exchange let go of its legs. The
worker side is played by calling the leg callbacks (no sockets), as in
tests/bench/test_bench_proxy.py.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable
from typing import Any

import pytest

from fastroute.config import Config
from fastroute.control.metrics import Stats
from fastroute.dataplane.protocol import ClientProtocol
from tests.stubs import StubPool, StubRegistry, StubTransport, stand_in_app

PD = {
    "pd_disaggregation": True,
    "prefill": [("http://127.0.0.1:9", 8998)],
    "decode": ["http://127.0.0.1:10"],
    "dp_aware": True,
}
BODY = b'{"text": "hi", "stream": true, "sampling_params": {"max_new_tokens": 4}}'
REQ = b"POST /generate HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n%b" % (len(BODY), BODY)
HEAD = [(b"content-type", b"text/event-stream"), (b"transfer-encoding", b"chunked")]
EVENT = b'data: {"text": "x"}\n\n'
ERROR_HEAD = [(b"content-type", b"application/json"), (b"content-length", b"2")]


def _pd_ok(proto: ClientProtocol, legs: list) -> None:
    proto.data_received(REQ)
    p, d = legs
    p.up_head(200, HEAD)
    d.up_head(200, HEAD)
    p.up_body(EVENT)
    p.up_done()
    d.up_body(EVENT)
    d.up_flush()
    d.up_done()


def _pd_decode_fails(proto: ClientProtocol, legs: list) -> None:
    proto.data_received(REQ)
    _p, d = legs
    d.up_head(400, ERROR_HEAD)
    d.up_body(b"{}")
    d.up_done()


def _regular_ok(proto: ClientProtocol, legs: list) -> None:
    proto.data_received(REQ)
    (leg,) = legs
    leg.up_head(200, HEAD)
    leg.up_body(EVENT)
    leg.up_flush()
    leg.up_done()


@pytest.mark.parametrize(
    "cfg, one, status",
    [
        (PD, _pd_ok, b" 200 "),
        (PD, _pd_decode_fails, b" 400 "),
        ({"worker_urls": ["http://127.0.0.1:9"]}, _regular_ok, b" 200 "),
    ],
    ids=["pd", "pd-decode-error", "regular"],
)
def test_finished_requests_leave_no_cyclic_garbage(
    cfg: dict, one: Callable[[ClientProtocol, list], None], status: bytes
) -> None:
    loop = asyncio.new_event_loop()
    registry = StubRegistry()
    pool = StubPool()
    app = stand_in_app(Config(**cfg), registry, loop, pool)
    app.stats = Stats()  # metrics on: their per-request bookkeeping is checked too
    proto = app.protocol_factory()
    transport = StubTransport(record=True)
    proto.connection_made(transport)
    n = 200
    gc.collect()
    gc.disable()
    try:
        for _ in range(n):
            pool.legs.clear()
            transport.out.clear()
            one(proto, pool.legs)
        garbage = gc.collect()
    finally:
        gc.enable()
        loop.close()
    assert garbage == 0
    assert not proto.busy and not app.live.exchanges
    head = transport.out[0].split(b"\r\n", 1)[0]
    assert status in head, head
    if status == b" 200 ":
        assert transport.out[-1].endswith(b"0\r\n\r\n")  # the stream ended cleanly
    leases = [lease for g in registry.groups.values() for lease in g.leases]
    assert len(leases) == n * len(pool.legs) and all(lease.releases == 1 for lease in leases)


def _pd_client_leaves(proto: ClientProtocol, legs: list) -> None:
    proto.data_received(REQ)
    p, _d = legs
    p.up_head(200, HEAD)
    p.up_body(EVENT)
    proto.connection_lost(None)


def _leg_state(leg: Any) -> tuple:
    return (leg.ex, leg.conn, leg.role, leg.target, leg.status, leg.headers, leg.chunks, leg.size, leg.done)


@pytest.mark.parametrize(
    "one", [_pd_ok, _pd_decode_fails, _pd_client_leaves], ids=["ok", "decode-error", "client-left"]
)
def test_the_shared_inert_pd_leg_is_never_written(one: Callable[[ClientProtocol, list], None]) -> None:
    """A PD exchange points its legs at one shared inert leg before its first attempt and
    after its books close: whatever a request does, that leg stays as it was made."""
    from fastroute.dataplane.pd import _NO_LEG, _PDLeg

    loop = asyncio.new_event_loop()
    pool = StubPool()
    app = stand_in_app(Config(**PD), StubRegistry(), loop, pool)
    proto = app.protocol_factory()
    proto.connection_made(StubTransport())
    try:
        one(proto, pool.legs)
    finally:
        loop.close()
    assert not app.live.exchanges
    assert _leg_state(_NO_LEG) == _leg_state(_PDLeg(None, "prefill"))
