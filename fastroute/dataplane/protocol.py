"""The client side of the data path: HTTP/1.1 parsing and in-order answering, per connection.

Owns, per client connection, the request parsing (httptools, keep-alive, pipelining
answered strictly in order, chunked request bodies, the read deadlines, the head and
payload limits), request headers classified in one lookup (the table is
:mod:`fastroute.dataplane.headerflags`), request ids, prebuilt status lines, and the
simple responses (inline answers and errors; none carries a body for ``HEAD``).

Reading a request is bounded in time and bytes, as the bytes arrive:

* the head (request line + headers) must arrive within ``header_read_timeout_secs``
  of its first byte and stay under 64 KiB, counted per read even while httptools
  holds an unterminated line (it buffers a partial header value itself, so the
  callbacks alone would see nothing until the line ends): else 431 and close;
* the body must keep arriving (no read for ``header_read_timeout_secs``: 408 and
  close) and be complete within ``body_read_timeout_secs`` of its head.

No reference cycle keeps a request body alive: the body chunks are dropped when the request is
handed off, and the protocol<->parser cycle is broken when the connection is lost, so a finished
body is freed at once, without a GC pass. What a request means is the endpoints' business
(:mod:`fastroute.dataplane.endpoints`); backpressure is
:class:`~fastroute.dataplane.flow.FlowControl`'s. To the exchange answering a request the
connection is a :class:`~fastroute.dataplane.wire.ClientSide`: it writes, ends, fails or cuts the
response through those four calls and never touches the transport.

Per request: one header scan (lower-cased name -> flag bits), one join of the
forwarded headers, no logging. Byte constants are built at import.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import TYPE_CHECKING, Any, Protocol

import httptools

from fastroute import errors as _errors
from fastroute.dataplane._clock import monotonic
from fastroute.dataplane.flow import FlowControl
from fastroute.dataplane.headerflags import (
    _F_ACRH,
    _F_AUTH,
    _F_CL,
    _F_CONN,
    _F_EXPECT,
    _F_FWD,
    _F_KEY,
    _F_ORIGIN,
    _F_RID,
    _classify,
)
from fastroute.dataplane.request import Request
from fastroute.dataplane.routes import INFERENCE
from fastroute.dataplane.wire import CT_JSON, CT_SSE, ClientSide, status_line

if TYPE_CHECKING:
    from fastroute.dataplane.admission import Waiter
    from fastroute.dataplane.limits import Limits
    from fastroute.dataplane.live import Live
    from fastroute.dataplane.telemetry import Telemetry
    from fastroute.errors import RouterError

log = logging.getLogger("fastroute.proxy")

# --------------------------------------------------------------------------- constants

_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"

# The inference paths (raw path -> endpoint label) come from the route table
# (fastroute.dataplane.routes); everything else is answered, not proxied.

_NO_BODY_METHODS = frozenset({b"GET", b"HEAD", b"OPTIONS"})
_PIPELINE_LIMIT = 32  # queued pipelined requests before we stop reading the client
_HEAD_LIMIT = 1 << 16  # bytes of request line + headers before 431
# Answers to a request that could not be read, by status.
_READ_ERROR_CODE = {400: _errors.CODE_BAD_REQUEST, 408: "request_timeout", 431: "header_too_large"}


# --------------------------------------------------------------------------- client protocol


class Handler(Protocol):
    """What the connection asks of its handler: :class:`~fastroute.dataplane.endpoints.Endpoints`
    (endpoints.py, which is above this module: the compiled build cimports it, this module's
    Python never imports it)."""

    def handle(self, proto: ClientProtocol, req: Request) -> None: ...

    def refuse_at_head(self, method: bytes, url: bytes, auth: bytes | None) -> RouterError | None: ...

    def unqueue(self, waiter: Waiter, key: Any) -> None: ...


def _origin_form(url: bytes) -> bytes:
    """``http://host:port/p?q`` -> ``/p?q`` (``/`` when the target names no path)."""
    rest = url.partition(b"://")[2]
    for i in range(len(rest)):
        c = rest[i]
        if c == 47:  # '/'
            return rest[i:]
        if c == 63:  # '?'
            return b"/" + rest[i:]
    return b"/"


