"""The data plane's frozen settings: what the client protocol, the endpoints and the exchanges
read on every request, fixed at start.

One :class:`Limits` per proxy process, built by the App from the config and never changed:
payload and time limits, the header tables the protocol classifies headers with, the retry
budget, the PD batch limit, CORS, and whether an admin rule is configured (``guarded``: admin
calls with a body are then checked at their head). What changes while the process runs lives
elsewhere: the open connections and exchanges in :class:`~fastroute.dataplane.live.Live`, the
targets in :class:`~fastroute.dataplane.upstreams.Upstreams`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastroute.dataplane.cors import Cors
from fastroute.dataplane.headerflags import header_flags

if TYPE_CHECKING:
    from fastroute.config import Config


class Limits:
    """The settings (module docstring); in the compiled build (limits.pxd) each is a C field."""

    __slots__ = (
        "max_payload",
        "timeout",
        "header_timeout",
        "body_timeout",
        "idle_timeout",
        "sse_keepalive",
        "max_attempts",
        "pd_max_batch_size",
        "guarded",
        "cors",
        "header_flags",
        "rid_headers",
        "key_headers",
    )

    def __init__(self, config: Config, guarded: bool) -> None:
        self.max_payload = int(config.max_payload_size)
        self.timeout = float(config.request_timeout_secs)
        self.header_timeout = float(config.header_read_timeout_secs)
        self.body_timeout = float(config.body_read_timeout_secs)
        self.idle_timeout = float(config.idle_connection_timeout_secs)
        # SSE keep-alive comments while a stream waits for its first upstream byte (0: off).
        self.sse_keepalive = float(config.sse_keepalive_secs)
        self.max_attempts = int(config.max_attempts)
        self.pd_max_batch_size = int(config.pd_max_batch_size)
        self.guarded = guarded  # an admin rule is configured: admin calls are checked at the head
        self.cors = Cors(config.cors_allowed_origins)
        # header name -> _F_* bits (headerflags.py; grows by one entry per new spelling)
        self.header_flags, self.rid_headers, self.key_headers = header_flags(
            config.request_id_headers, config.routing_key_headers, self.cors.enabled
        )
