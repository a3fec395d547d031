"""What a proxy process has open: client connections, TLS handshakes, live exchanges.

One :class:`Live` per proxy process. The client protocol adds and removes its connection and the
exchanges register themselves while they run; the sweep (sweep.py) walks these sets for
deadlines and leaked leases, and the App for shutdown. ``accepting`` turns False when the
shutdown drain starts: from then on every response closes its connection.
"""

from __future__ import annotations

from typing import Any


class Live:
    """The process's open connections and exchanges (module docstring)."""

    __slots__ = ("connections", "handshaking", "exchanges", "accepting")

    def __init__(self) -> None:
        self.connections: set[Any] = set()  # ClientProtocol: connected
        # TLS connections accepted whose handshake has not finished -> when it must have
        # (accept + --header-read-timeout-secs, the listener's handshake timeout). Counted in
        # smg_http_connections_active from the accept, like any other open connection.
        self.handshaking: dict[Any, float] = {}
        self.exchanges: set[Any] = set()  # exchanges that have not finished
        self.accepting = True
