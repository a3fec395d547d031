"""A load poll of a real simulated DP server reads its answer typed, without json.loads (issue 52:
a fleet's polls held the request loop decoding whole answers), and writes the same table rows."""

from __future__ import annotations

import json

import pytest
from fakeworker import Plane, make_config, run

import fastroute.control.monitor as monitor_mod
from fastroute.core.table import COL_POLLED_AT, COL_POLLED_MAX_RUNNING, COL_POLLED_MAX_TOKENS, COL_POLLED_RUNNING
from fastroute.sim.engine import SimParams
from fastroute.sim.server import SimWorker


def test_a_poll_of_a_well_formed_answer_does_not_json_decode_it(monkeypatch):
    calls = []
    real = json.loads

    def counting(*a, **kw):
        calls.append(a[0][:40] if a else None)
        return real(*a, **kw)

    async def body():
        sim = SimWorker("regular", SimParams(dp_size=4, time_scale=0.001), "127.0.0.1")
        await sim.start()
        try:
            async with Plane(make_config(dp_aware=True)) as p:
                w = await p.add(sim)
                monkeypatch.setattr(monitor_mod.json, "loads", counting)
                await p.monitor.poll_once()
                monkeypatch.setattr(monitor_mod.json, "loads", real)
                assert calls == []
                assert len(w.targets) == 4
                for t in w.targets:
                    assert p.table.get(t, COL_POLLED_AT) >= 0
                    assert p.table.get(t, COL_POLLED_RUNNING) == 0
                    assert p.table.get(t, COL_POLLED_MAX_TOKENS) == sim.p.max_total_num_tokens
                    assert p.table.get(t, COL_POLLED_MAX_RUNNING) == sim.p.max_running_requests
                # the engine gauges' rows are built when read, one per rank
                assert [rank for rank, _ in p.monitor.engine.rows[sim.url]] == ["0", "1", "2", "3"]
        finally:
            await sim.stop()

    run(body)


def test_repeated_polls_do_not_parse_the_workers_url_again(monkeypatch):
    import fastroute.control.httpclient as hc

    parsed = []
    real = hc.urlsplit

    def counting(url, *a, **kw):
        parsed.append(url)
        return real(url, *a, **kw)

    async def body():
        sim = SimWorker("regular", SimParams(dp_size=2, time_scale=0.001), "127.0.0.1")
        await sim.start()
        try:
            async with Plane(make_config(dp_aware=True)) as p:
                w = await p.add(sim)
                await p.monitor.poll_once()
                monkeypatch.setattr(hc, "urlsplit", counting)
                for _ in range(3):
                    await p.monitor.poll_once()
                    await p.monitor.check_once()
                assert parsed == []
                assert all(p.table.get(t, COL_POLLED_AT) >= 0 for t in w.targets)
                # a URL never asked before is still parsed (and a bad one still refused)
                status, _, _ = await hc.request("GET", sim.url + "/health?x=1", timeout=5)
                assert status == 200 and parsed == [sim.url + "/health?x=1"]
                for _ in range(2):
                    with pytest.raises(hc.HttpConnectError, match="unsupported URL scheme"):
                        await hc.request("GET", "ftp://127.0.0.1/x", timeout=5)
        finally:
            await sim.stop()

    run(body)
