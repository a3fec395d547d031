"""Peer metrics parity (dashboards built for the peers keep working): scrape /metrics after JSON,
SSE and PD traffic and check every series the mapping table says fastroute emits as the peers do:
name, type and label names, and the peers' label values (endpoint=generate/chat/completions, the
request's model)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from fastroute.control.metrics import PEER_SERIES, peer_table_markdown
from tests.integration.conftest import Router, call, get, post, run, until, workers

CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}


def _families(text: str) -> dict:
    out = {}
    for fam in text_string_to_metric_families(text):
        out[fam.name] = fam
    return out


def _check(fams: dict, require_samples: set[str]) -> None:
    for peer, kind, labels, ours in PEER_SERIES:
        if ours != peer:
            continue
        base = peer[: -len("_total")] if kind == "counter" and peer.endswith("_total") else peer
        fam = fams.get(base)
        assert fam is not None, f"{peer} missing from /metrics"
        assert fam.type == kind, (peer, fam.type)
        samples = [s for s in fam.samples if not s.name.endswith("_created")]
        if peer in require_samples:
            assert samples, f"{peer} has no samples after the traffic"
        for s in samples:
            names = set(s.labels) - {"le"}
            assert names == set(labels), (peer, sorted(names), labels)


def test_scrape_after_json_sse_and_pd_traffic_matches_the_table() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(
            worker_urls=[w.url], disable_health_check=False, health_check_interval_secs=1, retry_max_retries=1
        ) as r:
            assert (await call(r.port, post("/v1/chat/completions", CHAT))).status == 200
            assert (await call(r.port, post("/v1/chat/completions", {**CHAT, "stream": True}))).status == 200
            assert (await call(r.port, post("/generate", {"text": "x"}))).status == 200
            w.status = 503
            assert (await call(r.port, post("/v1/completions", {"model": "fake-model", "prompt": "x"}))).status == 503
            w.status = 200
            w.die_after = 1  # a stream cut after its first event: a router-side error
            try:
                await call(r.port, post("/v1/chat/completions", {**CHAT, "stream": True}))
            except Exception:
                pass
            w.die_after = None
            mon = r.server.monitor
            await until(lambda: sum(mon.health_checks.values()) >= 1, 4.0, "a health probe")
            text = (await call(r.server.metrics.port, get("/metrics"))).body.decode()
            fams = _families(text)
            _check(
                fams,
                {
                    "smg_http_requests_total",
                    "smg_http_responses_total",
                    "smg_http_request_duration_seconds",
                    "smg_router_requests_total",
                    "smg_router_request_duration_seconds",
                    "smg_router_request_errors_total",
                    "smg_worker_errors_total",
                    "smg_worker_health_checks_total",
                    "smg_worker_requests_active",
                    "smg_worker_selection_total",
                },
            )
            routed = {
                (s.labels["endpoint"], s.labels["model"], s.labels["streaming"]): s.value
                for s in fams["smg_router_requests"].samples
                if s.name.endswith("_total")
            }
            assert routed == {
                ("chat", "fake-model", "false"): 1,
                ("chat", "fake-model", "true"): 2,
                ("generate", "unknown", "false"): 1,
                ("completions", "fake-model", "false"): 1,
            }
            errs = [s.labels for s in fams["smg_worker_errors"].samples if s.name.endswith("_total")]
            assert {"worker_type": "regular", "connection_mode": "http", "error_type": "status_503"} in errs
            dur = [
                s
                for s in fams["smg_http_request_duration_seconds"].samples
                if s.name.endswith("_count") and s.labels["path"] == "/v1/chat/completions"
            ]
            assert dur and dur[0].labels["method"] == "POST" and dur[0].value == 3
            count = {
                name: [s.value for s in fams[name].samples if s.name.endswith("_count")][0]
                for name in ("fastroute_pick_seconds", "fastroute_router_overhead_seconds")
            }
            # one overhead sample per request, one pick per attempt (one attempt each here)
            assert count == {"fastroute_router_overhead_seconds": 5, "fastroute_pick_seconds": 5}
        (p,) = await workers(1, role="prefill")
        (d,) = await workers(1, role="decode")
        async with Router(pd_disaggregation=True, prefill=[(p.url, 8998)], decode=[d.url]) as r:
            assert (await call(r.port, post("/generate", {"text": "x", "stream": True}))).status == 200
            assert (await call(r.port, post("/v1/chat/completions", CHAT))).status == 200
            fams = _families((await call(r.server.metrics.port, get("/metrics"))).body.decode())
            _check(fams, {"smg_pd_ttft_seconds", "smg_router_requests_total"})
            ttft = {
                s.labels["model"]: s.value for s in fams["smg_pd_ttft_seconds"].samples if s.name.endswith("_count")
            }
            assert ttft == {"unknown": 1, "fake-model": 1}
            assert all(s.labels["backend_type"] == "pd" for s in fams["smg_router_requests"].samples)

    run(body())


def test_docs_table_is_rendered_from_the_code() -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    assert peer_table_markdown() in page
