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

_COMPLETION = re.compile(rb'"completion_tokens"\s*:\s*(\d+)')
_TAIL = 4096  # bytes of a non-streaming answer kept to find its completion_tokens


def _output_tokens(tail: bytes) -> int:
    found = _COMPLETION.findall(tail)
    return int(found[-1]) if found else 0


def metered(book: Any, pd: bool) -> Any:
    """The exchange class the App runs under --speed-aware: ``PDRelay`` or ``Relay`` timing
    what they relay into ``book`` (a ``fastroute.core.speed.SpeedBook``, handed in by the
    runtime: the data plane imports no core module)."""

    class MeteredRelay(Relay):
        __slots__ = ("meter", "tail")

        meter: Any
        tail: bytes

        def attempt(self) -> None:
            self.meter = None
            self.tail = b""
            Relay.attempt(self)

        def up_body(self, data: bytes) -> None:
            if 200 <= self.status < 300:
                if self.meta.stream:
                    m = self.meter
                    if m is None or m.target != self.target:
                        m = self.meter = book.meter(self.target)
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
        __slots__ = ("meter", "tail", "replaying", "p_sent", "p_idle", "p_done_at")

        meter: Any
        tail: bytes

        def attempt(self) -> None:
            self.meter = None
            self.tail = b""
            self.replaying = False
            self.p_done_at = -1.0
            self.p_sent = monotonic()
            PDRelay.attempt(self)
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
                        m = self.meter = book.meter(self.d.target)
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
