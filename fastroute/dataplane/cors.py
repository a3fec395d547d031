"""CORS for browser clients (``--cors-allowed-origins ORIGIN ... | '*'``).

Default: no origin is allowed and no ``Access-Control-*`` header is ever sent (smg's default).
With origins configured, a preflight (``OPTIONS`` with ``Origin`` and
``Access-Control-Request-Method``) from an allowed origin is answered ``204`` with the allowed
methods and the requested headers, and every response to an allowed origin carries
``Access-Control-Allow-Origin`` (the origin itself, or ``*`` when any origin is allowed) and
``Vary: Origin``. A disallowed origin gets no allowance, so the browser blocks the response.

Everything is precomputed bytes; the per-request cost is one dict lookup for requests that carry
an ``Origin`` header and nothing for the others.
"""

from __future__ import annotations

from collections.abc import Iterable

METHODS = b"GET, POST, PUT, DELETE, OPTIONS"
# Response headers a browser script may read beyond the CORS-safelisted ones.
_EXPOSE = b"x-request-id, x-smg-routed-worker-id"
_MAX_AGE = b"600"
_TOKEN = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789!#$%&'*+-.^_`|~ ,")


def _normal(origin: str) -> bytes:
    return origin.strip().rstrip("/").lower().encode("latin-1")


class Cors:
    """Answers for one process; ``enabled`` is False when no origin is configured."""

    __slots__ = ("enabled", "any", "_allow")

    def __init__(self, origins: Iterable[str] | None) -> None:
        origins = [o for o in (origins or ()) if o.strip()]
        self.enabled = bool(origins)
        self.any = "*" in origins
        # origin (as the browser sent it, lower-cased) -> header lines for its responses
        self._allow: dict[bytes, bytes] = {}
        for o in origins:
            if o != "*":
                n = _normal(o)
                self._allow[n] = self._lines(n)

    @staticmethod
    def _lines(origin: bytes) -> bytes:
        return (
            b"access-control-allow-origin: " + origin + b"\r\nvary: Origin\r\n"
            b"access-control-expose-headers: " + _EXPOSE + b"\r\n"
        )

    def headers_for(self, origin: bytes | None) -> bytes:
        """Header lines to add to a response to ``origin`` (empty when not allowed)."""
        if origin is None or not self.enabled:
            return b""
        key = origin.strip().lower()
        lines = self._allow.get(key)
        if lines is not None:
            return lines
        if self.any:
            return (
                b"access-control-allow-origin: *\r\nvary: Origin\r\naccess-control-expose-headers: " + _EXPOSE + b"\r\n"
            )
        return b""

    def preflight(
        self, origin: bytes | None, request_headers: bytes | None, keep_alive: bool, http11: bool = True
    ) -> bytes:
        """The whole response to an ``OPTIONS`` request (``http11`` False: an HTTP/1.0 one,
        which is kept alive only when the answer says so)."""
        allow = self.headers_for(origin)
        lines = b"allow: " + METHODS + b"\r\n"
        if allow:
            lines += allow + b"access-control-allow-methods: " + METHODS + b"\r\n"
            if request_headers and all(c in _TOKEN for c in request_headers):
                lines += b"access-control-allow-headers: " + request_headers.strip() + b"\r\n"
            lines += b"access-control-max-age: " + _MAX_AGE + b"\r\n"
        conn = (b"" if http11 else b"connection: keep-alive\r\n") if keep_alive else b"connection: close\r\n"
        return b"HTTP/1.1 204 No Content\r\n" + lines + conn + b"\r\n"
