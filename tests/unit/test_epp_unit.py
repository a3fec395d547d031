"""fastroute epp without Envoy: its command line, the bootstrap it prints, and the ext_proc
servicer driven message by message over the real routing core (table, router, group, leases),
so a lease's one release is checked at every ending a stream can have."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("grpc")
pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")

import grpc  # noqa: E402
from envoy.config.core.v3 import base_pb2  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb  # noqa: E402

from fastroute.config import Config  # noqa: E402
from fastroute.config.cli import main  # noqa: E402
from fastroute.core.routing import Router  # noqa: E402
from fastroute.core.table import TargetTable  # noqa: E402
from fastroute.dataplane.admission import Admission  # noqa: E402
from fastroute.epp.bootstrap import envoy_bootstrap  # noqa: E402
from fastroute.epp.decide import Decider, endpoint_of  # noqa: E402
from fastroute.epp.options import EppError, option_warnings, refusal, split  # noqa: E402
from fastroute.epp.service import ExternalProcessor  # noqa: E402


# -- the command line -------------------------------------------------------------------
def test_split_takes_the_picker_flags_and_leaves_the_router_flags() -> None:
    opts, rest = split(
        [
            "--grpc-port",
            "9002",
            "--policy",
            "round_robin",
            "--worker-urls",
            "http://a:1",
            "--print-envoy-config",
            "--envoy-listen-port=8080",
        ]
    )
    assert (opts.grpc_port, opts.print_config, opts.listen_port, opts.admin_port) == (9002, True, 8080, None)
    assert rest == ["--policy", "round_robin", "--worker-urls", "http://a:1"]


_PRINTING = ["--grpc-port", "1", "--print-envoy-config", "--envoy-listen-port", "2"]
_TLS = ["--grpc-tls-cert-path", "c", "--grpc-tls-key-path", "k"]


@pytest.mark.parametrize(
    "argv, flag",
    [
        ([], "--grpc-port"),
        (["--grpc-port", "x"], "--grpc-port"),
        (["--grpc-port", "70000"], "--grpc-port"),
        (["--grpc-port", "1", "--print-envoy-config"], "--envoy-listen-port"),
        (["--grpc-port", "1", "--envoy-admin-port", "2"], "--envoy-admin-port"),
        (["--grpc-port", "1", "--inference-pool-namespace", "ns"], "--inference-pool-namespace"),
        (["--grpc-port", "1", "--inference-pool", "Pool_1"], "--inference-pool"),
        (["--grpc-port", "1", "--failure-mode=Open"], "--failure-mode"),
        (["--grpc-port", "1", "--failure-mode"], "--failure-mode"),
        (["--grpc-port", "1", "--failure-mode-allow"], "--failure-mode-allow"),
        (["--grpc-port", "1", "--sidecar"], "--sidecar"),
        (["--grpc-port", "1", "--grpc-tls-cert-path", "c.pem"], "--grpc-tls-cert-path"),
        (["--grpc-port", "1", "--grpc-tls-key-path", "k.pem"], "--grpc-tls-key-path"),
        (["--grpc-port", "1", "--grpc-tls-client-ca-path", "ca.pem"], "--grpc-tls-client-ca-path"),
        (["--grpc-port", "1", "--grpc-tls-cert-path", "--grpc-tls-key-path", "k"], "--grpc-tls-cert-path"),
        (["--grpc-port", "1", "--envoy-grpc-ca-path", "ca.pem"], "--envoy-grpc-ca-path"),
        (
            [*_PRINTING, "--grpc-tls-cert-path", "c", "--grpc-tls-key-path", "k"],
            "--grpc-tls-cert-path",
        ),
        (
            [*_PRINTING, *_TLS, "--grpc-tls-client-ca-path", "ca", "--envoy-grpc-ca-path", "ca"],
            "--grpc-tls-client-ca-path",
        ),
        ([*_PRINTING, "--envoy-grpc-cert-path", "c", "--envoy-grpc-key-path", "k"], "--envoy-grpc-cert-path"),
        (["--grpc-port", "1", "--silent-stream-timeout-secs", "-1"], "--silent-stream-timeout-secs"),
        (["--grpc-port", "1", "--silent-stream-timeout-secs", "soon"], "--silent-stream-timeout-secs"),
        (["--grpc-port", "1", "--max-grpc-streams", "0"], "--max-grpc-streams"),
        (["--grpc-port", "1", "--max-grpc-streams=many"], "--max-grpc-streams"),
    ],
)
def test_split_refuses_naming_the_flag(argv: list[str], flag: str) -> None:
    with pytest.raises(EppError, match=f"argument {flag}"):
        split(argv)


@pytest.mark.parametrize(
    "kw, flag",
    [
        (
            {"pd_disaggregation": True, "prefill": [("http://p:1", None)], "decode": ["http://d:2"]},
            "--pd-disaggregation",
        ),
        ({"worker_urls": ["https://w:1"]}, "--worker-urls"),
        ({"retry_max_retries": 2}, "--retry-max-retries"),
        ({"cb_failure_threshold": 3}, "--cb-failure-threshold"),
        ({"max_payload_size": 2**31}, "--max-payload-size"),
    ],
)
def test_refusal_names_what_the_picker_does_not_do(kw: dict, flag: str) -> None:
    why = refusal(Config(**kw), 1)
    assert why is not None and why.startswith(f"argument {flag}:")
    assert refusal(Config(worker_urls=["http://w:1"]), 1) is None
    # --workers N runs N picker processes (fastroute.epp.child), not with the pool or PD
    assert refusal(Config(worker_urls=["http://w:1"]), 2) is None
    assert refusal(Config(), 2, pool="llama").startswith("argument --workers:")


def test_fail_open_needs_a_static_worker_list_and_no_pd() -> None:
    pd = {"pd_disaggregation": True, "prefill": [("http://p:1", None)], "decode": ["http://d:2"]}
    for kw, pool in (({}, None), ({"worker_urls": ["http://w:1"]}, "llama"), (pd, None)):
        why = refusal(Config(**kw), 1, pool, 30100 if kw is pd else None, "FailOpen")
        assert why is not None and why.startswith("argument --failure-mode:"), why
    assert refusal(Config(worker_urls=["http://w:1"]), 1, None, None, "FailOpen") is None
    assert split(["--grpc-port", "1", "--failure-mode", "FailOpen"])[0].failure_mode == "FailOpen"
    assert split(["--grpc-port", "1"])[0].failure_mode == "FailClose"


def test_cli_refuses_in_one_line_and_exits_2(capsys: Any) -> None:
    assert main(["epp", "--grpc-port", "1", "--failure-mode", "FailOpen"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--failure-mode" in err[0] and "--worker-urls" in err[0]
    assert _status(["sidecar"]) == 2
    assert "argument --pd-disaggregation" in capsys.readouterr().err


def test_failure_mode_on_the_running_picker_is_warned_about_once() -> None:
    argv = ["--grpc-port", "1", "--failure-mode", "FailOpen"]
    (line,) = option_warnings(split(argv)[0], argv)
    assert line.startswith("--failure-mode is accepted and ignored")
    printing = [*argv, "--print-envoy-config", "--envoy-listen-port", "8080"]
    assert option_warnings(split(printing)[0], printing) == []  # there it acts
    assert option_warnings(split(argv[:2])[0], argv[:2]) == []
    bounds = [*printing, "--max-grpc-streams", "5", "--silent-stream-timeout-secs=0"]
    said = option_warnings(split(bounds)[0], bounds)
    assert [line.split()[0] for line in said] == ["--silent-stream-timeout-secs", "--max-grpc-streams"]
    assert option_warnings(split([*argv[:2], *bounds[-3:]])[0], [*argv[:2], *bounds[-3:]]) == []


def test_help_lists_the_picker_options_then_the_router_flags(capsys: Any) -> None:
    assert main(["epp", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--grpc-port", "--print-envoy-config", "--failure-mode", "--inference-pool", "--sidecar-port"):
        assert f"  {flag} " in out, flag
    router = out.index("usage: fastroute epp --grpc-port G [OPTIONS]")  # then the router's flags
    assert out.index("  --sidecar-port ") < router < out.index("  --worker-urls ")
    assert main(["epp", "--grpc-port", "1", "-h"]) == 0 and "picker options:" in capsys.readouterr().out


def test_cli_prints_the_bootstrap_and_exits(capsys: Any) -> None:
    assert (
        main(
            [
                "epp",
                "--grpc-port",
                "9002",
                "--print-envoy-config",
                "--envoy-listen-port",
                "8080",
                "--envoy-admin-port",
                "9901",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out == envoy_bootstrap(9002, 8080, 9901, idle_timeout=1800)
    for needle in (
        "port_value: 9002",
        "port_value: 8080",
        "port_value: 9901",
        "http_header_name: x-gateway-destination-endpoint",
        "type: ORIGINAL_DST",
        "http2_protocol_options",
        "request_body_mode: BUFFERED",
        'untyped: ["envoy.lb"]',
        "failure_mode_allow: false",
    ):
        assert needle in out


# -- the servicer over the real routing core ----------------------------------------------
@dataclass(eq=False)
class _Worker:
    host: str
    port: int
    addr: tuple | None = None
    api_key: str | None = None
    basic_auth: str | None = None


class _Registry:
    """The registry surface the Decider reads: ready(), group(role), target_info."""

    def __init__(self, table: TargetTable, dp: int, worker: _Worker, policy: str) -> None:
        rows = [table.alloc() for _ in range(dp)]
        self.target_info: list[Any] = [None] * (max(rows) + 1)
        for rank, t in enumerate(rows):
            self.target_info[t] = (worker, rank if dp > 1 else None)
        self.rows = rows
        self._group = Router(table, seed=7).group(rows, policy, load_metric="least_requests")
        self.is_ready = True

    def ready(self) -> bool:
        return self.is_ready

    def group(self, role: str) -> Any:
        assert role == "regular"
        return self._group


class _Context:
    """A Process stream: the test feeds messages (or EOF) and reads the answers."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue = asyncio.Queue()
        self.out: asyncio.Queue = asyncio.Queue()

    async def read(self) -> Any:
        return await self.inbox.get()

    async def write(self, msg: Any) -> None:
        await self.out.put(msg)

    async def answer(self) -> Any:
        return await asyncio.wait_for(self.out.get(), 2.0)


