"""--enable-trace against a real OTLP/gRPC collector (a servicer from opentelemetry-proto on a
loopback port) and the simulated SGLang workers, which record the traceparent they receive:
one trace across the client, the router, the prefill and the decode with the right parents; the
pick's attributes; a new trace when the client sends none; a collector that is slow or down
never holds or fails a request; a bad endpoint is refused by its flag."""

from __future__ import annotations

import asyncio
import socket
import threading
from concurrent import futures

import grpc
import pytest

pytest.importorskip("opentelemetry.sdk", reason="the 'trace' extra (OpenTelemetry SDK) is not installed")

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc  # noqa: E402

from fastroute.config import Config, ConfigError  # noqa: E402
from fastroute.sim.engine import SimParams  # noqa: E402
from fastroute.sim.server import SimWorker  # noqa: E402
from fastroute.sim.worker import start_cluster  # noqa: E402
from tests.integration.conftest import Router, call, post, run, until, workers  # noqa: E402

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SIM = SimParams(dp_size=2, time_scale=0.01)


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP trace receiver; ``gate`` (when set up) holds every export until released."""

    def __init__(self, hold: bool = False) -> None:
        self.spans: list = []
        self.lock = threading.Lock()
        self.entered = threading.Event()
        self.gate = threading.Event()
        if not hold:
            self.gate.set()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def Export(self, request, context):  # noqa: N802 (the gRPC method's name)
        self.entered.set()
        self.gate.wait(30)
        with self.lock:
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    self.spans.extend(ss.spans)
        return trace_service_pb2.ExportTraceServiceResponse()

    def stop(self) -> None:
        self.gate.set()
        self.server.stop(0)

    def named(self, name: str) -> list:
        with self.lock:
            return [s for s in self.spans if s.name == name]


def attrs(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        out[kv.key] = getattr(v, v.WhichOneof("value"))
    return out


def traceparent(trace_id: bytes, span_id: bytes) -> str:
    """A sampled W3C traceparent of the span, without its flags' other bits (a trace the
    router starts also sets the random-trace-id flag, 0x02)."""
    return "00-%s-%s" % (trace_id.hex(), span_id.hex())


def received(worker: SimWorker) -> list[str]:
    """The traceparents ``worker`` received, flags dropped once their sampled bit is checked."""
    out = []
    for tp in worker.traceparents:
        head, _, flags = tp.rpartition("-")
        assert int(flags, 16) & 1, tp
        out.append(head)
    return out


def _pd_router(cluster, port: int, **kw) -> Router:
    p, d = cluster.prefills[0], cluster.decodes[0]
    return Router(
        pd_disaggregation=True,
        prefill=[(p.url, p.bootstrap_port)],
        decode=[d.url],
        dp_aware=True,
        enable_trace=True,
        otlp_traces_endpoint=f"127.0.0.1:{port}",
        **kw,
    )


def test_one_trace_across_client_router_prefill_and_decode() -> None:
    col = Collector()

    async def go() -> None:
        cluster = await start_cluster(1, 1, SIM)
        p, d = cluster.prefills[0], cluster.decodes[0]
        try:
            async with _pd_router(cluster, col.port, policy="cache_aware") as r:
                hdr = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01", "tracestate": "vendor=abc"}
                body = {"text": "hello there", "sampling_params": {"max_new_tokens": 3}, "stream": True}
                resp = await call(r.port, post("/generate", body, hdr))
                assert resp.status == 200, resp.body
        finally:
            await cluster.stop()
        # Router stopped: its tracer exported what was queued.
        (req,) = col.named("request")
        assert req.trace_id.hex() == CLIENT_TRACE and req.parent_span_id.hex() == CLIENT_SPAN
        a = attrs(req)
        assert a["http.route"] == "/generate" and a["http.response.status_code"] == 200
        assert a["fastroute.stream"] is True and a["fastroute.attempts"] == 1
        assert "first_token" in [e.name for e in req.events]
        for role, worker in (("prefill", p), ("decode", d)):
            (pick,) = col.named("pick " + role)
            (leg,) = col.named(role + " leg")
            for s in (pick, leg):
                assert s.trace_id == req.trace_id and s.parent_span_id == req.span_id
            pa = attrs(pick)
            assert pa["fastroute.policy"] == "cache_aware" and pa["fastroute.pick.candidates"] == 2
            assert pa["fastroute.worker"] == worker.url and pa["fastroute.rank"] in (0, 1)
            assert pa["fastroute.pick.reason"] in ("prefix_hit", "load", "smallest_tree"), pa
            la = attrs(leg)
            assert la["fastroute.worker"] == worker.url and la["fastroute.rank"] == pa["fastroute.rank"]
            assert la["http.response.status_code"] == 200
            assert "first_byte" in [e.name for e in leg.events]
            # The worker received the leg's own context, in the client's trace.
            assert received(worker) == [traceparent(req.trace_id, leg.span_id)]
            assert leg.trace_state == "vendor=abc"
            assert leg.start_time_unix_nano <= leg.end_time_unix_nano <= req.end_time_unix_nano

    try:
        run(go(), 40.0)
    finally:
        col.stop()


def test_a_request_without_traceparent_starts_a_trace_and_a_regular_worker_joins_it() -> None:
    col = Collector()

    async def go() -> None:
        w = SimWorker("regular", SIM)
        await w.start()
        try:
            async with Router(
                worker_urls=[w.url],
                policy="power_of_two",
                enable_trace=True,
                otlp_traces_endpoint=f"127.0.0.1:{col.port}",
            ) as r:
                resp = await call(r.port, post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2}}))
                assert resp.status == 200, resp.body
        finally:
            await w.stop()
        (req,) = col.named("request")
        assert len(req.parent_span_id) == 0  # a root: the client sent no context
        (leg,) = col.named("regular leg")
        (pick,) = col.named("pick regular")
        assert leg.parent_span_id == req.span_id and pick.parent_span_id == req.span_id
        assert attrs(pick)["fastroute.pick.reason"] == "load"
        assert received(w) == [traceparent(req.trace_id, leg.span_id)]

    try:
        run(go(), 40.0)
    finally:
        col.stop()


def test_a_slow_collector_holds_no_request() -> None:
    col = Collector(hold=True)

    async def go() -> None:
        w = SimWorker("regular", SIM)
        await w.start()
        try:
            async with Router(
                worker_urls=[w.url], enable_trace=True, otlp_traces_endpoint=f"127.0.0.1:{col.port}"
            ) as r:
                body = post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2}})
                assert (await call(r.port, body)).status == 200
                # An export in progress that the collector does not answer.
                tracer = r.server.app.tracer
                flusher = threading.Thread(target=tracer.provider.force_flush, daemon=True)
                flusher.start()
                await until(col.entered.is_set, 10.0, "the collector holding an export")
                answers = await asyncio.gather(*(call(r.port, body) for _ in range(8)))
                assert [a.status for a in answers] == [200] * 8
                assert not col.gate.is_set() and flusher.is_alive()  # the export was still held
                col.gate.set()
        finally:
            await w.stop()
        await until(lambda: len(col.named("request")) == 9, 10.0, "all nine request spans")

    try:
        run(go(), 60.0)
    finally:
        col.stop()


def test_a_collector_that_is_down_fails_no_request() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    dead = s.getsockname()[1]
    s.close()  # nothing listens there

    async def go() -> None:
        w = SimWorker("regular", SIM)
        await w.start()
        try:
            async with Router(worker_urls=[w.url], enable_trace=True, otlp_traces_endpoint=f"127.0.0.1:{dead}") as r:
                body = post(
                    "/generate",
                    {"text": "x", "sampling_params": {"max_new_tokens": 2}},
                    {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"},
                )
                answers = await asyncio.gather(*(call(r.port, body) for _ in range(5)))
                assert [a.status for a in answers] == [200] * 5
        finally:
            await w.stop()
        assert len(w.traceparents) == 5 and all(tp.split("-")[1] == CLIENT_TRACE for tp in w.traceparents)

    run(go(), 60.0)


def test_a_retried_attempt_has_its_own_pick_and_a_failed_leg() -> None:
    """The first worker answers 503: its leg span ends in error ("retried"), a second pick
    (attempt 2) sends to the other worker, and the request span counts two attempts."""
    col = Collector()

    async def go() -> None:
        bad, good = await workers(2)
        bad.status = 503
        try:
            async with Router(
                worker_urls=[bad.url, good.url],
                policy="round_robin",
                retry_max_retries=2,
                retry_initial_backoff_ms=1,
                enable_trace=True,
                otlp_traces_endpoint=f"127.0.0.1:{col.port}",
            ) as r:
                seen = 0
                while seen < 2:  # round robin: until one request met the bad worker first
                    resp = await call(r.port, post("/generate", {"text": "x"}))
                    assert resp.status == 200, resp.body
                    seen += 1
        finally:
            await bad.stop()
            await good.stop()
        reqs = [s for s in col.named("request") if attrs(s)["fastroute.attempts"] == 2]
        assert reqs, [attrs(s) for s in col.named("request")]
        for req in reqs:
            legs = sorted(
                (s for s in col.named("regular leg") if s.trace_id == req.trace_id),
                key=lambda s: s.start_time_unix_nano,
            )
            picks = sorted(
                (s for s in col.named("pick regular") if s.trace_id == req.trace_id),
                key=lambda s: s.start_time_unix_nano,
            )
            assert [attrs(p)["fastroute.attempt"] for p in picks] == [1, 2]
            assert [attrs(x)["fastroute.worker"] for x in legs] == [bad.url, good.url]
            assert legs[0].status.code == 2 and legs[0].status.message == "retried"  # STATUS_CODE_ERROR
            assert attrs(legs[0])["http.response.status_code"] == 503
            assert legs[1].status.code != 2 and attrs(legs[1])["http.response.status_code"] == 200
            assert attrs(req)["http.response.status_code"] == 200

    try:
        run(go(), 40.0)
    finally:
        col.stop()


def test_a_stream_cut_after_its_head_is_an_error_span() -> None:
    """The worker dies after its first SSE event: the client already has the 200 head, and the
    request span says the request failed (error status, error.type) beside that 200."""
    col = Collector()

    async def go() -> None:
        (w,) = await workers(1)
        w.die_after = 1
        try:
            async with Router(
                worker_urls=[w.url], enable_trace=True, otlp_traces_endpoint=f"127.0.0.1:{col.port}"
            ) as r:
                try:
                    await call(r.port, post("/generate", {"text": "x", "stream": True}))
                except Exception:
                    pass  # a cut stream: the client sees a truncated body or a closed connection
        finally:
            await w.stop()
        (req,) = col.named("request")
        a = attrs(req)
        assert a["http.response.status_code"] == 200 and a["error.type"]
        assert req.status.code == 2  # STATUS_CODE_ERROR
        (leg,) = col.named("regular leg")
        assert leg.status.code == 2

    try:
        run(go(), 40.0)
    finally:
        col.stop()


def test_spans_not_sampled_still_route_and_propagate(monkeypatch) -> None:
    """OTEL_TRACES_SAMPLER=always_off: spans that record nothing (no attributes to read back),
    requests answered as usual, and each worker still receives a (not sampled) traceparent of
    the client's trace."""
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_off")
    col = Collector()

    async def go() -> None:
        cluster = await start_cluster(1, 1, SIM)
        p, d = cluster.prefills[0], cluster.decodes[0]
        try:
            async with _pd_router(cluster, col.port) as r:
                hdr = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00"}
                for stream in (False, True):
                    body = {"text": "hi", "sampling_params": {"max_new_tokens": 3}, "stream": stream}
                    resp = await call(r.port, post("/generate", body, hdr))
                    assert resp.status == 200, resp.body
        finally:
            await cluster.stop()
        for w in (p, d):
            assert len(w.traceparents) == 2
            assert all(tp.split("-")[1] == CLIENT_TRACE and tp.endswith("-00") for tp in w.traceparents)
        assert col.spans == []

    try:
        run(go(), 40.0)
    finally:
        col.stop()


@pytest.mark.parametrize("endpoint", ["nohost", "ftp://c:4317", "c:99999", "c:4317/v1/traces", ""])
def test_a_bad_endpoint_is_refused_by_its_flag(endpoint: str) -> None:
    with pytest.raises(ConfigError) as e:
        Config(worker_urls=["http://127.0.0.1:1"], enable_trace=True, otlp_traces_endpoint=endpoint)
    assert e.value.flag == "--otlp-traces-endpoint"
    # Without --enable-trace the endpoint is not used (smg reads it only with tracing on).
    Config(worker_urls=["http://127.0.0.1:1"], otlp_traces_endpoint="c:4317")
