"""--policy manual over real sockets: 16 requests under 4 routing keys stick to one worker per
key, and new keys spread by min_load (each new key lands on a worker with nothing in flight)."""

from __future__ import annotations

import asyncio
import collections

from tests.integration.conftest import Router, call, post, run, until, workers


def test_routing_keys_stick_and_spread_by_min_load() -> None:
    async def body() -> None:
        ws = await workers(4)
        async with Router(
            worker_urls=[w.url for w in ws],
            policy="manual",
            assignment_mode="min_load",
            routing_key_headers=["x-session"],
        ) as r:
            for w in ws:
                w.hold()
            # First request of each key while all are held: min_load sends each new key to a
            # worker with nothing in flight, so the 4 keys land on 4 different workers.
            first = []
            for k in range(4):
                first.append(
                    asyncio.ensure_future(
                        call(r.port, post("/generate", {"text": f"k{k}"}, {"X-SMG-Routing-Key": f"key-{k}"}))
                    )
                )
                await until(lambda: sum(w.held for w in ws) == k + 1, what=f"key {k} held")
            assert sorted(w.held for w in ws) == [1, 1, 1, 1]
            for w in ws:
                w.release()
            assert [(await f).status for f in first] == [200] * 4
            # 12 more: 3 per key, in mixed order; every one goes to its key's worker.
            for i in range(12):
                res = await call(
                    r.port, post("/generate", {"text": f"k{i % 4}"}, {"X-SMG-Routing-Key": f"key-{i % 4}"})
                )
                assert res.status == 200
            where = collections.defaultdict(set)
            for w in ws:
                for rec in w.inference():
                    where[rec.json["text"]].add(w.port)
            assert {k: len(v) for k, v in where.items()} == {f"k{k}": 1 for k in range(4)}
            assert len({next(iter(v)) for v in where.values()}) == 4
            assert [len(w.inference()) for w in ws] == [4, 4, 4, 4]
            # the configured header is a routing key too (after X-SMG-Routing-Key)
            res = await call(r.port, post("/generate", {"text": "s"}, {"X-Session": "key-0"}))
            assert res.status == 200
            assert any(rec.json["text"] == "s" for w in ws for rec in w.inference() if w.port in where["k0"])
            await until(lambda: all(r.in_flight(w) == 0 for w in ws), what="released")

    run(body())


def test_key_of_a_removed_worker_is_reassigned() -> None:
    async def body() -> None:
        ws = await workers(2)
        async with Router(worker_urls=[w.url for w in ws], policy="manual") as r:
            hdr = {"X-SMG-Routing-Key": "rollout-1"}
            assert (await call(r.port, post("/generate", {"text": "a"}, hdr))).status == 200
            (owner,) = [w for w in ws if w.inference()]
            other = ws[1] if owner is ws[0] else ws[0]
            res = await call(
                r.port, f"POST /remove_worker?url={owner.url} HTTP/1.1\r\nHost: r\r\nContent-Length: 0\r\n\r\n".encode()
            )
            assert res.status < 300, res.body
            await until(lambda: r.server.registry.find(owner.url) is None, what="removed")
            for _ in range(3):
                assert (await call(r.port, post("/generate", {"text": "b"}, hdr))).status == 200
            assert len(other.inference()) == 3 and len(owner.inference()) == 1

    run(body())
