"""The pool hands out and takes back a connection exactly once (twice would let two requests share
one socket): unit tests over a fake transport (a few over local sockets: connects, socket options)."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import pytest
import uvloop

from fastroute.dataplane.upstream import Leg, Pool, UpstreamConnection
from tests.unit.test_proxy_unit import FakeTransport


class _Leg(Leg):
    def __init__(self) -> None:
        self.conn: Any = None
        self.events: list[Any] = []

    def up_head(self, status: int, headers: list) -> None:
        self.events.append(("head", status))

    def up_body(self, data: bytes) -> None:
        self.events.append(("body", bytes(data)))

    def up_done(self) -> None:
        self.conn = None
        self.events.append("done")

    def up_error(self, exc: BaseException) -> None:
        self.conn = None
        self.events.append(("error", str(exc)))

    def up_flush(self) -> None:
        pass


OK = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok"


def _served(pool: Pool) -> tuple[UpstreamConnection, _Leg, FakeTransport]:
    """A connection of ``pool`` serving a fresh leg over a fake transport."""
    leg = _Leg()
    conn = UpstreamConnection(pool)
    conn.leg = leg
    leg.conn = conn
    pool.busy.add(conn)
    t = FakeTransport()
    conn.connection_made(t)
    return conn, leg, t


def _pool() -> tuple[Pool, asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    return Pool("127.0.0.1", 9, 3.0, loop), loop


def test_release_is_idempotent_and_needs_no_leg() -> None:
    pool, loop = _pool()
    try:
        conn, leg, _ = _served(pool)
        conn.data_received(OK)
        assert leg.events == [("head", 200), ("body", b"ok"), "done"]
        assert pool.idle == [conn]
        pool.release(conn)
        pool.release(conn)
        assert pool.idle == [conn]  # never twice
        # a connection that serves a leg is not taken back
        other, _, _ = _served(pool)
        pool.release(other)
        assert other not in pool.idle
    finally:
        pool.close()
        loop.close()


def test_bytes_on_an_idle_connection_abort_it() -> None:
    pool, loop = _pool()
    try:
        conn, _, t = _served(pool)
        conn.data_received(OK)
        assert pool.idle == [conn]
        conn.data_received(OK)  # a late response nobody asked for
        assert conn.closed and t.closed and pool.idle == []
    finally:
        pool.close()
        loop.close()


def test_a_second_response_in_the_same_read_aborts_before_pooling() -> None:
    pool, loop = _pool()
    try:
        conn, leg, t = _served(pool)
        conn.data_received(OK + OK)
        assert leg.events == [("head", 200), ("body", b"ok"), "done"]
        assert conn.closed and t.closed and pool.idle == []
    finally:
        pool.close()
        loop.close()


def test_1xx_heads_are_skipped_and_101_fails_the_leg() -> None:
    pool, loop = _pool()
    try:
        conn, leg, _ = _served(pool)
        conn.data_received(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: <x>\r\n\r\n")
        assert leg.events == [] and conn.leg is leg
        conn.data_received(OK)
        assert leg.events == [("head", 200), ("body", b"ok"), "done"] and pool.idle == [conn]

        conn2, leg2, t2 = _served(pool)
        conn2.data_received(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\nconnection: upgrade\r\n\r\n")
        assert leg2.events and leg2.events[0][0] == "error" and "101" in leg2.events[0][1]
        assert conn2.closed and t2.closed and conn2 not in pool.idle
    finally:
        pool.close()
        loop.close()


def test_a_connection_without_a_leg_is_never_paused() -> None:
    pool, loop = _pool()
    try:
        conn, leg, t = _served(pool)
        conn.data_received(OK)
        conn.pause()  # e.g. a stale flow-control binding after the answer was written
        assert not conn.paused and t.reading
    finally:
        pool.close()
        loop.close()


class _Writes(FakeTransport):
    """A fake transport that records how each request was handed to it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, Any]] = []

    def write(self, data: Any) -> None:
        self.calls.append(("write", data))
        super().write(data)

    def writelines(self, parts: Any) -> None:
        parts = tuple(parts)
        self.calls.append(("writelines", parts))
        super().write(b"".join(parts))


HEAD = b"POST /generate HTTP/1.1\r\nHost: w\r\nContent-Length: 4108\r\n\r\n"


