"""The ext_proc servicer: one ``Process`` stream per HTTP request Envoy relays.

Per stream (the processing mode is the printed bootstrap's, :mod:`fastroute.epp.bootstrap`):

1. request headers: refusals that need no body (readiness, ``--api-key``, a Content-Length
   over ``--max-payload-size``) answer an ImmediateResponse at once; a request without a body,
   or any request when the pick needs no body (:func:`~fastroute.epp.decide.needs_body`), is
   picked here, the latter with a mode override so that Envoy does not send the body; otherwise
   the headers continue unchanged and the body is awaited.
2. request body (buffered, ``end_of_stream``): admission, then the pick
   (:meth:`~fastroute.epp.decide.Decider.decide`); the answer sets
   ``x-gateway-destination-endpoint`` (and the Authorization the worker wants), the same value
   under dynamic metadata ``envoy.lb``, and, for one rank of a single-port DP server, the body
   with the rank spliced in (Content-Length set to match).
3. the response's end releases the booking: the end of the stream (Envoy half-closes it when
   the HTTP stream is done, completed, reset or abandoned by the client; a dead Envoy ends it
   too), a response message with ``end_of_stream``, the response trailers when the worker sends
   some, or the stream's cancellation. Exactly once (:meth:`~fastroute.epp.decide.Booking.close`).

The gateway's subset hint (the endpoint picker protocol's ``envoy.lb.subset_hint`` metadata,
forwarded by the printed bootstrap) limits the pick to the endpoints it lists; none of them
available is a 503 (:class:`~fastroute.epp.decide.Subsets`).

Errors are ImmediateResponses with the proxy's JSON error body and ``x-smg-error-code``; a
body streamed without Content-Length is refused (413) on the message that passes the limit.
Streams the picker ends without serving them (a message that is not a ProcessingRequest:
INVALID_ARGUMENT; more than ``--max-grpc-streams`` open: RESOURCE_EXHAUSTED) are counted by
reason and logged once per client address and reason (:meth:`ExternalProcessor.refuse`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Any

import grpc
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from google.protobuf.message import DecodeError

from fastroute.epp.bootstrap import HEADER, METADATA_NAMESPACE, SUBSET_KEY, SUBSET_NAMESPACE
from fastroute.epp.decide import Booking, Decider, Pick
from fastroute.errors import RouterError, payload_too_large

log = logging.getLogger("fastroute.epp")

MALFORMED = "malformed_message"  # a message that is not a ProcessingRequest
TOO_MANY_STREAMS = "too_many_streams"  # --max-grpc-streams streams were open already
REFUSE_READ_WAIT = 1.0  # seconds a refused stream's first message is waited for
LOGGED_MAX = 1024  # (peer, reason) pairs remembered as logged; the oldest are forgotten

_CONTINUE_HEADERS = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
_CONTINUE_RESPONSE_HEADERS = pb.ProcessingResponse(response_headers=pb.HeadersResponse())
_CONTINUE_RESPONSE_BODY = pb.ProcessingResponse(response_body=pb.BodyResponse())
_CONTINUE_TRAILERS = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
_CONTINUE_REQUEST_TRAILERS = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
_CONTINUE_BODY = pb.ProcessingResponse(request_body=pb.BodyResponse())
_RESPONSE_KINDS = frozenset({"response_headers", "response_body", "response_trailers"})
# Picked on the headers: the rest of the stream without the request body (the bootstrap's mode
# otherwise; the trailers keep the stream open until the response ends).
_NO_BODY = ProcessingMode(
    request_header_mode=ProcessingMode.SEND,
    request_body_mode=ProcessingMode.NONE,
    request_trailer_mode=ProcessingMode.SKIP,
    response_header_mode=ProcessingMode.SEND,
    response_body_mode=ProcessingMode.NONE,
    response_trailer_mode=ProcessingMode.SEND,
)
# The same without the response headers, when nothing reads them (no silence bound, no served
# report): one message and answer fewer per request; the stream's end still releases.
_NO_BODY_QUIET = ProcessingMode(
    request_header_mode=ProcessingMode.SEND,
    request_body_mode=ProcessingMode.NONE,
    request_trailer_mode=ProcessingMode.SKIP,
    response_header_mode=ProcessingMode.SKIP,
    response_body_mode=ProcessingMode.NONE,
    response_trailer_mode=ProcessingMode.SEND,
)
ANSWERS_KEPT = 4096  # routed answers kept for reuse (a few per target)


def peer_host(context: Any) -> str:
    """The client's address without its port (``ipv4:127.0.0.1``), or ``unknown``."""
    try:
        peer = str(context.peer() or "")
    except Exception:  # a context without a transport
        peer = ""
    host, sep, port = peer.rpartition(":")
    return host if sep and port.isdigit() else (peer or "unknown")


def _header(key: str, value: str) -> Any:
    return base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=key, raw_value=value.encode("latin-1")),
        append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
    )


