"""cache_aware's load index in a running router (issue #52): a PD router with --dp-aware over a
DP-64 decode server (64 rank targets: the tree's index and, with --decode-kv-fit on and every
rank fitting, the skipped filter) keeps the decode leg's ranks even while requests are held, and
gives every booking back."""

from __future__ import annotations

from tests.integration.conftest import RawClient, Router, post, run, until, workers


def test_a_dp64_decode_leg_spreads_held_requests_evenly_through_the_index() -> None:
    async def body() -> None:
        (p,) = await workers(1, role="prefill")
        (d,) = await workers(1, role="decode", dp_size=64)
        async with Router(
            pd_disaggregation=True,
            prefill=[(p.url, 8998)],
            decode=[d.url],
            dp_aware=True,
            policy="cache_aware",
            decode_kv_fit="on",
            load_monitor_interval=0.1,
        ) as r:
            dec = r.server.registry.find(d.url)
            assert len(dec.targets) == 64
            await until(lambda: all(r.server.table.get(t, 5) >= 0 for t in dec.targets), what="first poll")
            d.hold()
            clients = []
            for i in range(128):
                c = await RawClient(r.port).connect()
                text = f"conversation {i % 4}: " + "y" * (40 + i)
                c.send(post("/generate", {"text": text, "sampling_params": {"max_new_tokens": 8}}))
                clients.append(c)
            await until(lambda: sum(r.rank_in_flight(d)) == 128, what="128 held")
            # The decode leg inherits cache_aware with rank slack 0: only least-loaded ranks.
            assert r.rank_in_flight(d) == [2] * 64
            tree = r.server.registry._groups["decode"].policy_impl.tree_policy.tree
            assert tree.indexed and tree.index_fallbacks == 0  # the group's own list each pick
            d.release()
            for c in clients:
                resp = await c.response(timeout=10)
                assert resp.status == 200
                c.close()
            await until(lambda: sum(r.rank_in_flight(d)) == 0, what="released")
            assert r.server.table.underflows == 0

    run(body())