def _headers(path: str = "/generate", method: str = "POST", eos: bool = False, **extra: str) -> Any:
    hm = pb.HttpHeaders(end_of_stream=eos)
    for k, v in {":method": method, ":path": path, ":authority": "gw", **extra}.items():
        hm.headers.headers.append(base_pb2.HeaderValue(key=k, raw_value=v.encode()))
    return pb.ProcessingRequest(request_headers=hm)


def _body(data: bytes) -> Any:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=True))


class _Rig:
    def __init__(self, dp: int = 4, policy: str = "power_of_two", **cfg: Any) -> None:
        self.table = TargetTable(16)
        self.worker = _Worker("127.0.0.1", 31000, addr=("10.1.2.3", 31000))
        self.registry = _Registry(self.table, dp, self.worker, policy)
        self.config = Config(dp_aware=dp > 1, dp_rank_field="routed_dp_rank", policy=policy, **cfg)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        c = self.config
        self.admission = Admission(c.max_concurrent_requests, c.queue_size, c.queue_timeout_secs, loop)
        self.decider = Decider(c, self.registry, self.admission, None, loop)
        self.servicer = ExternalProcessor(self.decider)

    def stream(self) -> tuple[_Context, asyncio.Task]:
        ctx = _Context()
        return ctx, asyncio.get_running_loop().create_task(self.servicer.Process(None, ctx))

    def in_flight(self) -> list[int]:
        return [self.table.in_flight(t) for t in self.registry.rows]

    def close(self) -> None:
        self.table.unlink()