def subset_of(msg: Any) -> frozenset[str] | None:
    """The subset hint a ProcessingRequest carries: the endpoints listed under
    ``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset`` in its metadata
    context (a list of ``ip:port`` strings; a comma-separated string is read too), or None when
    the key is absent. A value of another shape is an empty subset: nothing may be picked."""
    if not msg.HasField("metadata_context"):
        return None
    ns = msg.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET_KEY not in ns.fields:
        return None
    value = ns.fields[SUBSET_KEY]
    kind = value.WhichOneof("kind")
    if kind == "list_value":
        items = [v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value"]
    elif kind == "string_value":
        items = value.string_value.split(",")
    else:
        items = []
    return frozenset(i.strip() for i in items if i.strip())


def headers_of(msg: Any) -> dict[str, str]:
    """The HttpHeaders of a message as {lower-case name: value} (Envoy sends raw_value)."""
    out: dict[str, str] = {}
    for h in msg.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("latin-1") if h.raw_value else h.value
    return out


def immediate(exc: RouterError) -> Any:
    """The ImmediateResponse of a refusal: the proxy's status, JSON body and error code."""
    hdrs = [_header("content-type", "application/json"), _header("x-smg-error-code", exc.code)]
    hdrs.extend(_header(n.decode("latin-1").lower(), v.decode("latin-1")) for n, v in exc.headers)
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=exc.status),
            headers=pb.HeaderMutation(set_headers=hdrs),
            body=exc.body(),
            details="fastroute_epp_" + (exc.code or "error"),
        )
    )


