"""Exchanges: the client-facing half of one proxied request, and the regular-mode relay.

Lease invariant (protocol.md 3.8): every lease obtained from a group is owned by
exactly one exchange (:class:`Relay`, or :class:`~fastroute.dataplane.pd.PDRelay`)
and released exactly once in ``_Exchange._close_books``, which every ending
funnels into: response EOF, client disconnect, upstream failure, request timeout,
or an exception while starting the exchange.

Resilience (protocol.md 7.2-7.4): an attempt that fails before any client byte
(connect failure, or a 408/429/500/502/503/504 head) is retried with a fresh pick
after a loop-timer backoff. Every upstream outcome goes through
``_Exchange._outcome``, the one place that feeds the circuit breakers; which
outcomes count as failures is the breakers' rule (``Breakers.status``).

Per request: one pick, one framed write upstream, one client write per upstream
read (bytes produced while one read is parsed are coalesced in ``out``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from email.utils import parsedate_to_datetime
from typing import TYPE_CHECKING, Any

from fastroute import errors as _errors
from fastroute.dataplane._clock import monotonic
from fastroute.dataplane._splice import chunk, copied_headers, joined
from fastroute.dataplane.upstream import TIMEOUT, ConnectError, Leg
from fastroute.dataplane.wire import new_request_id, status_line
from fastroute.errors import RouterError

if TYPE_CHECKING:
    from fastroute.dataplane.admission import Admission
    from fastroute.dataplane.body import RequestMeta
    from fastroute.dataplane.limits import Limits
    from fastroute.dataplane.live import Live
    from fastroute.dataplane.request import Request
    from fastroute.dataplane.telemetry import Telemetry
    from fastroute.dataplane.upstreams import Upstreams
    from fastroute.dataplane.wire import ClientSide

log = logging.getLogger("fastroute.proxy")

# _start_response's ``length``: keep the worker's own Content-Length, if it sent one.
KEEP_LENGTH: Any = object()
_LAST_CHUNK = b"0\r\n\r\n"
# An SSE comment (ignored by every SSE client), as one chunk of a chunked body.
KEEPALIVE = b": keep-alive\n\n"
_KEEPALIVE_CHUNK = b"%x\r\n%b\r\n" % (len(KEEPALIVE), KEEPALIVE)
_KEEPALIVE_HEAD = b"content-type: text/event-stream\r\ncache-control: no-cache\r\ntransfer-encoding: chunked\r\n"


def retry_after(status: int, headers: list) -> float:
    """Seconds a 429 or 503 asks the client to wait (``Retry-After``: delta-seconds or an
    HTTP-date, RFC 9110 10.2.3); -1.0 when there is none or it does not parse."""
    if status != 429 and status != 503:
        return -1.0
    for name, value in headers:
        if len(name) == 11 and name.lower() == b"retry-after":
            v = value.strip()
            if v.isdigit():
                return float(v)
            try:
                when = parsedate_to_datetime(v.decode("latin-1"))
                return max(0.0, when.timestamp() - time.time())
            except (TypeError, ValueError, IndexError, OverflowError):
                return -1.0
    return -1.0


# Upstream statuses worth another attempt on another target (protocol.md 7.2).
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})


class _Exchange(Leg):
    """Client-facing half of one proxied request: framing, the lease release, breaker outcomes.

    What it may touch is what its constructor receives: its client connection (``client``, a
    :class:`~fastroute.dataplane.wire.ClientSide`), the request and its parse, the targets
    (``upstreams``: groups, routes, breakers, retry timers), the frozen settings (``limits``), the
    process's live set it registers in (``live``), the metrics' events (``tel``) and the admission
    gate whose slot it holds until ``_close_books``.
    """

    __slots__ = (
        "client",
        "upstreams",
        "limits",
        "live",
        "tel",
        "admission",
        "req",
        "leases",
        "deadline",
        "chunked",
        "head",
        "started",
        "finished",
        "keep_alive",
        "rid",
        "out",
        "started_at",
        "path",
        "status",
        "meta",
        "tries",
        "retry_handle",
        "slot",
        "gave_up",
        "ka_due",
        "ka_sent",
    )

    def _init(
        self,
        client: ClientSide,
        req: Request,
        path: bytes,
        meta: RequestMeta,
        upstreams: Upstreams,
        limits: Limits,
        live: Live,
        tel: Telemetry,
        admission: Admission,
    ) -> None:
        """The fields every exchange starts with (the class is abstract: only Relay and PDRelay
        are made). Their ``__init__`` call this as ``_Exchange._init(self, ...)`` (uvloop's
        ``_init`` pattern): a C call in the compiled build, where ``super().__init__`` is a Python
        one (a super object, a lookup, the arguments packed)."""
        self.client = client
        self.upstreams = upstreams
        self.limits = limits
        self.live = live
        self.tel = tel
        self.admission = admission
        self.req = req
        self.meta = meta
        self.leases: tuple = ()  # bookings of the current attempt
        self.tries = 0  # attempts started
        self.retry_handle: asyncio.TimerHandle | None = None
        self.slot = True  # holds an admission slot until _close_books
        self.gave_up = False  # retries_exhausted counted
        # Read back through self below: the fields are typed in the compiled build (C field
        # reads), the parameters are not.
        self.started_at = monotonic()
        self.deadline = self.started_at + self.limits.timeout
        self.chunked = False
        self.head: bytes | None = None  # client head not yet written (sent with the first body bytes)
        self.started = False  # client head built: errors now end the connection
        self.finished = False
        self.keep_alive = self.req.keep_alive
        rid = self.req.rid
        self.rid = rid if rid is not None else new_request_id(path)
        # Client bytes produced while one upstream read is parsed; written with a
        # single transport.write when the read is done (up_flush), so a burst of
        # SSE events costs one syscall, not one per event.
        self.out: list[bytes] = []
        self.path = path
        self.status = 0
        # SSE keep-alive (protocol.md 3.6): when the next ": keep-alive" comment is due (0: none
        # for this request), and whether the router already committed the 200 event-stream head.
        ka = self.limits.sse_keepalive
        self.ka_due = self.started_at + ka if self.meta.stream and ka > 0 and self.req.http11 else 0.0
        self.ka_sent = False
        self.live.exchanges.add(self)
        self.client.exchange = self

    # -- breaker outcomes ---------------------------------------------------------
    def _outcome(self, target: int, result: int | BaseException) -> None:
        """Record what ``target``'s worker did: a response status, or a failure (connect error,
        broken stream, ``TIMEOUT``); the breakers' rule is ``Upstreams.outcome``'s."""
        self.upstreams.outcome(target, result)

    # -- client writing -----------------------------------------------------
    def _start_response(
        self, status: int, headers: list, length: bytes | None = KEEP_LENGTH, ctype: bytes | None = None
    ) -> None:
        """Build the client head from the upstream head (hop-by-hop stripped), in one scan.

        ``length``: ``KEEP_LENGTH`` keeps the upstream Content-Length if there is one (a
        byte-exact relay), bytes set it, None picks chunked framing. ``ctype`` overrides
        Content-Type.
        """
        # No attempt follows a started response (can_retry): a long stream need not keep the
        # request body and its parse alive to its end.
        self.req.body = b""
        self.meta.obj = None
        if self.ka_sent:  # (started below ends the keep-alives: see keepalive)
            # The 200 event-stream head is already out (keep-alive comments went first): the
            # upstream's 2xx head adds nothing the client can still receive.
            self.status = status
            self.started = True
            return
        self.status = status
        # The worker's lines but the hop-by-hop ones (and those the router sets), in one C
        # pass (_splice.copied_headers), and its Content-Length for a byte-exact relay.
        copied, upstream_length = copied_headers(headers, ctype is not None)
        if length is KEEP_LENGTH:
            length = upstream_length
        parts = [status_line(status), copied]
        ap = parts.append
        if ctype is not None:
            ap(b"content-type: ")
            ap(ctype)
            ap(b"\r\n")
        if length is not None:
            ap(b"content-length: ")
            ap(length)
            ap(b"\r\n")
        elif status >= 200 and status not in (204, 304):
            if self.req.http11:
                ap(b"transfer-encoding: chunked\r\n")
                self.chunked = True
            else:
                self.keep_alive = False  # HTTP/1.0: body delimited by close
        ap(b"x-request-id: ")
        ap(self.rid)
        ap(b"\r\n")
        if self.req.origin is not None:
            ap(self.limits.cors.headers_for(self.req.origin))
        if not self.live.accepting:
            self.keep_alive = False  # draining: this connection closes after the response
        if not self.keep_alive:
            ap(b"connection: close\r\n")
        elif not self.req.http11:
            ap(b"connection: keep-alive\r\n")  # HTTP/1.0 closes unless told otherwise
        ap(b"\r\n")
        self.head = joined(parts)
        self.started = True

    def keepalive(self, now: float) -> None:
        """The sweep found this stream quiet for ``--sse-keepalive-secs`` before its first
        event: send a ``: keep-alive`` comment (the first one with a 200
        ``text/event-stream`` head, so idle-timeout proxies in front see bytes). Never inside an
        event: nothing of the upstream body has been relayed yet (the first body write stops
        the keep-alives). After the head is committed an upstream failure is an SSE error event,
        as after the first byte (``_fail_client``). A worker's 2xx chunked head that came in
        without an event (SGLang sends its head before the prefill ends) goes out at once with
        the comment, and comments follow until the first event."""
        if self.finished or self.client.closed:
            self.ka_due = 0.0
            return
        limits = self.limits
        if self.started:
            if self.ka_sent or (self.head is not None and self.chunked and 200 <= self.status < 300):
                data = _KEEPALIVE_CHUNK
                head = self.head
                if head is not None:
                    self.head = None
                    data = head + data
                self.ka_sent = True
                self.ka_due = now + limits.sse_keepalive
                self.client.write(data)
            else:
                self.ka_due = 0.0
            return
        self.ka_due = now + limits.sse_keepalive
        if self.ka_sent:
            self.client.write(_KEEPALIVE_CHUNK)
            return
        self.ka_sent = True
        self.chunked = True
        if not self.live.accepting:
            self.keep_alive = False
        origin = self.req.origin
        self.client.write(
            b"%b%bx-request-id: %b\r\n%b%b\r\n%b"
            % (
                status_line(200),
                _KEEPALIVE_HEAD,
                self.rid,
                limits.cors.headers_for(origin) if origin is not None else b"",
                b"" if self.keep_alive else b"connection: close\r\n",
                _KEEPALIVE_CHUNK,
            )
        )

    def _write(self, data: bytes) -> None:
        self.ka_due = 0.0  # the first body byte ends the keep-alives
        head = self.head
        if self.chunked:
            if not data:
                return  # (an empty chunk would end the body)
            self.head = None
            self.out.append(chunk(head, data))  # head, size line, data, CRLF: one allocation
            return
        if head is not None:
            self.head = None
            data = head + data
        self.out.append(data)

    def flush(self) -> None:
        out = self.out
        if out:
            data = out[0] if len(out) == 1 else joined(out)
            del out[:]
            self.client.write(data)

    def up_flush(self) -> None:
        """End of one upstream read (the Leg callback): write what it produced."""
        self.flush()

    def _end(self) -> None:
        """Response complete: write what is left, release, hand the connection back."""
        head = self.head
        if head is not None:
            self.head = None
            self.out.append(head)
        if self.chunked:
            self.out.append(_LAST_CHUNK)
        self.flush()
        self.tel.done(self.status, self.path, self.meta, self.started_at)
        self._finish(self.keep_alive)

    def _release_leases(self) -> None:
        leases = self.leases
        self.leases = ()
        for lease in leases:
            lease.release()

    def _close_books(self) -> None:
        """Give back everything the exchange holds: leases, retry timer, admission slot.

        Idempotent; every ending funnels here (the lease invariant in the module
        docstring), and the safety net calls it too.
        """
        h = self.retry_handle
        if h is not None:
            self.retry_handle = None
            h.cancel()
        try:
            self._release_leases()
        finally:
            if self.slot:
                self.slot = False
                self.admission.leave()

    def _finish(self, keep_alive: bool, error: RouterError | None = None, sse: bool = False) -> None:
        """The one ending: give the books back, then hand the connection on, either with the
        response done or (``error``, nothing of a response sent yet) with that error."""
        if self.finished:
            return
        self.finished = True
        self.live.exchanges.discard(self)
        try:
            self._close_books()
        finally:
            client = self.client
            if client.exchange is self:
                if error is None:
                    client.done(keep_alive)
                else:
                    client.fail(error, self.req, sse, self.meta.model)

    def _fail_client(self, exc: RouterError, sse: bool = False) -> None:
        """Upstream failed. Before any client byte: a JSON (or SSE) error; after: cut the stream."""
        if self.finished:
            return
        self._abort_legs()
        if self.started:
            # Chunked: no terminating 0-chunk, so the client sees a truncated
            # response rather than a clean end; Content-Length: short body.
            if self.head is None:
                self.flush()  # bytes already committed to the client go out before the cut
                self.tel.response(self.status, exc.code, self.path, self.meta.model)
                self._finish(False)
                self.client.abort()
                return
            self.head = None  # nothing sent yet: still free to answer with an error
            self.out.clear()
        if self.ka_sent:
            # Only keep-alive comments went out, under a 200 head: the error is an SSE error
            # event and the stream ends cleanly.
            body = exc.sse()
            self.out.append(b"%x\r\n%b\r\n%b" % (len(body), body, _LAST_CHUNK))
            self.flush()
            self.tel.response(exc.status, exc.code, self.path, self.meta.model)
            self._finish(self.keep_alive)
            return
        self._finish(False, exc, sse)

    # -- control --------------------------------------------------------------
    def cancel(self, status: int = 499, code: str = "client_closed") -> None:
        """Client disconnected (or shutdown): drop the upstream legs, release.

        Counted as a response (nginx's 499 for a client that left) so every
        request has exactly one smg_http_responses_total sample.
        """
        if self.finished:
            return
        self._abort_legs()
        self.tel.response(status, code, self.path, self.meta.model)
        self._finish(False)

    def on_timeout(self) -> None:
        if self.finished:
            return
        self._blame_timeout()
        self._fail_client(_errors.gateway_timeout())

    # -- retries (protocol.md 7.2) -----------------------------------------------
    def can_retry(self) -> bool:
        """Another attempt is allowed: attempts left and no client byte committed."""
        return self.tries < self.limits.max_attempts and not self.started and not self.finished

    def fits(self, wait: float) -> bool:
        """A retry after ``wait`` seconds (a worker's Retry-After; < 0: none) still starts
        before the request's deadline. When it would not, the worker's answer is relayed."""
        return wait < 0.0 or monotonic() + wait < self.deadline

    def retry_later(self, role: str, wait: float = -1.0) -> None:
        """Drop this attempt (legs aborted, leases released) and schedule a fresh pick.

        The delay is a timer on the loop (never a sleep): the backoff, or the worker's
        Retry-After (``wait``) when longer; the request timeout and a client disconnect still
        apply while it waits.
        """
        self._abort_legs()
        self._release_leases()
        self.tel.retry(role, self.path)
        self.retry_handle = self.upstreams.retry_later(self.tries - 1, wait, self._retry)

    def _retry(self) -> None:
        self.retry_handle = None
        if self.finished:
            return
        try:
            self.attempt()
        except Exception:
            log.exception("retry failed")

    def exhausted(self, role: str) -> None:
        """The last allowed attempt failed retryably: count it (only when retries are on)."""
        if self.gave_up:
            return
        self.gave_up = True
        if self.limits.max_attempts > 1:
            self.tel.exhausted(role, self.path)

    def attempt(self) -> None:
        raise NotImplementedError

    def _blame_timeout(self) -> None:
        raise NotImplementedError

    def fail_internal(self) -> None:
        """Exception while starting an attempt: make sure the leases come back."""
        self._abort_legs()
        self._fail_client(_errors.internal_error())

    def _abort_legs(self) -> None:
        raise NotImplementedError


class Relay(_Exchange):
    """Regular mode: one worker, response relayed as it arrives. Is its own leg."""

    __slots__ = ("target",)

    def __init__(
        self,
        client: ClientSide,
        req: Request,
        path: bytes,
        meta: RequestMeta,
        upstreams: Upstreams,
        limits: Limits,
        live: Live,
        tel: Telemetry,
        admission: Admission,
    ) -> None:
        _Exchange._init(self, client, req, path, meta, upstreams, limits, live, tel, admission)
        self.conn: Any = None
        self.target = -1

    def attempt(self) -> None:
        """Pick a target and send (first attempt and every retry)."""
        self.tries += 1
        upstreams = self.upstreams
        meta = self.meta
        # The acquire too runs inside the error handling: whatever it raises, the client is
        # answered and the admission slot given back (fail_internal -> _close_books).
        tel = self.tel
        try:
            # out_tokens only matters to KV-fit placement (the decode group); 0 when not given.
            t0 = tel.clock()
            lease = upstreams.group("regular").acquire(meta.input_tokens, self.req.key, meta, meta.max_new_tokens or 0)
            tel.pick(t0)
            meta.shed()  # the pick has read the decoded prompt: it is not held while we wait
            if lease is None:
                self._fail_client(_errors.no_available_workers())
                return
            self.leases = (lease,)
            t = self.target = lease.target
            self.status = 0
            route = upstreams.routes[t]
            route.send(self.req, self)
        except BaseException:
            self.fail_internal()
            raise

    # leg callbacks (from upstream.UpstreamConnection)
    def up_head(self, status: int, headers: list) -> None:
        if status in RETRY_STATUS:
            wait = retry_after(status, headers)
            if self.can_retry() and self.fits(wait):
                self._outcome(self.target, status)
                self.retry_later("regular", wait)  # aborts this connection: no more callbacks
                return
            self.exhausted("regular")
        if self.ka_sent and not 200 <= status < 300:
            # The 200 head is out: the worker's error becomes an SSE error event.
            self._outcome(self.target, status)
            self._fail_client(
                RouterError(status if status >= 400 else 502, "upstream_error", "Worker answered HTTP %d" % status),
                True,
            )
            return
        self._start_response(status, headers)  # (keeps the worker's Content-Length, if any)
        self.client.flow.relay(self)

    def up_body(self, data: bytes) -> None:
        self._write(data)

    def up_done(self) -> None:
        self.conn = None
        self._outcome(self.target, self.status)
        self._end()

    def up_error(self, exc: BaseException) -> None:
        self.conn = None
        if self.finished:
            return
        self._outcome(self.target, exc)  # connect error, reset, or a stream cut short
        # Only a connect failure proves the worker never saw the request; a
        # connection that died later may have run it, so that is not retried.
        if isinstance(exc, ConnectError):
            if self.can_retry():
                self.retry_later("regular")
                return
            self.exhausted("regular")
        self._fail_client(_errors.bad_gateway("Upstream request failed: %s" % exc))

    def _blame_timeout(self) -> None:
        if self.leases and self.conn is not None:
            self._outcome(self.target, TIMEOUT)

    def _abort_legs(self) -> None:
        c = self.conn
        self.conn = None
        if c is not None:
            c.abort()
