"""The request-header flag table: which header names the data plane acts on, and how.

``ClientProtocol.on_header`` looks each header name up in a per-App table of ``_F_*`` bits
(forward to the worker, Authorization, request-id or routing-key candidate, Content-Length,
Expect, Connection, the CORS request headers). The table is built once per App by :func:`header_flags`
from the configured header names and grows by :func:`_classify` with each new spelling a client
uses, so the hot path is one dict lookup per header. Nothing here runs per request once a
spelling is known: the module is not compiled.
"""

from __future__ import annotations

# Request header flags (bitmask) by lower-cased name; see ClientProtocol.on_header.
_F_FWD = 1  # forwarded verbatim to the worker (3.4 whitelist)
_F_AUTH = 2  # Authorization
_F_RID = 4  # candidate for the x-request-id response header
_F_KEY = 8  # routing key for consistent hashing
_F_CL = 16  # Content-Length
_F_EXPECT = 32  # Expect: 100-continue
_F_ORIGIN = 64  # Origin (flagged only with --cors-allowed-origins)
_F_ACRH = 128  # Access-Control-Request-Headers (ditto: preflights)
_F_CONN = 256  # Connection: only then can a kept-alive request be other than HTTP/1.1


def header_flags(
    request_id_headers: list[str],
    routing_key_headers: list[str],
    cors: bool = False,
) -> tuple[dict[bytes, int], tuple[bytes, ...], tuple[bytes, ...]]:
    """(flag table, request-id headers in priority order, routing-key headers in priority order).

    Built once per App from the configured header names (already lower-cased by Config).
    ``cors``: also flag the CORS request headers (without CORS they cost nothing).
    """
    flags: dict[bytes, int] = {
        b"x-request-id": _F_FWD,
        b"x-correlation-id": _F_FWD,
        b"traceparent": _F_FWD,
        b"tracestate": _F_FWD,
        b"x-smg-routing-key": _F_FWD | _F_KEY,
        b"authorization": _F_AUTH,
        b"content-length": _F_CL,
        b"expect": _F_EXPECT,
        b"connection": _F_CONN,
    }
    if cors:
        flags[b"origin"] = _F_ORIGIN
        flags[b"access-control-request-headers"] = _F_ACRH
    rid_headers = tuple(h.encode("latin-1") for h in request_id_headers)
    for h in rid_headers:
        flags[h] = flags.get(h, 0) | _F_RID
    key_headers = (b"x-smg-routing-key",) + tuple(h.encode("latin-1") for h in routing_key_headers)
    for h in key_headers:
        flags[h] = flags.get(h, 0) | _F_KEY
    return flags, rid_headers, key_headers


_HEADER_SPELLINGS = 1024  # raw header-name spellings remembered per App (see _classify)


def _classify(flags: dict[bytes, int], name: bytes) -> int:
    """The flag bits of a header name as the client spelled it, remembered in the App's table.

    The table starts with the flagged lower-case names; each new spelling (``Content-Length``,
    ``User-Agent``...) is looked up once by its lower-case form and then found by one dict
    lookup, without a ``lower()`` per header. Unflagged names get 0, ``x-request-id-*``
    (forwarded) ``_F_FWD``. A client inventing names cannot grow the table past
    ``_HEADER_SPELLINGS`` new entries: beyond that, names are classified each time.
    """
    n = name.lower()
    f = flags.get(n)
    if f is None:
        f = _F_FWD if len(n) > 13 and n.startswith(b"x-request-id-") else 0
    if len(flags) < _HEADER_SPELLINGS:
        flags[name] = f
    return f
