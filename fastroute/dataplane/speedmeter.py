"""The relay's measurements for ``--speed-aware`` (fits in ``fastroute.core.speed``).

With the mode off the App runs the plain ``Relay`` / ``PDRelay``: the request path does no more
work than without this module. With it on (or in shadow) it runs these subclasses, which time
the decode answer's upstream reads (``StreamMeter``), give a non-streaming answer's decode time
over its output tokens as one sample, and time a PD prefill that found its rank idle (time to
its answer over its input tokens) where the rank does not push LoadStat counters.
"""

from __future__ import annotations

import re
from typing import Any

from fastroute.dataplane._clock import monotonic
from fastroute.dataplane.exchange import Relay
from fastroute.dataplane.pd import PDRelay
from fastroute.errors import CODE_BAD_REQUEST, RouterError

CODE_SLO_UNATTAINABLE = "slo_unattainable"
_NO_SLO = (0.0, 0.0)

_SLO = re.compile(rb"(?im)^x-slo-(ttft|tpot)-ms:[ \t]*([^\r\n]*)")
SLO_HEADERS = (b"x-slo-ttft-ms", b"x-slo-tpot-ms")  # llm-d's spelling (milliseconds)
_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_TAIL = 4096  # bytes of a non-streaming answer kept to find its completion_tokens


def _output_tokens(tail: bytes) -> int:
    found = _COMPLETION.findall(tail)
    return int(found[-1]) if found else 0


def slo_targets(fwd: bytes) -> tuple[float, float]:
    """(TTFT, TPOT) targets in seconds from a request's forwarded header lines (0: none);
    ValueError naming the header when a value is not a positive number of milliseconds."""
    if b"slo" not in fwd and b"SLO" not in fwd:
        return 0.0, 0.0
    got = {b"ttft": 0.0, b"tpot": 0.0}
    for name, raw in _SLO.findall(fwd):
        text = raw.strip().decode("latin-1")
        try:
            ms = float(text)
        except ValueError:
            ms = -1.0
        if not 0 < ms < 1e9:
            raise ValueError(
                f"x-slo-{name.lower().decode()}-ms must be a positive number of milliseconds, not {text!r}"
            )
        got[name.lower()] = ms / 1000.0
    return got[b"ttft"], got[b"tpot"]


def _refusal(exc: ValueError | None, book: Any, tokens: int, slo: tuple[float, float]) -> RouterError | None:
    """Why a request's SLO headers stop it before any pick: malformed (400), or under
    ``--speed-slo-unmet refuse`` no rank predicted to meet them (503, Retry-After)."""
    if exc is not None:
        return RouterError(400, CODE_BAD_REQUEST, str(exc))
    if book.refuse_unmet and (slo[0] > 0 or slo[1] > 0) and not book.slo_feasible(tokens, slo[0], slo[1]):
        for cls, target in zip(("ttft", "tpot"), slo):
            if target > 0:
                book.count_slo(cls, "refused")
        return RouterError(
            503,
            CODE_SLO_UNATTAINABLE,
            "No worker is predicted to meet the request's latency targets (x-slo-ttft-ms / x-slo-tpot-ms)",
            headers=((b"Retry-After", b"1"),),  # send_error adds x-smg-error-code
        )
    return None


def _slo_of(ex: Any) -> tuple[tuple[float, float], ValueError | None]:
    try:
        return slo_targets(ex.req.fwd), None
    except ValueError as exc:
        return (0.0, 0.0), exc