def _run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 10))


def _set(answer: Any, phase: str) -> dict[str, str]:
    common = getattr(answer, phase).response
    return {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}


async def _route(rig: _Rig, body: bytes = b'{"text": "hi"}') -> tuple[_Context, asyncio.Task, Any]:
    ctx, task = rig.stream()
    await ctx.inbox.put(_headers())
    assert (await ctx.answer()).WhichOneof("response") == "request_headers"
    await ctx.inbox.put(_body(body))
    return ctx, task, await ctx.answer()


def test_a_pick_names_the_endpoint_splices_the_rank_and_releases_at_eof() -> None:
    rig = _Rig()

    async def body() -> None:
        rig.start()
        ctx, task, ans = await _route(rig)
        assert ans.WhichOneof("response") == "request_body"
        sets = _set(ans, "request_body")
        assert sets["x-gateway-destination-endpoint"] == "10.1.2.3:31000"
        assert ans.dynamic_metadata["envoy.lb"]["x-gateway-destination-endpoint"] == "10.1.2.3:31000"
        new = ans.request_body.response.body_mutation.body
        assert json.loads(new) == {"text": "hi", "routed_dp_rank": json.loads(new)["routed_dp_rank"]}
        assert sets["content-length"] == str(len(new))
        assert sum(rig.in_flight()) == 1
        rank = json.loads(new)["routed_dp_rank"]
        assert rig.in_flight()[rank] == 1
        await ctx.inbox.put(grpc.aio.EOF)
        await task
        assert rig.in_flight() == [0, 0, 0, 0]
        assert rig.decider.in_flight == 0

    try:
        _run(body())
    finally:
        rig.close()


