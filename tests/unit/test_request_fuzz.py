"""Property tests of the request parsing path: raw bytes into ClientProtocol, mock transport.

Whatever arrives (garbage, fragments, pipelined mixes of valid and hostile requests, any split
into reads), the protocol must never raise, must only ever write well-formed HTTP responses,
must answer every complete well-formed request in order, and must release every lease exactly
once by the time the connection is gone.
"""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace
from typing import Any

import httptools
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastroute.config import Config
from fastroute.dataplane.app import App
from fastroute.dataplane.protocol import ClientProtocol
from tests.stubs import StubGroup as Group
from tests.stubs import StubPool as Pool
from tests.stubs import stand_in_app


class Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False

    def write(self, data: Any) -> None:
        assert not self.closed, "write after close"
        self.out += data

    def close(self) -> None:
        self.closed = True

    abort = close

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


# The App of each connection make() returned (check_released reads its books).
_APPS: dict[int, App] = {}


def make() -> tuple[ClientProtocol, Transport, Pool, Group, asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    worker = SimpleNamespace(
        url="http://127.0.0.1:9", host="127.0.0.1", port=9, api_key=None, bootstrap_port=None, dp_size=1
    )
    group = Group()
    registry = SimpleNamespace(
        target_info=[(worker, None)], ready=lambda: True, group=lambda role: group, add_listener=lambda cb: None
    )
    cfg = Config(
        worker_urls=["http://127.0.0.1:9"],
        max_payload_size=4096,
        request_timeout_secs=60,
        max_concurrent_requests=2,
        queue_size=4,
    )
    pool = Pool()
    app = stand_in_app(cfg, registry, loop, pool)
    proto = app.protocol_factory()
    _APPS[id(proto)] = app
    tr = Transport()
    proto.connection_made(tr)
    return proto, tr, pool, group, loop


def serve_upstream(pool: Pool) -> None:
    """Answer every leg the proxy sent (answers may start the next pipelined request)."""
    served = 0
    while served < len(pool.legs):
        leg = pool.legs[served]
        served += 1
        if leg.conn is None:
            continue
        leg.up_head(200, [(b"content-type", b"application/json"), (b"content-length", b"2")])
        leg.up_body(b"{}")
        leg.up_done()


class Parsed:
    def __init__(self) -> None:
        self.statuses: list[int] = []
        self.complete = 0
        self.p = httptools.HttpResponseParser(self)

    def on_headers_complete(self) -> None:
        self.statuses.append(self.p.get_status_code())

    def on_message_complete(self) -> None:
        self.complete += 1


def parse_out(data: bytes) -> Parsed:
    r = Parsed()
    r.p.feed_data(bytes(data))  # raises on anything that is not HTTP/1.1 responses
    return r


def feed(proto: ClientProtocol, data: bytes, cuts: list[int]) -> None:
    points = sorted({c % (len(data) + 1) for c in cuts})
    prev = 0
    for c in points + [len(data)]:
        if c > prev:
            proto.data_received(data[prev:c])
            prev = c


def check_released(proto: ClientProtocol, tr: Transport, group: Group) -> None:
    proto.connection_lost(None)
    assert all(lease.releases == 1 for lease in group.leases), [lease.releases for lease in group.leases]
    app = _APPS.pop(id(proto))
    assert not app.live.exchanges
    assert app.admission.active == 0 and not app.admission.queue


# -- strategies ---------------------------------------------------------------------------------

json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-10, 10**6) | st.text(max_size=8),
    lambda kids: (
        st.lists(kids, max_size=3)
        | st.dictionaries(
            st.sampled_from(
                [
                    "text",
                    "stream",
                    "input_ids",
                    "sampling_params",
                    "max_new_tokens",
                    "messages",
                    "prompt",
                    "model",
                    "return_logprob",
                    "rid",
                ]
            ),
            kids,
            max_size=4,
        )
    ),
    max_leaves=8,
)


@st.composite
def good_request(draw: Any) -> bytes:
    kind = draw(st.sampled_from(["health", "generate", "chat", "notfound", "badjson", "wrongtype"]))
    if kind == "health":
        return b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n"
    if kind == "notfound":
        return b"GET /nope HTTP/1.1\r\nHost: r\r\n\r\n"
    if kind == "generate":
        body = json.dumps({"text": draw(st.text(max_size=20)), "stream": draw(st.booleans())}).encode()
        path = b"/generate"
    elif kind == "chat":
        body = json.dumps({"messages": [{"role": "user", "content": draw(st.text(max_size=20))}]}).encode()
        path = b"/v1/chat/completions"
    elif kind == "badjson":
        body, path = draw(st.binary(max_size=30)), b"/generate"
    else:
        body, path = json.dumps(draw(json_value)).encode(), b"/generate"
    if draw(st.booleans()):
        return b"POST %b HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n%b" % (path, len(body), body)
    chunks = b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in (body[:5], body[5:]) if p)
    return b"POST %b HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n%b0\r\n\r\n" % (path, chunks)


hostile = st.sampled_from(
    [
        b"GARBAGE\r\n\r\n",
        b"POST /generate HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"POST /generate HTTP/1.1\r\nContent-Length: 99999\r\n\r\n",
        b"GET / HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n",
        b"GET /health HTTP/1.1\r\nUpgrade: websocket\r\nConnection: upgrade\r\n\r\n",
        b"\x00\xff\r\n",
        b'POST /generate HTTP/1.1\r\nContent-Length: 10\r\n\r\n{"te',  # truncated: waits
        b"GET /health HTTP/1.0\r\n\r\n",
    ]
)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(data=st.binary(max_size=400), cuts=st.lists(st.integers(0, 400), max_size=6))
def test_arbitrary_bytes_never_crash_and_never_leak(data: bytes, cuts: list[int]) -> None:
    proto, tr, pool, group, loop = make()
    try:
        feed(proto, data, cuts)
        serve_upstream(pool)
        parse_out(tr.out)
        check_released(proto, tr, group)
    finally:
        loop.close()


@SETTINGS
@given(
    reqs=st.lists(st.one_of(good_request(), hostile), min_size=1, max_size=6),
    cuts=st.lists(st.integers(0, 2000), max_size=8),
    early_close=st.booleans(),
)
def test_pipelined_mix_is_answered_in_order_or_refused_and_never_leaks(
    reqs: list[bytes], cuts: list[int], early_close: bool
) -> None:
    proto, tr, pool, group, loop = make()
    try:
        feed(proto, b"".join(reqs), cuts)
        if early_close:  # client leaves with requests in flight / queued
            check_released(proto, tr, group)
            return
        serve_upstream(pool)
        out = parse_out(tr.out)
        # Well-formed requests before the first hostile (or closing) one are all answered.
        n_good = 0
        for r in reqs:
            if (
                r.startswith(b"GARBAGE")
                or b"Transfer-Encoding: chunked\r\n\r\n" in r
                and b"Content-Length" in r
                or r.startswith(b"\x00")
                or b"a" * 1000 in r
                or b"Upgrade" in r
                or b"99999" in r
                or r.endswith(b'{"te')
            ):
                break
            n_good += 1
            if b"HTTP/1.0" in r:
                break  # answered, then the connection closes: later requests are dropped
        assert out.complete >= n_good, (out.statuses, n_good)
        expected = {200, 400, 404, 413, 431}
        assert set(out.statuses) <= expected, out.statuses
        if n_good == len(reqs) and not tr.closed:
            # Everything was well-formed and kept alive: nothing is left waiting.
            assert not proto.busy and not proto.queue
        check_released(proto, tr, group)
    finally:
        loop.close()
