"""/metrics on a PD + dp-aware router: per-rank series read from the shared table agree with the
router's own counters while requests are held, and return to zero after release."""

from __future__ import annotations

from tests.integration.conftest import RawClient, Router, call, get, post, run, until, workers


def scrape(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def test_per_rank_series_follow_the_ledger() -> None:
    async def body() -> None:
        (p,) = await workers(1, role="prefill")
        (d,) = await workers(1, role="decode", dp_size=8)
        async with Router(
            pd_disaggregation=True,
            prefill=[(p.url, 8998)],
            decode=[d.url],
            dp_aware=True,
            policy="power_of_two",
            p2c_load_metric="least_requests",
            decode_input_demand="shadow",
            decode_request_weight=1_000_000,
            decode_kv_fit="shadow",
            load_monitor_interval=0.1,
        ) as r:
            reg = r.server.registry
            dec = reg.find(d.url)
            # wait for the first per-rank poll so least_requests and KV fit see known ranks
            await until(lambda: all(r.server.table.get(t, 5) >= 0 for t in dec.targets), what="first poll")
            d.hold()
            clients = []
            for _i in range(16):
                c = await RawClient(r.port).connect()
                c.send(post("/generate", {"text": "x" * 400, "sampling_params": {"max_new_tokens": 8}}))
                clients.append(c)
            await until(lambda: sum(r.rank_in_flight(d)) == 16, what="16 held")
            m = scrape((await call(r.server.metrics.port, get("/metrics"))).body.decode())
            for rank, _t in enumerate(dec.targets):
                name = f'target="{d.url}@{rank}"'
                assert m[f"fastroute_decode_demand_requests{{{name}}}"] == 2
                assert m[f"fastroute_decode_demand_tokens{{{name}}}"] == 200  # 400 bytes / 4
                assert m[f"fastroute_target_in_flight_requests{{{name}}}"] == 2
                assert m[f'smg_worker_requests_active{{worker="{d.url}@{rank}"}}'] == 2
                assert m[f"fastroute_target_kv_free_tokens{{{name}}}"] == 100_000 - 200
                assert f"fastroute_target_polled_running{{{name}}}" in m
            shadow = {k: v for k, v in m.items() if k.startswith("fastroute_decode_demand_shadow")}
            assert sum(shadow.values()) == 16
            kv = {k: v for k, v in m.items() if k.startswith("fastroute_decode_kv_fit_decisions_total")}
            assert kv['fastroute_decode_kv_fit_decisions_total{result="agree",role="decode"}'] == 16
            assert m["fastroute_lease_underflows_total"] == 0
            d.release()
            for c in clients:
                await c.response(timeout=5)
                c.close()
            await until(lambda: sum(r.rank_in_flight(d)) == 0, what="released")
            m = scrape((await call(r.server.metrics.port, get("/metrics"))).body.decode())
            assert all(v == 0 for k, v in m.items() if k.startswith("fastroute_decode_demand_requests"))
            assert m['fastroute_target_picks_total{role="decode",target="%s@0"}' % d.url] == 2
            assert (
                m[
                    'smg_worker_selection_total{connection_mode="http",model="fake-model",'
                    'policy="power_of_two",worker_type="decode"}'
                ]
                == 16
            )

    run(body())
