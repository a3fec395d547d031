"""Small one-shot async HTTP/1.1 client for the control plane.

Owns the router's *control* traffic to workers: registration handshake, load polls, health
probes and admin fan-outs (/flush_cache, /metrics, /health_generate, server/model info). It is
deliberately not used on the request path (the data path has its own pooled upstream): a call
opens one connection, sends ``Connection: close`` and parses the answer with
``httptools.HttpResponseParser``; a call given a :class:`Pool` (the load polls) reuses the
pool's kept-alive connection to that worker port instead. The whole exchange, connect included, is bounded by one
total timeout.

Failures are reported as one exception family so callers can treat "worker unreachable"
uniformly: :class:`HttpConnectError` (could not connect), :class:`HttpTimeout` (total timeout
exceeded) and :class:`HttpProtocolError` (malformed or truncated response), all subclasses of
:class:`HttpClientError`.
"""

from __future__ import annotations

import asyncio
import functools
import ssl as _ssl
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

import httptools

# asyncio.timeout (Python 3.11+); wait_for on 3.10.
_timeout = getattr(asyncio, "timeout", None)

__all__ = [
    "HttpClientError",
    "HttpConnectError",
    "HttpTimeout",
    "HttpProtocolError",
    "HttpTLSClosed",
    "Pool",
    "request",
    "header",
]

HeadersIn = Mapping[str, str] | Iterable[tuple[str, str]] | None
HeaderList = list[tuple[str, str]]

_READ_CHUNK = 65536
# A worker's answer to a control call (loads, server info, a /metrics fan-out) is read whole:
# past this many bytes it is refused as malformed, not buffered without end.
MAX_RESPONSE_BYTES = 64 << 20


class HttpClientError(Exception):
    """Base class: the request did not produce a complete HTTP response."""


class HttpConnectError(HttpClientError):
    """TCP (or TLS) connection to the worker could not be established or was reset."""


class HttpTLSError(HttpConnectError):
    """The TLS handshake failed (certificate not trusted, hostname mismatch, client certificate
    refused): retrying cannot fix it, so registration reports it at once."""


# The context for https:// URLs: fastroute.tls.client_context from --ca-cert-paths and the
# client certificate, installed once per process by the runtime (configure_tls); until then the
# system default (verifying against the system CAs).
_tls: _ssl.SSLContext | None = None


def configure_tls(ctx: _ssl.SSLContext | None) -> None:
    """Use ``ctx`` for every https:// request of this process (None: the system default)."""
    global _tls
    _tls = ctx


def _tls_context() -> _ssl.SSLContext:
    global _tls
    if _tls is None:
        _tls = _ssl.create_default_context()
    return _tls


class HttpTimeout(HttpClientError):
    """The total timeout elapsed before the response was complete."""


class HttpProtocolError(HttpClientError):
    """The peer sent something that is not a complete, well-formed HTTP response."""


class HttpTLSClosed(HttpProtocolError):
    """The TLS handshake completed, then the worker closed without a byte of response: what a
    worker that requires a client certificate does under TLS 1.3 when none (or one it does not
    trust) was presented. Retried like any closed connection; registration warns once."""


class _Collector:
    """httptools callback target; accumulates one response."""

    __slots__ = ("headers", "chunks", "complete", "headers_done")

    def __init__(self) -> None:
        self.headers: HeaderList = []
        self.chunks: list[bytes] = []
        self.complete = False
        self.headers_done = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.decode("latin-1").lower(), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)

    def on_message_complete(self) -> None:
        self.complete = True


def header(headers: HeaderList, name: str) -> str | None:
    """First value of header ``name`` (lower-case) in a response header list, or None."""
    for k, v in headers:
        if k == name:
            return v
    return None