def test_response_trailers_release_once_and_eof_after_does_nothing_more() -> None:
    rig = _Rig()

    async def body() -> None:
        rig.start()
        held = []
        for _ in range(4):  # least_requests: one per rank
            held.append(await _route(rig))
        assert rig.in_flight() == [1, 1, 1, 1]
        ctx, task, _ = held[0]
        await ctx.inbox.put(pb.ProcessingRequest(response_trailers=pb.HttpTrailers()))
        assert (await ctx.answer()).WhichOneof("response") == "response_trailers"
        assert sum(rig.in_flight()) == 3
        await ctx.inbox.put(grpc.aio.EOF)
        await task
        assert sum(rig.in_flight()) == 3 and rig.table.underflows == 0
        for _ctx, task, _ in held[1:]:
            task.cancel()  # Envoy reset / connection gone
            with pytest.raises(asyncio.CancelledError):
                await task
        assert rig.in_flight() == [0, 0, 0, 0] and rig.table.underflows == 0

    try:
        _run(body())
    finally:
        rig.close()


def test_bad_body_answers_400_and_books_nothing() -> None:
    rig = _Rig()

    async def body() -> None:
        rig.start()
        ctx, task, ans = await _route(rig, b'{"text": ')
        assert ans.immediate_response.status.code == 400
        assert json.loads(ans.immediate_response.body)["error"]["code"]
        await task
        assert rig.in_flight() == [0, 0, 0, 0] and rig.admission.active == 0

    try:
        _run(body())
    finally:
        rig.close()


def test_not_ready_is_503_at_the_headers() -> None:
    rig = _Rig()

    async def body() -> None:
        rig.start()
        rig.registry.is_ready = False
        ctx, task = rig.stream()
        await ctx.inbox.put(_headers())
        ans = await ctx.answer()
        assert ans.immediate_response.status.code == 503
        hdrs = {h.header.key: h.header.raw_value for h in ans.immediate_response.headers.set_headers}
        assert hdrs["content-type"] == b"application/json"
        await task
        assert rig.in_flight() == [0, 0, 0, 0]

    try:
        _run(body())
    finally:
        rig.close()


def test_a_request_without_body_is_picked_at_its_headers() -> None:
    rig = _Rig(dp=1, policy="round_robin")

    async def body() -> None:
        rig.start()
        ctx, task = rig.stream()
        await ctx.inbox.put(_headers("/v1/models", "GET", eos=True))
        ans = await ctx.answer()
        assert _set(ans, "request_headers")["x-gateway-destination-endpoint"] == "10.1.2.3:31000"
        assert rig.in_flight() == [1]
        await ctx.inbox.put(grpc.aio.EOF)
        await task
        assert rig.in_flight() == [0]

    try:
        _run(body())
    finally:
        rig.close()


