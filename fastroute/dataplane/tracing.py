"""OpenTelemetry traces of the request path (``--enable-trace``, ``--otlp-traces-endpoint``).

With tracing off nothing here is imported and the request path is the one it always was. With it
on, the App builds its exchanges and routes from the subclasses below (:func:`traced_parts`),
which add the spans around the unchanged methods of :class:`~fastroute.dataplane.exchange.Relay`,
:class:`~fastroute.dataplane.pd.PDRelay` and :class:`~fastroute.dataplane.route.Route`:

- ``request`` (SERVER): the client's request, a child of the W3C ``traceparent`` it came with (a
  new trace when none): route, model, stream, request id, attempts, response status;
- ``pick <role>`` per group and attempt: policy, candidate count, chosen worker, rank and
  target, and the reason (prefix blocks hit in the engines' KV index, a prefix-tree hit, load,
  KV fit, demand, or the policy's own rule);
- ``<role> leg`` (CLIENT) per upstream request: worker, rank, a ``connected`` event when a new
  connection had to be opened, ``first_byte`` at the response head, status, and its end; its
  context is what the worker receives as ``traceparent`` (``tracestate`` passed on), so the
  prefill, the decode and a regular worker join the client's trace;
- ``first_token``: an event on the request span at the first body byte relayed to the client.

Spans are exported by the SDK's batch processor on its own thread: a slow or absent collector
costs the request path nothing but a queue append (spans beyond the queue are dropped).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from fastroute.control.otlp import FLAG, endpoint_problem
from fastroute.dataplane.exchange import Relay
from fastroute.dataplane.pd import PDRelay, _PDLeg
from fastroute.dataplane.route import Route

_PROPAGATOR = TraceContextTextMapPropagator()
_TRACE_HEADERS = (b"traceparent", b"tracestate")
# Export: a gRPC call's bound, and how long a shutdown waits for the last batch.
_EXPORT_TIMEOUT_S = 5.0
_SHUTDOWN_WAIT_S = 5.0
# The policies whose rule is the targets' load (the pick reason "load").
_LOAD_POLICIES = frozenset({"least_requests", "least_load", "power_of_two", "bucket"})
_RULE_REASON = {"random": "random", "round_robin": "round_robin", "consistent_hashing": "key_hash", "manual": "key"}
_TREE_REASON = {"cache_hit": "prefix_hit", "balance": "load", "least_loaded": "load"}


class Tracer:
    """One process's tracer provider, batch processor and OTLP/gRPC exporter."""

    def __init__(self, endpoint: str, service: str | None = None) -> None:
        problem = endpoint_problem(endpoint)
        if problem is not None:
            raise ValueError(f"{FLAG}: {problem}")
        v = endpoint.strip()
        secure = v.startswith("https://")
        target = v.split("://", 1)[1] if "://" in v else v
        name = service or os.environ.get("OTEL_SERVICE_NAME") or "fastroute"
        self.provider = TracerProvider(resource=Resource.create({"service.name": name}))
        self.exporter = OTLPSpanExporter(endpoint=target.rstrip("/"), insecure=not secure, timeout=_EXPORT_TIMEOUT_S)
        self.provider.add_span_processor(BatchSpanProcessor(self.exporter))
        self.tracer = self.provider.get_tracer("fastroute")

    def shutdown(self, wait: float = _SHUTDOWN_WAIT_S) -> None:
        """Export what is queued and stop, waiting at most ``wait`` seconds (a collector that is
        down must not hold the router's exit)."""
        t = threading.Thread(target=self.provider.shutdown, name="otlp-shutdown", daemon=True)
        t.start()
        t.join(wait)


def _split_fwd(fwd: bytes) -> tuple[bytes, dict[str, str]]:
    """The forwarded header lines without the client's trace headers, and those headers."""
    if b"trace" not in fwd.lower():
        return fwd, {}
    kept: list[bytes] = []
    carrier: dict[str, str] = {}
    for line in fwd.split(b"\r\n"):
        if not line:
            continue
        name, _, value = line.partition(b":")
        low = name.strip().lower()
        if low in _TRACE_HEADERS:
            carrier[low.decode("latin-1")] = value.strip().decode("latin-1")
        else:
            kept.append(line + b"\r\n")
    return b"".join(kept), carrier


