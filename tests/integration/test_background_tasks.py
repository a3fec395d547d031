"""Background tasks under hostile input (issue 24): the health checker, the load monitor and
the replica sync keep running, count what they skipped or what failed, say when their view is
stale and come back. Real routers over loopback, fake workers, a real redis-server."""
from __future__ import annotations

import json
import logging

from fastroute.control import monitor as monitor_mod
from fastroute.control.monitor import Monitor
from fastroute.core.table import COL_POLLED_AT
from tests.integration.conftest import Router, call, get, run, until, workers


def metric(r: Router, line_start: str) -> float | None:
    for line in r.server.metrics.render().decode().splitlines():
        if line.startswith(line_start + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def errors_logged(caplog, task: str) -> list[str]:
    return [x.getMessage() for x in caplog.records
            if x.levelno >= logging.ERROR and task in x.getMessage()]


def test_health_checker_and_load_monitor_survive_crashing_ticks(caplog, monkeypatch):
    crashes = {"health": 0, "load": 0}
    real_check, real_parse = Monitor.check_once, monitor_mod.parse_v1_loads

    async def check_once(self):
        if crashes["health"] < 3:
            crashes["health"] += 1
            raise RuntimeError("health bug")
        await real_check(self)

    def parse(doc):
        if crashes["load"] < 3:
            crashes["load"] += 1
            raise TypeError("load bug")
        return real_parse(doc)
    monkeypatch.setattr(Monitor, "check_once", check_once)
    monkeypatch.setattr(monitor_mod, "parse_v1_loads", parse)

    async def body():
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url], disable_health_check=False,
                          health_check_interval_secs=1, load_monitor_interval=0.1) as r:
            bg = r.server.registry.background
            await until(lambda: crashes["load"] == 3 and bg.tasks["load monitor"].up, 10,
                        "the load monitor back")
            await until(lambda: crashes["health"] >= 1, 10, "a health crash")
            if crashes["health"] < 3:
                doc = json.loads((await call(r.port, get("/readiness"))).body)
                assert "health checks" in doc["stale"]
            await until(lambda: crashes["health"] == 3 and bg.tasks["health checks"].up, 10,
                        "the health checker back")
            for task in ("health checks", "load monitor"):
                assert metric(r, f'fastroute_background_errors_total{{task="{task}"}}') == 3
                assert metric(r, f'fastroute_background_task_up{{task="{task}"}}') == 1
                assert len(errors_logged(caplog, task)) == 1
            t = r.server.registry.find(w.url).targets[0]
            await until(lambda: r.server.table.get(t, COL_POLLED_AT) >= 0, 5, "loads polled again")
            assert "stale" not in json.loads((await call(r.port, get("/readiness"))).body)
        await w.stop()
    with caplog.at_level(logging.INFO, logger="fastroute"):
        run(body(), 60)
