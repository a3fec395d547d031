"""Over real sockets: smg's engine gauges from the load polls (per dp_rank, the
physical worker's URL), smg_worker_requests_total, the path label of smg_http_responses_total,
/v1/models and /workers in smg_http_requests_total, and the other families the parity table says
fastroute exports; docs/metrics.md's table is generated from fastroute.control.parity."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from fastroute.control import parity
from tests.integration.conftest import DataWorker, Router, call, get, post, run, until

REPO = Path(__file__).resolve().parents[2]


class LoadedWorker(DataWorker):
    """Reports per-rank loads with smg's core fields (or only the legacy /get_load)."""

    def __init__(self, legacy: bool = False, **kw) -> None:
        super().__init__(**kw)
        self.legacy = legacy

    def control(self, path: str):
        if path == "/v1/loads" and self.legacy:
            return 404, b"{}"
        if path == "/get_load" and self.legacy:
            return 200, json.dumps(
                [
                    {"dp_rank": r, "num_reqs": 5 + r, "num_waiting_reqs": 2, "num_tokens": 100}
                    for r in range(self.dp_size)
                ]
            ).encode()
        if path == "/v1/loads":
            loads = [
                {
                    "dp_rank": r,
                    "num_running_reqs": 3 + r,
                    "num_waiting_reqs": 1 + 2 * r,
                    "num_total_reqs": 4 + 3 * r,
                    "num_used_tokens": 10,
                    "max_total_num_tokens": 1000,
                    "token_usage": 0.25 + r / 10,
                    "gen_throughput": 80.0 + r,
                    "cache_hit_rate": 0.5,
                }
                for r in range(self.dp_size)
            ]
            return 200, json.dumps({"dp_rank_count": self.dp_size, "loads": loads}).encode()
        return super().control(path)


