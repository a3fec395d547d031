"""Backpressure of one client connection, in both directions, in one object.

Two things are paused here, never anywhere else:

* reading from the **client** (too many pipelined requests queued, or a parse
  error after which nothing more is read);
* reading from the **upstream connection** whose response is relayed to this
  client, while the client transport is above its high-water mark (asyncio
  calls ``pause_writing`` / ``resume_writing`` on the protocol, which forwards
  them here), or while a PD exchange buffers a decode body it cannot relay yet.

The upstream side is reached through the *leg* being relayed (the object the
pool serves, see :mod:`fastroute.dataplane.upstream`), always as ``leg.conn``,
never as a connection remembered here. Every leg drops its ``conn`` before
anything else happens when its response ends, fails or is aborted, and the pool
takes a connection back only at that point, so a connection that went back to
the pool (and may already serve another request) is never paused or resumed
from here.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastroute.dataplane.upstream import Leg


class FlowControl:
    """Pause/resume state of one client connection and of the upstream relayed to it."""

    __slots__ = ("transport", "reading_paused", "writing_paused", "_leg")

    def __init__(self, transport: asyncio.Transport | None = None) -> None:
        self.transport = transport
        self.reading_paused = False  # we stopped reading the client
        self.writing_paused = False  # the client transport is above its high-water mark
        self._leg: Any = None  # the leg whose upstream body flows to this client

    # -- reading the client -----------------------------------------------------
    def pause_reading(self) -> None:
        if not self.reading_paused:
            self.reading_paused = True
            self.transport.pause_reading()  # type: ignore[union-attr]

    def resume_reading(self) -> None:
        if self.reading_paused:
            self.reading_paused = False
            self.transport.resume_reading()  # type: ignore[union-attr]

    # -- writing to the client (asyncio's water marks) ----------------------------
    def pause_writing(self) -> None:
        self.writing_paused = True
        leg = self._leg
        if leg is not None:
            conn = leg.conn
            if conn is not None:
                conn.pause()

    def resume_writing(self) -> None:
        self.writing_paused = False
        leg = self._leg
        if leg is not None:
            conn = leg.conn
            if conn is not None:
                conn.resume()

    # -- the upstream relayed to the client ----------------------------------------
    def relay(self, leg: Leg, held: bool = False) -> None:
        """``leg``'s upstream body now flows to this client: it is read only while the client
        accepts writes. ``held``: the leg may be under a ``hold``, lifted here unless the client
        is full. The binding lasts until the next ``relay``; once the exchange is over its legs
        hold no connection, so a stale binding does nothing (and costs no unbinding call per
        request)."""
        self._leg = leg
        conn = leg.conn
        if conn is not None:
            if self.writing_paused:
                conn.pause()
            elif held:
                conn.resume()

    @staticmethod
    def hold(leg: Any) -> None:
        """Stop reading ``leg``'s upstream while its bytes are buffered, not relayed (the PD
        decode before the prefill ended); ``relay(leg)`` lifts it."""
        conn = leg.conn
        if conn is not None:
            conn.pause()
