"""One timer for every deadline of a proxy process, and the lease safety net it runs.

A request stores its deadlines as floats (``exchange.deadline``, ``exchange.ka_due``,
``proto.head_deadline``); nothing on the request path arms a timer. :class:`Sweeper` wakes every
``every`` seconds (a quarter of the shortest timeout it serves, at least 50 ms, at most 1 s) and
acts on what is due: request timeouts (504 or a cut stream), SSE keep-alive comments, header read
timeouts, TLS handshakes that never finished, the admission queue's expiry, the circuit breakers'
half-open moves, and every ``leak_every`` seconds the lease safety net.

The safety net (:meth:`Sweeper.check_leaks`) catches bugs, not traffic: owners release their
leases in ``_Exchange._close_books``. It reclaims the bookings of an exchange still registered
after it finished, of one whose client connection is gone, and of one older than the request
timeout plus ``leak_slack``; each reclaimed lease is logged and counted
(``fastroute_leases_reclaimed_total{reason}``). Where this process audits the shared table it
also runs the reconciler.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from fastroute.dataplane._clock import monotonic
from fastroute.dataplane.telemetry import NULL_TELEMETRY, Telemetry

if TYPE_CHECKING:
    from fastroute.control.leases import Reconciler
    from fastroute.core.breaker import Breakers
    from fastroute.dataplane.admission import Admission
    from fastroute.dataplane.exchange import _Exchange
    from fastroute.dataplane.limits import Limits
    from fastroute.dataplane.live import Live

log = logging.getLogger("fastroute.proxy")

LEAK_EVERY = 5.0  # seconds between passes of the lease safety net
LEAK_SLACK = 5.0  # grace past request_timeout_secs before a booking counts as leaked


class Sweeper:
    """The periodic pass over one process's open requests and connections (``live``; module
    docstring); ``reconciler`` audits the shared table of ``registry`` where this process does
    (None elsewhere). ``tel`` is the metrics' events (the App swaps in the counting one)."""

    def __init__(
        self,
        live: Live,
        limits: Limits,
        admission: Admission,
        loop: asyncio.AbstractEventLoop,
        breakers: Breakers | None = None,
        registry: Any = None,
        reconciler: Reconciler | None = None,
    ) -> None:
        self._live = live
        self._limits = limits
        self._admission = admission
        self._loop = loop
        self._breakers = breakers
        self._registry = registry
        self.reconciler = reconciler
        self.tel: Telemetry = NULL_TELEMETRY
        self.leak_every = LEAK_EVERY
        self.leak_slack = LEAK_SLACK
        self.next_leak = 0.0
        self._handle: asyncio.TimerHandle | None = None
        every = [1.0, limits.timeout / 4, limits.header_timeout / 4]
        if admission.enabled:
            every.append(admission.queue_timeout / 4)
        if breakers is not None:
            every.append(breakers.timeout / 4)
        if limits.sse_keepalive > 0:
            every.append(limits.sse_keepalive / 4)
        self.every = max(0.05, min(every))

    def start(self) -> None:
        if self._handle is None:
            self._handle = self._loop.call_later(self.every, self.tick)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def tick(self) -> None:
        """One pass now (the timer calls it every ``every`` seconds)."""
        live = self._live
        # The data plane's deadlines and start times are _clock.monotonic readings; admission
        # keeps the loop's clock (its own timer wakes it).
        now = monotonic()
        try:
            for ex in [e for e in live.exchanges if e.deadline <= now]:
                ex.on_timeout()
            if self._limits.sse_keepalive > 0:
                for ex in [e for e in live.exchanges if 0.0 < e.ka_due <= now]:
                    ex.keepalive(now)
            for conn in [c for c in live.connections if 0.0 < c.head_deadline <= now]:
                conn.on_header_timeout()
            if live.handshaking:
                self._expire_handshakes(now)
            if self._admission.queue:
                self._admission.expire(self._loop.time())
            if self._breakers is not None:
                self._breakers.tick(now)
            if now >= self.next_leak:
                self.next_leak = now + self.leak_every
                self.check_leaks(now)
        except Exception:  # a bug here must not stop the sweeper forever
            log.exception("sweep failed")
        self._handle = self._loop.call_later(self.every, self.tick)

    def _expire_handshakes(self, now: float) -> None:
        """Uncount TLS connections whose handshake deadline passed: the listener aborted them
        (or they failed earlier: asyncio tells the protocol nothing of a failed handshake)."""
        hs = self._live.handshaking
        for proto in [p for p, due in hs.items() if due <= now]:
            del hs[proto]
            self.tel.connections(-1)

    def check_leaks(self, now: float | None = None) -> int:
        """Reclaim bookings their owner should have released (module docstring); returns how
        many leases."""
        if now is None:
            now = monotonic()
        limit = self._limits.timeout + self.leak_slack
        n = 0
        for ex in list(self._live.exchanges):
            if ex.finished:
                reason = "finished"
            elif ex.client.closed:
                reason = "client_gone"
            elif now - ex.started_at > limit:
                reason = "expired"
            else:
                continue
            n += self._reclaim(ex, reason, now)
        if self.reconciler is not None:
            self.reconciler.check(getattr(self._registry, "target_info", None) or (), now)
        return n

    def _reclaim(self, ex: _Exchange, reason: str, now: float) -> int:
        n = 0
        for lease in ex.leases:
            if lease.release():
                n += 1
                log.warning(
                    "reclaimed a leaked lease on target %s (%s, request %s, age %.1f s)",
                    lease.target,
                    reason,
                    ex.rid.decode("latin-1"),
                    now - ex.started_at,
                )
                self.tel.reclaim(reason)
        ex.leases = ()
        try:
            if reason == "expired" and not ex.finished:
                ex.on_timeout()  # answers 504 (or cuts the stream) like the timeout sweep
            elif not ex.finished:
                ex.cancel()
        except Exception:
            log.exception("cleanup of a leaked exchange failed")
        ex._close_books()
        self._live.exchanges.discard(ex)
        return n
