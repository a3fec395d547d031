"""Minimal HTTP/1.1 plumbing for the simulator: an httptools server protocol and a keep-alive client.

Owns only the wire: request parsing, response framing (Content-Length bodies and chunked
streams, which is what SGLang's uvicorn sends for SSE), disconnect detection, and a small
client connection that the load generator and the simulated decode reuse. No routing logic
lives here; an application is any ``async def app(req: Request, resp: Responder)``.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import httptools

_REASONS = {
    200: b"OK",
    202: b"Accepted",
    204: b"No Content",
    400: b"Bad Request",
    404: b"Not Found",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    413: b"Payload Too Large",
    500: b"Internal Server Error",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
}
# Status lines are prebuilt once; per-response work is one join.
_STATUS_LINES = {code: b"HTTP/1.1 %d %s\r\n" % (code, reason) for code, reason in _REASONS.items()}
CT_JSON = b"application/json"
CT_TEXT = b"text/plain; charset=utf-8"
CT_SSE = b"text/event-stream"


def _status_line(code: int) -> bytes:
    line = _STATUS_LINES.get(code)
    return line if line is not None else b"HTTP/1.1 %d Status\r\n" % code


class Request:
    """One parsed request. ``headers`` keeps lower-cased names; values are raw bytes."""

    __slots__ = ("method", "path", "query", "headers", "body")

    def __init__(self, method: str, path: str, query: str, headers: dict[bytes, bytes], body: bytes) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        return json.loads(self.body) if self.body else {}

    def query_params(self) -> dict[str, str]:
        out: dict[str, str] = {}
        if self.query:
            for part in self.query.split("&"):
                k, _, v = part.partition("=")
                out[k] = v.replace("%2C", ",").replace("%2c", ",")
        return out


class Responder:
    """Writes one response on a connection; also tells the handler whether the client left."""

    __slots__ = ("_conn", "_transport", "_keep_alive", "streaming", "done")

    def __init__(self, conn: _ServerConn, keep_alive: bool) -> None:
        assert conn.transport is not None  # a request arrived on it: connection_made ran
        self._conn = conn
        self._transport = conn.transport
        self._keep_alive = keep_alive
        self.streaming = False
        self.done = False

    @property
    def closed(self) -> bool:
        return self._conn.closed

    def send(self, status: int, body: bytes = b"", content_type: bytes = CT_JSON) -> None:
        if self.done or self._conn.closed:
            self.done = True
            return
        self.done = True
        conn_hdr = b"keep-alive" if self._keep_alive else b"close"
        self._transport.write(
            b"".join(
                (
                    _status_line(status),
                    b"content-type: ",
                    content_type,
                    b"\r\ncontent-length: ",
                    str(len(body)).encode(),
                    b"\r\nconnection: ",
                    conn_hdr,
                    b"\r\n\r\n",
                    body,
                )
            )
        )
        if not self._keep_alive:
            self._transport.close()

    def send_json(self, status: int, obj: Any) -> None:
        self.send(status, json.dumps(obj).encode(), CT_JSON)

    def start_stream(self, status: int = 200, content_type: bytes = CT_SSE) -> None:
        self.streaming = True
        if self._conn.closed:
            return
        self._transport.write(
            b"".join(
                (
                    _status_line(status),
                    b"content-type: ",
                    content_type,
                    b"\r\ntransfer-encoding: chunked\r\ncache-control: no-cache\r\nconnection: ",
                    b"keep-alive" if self._keep_alive else b"close",
                    b"\r\n\r\n",
                )
            )
        )

    def write_chunk(self, data: bytes) -> None:
        # Called from the decode step loop for every token: one write, no awaits.
        if not self._conn.closed:
            self._transport.write(b"%x\r\n%b\r\n" % (len(data), data))

    def end_stream(self) -> None:
        if self.done:
            return
        self.done = True
        if not self._conn.closed:
            self._transport.write(b"0\r\n\r\n")
            if not self._keep_alive:
                self._transport.close()


App = Callable[[Request, Responder], Awaitable[None]]


class _ServerConn(asyncio.Protocol):
    """One client connection. Requests are served one at a time in arrival order (pipelining
    is queued, not interleaved). Losing the connection cancels the running handler, which is
    how a client disconnect becomes an abort inside the simulated engine."""

    def __init__(self, app: App, conns: set) -> None:
        self._app = app
        self._conns = conns
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self._pending: deque = deque()
        self._task: asyncio.Task | None = None

    # asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._conns.add(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        self._conns.discard(self)
        self._pending.clear()
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
                self.transport.close()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._body = []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        path, _, query = self._url.decode("latin-1").partition("?")
        req = Request(self._parser.get_method().decode(), path, query, self._headers, b"".join(self._body))
        self._pending.append((req, self._parser.should_keep_alive()))
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        while self._pending and not self.closed:
            req, keep_alive = self._pending.popleft()
            resp = Responder(self, keep_alive)
            try:
                await self._app(req, resp)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a handler bug must still answer, never hang the client
                if not resp.streaming:
                    resp.send_json(500, {"error": {"message": repr(exc), "code": 500}})
                else:
                    resp.end_stream()
                if self.transport is not None:
                    self.transport.close()
                return
            if not resp.done:
                if resp.streaming:
                    resp.end_stream()
                else:
                    resp.send(204)


class HttpServer:
    """An asyncio listener for one app on host:port (port 0 = ephemeral, read ``.port`` after start)."""

    def __init__(self, app: App, host: str = "127.0.0.1", port: int = 0) -> None:
        self.app = app
        self.host = host
        self.port = port
        self._server: asyncio.AbstractServer | None = None
        self._conns: set = set()

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _ServerConn(self.app, self._conns), self.host, self.port, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is None:
            return
        self._server.close()
        for conn in list(self._conns):
            if conn.transport is not None:
                conn.transport.close()
        await self._server.wait_closed()
        self._server = None


# ---------------------------------------------------------------------------------------------
# Client side


class HttpError(Exception):
    """Transport-level failure of a client request (connection refused/reset, parse error)."""


class _ClientProto(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.on_chunk: Callable[[bytes], None] | None = None
        self.body: list[bytes] = []
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.head_done: asyncio.Future | None = None
        self.complete: asyncio.Future | None = None
        self.keep_alive = True
        self.lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: BaseException | None) -> None:
        self.lost = True
        err = HttpError("connection lost" if exc is None else repr(exc))
        for fut in (self.head_done, self.complete):
            if fut is not None and not fut.done():
                fut.set_exception(err)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.complete is not None and not self.complete.done():
                self.complete.set_exception(HttpError(repr(exc)))
            if self.transport is not None:
                self.transport.close()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()
        if self.head_done is not None and not self.head_done.done():
            self.head_done.set_result(self.status)

    def on_body(self, body: bytes) -> None:
        if self.on_chunk is not None:
            self.on_chunk(body)
        else:
            self.body.append(body)

    def on_message_complete(self) -> None:
        if self.complete is not None and not self.complete.done():
            self.complete.set_result(None)


def _consume(fut: asyncio.Future | None) -> None:
    """Settle a future the caller will not await: read its exception if it failed (the caller is
    raising something else), cancel it if still pending (connection_lost then skips it)."""
    if fut is None:
        return
    if not fut.done():
        fut.cancel()
    elif not fut.cancelled():
        fut.exception()


class HttpConnection:
    """A keep-alive client connection to one host:port; one request at a time.

    ``request`` returns (status, headers, body); with ``on_chunk`` the body is handed over
    chunk by chunk as it arrives (for SSE) and the returned body is empty. The connection is
    reopened transparently after the server closed it."""

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._proto: _ClientProto | None = None

    async def _connect(self) -> _ClientProto:
        loop = asyncio.get_running_loop()
        try:
            _, proto = await loop.create_connection(_ClientProto, self.host, self.port)
        except OSError as exc:
            raise HttpError(repr(exc)) from exc
        return proto

    async def request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        on_chunk: Callable[[bytes], None] | None = None,
        on_head: Callable[[int], None] | None = None,
    ) -> tuple[int, dict[bytes, bytes], bytes]:
        proto = self._proto
        # A transport already closing (the server's FIN was read, connection_lost not yet
        # delivered) cannot carry a request: reconnect rather than write into it.
        if (
            proto is None
            or proto.lost
            or not proto.keep_alive
            or proto.transport is None
            or proto.transport.is_closing()
        ):
            if proto is not None and proto.transport is not None:
                proto.transport.close()
            proto = self._proto = await self._connect()
        loop = asyncio.get_running_loop()
        proto.parser = httptools.HttpResponseParser(proto)
        proto.body = []
        proto.headers = {}
        proto.on_chunk = on_chunk
        # Only awaited when the caller wants the head early; an unawaited failed future would warn.
        head_done = loop.create_future() if on_head is not None else None
        complete = loop.create_future()
        proto.head_done, proto.complete = head_done, complete
        extra = "".join(f"{k}: {v}\r\n" for k, v in headers.items()) if headers else ""
        head = (
            f"{method} {path} HTTP/1.1\r\nhost: {self.host}:{self.port}\r\n"
            f"content-type: application/json\r\ncontent-length: {len(body)}\r\n{extra}\r\n"
        ).encode()
        assert proto.transport is not None
        try:
            proto.transport.write(head + body if len(body) < 65536 else head)
            if len(body) >= 65536:
                proto.transport.write(body)
            if on_head is not None and head_done is not None:
                on_head(await head_done)
            await complete
        except BaseException:
            # Cancelled or failed mid-response: this connection's state is unknown, drop it.
            # A future may hold an error nobody will await: the head failed and ``complete``
            # failed with it, or the write raised and the connection was lost afterwards (then
            # ``complete`` fails later: cancel it now). Read those errors here, or asyncio
            # prints "Future exception was never retrieved" when they are collected.
            _consume(proto.head_done)
            _consume(proto.complete)
            self.close()
            raise
        return proto.status, proto.headers, b"".join(proto.body)

    def close(self) -> None:
        if self._proto is not None and self._proto.transport is not None:
            self._proto.transport.close()
        self._proto = None


async def fetch(
    host: str, port: int, method: str, path: str, body: bytes = b"", timeout: float = 10.0
) -> tuple[int, bytes]:
    """One-shot request on a fresh connection, bounded by ``timeout``; returns (status, body)."""
    conn = HttpConnection(host, port)
    try:
        status, _, data = await asyncio.wait_for(conn.request(method, path, body), timeout)
    finally:
        conn.close()
    return status, data


def ephemeral_low() -> int:
    """The lowest local port the kernel gives outgoing connections (Linux; a default elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


async def bind_consecutive(servers: list[HttpServer], port: int) -> None:
    """Start ``servers`` on ports port, port+1, ...; with ``port`` 0 on the first run of free
    consecutive ports found from a random base below the ephemeral range (a few tries).

    Below the range because the ephemeral ports hold the client sides of closed connections in
    TIME_WAIT (after a benchmark, thousands), and a listener cannot bind a port such a socket
    holds; ``port`` 0 alone picks from inside that range."""
    fixed = port != 0
    lo = ephemeral_low()
    rng = random.Random()
    n = len(servers)
    for _ in range(1 if fixed else 50):
        started: list[HttpServer] = []
        try:
            base = port if fixed else (rng.randrange(10000, lo - n) if lo - n > 10000 else 0)
            servers[0].port = base
            await servers[0].start()
            started.append(servers[0])
            base = servers[0].port
            if base + n - 1 > 65535:
                raise OSError(f"no room for {n} rank ports from {base}")
            for i, srv in enumerate(servers[1:], 1):
                srv.port = base + i
                await srv.start()
                started.append(srv)
            return
        except OSError:
            for srv in started:
                await srv.stop()
            if fixed:
                raise
    raise OSError(f"found no {len(servers)} consecutive free ports")
