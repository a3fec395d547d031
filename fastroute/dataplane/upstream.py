"""Upstream side of the data path: keep-alive connection pools to workers.

This module owns the TCP connections from the router to SGLang workers: one
:class:`Pool` per worker (host, port), each holding idle keep-alive
:class:`UpstreamConnection` objects (``asyncio.Protocol`` + ``httptools``
response parser). It knows nothing about routing, leases or PD; the proxy hands
it fully framed request bytes and a *leg* object that receives callbacks.

Leg interface (:class:`Leg`, implemented by the proxy's exchanges and PD legs)::

    leg.conn                       # set by the pool to the connection serving it
    leg.up_head(status, headers)   # headers: list[(name bytes, value bytes)]
    leg.up_body(data)              # de-chunked body bytes, in order
    leg.up_done()                  # response complete (the leg is detached; the pool takes the
                                   # connection back when the read that completed it is parsed)
    leg.up_flush()                 # end of one upstream read: write what up_body produced
    leg.up_error(exc)              # transport failure / malformed response; no more callbacks

Invariants:

* A connection serves at most one leg at a time and is returned to the idle list
  only after its response was read completely and both sides allow keep-alive.
  A connection whose response was not fully read is aborted, never reused.
* The pool hands a connection out and takes it back exactly once per leg: only a
  connection whose *leg's* final response completed goes back (``Pool.release`` is
  idempotent), and only after the read that completed it was parsed to its end, so
  bytes behind the answer in the same read are still seen. Any byte that arrives
  while no leg is attached (an extra or late response, garbage) aborts the
  connection: it can never be handed to the next request as that request's answer.
* Informational heads (100, 102, 103) are skipped: the leg gets the final answer
  that follows on the same connection. A 101 is a protocol error (we never ask to
  upgrade): the leg fails and the connection is aborted.
* A request sent on a *reused* connection that dies before any response byte
  arrives is re-sent once on a fresh connection: the worker closed the idle
  socket (keep-alive race) and cannot have processed it.
* Idle connections are closed after ``idle_timeout`` (default 3 s, below
  SGLang's 5 s keep-alive) so we never write into a socket the server is about
  to close. An ``idle_timeout`` of 0 turns reuse off: each connection is closed
  when its response ends.
* Pausing and resuming a connection's reading is decided by the client's
  :class:`~fastroute.dataplane.flow.FlowControl`, and only while a leg is attached:
  a connection without a leg (pooled, or done with its answer) ignores ``pause``,
  and the pool resumes a connection it takes back.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httptools

from fastroute.dataplane._clock import monotonic

log = logging.getLogger("fastroute.upstream")

_IDLE_TIMEOUT = 3.0


def _length_known(status: int, headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether a response head delimits its body (else EOF ends it, RFC 9112 6.3)."""
    if status < 200 or status in (204, 304):
        return True
    for name, value in headers:
        n = name.lower()
        if n == b"content-length" or (n == b"transfer-encoding" and b"chunked" in value.lower()):
            return True
    return False


class UpstreamError(ConnectionError):
    """The upstream connection failed before the response completed."""


class ConnectError(UpstreamError):
    """TCP connect to the worker failed: the request never reached it (safe to retry)."""


class _Timeout(Exception):
    """The request timeout ran out while this leg's worker still owed bytes."""


TIMEOUT = _Timeout("request timeout")  # an attempt's outcome when the exchange's timer fired


class Leg:
    """What a connection reports its response to (see the module docstring); the regular
    exchange and each leg of a PD exchange derive from it. A base class rather than a duck type
    so that the compiled build (upstream.pxd) makes these callbacks C calls, and ``conn`` (the
    connection serving it, set by the pool) a C field."""

    __slots__ = ("conn",)
    conn: Any  # the UpstreamConnection serving this leg (None when there is none)

    def up_head(self, status: int, headers: list) -> None:
        raise NotImplementedError

    def up_body(self, data: bytes) -> None:
        raise NotImplementedError

    def up_done(self) -> None:
        raise NotImplementedError

    def up_error(self, exc: BaseException) -> None:
        raise NotImplementedError

    def up_flush(self) -> None:
        raise NotImplementedError