def _group_counts(group: Any) -> tuple:
    """The counters of ``group`` a pick moves, read before and after it (pick reason)."""
    idx = group.kv_index
    k = group.kernel
    return (idx.picks if idx is not None else 0, idx.hit_sum if idx is not None else 0, k.kv_fallback)


def pick_reason(group: Any, before: tuple) -> tuple[str, dict[str, Any]]:
    """Why ``group`` chose what it chose since ``before`` (``_group_counts``): the reason and
    attributes that say more."""
    after = _group_counts(group)
    attrs: dict[str, Any] = {"fastroute.pick.kv_fit": group.kv_fit, "fastroute.pick.demand": group.demand}
    policy = group.policy
    if after[0] > before[0]:
        attrs["fastroute.pick.prefix_hit_blocks"] = after[1] - before[1]
        return "prefix_blocks", attrs
    if policy == "cache_aware":
        tree = group.policy_impl.tree_policy.last_reason
        attrs["fastroute.pick.tree_reason"] = tree
        if not group.policy_impl.coordinate or tree != "none":
            return _TREE_REASON.get(tree, tree), attrs  # (smallest_tree, no_text: the tree's own rules)
    if group.kv_fit == "on" and after[2] == before[2]:
        return "kv_fit", attrs
    if group.demand == "on":
        return "demand", attrs
    if policy in _LOAD_POLICIES:
        return "load", attrs
    return _RULE_REASON.get(policy, policy), attrs


