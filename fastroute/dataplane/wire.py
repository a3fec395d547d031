"""HTTP/1.1 on the client's side of the wire: the bytes every answer starts with, request ids,
and :class:`ClientSide`, what an exchange may do to its client connection.

``ClientSide`` is the client's twin of :class:`~fastroute.dataplane.upstream.Leg`: a leg is what
a pool reports an upstream response to; a client side is what an exchange writes its answer
to. The exchanges (exchange.py, pd.py) hold their client as a ``ClientSide`` and never import
the protocol (protocol.py), whose :class:`~fastroute.dataplane.protocol.ClientProtocol` is the
one implementation.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from fastroute.dataplane._ids import request_id
from fastroute.dataplane.routes import RID_PREFIX

if TYPE_CHECKING:
    from fastroute.dataplane.flow import FlowControl
    from fastroute.dataplane.request import Request
    from fastroute.errors import RouterError

CT_JSON = b"application/json"
CT_SSE = b"text/event-stream"


def _status_line(code: int) -> bytes:
    try:
        phrase = HTTPStatus(code).phrase
    except ValueError:
        phrase = "Unknown"
    return b"HTTP/1.1 %d %s\r\n" % (code, phrase.encode("latin-1"))


_STATUS: dict[int, bytes] = {s.value: _status_line(s.value) for s in HTTPStatus}
_RID_PREFIX: dict[bytes, bytes] = RID_PREFIX


def status_line(code: int) -> bytes:
    """Prebuilt ``HTTP/1.1 <code> <phrase>\\r\\n`` (built on the fly for exotic codes)."""
    line = _STATUS.get(code)
    return line if line is not None else _status_line(code)


def new_request_id(path: bytes) -> bytes:
    """A fresh id for a request that brought none: the path's prefix and 24 lowercase hex
    characters (96 random bits, alphanumeric as protocol.md 6.1 asks; ``_ids.request_id``)."""
    prefix = _RID_PREFIX.get(path)
    return request_id(prefix if prefix is not None else b"req-")


class ClientSide:
    """What an exchange may do to its client connection (see the module docstring).

    ``flow`` is the connection's backpressure (the exchange hands it the leg to pause), ``closed``
    says the client is gone (read-only for the exchange), and ``exchange`` is the exchange
    answering the connection's current request (set by that exchange when it starts; the
    connection cancels it when the client leaves)."""

    __slots__ = ("flow", "closed", "exchange")
    flow: FlowControl
    closed: bool
    exchange: Any

    def write(self, data: bytes) -> None:
        """Write response bytes (nothing once the client is gone)."""
        raise NotImplementedError

    def done(self, keep_alive: bool) -> None:
        """The current response is fully written (or abandoned): answer the next request."""
        raise NotImplementedError

    def fail(self, exc: RouterError, req: Request, sse: bool = False, model: str | None = None) -> None:
        """Answer ``req`` with ``exc`` (JSON, or an SSE error event), nothing of a response sent."""
        raise NotImplementedError

    def abort(self) -> None:
        """Cut the connection: a response already started cannot end cleanly."""
        raise NotImplementedError
