"""PD disaggregation (protocol.md 3.5): one client request, a prefill leg and a decode leg.

Both legs leave in the same loop iteration with the same bootstrap room. The
decode's status decides first (its body is the error message); the prefill is
read to completion; then the decode's body is relayed (with the prefill's input
logprobs merged in when the request asked for logprobs,
:mod:`fastroute.dataplane.logprobs`). What is buffered is bounded: the decode
bytes that arrive before the relay (then its reading is paused), and the answers
kept for a logprob merge (past ``_MERGE_LIMIT`` the merge is given up, logged,
and the decode relayed as it came).

Refused before any leg leaves: a batch over ``--pd-max-batch-size`` (413; each
item costs a bootstrap room), and client DP-rank keys (400): ranks are the
router's choice, and a client's key would reach the prefill unchanged, where it
contradicts the rank the bootstrap room encodes. Retries pick a fresh pair and draw a fresh
room. Breaker outcomes are recorded on the leg that produced them only: the
other leg is aborted by us and says nothing about its worker.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from fastroute import errors as _errors
from fastroute.config import DP_RANK_FIELDS
from fastroute.dataplane.body import bootstrap_fields, splice_point
from fastroute.dataplane.exchange import KEEP_LENGTH, RETRY_STATUS, TIMEOUT, _Exchange, retry_after
from fastroute.dataplane.logprobs import SSELogprobMerger, merge_logprobs_json
from fastroute.dataplane.upstream import ConnectError, Leg
from fastroute.dataplane.wire import CT_JSON
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

_PD_BUFFER_LIMIT = 1 << 20  # decode bytes buffered while the prefill finishes
_ERROR_BODY_LIMIT = 1 << 16  # bytes of a failed leg's body kept for the error message
# Bytes of one leg's answer kept for a logprob merge (the prefill's whole answer, and the
# decode's for a JSON merge): input logprobs of a 128k-token prompt with top-20 logprobs
# are a few tens of MB; anything beyond is not worth holding (and re-encoding) in memory.
_MERGE_LIMIT = 64 << 20
_RANK_A, _RANK_B = DP_RANK_FIELDS  # the client body keys refused in PD mode


class _PDLeg(Leg):
    """One leg of a PD exchange; forwards upstream callbacks to the PDRelay."""

    __slots__ = ("ex", "role", "status", "headers", "chunks", "size", "done", "target")

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
        ex = self.ex
        if self is ex.d:
            ex.observe_ttft()
        ex.pd_progress()

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
                if ok and self.size > _MERGE_LIMIT:
                    ex.drop_merge(self)
            return
        # Decode 2xx before the relay starts (prefill still running): buffer,
        # and stop reading past the limit; the relay start resumes it.
        self.chunks.append(data)
        self.size += len(data)
        if ex.merge and not ex.stream:
            # A JSON merge needs the whole decode answer, so reading goes on up to the
            # merge bound (pausing here would wait for an end that never comes).
            if self.size > _MERGE_LIMIT:
                ex.drop_merge(self)
                ex.client.flow.hold(self)
                ex.pd_progress()  # a finished prefill lets the plain relay start now
        elif self.size > _PD_BUFFER_LIMIT:
            ex.client.flow.hold(self)

    def up_done(self) -> None:
        self.conn = None
        self.done = True
        ex = self.ex
        if self is ex.p and ex.leases:
            # Its prefill is over: under prefill input demand its tokens are given back now
            # (the request stays booked until the exchange ends).
            ex.leases[0].answered()
        ex._outcome(self.target, self.status)
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


# The legs of a PD exchange before its first attempt and after its books are closed: no
# connection, no status, nothing buffered. One shared instance (a _PDLeg, so that the
# compiled build can type the exchange's legs), so nothing may ever write to it
# (tests/unit/test_no_cycles.py checks it stays as made).
_NO_LEG = _PDLeg(None, "prefill")  # type: ignore[arg-type]  # inert: it has no exchange


class PDRelay(_Exchange):
    """PD mode (protocol.md 3.5): both heads, decode status first, drain prefill, relay decode."""

    __slots__ = ("p", "d", "stream", "merge", "relaying", "merger")

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
        # attempt() makes the real legs; until then both point at an inert leg
        # (no connection, no status) so every path that reads them stays valid.
        self.p = self.d = _NO_LEG
        self.stream = bool(meta.stream)
        self.merge = bool(meta.return_logprob)
        self.relaying = False
        self.merger: Any = None

    def drop_merge(self, leg: _PDLeg) -> None:
        """``leg``'s answer outgrew ``_MERGE_LIMIT``: give the logprob merge up (the decode is
        relayed as it came) and free what was kept for it."""
        self.merge = False
        self.p.chunks = []
        if leg is self.p:
            self.p.size = 0
        log.warning(
            "request %s: %s answer over %d bytes, input logprobs not merged",
            self.rid.decode("latin-1"),
            leg.role,
            _MERGE_LIMIT,
        )

    def _refusal(self) -> RouterError | None:
        """Why this request must not be sent at all (checked once, before the first pick)."""
        meta = self.meta
        batch = meta.batch
        limit = self.limits.pd_max_batch_size
        if batch is not None and batch > limit:
            return RouterError(
                413, "batch_too_large", "PD batch of %d items exceeds --pd-max-batch-size %d" % (batch, limit)
            )
        obj = meta.fields  # (the rank keys are among the fields body.py always reads)
        for field in DP_RANK_FIELDS:
            if field in obj:
                return RouterError(
                    400, _errors.CODE_BAD_REQUEST, "'%s' is chosen by the router in PD mode; do not send it" % field
                )
        return None

    def attempt(self) -> None:
        """Pick a fresh pair, draw a fresh room, send both legs (first attempt and retries)."""
        meta, req = self.meta, self.req
        if not self.tries and (meta.batch is not None or _RANK_A in meta.fields or _RANK_B in meta.fields):
            refused = self._refusal()  # (called only for the requests that may need it)
            if refused is not None:
                self._fail_client(refused)
                return
        self.tries += 1
        upstreams = self.upstreams
        tokens, key, out_tokens = meta.input_tokens, req.key, meta.max_new_tokens or 0
        # Both acquires run inside the error handling too: whatever they raise, the client
        # is answered and the leases and admission slot given back (fail_internal).
        tel = self.tel
        t0 = tel.clock()
        try:
            p_lease = upstreams.group("prefill").acquire(tokens, key, meta, out_tokens)
            if p_lease is None:
                self._fail_client(_errors.no_available_workers("prefill"))
                return
            self.leases = (p_lease,)
            d_lease = upstreams.group("decode").acquire(tokens, key, meta, out_tokens)
            tel.pick(t0)  # the pair's pick
            meta.shed()  # both picks have read the decoded prompt: not held while we wait
            if d_lease is None:
                self._fail_client(_errors.no_available_workers("decode"))  # releases p_lease
                return
            self.leases = (p_lease, d_lease)
            # New leg objects per attempt: callbacks of an aborted attempt can never
            # reach the new one.
            p = self.p = _PDLeg(self, "prefill", p_lease.target)
            d = self.d = _PDLeg(self, "decode", d_lease.target)
            routes = upstreams.routes
            p_route = routes[p_lease.target]
            d_route = routes[d_lease.target]
            # Prefill rank travels in the room (room % prefill_dp_size == rank, 4.3),
            # never as a body key on the prefill leg; one room for both legs.
            pfields = bootstrap_fields(
                meta.batch, p_route.bootstrap, upstreams.room_rng, p_route.prefill_dp_size, p_route.prefill_rank
            )
            rank = d_route.rank_field
            dfields = pfields if rank is None else pfields + b"," + rank
            if p_route.prefill_rank_field is not None:  # a per-rank-port prefill rank
                dfields = dfields + b"," + p_route.prefill_rank_field
            # One scan of the client body for both legs.
            end, sep = splice_point(req.body)
            # Both legs leave in the same loop iteration (3.4: concurrent dispatch).
            p_route.send_injected(req, end, sep, pfields, p)
            d_route.send_injected(req, end, sep, dfields, d)
        except BaseException:
            self.fail_internal()
            raise

    def _retry_head(self, leg: _PDLeg) -> bool:
        """A leg answered a retryable status before the relay: retry if allowed."""
        wait = retry_after(leg.status, leg.headers)
        if not self.can_retry() or not self.fits(wait):
            self.exhausted(leg.role)
            return False
        self._outcome(leg.target, leg.status)
        self.retry_later(leg.role, wait)
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
            if d.status in RETRY_STATUS and not d.done and self._retry_head(d):
                return
            if d.done:
                self._leg_error(d)
            return
        if p.status in RETRY_STATUS and not p.done and self._retry_head(p):
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
            merged = merge_logprobs_json(p.body(), d.body())
            self.relaying = True
            self._start_response(d.status, d.headers, b"%d" % len(merged), CT_JSON)
            self._write(merged)
            self._end()
            return
        self.relaying = True
        length = None
        if self.merge:
            merger = SSELogprobMerger()
            merger.feed_prefill(p.body())
            self.merger = merger
        else:
            length = KEEP_LENGTH  # byte-exact relay keeps the decode's length
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
        # From here the decode is read only while the client accepts writes (this also
        # lifts the pre-relay buffer limit's hold).
        self.client.flow.relay(d, held=True)

    def observe_ttft(self) -> None:
        """smg_pd_ttft_seconds: from the request's start to the decode's response head."""
        self.tel.ttft(self.path, self.meta, self.started_at)

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
        self._outcome(leg.target, exc)  # only the leg that failed (the other may be fine)
        if connect_failed and not self.relaying:
            if self.can_retry():
                self.retry_later(leg.role)
                return
            self.exhausted(leg.role)
        self._fail_client(_errors.bad_gateway("PD disaggregation request failed (%s leg: %s)" % (leg.role, exc)))

    def _blame_timeout(self) -> None:
        # The leg the exchange is still waiting for is the slow one: the
        # prefill while it has not finished (the decode waits on it), else the decode.
        if not self.leases:
            return
        p, d = self.p, self.d
        if not p.done and p.conn is not None:
            self._outcome(p.target, TIMEOUT)
        elif not d.done and d.conn is not None:
            self._outcome(d.target, TIMEOUT)

    def _close_books(self) -> None:
        try:
            _Exchange._close_books(self)  # (not super(): the compiled build's C override)
        finally:
            # The legs point back at this exchange: letting go of them here breaks that
            # cycle, so the exchange, its legs and their buffers are freed by reference
            # counting when the request ends, not by a garbage-collector pass (which cost
            # about a tenth of the PD CPU per request while the cycle stayed).
            self.p = self.d = _NO_LEG

    def _abort_legs(self) -> None:
        for leg in (self.p, self.d):
            c = leg.conn
            if c is not None:  # (never true for _NO_LEG, which must stay unmodified)
                leg.conn = None
                c.abort()