class RequestTrace:
    """The spans of one exchange (see the module docstring)."""

    __slots__ = (
        "tracer",
        "span",
        "ctx",
        "fwd",
        "legs",
        "heads",
        "t0",
        "counts",
        "first",
        "ended",
        "recording",
        "fwd_unsampled",
        "error",
    )

    def __init__(self, tracer: Any, ex: Any) -> None:
        self.tracer = tracer
        req, meta = ex.req, ex.meta
        base, carrier = _split_fwd(req.fwd)
        parent = _PROPAGATOR.extract(carrier) if carrier else None
        attrs: dict[str, Any] = {
            "http.request.method": "POST",
            "http.route": ex.path.decode("latin-1"),
            "fastroute.backend": "pd" if isinstance(ex, PDRelay) else "regular",
            "fastroute.stream": bool(meta.stream),
            "fastroute.request_id": ex.rid.decode("latin-1"),
        }
        if meta.model is not None:
            attrs["fastroute.model"] = str(meta.model)
        self.span = tracer.start_span("request", context=parent, kind=SpanKind.SERVER, attributes=attrs)
        self.ctx = trace.set_span_in_context(self.span)
        self.recording = self.span.is_recording()  # False: the sampler dropped this trace
        self.fwd_unsampled: bytes | None = None
        self.error: str | None = None  # the code of a failure after the response started
        # The client's other forwarded headers; each leg adds its own traceparent (and the
        # client's tracestate, which the injected context carries on).
        self.fwd = base
        self.legs: dict[Any, Any] = {}  # leg -> its open span
        self.heads: set[Any] = set()  # legs whose response head was recorded
        self.t0 = 0  # the current attempt's start (ns), the picks' start
        self.counts: dict[str, tuple] = {}
        self.first = False  # first_token recorded
        self.ended = False

    def attempt(self, upstreams: Any, roles: tuple[str, ...]) -> None:
        if not self.recording:
            return
        self.t0 = time.time_ns()
        self.counts = {r: _group_counts(upstreams.group(r)) for r in roles}

    def leg_sent(self, ex: Any, leg: Any, role: str, route: Route, req: Any) -> None:
        """``leg`` is about to be framed for ``route``: its pick span, its leg span, and the
        traceparent the worker receives."""
        if leg in self.legs:
            return  # (Route.send framing through send_injected: one leg, one span)
        if not self.recording:
            # Not sampled: no pick or leg span, and every worker gets the request span's own
            # (not sampled) context, built once.
            if self.fwd_unsampled is None:
                carrier: dict[str, str] = {}
                _PROPAGATOR.inject(carrier, context=self.ctx)
                self.fwd_unsampled = self.fwd + "".join("%s: %s\r\n" % kv for kv in carrier.items()).encode("latin-1")
            req.fwd = self.fwd_unsampled
            return
        group = ex.upstreams.group(role)
        now = time.time_ns()
        target = int(getattr(leg, "target", -1))
        where: dict[str, Any] = {"fastroute.worker": route.worker.url, "fastroute.target": target}
        if route.index is not None:
            where["fastroute.rank"] = int(route.index)
        before = self.counts.get(role)
        reason, more = pick_reason(group, before) if before is not None else ("unknown", {})
        pick = self.tracer.start_span(
            "pick " + role,
            context=self.ctx,
            start_time=self.t0 or now,
            attributes={
                "fastroute.role": role,
                "fastroute.policy": group.policy,
                "fastroute.pick.candidates": len(group.targets),
                "fastroute.pick.reason": reason,
                "fastroute.attempt": int(ex.tries),
                **where,
                **more,
            },
        )
        pick.end(end_time=now)
        span = self.tracer.start_span(
            role + " leg",
            context=self.ctx,
            kind=SpanKind.CLIENT,
            start_time=now,
            attributes={"fastroute.role": role, **where},
        )
        self.legs[leg] = span
        carrier = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span, self.ctx))
        tp = "".join("%s: %s\r\n" % kv for kv in carrier.items()).encode("latin-1")
        req.fwd = self.fwd + tp

    def leg_framed(self, leg: Any) -> None:
        """After the pool took ``leg``: a ``connected`` event once a new connection is up."""
        span = self.legs.get(leg)
        conn = leg.conn
        if span is None or conn is None or not span.is_recording():
            return
        task = conn.connect_task
        if task is not None and not task.done():
            span.set_attribute("fastroute.upstream.new_connection", True)
            task.add_done_callback(lambda t: span.add_event("connected") if span.is_recording() else None)
        else:
            span.set_attribute("fastroute.upstream.new_connection", not conn.reused)

    def leg_head(self, leg: Any, status: int) -> None:
        span = self.legs.get(leg)
        if span is not None and leg not in self.heads:  # (a span not sampled has no attributes to read)
            self.heads.add(leg)
            span.add_event("first_byte")
            span.set_attribute("http.response.status_code", status)

    def leg_end(self, leg: Any, error: str | None = None) -> None:
        span = self.legs.pop(leg, None)
        if span is None:
            return
        self.heads.discard(leg)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end()

    def first_token(self) -> None:
        if not self.first and self.recording:
            self.first = True
            self.span.add_event("first_token")

    def end(self, status: int, error: str | None, tries: int) -> None:
        if self.ended:
            return
        self.ended = True
        if not self.recording:
            return
        error = error or self.error
        for leg in list(self.legs):
            self.leg_end(leg, "aborted")
        span = self.span
        span.set_attribute("fastroute.attempts", tries)
        if status:
            span.set_attribute("http.response.status_code", status)
        if error:
            span.set_attribute("error.type", error)
        if error or status >= 500:
            span.set_status(Status(StatusCode.ERROR, error or "HTTP %d" % status))
        span.end()


class TracedRelay(Relay):
    """Regular mode with spans (the exchange is its own leg)."""

    __slots__ = ("_trace",)
    _tracer: Any = None  # set on the class traced_parts makes

    def __init__(self, *args: Any) -> None:
        Relay.__init__(self, *args)
        self._trace = RequestTrace(self._tracer, self)

    def attempt(self) -> None:
        self._trace.attempt(self.upstreams, ("regular",))
        Relay.attempt(self)

    def up_head(self, status: int, headers: list) -> None:
        self._trace.leg_head(self, status)
        Relay.up_head(self, status, headers)

    def up_body(self, data: bytes) -> None:
        if data:
            self._trace.first_token()
        Relay.up_body(self, data)

    def up_done(self) -> None:
        self._trace.leg_end(self)
        Relay.up_done(self)

    def up_error(self, exc: BaseException) -> None:
        self._trace.leg_end(self, str(exc) or type(exc).__name__)
        Relay.up_error(self, exc)

    def retry_later(self, role: str, wait: float = -1.0) -> None:
        self._trace.leg_end(self, "retried")
        Relay.retry_later(self, role, wait)

    def cancel(self, status: int = 499, code: str = "client_closed") -> None:
        if not self.finished:
            self._trace.end(status, code, self.tries)
        Relay.cancel(self, status, code)

    def _fail_client(self, exc: Any, sse: bool = False) -> None:
        if not self.finished:
            self._trace.error = exc.code  # (a stream cut after its head keeps the worker's status)
        Relay._fail_client(self, exc, sse)

    def _finish(self, keep_alive: bool, error: Any = None, sse: bool = False) -> None:
        if not self.finished:
            self._trace.end(
                error.status if error is not None else self.status, getattr(error, "code", None), self.tries
            )
        Relay._finish(self, keep_alive, error, sse)


