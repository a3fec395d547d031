"""What a PD request hands each leg: one request through the real App and ``PDRelay.attempt``,
each route sending through a stand-in pool that records the bytes instead of connecting.

The bootstrap fields (host, port, room; the decode's DP rank keys) are tested here, on the
bodies the router really sends, not on a twin of the code that builds them."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

from fastroute.config import Config
from fastroute.dataplane.app import App
from tests.stubs import PoolStandIn, StandInUpstreams, StubConn, StubRegistry, StubTransport

PD = {
    "pd_disaggregation": True,
    "prefill": [("http://127.0.0.1:9", 8998)],
    "decode": ["http://127.0.0.1:10"],
    "dp_aware": True,
}


class RecordingPool(PoolStandIn):
    """Records (request, body parts) of each leg sent through it; answers nothing."""

    authority = b"127.0.0.1:9"
    auth = b""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[bytes, Any]] = []

    def send(self, request: bytes, leg: Any, fresh: bool = False, body: Any = None) -> StubConn:
        leg.conn = StubConn()
        self.sent.append((request, body))
        return leg.conn


def wire_body(request: bytes, parts: Any) -> tuple[bytes, bytes]:
    """(head, body) of one recorded leg: whole, or a framed head and views of the client's bytes."""
    if parts is None:
        head, _, body = request.partition(b"\r\n\r\n")
        return head + b"\r\n\r\n", body
    return request, b"".join(parts)


def send_pd(
    path: str,
    body: bytes,
    *,
    host: str = "127.0.0.1",
    bootstrap_port: int | None = 8998,
    prefill_dp_size: int = 1,
    prefill_rank: int | None = None,
    decode_rank: int | None = 3,
    room_rng: Any = None,
) -> tuple[list[tuple[bytes, Any]], bytes]:
    """Send ``body`` to ``path`` of a PD router whose prefill pick is ``host`` (bootstrap port
    ``bootstrap_port``; DP rank ``prefill_rank`` of ``prefill_dp_size`` when given) and whose
    decode pick is DP rank ``decode_rank`` (None: a whole worker) -> (what each leg sent, in
    the order sent: prefill then decode; the bytes written to the client)."""
    loop = asyncio.new_event_loop()
    try:
        registry = StubRegistry()
        prefill = SimpleNamespace(
            url=f"http://{host}:9",
            host=host,
            port=9,
            api_key=None,
            bootstrap_port=bootstrap_port,
            dp_size=prefill_dp_size,
        )
        decode = SimpleNamespace(
            url="http://127.0.0.1:10", host="127.0.0.1", port=10, api_key=None, bootstrap_port=None, dp_size=8
        )
        registry.target_info = [(prefill, prefill_rank), (decode, decode_rank)]
        pool = RecordingPool()
        config = Config(**PD)
        kw = {} if room_rng is None else {"room_rng": room_rng}
        app = App(config, registry, loop, upstreams=StandInUpstreams(config, registry, loop, pool, **kw))
        transport = StubTransport(record=True)
        proto = app.protocol_factory()
        proto.connection_made(transport)
        proto.data_received(
            b"POST %b HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (path.encode(), len(body), body)
        )
        return pool.sent, b"".join(transport.out)
    finally:
        loop.close()


def pd_legs(path: str, body: dict | bytes, **kw: Any) -> tuple[dict, dict]:
    """The JSON bodies the prefill and the decode leg of one PD request get (see send_pd)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    sent, answer = send_pd(path, raw, **kw)
    assert len(sent) == 2, answer  # both legs sent, or the client's answer says why not
    return json.loads(wire_body(*sent[0])[1]), json.loads(wire_body(*sent[1])[1])