def test_shed_is_429_and_a_cancelled_wait_leaves_the_queue() -> None:
    rig = _Rig(max_concurrent_requests=1, queue_size=1)

    async def body() -> None:
        rig.start()
        first = await _route(rig)
        waiting_ctx, waiting = rig.stream()
        await waiting_ctx.inbox.put(_headers())
        await waiting_ctx.answer()
        await waiting_ctx.inbox.put(_body(b'{"text": "q"}'))
        for _ in range(100):
            if rig.admission.queue:
                break
            await asyncio.sleep(0.005)
        assert len(rig.admission.queue) == 1
        _, shed_task, shed = await _route(rig)  # queue full: shed
        assert shed.immediate_response.status.code == 429
        await shed_task
        waiting.cancel()  # Envoy gave up on the queued one
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert not rig.admission.queue and rig.admission.active == 1
        ctx, task, _ = first
        await ctx.inbox.put(grpc.aio.EOF)
        await task
        assert rig.admission.active == 0 and sum(rig.in_flight()) == 0

    try:
        _run(body())
    finally:
        rig.close()


def test_the_safety_net_releases_a_booking_whose_stream_never_ended() -> None:
    rig = _Rig(request_timeout_secs=1)

    async def body() -> None:
        rig.start()
        ctx, task, _ = await _route(rig)
        assert sum(rig.in_flight()) == 1
        loop = asyncio.get_running_loop()
        assert rig.decider.check_leaks(loop.time()) == 0
        assert rig.decider.check_leaks(loop.time() + 7.0) == 1
        assert sum(rig.in_flight()) == 0
        await ctx.inbox.put(grpc.aio.EOF)  # the late end releases nothing twice
        await task
        assert rig.table.underflows == 0

    try:
        _run(body())
    finally:
        rig.close()


def test_endpoint_is_the_resolved_address() -> None:
    assert endpoint_of(_Worker("w.example", 80, addr=("10.0.0.9", 80))) == "10.0.0.9:80"
    assert endpoint_of(_Worker("::1", 81, addr=("::1", 81))) == "[::1]:81"
    assert endpoint_of(_Worker("127.0.0.1", 82)) == "127.0.0.1:82"


def test_a_pick_without_body_needs_overrides_the_mode_to_skip_the_body() -> None:
    rig = _Rig(dp=1, policy="round_robin")

    async def body() -> None:
        rig.start()
        assert not rig.decider.needs_body
        ctx, task = rig.stream()
        await ctx.inbox.put(_headers())
        ans = await ctx.answer()
        assert _set(ans, "request_headers")["x-gateway-destination-endpoint"] == "10.1.2.3:31000"
        assert ans.HasField("mode_override")
        assert ans.mode_override.request_body_mode == 0  # NONE
        assert ans.mode_override.response_trailer_mode == 1  # SEND: open to the end
        assert rig.in_flight() == [1]
        await ctx.inbox.put(grpc.aio.EOF)
        await task
        assert rig.in_flight() == [0]

    try:
        _run(body())
    finally:
        rig.close()


# -- every router flag under fastroute epp: works, warned once, or refused ------------------
from fastroute.config.cli import build_parser  # noqa: E402
from fastroute.config.flagparse import IgnoredFlag  # noqa: E402
from fastroute.epp.audit import AUDIT, INERT, REFUSED  # noqa: E402

_PRINT = ["epp", "--grpc-port", "9002", "--print-envoy-config", "--envoy-listen-port", "8080"]

