"""Downstream side of the data path: the client HTTP protocol and the relay.

Owns, per client connection, the HTTP/1.1 request parsing (httptools, keep-alive,
pipelining answered in order, chunked request bodies, header read timeout,
payload limit, API key), the dispatch of each request (inline health answers,
admin paths delegated to the registry, inference paths proxied), and the relay
of the upstream response back to the client chunk by chunk with flow control.

Lease invariant (protocol.md 3.8): every lease obtained from a group is owned by
exactly one exchange (:class:`Relay` or :class:`PDRelay`) and released exactly
once in ``_Exchange._finish``, which every ending funnels into: response EOF,
client disconnect, upstream failure, request timeout, or an exception while
starting the exchange.

Resilience (protocol.md 7.2-7.4): an attempt that fails before any client byte
(connect failure, or a 408/429/500/502/503/504 head) is retried with a fresh pick
(PD: fresh pair and room) after a loop-timer backoff; outcomes feed the
per-target circuit breakers (:mod:`fastroute.core.breaker`) on the leg that failed;
``--max-concurrent-requests`` is enforced by :mod:`fastroute.dataplane.admission`, whose
slot is released together with the leases. ``App.exchanges`` is the registry of
live exchanges that the lease safety net (``App.check_leaks``) scans every few
seconds for bookings their owner failed to release.

Per-request work is kept to: one header scan (lower-cased name -> flag table),
one parse of the JSON body (``body.parse_request``), one pick, one framed write
upstream, and one write per upstream body chunk. Byte constants (status lines,
fixed headers) are built at import. Nothing is logged per request at info.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import random
import socket
from http import HTTPStatus
from typing import Any

import httptools

from fastroute.dataplane import body as _body
from fastroute.dataplane import logprobs as _logprobs
from fastroute import errors as _errors
from fastroute.dataplane.admission import Admission
from fastroute.core.breaker import Breakers
from fastroute.errors import RouterError
from fastroute.dataplane.upstream import ConnectError, Pool, _nodelay

log = logging.getLogger("fastroute.proxy")

# --------------------------------------------------------------------------- constants


def _status_line(code: int) -> bytes:
    try:
        phrase = HTTPStatus(code).phrase
    except ValueError:
        phrase = "Unknown"
    return b"HTTP/1.1 %d %s\r\n" % (code, phrase.encode("latin-1"))


_STATUS: dict[int, bytes] = {s.value: _status_line(s.value) for s in HTTPStatus}


def status_line(code: int) -> bytes:
    """Prebuilt ``HTTP/1.1 <code> <phrase>\\r\\n`` (built on the fly for exotic codes)."""
    line = _STATUS.get(code)
    return line if line is not None else _status_line(code)


_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_HEALTH_KA = (b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; charset=utf-8\r\n"
              b"content-length: 2\r\n\r\nOK")
_HEALTH_CLOSE = (b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; charset=utf-8\r\n"
                 b"content-length: 2\r\nconnection: close\r\n\r\nOK")
_LAST_CHUNK = b"0\r\n\r\n"
_CT_JSON = b"application/json"
_CT_SSE = b"text/event-stream"

_INFERENCE = {
    b"/generate": "/generate",
    b"/v1/completions": "/v1/completions",
    b"/v1/chat/completions": "/v1/chat/completions",
}
# Paths answered by registry.handle_admin. Of those, only probes and the model
# list stay open under --api-key (protocol.md 6.7).
_ADMIN = frozenset({
    b"/workers", b"/add_worker", b"/remove_worker", b"/list_workers", b"/get_loads",
    b"/flush_cache", b"/get_server_info", b"/server_info", b"/get_model_info", b"/model_info",
    b"/v1/models", b"/readiness", b"/health_generate", b"/engine_metrics",
})
_OPEN = frozenset({b"/readiness", b"/v1/models"})

# Response headers never copied from the worker (hop-by-hop, or set by us).
_HOP = frozenset({
    b"connection", b"keep-alive", b"proxy-connection", b"proxy-authenticate",
    b"proxy-authorization", b"te", b"trailer", b"trailers", b"transfer-encoding", b"upgrade",
    b"content-encoding", b"host", b"content-length", b"x-request-id",
})

# Request header flags (bitmask) by lower-cased name; see ClientProtocol.on_header.
_F_FWD = 1       # forwarded verbatim to the worker (3.4 whitelist)
_F_AUTH = 2      # Authorization
_F_RID = 4       # candidate for the x-request-id response header
_F_KEY = 8       # routing key for consistent hashing
_F_CL = 16       # Content-Length
_F_EXPECT = 32   # Expect: 100-continue

# Bounded label values for metrics (unknown paths/methods collapse to one value).
_PATH_LABEL = {p: p.decode() for p in (
    b"/generate", b"/v1/completions", b"/v1/chat/completions", b"/health", b"/liveness",
    b"/readiness", b"/workers", b"/add_worker", b"/remove_worker", b"/list_workers", b"/get_loads",
    b"/flush_cache", b"/get_server_info", b"/server_info", b"/get_model_info", b"/model_info",
    b"/v1/models", b"/health_generate", b"/engine_metrics")}
_METHOD_LABEL = {m: m.decode() for m in (b"GET", b"POST", b"PUT", b"DELETE", b"HEAD", b"PATCH", b"OPTIONS")}
_STATUS_LABEL = {s.value: str(s.value) for s in HTTPStatus}

_RID_PREFIX = {b"/generate": b"gnt-", b"/v1/completions": b"cmpl-",
               b"/v1/chat/completions": b"chatcmpl-"}

_PIPELINE_LIMIT = 32          # queued pipelined requests before we stop reading the client
_HEAD_LIMIT = 1 << 16         # bytes of request line + headers before 431
# Upstream statuses worth another attempt on another target (protocol.md 7.2).
_RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_LEAK_EVERY = 5.0             # seconds between passes of the lease safety net
_LEAK_SLACK = 5.0             # grace past request_timeout_secs before a booking counts as leaked
_PD_BUFFER_LIMIT = 1 << 20    # decode bytes buffered while the prefill finishes
_ERROR_BODY_LIMIT = 1 << 16   # bytes of a failed leg's body kept for the error message


# Request ids are correlation tags, not secrets: a Mersenne Twister seeded from
# the OS is random enough (6.1) and costs no getrandom() syscall per request,
# unlike secrets.token_hex. Re-seeded in a forked child so that processes
# started by fork never hand out the same sequence.
_rid_rng = random.Random(os.urandom(32))
_rid_bits = _rid_rng.getrandbits
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _rid_rng.seed(os.urandom(32)))


def _new_request_id(path: bytes) -> bytes:
    # 24 lowercase hex characters (96 random bits): alphanumeric as 6.1 asks.
    return _RID_PREFIX.get(path, b"req-") + b"%024x" % _rid_bits(96)


# --------------------------------------------------------------------------- app state


class App:
    """Per-process data-path state shared by every client connection."""

    def __init__(self, config: Any, registry: Any, loop: asyncio.AbstractEventLoop | None = None,
                 room_rng: Any = None) -> None:
        self.config = config
        self.registry = registry
        self.loop = loop or asyncio.get_event_loop()
        self.pools: dict[str, Pool] = {}
        self.connections: set[ClientProtocol] = set()
        self.exchanges: set[_Exchange] = set()
        self.admin_tasks: set[asyncio.Task] = set()
        self.pd = bool(config.pd_disaggregation)
        self.dp_aware = bool(config.dp_aware)
        self.max_payload = int(config.max_payload_size)
        self.timeout = float(config.request_timeout_secs)
        self.header_timeout = float(getattr(config, "header_read_timeout_secs", 30.0) or 30.0)
        self.idle_timeout = float(getattr(config, "idle_connection_timeout_secs", 60.0) or 60.0)
        self.pool_idle = float(getattr(config, "upstream_pool_idle_timeout_secs", 3.0) or 3.0)
        self.room_rng = room_rng if room_rng is not None else random.Random(config.seed)
        field = config.dp_rank_field
        self.rank_field_regular = field or "data_parallel_rank"
        self.rank_field_decode = field or "routed_dp_rank"
        self.accepting = True
        self._stats: Any = None
        self.backend = "pd" if self.pd else "regular"

        # -- resilience (protocol.md 7.2-7.4) --
        self.max_attempts = max(1, int(getattr(config, "max_attempts", 1)))
        self.backoff_initial = float(getattr(config, "retry_initial_backoff_ms", 50)) / 1000.0
        self.backoff_max = float(getattr(config, "retry_max_backoff_ms", 30000)) / 1000.0
        self.backoff_mult = float(getattr(config, "retry_backoff_multiplier", 1.5))
        self.backoff_jitter = float(getattr(config, "retry_jitter_factor", 0.2))
        self.retry_rng = random.Random(config.seed)
        table = getattr(registry, "table", None)
        self.breakers: Breakers | None = None
        self.reconciler: Any = None
        if table is not None:
            self.breakers = Breakers(
                table, int(table.capacity), int(getattr(config, "cb_failure_threshold", 10)),
                int(getattr(config, "cb_success_threshold", 3)),
                float(getattr(config, "cb_timeout_duration_secs", 60)),
                not getattr(config, "disable_circuit_breaker", False),
                name_of=getattr(registry, "target_name", None), clock=self.loop.time)
            # Imported here, not at module level: the monitor side pulls in the
            # table (NumPy); the data path itself never touches it.
            from fastroute.control.monitor import Reconciler
            # Under --workers N the supervisor reconciles the shared table once (a proxy
            # process's registry follows the supervisor's and has a ledger of its own).
            if getattr(registry, "ledger", None) is None:
                self.reconciler = Reconciler(table, self.timeout, self._reconcile_mismatch)
            self._row_owner: dict[int, Any] = {}
            add_listener = getattr(registry, "add_listener", None)
            if add_listener is not None:
                add_listener(self._targets_changed)
        self.admission = Admission(int(getattr(config, "max_concurrent_requests", -1)),
                                   int(getattr(config, "queue_size", 100)),
                                   float(getattr(config, "queue_timeout_secs", 60)), self.loop)
        self.leak_every = _LEAK_EVERY
        self.leak_slack = _LEAK_SLACK
        self._next_leak = 0.0

        key = config.api_key
        self.api_key: bytes | None = ("Bearer " + key).encode() if key else None
        flags: dict[bytes, int] = {
            b"x-request-id": _F_FWD, b"x-correlation-id": _F_FWD, b"traceparent": _F_FWD,
            b"tracestate": _F_FWD, b"x-smg-routing-key": _F_FWD | _F_KEY,
            b"authorization": _F_AUTH, b"content-length": _F_CL, b"expect": _F_EXPECT,
        }
        self.rid_headers = tuple(h.encode("latin-1") for h in config.request_id_headers)
        for h in self.rid_headers:
            flags[h] = flags.get(h, 0) | _F_RID
        self.key_headers = (b"x-smg-routing-key",) + tuple(
            h.encode("latin-1") for h in config.routing_key_headers)
        for h in self.key_headers:
            flags[h] = flags.get(h, 0) | _F_KEY
        self.header_flags = flags
        self._sweep_handle: asyncio.TimerHandle | None = None
        every = [1.0, self.timeout / 4, self.header_timeout / 4]
        if self.admission.enabled:
            every.append(self.admission.queue_timeout / 4)
        if self.breakers is not None:
            every.append(self.breakers.timeout / 4)
        self._sweep_every = max(0.05, min(every))

    # fastroute.control.metrics.Stats of this process (set by the server when metrics
    # run): plain dict increments per request, turned into series at scrape time.
    @property
    def stats(self) -> Any:
        return self._stats

    @stats.setter
    def stats(self, stats: Any) -> None:
        self._stats = stats
        self.admission.stats = stats
        if self.breakers is not None:
            self.breakers.stats = stats

    # -- lifecycle ----------------------------------------------------------
    def start(self) -> None:
        """Start the periodic sweep (request timeouts, header read timeouts)."""
        if self._sweep_handle is None:
            self._sweep_handle = self.loop.call_later(self._sweep_every, self._sweep)

    def protocol_factory(self) -> ClientProtocol:
        return ClientProtocol(self)

    @property
    def active(self) -> int:
        """Requests being answered (proxied exchanges + admin calls + admission queue)."""
        return len(self.exchanges) + len(self.admin_tasks) + len(self.admission.queue)

    def stop_accepting(self) -> None:
        """Shutdown phase 1: close idle client connections; busy ones close after their response."""
        self.accepting = False
        for conn in list(self.connections):
            if not conn.busy and not conn.closed and conn.transport is not None:
                conn.closed = True
                conn.transport.close()

    def close(self) -> None:
        """Abort everything still open (end of the shutdown grace period)."""
        self.accepting = False
        if self._sweep_handle is not None:
            self._sweep_handle.cancel()
            self._sweep_handle = None
        for ex in list(self.exchanges):
            ex.cancel(503, "shutdown")
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.close()
        for t in list(self.admin_tasks):
            t.cancel()
        for pool in self.pools.values():
            pool.close()
        self.pools.clear()

    def _sweep(self) -> None:
        # One timer for all deadlines instead of a TimerHandle per request:
        # per-request cost is a float store, the sweep is O(open requests).
        now = self.loop.time()
        try:
            for ex in [e for e in self.exchanges if e.deadline <= now]:
                ex.on_timeout()
            for conn in [c for c in self.connections if 0.0 < c.head_deadline <= now]:
                conn.on_header_timeout()
            if self.admission.queue:
                self.admission.expire(now)
            if self.breakers is not None:
                self.breakers.tick(now)
            if now >= self._next_leak:
                self._next_leak = now + self.leak_every
                self.check_leaks(now)
        except Exception:  # a bug here must not stop the sweeper forever
            log.exception("sweep failed")
        self._sweep_handle = self.loop.call_later(self._sweep_every, self._sweep)

    # -- lease safety net -----------------------------------------------------
    def check_leaks(self, now: float | None = None) -> int:
        """Reclaim bookings their owner should have released; returns how many leases.

        Owners release in ``_Exchange._close_books``; this pass only catches bugs.
        Suspicious: an exchange still registered after it finished, one whose
        client connection is gone (connection_lost should have cancelled it), or
        one older than request_timeout_secs + slack (the timeout sweep should
        have ended it). Each reclaimed lease is logged and counted in
        ``fastroute_leases_reclaimed_total{reason}``.
        """
        if now is None:
            now = self.loop.time()
        limit = self.timeout + self.leak_slack
        n = 0
        for ex in list(self.exchanges):
            if ex.finished:
                reason = "finished"
            elif ex.proto.closed:
                reason = "client_gone"
            elif now - ex.started_at > limit:
                reason = "expired"
            else:
                continue
            n += self._reclaim(ex, reason, now)
        if self.reconciler is not None:
            self.reconciler.check(getattr(self.registry, "target_info", None) or (), now)
        return n

    def _reclaim(self, ex: _Exchange, reason: str, now: float) -> int:
        n = 0
        for lease in ex.leases:
            if lease.release():
                n += 1
                log.warning("reclaimed a leaked lease on target %s (%s, request %s, age %.1f s)",
                            lease.target, reason, ex.rid.decode("latin-1"), now - ex.started_at)
                if self._stats is not None:
                    self._stats.reclaim(reason)
        ex.leases = ()
        try:
            if reason == "expired" and not ex.finished:
                ex.on_timeout()   # answers 504 (or cuts the stream) like the timeout sweep
            elif not ex.finished:
                ex.cancel()
        except Exception:
            log.exception("cleanup of a leaked exchange failed")
        ex._close_books()
        self.exchanges.discard(ex)
        return n

    def _reconcile_mismatch(self, name: str) -> None:
        if self._stats is not None:
            self._stats.reclaim("reconcile_mismatch")

    def _targets_changed(self, role: str) -> None:
        # A table row handed to another worker starts with clean breaker cells
        # (TargetTable.alloc zeroes the row); here only this process's cached
        # metric labels for the row are dropped.  Resetting the shared cells would
        # let a restarted proxy process close circuits the others opened.
        owners = self._row_owner
        for t, entry in enumerate(self.registry.target_info):
            w = entry[0] if entry is not None else None
            if owners.get(t) is not w:
                owners[t] = w
                self.breakers.forget_names(t)  # type: ignore[union-attr]

    def backoff(self, retry: int) -> float:
        """Delay in seconds before retry number ``retry`` (0-based), with jitter (7.2)."""
        d = min(self.backoff_initial * self.backoff_mult ** retry, self.backoff_max)
        j = self.backoff_jitter
        return d * self.retry_rng.uniform(1.0 - j, 1.0 + j) if j else d

    def pool_for(self, worker: Any) -> Pool:
        pool = self.pools.get(worker.url)
        if pool is None:
            pool = Pool(worker.host, int(worker.port), self.pool_idle, self.loop)
            # With --api-key (or a per-worker key from POST /workers) the worker
            # always gets that key; the client's own header was checked equal.
            key = getattr(worker, "api_key", None) or self.config.api_key
            if key:
                pool.auth = b"Authorization: Bearer " + key.encode("latin-1") + b"\r\n"
            self.pools[worker.url] = pool
        return pool

    # -- dispatch -----------------------------------------------------------
    def handle(self, proto: ClientProtocol, req: Request) -> None:
        """Answer one parsed request; ends with proto.response_done() (maybe later)."""
        path, _, query = req.url.partition(b"?")
        st = self._stats
        if st is not None:
            label = _PATH_LABEL.get(path, "other")
            key = (_METHOD_LABEL.get(req.method, "OTHER"), label)
            st.http_requests[key] = st.http_requests.get(key, 0) + 1
        if path in _INFERENCE:
            if req.method != b"POST":
                proto.send_error(RouterError(405, "method_not_allowed",
                                             "Method Not Allowed (%s %s)" % (req.method.decode("latin-1"),
                                                                            path.decode("latin-1"))),
                                 req)
            elif self.api_key is not None and not self._authorized(req):
                proto.send_error(_errors.invalid_api_key(), req)
            else:
                self.proxy(proto, req, path)
        elif path == b"/health" or path == b"/liveness":
            ka = req.keep_alive and self.accepting
            if st is not None:
                self.count_response(200, "")
            proto.reply(_HEALTH_KA if ka else _HEALTH_CLOSE, ka)
        elif path in _ADMIN or path.startswith(b"/workers/"):
            if self.api_key is not None and path not in _OPEN and not self._authorized(req):
                proto.send_error(_errors.invalid_api_key(), req)
                return
            task = self.loop.create_task(self._admin(proto, req, path, query))
            self.admin_tasks.add(task)
            task.add_done_callback(self.admin_tasks.discard)
        else:
            proto.send_error(_errors.unknown_url(req.method.decode("latin-1"),
                                                 path.decode("latin-1")), req)

    def _count_routed(self, path: bytes, stream: bool) -> None:
        d = self._stats.router_requests
        key = (self.backend, _INFERENCE[path], "true" if stream else "false")
        d[key] = d.get(key, 0) + 1

    def count_response(self, status: int, code: str, path: bytes | None = None) -> None:
        """smg_http_responses, and smg_router_request_errors for failed inference requests."""
        st = self._stats
        d = st.http_responses
        key = (_STATUS_LABEL.get(status) or str(status), code)
        d[key] = d.get(key, 0) + 1
        if code and path is not None:
            endpoint = _INFERENCE.get(path)
            if endpoint is not None:
                e = st.router_errors
                key2 = (self.backend, endpoint, code)
                e[key2] = e.get(key2, 0) + 1

    def _authorized(self, req: Request) -> bool:
        got = req.auth
        return got is not None and hmac.compare_digest(got, self.api_key)  # type: ignore[arg-type]

    async def _admin(self, proto: ClientProtocol, req: Request, path: bytes, query: bytes) -> None:
        try:
            status, body, ctype = await self.registry.handle_admin(
                req.method.decode("latin-1"), path.decode("latin-1"), query.decode("latin-1"),
                req.body, ((b"authorization", req.auth),) if req.auth is not None else ())
        except asyncio.CancelledError:
            raise
        except RouterError as exc:
            proto.send_error(exc, req)
            return
        except Exception:
            log.exception("admin handler failed for %s", path)
            proto.send_error(RouterError(500, "internal_error", "internal error"), req)
            return
        if isinstance(ctype, str):
            ctype = ctype.encode("latin-1")
        proto.reply_simple(status, ctype, body, req)

    def proxy(self, proto: ClientProtocol, req: Request, path: bytes) -> None:
        st = self._stats
        if req.too_large:
            proto.send_error(_errors.payload_too_large(req.body_len, self.max_payload), req)
            return
        registry = self.registry
        if not registry.ready():
            proto.send_error(RouterError(503, _errors.CODE_NO_AVAILABLE_WORKERS,
                                         "No available workers (router is still registering workers)"),
                             req)
            return
        try:
            meta = _body.parse_request(_INFERENCE[path], req.body)
        except RouterError as exc:
            proto.send_error(exc, req)
            return
        # Every parsed inference request counts once here (whatever answers it:
        # relay, 429/408 admission, 503 no target, retries); malformed ones
        # count only in smg_http_responses_total.
        if st is not None:
            self._count_routed(path, meta.stream)
        if self.admission.try_enter():
            self._begin(proto, req, path, meta)
        else:
            self._wait(proto, req, path, meta)

    def _begin(self, proto: ClientProtocol, req: Request, path: bytes, meta: Any) -> None:
        """Start the exchange of an admitted request (it owns the admission slot from here)."""
        if self.pd:
            ex: _Exchange = PDRelay(self, proto, req, path, meta)
        else:
            ex = Relay(self, proto, req, path, meta)
        ex.attempt()

    def _wait(self, proto: ClientProtocol, req: Request, path: bytes, meta: Any) -> None:
        """Over --max-concurrent-requests: queue (FIFO) or refuse with 429."""
        def start() -> None:
            proto.waiter = None
            if proto.closed:  # client left between the dequeue and this callback
                self.admission.leave()
                return
            try:
                self._begin(proto, req, path, meta)
            except Exception:
                log.exception("request handling failed")

        def expired() -> None:
            proto.waiter = None
            if not proto.closed:
                proto.send_error(_errors.queue_timeout(), req)

        waiter = self.admission.wait(start, expired, self.loop.time())
        if waiter is None:
            proto.send_error(_errors.queue_full(), req)
            return
        proto.waiter = waiter

    def _frame(self, pool: Pool, req: Request, body: bytes) -> bytes:
        auth = pool.auth
        if not auth and req.auth is not None:
            auth = b"Authorization: " + req.auth + b"\r\n"
        return b"POST %b HTTP/1.1\r\nHost: %b\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%b%b\r\n%b" % (
            req.url, pool.authority, len(body), req.fwd, auth, body)

    def _frame_injected(self, pool: Pool, req: Request, head: Any, sep: bytes, fields: bytes,
                        tail: Any) -> bytes:
        """_frame of the body with ``fields`` injected (parts from body.splice_parts).

        The framing is the only copy of the client body per leg (no injected
        body is built first).
        """
        auth = pool.auth
        if not auth and req.auth is not None:
            auth = b"Authorization: " + req.auth + b"\r\n"
        return b"POST %b HTTP/1.1\r\nHost: %b\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%b%b\r\n%b%b%b%b" % (
            req.url, pool.authority, len(head) + len(sep) + len(fields) + len(tail), req.fwd, auth,
            head, sep, fields, tail)

    def _acquire(self, group: Any, meta: Any, req: Request) -> Any:
        # The group asks meta for what its policy needs (cache_aware: the text), so no branch
        # on the policy here. out_tokens only matters to KV-fit placement (the decode group).
        return group.acquire(meta.input_tokens, req.key, meta, meta.max_new_tokens or 0)


# --------------------------------------------------------------------------- client protocol


class Request:
    """One parsed client request (kept only until it is answered)."""

    __slots__ = ("method", "url", "fwd", "auth", "rid", "key", "body", "body_len",
                 "too_large", "keep_alive", "http11")

    def __init__(self) -> None:
        self.method = b"GET"
        self.url = b"/"
        self.fwd = b""
        self.auth: bytes | None = None
        self.rid: bytes | None = None
        self.key: bytes | None = None
        self.body = b""
        self.body_len = 0
        self.too_large = False
        self.keep_alive = True
        self.http11 = True


class ClientProtocol(asyncio.Protocol):
    """One client connection: parse requests, answer them strictly in order."""

    def __init__(self, app: App) -> None:
        self.app = app
        self.loop = app.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self._flags = app.header_flags   # lower-cased name -> _F_* bits (fixed per App)
        self.closed = False
        self.busy = False                 # a response is in progress
        self.queue: list[Request] = []    # pipelined requests waiting for their turn
        self.draining = False
        self.bad_request = False          # parse error seen: answer what is queued, then 400 + close
        self.read_paused = False
        self.write_paused = False
        self.exchange: _Exchange | None = None
        self.head_deadline = 0.0
        self.in_head = False
        # per-message parse state
        self._req: Request | None = None
        self._url = b""
        self._fwd: list[bytes] = []
        self._chunks: list[bytes] = []
        self._rid_vals: dict[bytes, bytes] | None = None
        self._key_vals: dict[bytes, bytes] | None = None
        self._expect = False
        self._cl = -1
        self._head_size = 0
        self.waiter: Any = None           # admission queue entry while the request waits for a slot
        self._bad_message = ""
        self._bad_status = 400

    # -- asyncio.Protocol ---------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        _nodelay(transport)
        self.app.connections.add(self)
        if self.app._stats is not None:
            self.app._stats.connections_active += 1
        self.head_deadline = self.loop.time() + self.app.header_timeout

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self in self.app.connections:
            self.app.connections.discard(self)
            if self.app._stats is not None:
                self.app._stats.connections_active -= 1
        self.queue.clear()
        ex = self.exchange
        if ex is not None:
            ex.cancel()  # client gone: abort upstream legs, release leases
        w = self.waiter
        if w is not None:
            self.waiter = None
            if self.app.admission.cancel(w) and self.app._stats is not None:
                self.app.count_response(499, "client_closed")

    def data_received(self, data: bytes) -> None:
        if self.bad_request:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._parse_failed("Upgrade is not supported")
        except httptools.HttpParserError as exc:
            self._parse_failed("Malformed HTTP request: %s" % exc)

    def pause_writing(self) -> None:
        self.write_paused = True
        ex = self.exchange
        if ex is not None:
            ex.client_paused()

    def resume_writing(self) -> None:
        self.write_paused = False
        ex = self.exchange
        if ex is not None:
            ex.client_resumed()

    # -- httptools callbacks --------------------------------------------------
    def on_message_begin(self) -> None:
        self._req = Request()
        self._url = b""
        self._fwd = []
        self._chunks = []
        self._rid_vals = None
        self._key_vals = None
        self._expect = False
        self._cl = -1
        self._head_size = 0
        self.in_head = True
        self.head_deadline = self.loop.time() + self.app.header_timeout

    def on_url(self, url: bytes) -> None:
        self._url = url if not self._url else self._url + url
        self._head_size += len(url)
        if self._head_size > _HEAD_LIMIT:
            self._head_too_large()

    def on_header(self, name: bytes, value: bytes) -> None:
        req = self._req
        if req is None:  # head already refused (431)
            return
        # httptools has no limit of its own on the head; without one a client
        # could make us buffer headers forever.
        size = self._head_size + len(name) + len(value) + 4
        self._head_size = size
        if size > _HEAD_LIMIT:
            self._head_too_large()
            return
        n = name.lower()
        f = self._flags.get(n)
        if f is None:
            # len() first: most unflagged names are shorter than the prefix.
            if len(n) > 13 and n.startswith(b"x-request-id-"):
                self._fwd.append(name + b": " + value + b"\r\n")
            return
        if f == _F_CL:  # the one flagged header of nearly every request
            try:
                self._cl = int(value)
            except ValueError:
                self._cl = -1
            return
        if f & _F_FWD:
            self._fwd.append(name + b": " + value + b"\r\n")
        if f & _F_AUTH:
            req.auth = value  # type: ignore[union-attr]
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

    def on_headers_complete(self) -> None:
        req = self._req
        if req is None:
            return
        self.in_head = False
        self.head_deadline = 0.0
        app = self.app
        req.method = self.parser.get_method()  # type: ignore[union-attr]
        if self._cl > app.max_payload:
            req.too_large = True  # type: ignore[union-attr]
            req.body_len = self._cl  # type: ignore[union-attr]
            if not self.busy and not self.queue:
                # Answer now instead of reading (or waiting for, under Expect:
                # 100-continue) a body we will refuse; then close, since the
                # unread body makes the stream unusable.
                self._req = None
                self.bad_request = True  # ignore whatever else arrives
                req.keep_alive = False  # type: ignore[union-attr]
                self.busy = True
                self.send_error(_errors.payload_too_large(self._cl, app.max_payload), req)  # type: ignore[arg-type]
        elif self._expect and not self.busy and not self.queue:
            # Only when nothing is being written: a 100 must not land inside another response.
            self.transport.write(_CONTINUE)  # type: ignore[union-attr]

    def on_body(self, body: bytes) -> None:
        req = self._req
        if req is None or req.too_large:
            return
        n = req.body_len + len(body)  # type: ignore[union-attr]
        req.body_len = n  # type: ignore[union-attr]
        if n > self.app.max_payload:
            req.too_large = True  # type: ignore[union-attr]
            self._chunks = []
            return
        self._chunks.append(body)

    def on_message_complete(self) -> None:
        req = self._req
        if req is None or self.bad_request:  # already answered (413/431 at the head)
            return
        self._req = None
        p = self.parser
        req.url = self._url  # type: ignore[union-attr]
        req.keep_alive = p.should_keep_alive()  # type: ignore[union-attr]
        req.http11 = p.get_http_version() == "1.1"  # type: ignore[union-attr]
        chunks = self._chunks
        if chunks:
            req.body = chunks[0] if len(chunks) == 1 else b"".join(chunks)  # type: ignore[union-attr]
        app = self.app
        if self._fwd:
            req.fwd = b"".join(self._fwd)  # type: ignore[union-attr]
        rv = self._rid_vals
        if rv:
            for h in app.rid_headers:
                v = rv.get(h)
                if v is not None:
                    req.rid = v  # type: ignore[union-attr]
                    break
        kv = self._key_vals
        if kv:
            for h in app.key_headers:
                v = kv.get(h)
                if v is not None:
                    req.key = v  # type: ignore[union-attr]
                    break
        if self.busy or self.queue:
            self.queue.append(req)  # type: ignore[arg-type]
            if len(self.queue) >= _PIPELINE_LIMIT and not self.read_paused:
                self.read_paused = True
                self.transport.pause_reading()  # type: ignore[union-attr]
        else:
            self._start(req)  # type: ignore[arg-type]

    # -- request sequencing ---------------------------------------------------
    def _start(self, req: Request) -> None:
        self.busy = True
        try:
            self.app.handle(self, req)
        except Exception:
            log.exception("request handling failed")
            if self.busy and self.exchange is None:
                self.send_error(RouterError(500, "internal_error", "internal error"), req)

    def response_done(self, keep_alive: bool) -> None:
        """The current response is fully written (or abandoned)."""
        self.busy = False
        self.exchange = None
        if self.closed:
            return
        if not keep_alive or not self.app.accepting:
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
                    if self.read_paused and len(self.queue) < _PIPELINE_LIMIT // 2:
                        self.read_paused = False
                        self.transport.resume_reading()  # type: ignore[union-attr]
                    self._start(req)
                    continue
                if self.bad_request:
                    self._write_bad_request()
                elif not self.in_head:
                    self.head_deadline = self.loop.time() + self.app.idle_timeout
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
        if not self.read_paused and not self.closed:
            self.read_paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]
        if not self.busy and not self.queue:
            self._write_bad_request()

    def _write_bad_request(self) -> None:
        if self.closed:
            # e.g. bytes after an HTTP/1.0 or "Connection: close" request that
            # was already answered and closed: nobody is left to tell.
            return
        status = self._bad_status
        code = _errors.CODE_BAD_REQUEST if status == 400 else "header_too_large"
        body = _errors.error_response(status, code, self._bad_message)
        if self.app._stats is not None:
            self.app.count_response(status, code)
        self.transport.write(b"%bcontent-type: application/json\r\nx-smg-error-code: %b\r\n"  # type: ignore[union-attr]
                             b"content-length: %d\r\nconnection: close\r\n\r\n%b"
                             % (status_line(status), code.encode(), len(body), body))
        self.closed = True
        self.transport.close()  # type: ignore[union-attr]

    def on_header_timeout(self) -> None:
        """Client too slow to send a request head (or idle keep-alive too long)."""
        if self.busy or self.closed:
            return
        self.closed = True
        self.head_deadline = 0.0
        if self.transport is not None:
            self.transport.close()

    # -- simple responses -----------------------------------------------------
    def reply(self, data: bytes, keep_alive: bool) -> None:
        if not self.closed:
            self.transport.write(data)  # type: ignore[union-attr]
        self.response_done(keep_alive)

    def reply_simple(self, status: int, ctype: bytes, body: bytes, req: Request,
                     extra: bytes = b"", code: str = "") -> None:
        ka = req.keep_alive and self.app.accepting
        if self.app._stats is not None:
            self.app.count_response(status, code, req.url.partition(b"?")[0])
        head = b"%bcontent-type: %b\r\ncontent-length: %d\r\n%b%b\r\n" % (
            status_line(status), ctype, len(body), extra, b"" if ka else b"connection: close\r\n")
        self.reply(head + body, ka)

    def send_error(self, exc: RouterError, req: Request, sse: bool = False) -> None:
        extra = b"x-smg-error-code: " + exc.code.encode("latin-1") + b"\r\n"
        for k, v in exc.headers:
            extra += k + b": " + v + b"\r\n"
        if sse:
            self.reply_simple(exc.status, _CT_SSE, exc.sse(), req, extra, exc.code)
        else:
            self.reply_simple(exc.status, _CT_JSON, exc.body(), req, extra, exc.code)


# --------------------------------------------------------------------------- exchanges


class _Exchange:
    """Client-facing half of one proxied request: framing, flow control, the lease release."""

    __slots__ = ("app", "proto", "req", "leases", "deadline", "chunked", "head", "started",
                 "finished", "keep_alive", "rid", "relay_conn", "out", "started_at", "path", "status",
                 "meta", "tries", "retry_handle", "slot", "gave_up")

    def __init__(self, app: App, proto: ClientProtocol, req: Request, path: bytes,
                 meta: Any) -> None:
        self.app = app
        self.proto = proto
        self.req = req
        self.meta = meta
        self.leases: tuple = ()          # bookings of the current attempt
        self.tries = 0                   # attempts started
        self.retry_handle: asyncio.TimerHandle | None = None
        self.slot = True                 # holds an admission slot until _close_books
        self.gave_up = False             # retries_exhausted counted
        self.started_at = app.loop.time()
        self.deadline = self.started_at + app.timeout
        self.chunked = False
        self.head: bytes | None = None   # client head not yet written (sent with the first body bytes)
        self.started = False             # client head built: errors now end the connection
        self.finished = False
        self.keep_alive = req.keep_alive
        self.rid = req.rid if req.rid is not None else _new_request_id(path)
        self.relay_conn: Any = None      # upstream connection whose body we relay (flow control)
        # Client bytes produced while one upstream read is parsed; written with a
        # single transport.write when the read is done (up_flush), so a burst of
        # SSE events costs one syscall, not one per event.
        self.out: list[bytes] = []
        self.path = path
        self.status = 0
        app.exchanges.add(self)
        proto.exchange = self

    # -- client writing -----------------------------------------------------
    def _start_response(self, status: int, headers: list, length: bytes | None = None,
                        ctype: bytes | None = None) -> None:
        """Build the client head from the upstream head (hop-by-hop stripped).

        ``length``: the upstream Content-Length to keep (byte-exact relay), or
        None to pick chunked framing. ``ctype`` overrides Content-Type.
        """
        parts = [status_line(status)]
        ap = parts.append
        self.status = status
        for name, value in headers:
            n = name.lower()
            if n in _HOP:
                continue
            if ctype is not None and n == b"content-type":
                continue
            ap(name + b": " + value + b"\r\n")
        if ctype is not None:
            ap(b"content-type: " + ctype + b"\r\n")
        if length is not None:
            ap(b"content-length: " + length + b"\r\n")
        elif status >= 200 and status not in (204, 304):
            if self.req.http11:
                ap(b"transfer-encoding: chunked\r\n")
                self.chunked = True
            else:
                self.keep_alive = False  # HTTP/1.0: body delimited by close
        ap(b"x-request-id: " + self.rid + b"\r\n")
        if not self.app.accepting:
            self.keep_alive = False  # draining: this connection closes after the response
        if not self.keep_alive:
            ap(b"connection: close\r\n")
        ap(b"\r\n")
        self.head = b"".join(parts)
        self.started = True

    def _write(self, data: bytes) -> None:
        if self.chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        head = self.head
        if head is not None:
            self.head = None
            data = head + data
        self.out.append(data)

    def flush(self) -> None:
        out = self.out
        if out:
            data = out[0] if len(out) == 1 else b"".join(out)
            out.clear()
            if not self.proto.closed:
                self.proto.transport.write(data)  # type: ignore[union-attr]

    up_flush = flush

    def _end(self) -> None:
        """Response complete: write what is left, release, hand the connection back."""
        head = self.head
        if head is not None:
            self.head = None
            self.out.append(head)
        if self.chunked:
            self.out.append(_LAST_CHUNK)
        self.flush()
        st = self.app._stats
        if st is not None:
            app = self.app
            app.count_response(self.status, "")
            if 200 <= self.status < 300:
                st.duration(app.backend, _INFERENCE[self.path], app.loop.time() - self.started_at)
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
                self.app.admission.leave()

    def _finish(self, keep_alive: bool) -> None:
        if self.finished:
            return
        self.finished = True
        self.relay_conn = None
        self.app.exchanges.discard(self)
        try:
            self._close_books()
        finally:
            if self.proto.exchange is self:
                self.proto.response_done(keep_alive)

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
                if self.app._stats is not None:
                    self.app.count_response(self.status, exc.code, self.path)
                self._finish(False)
                if not self.proto.closed:
                    self.proto.closed = True
                    self.proto.transport.close()  # type: ignore[union-attr]
                return
            self.head = None  # nothing sent yet: still free to answer with an error
            self.out.clear()
        self.finished = True
        self.app.exchanges.discard(self)
        try:
            self._close_books()
        finally:
            if self.proto.exchange is self:
                self.proto.exchange = None
                self.proto.send_error(exc, self.req, sse)

    # -- control --------------------------------------------------------------
    def client_paused(self) -> None:
        c = self.relay_conn
        if c is not None:
            c.pause()

    def client_resumed(self) -> None:
        c = self.relay_conn
        if c is not None:
            c.resume()

    def cancel(self, status: int = 499, code: str = "client_closed") -> None:
        """Client disconnected (or shutdown): drop the upstream legs, release.

        Counted as a response (nginx's 499 for a client that left) so every
        request has exactly one smg_http_responses_total sample.
        """
        if self.finished:
            return
        self._abort_legs()
        if self.app._stats is not None:
            self.app.count_response(status, code, self.path)
        self._finish(False)

    def on_timeout(self) -> None:
        if self.finished:
            return
        self._blame_timeout()
        self._fail_client(_errors.gateway_timeout())

    # -- retries (protocol.md 7.2) -----------------------------------------------
    def can_retry(self) -> bool:
        """Another attempt is allowed: attempts left and no client byte committed."""
        return self.tries < self.app.max_attempts and not self.started and not self.finished

    def retry_later(self, role: str) -> None:
        """Drop this attempt (legs aborted, leases released) and schedule a fresh pick.

        The delay is a timer on the loop (never a sleep); the request timeout
        and a client disconnect still apply while it waits.
        """
        self._abort_legs()
        self._release_leases()
        app = self.app
        st = app._stats
        if st is not None:
            key = (role, _INFERENCE[self.path])
            st.retries[key] = st.retries.get(key, 0) + 1
        self.retry_handle = app.loop.call_later(app.backoff(self.tries - 1), self._retry)

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
        app = self.app
        st = app._stats
        if st is not None and app.max_attempts > 1:
            key = (role, _INFERENCE[self.path])
            st.retries_exhausted[key] = st.retries_exhausted.get(key, 0) + 1

    def attempt(self) -> None:
        raise NotImplementedError

    def _blame_timeout(self) -> None:
        raise NotImplementedError

    def fail_internal(self) -> None:
        """Exception while starting an attempt: make sure the leases come back."""
        self._abort_legs()
        self._fail_client(RouterError(500, "internal_error", "internal error"))

    def _abort_legs(self) -> None:
        raise NotImplementedError


class Relay(_Exchange):
    """Regular mode: one worker, response relayed as it arrives. Is its own leg."""

    __slots__ = ("conn", "target")

    def __init__(self, app: App, proto: ClientProtocol, req: Request, path: bytes,
                 meta: Any) -> None:
        super().__init__(app, proto, req, path, meta)
        self.conn: Any = None
        self.target = -1

    def attempt(self) -> None:
        """Pick a target and send (first attempt and every retry)."""
        self.tries += 1
        app = self.app
        registry = app.registry
        lease = app._acquire(registry.group("regular"), self.meta, self.req)
        if lease is None:
            self._fail_client(_errors.no_available_workers())
            return
        self.leases = (lease,)
        self.target = lease.target
        self.status = 0
        try:
            worker, rank = registry.target_info[lease.target]
            req = self.req
            pool = app.pool_for(worker)
            if rank is not None and app.dp_aware:
                head, sep, tail = _body.splice_parts(req.body)
                pool.send(app._frame_injected(pool, req, head, sep, _body.rank_field_bytes(
                    app.rank_field_regular, rank), tail), self)
            else:
                pool.send(app._frame(pool, req, req.body), self)
        except BaseException:
            self.fail_internal()
            raise

    # leg callbacks (from upstream.UpstreamConnection)
    def up_head(self, status: int, headers: list) -> None:
        if status in _RETRY_STATUS:
            br = self.app.breakers
            if self.can_retry():
                if br is not None:
                    br.status(self.target, status)
                self.retry_later("regular")  # aborts this connection: no more callbacks
                return
            self.exhausted("regular")
        length = None
        for name, value in headers:
            if len(name) == 14 and name.lower() == b"content-length":
                length = value
                break
        self._start_response(status, headers, length)
        conn = self.conn
        self.relay_conn = conn
        if self.proto.write_paused and conn is not None:
            conn.pause()

    def up_body(self, data: bytes) -> None:
        self._write(data)

    def up_done(self) -> None:
        self.conn = None
        br = self.app.breakers
        if br is not None:
            br.status(self.target, self.status)
        self._end()

    def up_error(self, exc: BaseException) -> None:
        self.conn = None
        if self.finished:
            return
        br = self.app.breakers
        if br is not None:
            br.failure(self.target)  # connect error, reset, or a stream cut short
        # Only a connect failure proves the worker never saw the request; a
        # connection that died later may have run it, so that is not retried.
        if isinstance(exc, ConnectError):
            if self.can_retry():
                self.retry_later("regular")
                return
            self.exhausted("regular")
        self._fail_client(_errors.bad_gateway("Upstream request failed: %s" % exc))

    def _blame_timeout(self) -> None:
        br = self.app.breakers
        if br is not None and self.leases and self.conn is not None:
            br.failure(self.target)

    def _abort_legs(self) -> None:
        c = self.conn
        self.conn = None
        if c is not None:
            c.abort()


class _PDLeg:
    """One leg of a PD exchange; forwards upstream callbacks to the PDRelay."""

    __slots__ = ("ex", "conn", "role", "status", "headers", "chunks", "size", "done", "target")

    def __init__(self, ex: PDRelay, role: str, target: int = -1) -> None:
        self.ex = ex
        self.conn: Any = None
        self.role = role
        self.target = target
        self.status = 0
        self.headers: list = []
        self.chunks: list[bytes] = []
        self.size = 0
        self.done = False

    def up_head(self, status: int, headers: list) -> None:
        self.status = status
        self.headers = headers
        self.ex.pd_progress()

    def up_body(self, data: bytes) -> None:
        ex = self.ex
        if ex.relaying:
            if self is ex.d:
                ex.relay_body(data)
            return
        ok = 200 <= self.status < 300
        if self is ex.p or not ok:
            # Read to completion, never paused (we wait for its end). Kept only
            # when needed: the whole body for a logprob merge, else the first
            # bytes for an error message.
            if (ok and ex.merge) or (not ok and self.size < _ERROR_BODY_LIMIT):
                self.chunks.append(data)
                self.size += len(data)
            return
        # Decode 2xx before the relay starts (prefill still running): buffer,
        # and stop reading past the limit; the relay start resumes it.
        self.chunks.append(data)
        self.size += len(data)
        if self.size > _PD_BUFFER_LIMIT and self.conn is not None:
            self.conn.pause()

    def up_done(self) -> None:
        self.conn = None
        self.done = True
        ex = self.ex
        br = ex.app.breakers
        if br is not None:
            br.status(self.target, self.status)
        if ex.relaying and self is ex.d:
            ex.relay_end()
        else:
            ex.pd_progress()

    def up_error(self, exc: BaseException) -> None:
        self.conn = None
        # A connect failure proves this leg's worker never saw the request.
        self.ex.leg_failed(self, exc, isinstance(exc, ConnectError))

    def body(self) -> bytes:
        return b"".join(self.chunks)

    def up_flush(self) -> None:
        self.ex.flush()


class _NoLeg:
    """Stand-in for the legs of a PD exchange before its first attempt (shared, never mutated)."""

    __slots__ = ()
    conn = None
    role = "prefill"
    target = -1
    status = 0
    headers: list = []
    chunks: list = []
    size = 0
    done = False

    def body(self) -> bytes:
        return b""


_NO_LEG: Any = _NoLeg()


class PDRelay(_Exchange):
    """PD mode (protocol.md 3.5): both heads, decode status first, drain prefill, relay decode."""

    __slots__ = ("p", "d", "stream", "merge", "relaying", "merger")

    def __init__(self, app: App, proto: ClientProtocol, req: Request, path: bytes,
                 meta: Any) -> None:
        super().__init__(app, proto, req, path, meta)
        # attempt() makes the real legs; until then both point at an inert leg
        # (no connection, no status) so every path that reads them stays valid.
        self.p = self.d = _NO_LEG
        self.stream = bool(meta.stream)
        self.merge = bool(meta.return_logprob)
        self.relaying = False
        self.merger: Any = None

    def attempt(self) -> None:
        """Pick a fresh pair, draw a fresh room, send both legs (first attempt and retries)."""
        self.tries += 1
        app = self.app
        registry = app.registry
        meta, req = self.meta, self.req
        plea = app._acquire(registry.group("prefill"), meta, req)
        if plea is None:
            self._fail_client(_errors.no_available_workers("prefill"))
            return
        dlea = app._acquire(registry.group("decode"), meta, req)
        if dlea is None:
            plea.release()
            self._fail_client(_errors.no_available_workers("decode"))
            return
        self.leases = (plea, dlea)
        # New leg objects per attempt: callbacks of an aborted attempt can never
        # reach the new one.
        p = self.p = _PDLeg(self, "prefill", plea.target)
        d = self.d = _PDLeg(self, "decode", dlea.target)
        try:
            pworker, prank = registry.target_info[plea.target]
            dworker, drank = registry.target_info[dlea.target]
            # Prefill rank travels in the room (room % prefill_dp_size == rank, 4.3),
            # never as a body key on the prefill leg; one room for both legs.
            pfields, dfields = _body.pd_leg_fields(
                meta, pworker.host, pworker.bootstrap_port, app.room_rng,
                app.rank_field_decode if drank is not None else None, drank,
                int(pworker.dp_size) if prank is not None else 1, prank)
            # One scan of the client body for both legs.
            head, sep, tail = _body.splice_parts(req.body)
            ppool = app.pool_for(pworker)
            dpool = app.pool_for(dworker)
            # Both legs leave in the same loop iteration (3.4: concurrent dispatch).
            ppool.send(app._frame_injected(ppool, req, head, sep, pfields, tail), p)
            dpool.send(app._frame_injected(dpool, req, head, sep, dfields, tail), d)
        except BaseException:
            self.fail_internal()
            raise

    def _retry_head(self, leg: _PDLeg) -> bool:
        """A leg answered a retryable status before the relay: retry if allowed.

        The outcome is recorded on that leg's target only (the other leg is
        aborted by us and says nothing about its worker).
        """
        if not self.can_retry():
            self.exhausted(leg.role)
            return False
        br = self.app.breakers
        if br is not None:
            br.status(leg.target, leg.status)
        self.retry_later(leg.role)
        return True

    def pd_progress(self) -> None:
        """Re-evaluate after any leg event until the relay starts (or an error is sent)."""
        if self.relaying or self.finished:
            return
        p, d = self.p, self.d
        # 3.5: decode status decides first, its body is the message. We do not
        # wait for the prefill head once the decode error is complete: the
        # answer cannot change, and a prefill waiting for a decode that
        # will never bootstrap would only hold the client until the timeout.
        if d.status and not 200 <= d.status < 300:
            if d.status in _RETRY_STATUS and not d.done and self._retry_head(d):
                return
            if d.done:
                self._leg_error(d)
            return
        if p.status in _RETRY_STATUS and not p.done and self._retry_head(p):
            # Retried at the prefill head: a decode that cannot bootstrap from
            # it would only answer (or hang) later.
            return
        if not d.status or not p.status:
            # A failed prefill still waits for the decode head (the decode's
            # own error, if any, takes precedence); request_timeout_secs bounds it.
            return
        if not p.done:
            return  # 3.5 step 3: prefill read to completion
        if not 200 <= p.status < 300:
            self._leg_error(p)
            return
        if self.merge and not self.stream:
            if not d.done:
                return
            merged = _logprobs.merge_logprobs_json(p.body(), d.body())
            self.relaying = True
            self._start_response(d.status, d.headers, b"%d" % len(merged), _CT_JSON)
            self._write(merged)
            self._end()
            return
        self.relaying = True
        length = None
        if self.merge:
            merger = _logprobs.SSELogprobMerger()
            merger.feed_prefill(p.body())
            self.merger = merger
        else:
            for name, value in d.headers:
                if len(name) == 14 and name.lower() == b"content-length":
                    length = value  # byte-exact relay keeps the decode's length
                    break
        p.chunks = []
        self._start_response(d.status, d.headers, length)
        buffered = d.chunks
        d.chunks = []
        for c in buffered:
            self.relay_body(c)
        if d.done:
            self.relay_end()
            return
        self.flush()  # we may be inside the prefill's read: nothing else flushes these bytes
        conn = d.conn
        self.relay_conn = conn
        if conn is not None:
            if self.proto.write_paused:
                conn.pause()
            else:
                conn.resume()  # may have been paused by the pre-relay buffer limit

    def relay_body(self, data: bytes) -> None:
        m = self.merger
        if m is not None:
            data = m.transform(data)
            if not data:
                return
        self._write(data)

    def relay_end(self) -> None:
        m = self.merger
        if m is not None:
            tail = m.flush()
            if tail:
                self._write(tail)
        self._end()

    def _leg_error(self, leg: _PDLeg) -> None:
        exc = _errors.leg_error(leg.role, leg.status, leg.body())
        self._fail_client(exc, self.stream)

    def leg_failed(self, leg: _PDLeg, exc: BaseException, connect_failed: bool = False) -> None:
        if self.finished or leg is not self.p and leg is not self.d:
            return
        br = self.app.breakers
        if br is not None:
            br.failure(leg.target)  # only the leg that failed (the other may be fine)
        if connect_failed and not self.relaying:
            if self.can_retry():
                self.retry_later(leg.role)
                return
            self.exhausted(leg.role)
        self._fail_client(_errors.bad_gateway("PD disaggregation request failed (%s leg: %s)"
                                              % (leg.role, exc)))

    def _blame_timeout(self) -> None:
        # The leg the exchange is still waiting for is the slow one: the
        # prefill while it has not finished (the decode waits on it), else the decode.
        br = self.app.breakers
        if br is None or not self.leases:
            return
        p, d = self.p, self.d
        if not p.done and p.conn is not None:
            br.failure(p.target)
        elif not d.done and d.conn is not None:
            br.failure(d.target)

    def _abort_legs(self) -> None:
        for leg in (self.p, self.d):
            c = leg.conn
            if c is not None:  # (never true for _NO_LEG, which must stay unmodified)
                leg.conn = None
                c.abort()