async def _scrape(r: Router) -> dict[str, list[tuple[dict, float]]]:
    text = (await call(r.server.metrics.port, get("/metrics"))).body.decode()
    out: dict[str, list[tuple[dict, float]]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def test_engine_gauges_per_rank_from_the_load_polls() -> None:
    async def body() -> None:
        w = await LoadedWorker(dp_size=2).start()
        async with Router(worker_urls=[w.url], dp_aware=True, load_monitor_interval=0.1) as r:
            await until(lambda: r.server.monitor.engine.rows.get(w.url), 10, "a load poll")
            m = await _scrape(r)
            got = {(lab["worker"], lab["model"], lab["dp_rank"]): v for lab, v in m["smg_engine_running_requests"]}
            assert got == {(w.url, "fake-model", "0"): 3.0, (w.url, "fake-model", "1"): 4.0}
            waiting = {lab["dp_rank"]: v for lab, v in m["smg_engine_waiting_requests"]}
            assert waiting == {"0": 1.0, "1": 3.0}
            assert {lab["dp_rank"]: v for lab, v in m["smg_engine_token_usage"]} == {"0": 0.25, "1": 0.35}
            assert {lab["dp_rank"]: v for lab, v in m["smg_engine_gen_throughput"]} == {"0": 80.0, "1": 81.0}
            assert {lab["dp_rank"]: v for lab, v in m["smg_engine_cache_hit_rate"]} == {"0": 0.5, "1": 0.5}
            polls = {(lab["worker"], lab["mode"]): v for lab, v in m["smg_engine_load_polls_total"]}
            assert polls[(w.url, "v1_loads")] >= 1

    run(body())


def test_engine_gauges_from_the_legacy_get_load() -> None:
    async def body() -> None:
        w = await LoadedWorker(legacy=True, dp_size=2).start()
        async with Router(worker_urls=[w.url], load_monitor_interval=0.1) as r:
            await until(lambda: r.server.monitor.engine.rows.get(w.url), 10, "a load poll")
            m = await _scrape(r)
            assert {lab["dp_rank"]: v for lab, v in m["smg_engine_running_requests"]} == {"0": 3.0, "1": 4.0}
            assert {lab["dp_rank"]: v for lab, v in m["smg_engine_waiting_requests"]} == {"0": 2.0, "1": 2.0}
            assert "smg_engine_token_usage" not in m  # /get_load has no such field

    run(body())


def test_worker_requests_and_breaker_streak_per_worker() -> None:
    async def body() -> None:
        w = await DataWorker(dp_size=2).start()
        async with Router(worker_urls=[w.url], dp_aware=True, retry_max_retries=1, policy="round_robin") as r:
            for _ in range(4):
                assert (await call(r.port, post("/generate", {"text": "x"}))).status == 200
            w.status = 500
            for _ in range(2):
                assert (await call(r.port, post("/generate", {"text": "x"}))).status == 500
            m = await _scrape(r)
            sent = {(lab["worker"], lab["model"]): v for lab, v in m["smg_worker_requests_total"]}
            assert sent == {(w.url + "@0", "fake-model"): 3.0, (w.url + "@1", "fake-model"): 3.0}
            streak = {lab["worker"]: v for lab, v in m["smg_worker_cb_consecutive_failures"]}
            assert streak == {w.url + "@0": 1.0, w.url + "@1": 1.0}

    run(body())


def test_http_series_carry_the_path_and_count_models_and_workers() -> None:
    async def body() -> None:
        w = await DataWorker().start()
        async with Router(worker_urls=[w.url]) as r:
            assert (await call(r.port, post("/generate", {"text": "x"}))).status == 200
            assert (await call(r.port, get("/v1/models"))).status == 200
            assert (await call(r.port, get("/workers"))).status == 200
            wid = (await call(r.port, get("/workers"))).json["workers"][0]["id"]
            assert (await call(r.port, get(f"/workers/{wid}"))).status == 200
            assert (await call(r.port, get("/nope"))).status == 404
            m = await _scrape(r)
            req = {(lab["method"], lab["path"]): v for lab, v in m["smg_http_requests_total"]}
            assert req[("GET", "/v1/models")] == 1 and req[("GET", "/workers")] == 2
            assert req[("GET", "/workers/{worker_id}")] == 1 and req[("GET", "other")] == 1
            resp = {(lab["path"], lab["status_code"], lab["error_code"]): v for lab, v in m["smg_http_responses_total"]}
            assert resp[("/generate", "200", "")] == 1
            assert resp[("/v1/models", "200", "")] == 1
            assert resp[("/workers/{worker_id}", "200", "")] == 1
            assert resp[("other", "404", "unknown_url")] == 1

    run(body())


def test_manual_key_table_size() -> None:
    async def body() -> None:
        w1, w2 = DataWorker(), DataWorker()
        await w1.start()
        await w2.start()
        async with Router(worker_urls=[w1.url, w2.url], policy="manual") as r:
            for key in ("a", "b", "c", "a"):
                raw = (
                    f"POST /generate HTTP/1.1\r\nHost: x\r\nX-SMG-Routing-Key: {key}\r\n"
                    "Content-Type: application/json\r\nContent-Length: 12\r\n\r\n"
                    '{"text":"x"}'
                ).encode()
                assert (await call(r.port, raw)).status == 200
            m = await _scrape(r)
            assert m["smg_manual_policy_cache_entries"] == [({}, 3.0)]

    run(body())


def test_docs_parity_table_is_the_generators_output() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "fastroute.control.parity"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert out == parity.markdown()
    assert out in (REPO / "docs" / "metrics.md").read_text(), "regenerate with: python -m fastroute.control.parity"
    names = [f.name for f in parity.FAMILIES]
    assert len(names) == len(set(names))
    for f in parity.FAMILIES:
        assert f.status in (parity.EXPORTED, parity.NOT_EXPORTED)
        assert f.status == parity.EXPORTED or f.why, f.name  # every gap says why


def test_breaker_series_of_a_removed_worker_go_with_it() -> None:
    """smg_worker_cb_outcomes_total has a series per worker that answered; once the worker is
    removed its series are gone from the scrape (and from the process's counters)."""

    async def body() -> None:
        a, b = await DataWorker().start(), await DataWorker().start()
        try:
            async with Router(worker_urls=[a.url, b.url], policy="round_robin") as r:
                for _ in range(4):
                    assert (await call(r.port, post("/generate", {"text": "x"}))).status == 200
                m = await _scrape(r)
                workers = {lab["worker"] for lab, _ in m["smg_worker_cb_outcomes_total"]}
                assert workers == {a.url, b.url}, workers
                wb = r.server.registry.find(b.url)
                res = await call(r.port, f"DELETE /workers/{wb.id} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                assert res.status == 202, res.body
                await until(lambda: r.server.registry.find(b.url) is None, 5, "b removed")
                m = await _scrape(r)
                workers = {lab["worker"] for lab, _ in m.get("smg_worker_cb_outcomes_total", [])}
                assert workers == {a.url}, workers
                # a later change of the worker set drops the removed worker's counters too
                c = await DataWorker().start()
                assert (await call(r.port, post("/workers", {"url": c.url}))).status == 202
                await until(lambda: len(r.server.registry.ready_workers()) == 2, 5, "c ready")
                assert all(k[0] != b.url for k in r.server.app.stats.cb_outcomes), r.server.app.stats.cb_outcomes
                await c.stop()
        finally:
            await a.stop()
            await b.stop()

    run(body())


def test_a_removed_workers_load_polls_are_forgotten() -> None:
    """The monitor's per-worker poll counters and engine rows (smg_engine_*) of a removed
    worker are dropped, not only hidden: 10,000 workers that came and went leave none."""

    async def body() -> None:
        a, b = await LoadedWorker(dp_size=2).start(), await LoadedWorker(dp_size=2).start()
        try:
            async with Router(worker_urls=[a.url, b.url], dp_aware=True, load_monitor_interval=0.1) as r:
                mon = r.server.monitor
                await until(lambda: a.url in mon.engine.rows and b.url in mon.engine.rows, 10, "both polled")
                wb = r.server.registry.find(b.url)
                res = await call(r.port, f"DELETE /workers/{wb.id} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                assert res.status == 202, res.body
                await until(
                    lambda: b.url not in mon.engine.rows and all(k[0] != b.url for k in mon.polls),
                    10,
                    "b's polls forgotten",
                )
                assert a.url in mon.engine.rows
                await until(lambda: mon.polls.get((a.url, "v1_loads"), 0) >= 3, 10, "a still polled")
        finally:
            await a.stop()
            await b.stop()

    run(body())