# A value for each flag the picker warns about or refuses (several flags go together).
_INERT_SAMPLES = {
    "--port": ["--port", "31000"],
    "--control-plane-api-keys": ["--control-plane-api-keys", "k1:ops:admin:s3cret-key-0001"],
    "--control-plane-audit-enabled": ["--control-plane-audit-enabled"],
    "--allow-open-admin": ["--allow-open-admin"],
    "--ca-cert-paths": ["--ca-cert-paths", "/etc/ssl/ca.pem"],
    "--client-cert-path": ["--client-cert-path", "/c.pem", "--client-key-path", "/k.pem"],
    "--client-key-path": ["--client-cert-path", "/c.pem", "--client-key-path", "/k.pem"],
    "--prometheus-duration-buckets": ["--prometheus-duration-buckets", "0.1", "1"],
    "--request-id-headers": ["--router-request-id-headers", "x-my-id"],
    "--sse-keepalive-secs": ["--sse-keepalive-secs", "5"],
    "--enable-trace": ["--enable-trace"],
    "--otlp-traces-endpoint": ["--otlp-traces-endpoint", "127.0.0.1:4317"],
    "--bootstrap-port-annotation": ["--bootstrap-port-annotation", "x/port"],
    "--prefill-policy": ["--prefill-policy", "round_robin"],
    "--decode-policy": ["--decode-policy", "round_robin"],
    "--pd-max-batch-size": ["--pd-max-batch-size", "3"],
    "--dp-rank-field": [
        "--pd-disaggregation",
        "--prefill",
        "http://p:1",
        "--decode",
        "http://d:2",
        "--sidecar-port",
        "9",
        "--dp-rank-field",
        "routed_dp_rank",
    ],
    "--cb-window-duration-secs": ["--cb-window-duration-secs", "5"],
    "--prefill-selector": ["--prefill-selector", "app=p"],
    "--decode-selector": ["--decode-selector", "app=d"],
}
_TOK = ["--tokenizer-path", "/tok"]
_REFUSED_SAMPLES = {
    "--priority-scheduler-enabled": ["--priority-scheduler-enabled"],
    "--priority-scheduler-default-max-class": ["--priority-scheduler-default-max-class", "interactive"],
    "--priority-scheduler-config": ["--priority-scheduler-config", "/nonexistent/priority.yaml"],
    "--priority-scheduler-tenant-metric-top-n": ["--priority-scheduler-tenant-metric-top-n", "4"],
    "--tenant-rate-limit-enabled": ["--tenant-rate-limit-enabled"],
    "--tenant-rate-limit-config": ["--tenant-rate-limit-config", "/nonexistent/limits.yaml"],
    "--tenant-api-key": ["--tenant-api-key", "team-a:key-a"],
    "--trust-tenant-header": ["--trust-tenant-header"],
    "--tenant-header-name": ["--tenant-header-name", "x-team"],
    "--worker-overload-shed": ["--worker-overload-shed"],
    "--worker-overload-waiting-requests": ["--worker-overload-waiting-requests", "4"],
    "--worker-overload-token-usage": ["--worker-overload-token-usage", "0.5"],
    "--prefill-overload-uncached-tokens": ["--prefill-overload-uncached-tokens", "1000"],
    "--flow-max-queued": ["--flow-max-queued", "10"],
    "--cors-allowed-origins": ["--cors-allowed-origins", "https://app.example"],
    "--tls-cert-path": ["--tls-cert-path", "/c.pem", "--tls-key-path", "/k.pem"],
    "--tls-key-path": ["--tls-key-path", "/k.pem", "--tls-cert-path", "/c.pem"],
    "--tls-min-version": ["--tls-min-version", "1.3"],
    "--enable-igw": ["--enable-igw"],
    "--model-alias": ["--model-alias", "a=b"],
    "--retry-max-retries": ["--retry-max-retries", "2"],
    "--retry-initial-backoff-ms": ["--retry-initial-backoff-ms", "10"],
    "--retry-max-backoff-ms": ["--retry-max-backoff-ms", "100"],
    "--retry-backoff-multiplier": ["--retry-backoff-multiplier", "2"],
    "--retry-jitter-factor": ["--retry-jitter-factor", "0.5"],
    "--cb-failure-threshold": ["--cb-failure-threshold", "3"],
    "--cb-success-threshold": ["--cb-success-threshold", "1"],
    "--cb-timeout-duration-secs": ["--cb-timeout-duration-secs", "5"],
    "--prefill-input-demand": ["--prefill-input-demand", "on"],
    "--speed-aware": ["--speed-aware", "on", "--policy", "round_robin"],
    "--speed-slo-unmet": ["--speed-slo-unmet", "refuse"],
    "--tokenizer-path": ["--tokenizer-path", "/tok"],
    "--model-path": ["--model-path", "/m"],
    # (with what they go with: alone they only warn, as settings without their feature)
    "--chat-template": [*_TOK, "--chat-template", "/t.jinja"],
    "--tokenize-timeout-ms": [*_TOK, "--tokenize-timeout-ms", "10"],
    "--tokenizer-cache-enable-l0": [*_TOK, "--tokenizer-cache-enable-l0"],
    "--tokenizer-cache-l0-max-entries": [*_TOK, "--tokenizer-cache-enable-l0", "--tokenizer-cache-l0-max-entries", "5"],
    "--tokenizer-cache-l0-max-memory": [
        *_TOK,
        "--tokenizer-cache-enable-l0",
        "--tokenizer-cache-l0-max-memory",
        "1000",
    ],
    "--tokenizer-cache-enable-l1": [*_TOK, "--tokenizer-cache-enable-l1"],
    "--tokenizer-cache-l1-max-memory": [
        *_TOK,
        "--tokenizer-cache-enable-l1",
        "--tokenizer-cache-l1-max-memory",
        "1000",
    ],
}
# The flag a refusal names when the router's own check speaks first.
_NAMED = {"--tls-key-path": "--tls-cert-path"}


