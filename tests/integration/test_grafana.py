"""deploy/grafana/fastroute.json against a running router: the JSON parses as a Grafana dashboard,
and every expression names a metric family the router exports (scraped from /metrics while the
simulated PD cluster serves traffic), grouped only by labels that family has. Also smg's
smg_engine_pd_* gauges from the include=disagg load polls."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from fastroute.sim.engine import SimParams
from fastroute.sim.worker import start_cluster
from tests.integration.conftest import DataWorker, Router, call, get, post, run, until

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "fastroute.json"
_METRIC = re.compile(r"\b((?:smg|fastroute)_[a-zA-Z0-9_]+)")
_BY = re.compile(r"\bby\s*\(([^)]*)\)")
# Labels a query may group by although no series carries them (Prometheus and Grafana add them).
_ANY = {"le", "job", "instance"}


async def _families(r: Router) -> dict[str, tuple[str, set[str]]]:
    """Sample name as written in an expression -> (family, its labels)."""
    text = (await call(r.server.metrics.port, get("/metrics"))).body.decode()
    out: dict[str, tuple[str, set[str]]] = {}
    for fam in text_string_to_metric_families(text):
        labels = {k for s in fam.samples for k in s.labels}
        names = {
            "counter": [fam.name + "_total"],
            "histogram": [fam.name + "_bucket", fam.name + "_sum", fam.name + "_count"],
        }.get(fam.type, [fam.name])
        for n in names:
            out[n] = (fam.name, labels)
    return out


def _exprs(dash: dict) -> list[tuple[str, str]]:
    """(panel title, expression) of every query, rows' nested panels and variables included."""
    out = []
    panels = list(dash["panels"])
    while panels:
        p = panels.pop()
        panels.extend(p.get("panels", []))
        for t in p.get("targets", []):
            out.append((p["title"], t["expr"]))
    for v in dash["templating"]["list"]:
        if v.get("type") == "query":
            out.append(("variable " + v["name"], v["definition"]))
    return out


def test_every_expression_names_a_family_the_router_exports() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["uid"] and dash["title"] and dash["schemaVersion"] >= 30
    exprs = _exprs(dash)
    assert len(exprs) >= 20

    async def go() -> None:
        cluster = await start_cluster(1, 1, SimParams(dp_size=2, time_scale=0.01))
        p, d = cluster.prefills[0], cluster.decodes[0]
        try:
            async with Router(
                pd_disaggregation=True,
                prefill=[(p.url, p.bootstrap_port)],
                decode=[d.url],
                dp_aware=True,
                policy="cache_aware",
                load_monitor_interval=0.2,
            ) as r:
                for i in range(4):
                    body = {"text": "hi %d" % i, "sampling_params": {"max_new_tokens": 3}, "stream": i % 2 == 0}
                    assert (await call(r.port, post("/generate", body))).status == 200
                await until(lambda: len(r.server.monitor.engine.rows) == 2, 10.0, "both workers polled")
                fams = await _families(r)
        finally:
            await cluster.stop()
        used = set()
        for title, expr in exprs:
            names = _METRIC.findall(expr)
            assert names, (title, expr)
            for name in names:
                assert name in fams, f"{title}: {name} is not exported (in {expr})"
                used.add(fams[name][0])
            if not all(fams[n][1] for n in names):
                continue  # no series yet (no lease reclaimed, no error): its labels are not shown
            labels = set().union(*(fams[n][1] for n in names)) | _ANY
            for group in _BY.findall(expr):
                wanted = {x.strip() for x in group.split(",") if x.strip()}
                assert wanted <= labels, f"{title}: groups by {sorted(wanted - labels)}, which {names} lack"
        # What the issue asks the dashboard to show is there.
        for family in (
            "fastroute_target_in_flight_requests",
            "smg_pd_ttft_seconds",
            "fastroute_pick_reasons",
            "fastroute_background_task_up",
            "smg_engine_pd_decode_queue_reqs",
        ):
            assert family in used, family

    run(go(), 60.0)


class DisaggWorker(DataWorker):
    """Reports per-rank loads with a disaggregation section of known values."""

    def control(self, path: str):
        if path == "/v1/loads":
            loads = [
                {
                    "dp_rank": r,
                    "num_running_reqs": 1,
                    "num_waiting_reqs": 0,
                    "disaggregation": {
                        "mode": "decode",
                        "prefill_prealloc_queue_reqs": 2 + r,
                        "prefill_inflight_queue_reqs": 3,
                        "decode_prealloc_queue_reqs": 4,
                        "decode_transfer_queue_reqs": 1 + r,
                        "decode_retracted_queue_reqs": 9,
                        "kv_transfer_speed_gb_s": 1.5,
                        "kv_transfer_latency_ms": 7.0 + r,
                    },
                }
                for r in range(self.dp_size)
            ]
            return 200, json.dumps({"dp_rank_count": self.dp_size, "loads": loads}).encode()
        return super().control(path)


def test_the_pd_engine_gauges_come_from_the_disagg_section() -> None:
    async def go() -> None:
        w = await DisaggWorker(dp_size=2).start()
        async with Router(worker_urls=[w.url], dp_aware=True, load_monitor_interval=0.1) as r:
            await until(lambda: r.server.monitor.engine.rows.get(w.url), 10, "a load poll")
            text = (await call(r.server.metrics.port, get("/metrics"))).body.decode()
        got: dict[str, dict[str, float]] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name.startswith("smg_engine_pd_"):
                    assert (s.labels["worker"], s.labels["role"]) == (w.url, "regular")
                    got.setdefault(s.name, {})[s.labels["dp_rank"]] = s.value
        assert got == {
            "smg_engine_pd_prefill_queue_reqs": {"0": 5.0, "1": 6.0},
            "smg_engine_pd_decode_queue_reqs": {"0": 5.0, "1": 6.0},
            "smg_engine_pd_kv_transfer_speed_gb_s": {"0": 1.5, "1": 1.5},
            "smg_engine_pd_kv_transfer_latency_ms": {"0": 7.0, "1": 8.0},
        }

    run(go(), 30.0)
