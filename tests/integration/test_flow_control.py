"""Flow control over real sockets: priority classes, tenant fairness, queue bounds and TTLs,
client disconnects, tenant keys, tenant rate limits, and smg's flags and file errors."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fastroute.config.cli import parse_args
from fastroute.dataplane.flowcontrol import CLIENT_GONE, FlowAdmission
from tests.integration.conftest import RawClient, Router, call, get, post, run, until, workers


def _flow(r: Router) -> FlowAdmission:
    flow = r.server.app.admission
    assert isinstance(flow, FlowAdmission)
    return flow


def _yaml(tmp_path: Path, text: str, name: str = "flow.yaml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _gen(tag: str, headers: dict[str, str] | None = None) -> bytes:
    return post("/generate", {"text": tag}, headers)


def _limited(cfg: str, w: Any) -> Router:
    """A router over ``w`` with the tenant rate limits of ``cfg`` and the tenant header trusted."""
    return Router(
        worker_urls=[w.url], tenant_rate_limit_enabled=True, tenant_rate_limit_config=cfg, trust_tenant_header=True
    )


async def _send(port: int, data: bytes) -> Any:
    return await call(port, data, timeout=15.0)


def test_interactive_is_served_before_bulk_that_arrived_earlier() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(
            worker_urls=[w.url],
            max_concurrent_requests=1,
            priority_scheduler_enabled=True,
            priority_scheduler_default_max_class="system",
        ) as r:
            flow = _flow(r)
            w.hold()
            first = asyncio.ensure_future(_send(r.port, _gen("first")))
            await until(lambda: w.held == 1 or len(w.inference()) == 1, what="first request at the worker")
            bulk = [
                asyncio.ensure_future(_send(r.port, _gen(f"bulk{i}", {"x-smg-priority": "bulk"}))) for i in range(3)
            ]
            await until(lambda: len(flow.queue) == 3, what="three bulk requests queued")
            inter = asyncio.ensure_future(_send(r.port, _gen("inter", {"X-SMG-Priority": " Interactive "})))
            await until(lambda: len(flow.queue) == 4, what="the interactive request queued")
            w.release()
            results = await asyncio.gather(first, *bulk, inter)
            assert [res.status for res in results] == [200] * 5
            order = [rec.json["text"] for rec in w.inference()]
            assert order == ["first", "inter", "bulk0", "bulk1", "bulk2"]

    run(body())


def test_tenant_header_clamps_to_max_class(tmp_path: Path) -> None:
    cfg = _yaml(tmp_path, 'tenant_policies:\n  "header:vip":\n    max_class: interactive\n')

    async def body() -> None:
        (w,) = await workers(1)
        async with Router(
            worker_urls=[w.url],
            max_concurrent_requests=1,
            priority_scheduler_enabled=True,
            priority_scheduler_config=cfg,
            trust_tenant_header=True,
        ) as r:
            flow = _flow(r)
            w.hold()
            first = asyncio.ensure_future(_send(r.port, _gen("first")))
            await until(lambda: len(w.inference()) == 1, what="first request at the worker")
            # An unlisted tenant asking for system is clamped to default (the default ceiling),
            # so the vip's interactive request, sent later, goes first.
            low = asyncio.ensure_future(
                _send(r.port, _gen("other", {"x-smg-priority": "system", "x-smg-tenant-id": "other"}))
            )
            await until(lambda: len(flow.queue) == 1, what="the clamped request queued")
            vip = asyncio.ensure_future(
                _send(r.port, _gen("vip", {"x-smg-priority": "system", "x-smg-tenant-id": "vip"}))
            )
            await until(lambda: len(flow.queue) == 2, what="the vip request queued")
            w.release()
            assert [x.status for x in await asyncio.gather(first, low, vip)] == [200, 200, 200]
            assert [rec.json["text"] for rec in w.inference()] == ["first", "vip", "other"]
            assert flow.admitted[("header:vip", "interactive")] == 1
            assert flow.admitted[("header:other", "default")] == 1

    run(body())


def test_tenants_inside_a_class_take_turns() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(
            worker_urls=[w.url],
            max_concurrent_requests=1,
            priority_scheduler_enabled=True,
            trust_tenant_header=True,
            priority_scheduler_tenant_metric_top_n=1,
        ) as r:
            flow = _flow(r)
            w.hold()
            first = asyncio.ensure_future(_send(r.port, _gen("first")))
            await until(lambda: len(w.inference()) == 1, what="first request at the worker")
            sent = []
            for i in range(10):  # the heavy tenant queues ten before the light one's two
                sent.append(asyncio.ensure_future(_send(r.port, _gen(f"big{i}", {"x-smg-tenant-id": "big"}))))
                await until(lambda n=i + 1: len(flow.queue) == n, what="queued")
            for i in range(2):
                sent.append(asyncio.ensure_future(_send(r.port, _gen(f"small{i}", {"x-smg-tenant-id": "small"}))))
                await until(lambda n=11 + i: len(flow.queue) == n, what="queued")
            w.release()
            results = await asyncio.gather(first, *sent)
            assert all(res.status == 200 for res in results)
            order = [rec.json["text"] for rec in w.inference()][1:]
            # Round robin between the two tenants: the light one's requests are the 2nd and 4th
            # served, not the 11th and 12th as in one FIFO.
            assert order[:4] == ["big0", "small0", "big1", "small1"]
            assert order[4:] == [f"big{i}" for i in range(2, 10)]
            # --priority-scheduler-tenant-metric-top-n 1: only the busiest tenant is named.
            text = (await call(r.server.metrics.port, get("/metrics"))).body.decode()
            assert 'fastroute_flow_admitted_total{class="default",tenant="header:big"} 10.0' in text
            assert 'fastroute_flow_admitted_total{class="default",tenant="other"} 3.0' in text
            assert "header:small" not in text

    run(body())


def test_full_class_queue_429_and_class_ttl_503(tmp_path: Path) -> None:
    cfg = _yaml(tmp_path, "classes:\n  bulk:\n    queue_size: 1\n    queue_timeout_secs: 1\n")

    async def body() -> None:
        (w,) = await workers(1)
        async with Router(
            worker_urls=[w.url],
            max_concurrent_requests=1,
            priority_scheduler_enabled=True,
            priority_scheduler_config=cfg,
        ) as r:
            flow = _flow(r)
            w.hold()
            first = asyncio.ensure_future(_send(r.port, _gen("first")))
            await until(lambda: len(w.inference()) == 1, what="first request at the worker")
            queued = asyncio.ensure_future(_send(r.port, _gen("b0", {"x-smg-priority": "bulk"})))
            await until(lambda: len(flow.queue) == 1, what="one bulk request queued")
            full = await _send(r.port, _gen("b1", {"x-smg-priority": "bulk"}))
            assert full.status == 429
            assert full.json["error"]["code"] == "scheduler_queue_full"
            assert full.headers["x-smg-error-code"] == "scheduler_queue_full"
            assert full.headers["retry-after"] == "2"  # smg 1.13 answers both with 2
            timed_out = await queued  # its class TTL (1 s) passes while the first one is held
            assert timed_out.status == 503
            assert timed_out.json["error"]["code"] == "scheduler_queue_timeout"
            assert timed_out.headers["x-smg-error-code"] == "scheduler_queue_timeout"
            assert timed_out.headers["retry-after"] == "2"
            assert not flow.queue
            w.release()
            assert (await first).status == 200
            assert [rec.json["text"] for rec in w.inference()] == ["first"]  # nothing refused reached it
            assert flow.refusals[("ip:127.0.0.1", "bulk", "scheduler_queue_full")] == 1
            assert flow.refusals[("ip:127.0.0.1", "bulk", "scheduler_queue_timeout")] == 1
            assert flow.running == 0
            text = (await call(r.server.metrics.port, get("/metrics"))).body.decode()
            for reason in ("scheduler_queue_full", "scheduler_queue_timeout"):
                line = f'fastroute_flow_refusals_total{{class="bulk",reason="{reason}",tenant="ip:127.0.0.1"}} 1.0'
                assert line in text
            assert 'fastroute_flow_admitted_total{class="default",tenant="ip:127.0.0.1"} 1.0' in text

    run(body())


def test_client_leaving_while_queued_is_dropped_at_once() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url], max_concurrent_requests=1, priority_scheduler_enabled=True) as r:
            flow = _flow(r)
            w.hold()
            first = asyncio.ensure_future(_send(r.port, _gen("first")))
            await until(lambda: len(w.inference()) == 1, what="first request at the worker")
            c = await RawClient(r.port).connect()
            c.send(_gen("gone"))
            await until(lambda: len(flow.queue) == 1, what="queued")
            c.close()
            await until(lambda: not flow.queue, what="the waiter dropped")
            assert flow.refusals[("ip:127.0.0.1", "default", CLIENT_GONE)] == 1
            w.release()
            assert (await first).status == 200
            after = await _send(r.port, _gen("after"))
            assert after.status == 200
            assert [rec.json["text"] for rec in w.inference()] == ["first", "after"]
            assert flow.running == 0

    run(body())


def test_tenant_api_keys_name_the_tenant_beside_api_key() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(
            worker_urls=[w.url], api_key="main-key", tenant_api_key=["acme:acme-key", "beta: beta-key "]
        ) as r:
            flow = _flow(r)
            ok = await _send(r.port, _gen("a", {"Authorization": "Bearer acme-key"}))
            assert ok.status == 200
            ok2 = await _send(r.port, _gen("b", {"Authorization": "Bearer beta-key"}))
            assert ok2.status == 200
            main = await _send(r.port, _gen("c", {"Authorization": "Bearer main-key"}))
            assert main.status == 200
            bad = await _send(r.port, _gen("d", {"Authorization": "Bearer nope"}))
            assert bad.status == 401
            assert flow.admitted[("auth:acme", "default")] == 1
            assert flow.admitted[("auth:beta", "default")] == 1
            assert flow.admitted[("ip:127.0.0.1", "default")] == 1
            assert [rec.json["text"] for rec in w.inference()] == ["a", "b", "c"]

    run(body())


def test_tenant_keys_alone_still_need_a_key() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url], tenant_api_key=["acme:acme-key"]) as r:
            assert (await _send(r.port, _gen("a", {"Authorization": "Bearer acme-key"}))).status == 200
            anon = await _send(r.port, _gen("b"))
            assert anon.status == 401
            assert [rec.json["text"] for rec in w.inference()] == ["a"]

    run(body())


def test_tenant_request_and_token_limits(tmp_path: Path) -> None:
    cfg = _yaml(
        tmp_path,
        "default_policy:\n"
        "  tokens_per_minute: 100000\n"
        "  requests_per_minute: 2\n"
        "tenants:\n"
        '  - tenant_key: "header:small"\n'
        "    tokens_per_minute: 100\n"
        "    requests_per_minute: 1000\n"
        "    model_rules:\n"
        "      - rule_id: big-model\n"
        "        matcher: {type: prefix, value: big-}\n"
        "        tokens_per_minute: 100000\n"
        "        requests_per_minute: 1\n",
    )

    async def body() -> None:
        (w,) = await workers(1)
        async with _limited(cfg, w) as r:
            flow = _flow(r)
            # Requests per minute (default policy, per tenant): the third is refused.
            for tag in ("r0", "r1"):
                assert (await _send(r.port, _gen(tag))).status == 200
            third = await _send(r.port, _gen("r2"))
            assert third.status == 429
            assert third.json["error"]["code"] == "tenant_rate_limit_exceeded"
            assert third.headers["x-smg-error-code"] == "tenant_rate_limit_exceeded"
            assert int(third.headers["retry-after"]) >= 1
            # Another tenant has its own budget.
            small = {"x-smg-tenant-id": "small"}
            assert (await _send(r.port, post("/generate", {"text": "x" * 200}, small))).status == 200  # 50 tokens
            assert (await _send(r.port, post("/generate", {"text": "y" * 160}, small))).status == 200  # 40 tokens
            over = await _send(r.port, post("/generate", {"text": "z" * 200}, small))  # 50 > the 10 left
            assert over.status == 429 and over.json["error"]["code"] == "tenant_rate_limit_exceeded"
            assert int(over.headers["retry-after"]) >= 1
            never = await _send(r.port, post("/generate", {"text": "w" * 800}, small))  # 200 > capacity
            assert never.status == 429 and "retry-after" not in never.headers
            # A model rule adds its own scope: one request per minute for big-*.
            assert (await _send(r.port, post("/generate", {"text": "m", "model": "big-1"}, small))).status == 200
            rule = await _send(r.port, post("/generate", {"text": "n", "model": "big-2"}, small))
            assert rule.status == 429
            texts = [rec.json["text"] for rec in w.inference()]
            assert "r2" not in texts and "z" * 200 not in texts and "n" not in texts
            assert flow.refusals[("ip:127.0.0.1", "default", "tenant_rate_limit_exceeded")] == 1
            assert flow.refusals[("header:small", "default", "tenant_rate_limit_exceeded")] == 3
            assert flow.running == 0

    run(body())


SMG_FLAGS = [
    "--priority-scheduler-enabled",
    "--priority-scheduler-default-max-class",
    "interactive",
    "--priority-scheduler-tenant-metric-top-n",
    "8",
    "--tenant-rate-limit-enabled",
    "--tenant-api-key",
    "acme:k1",
    "--tenant-api-key",
    "beta:k2",
    "--trust-tenant-header",
    "--tenant-header-name",
    "x-team",
    "--worker-overload-shed",
    "--worker-overload-waiting-requests",
    "4",
    "--worker-overload-token-usage",
    "0.9",
]


def test_smg_flags_are_accepted(tmp_path: Path) -> None:
    sched = _yaml(tmp_path, "classes:\n  bulk:\n    queue_size: 5\n", "sched.yaml")
    rl = _yaml(tmp_path, "default_policy:\n  tokens_per_minute: 10\n  requests_per_minute: 1\n", "rl.yaml")
    c = parse_args(
        ["--worker-urls", "http://127.0.0.1:1"]
        + SMG_FLAGS
        + ["--priority-scheduler-config", sched, "--tenant-rate-limit-config", rl]
    )
    assert c.priority_scheduler_enabled and c.tenant_rate_limit_enabled and c.trust_tenant_header
    assert c.priority_scheduler_default_max_class == "interactive"
    assert c.tenant_api_key == ["acme:k1", "beta:k2"]
    assert c.tenant_header_name == "x-team"
    assert c.priority_scheduler_tenant_metric_top_n == 8
    assert c.worker_overload_shed and c.worker_overload_waiting_requests == 4
    assert c.worker_overload_token_usage == 0.9


def test_overload_thresholds_without_a_gate_are_refused_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    # smg leaves overloaded workers out of routing with them; fastroute uses them only for its
    # saturation gate, so without --priority-scheduler-enabled or --worker-overload-shed a
    # threshold that is on would do nothing: refused, naming the flag. The off values start.
    for flag, value in (("--worker-overload-waiting-requests", "8"), ("--worker-overload-token-usage", "0.8")):
        with pytest.raises(SystemExit):
            parse_args(["--worker-urls", "http://127.0.0.1:1", flag, value])
        assert flag in capsys.readouterr().err
    c = parse_args(
        ["--worker-urls", "http://127.0.0.1:1", "--worker-overload-waiting-requests", "0"]
        + ["--worker-overload-token-usage", "1.0"]
    )
    assert c.worker_overload_waiting_requests == 0


def _start(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fastroute", "--worker-urls", "http://127.0.0.1:1", *flags],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=str(Path(__file__).resolve().parents[2]),
    )


def test_a_bad_policy_file_stops_start_up_naming_its_line(tmp_path: Path) -> None:
    sched = _yaml(tmp_path, "classes:\n  bulk:\n    queue_size: 5\n    queue_timout_secs: 3\n", "sched.yaml")
    res = _start(tmp_path, "--priority-scheduler-enabled", "--priority-scheduler-config", sched)
    assert res.returncode == 1
    assert f"{sched}:4:" in res.stderr and "queue_timout_secs" in res.stderr
    broken = _yaml(tmp_path, "default_policy:\n  tokens_per_minute: 10\n   requests_per_minute: [\n", "rl.yaml")
    res = _start(tmp_path, "--tenant-rate-limit-enabled", "--tenant-rate-limit-config", broken)
    assert res.returncode == 1
    assert f"{broken}:3:" in res.stderr
    zero = _yaml(
        tmp_path,
        "default_policy:\n  tokens_per_minute: 10\n  requests_per_minute: 1\ntenants:\n"
        "  - tenant_key: auth:a\n    tokens_per_minute: 0\n    requests_per_minute: 1\n",
        "zero.yaml",
    )
    res = _start(tmp_path, "--tenant-rate-limit-enabled", "--tenant-rate-limit-config", zero)
    assert res.returncode == 1
    assert f"{zero}:6:" in res.stderr and "tokens_per_minute" in res.stderr
    res = _start(tmp_path, "--tenant-rate-limit-enabled")
    assert res.returncode == 2 and "--tenant-rate-limit-config" in res.stderr


@pytest.mark.parametrize("knob", ["reserved_floor: 1", "reserved_per_slot: 0.5"])
def test_reserved_slots_are_kept_for_the_classes_above(tmp_path: Path, knob: str) -> None:
    # smg 1.13's two knobs: a floor of slots, or a share of the capacity (0.5 x 2 = 1 slot).
    cfg = _yaml(tmp_path, f"classes:\n  interactive:\n    {knob}\n")

    async def body() -> None:
        (w,) = await workers(1)
        async with Router(
            worker_urls=[w.url],
            max_concurrent_requests=2,
            priority_scheduler_enabled=True,
            priority_scheduler_config=cfg,
            priority_scheduler_default_max_class="interactive",
        ) as r:
            flow = _flow(r)
            w.hold()
            bulk = [
                asyncio.ensure_future(_send(r.port, _gen(f"bulk{i}", {"x-smg-priority": "bulk"}))) for i in range(2)
            ]
            await until(lambda: len(w.inference()) == 1 and len(flow.queue) == 1, what="one bulk running, one held")
            # The second slot is interactive's reservation: an interactive request takes it at once.
            inter = asyncio.ensure_future(_send(r.port, _gen("inter", {"x-smg-priority": "interactive"})))
            await until(lambda: len(w.inference()) == 2, what="the interactive request at the worker")
            assert len(flow.queue) == 1
            w.release()
            assert [x.status for x in await asyncio.gather(*bulk, inter)] == [200, 200, 200]
            assert [rec.json["text"] for rec in w.inference()] == ["bulk0", "inter", "bulk1"]

    run(body())


def test_a_request_refused_after_its_rate_reservation_gives_it_back(tmp_path: Path) -> None:
    sched = _yaml(tmp_path, "classes:\n  default:\n    queue_size: 0\n", "sched.yaml")
    rl = _yaml(tmp_path, "default_policy:\n  tokens_per_minute: 100000\n  requests_per_minute: 2\n", "rl.yaml")

    async def body() -> None:
        (w,) = await workers(1)
        async with Router(
            worker_urls=[w.url],
            max_concurrent_requests=1,
            priority_scheduler_enabled=True,
            priority_scheduler_config=sched,
            tenant_rate_limit_enabled=True,
            tenant_rate_limit_config=rl,
        ) as r:
            w.hold()
            first = asyncio.ensure_future(_send(r.port, _gen("first")))
            await until(lambda: len(w.inference()) == 1, what="first request at the worker")
            full = await _send(r.port, _gen("full"))
            assert full.status == 429 and full.json["error"]["code"] == "scheduler_queue_full"
            w.release()
            assert (await first).status == 200
            # The refused request's reservation came back: the tenant's second request of the
            # minute is served, the third is over its budget.
            assert (await _send(r.port, _gen("second"))).status == 200
            over = await _send(r.port, _gen("third"))
            assert over.status == 429 and over.json["error"]["code"] == "tenant_rate_limit_exceeded"

    run(body())


def test_at_the_total_bound_the_lowest_class_is_shed_first() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(
            worker_urls=[w.url],
            max_concurrent_requests=1,
            priority_scheduler_enabled=True,
            priority_scheduler_default_max_class="system",
            flow_max_queued=3,
        ) as r:
            flow = _flow(r)
            w.hold()
            first = asyncio.ensure_future(_send(r.port, _gen("first")))
            await until(lambda: len(w.inference()) == 1, what="first request at the worker")
            queued = {}
            for n, (tag, cls) in enumerate((("bulk0", "bulk"), ("default0", "default"), ("bulk1", "bulk")), 1):
                queued[tag] = asyncio.ensure_future(_send(r.port, _gen(tag, {"x-smg-priority": cls})))
                await until(lambda n=n: len(flow.queue) == n, what="queued")
            # At the bound: an interactive newcomer sheds the newest bulk waiter, then the older one.
            for i in range(2):
                queued[f"inter{i}"] = asyncio.ensure_future(
                    _send(r.port, _gen(f"inter{i}", {"x-smg-priority": "interactive"}))
                )
                shed = await queued[f"bulk{1 - i}"]
                assert shed.status == 503
                assert shed.json["error"]["code"] == shed.headers["x-smg-error-code"] == "scheduler_shed"
                assert shed.headers["retry-after"] == "2"
            # Nothing lower than bulk waits for a bulk newcomer to shed: it is refused itself.
            late = await _send(r.port, _gen("bulk2", {"x-smg-priority": "bulk"}))
            assert late.status == 429 and late.json["error"]["code"] == "scheduler_queue_full"
            assert len(flow.queue) == 3
            w.release()
            rest = await asyncio.gather(first, queued["default0"], queued["inter0"], queued["inter1"])
            assert [x.status for x in rest] == [200] * 4
            assert [rec.json["text"] for rec in w.inference()] == ["first", "inter0", "inter1", "default0"]
            assert flow.refusals[("ip:127.0.0.1", "bulk", "scheduler_shed")] == 2

    run(body())


def test_what_is_kept_per_tenant_stays_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tenants are what clients make them (any value of a trusted header): the counters fold
    the least counted into ``other`` and the rate-limit scopes forget the oldest, so 300
    one-request tenants keep neither growing. Caps lowered here; the defaults are 8,192 counter
    entries (1,024 named after a fold) and 65,536 scopes."""
    from fastroute.dataplane import flowcontrol

    monkeypatch.setattr(flowcontrol, "COUNTED_KEYS", 40)
    monkeypatch.setattr(flowcontrol, "TENANTS_AFTER_FOLD", 8)
    monkeypatch.setattr(flowcontrol, "BUCKETS_KEPT", 24)
    cfg = _yaml(tmp_path, "default_policy:\n  tokens_per_minute: 100000\n  requests_per_minute: 2\n")

    async def body() -> None:
        (w,) = await workers(1)
        async with _limited(cfg, w) as r:
            flow = _flow(r)
            busy = {"x-smg-tenant-id": "busy"}
            codes = [(await _send(r.port, _gen(f"b{i}", busy))).status for i in range(3)]
            assert codes == [200, 200, 429]  # two a minute
            sizes = []
            for i in range(300):
                resp = await _send(r.port, _gen(f"t{i}", {"x-smg-tenant-id": f"t{i}"}))
                assert resp.status == 200
                sizes.append((len(flow.admitted), len(flow.refusals), len(flow._buckets)))
            assert max(s[0] for s in sizes) <= 40 and max(s[2] for s in sizes) <= 24, sizes[-5:]
            # nothing counted is lost: folded counts are under "other"
            assert sum(flow.admitted.values()) == 302
            assert flow.admitted[("header:busy", "default")] == 2  # the busiest keep their name
            assert flow.admitted[("other", "default")] > 200
            assert flow.refusals == {("header:busy", "default", "tenant_rate_limit_exceeded"): 1}
            text = r.server.metrics.render().decode()
            assert 'fastroute_flow_admitted_total{class="default",tenant="other"}' in text
            assert flow.running == 0

    run(body())