def _status(argv: list[str]) -> int | None:
    try:
        return main(argv)
    except SystemExit as exc:  # the router's own refusals exit through argparse
        return exc.code  # type: ignore[return-value]


def test_every_router_flag_has_its_place_under_epp() -> None:
    parser = build_parser()
    named = set()
    for action in parser._actions:
        if isinstance(action, IgnoredFlag) or action.help == "==SUPPRESS==":
            continue  # the peers' inventory: judged as in the proxy (fastroute.config.flags)
        opts = [o for o in action.option_strings if o not in ("-h", "--help", "--version")]
        if opts:
            named.add("--p2c-load-metric" if "--p2c-load-metric" in opts else opts[0])
    assert named == set(AUDIT)
    assert {f for f, c in AUDIT.items() if c == INERT} == set(_INERT_SAMPLES)
    assert {f for f, c in AUDIT.items() if c == REFUSED} == set(_REFUSED_SAMPLES)


@pytest.mark.parametrize("flag", sorted(_INERT_SAMPLES))
def test_an_inert_flag_is_warned_about_exactly_once(flag: str, capsys: Any) -> None:
    assert main([*_PRINT, *_INERT_SAMPLES[flag]]) == 0
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if f" {flag} " in ln + " "]
    assert len(lines) == 1, err
    assert "WARNING" in lines[0] and "ignored" in lines[0]