def routed(pick: Pick, phase: str) -> Any:
    """The answer that sends the request to ``pick`` (``phase``: request_headers or
    request_body, the message it answers)."""
    sets = [_header(HEADER, pick.endpoint)]
    sets.extend(_header(k, v) for k, v in pick.headers)
    if pick.auth is not None:
        sets.append(_header("authorization", pick.auth))
    if pick.body is not None:
        sets.append(_header("content-length", str(len(pick.body))))
        common = pb.CommonResponse(
            header_mutation=pb.HeaderMutation(set_headers=sets), body_mutation=pb.BodyMutation(body=pick.body)
        )
    else:
        common = pb.CommonResponse(header_mutation=pb.HeaderMutation(set_headers=sets))
    meta = struct_pb2.Struct()
    meta.get_or_create_struct(METADATA_NAMESPACE)[HEADER] = pick.endpoint
    if phase == "request_headers":
        return pb.ProcessingResponse(request_headers=pb.HeadersResponse(response=common), dynamic_metadata=meta)
    return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=meta)


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    """``envoy.service.ext_proc.v3.ExternalProcessor`` over a :class:`Decider`."""

    def __init__(self, decider: Decider, max_streams: int = 0) -> None:
        self.decider = decider
        self.max_streams = max_streams  # --max-grpc-streams (0: no bound)
        self.streams = 0  # Process streams open now
        self.refused: dict[str, int] = {}  # streams ended by the picker, by reason (metrics)
        self._logged: OrderedDict[tuple[str, str], None] = OrderedDict()  # (peer, reason) said
        self._answers: dict[tuple[Any, ...], Any] = {}  # routed answers without a body, reused

    def refuse(self, context: Any, reason: str, detail: str) -> None:
        """Count a stream the picker ends for ``reason`` (fastroute_epp_streams_refused_total);
        the first one of each peer host and reason is logged, one line, the rest only counted."""
        self.refused[reason] = self.refused.get(reason, 0) + 1
        peer = peer_host(context)
        key = (peer, reason)
        if key in self._logged:
            return
        self._logged[key] = None
        if len(self._logged) > LOGGED_MAX:
            self._logged.popitem(last=False)
        log.warning(
            "ext_proc: stream from %s refused (%s): %s; further ones from that peer are only "
            "counted in fastroute_epp_streams_refused_total",
            peer,
            reason,
            detail[:200],
        )

    async def Process(self, request_iterator: Any, context: Any) -> None:  # noqa: N802
        # read()/write() rather than an async generator: a cancelled stream raises inside this
        # frame at once, so the finally below releases without waiting for a collection.
        if self.max_streams and self.streams >= self.max_streams:
            self.refuse(context, TOO_MANY_STREAMS, f"{self.streams} streams open (--max-grpc-streams)")
            # The first message (Envoy sends the request headers at once) is read before the
            # status goes out: a grpc.aio client whose write races an early status reports
            # INTERNAL instead of the status (grpc/grpc#36066).
            try:
                await asyncio.wait_for(context.read(), REFUSE_READ_WAIT)
            except asyncio.CancelledError:
                raise
            except Exception:  # no message, a malformed one, a client gone: refused all the same
                pass
            context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
            context.set_details(f"the picker serves at most {self.max_streams} streams at once")
            return
        self.streams += 1
        held: list[Booking] = []  # the stream's booking, once made (even mid-admission)
        reason = "stream_end"
        try:
            await self._serve(context, held)
        except asyncio.CancelledError:
            reason = "cancelled"
            raise
        except DecodeError as exc:  # not a ProcessingRequest: the client's fault, not ours
            reason = "error"
            self.refuse(context, MALFORMED, str(exc))
            context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
            context.set_details("malformed ProcessingRequest")
        except Exception:
            reason = "error"
            log.exception("ext_proc stream failed")
        finally:
            self.streams -= 1
            for b in held:
                b.close(reason)

    async def _serve(self, context: Any, held: list[Booking]) -> None:
        d = self.decider
        booking: Booking | None = None
        method = path = ""
        headers: dict[str, str] = {}
        chunks: list[bytes] = []
        size = 0  # request body bytes received so far
        subset: frozenset[str] | None = None
        while True:
            msg = await context.read()
            if msg is grpc.aio.EOF:
                return
            kind = msg.WhichOneof("request")
            if booking is not None:
                booking.seen = d.loop.time()  # the picked stream is alive
                if kind in _RESPONSE_KINDS:
                    booking.answered = True  # the worker answered: no silence bound from here
            if booking is None:
                hint = subset_of(msg)
                if hint is not None:
                    subset = hint
            if booking is not None and kind in ("request_headers", "request_body"):
                log.warning("ext_proc: a second request on one stream; closing it")
                return
            if kind == "request_headers":
                h = msg.request_headers
                headers = headers_of(h)
                method = headers.get(":method", "")
                path = headers.get(":path", "/")
                try:
                    length = int(headers.get("content-length", "0") or 0)
                except ValueError:
                    length = 0
                try:
                    d.check(method, path, headers, length)
                except RouterError as exc:
                    await context.write(immediate(exc))
                    return
                if not h.end_of_stream and d.needs_body:
                    await context.write(_CONTINUE_HEADERS)
                    continue
                booking = Booking(d)
                held.append(booking)
                if h.end_of_stream:
                    mode = None
                else:  # no body to send; response headers only when something reads them
                    mode = _NO_BODY if d.silent_timeout > 0 or d.fallback is not None else _NO_BODY_QUIET
                answer = await self._route(booking, method, path, headers, None, "request_headers", subset, mode)
                await context.write(answer)
                if answer.WhichOneof("response") == "immediate_response":
                    booking.close("refused")
                    return
            elif kind == "request_body":
                b = msg.request_body
                data = b.body  # each read of the field is a copy of the bytes: read once
                size += len(data)
                if size > d.max_payload:  # no Content-Length to judge early: refused once over
                    await context.write(immediate(payload_too_large(size, d.max_payload)))
                    return
                chunks.append(data)
                if not b.end_of_stream:
                    await context.write(_CONTINUE_BODY)
                    continue
                body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                chunks = []
                booking = Booking(d)
                held.append(booking)
                answer = await self._route(booking, method, path, headers, body, "request_body", subset)
                await context.write(answer)
                if answer.WhichOneof("response") == "immediate_response":
                    booking.close("refused")
                    return
            elif kind == "request_trailers":
                await context.write(_CONTINUE_REQUEST_TRAILERS)
            elif kind == "response_headers":
                if d.fallback is not None and booking is not None:
                    d.fallback.served(d, booking, msg)  # Envoy may have retried elsewhere
                if msg.response_headers.end_of_stream and booking is not None:
                    booking.close("response_end")
                await context.write(_CONTINUE_RESPONSE_HEADERS)
            elif kind == "response_body":
                if msg.response_body.end_of_stream and booking is not None:
                    booking.close("response_end")
                await context.write(_CONTINUE_RESPONSE_BODY)
            elif kind == "response_trailers":
                if booking is not None:
                    booking.close("response_end")
                await context.write(_CONTINUE_TRAILERS)
            else:
                log.warning("ext_proc: unexpected message %s", kind)
                return

    async def _route(
        self,
        booking: Booking,
        method: str,
        path: str,
        headers: dict[str, str],
        body: bytes | None,
        phase: str,
        subset: frozenset[str] | None,
        mode: Any = None,
    ) -> Any:
        """The answer to the message that completes the request (``mode``: a processing mode
        override for the rest of the stream). Answers without a new body are built once per
        endpoint and reused: grpc serializes a message at each write and nothing changes it."""
        d = self.decider
        try:
            await d.admit(booking)
            pick = d.decide(booking, method, path, headers, body, subset)
            booking.seen = d.loop.time()  # silence counts from the pick
            if pick.body is not None:
                return routed(pick, phase)
            key = (pick.endpoint, pick.auth, pick.headers, phase, id(mode))  # modes: module constants
            answer = self._answers.get(key)
            if answer is None:
                if len(self._answers) >= ANSWERS_KEPT:
                    self._answers.clear()
                answer = routed(pick, phase)
                if mode is not None:
                    answer.mode_override.CopyFrom(mode)
                self._answers[key] = answer
            return answer
        except RouterError as exc:
            booking.close("refused")
            return immediate(exc)