class UpstreamConnection:
    """One TCP connection to a worker; parses responses with httptools.

    An asyncio protocol by its methods (not derived from ``asyncio.Protocol``, so that the
    compiled build can make it an extension type: see upstream.pxd)."""

    __slots__ = (
        "pool",
        "transport",
        "parser",
        "leg",
        "request",
        "body",
        "reused",
        "got_bytes",
        "headers",
        "head_done",
        "status",
        "keep_alive",
        "closed",
        "idle_since",
        "connect_task",
        "paused",
        "interim",
        "pooled",
    )

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        # Made at the first bytes of an answer (data_received): a connection that waits for
        # its connect or its worker holds no parser (nearly 1 KB with its bound callbacks).
        self.parser: Any = None
        self.leg: Any = None
        self.request: bytes | None = None  # kept until the first response byte (for the one re-send)
        # The request's body when it is sent beside ``request`` (the framed head) rather than in
        # it: the client's own bytes, not a copy. Kept and dropped with ``request``.
        self.body: Any = None  # bytes, or a tuple of buffers (Pool.send)
        self.reused = False
        self.got_bytes = False
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.status = 0
        self.keep_alive = True
        self.closed = False
        self.idle_since = 0.0
        self.connect_task: asyncio.Task | None = None
        self.paused = False
        self.interim = False  # the message being parsed is a 1xx head: the final one follows
        self.pooled = False  # in the pool's idle list

    # -- asyncio.Protocol -------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport = transport  # (TCP_NODELAY: set by the loop, see ClientProtocol's)
        if self.closed:  # aborted while connecting
            transport.abort()
            return
        if self.paused:
            transport.pause_reading()
        if self.request is not None:
            self._write_request(transport)

    def _write_request(self, transport: asyncio.Transport) -> None:
        body = self.body
        if body is None:
            transport.write(self.request)  # type: ignore[arg-type]
        elif type(body) is tuple:  # the client's bytes around spliced fields (Route.send_injected)
            transport.writelines((self.request, *body))  # type: ignore[arg-type]  # one writev
        else:
            transport.writelines((self.request, body))  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        if self.leg is None:
            # Nobody asked: a late or extra response on an idle connection. Its bytes
            # would be taken for the answer of the next request sent on it.
            self.abort()
            return
        if not self.got_bytes:
            self.got_bytes = True
            self.request = None
            self.body = None
            if self.parser is None:  # the first answer on this connection
                self.parser = httptools.HttpResponseParser(self)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:  # (not an HttpParserError subclass)
            self._fail(UpstreamError("worker switched protocols (101) without being asked"))
            return
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError("malformed upstream response: %s" % exc))
            return
        leg = self.leg
        if leg is not None:
            leg.up_flush()  # one client write per upstream read
        elif not self.closed:
            # The leg's answer ended in this read and nothing followed it (a byte behind it
            # would have aborted us in on_message_begin, a failure closed us): now, and only
            # now, it may serve another request.
            self.pool.release(self)

    def eof_received(self) -> bool | None:
        return None  # let the transport close; connection_lost does the bookkeeping

    def pause_writing(self) -> None:
        pass  # a request larger than the transport's buffer: it is written as it drains

    def resume_writing(self) -> None:
        pass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.discard(self)
        leg = self.leg
        if leg is None:
            return
        self.leg = None
        if self.head_done and not self.keep_alive and not _length_known(self.status, self.headers):
            # Close-delimited body (no Content-Length, not chunked): EOF ends it.
            leg.up_done()
            return
        if self.reused and not self.got_bytes and self.request is not None:
            # Keep-alive race: the worker closed the idle socket as we wrote.
            req, body = self.request, self.body
            self.request = None
            self.body = None
            self.pool.send(req, leg, True, body)
            return
        leg.up_error(UpstreamError(str(exc) if exc else "upstream closed the connection"))

    # -- httptools callbacks ---------------------------------------------
    def on_message_begin(self) -> None:
        if self.leg is None:
            # A second response behind the one that completed in this read: the
            # worker answered something nobody sent. Never reuse this connection.
            self.abort()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        p = self.parser
        status = p.get_status_code()
        if status < 200:
            if status == 101:
                self._fail(UpstreamError("worker switched protocols (101) without being asked"))
                return
            # 100/102/103: informational, not the answer (RFC 9110 15.2); its headers
            # (e.g. 103's Link) are dropped, the final head follows.
            self.interim = True
            self.headers = []
            return
        self.head_done = True
        self.keep_alive = p.should_keep_alive()
        # How the body is delimited only matters if the connection dies
        # mid-body (connection_lost), so the headers are not scanned here.
        self.status = status
        leg = self.leg
        if leg is not None:
            leg.up_head(status, self.headers)
        if self.keep_alive:
            # llhttp's keep-alive implies a delimited body, so connection_lost needs no head:
            # a long stream does not keep it (a leg that wants it keeps its own reference).
            self.headers = []

    def on_body(self, body: bytes) -> None:
        leg = self.leg
        if leg is not None:
            leg.up_body(body)

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False  # end of a 1xx: the leg still waits for its answer
            return
        leg = self.leg
        self.leg = None
        if self.headers:  # (already dropped at the head when the body is delimited)
            self.headers = []
        self.head_done = False
        if leg is None:
            self.abort()  # the end of a response nobody asked for
            return
        if not self.keep_alive:
            self.abort()
        # (else pooled by data_received once this read is parsed to its end)
        leg.up_done()

    # -- control from the proxy ------------------------------------------
    def pause(self) -> None:
        """Stop reading from the worker (client transport is full). A connection without a
        leg has no client to wait for: it is never paused (the pool may hand it out)."""
        if not self.paused and self.leg is not None:
            self.paused = True
            t = self.transport
            if t is not None and not self.closed:
                t.pause_reading()

    def resume(self) -> None:
        if self.paused:
            self.paused = False
            t = self.transport
            if t is not None and not self.closed:
                t.resume_reading()

    def abort(self) -> None:
        """Drop the connection now (response unread, client gone, timeout).

        No leg callback follows. The worker sees the socket close, which SGLang
        treats as an abort of the request.
        """
        self.leg = None
        if self.closed:
            return
        self.closed = True
        self.pool.discard(self)
        t = self.transport
        if t is not None:
            t.abort()
        elif self.connect_task is not None:
            self.connect_task.cancel()

    def __call__(self) -> UpstreamConnection:
        """The protocol factory of its own connect (see ``Pool.send``)."""
        return self

    def _connected(self, task: asyncio.Task) -> None:
        """The connect task is done: connected (connection_made already ran), cancelled
        (``abort``), or failed, which fails the leg with a ConnectError (safe to retry)."""
        self.connect_task = None
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        if not isinstance(exc, OSError):
            # What asyncio reports for a task whose exception nobody retrieved.
            self.pool.loop.call_exception_handler(
                {"message": "upstream connect failed", "exception": exc, "future": task}
            )
            return
        pool = self.pool
        self.closed = True
        pool.discard(self)
        leg = self.leg
        self.leg = None
        if leg is not None:
            leg.up_error(ConnectError("connect to %s:%s failed: %s" % (pool.host, pool.port, exc)))

    def _fail(self, exc: Exception) -> None:
        leg = self.leg
        self.abort()
        if leg is not None:
            leg.up_error(exc)