@pytest.mark.parametrize("flag", sorted(_REFUSED_SAMPLES))
def test_a_flag_the_picker_cannot_honour_refuses_the_start(flag: str, capsys: Any) -> None:
    assert _status([*_PRINT, *_REFUSED_SAMPLES[flag]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"argument {_NAMED.get(flag, flag)}" in err[0], err


def test_pd_needs_the_sidecar_port_and_the_pd_flags_then_act(capsys: Any) -> None:
    pd = ["--pd-disaggregation", "--prefill", "http://p:1", "--decode", "http://d:2"]
    assert _status([*_PRINT, *pd]) == 2
    assert "argument --pd-disaggregation: needs --sidecar-port" in capsys.readouterr().err
    assert _status([*_PRINT, "--sidecar-port", "9"]) == 2
    assert "argument --sidecar-port" in capsys.readouterr().err
    assert _status([*_PRINT, *pd, "--sidecar-port", "9", "--prefill-input-demand", "on"]) == 2
    assert "argument --prefill-input-demand" in capsys.readouterr().err
    assert (
        main([*_PRINT, *pd, "--sidecar-port", "9", "--prefill-policy", "random", "--decode-policy", "round_robin"]) == 0
    )
    assert "WARNING" not in capsys.readouterr().err
    assert _status(["sidecar", "--worker-urls", "http://w:1"]) == 2
    assert "argument --pd-disaggregation: required by fastroute sidecar" in capsys.readouterr().err


def test_connection_flags_go_into_the_printed_bootstrap(capsys: Any) -> None:
    assert (
        main(
            [
                *_PRINT,
                "--header-read-timeout-secs",
                "2.5",
                "--body-read-timeout-secs",
                "40",
                "--idle-connection-timeout-secs",
                "7",
                "--upstream-pool-idle-timeout-secs",
                "1.5",
                "--max-payload-size",
                "4096",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    for needle in (
        "request_headers_timeout: 2.5s",
        "request_timeout: 50s",
        "idle_timeout: 7s",
        "idle_timeout: 1.5s",
        "per_connection_buffer_limit_bytes: 4096",
    ):
        assert needle in out
    assert main([*_PRINT, "--upstream-pool-idle-timeout-secs", "0"]) == 0
    out = capsys.readouterr().out
    assert "max_requests_per_connection: 1" in out
    assert f"per_connection_buffer_limit_bytes: {32 * 1024 * 1024}" in out  # Envoy's default


# -- the subset hint -------------------------------------------------------------------------
from google.protobuf import struct_pb2  # noqa: E402

from fastroute.epp.decide import CODE_NO_SUBSET_ENDPOINT  # noqa: E402


class _Pool(_Registry):
    """Several single-rank workers (distinct endpoints) in one regular group."""

    def __init__(self, table: TargetTable, workers: list[_Worker], policy: str) -> None:
        rows = [table.alloc() for _ in workers]
        self.target_info = [None] * (max(rows) + 1)
        for w, t in zip(workers, rows):
            self.target_info[t] = (w, None)
        self.rows = rows
        self.router = Router(table, seed=7)
        self._group = self.router.group(rows, policy, load_metric="least_requests", names=[f"w{t}" for t in rows])
        self.is_ready = True


def _hinted(value: Any) -> Any:
    """Request headers carrying the subset hint (``value``: a list, a string, or None)."""
    msg = _headers("/v1/models", "GET", eos=True)
    hint = struct_pb2.Struct()
    if isinstance(value, list):
        hint.get_or_create_list("x-gateway-destination-endpoint-subset").extend(value)
    elif value is not None:
        hint["x-gateway-destination-endpoint-subset"] = value
    msg.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return msg


def test_the_subset_hint_limits_the_pick_and_none_left_is_a_503() -> None:
    table = TargetTable(16)
    ws = [
        _Worker("a", 1, addr=("10.0.0.1", 8000)),
        _Worker("b", 1, addr=("10.0.0.2", 8000)),
        _Worker("c", 1, addr=("10.0.0.3", 8000)),
    ]
    reg = _Pool(table, ws, "round_robin")

    async def one(value: Any, hinted: bool = True) -> Any:
        ctx, task = servicer.stream()
        await ctx.inbox.put(_hinted(value) if hinted else _headers("/v1/models", "GET", eos=True))
        ans = await ctx.answer()
        if ans.WhichOneof("response") != "immediate_response":
            await ctx.inbox.put(grpc.aio.EOF)
        await task
        return ans

    async def body() -> None:
        loop = asyncio.get_running_loop()
        c = Config(policy="round_robin")
        d = Decider(c, reg, Admission(-1, 0, 1, loop), None, loop)
        servicer.servicer = ExternalProcessor(d)
        got = set()
        for _ in range(6):
            ans = await one(["10.0.0.2:8000", "10.0.0.3:8000", "10.9.9.9:1"])
            got.add(_set(ans, "request_headers")["x-gateway-destination-endpoint"])
        assert got == {"10.0.0.2:8000", "10.0.0.3:8000"}
        ans = await one("10.0.0.1:8000, 10.9.9.9:1")  # comma-separated form
        assert _set(ans, "request_headers")["x-gateway-destination-endpoint"] == "10.0.0.1:8000"
        for bad in (["10.9.9.9:1"], [], 7.0):  # nothing allowed is available
            ans = await one(bad)
            imm = ans.immediate_response
            assert imm.status.code == 503
            err = json.loads(imm.body)["error"]
            assert err["code"] == CODE_NO_SUBSET_ENDPOINT and "subset" in err["message"]
        got = set()
        for _ in range(3):  # no hint: the whole pool
            ans = await one(None, hinted=False)
            got.add(_set(ans, "request_headers")["x-gateway-destination-endpoint"])
        assert len(got) == 3
        assert [table.in_flight(t) for t in reg.rows] == [0, 0, 0]
        assert d.in_flight == 0 and table.underflows == 0

    class _S:
        servicer: Any = None

        def stream(self) -> tuple[_Context, asyncio.Task]:
            ctx = _Context()
            return ctx, asyncio.get_running_loop().create_task(self.servicer.Process(None, ctx))

    servicer = _S()
    try:
        _run(body())
    finally:
        table.unlink()


def test_a_body_over_the_limit_without_content_length_is_413() -> None:
    rig = _Rig(max_payload_size=64)

    async def body() -> None:
        rig.start()
        ctx, task, ans = await _route(rig, b'{"text": "%s"}' % (b"x" * 100))
        assert ans.immediate_response.status.code == 413
        await task
        assert rig.in_flight() == [0, 0, 0, 0] and rig.admission.active == 0

    try:
        _run(body())
    finally:
        rig.close()