def test_a_body_sent_apart_is_written_beside_its_head_and_never_copied() -> None:
    """The client's body goes out as the object it came in (one writev with the framed head), on
    a fresh connection and on a reused one, and is let go with the head at the first answer byte."""
    pool, loop = _pool()
    body = b'{"text": "' + b"x" * 4096 + b'"}'
    try:
        # fresh: written when the connection is made
        leg = _Leg()
        conn = UpstreamConnection(pool)
        conn.request, conn.body, conn.leg = HEAD, body, leg
        leg.conn = conn
        pool.busy.add(conn)
        t = _Writes()
        conn.connection_made(t)
        assert t.calls == [("writelines", (HEAD, body))] and t.calls[0][1][1] is body
        conn.data_received(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        assert conn.request is None and conn.body is None  # no re-send can need them now
        conn.data_received(b"0\r\n\r\n")
        assert pool.idle == [conn]
        # reused: written at once by send
        t.calls.clear()
        leg2 = _Leg()
        assert pool.send(HEAD, leg2, False, body) is conn
        assert t.calls == [("writelines", (HEAD, body))] and t.calls[0][1][1] is body
        # a request framed whole is one write, as before
        conn.data_received(OK)
        t.calls.clear()
        pool.send(HEAD + b"{}", _Leg())
        assert t.calls == [("write", HEAD + b"{}")]
    finally:
        pool.close()
        loop.close()


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return port


def test_a_connect_is_the_loops_own_task_and_a_refusal_fails_the_leg() -> None:
    """While a new connection waits for its connect it holds only the loop's connect task (no
    coroutine or closure of ours); a refused connect fails the leg with a ConnectError."""
    loop = asyncio.new_event_loop()
    pool = Pool("127.0.0.1", _closed_port(), 3.0, loop)
    try:
        leg = _Leg()
        conn = pool.send(HEAD, leg, False, b"{}")
        task = conn.connect_task
        assert task is not None and task.get_coro().__name__ == "create_connection"
        assert conn() is conn  # its own protocol factory
        loop.run_until_complete(asyncio.sleep(0.2))
        assert conn.connect_task is None and conn.closed and conn not in pool.busy
        assert leg.events and leg.events[0][0] == "error" and "connect to 127.0.0.1" in leg.events[0][1]
        # aborted while connecting: cancelled quietly, the leg hears nothing
        leg2 = _Leg()
        conn2 = pool.send(HEAD, leg2)
        conn2.abort()
        loop.run_until_complete(asyncio.sleep(0.05))
        assert conn2.connect_task is None and leg2.events == []
    finally:
        pool.close()
        loop.close()


def test_a_connection_makes_its_parser_at_the_first_answer_byte() -> None:
    """A connection waiting for its connect or its worker holds no response parser."""
    pool, loop = _pool()
    try:
        leg = _Leg()
        conn = UpstreamConnection(pool)
        conn.request, conn.leg = HEAD, leg
        leg.conn = conn
        pool.busy.add(conn)
        assert conn.parser is None
        conn.connection_made(FakeTransport())
        assert conn.parser is None  # request sent, no answer yet
        conn.data_received(OK)
        assert conn.parser is not None and leg.events == [("head", 200), ("body", b"ok"), "done"]
        parser = conn.parser
        leg2 = _Leg()
        pool.send(HEAD, leg2)
        conn.data_received(OK)
        assert conn.parser is parser and leg2.events == [("head", 200), ("body", b"ok"), "done"]  # reused
    finally:
        pool.close()
        loop.close()


@pytest.mark.parametrize("loop_kind", ["uvloop", "asyncio"])
def test_the_loop_sets_tcp_nodelay_on_both_sockets_of_a_stream(loop_kind: str) -> None:
    """The data plane sets no socket option itself: small SSE events leave at once because the
    loop sets TCP_NODELAY on every TCP socket it accepts (client side) and connects (upstream)."""
    from fastroute.config import Config
    from fastroute.dataplane.app import App
    from fastroute.dataplane.protocol import ClientProtocol
    from tests.unit.test_proxy_unit import Registry

    loop = uvloop.new_event_loop() if loop_kind == "uvloop" else asyncio.new_event_loop()
    app = App(Config(worker_urls=["http://127.0.0.1:9"]), Registry(), loop)  # type: ignore[arg-type]
    protos: list[ClientProtocol] = []

    def accept() -> ClientProtocol:
        protos.append(app.protocol_factory())
        return protos[-1]

    async def run() -> tuple[int, int]:
        server = await loop.create_server(accept, "127.0.0.1", 0)  # type: ignore[arg-type]
        pool = Pool("127.0.0.1", server.sockets[0].getsockname()[1], 3.0, loop)
        conn = pool.send(HEAD, _Leg())
        for _ in range(100):
            if protos and conn.transport is not None:
                break
            await asyncio.sleep(0.01)
        opt = (socket.IPPROTO_TCP, socket.TCP_NODELAY)
        up = conn.transport.get_extra_info("socket").getsockopt(*opt)  # type: ignore[union-attr]
        client = protos[0].transport.get_extra_info("socket").getsockopt(*opt)  # type: ignore[union-attr]
        pool.close()
        server.close()
        await asyncio.sleep(0.01)
        return up, client

    try:
        assert loop.run_until_complete(run()) == (1, 1)
    finally:
        loop.close()
