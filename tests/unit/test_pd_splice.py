"""What a PD request hands each leg's pool: the client's body with the bootstrap fields spliced
in, whole for a small body, as (framed head, views of the client's bytes around the fields)
for a large one, and the same bytes on the wire either way."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from fastroute.config import Config
from fastroute.dataplane import route as _route
from tests.stubs import PoolStandIn, StubConn, StubRegistry, StubTransport, stand_in_app

PD = {
    "pd_disaggregation": True,
    "prefill": [("http://127.0.0.1:9", 8998)],
    "decode": ["http://127.0.0.1:10"],
    "dp_aware": True,
}


class _Pool(PoolStandIn):
    authority = b"127.0.0.1:9"
    auth = b""

    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[bytes, Any]] = []

    def send(self, request: bytes, leg: Any, fresh: bool = False, body: Any = None) -> StubConn:
        leg.conn = StubConn()
        self.sent.append((request, body))
        return leg.conn


def _legs(body: bytes) -> list[tuple[bytes, Any]]:
    loop = asyncio.new_event_loop()
    try:
        pool = _Pool()
        app = stand_in_app(Config(**PD), StubRegistry(), loop, pool)
        proto = app.protocol_factory()
        proto.connection_made(StubTransport())
        proto.data_received(
            b"POST /generate HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
        )
        return pool.sent
    finally:
        loop.close()


@pytest.mark.parametrize("size", [100, _route._VIEWS_FROM - 200, _route._VIEWS_FROM + 10, 60_000])
def test_each_leg_gets_the_body_with_its_fields_and_a_matching_length(size: int) -> None:
    text = "x" * max(1, size - 40)
    body = json.dumps({"text": text, "sampling_params": {"max_new_tokens": 4}}).encode()
    sent = _legs(body)
    assert len(sent) == 2  # prefill and decode
    rooms = set()
    for request, parts in sent:
        large = len(body) >= _route._VIEWS_FROM
        assert (parts is not None) == large  # views only for a large body
        if large:
            assert type(parts) is tuple and len(parts) == 3
            assert all(type(p) is memoryview for p in (parts[0], parts[2]))  # the client's bytes, not copies
            head, wire = request, request + b"".join(parts)
        else:
            head, _, _ = request.partition(b"\r\n\r\n")
            head, wire = head + b"\r\n\r\n", request
        sent_body = wire[len(head) :]
        assert b"Content-Length: %d\r\n" % len(sent_body) in head
        obj = json.loads(sent_body)
        assert obj["text"] == text and obj["bootstrap_host"] == "127.0.0.1" and obj["bootstrap_port"] == 8998
        rooms.add(obj["bootstrap_room"])
    assert len(rooms) == 1  # one room for both legs