# Load polls and health probes ask the same few URLs of every worker each interval: parsed once
# (a thousand workers' polls spent ~10% of their loop time in urlsplit). Bad URLs raise, and
# are not kept.
@functools.lru_cache(maxsize=16384)
def _split_url(url: str) -> tuple[str, int, bool, str, str]:
    """-> (connect host, port, tls, Host header value, path+query)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise HttpConnectError(f"unsupported URL scheme in {url!r}")
    host = parts.hostname
    if not host:
        raise HttpConnectError(f"no host in URL {url!r}")
    tls = parts.scheme == "https"
    try:
        port = parts.port or (443 if tls else 80)
    except ValueError as exc:  # port out of range / not a number
        raise HttpConnectError(f"bad port in URL {url!r}") from exc
    target = parts.path or "/"
    if parts.query:
        target = f"{target}?{parts.query}"
    netloc = parts.netloc.rpartition("@")[2]
    return host, port, tls, netloc, target


def _encode_request(method: str, netloc: str, target: str, body: bytes, headers: HeadersIn, close: bool) -> bytes:
    lines = [f"{method} {target} HTTP/1.1", f"Host: {netloc}"]
    if close:
        lines.append("Connection: close")
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}")
    if headers:
        items = headers.items() if isinstance(headers, Mapping) else headers
        for k, v in items:
            lines.append(f"{k}: {v}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head + body if body else head


_Origin = tuple[str, int, bool]  # (connect host, port, tls)
_Conn = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class Pool:
    """Idle keep-alive connections, at most one per origin, for calls repeated every interval
    (load polls: a new TCP connection per poll and worker was most of a poll's cost on the
    loop). A connection goes back only after a complete response the server lets live; one
    the server closed while idle is replaced once, transparently."""

    def __init__(self) -> None:
        self._idle: dict[_Origin, _Conn] = {}

    def __len__(self) -> int:
        return len(self._idle)

    def _take(self, origin: _Origin) -> _Conn | None:
        conn = self._idle.pop(origin, None)
        if conn is not None and (conn[0].at_eof() or conn[1].is_closing()):
            conn[1].close()
            return None
        return conn

    def _give(self, origin: _Origin, conn: _Conn) -> None:
        old = self._idle.pop(origin, None)
        if old is not None:
            old[1].close()
        self._idle[origin] = conn

    def keep_only(self, urls: Iterable[str]) -> None:
        """Close the idle connections to every origin but those of ``urls``."""
        keep = {_split_url(u)[:3] for u in urls}
        for origin in [o for o in self._idle if o not in keep]:
            self._idle.pop(origin)[1].close()

    def close(self) -> None:
        idle, self._idle = self._idle, {}
        for _, writer in idle.values():
            writer.close()


class _Stale(Exception):
    """A reused connection was closed by the server before a byte of the response."""


async def _connect(host: str, port: int, tls: bool) -> _Conn:
    try:
        return await asyncio.open_connection(host, port, ssl=_tls_context() if tls else None)
    except _ssl.SSLError as exc:  # before OSError: SSLError is one
        raise HttpTLSError(
            f"TLS handshake with {host}:{port} failed: {getattr(exc, 'verify_message', None) or exc.reason or exc}"
        ) from exc
    except OSError as exc:
        raise HttpConnectError(f"cannot connect to {host}:{port}: {exc}") from exc


async def _exchange(
    method: str, url: str, body: bytes, headers: HeadersIn, pool: Pool | None
) -> tuple[int, HeaderList, bytes]:
    host, port, tls, netloc, target = _split_url(url)
    raw = _encode_request(method, netloc, target, body, headers, close=pool is None)
    if pool is not None:
        conn = pool._take((host, port, tls))
        if conn is not None:
            try:
                return await _over(conn, raw, url, pool, reused=True)
            except _Stale:
                pass  # closed by the server while idle: once more on a new connection
    return await _over(await _connect(host, port, tls), raw, url, pool, reused=False)


async def _over(conn: _Conn, raw: bytes, url: str, pool: Pool | None, reused: bool) -> tuple[int, HeaderList, bytes]:
    """One request/response on ``conn``; it goes back to ``pool`` when it may carry another."""
    host, port, tls = _split_url(url)[:3]
    reader, writer = conn
    col = _Collector()
    parser = httptools.HttpResponseParser(col)
    keep = False
    got = 0
    try:
        writer.write(raw)
        await writer.drain()
        while not col.complete:
            data = await reader.read(_READ_CHUNK)
            got += len(data)
            if got > MAX_RESPONSE_BYTES:
                raise HttpProtocolError(f"the response from {url} exceeds {MAX_RESPONSE_BYTES} bytes")
            if not data and reused and got == 0:
                raise _Stale
            if not data and tls and got == 0:
                raise HttpTLSClosed(f"{host}:{port} closed the TLS connection without answering")
            if not data:
                # EOF. A response without Content-Length/chunked framing ends at EOF, which
                # httptools cannot be told about; accept it only in that case.
                if (
                    col.headers_done
                    and header(col.headers, "content-length") is None
                    and "chunked" not in (header(col.headers, "transfer-encoding") or "")
                ):
                    break
                raise HttpProtocolError(f"connection closed before the response from {url} was complete")
            try:
                parser.feed_data(data)
            except httptools.HttpParserUpgrade:  # pragma: no cover - never requested
                raise HttpProtocolError(f"unexpected protocol upgrade from {url}") from None
            except httptools.HttpParserError as exc:
                raise HttpProtocolError(f"malformed response from {url}: {exc}") from exc
        status = parser.get_status_code()
        # (httptools' should_keep_alive() is reset once the message completes: read the framing)
        keep = (
            pool is not None
            and col.complete
            and parser.get_http_version() == "1.1"
            and "close" not in (header(col.headers, "connection") or "").lower()
        )
    except (ConnectionError, OSError) as exc:
        if reused and got == 0:
            raise _Stale from exc
        raise HttpConnectError(f"connection to {host}:{port} failed: {exc}") from exc
    finally:
        if keep and pool is not None:
            pool._give((host, port, tls), conn)
        else:
            writer.close()
    return status, col.headers, b"".join(col.chunks)


async def request(
    method: str,
    url: str,
    body: bytes = b"",
    headers: HeadersIn = None,
    timeout: float = 5.0,
    pool: Pool | None = None,
) -> tuple[int, HeaderList, bytes]:
    """Send one request and return ``(status, headers, body)``; with ``pool``, over one of its
    kept-alive connections (else ``Connection: close`` on a new one).

    ``headers`` in the result is a list of ``(lower-case name, value)`` string pairs.
    Raises :class:`HttpClientError` subclasses on connect failure, timeout (``timeout`` bounds
    the whole exchange) or a malformed/truncated response. Non-2xx statuses are returned,
    not raised.
    """
    try:
        if _timeout is None:  # Python 3.10
            return await asyncio.wait_for(_exchange(method, url, body, headers, pool), timeout)
        # A deadline on this task, not wait_for's task per request (a fleet's polls made a
        # thousand a second).
        async with _timeout(timeout):
            return await _exchange(method, url, body, headers, pool)
    except asyncio.TimeoutError:
        raise HttpTimeout(f"{method} {url} timed out after {timeout:g}s") from None