class Pool:
    """Keep-alive connections to one worker ``host:port``."""

    __slots__ = ("host", "port", "idle", "busy", "idle_timeout", "loop", "_sweep_handle", "closed", "ssl")

    def __init__(
        self,
        host: str,
        port: int,
        idle_timeout: float = _IDLE_TIMEOUT,
        loop: asyncio.AbstractEventLoop | None = None,
        ssl: Any = None,
    ) -> None:
        self.host = host[1 : len(host) - 1] if host.startswith("[") else host  # bracketed IPv6 -> connect form
        self.port = port
        # An ssl.SSLContext for an https:// worker (fastroute.tls.client_context), else None.
        # TLS costs only at connect: the handshake is paid once per pooled connection.
        self.ssl = ssl
        self.idle: list[UpstreamConnection] = []  # oldest first; reuse from the end (warmest)
        self.busy: set[UpstreamConnection] = set()
        self.idle_timeout = idle_timeout
        self.loop = loop or asyncio.get_event_loop()
        self._sweep_handle: asyncio.TimerHandle | None = None
        self.closed = False

    def send(self, request: bytes, leg: Leg, fresh: bool = False, body: Any = None) -> UpstreamConnection:
        """Send framed ``request`` bytes, followed by ``body`` when it is given apart from them
        (bytes, or a tuple of buffers written in order); callbacks go to ``leg``. Sets
        ``leg.conn``."""
        conn = None
        if not fresh:
            idle = self.idle
            deadline = monotonic() - self.idle_timeout
            while idle:
                c = idle.pop()
                c.pooled = False
                if c.idle_since >= deadline and not c.closed:
                    conn = c
                    break
                c.abort()
        if conn is not None:
            conn.pooled = False
            conn.reused = True
            conn.got_bytes = False
            conn.request = request
            conn.body = body
            conn.leg = leg
            self.busy.add(conn)
            leg.conn = conn
            conn._write_request(conn.transport)  # type: ignore[arg-type]
            return conn
        conn = UpstreamConnection(self)
        conn.request = request
        conn.body = body
        conn.leg = leg
        self.busy.add(conn)
        leg.conn = conn
        # The loop's connect coroutine runs as a task of its own, its outcome handed to
        # _connected: no coroutine or closure of ours lives (and holds memory) while it waits,
        # which for a burst of new requests is every one of them at once.
        if self.ssl is None:
            # (conn is an asyncio protocol by its methods, and its own factory: the compiled
            # class cannot derive from asyncio.BaseProtocol, which the stubs ask for.)
            coro = self.loop.create_connection(conn, self.host, self.port)  # type: ignore[type-var]
        else:
            coro = self.loop.create_connection(
                conn,  # type: ignore[type-var]
                self.host,
                self.port,
                ssl=self.ssl,
                server_hostname=self.host,
            )
        task = conn.connect_task = self.loop.create_task(coro)
        task.add_done_callback(conn._connected)
        return conn

    def release(self, conn: UpstreamConnection) -> None:
        """Return a connection whose leg's response was fully read to the idle list.

        Idempotent, and a no-op for a closed connection or one that serves a leg: the idle
        list never holds a connection twice, so two requests can never pop the same one."""
        if conn.pooled or conn.closed or conn.leg is not None:
            return
        self.busy.discard(conn)
        if self.closed or self.idle_timeout <= 0:
            # Retired pool, or keep-alive reuse turned off (idle timeout 0).
            conn.abort()
            return
        if conn.paused:
            conn.resume()  # a finished response may have been paused by a slow client
        conn.reused = False
        conn.idle_since = monotonic()
        conn.pooled = True
        self.idle.append(conn)
        if self._sweep_handle is None:
            self._sweep_handle = self.loop.call_later(self.idle_timeout, self._sweep)

    def discard(self, conn: UpstreamConnection) -> None:
        self.busy.discard(conn)
        if conn.pooled:
            conn.pooled = False
            try:
                self.idle.remove(conn)
            except ValueError:
                pass

    def _sweep(self) -> None:
        self._sweep_handle = None
        deadline = monotonic() - self.idle_timeout
        idle = self.idle
        while idle and idle[0].idle_since <= deadline:
            c = idle.pop(0)
            c.pooled = False
            c.abort()
        if idle:
            delay = idle[0].idle_since + self.idle_timeout - monotonic()
            self._sweep_handle = self.loop.call_later(max(delay, 0.05), self._sweep)

    def retire(self) -> None:
        """The worker left: close the idle connections now, the busy ones when their
        response ends (``release`` aborts them), without cutting requests in flight."""
        self.closed = True
        if self._sweep_handle is not None:
            self._sweep_handle.cancel()
            self._sweep_handle = None
        idle = self.idle
        self.idle = []
        for c in idle:
            c.pooled = False
            c.abort()

    def close(self) -> None:
        """Close idle connections and abort busy ones (shutdown)."""
        self.closed = True
        if self._sweep_handle is not None:
            self._sweep_handle.cancel()
            self._sweep_handle = None
        for c in list(self.idle) + list(self.busy):
            c.pooled = False
            c.abort()
        self.idle.clear()
        self.busy.clear()