class TracedPDRelay(PDRelay):
    """PD mode with spans: the legs' events are read where the exchange hears of them."""

    __slots__ = ("_trace",)
    _tracer: Any = None

    def __init__(self, *args: Any) -> None:
        PDRelay.__init__(self, *args)
        self._trace = RequestTrace(self._tracer, self)

    def attempt(self) -> None:
        self._trace.attempt(self.upstreams, ("prefill", "decode"))
        PDRelay.attempt(self)

    def _legs_seen(self) -> None:
        tr = self._trace
        for leg in (self.p, self.d):
            if leg in tr.legs:
                if leg.status:
                    tr.leg_head(leg, leg.status)
                if leg.done:
                    tr.leg_end(leg)

    def pd_progress(self) -> None:
        self._legs_seen()
        PDRelay.pd_progress(self)

    def relay_body(self, data: bytes) -> None:
        if data:
            self._trace.first_token()
        PDRelay.relay_body(self, data)

    def relay_end(self) -> None:
        self._legs_seen()
        PDRelay.relay_end(self)

    def leg_failed(self, leg: Any, exc: BaseException, connect_failed: bool = False) -> None:
        self._trace.leg_end(leg, str(exc) or type(exc).__name__)
        PDRelay.leg_failed(self, leg, exc, connect_failed)

    def retry_later(self, role: str, wait: float = -1.0) -> None:
        tr = self._trace
        self._legs_seen()
        for leg in list(tr.legs):
            tr.leg_end(leg, "retried")
        PDRelay.retry_later(self, role, wait)

    def cancel(self, status: int = 499, code: str = "client_closed") -> None:
        if not self.finished:
            self._trace.end(status, code, self.tries)
        PDRelay.cancel(self, status, code)

    def _fail_client(self, exc: Any, sse: bool = False) -> None:
        if not self.finished:
            self._trace.error = exc.code  # (a stream cut after its head keeps the worker's status)
        PDRelay._fail_client(self, exc, sse)

    def _finish(self, keep_alive: bool, error: Any = None, sse: bool = False) -> None:
        if not self.finished:
            self._legs_seen()
            self._trace.end(
                error.status if error is not None else self.status, getattr(error, "code", None), self.tries
            )
        PDRelay._finish(self, keep_alive, error, sse)


class TracedRoute(Route):
    """A route that gives each leg it frames its own ``traceparent``."""

    __slots__ = ()

    def _traced(self, req: Any, leg: Any) -> RequestTrace | None:
        ex = leg.ex if isinstance(leg, _PDLeg) else leg
        tr = getattr(ex, "_trace", None)
        if tr is not None:
            tr.leg_sent(ex, leg, leg.role if isinstance(leg, _PDLeg) else "regular", self, req)
        return tr

    def send_injected(self, req: Any, end: int, sep: bytes, fields: bytes, leg: Any) -> None:
        tr = self._traced(req, leg)
        Route.send_injected(self, req, end, sep, fields, leg)
        if tr is not None:
            tr.leg_framed(leg)

    def send(self, req: Any, leg: Any) -> None:
        tr = self._traced(req, leg)
        Route.send(self, req, leg)
        if tr is not None and self.rank_field is None:  # (else send_injected did)
            tr.leg_framed(leg)


def traced_parts(config: Any, pd: bool) -> tuple[Tracer, type, type]:
    """(the process's tracer, the exchange class, the route class) for an App with tracing on."""
    tracer = Tracer(config.otlp_traces_endpoint)
    base = TracedPDRelay if pd else TracedRelay
    exchange = type(base.__name__, (base,), {"__slots__": (), "_tracer": tracer.tracer})
    return tracer, exchange, TracedRoute