def metered(book: Any, pd: bool) -> Any:
    """The exchange class the App runs under --speed-aware: ``PDRelay`` or ``Relay`` timing
    what they relay into ``book`` (a ``fastroute.core.speed.SpeedBook``, handed in by the
    runtime: the data plane imports no core module)."""

    def refused_at_start(x: Any) -> bool:
        """At a request's first attempt, read its SLO headers; True when they refuse it (the
        client has been answered). Any earlier attempt's SLO hold is dropped."""
        if not x.tries:
            x.slo, bad = _slo_of(x)
            refused = _refusal(bad, book, x.meta.input_tokens, x.slo)
            if refused is not None:
                x._fail_client(refused)
                return True
        drop_held(x)
        return False

    def attempt_with_slo(x: Any, base: Any) -> None:
        """``base.attempt`` with the request's SLO visible to the speed-aware pick."""
        book.next_slo = x.slo
        try:
            base.attempt(x)
        finally:
            book.next_slo = _NO_SLO

    def drop_held(x: Any) -> None:
        held = getattr(x, "held", None)
        x.held = None
        if held is not None:
            book.drop_slo(held, x.slo[1])

    class MeteredRelay(Relay):
        __slots__ = ("meter", "tail", "slo", "held")

        meter: Any
        tail: bytes
        slo: tuple[float, float]

        def attempt(self) -> None:
            self.meter = None
            self.tail = b""
            if refused_at_start(self):
                return
            attempt_with_slo(self, Relay)
            if self.slo[1] > 0 and self.leases:
                self.held = book.hold_slo(self.target, self.slo[1])

        def _close_books(self) -> None:
            try:
                Relay._close_books(self)
            finally:
                drop_held(self)

        def up_body(self, data: bytes) -> None:
            if 200 <= self.status < 300:
                if self.meta.stream:
                    m = self.meter
                    if m is None or m.target != self.target:
                        m = self.meter = book.meter(self.target, self.slo, self.started_at)
                    m.read(data, monotonic())
                else:
                    self.tail = (self.tail + data)[-_TAIL:]
            Relay.up_body(self, data)

        def _end(self) -> None:
            if 200 <= self.status < 300:
                if self.meter is not None:
                    self.meter.end()
                elif not self.meta.stream:
                    book.observe_whole(self.target, _output_tokens(self.tail), monotonic() - self.started_at)
            Relay._end(self)

    class MeteredPDRelay(PDRelay):
        __slots__ = ("meter", "tail", "replaying", "p_sent", "p_idle", "p_done_at", "slo", "held")

        meter: Any
        tail: bytes
        slo: tuple[float, float]

        def attempt(self) -> None:
            self.meter = None
            self.tail = b""
            self.replaying = False
            self.p_done_at = -1.0
            self.p_sent = monotonic()
            self.p_idle = False
            if refused_at_start(self):
                return
            attempt_with_slo(self, PDRelay)
            if self.slo[1] > 0 and len(self.leases) == 2:
                self.held = book.hold_slo(self.d.target, self.slo[1])

        def _close_books(self) -> None:
            try:
                PDRelay._close_books(self)
            finally:
                drop_held(self)
            t = self.p.target
            # A prefill that found its rank idle: its time to answer is compute, not queueing.
            self.p_idle = book.idle_prefill(t)

        def pd_progress(self) -> None:
            p = self.p
            if p.done and self.p_done_at < 0:
                now = self.p_done_at = monotonic()
                if self.p_idle and 200 <= p.status < 300:
                    book.observe_prefill(p.target, self.meta.input_tokens, now - self.p_sent)
            self.replaying = True  # decode bytes buffered before the relay come in one burst
            try:
                PDRelay.pd_progress(self)
            finally:
                self.replaying = False

        def relay_body(self, data: bytes) -> None:
            if self.stream:
                if not self.replaying:
                    m = self.meter
                    if m is None:
                        m = self.meter = book.meter(self.d.target, self.slo, self.started_at)
                    m.read(data, monotonic())
            else:
                self.tail = (self.tail + data)[-_TAIL:]
            PDRelay.relay_body(self, data)

        def relay_end(self) -> None:
            if self.meter is not None:
                self.meter.end()
            elif not self.stream and self.p_done_at > 0:
                book.observe_whole(self.d.target, _output_tokens(self.tail), monotonic() - self.p_done_at)
            PDRelay.relay_end(self)

    return MeteredPDRelay if pd else MeteredRelay