class ClientProtocol(ClientSide):
    """One client connection: parse requests, answer them strictly in order.

    An asyncio protocol by its methods (not derived from ``asyncio.Protocol``, so that the
    compiled build can make it an extension type: see protocol.pxd), and the
    :class:`~fastroute.dataplane.wire.ClientSide` of the exchange answering its current request.
    It hands each request to ``endpoints`` in order; ``limits`` are the frozen settings it reads
    (header tables, payload and time limits), ``live`` the process's set of open connections it
    joins, ``tel`` the metrics' events."""

    # Slots: past 30 attributes CPython gives each instance a full dict (~1.6 KB per held
    # connection, and slower attribute access); slots cost 8 bytes a name. Keep in step with
    # __init__ (a name missing here fails the first time it is set).
    __slots__ = (
        "endpoints",
        "limits",
        "live",
        "tel",
        "transport",
        "parser",
        "_flags",
        "busy",
        "queue",
        "draining",
        "bad_request",
        "head_deadline",
        "in_head",
        "head_only",
        "_req",
        "_url",
        "_fwd",
        "_chunks",
        "_rid_vals",
        "_key_vals",
        "_expect",
        "_conn",
        "_cl",
        "_head_size",
        "_head_bytes",
        "_body_check",
        "waiter",
        "http_key",
        "http_t0",
        "_bad_message",
        "_bad_status",
    )

    def __init__(self, endpoints: Handler, limits: Limits, live: Live, tel: Telemetry) -> None:
        self.endpoints = endpoints
        self.limits = limits
        self.live = live
        self.tel = tel
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self._flags = limits.header_flags  # header name -> _F_* bits (per process; see _classify)
        self.closed = False
        self.busy = False  # a response is in progress
        self.queue: list[Request] = []  # pipelined requests waiting for their turn
        self.draining = False
        self.bad_request = False  # parse error seen: answer what is queued, then 400 + close
        self.flow = FlowControl()  # backpressure, both directions
        self.exchange = None  # the exchange answering the current request (wire.ClientSide)
        # The one read deadline the App's sweep checks (on_header_timeout): the head's total
        # deadline, then the body's next inactivity check, then the keep-alive idle limit.
        self.head_deadline = 0.0
        self.in_head = False
        # A body is being read while ``_req`` is set and ``in_head`` is not (no flag to keep).
        self.head_only = False  # the request being answered is a HEAD (reply clears it)
        # per-message parse state
        self._req: Request | None = None
        self._url = b""
        self._fwd: list[bytes] = []
        self._chunks: list[bytes] = []
        self._rid_vals: dict[bytes, bytes] | None = None
        self._key_vals: dict[bytes, bytes] | None = None
        self._expect = False
        self._conn = False  # the head being read has a Connection header
        self._cl = -1
        self._head_size = 0
        self._head_bytes = 0  # bytes of reads wholly inside an unfinished head
        # The body deadline's state, set at its first check (nothing per request): (a weak
        # reference to the request it is about, so a finished body is not kept alive by it,
        # its body bytes at the last check, its total deadline). One attribute, not three:
        # CPython keeps an instance's attributes inline (fast) only up to 30 names.
        self._body_check: tuple[Any, int, float] | None = None
        self.waiter: Any = None  # admission queue entry while the request waits for a slot
        self.http_key: Any = None  # metrics on: the current request's (method, path) labels
        self.http_t0 = 0.0  # ... and when it was complete (the telemetry's monotonic clock)
        self._bad_message = ""
        self._bad_status = 400

    # -- asyncio.Protocol ---------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.flow.transport = transport  # type: ignore[assignment]
        # Small SSE events must leave at once (Nagle plus the peer's delayed ACK would add ~40 ms
        # to each small write after the first): uvloop and asyncio both set TCP_NODELAY on every
        # TCP socket they accept or connect, TLS ones too, so nothing is set here (asking the
        # transport for its socket would keep a socket object per connection for nothing).
        live = self.live
        live.connections.add(self)
        hs = live.handshaking
        if hs and self in hs:
            del hs[self]  # TLS: counted since the accept (App.protocol_factory)
        else:
            self.tel.connections(1)
        self.head_deadline = monotonic() + self.limits.header_timeout

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        # The parser holds this protocol (its callbacks) and this protocol the parser: drop
        # the parser and the request being read, so both (and any body bytes they hold)
        # are freed now rather than by a later GC pass.
        self.parser = None  # type: ignore[assignment]  # closed: no callback reads it again
        self._req = None
        self._chunks = []
        self._body_check = None
        self.in_head = False
        self.head_deadline = 0.0
        if self in self.live.connections:
            self.live.connections.discard(self)
            self.tel.connections(-1)
        self.queue.clear()
        ex = self.exchange
        if ex is not None:
            ex.cancel()  # client gone: abort upstream legs, release leases
        w = self.waiter
        if w is not None:
            self.waiter = None
            self.endpoints.unqueue(w, self.http_key)

    def data_received(self, data: bytes) -> None:
        if self.bad_request:
            return
        in_head = self.in_head
        if in_head:
            req = self._req
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._parse_failed("Upgrade is not supported")
            return
        except httptools.HttpParserError as exc:
            self._parse_failed("Malformed HTTP request: %s" % exc)
            return
        if in_head and self.in_head and self._req is req:  # (req is bound when in_head)
            # The whole read belongs to one head that is still unfinished: httptools may be
            # holding it as a partial line the header callbacks have not seen, so it is
            # counted here. (A read in which a head starts is not counted: it is one read,
            # bounded by the transport's buffer size, and may hold a previous message.)
            n = self._head_bytes + len(data)
            self._head_bytes = n
            if n > _HEAD_LIMIT and not self.bad_request:
                self._head_too_large()

    def eof_received(self) -> bool | None:
        return None  # let the transport close; connection_lost does the bookkeeping

    def pause_writing(self) -> None:
        self.flow.pause_writing()

    def resume_writing(self) -> None:
        self.flow.resume_writing()

    # -- httptools callbacks --------------------------------------------------
    def on_message_begin(self) -> None:
        self._req = Request()
        self._url = b""
        if self._fwd:  # (joined into the last request: a fresh list, else reused)
            self._fwd = []
        if self._chunks:
            self._chunks = []
        self._rid_vals = None
        self._key_vals = None
        self._expect = False
        self._conn = False
        self._cl = -1
        self._head_size = 0
        self._head_bytes = 0
        self.in_head = True
        self.head_deadline = monotonic() + self.limits.header_timeout

    def on_url(self, url: bytes) -> None:
        self._url = url if not self._url else self._url + url
        self._head_size += len(url)
        if self._head_size > _HEAD_LIMIT:
            self._head_too_large()

    def on_header(self, name: bytes, value: bytes) -> None:
        req = self._req
        if req is None:  # head already refused (431)
            return
        if not self.in_head:
            # A chunked body's trailer field: never a request header (an Authorization or a
            # routing key sent after the body would change a decision already taken at the
            # head). Dropped, but counted against the head limit so it cannot grow unbounded.
            self._head_size += len(name) + len(value) + 4
            if self._head_size > _HEAD_LIMIT:
                self._head_too_large()
            return
        # httptools has no limit of its own on the head; without one a client
        # could make us buffer headers forever.
        size = self._head_size + len(name) + len(value) + 4
        self._head_size = size
        if size > _HEAD_LIMIT:
            self._head_too_large()
            return
        f = self._flags.get(name)
        if f is None:
            f = _classify(self._flags, name)
        if not f:
            return
        if f == _F_CL:  # the one flagged header of nearly every request
            try:
                self._cl = int(value)
            except ValueError:
                self._cl = -1
            return
        n = name.lower() if f & (_F_RID | _F_KEY) else name  # (read only by those two)
        if f & _F_FWD:
            self._fwd.append(name + b": " + value + b"\r\n")
        if f & _F_AUTH:
            req.auth = value
        if f & _F_RID:
            if self._rid_vals is None:
                self._rid_vals = {}
            self._rid_vals.setdefault(n, value)
        if f & _F_KEY:
            if self._key_vals is None:
                self._key_vals = {}
            self._key_vals.setdefault(n, value)
        if f & _F_CL:
            try:
                self._cl = int(value)
            except ValueError:
                self._cl = -1
        if f & _F_EXPECT and value.lower() == b"100-continue":
            self._expect = True
        if f & _F_ORIGIN:
            req.origin = value
        if f & _F_ACRH:
            req.acrh = value
        if f & _F_CONN:
            self._conn = True

    def on_headers_complete(self) -> None:
        req = self._req
        if req is None:
            return
        self.in_head = False
        # The body is read under the head's deadline, now its first inactivity check:
        # on_header_timeout extends it while body bytes keep arriving (no clock read here).
        limits = self.limits
        req.method = self.parser.get_method()
        url = self._url
        if url[:1] != b"/" and (url[:7].lower() == b"http://" or url[:8].lower() == b"https://"):
            # Absolute form (RFC 9112 3.2.2, what proxies send): routed by its path.
            self._url = url = _origin_form(url)
        if self._cl > limits.max_payload:
            req.too_large = True
            req.body_len = self._cl
            if not self.busy and not self.queue:
                # Answer now instead of reading (or waiting for, under Expect:
                # 100-continue) a body we will refuse; then close, since the
                # unread body makes the stream unusable.
                self._req = None
                self.bad_request = True  # ignore whatever else arrives
                req.keep_alive = False
                self.busy = True
                self.head_only = req.method == b"HEAD"  # (reply clears it)
                self.send_error(_errors.payload_too_large(self._cl, limits.max_payload), req)
        elif (
            limits.guarded
            and self._cl != 0
            and self._url not in INFERENCE
            and not self.busy
            and not self.queue
            and req.method not in _NO_BODY_METHODS
        ):
            # An admin call with a body: who may call it is decided before the body is read
            # (the endpoints' one AdminAuth); a refusal is answered now and the connection
            # closed, since the unread body makes the stream unusable.
            exc = self.endpoints.refuse_at_head(req.method, self._url, req.auth)
            if exc is not None:
                self._req = None
                self.bad_request = True
                req.keep_alive = False
                req.url = self._url
                self.busy = True
                self.send_error(exc, req)
            elif self._expect:
                self.transport.write(_CONTINUE)  # type: ignore[union-attr]
        elif self._expect and not self.busy and not self.queue:
            # Only when nothing is being written: a 100 must not land inside another response.
            self.transport.write(_CONTINUE)  # type: ignore[union-attr]

    def on_body(self, body: bytes) -> None:
        req = self._req
        if req is None:
            return
        n = req.body_len + len(body)
        req.body_len = n  # (also the body deadline's progress)
        if req.too_large:
            return
        if n > self.limits.max_payload:
            req.too_large = True
            self._chunks = []
            return
        self._chunks.append(body)

    def on_message_complete(self) -> None:
        self.head_deadline = 0.0
        req = self._req
        if req is None or self.bad_request:  # already answered (413/431 at the head)
            return
        self._req = None
        p = self.parser
        req.url = self._url
        ka = req.keep_alive = p.should_keep_alive()
        # llhttp parses HTTP/0.9, 1.0, 1.1 and 2.0 and keeps a request alive without a
        # Connection header only for 1.1: the version string (formatted per call) is asked
        # for only when it could be another.
        req.http11 = True if ka and not self._conn else p.get_http_version() == "1.1"
        chunks = self._chunks
        if chunks:
            # The request owns its body from here; the chunk list must not keep a second
            # copy of it alive until the next request on this connection.
            self._chunks = []
            req.body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        limits = self.limits
        if self._fwd:
            req.fwd = b"".join(self._fwd)
        rv = self._rid_vals
        if rv:
            for h in limits.rid_headers:
                v = rv.get(h)
                if v is not None:
                    req.rid = v
                    break
        kv = self._key_vals
        if kv:
            for h in limits.key_headers:
                v = kv.get(h)
                if v is not None:
                    req.key = v
                    break
        if self.busy or self.queue:
            self.queue.append(req)
            if len(self.queue) >= _PIPELINE_LIMIT:
                self.flow.pause_reading()
        else:
            self._start(req)

    # -- request sequencing ---------------------------------------------------
    def _start(self, req: Request) -> None:
        self.busy = True
        if req.method == b"HEAD":
            self.head_only = True
        try:
            self.endpoints.handle(self, req)
        except Exception:
            log.exception("request handling failed")
            if self.busy and self.exchange is None:
                self.send_error(_errors.internal_error(), req)

    def response_done(self, keep_alive: bool) -> None:
        """The current response is fully written (or abandoned)."""
        self.busy = False
        self.exchange = None
        key = self.http_key
        if key is not None:
            self.http_key = None
            self.tel.http_done(key, self.http_t0)
        if self.closed:
            return
        if not keep_alive or not self.live.accepting:
            self.closed = True
            self.transport.close()  # type: ignore[union-attr]
            return
        if self.draining:
            return  # the loop below picks up the next request
        self.draining = True
        try:
            while not self.busy and not self.closed:
                if self.queue:
                    req = self.queue.pop(0)
                    if len(self.queue) < _PIPELINE_LIMIT // 2:
                        self.flow.resume_reading()
                    self._start(req)
                    continue
                if self.bad_request:
                    self._write_bad_request()
                elif not self.in_head and self._req is None:  # (not while a body is read)
                    self.head_deadline = monotonic() + self.limits.idle_timeout
                break
        finally:
            self.draining = False

    def _head_too_large(self) -> None:
        # Drop the request being parsed; later callbacks of this feed see _req None.
        self._req = None
        self._parse_failed("Request header section exceeds %d bytes" % _HEAD_LIMIT, 431)

    def _parse_failed(self, message: str, status: int = 400) -> None:
        if self.bad_request:
            return
        self.bad_request = True
        self._bad_message = message
        self._bad_status = status
        if not self.closed:
            self.flow.pause_reading()
        if not self.busy and not self.queue:
            self._write_bad_request()

    def _write_bad_request(self) -> None:
        if self.closed:
            # e.g. bytes after an HTTP/1.0 or "Connection: close" request that
            # was already answered and closed: nobody is left to tell.
            return
        status = self._bad_status
        code = _READ_ERROR_CODE[status]
        body = _errors.error_response(status, code, self._bad_message)
        self.tel.response(status, code)
        self.transport.write(  # type: ignore[union-attr]
            b"%bcontent-type: application/json\r\nx-smg-error-code: %b\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%b" % (status_line(status), code.encode(), len(body), body)
        )
        self.closed = True
        self.transport.close()  # type: ignore[union-attr]

    def on_header_timeout(self) -> None:
        """The read deadline passed: a head too slow, a body stalled or too slow (408), or an
        idle keep-alive connection too long."""
        if self.closed:
            return
        if not self.in_head and self._req is not None:  # a body is being read
            self._body_deadline()
            return
        if self.busy:
            return
        self.closed = True
        self.head_deadline = 0.0
        if self.transport is not None:
            self.transport.close()

    def _body_deadline(self) -> None:
        """Inactivity check of a body being read: extend while bytes arrive, else 408.

        Runs only when the deadline passes (the sweep), so reading body bytes costs nothing
        per read; a stall is detected between one and two ``header_read_timeout_secs``."""
        req = self._req
        limits = self.limits
        now = monotonic()
        check = self._body_check
        if check is None or check[0]() is not req:
            # First check of this body: head_deadline is still the head's (its first byte +
            # header timeout), and no body byte has been checked yet.
            end = self.head_deadline - limits.header_timeout + limits.body_timeout
            check = (weakref.ref(req), 0, end)
        end = check[2]
        got = req.body_len  # type: ignore[union-attr]
        if got != check[1] and now < end:
            self._body_check = (check[0], got, end)
            self.head_deadline = min(now + limits.header_timeout, end)
            return
        self._body_check = None
        self.head_deadline = 0.0
        self._req = None
        self._chunks = []
        self._parse_failed("Request body not received in time", 408)

    # -- simple responses -----------------------------------------------------
    def reply(self, data: bytes, keep_alive: bool) -> None:
        if not self.closed:
            if self.head_only:
                # HEAD: the head of the answer the GET would get, never its body (RFC 9110
                # 9.3.2); a body here would be read as the next response on this connection.
                self.head_only = False
                data = data[: data.find(b"\r\n\r\n") + 4]
            self.transport.write(data)  # type: ignore[union-attr]
        self.response_done(keep_alive)

    def reply_simple(
        self,
        status: int,
        ctype: bytes,
        body: bytes,
        req: Request,
        extra: bytes = b"",
        code: str = "",
        model: str | None = None,
    ) -> None:
        ka = req.keep_alive and self.live.accepting
        self.tel.reply(status, code, req.url, model)
        if req.origin is not None:
            extra += self.limits.cors.headers_for(req.origin)
        head = b"%bcontent-type: %b\r\ncontent-length: %d\r\n%b%b\r\n" % (
            status_line(status),
            ctype,
            len(body),
            extra,
            (b"" if req.http11 else b"connection: keep-alive\r\n") if ka else b"connection: close\r\n",
        )
        self.reply(head + body, ka)

    def send_error(self, exc: RouterError, req: Request, sse: bool = False, model: str | None = None) -> None:
        extra = b"x-smg-error-code: " + exc.code.encode("latin-1") + b"\r\n"
        for k, v in exc.headers:
            extra += k + b": " + v + b"\r\n"
        if sse:
            self.reply_simple(exc.status, CT_SSE, exc.sse(), req, extra, exc.code, model)
        else:
            self.reply_simple(exc.status, CT_JSON, exc.body(), req, extra, exc.code, model)

    # -- the exchange's calls (wire.ClientSide) ----------------------------------------
    def write(self, data: bytes) -> None:
        if not self.closed:
            self.transport.write(data)  # type: ignore[union-attr]

    def done(self, keep_alive: bool) -> None:
        self.response_done(keep_alive)

    def fail(self, exc: RouterError, req: Request, sse: bool = False, model: str | None = None) -> None:
        self.exchange = None
        self.send_error(exc, req, sse, model)

    def abort(self) -> None:
        if not self.closed:
            self.closed = True
            self.transport.close()  # type: ignore[union-attr]
