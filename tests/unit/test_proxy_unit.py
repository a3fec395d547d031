"""ClientProtocol and relay, driven with raw bytes and a mock transport (no sockets).

The upstream pool is replaced by a recorder so each test plays the worker's side
by calling the leg callbacks (up_head / up_body / up_done / up_error) directly.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import httptools
import pytest

from fastroute.config import Config
from fastroute.dataplane.app import App
from fastroute.dataplane.upstream import Leg
from tests.stubs import PoolStandIn, stand_in_app
from tests.stubs import StubGroup as Group


class FakeTransport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.out = bytearray()
        self.closed = False
        self.reading = True

    def write(self, data: Any) -> None:
        assert not self.closed, "write after close"
        self.out += data

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


def _joined(body: Any) -> bytes:
    """A body handed to the pool apart from its head: bytes, or buffers written in order."""
    return b"".join(body) if type(body) is tuple else body


class FakeConn:
    def __init__(self) -> None:
        self.paused = False
        self.aborted = False

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def abort(self) -> None:
        self.aborted = True


class FakePool(PoolStandIn):
    def __init__(self) -> None:
        super().__init__()
        self.sent: list[tuple[bytes, Any]] = []
        self.bodies: list[bytes | None] = []  # bodies handed apart from their framed head
        self.authority = b"127.0.0.1:9"
        self.auth = b""

    def send(self, request: bytes, leg: Any, fresh: bool = False, body: bytes | None = None) -> FakeConn:
        conn = FakeConn()
        leg.conn = conn
        # What goes on the wire: the framed head and, when the pool was handed it apart, the body.
        self.sent.append((request if body is None else request + _joined(body), leg))
        self.bodies.append(None if body is None else _joined(body))
        return conn


class _Worker(SimpleNamespace):
    """A worker stand-in that is one worker by identity (pools are kept per worker object)."""

    __hash__ = object.__hash__


class Registry:
    def __init__(self) -> None:
        self.worker = _Worker(
            url="http://127.0.0.1:9", host="127.0.0.1", port=9, api_key=None, bootstrap_port=None, dp_size=1
        )
        self.target_info = [(self.worker, None)]
        self.groups = {"regular": Group()}
        self.is_ready = True

    def ready(self) -> bool:
        return self.is_ready

    def group(self, role: str) -> Group:
        return self.groups[role]

    def add_listener(self, callback: Any) -> None:
        """Its targets never change: nothing to announce."""


@pytest.fixture()
def env():
    loop = asyncio.new_event_loop()
    cfg = Config(worker_urls=["http://127.0.0.1:9"], max_payload_size=100, request_timeout_secs=60)
    reg = Registry()
    pool = FakePool()
    app = stand_in_app(cfg, reg, loop, pool)
    proto = app.protocol_factory()
    tr = FakeTransport()
    proto.connection_made(tr)
    yield SimpleNamespace(loop=loop, app=app, reg=reg, pool=pool, proto=proto, tr=tr)
    loop.close()


class _Parsed:
    def __init__(self) -> None:
        self.items: list[dict] = []
        self.p = httptools.HttpResponseParser(self)

    def on_message_begin(self) -> None:
        self.items.append({"headers": {}, "body": b"", "done": False})

    def on_header(self, n: bytes, v: bytes) -> None:
        self.items[-1]["headers"][n.decode().lower()] = v.decode()

    def on_headers_complete(self) -> None:
        self.items[-1]["status"] = self.p.get_status_code()

    def on_body(self, b: bytes) -> None:
        self.items[-1]["body"] += b

    def on_message_complete(self) -> None:
        self.items[-1]["done"] = True


def responses(out: bytes) -> list[dict]:
    parsed = _Parsed()
    if out:
        parsed.p.feed_data(bytes(out))
    return parsed.items


def post(body: bytes = b'{"text": "hi"}', extra: bytes = b"") -> bytes:
    return b"POST /generate HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n%b\r\n%b" % (len(body), extra, body)


def test_health_is_answered_inline_with_keep_alive(env) -> None:
    env.proto.data_received(b"GET /health HTTP/1.1\r\nHost: r\r\n\r\nGET /liveness HTTP/1.1\r\nHost: r\r\n\r\n")
    res = responses(env.tr.out)
    assert [(r["status"], r["body"]) for r in res] == [(200, b"OK"), (200, b"OK")]
    assert not env.tr.closed and env.pool.sent == []


def test_upstream_request_is_framed_with_whitelisted_headers(env) -> None:
    env.proto.data_received(
        post(extra=b"X-Request-Id: r1\r\nUser-Agent: ua\r\nAuthorization: Bearer c\r\ntracestate: ts\r\n")
    )
    ((req, _leg),) = env.pool.sent
    head, _, body = req.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    assert lines[0] == b"POST /generate HTTP/1.1"
    assert set(lines[1:]) == {
        b"Host: 127.0.0.1:9",
        b"Content-Type: application/json",
        b"Content-Length: 14",
        b"X-Request-Id: r1",
        b"tracestate: ts",
        b"Authorization: Bearer c",
    }
    assert body == b'{"text": "hi"}'


def test_pipelined_health_waits_for_proxied_response_then_order_kept(env) -> None:
    env.proto.data_received(post() + b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n")
    assert env.tr.out == b""  # /health must not overtake the pending proxied response
    ((_, leg),) = env.pool.sent
    leg.up_head(
        200,
        [
            (b"Content-Type", b"application/json"),
            (b"Content-Length", b"2"),
            (b"Connection", b"keep-alive"),
            (b"Keep-Alive", b"timeout=5"),
        ],
    )
    leg.up_body(b"{}")
    leg.up_done()
    res = responses(env.tr.out)
    assert [r["status"] for r in res] == [200, 200]
    assert res[0]["body"] == b"{}" and res[1]["body"] == b"OK"
    h = res[0]["headers"]
    assert h["content-length"] == "2" and "keep-alive" not in h and "connection" not in h
    assert h["x-request-id"].startswith("gnt-")
    (lease,) = env.reg.groups["regular"].leases
    assert lease.releases == 1


def test_chunked_upstream_is_relayed_chunk_by_chunk(env) -> None:
    env.proto.data_received(post(b'{"text": "hi", "stream": true}'))
    ((_, leg),) = env.pool.sent
    leg.up_head(200, [(b"Content-Type", b"text/event-stream"), (b"Transfer-Encoding", b"chunked")])
    assert env.tr.out == b""  # head goes out with the first body bytes (one write)
    leg.up_body(b"data: 1\n\n")
    assert env.tr.out == b""  # coalesced until the end of the upstream read
    leg.up_flush()
    first = bytes(env.tr.out)
    assert first.endswith(b"\r\n\r\n9\r\ndata: 1\n\n\r\n")
    assert b"transfer-encoding: chunked\r\n" in first
    leg.up_body(b"data: [DONE]\n\n")
    leg.up_done()
    (res,) = responses(env.tr.out)
    assert res["done"] and res["body"] == b"data: 1\n\ndata: [DONE]\n\n"
    assert env.tr.out.endswith(b"0\r\n\r\n")


def test_client_write_backpressure_pauses_upstream_reading(env) -> None:
    env.proto.data_received(post(b'{"text": "hi", "stream": true}'))
    ((_, leg),) = env.pool.sent
    leg.up_head(200, [(b"Transfer-Encoding", b"chunked")])
    env.proto.pause_writing()
    assert leg.conn.paused
    env.proto.resume_writing()
    assert not leg.conn.paused


def test_client_disconnect_aborts_upstream_and_releases_exactly_once(env) -> None:
    env.proto.data_received(post(b'{"text": "hi", "stream": true}'))
    ((_, leg),) = env.pool.sent
    conn = leg.conn
    leg.up_head(200, [(b"Transfer-Encoding", b"chunked")])
    leg.up_body(b"data: 1\n\n")
    env.tr.closed = True
    env.proto.connection_lost(None)
    assert conn.aborted
    (lease,) = env.reg.groups["regular"].leases
    assert lease.releases == 1
    assert env.app.live.exchanges == set()


def test_held_stream_keeps_neither_the_request_body_nor_its_parse(env) -> None:
    """Memory per stream: what no later attempt can read is let go at the head."""
    assert not hasattr(env.proto, "__dict__")  # slots: no per-connection instance dict
    env.proto.data_received(post(b'{"text": "hi", "stream": true}'))
    ((_, leg),) = env.pool.sent
    # the pick has read the decoded prompt: it is not held while the request waits ...
    assert leg.meta.fields is None
    # ... and the body bytes a retry decodes it from again are
    assert leg.req.body and leg.meta.obj is not None  # a retry may still need them
    # the pool got the client's body itself beside the framed head: no second copy is held
    assert env.pool.bodies == [leg.req.body] and env.pool.bodies[0] is leg.req.body
    leg.up_head(200, [(b"Transfer-Encoding", b"chunked")])
    assert leg.req.body == b"" and leg.meta.obj is None
    leg.up_body(b"data: 1\n\n")
    leg.up_done()
    (res,) = responses(env.tr.out)
    assert res["status"] == 200 and res["body"] == b"data: 1\n\n"


def test_upstream_error_before_head_is_502_after_head_cuts_stream(env) -> None:
    env.proto.data_received(post())
    ((_, leg),) = env.pool.sent
    leg.up_error(ConnectionResetError("reset"))
    (res,) = responses(env.tr.out)
    assert res["status"] == 502 and b"bad_gateway" in res["body"]
    assert not env.tr.closed
    env.tr.out.clear()
    env.proto.data_received(post(b'{"text": "hi", "stream": true}'))
    (_, leg2) = env.pool.sent[1]
    leg2.up_head(200, [(b"Transfer-Encoding", b"chunked")])
    leg2.up_body(b"data: 1\n\n")
    leg2.up_flush()
    leg2.up_error(ConnectionResetError("reset"))
    assert env.tr.closed and not env.tr.out.endswith(b"0\r\n\r\n")
    assert [lease.releases for lease in env.reg.groups["regular"].leases] == [1, 1]


def test_request_timeout_gives_504_and_releases(env) -> None:
    env.proto.data_received(post())
    ((_, leg),) = env.pool.sent
    for ex in list(env.app.live.exchanges):
        ex.deadline = 0.0
    env.app.sweeper.tick()
    (res,) = responses(env.tr.out)
    assert res["status"] == 504
    assert leg.conn is None or leg.conn.aborted
    assert env.reg.groups["regular"].leases[0].releases == 1


def test_malformed_request_gets_400_json_and_close(env) -> None:
    env.proto.data_received(b"NOT HTTP AT ALL\r\n\r\n")
    (res,) = responses(env.tr.out)
    assert res["status"] == 400 and b'"code":"bad_request"' in res["body"]
    assert env.tr.closed


def test_payload_limit_413_without_reading_upstream(env) -> None:
    env.proto.data_received(post(b'{"text": "' + b"x" * 200 + b'"}'))
    (res,) = responses(env.tr.out)
    assert res["status"] == 413 and env.pool.sent == []


def test_expect_100_continue(env) -> None:
    env.proto.data_received(b"POST /generate HTTP/1.1\r\nHost: r\r\nContent-Length: 14\r\nExpect: 100-continue\r\n\r\n")
    assert env.tr.out == b"HTTP/1.1 100 Continue\r\n\r\n"
    env.proto.data_received(b'{"text": "hi"}')
    assert len(env.pool.sent) == 1


def test_header_read_timeout_closes_idle_but_not_busy_connections(env) -> None:
    env.proto.data_received(b"GET /health HTTP/1.1\r\nHo")  # head never completes
    env.proto.head_deadline = 0.001
    env.app.sweeper.tick()
    assert env.tr.closed
    busy = env.app.protocol_factory()
    tr = FakeTransport()
    busy.connection_made(tr)
    busy.data_received(post())
    assert busy.head_deadline == 0.0  # no header timeout while a response is pending
    env.app.sweeper.tick()
    assert not tr.closed


def test_not_ready_is_503(env) -> None:
    env.reg.is_ready = False
    env.proto.data_received(post())
    (res,) = responses(env.tr.out)
    assert res["status"] == 503 and b"no_available_workers" in res["body"]
    assert res["headers"]["x-smg-error-code"] == "no_available_workers"


def test_http10_client_gets_close_delimited_stream(env) -> None:
    body = b'{"text": "hi", "stream": true}'
    env.proto.data_received(b"POST /generate HTTP/1.0\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
    ((_, leg),) = env.pool.sent
    leg.up_head(200, [(b"Transfer-Encoding", b"chunked")])
    leg.up_body(b"data: 1\n\n")
    leg.up_done()
    assert b"transfer-encoding" not in bytes(env.tr.out).lower()
    assert env.tr.out.endswith(b"\r\n\r\ndata: 1\n\n") and env.tr.closed


@pytest.mark.parametrize(
    "version, connection, chunked",
    [
        (b"1.0", b"Connection: keep-alive\r\n", False),  # kept alive, still 1.0: no chunked
        (b"1.0", b"connection: Keep-Alive\r\n", False),
        (b"1.1", b"", True),
        (b"1.1", b"Connection: keep-alive\r\n", True),
    ],
)
def test_only_an_http11_client_gets_a_chunked_stream(env, version: bytes, connection: bytes, chunked: bool) -> None:
    body = b'{"text": "hi", "stream": true}'
    env.proto.data_received(
        b"POST /generate HTTP/%b\r\n%bContent-Length: %d\r\n\r\n%b" % (version, connection, len(body), body)
    )
    ((_, leg),) = env.pool.sent
    leg.up_head(200, [(b"Transfer-Encoding", b"chunked")])
    leg.up_body(b"data: 1\n\n")
    leg.up_done()
    out = bytes(env.tr.out)
    assert (b"transfer-encoding: chunked" in out.lower()) is chunked
    assert out.endswith(b"0\r\n\r\n" if chunked else b"\r\n\r\ndata: 1\n\n")
    assert env.tr.closed is not chunked  # 1.0: the body ends at the close


def test_payload_limit_by_content_length_answers_before_the_body(env) -> None:
    env.proto.data_received(
        b"POST /generate HTTP/1.1\r\nHost: r\r\nContent-Length: 5000\r\nExpect: 100-continue\r\n\r\n"
    )
    (res,) = responses(env.tr.out)
    assert res["status"] == 413 and b"payload_too_large" in res["body"]
    assert env.tr.closed and env.pool.sent == []
    env.proto.data_received(b"x" * 100)  # late body bytes are ignored


class _StubPool(PoolStandIn):
    def __init__(self) -> None:
        super().__init__()
        self.resent: list[tuple[bytes, Any, bool]] = []
        self.bodies: list[bytes | None] = []
        self.discarded = 0

    def send(self, request: bytes, leg: Any, fresh: bool = False, body: bytes | None = None) -> None:
        self.resent.append((request if body is None else request + _joined(body), leg, fresh))
        self.bodies.append(None if body is None else _joined(body))

    def discard(self, conn: Any) -> None:
        self.discarded += 1


class _Leg(Leg):
    def __init__(self) -> None:
        self.conn = None
        self.events: list[Any] = []

    def up_head(self, status: int, headers: list) -> None:
        self.events.append(("head", status))

    def up_body(self, data: bytes) -> None:
        self.events.append(("body", data))

    def up_done(self) -> None:
        self.events.append("done")

    def up_error(self, exc: BaseException) -> None:
        self.events.append(("error", type(exc).__name__))

    def up_flush(self) -> None:
        pass


def test_reused_connection_closed_before_any_byte_is_resent_once_on_a_fresh_one() -> None:
    from fastroute.dataplane.upstream import UpstreamConnection

    pool, leg = _StubPool(), _Leg()
    conn = UpstreamConnection(pool)  # type: ignore[arg-type]
    conn.leg, conn.request, conn.reused = leg, b"REQ", True
    conn.connection_lost(None)
    assert pool.resent == [(b"REQ", leg, True)] and leg.events == []
    # a fresh connection failing the same way is an error, not another resend
    conn2 = UpstreamConnection(pool)  # type: ignore[arg-type]
    conn2.leg, conn2.request = leg, b"REQ"
    conn2.connection_lost(ConnectionResetError())
    assert leg.events == [("error", "UpstreamError")] and len(pool.resent) == 1
    # a body sent beside its head is re-sent beside it: the same object, not a copy
    body = b'{"text": "hi"}'
    conn3 = UpstreamConnection(pool)  # type: ignore[arg-type]
    conn3.leg, conn3.request, conn3.body, conn3.reused = leg, b"HEAD", body, True
    conn3.connection_lost(None)
    assert pool.resent[-1] == (b"HEAD" + body, leg, True) and pool.bodies[-1] is body
    assert conn3.request is None and conn3.body is None


def test_close_delimited_upstream_response_ends_at_eof() -> None:
    from fastroute.dataplane.upstream import UpstreamConnection

    pool, leg = _StubPool(), _Leg()
    conn = UpstreamConnection(pool)  # type: ignore[arg-type]
    conn.leg = leg
    conn.data_received(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\ndata: 1\n\n")
    conn.connection_lost(None)
    assert leg.events == [("head", 200), ("body", b"data: 1\n\n"), "done"]


def test_delimited_upstream_head_is_not_kept_and_a_cut_is_still_an_error() -> None:
    from fastroute.dataplane.upstream import UpstreamConnection

    pool, leg = _StubPool(), _Leg()
    conn = UpstreamConnection(pool)  # type: ignore[arg-type]
    conn.leg = leg
    conn.data_received(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n9\r\ndata: 1\n\n\r\n")
    assert conn.headers == []  # the head went to the leg; a held stream does not keep it
    conn.connection_lost(None)
    assert leg.events == [("head", 200), ("body", b"data: 1\n\n"), ("error", "UpstreamError")]


# -- routes, pools and flow control ----------------------------------------------------------


class _ListeningRegistry(Registry):
    """A registry that announces target changes, as the real one does (targets listener)."""

    def __init__(self) -> None:
        super().__init__()
        self.listeners: list[Any] = []
        self.groups["regular"].targets = []  # no worker until set_worker

    def add_listener(self, callback: Any) -> None:
        self.listeners.append(callback)

    def set_worker(self, worker: Any) -> None:
        self.target_info = [(worker, None)]
        self.groups["regular"].targets = [0]
        for cb in self.listeners:
            cb("regular")


def test_worker_re_added_under_the_same_url_gets_its_new_key(monkeypatch) -> None:
    """Pools (and the framing key) follow the worker, not its URL: a worker re-added under the
    same URL with a new api_key must not reuse connections made for the old one."""
    from fastroute.control.worker import Worker
    from fastroute.dataplane import upstreams as upstreams_module

    made: list[Any] = []

    class RecordingPool(FakePool):
        def __init__(self, host: str, port: int, idle: float, loop: Any) -> None:
            super().__init__()
            self.retired = False
            made.append(self)

        def retire(self) -> None:
            self.retired = True

    monkeypatch.setattr(upstreams_module, "Pool", RecordingPool)
    loop = asyncio.new_event_loop()
    try:
        reg = _ListeningRegistry()
        app = App(Config(worker_urls=["http://127.0.0.1:9"]), reg, loop)
        url = "http://127.0.0.1:9"
        reg.set_worker(Worker(url=url, role="regular", host="127.0.0.1", port=9, api_key="old"))
        proto = app.protocol_factory()
        tr = FakeTransport()
        proto.connection_made(tr)

        def answer(pool: FakePool) -> bytes:
            request, leg = pool.sent[-1]
            leg.up_head(200, [(b"Content-Length", b"2")])
            leg.up_body(b"{}")
            leg.up_done()
            return request

        proto.data_received(post(extra=b"Authorization: Bearer client\r\n"))
        assert b"Authorization: Bearer old\r\n" in answer(made[0])
        reg.set_worker(Worker(url=url, role="regular", host="127.0.0.1", port=9, api_key="new"))
        assert made[0].retired and len(made) == 2
        proto.data_received(post())
        assert b"Authorization: Bearer new\r\n" in answer(made[1])
        assert [r["status"] for r in responses(tr.out)] == [200, 200]
    finally:
        loop.close()


def test_pool_idle_timeout_zero_turns_connection_reuse_off() -> None:
    """--upstream-pool-idle-timeout-secs 0 stays 0 (no reuse), not the 3 s default."""
    from fastroute.dataplane.upstream import UpstreamConnection

    loop = asyncio.new_event_loop()
    try:
        reg = Registry()
        app = App(Config(worker_urls=["http://127.0.0.1:9"], upstream_pool_idle_timeout_secs=0), reg, loop)
        pool = app.upstreams.pool_for(reg.worker)
        conn = UpstreamConnection(pool)
        pool.busy.add(conn)
        pool.release(conn)
        assert conn.closed and pool.idle == [] and not pool.busy
    finally:
        loop.close()


def test_backpressure_at_the_end_of_a_response_leaves_the_pooled_connection_alone(env) -> None:
    """The client's write buffer may fill while the last bytes are flushed, after the upstream
    connection went back to the pool: that connection must not be paused (it would stall the
    next request that reuses it)."""
    proto = env.proto

    class FillingTransport(FakeTransport):
        def write(self, data: Any) -> None:
            super().write(data)
            if data.endswith(b"0\r\n\r\n"):
                proto.pause_writing()  # asyncio calls this from write() above the high-water mark

    tr = FillingTransport()
    proto.transport = proto.flow.transport = tr
    proto.data_received(post(b'{"text": "hi", "stream": true}'))
    ((_, leg),) = env.pool.sent
    conn = leg.conn
    leg.up_head(200, [(b"Transfer-Encoding", b"chunked")])
    leg.up_body(b"data: 1\n\n")
    leg.up_done()  # the pool took the connection back just before this call
    assert proto.flow.writing_paused and not conn.paused
    proto.resume_writing()
    assert [r["status"] for r in responses(tr.out)] == [200]


def test_metrics_off_is_the_null_telemetry_and_metrics_on_count_each_event(env) -> None:
    from fastroute.control.metrics import Stats
    from fastroute.dataplane.telemetry import NULL_TELEMETRY, RequestTelemetry, Telemetry

    health = b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n"
    assert env.app.tel is NULL_TELEMETRY and env.app.admission.tel is NULL_TELEMETRY
    env.proto.data_received(health)  # answered; there is nothing to count into
    st = Stats()
    env.app.stats = st
    assert type(env.app.tel) is RequestTelemetry and env.app.admission.tel is env.app.tel
    env.proto.data_received(health)
    env.proto.data_received(post())
    assert st.http_requests == {("GET", "/health"): 1, ("POST", "/generate"): 1}
    assert st.http_responses == {("200", "", "/health"): 1}
    assert st.router_requests == {("regular", "generate", "unknown", "false"): 1}
    assert st.pick_seconds.counts and sum(st.pick_seconds.counts) == 1
    env.app.stats = None
    assert env.app.tel is NULL_TELEMETRY and env.app.admission.tel is NULL_TELEMETRY
    # Every event the request path sends has a counting implementation.
    events = {n for n in dir(Telemetry) if not n.startswith("_")}
    assert events <= set(vars(RequestTelemetry)), events - set(vars(RequestTelemetry))


class _TextGroup(Group):
    """A group whose pick reads the routing text, as cache_aware's does."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: list[str | None] = []

    def acquire(self, tokens: int = 0, key: bytes | None = None, meta: Any = None, out_tokens: int = 0) -> Any:
        self.texts.append(meta.routing_text())
        return super().acquire(tokens, key, meta, out_tokens)


