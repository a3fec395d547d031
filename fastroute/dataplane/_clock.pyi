"""Typed API of fastroute.dataplane._clock: the request path's monotonic clock."""

from __future__ import annotations

def monotonic() -> float: ...
