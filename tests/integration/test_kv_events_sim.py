"""The router against the simulated SGLang server publishing KV events and LoadStat (PD, DP 8):
a prefix cached by a request another router placed is found through the events."""

from __future__ import annotations

from fastroute.sim.engine import SimParams
from fastroute.sim.worker import start_cluster
from tests.integration.conftest import Router, call, post, run, until

BLOCK = 64


def _router(cluster, **kw) -> Router:
    p, d = cluster.prefills[0], cluster.decodes[0]
    return Router(
        pd_disaggregation=True,
        prefill=[(p.url, p.bootstrap_port)],
        decode=[d.url],
        dp_aware=True,
        policy="cache_aware",
        load_monitor_interval=3600.0,
        **kw,
    )


def _body(ids: list[int]) -> bytes:
    return post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}})


def test_a_prefix_another_router_placed_is_found_through_the_events() -> None:
    async def go() -> None:
        prefill = SimParams(
            dp_size=8,
            time_scale=0.01,
            prefix_cache_tokens=64 * BLOCK,
            prefix_block_tokens=BLOCK,
            kv_events_port_base=-1,
        )
        cluster = await start_cluster(1, 1, SimParams(dp_size=8, time_scale=0.01), prefill)
        pe = cluster.prefills[0].prefill
        try:
            prompt = [1000 + i for i in range(10 * BLOCK)]
            # Router A places the first request with its own tree (no events).
            async with _router(cluster, kv_events="off", seed=11) as a:
                resp = await call(
                    a.port, post("/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 2}})
                )
                assert resp.status == 200, resp.body
            held = [i for i, r in enumerate(pe.ranks) if len(r.cache)]
            assert len(held) == 1  # one request: one rank computed (and cached) it
            holder = held[0]
            # Router B starts afterwards; only the engine's events tell it where the prefix is.
            async with _router(cluster, seed=5) as b:
                idx = b.server.router.kv_index
                w = b.server.registry.find(cluster.prefills[0].url)
                await until(lambda: idx.blocks(w.targets[holder]) == 10, 10.0, "the replayed blocks indexed")
                await until(lambda: all(idx.state(t) == "fresh" for t in w.targets), 10.0, "every rank replayed")
                hits0 = pe.hit_tokens
                for k in range(4):
                    resp = await call(b.port, _body(prompt + [7, k]))
                    assert resp.status == 200, resp.body
                assert pe.hit_tokens - hits0 == 4 * 10 * BLOCK  # every follow-up found the prefix
                kv = b.server.kv_events
                await until(lambda: all(kv.pushed(t) for t in w.targets), 5.0, "pushed loads")
                assert idx.picks == 4
        finally:
            await cluster.stop()

    run(go(), timeout=60)


def test_a_server_that_publishes_without_advertising_is_reached_by_the_flag() -> None:
    from tests.integration.test_kv_events import _free_ports

    async def go() -> None:
        base = _free_ports(3 * 8)
        prefill = SimParams(
            dp_size=8,
            time_scale=0.01,
            prefix_cache_tokens=64 * BLOCK,
            prefix_block_tokens=BLOCK,
            kv_events_port_base=base,
            kv_events_replay_port_base=base + 8,
            load_publish_port_base=base + 16,
            kv_events_advertise=False,
        )
        cluster = await start_cluster(1, 1, SimParams(dp_size=8, time_scale=0.01), prefill)
        try:
            spec = f"tcp://*:{base},replay={base + 8},load={base + 16}"
            async with _router(cluster, seed=5) as plain:
                assert plain.server.kv_events.streams == {}  # nothing advertised, no flag
            async with _router(cluster, seed=5, kv_events_endpoint=spec, block_size=BLOCK) as r:
                idx = r.server.router.kv_index
                w = r.server.registry.find(cluster.prefills[0].url)
                await until(lambda: all(idx.state(t) == "fresh" for t in w.targets), 10.0, "subscribed by the flag")
                prompt = [5000 + i for i in range(6 * BLOCK)]
                for k in range(3):
                    resp = await call(r.port, _body(prompt + [k]))
                    assert resp.status == 200, resp.body
                assert idx.picks == 3 and max(idx.hit_counts[1:]) > 0  # later picks found the prefix
        finally:
            await cluster.stop()

    run(go(), timeout=60)