def test_a_retry_pick_reads_the_prompt_the_first_pick_let_go(env) -> None:
    group = env.reg.groups["regular"] = _TextGroup()
    env.proto.data_received(post(b'{"text": "the prompt", "stream": true}'))
    ((_, leg),) = env.pool.sent
    assert leg.meta.fields is None  # let go after the first pick
    leg.up_head(503, [(b"Content-Length", b"0")])  # retryable: a fresh pick after the backoff
    for _ in range(100):  # (the backoff is a loop timer)
        if len(env.pool.sent) == 2:
            break
        env.loop.run_until_complete(asyncio.sleep(0.05))
    assert group.texts == ["the prompt", "the prompt"] and len(env.pool.sent) == 2
    assert leg.meta.fields is None  # and let go again after it


def test_an_error_reply_is_labelled_by_its_path_without_the_query(env) -> None:
    from fastroute.control.metrics import Stats

    st = Stats()
    env.app.stats = st  # (as the server does, before the connection is made)
    proto, tr = env.app.protocol_factory(), FakeTransport()
    proto.connection_made(tr)
    body = b"{not json"
    proto.data_received(
        b"POST /generate?trace=1 HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body)
    )
    assert [r["status"] for r in responses(tr.out)] == [400]
    assert [(status, path) for status, _code, path in st.http_responses] == [("400", "/generate")]
    assert sum(st.overhead_seconds.counts) == 0  # refused before any attempt
