"""The engine's KV events and pushed loads (``--kv-events``), over real ZMQ sockets.

``Engine`` below is a minimal SGLang 0.5.23 publisher written for the test from the wire
contract (protocol.md 13): per rank a PUB socket for KV event batches (``[topic, seq, msgpack
[ts, events, rank]]``), a ROUTER replay socket, and a PUB socket for LoadStat. A recording
fake worker advertises it in ``/server_info``; the router (in this loop) subscribes, and the
tests read where ``data_parallel_rank`` sent each request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from fastroute.core.kvindex import chain
from fastroute.core.table import COL_POLLED_RUNNING, COL_POLLED_UNCACHED
from tests.integration.conftest import DataWorker, Router, call, post, run, until

BS = 16  # tokens per block
DP = 8
_enc = msgspec.msgpack.Encoder()


def _free_ports(n: int) -> int:
    """A base port with ``n`` free ports after it (below 32768)."""
    import random
    import socket

    for _ in range(200):
        base = random.randrange(20000, 32000 - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port range")


def blocks(first: int, n: int) -> list[list[int]]:
    """``n`` blocks of BS token ids, distinct per ``first``."""
    return [[(first * 1000 + i) * 100 + k for k in range(BS)] for i in range(n)]


def stored(hashes: list[int], parent: int | None, token_blocks: list[list[int]]) -> dict[str, Any]:
    ev: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "token_ids": [t for b in token_blocks for t in b],
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
    }
    if parent is not None:
        ev["parent_block_hash"] = parent
    return ev


class Engine:
    """A minimal per-rank publisher (module docstring). ``publish(rank, events)`` sends one
    batch (``drop=True`` keeps it for replay but does not send it live)."""

    def __init__(self, dp: int = DP, replay: bool = True, loads: bool = True) -> None:
        self.dp = dp
        self.ctx = zmq.asyncio.Context()
        n = dp * (1 + replay + loads)
        base = _free_ports(n)
        self.kv_base = base
        self.replay_base = base + dp if replay else None
        self.load_base = base + dp * (1 + replay) if loads else None
        self.pubs = [self._bind(zmq.PUB, self.kv_base + r) for r in range(dp)]
        self.routers = [self._bind(zmq.ROUTER, self.replay_base + r) for r in range(dp)] if replay else []
        self.loads = [self._bind(zmq.PUB, self.load_base + r) for r in range(dp)] if loads else []
        self.seq = [0] * dp
        self.buffer: list[list[tuple[int, bytes]]] = [[] for _ in range(dp)]
        self._tasks = [asyncio.ensure_future(self._serve_replay(r)) for r in range(len(self.routers))]
        self.replay_requests = 0

    def _bind(self, kind: int, port: int) -> Any:
        s = self.ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.bind(f"tcp://127.0.0.1:{port}")
        return s

    def descriptor(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "publisher": "zmq",
            "endpoint_host": "*",
            "endpoint_port_base": self.kv_base,
            "topic": "",
            "block_size": BS,
            "dp_size": self.dp,
        }
        if self.replay_base is not None:
            d["replay_endpoint_port_base"] = self.replay_base
        if self.load_base is not None:
            d["load_endpoint_port_base"] = self.load_base
            d["load_topic"] = "load"
        return d

    async def publish(
        self, rank: int, events: list[dict[str, Any]], drop: bool = False, raw: bytes | None = None
    ) -> int:
        seq = self.seq[rank]
        self.seq[rank] += 1
        payload = raw if raw is not None else _enc.encode([time.time(), events, rank])
        self.buffer[rank].append((seq, payload))
        if not drop:
            await self.pubs[rank].send_multipart([b"", seq.to_bytes(8, "big"), payload])
        return seq

    async def load(self, rank: int, running: int, waiting: int, tokens: int, uncached: int) -> None:
        stat = ["LoadStat", running, waiting, tokens, 100_000, rank, uncached, tokens, 256, 0, 0]
        await self.loads[rank].send_multipart([b"load", (0).to_bytes(8, "big"), _enc.encode(stat)])

    async def _serve_replay(self, rank: int) -> None:
        sock = self.routers[rank]
        while True:
            ident, _, start = await sock.recv_multipart()
            self.replay_requests += 1
            first = int.from_bytes(start, "big")
            for seq, payload in list(self.buffer[rank]):
                if seq >= first:
                    await sock.send_multipart([ident, b"", b"", seq.to_bytes(8, "big"), payload])
            await sock.send_multipart([ident, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])

    def restart(self, rank: int) -> None:
        self.seq[rank] = 0
        self.buffer[rank] = []

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.ctx.destroy(linger=0)


class KvWorker(DataWorker):
    """A recording fake worker whose /server_info advertises ``engine``."""

    def __init__(self, engine: Engine | None, dp_size: int = DP) -> None:
        super().__init__(dp_size=dp_size)
        self.engine = engine

    def control(self, path: str) -> tuple[int, bytes] | None:
        got = super().control(path)
        if got is not None and path in ("/server_info", "/get_server_info") and self.engine is not None:
            info = json.loads(got[1])
            info["kv_events"] = self.engine.descriptor()
            return 200, json.dumps(info).encode()
        return got


def router(worker: DataWorker, **kw: Any) -> Router:
    kw.setdefault("kv_events_stale_secs", 30.0)
    return Router(
        worker_urls=[worker.url],
        dp_aware=True,
        policy="cache_aware",
        load_monitor_interval=3600.0,
        seed=3,
        **kw,
    )


@contextlib.asynccontextmanager
async def engine_and_router(dp: int = DP, replay: bool = True, loads: bool = True, **kw: Any) -> Any:
    """A publisher, a worker advertising it and a router subscribed to it; all stopped after."""
    e = Engine(dp, replay=replay, loads=loads)
    w = await KvWorker(e, dp_size=dp).start()
    try:
        async with router(w, **kw) as r:
            yield e, w, r
    finally:
        await w.stop()
        await e.close()


async def generate(r: Router, ids: list[int]) -> None:
    resp = await call(r.port, post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 4}}))
    assert resp.status == 200, resp.body


def last_rank(w: DataWorker) -> int:
    return w.inference()[-1].json["data_parallel_rank"]


def index_of(r: Router) -> Any:
    return r.server.router.kv_index


def rows(r: Router, w: DataWorker) -> list[int]:
    return r.server.registry.find(w.url).targets


async def subscribed(r: Router, w: DataWorker) -> None:
    idx = index_of(r)
    await until(lambda: all(idx.state(t) == "fresh" for t in rows(r, w)), 10.0, "every rank fresh")


def stream(r: Router, w: DataWorker, rank: int) -> Any:
    kv = r.server.kv_events
    return next(s for s in kv.streams.values() if s.worker == w.url and s.rank == rank)


async def store_chain(e: Engine, rank: int, tb: list[list[int]], base_hash: int) -> list[int]:
    hashes = [base_hash + i for i in range(len(tb))]
    await e.publish(rank, [stored(hashes, None, tb)])
    return hashes


def test_hit_goes_to_the_rank_that_stored_it_and_leaves_after_removal() -> None:
    async def go() -> None:
        async with engine_and_router() as (e, w, r):
            await subscribed(r, w)
            tb = blocks(1, 6)
            hashes = await store_chain(e, 5, tb, 500)
            prompt = [t for b in tb for t in b] + [7, 7, 7]
            idx = index_of(r)
            t5 = rows(r, w)[5]
            await until(lambda: idx.blocks(t5) == 6, 5.0, "6 blocks indexed on rank 5")
            for _ in range(3):
                await generate(r, prompt)
                assert last_rank(w) == 5
            # Evicted on rank 5, stored on rank 2: the hit moves with the cache.
            await e.publish(5, [{"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU"}])
            await store_chain(e, 2, tb, 900)
            t2 = rows(r, w)[2]
            await until(lambda: idx.blocks(t5) == 0 and idx.blocks(t2) == 6, 5.0, "moved to rank 2")
            for _ in range(3):
                await generate(r, prompt)
                assert last_rank(w) == 2
            assert idx.picks >= 6

    run(go())


def test_a_chained_store_extends_its_parent() -> None:
    async def go() -> None:
        async with engine_and_router(replay=False, loads=False) as (e, w, r):
            await until(lambda: len(r.server.kv_events.streams) == DP, 5.0, "subscribed")
            await asyncio.sleep(0.3)  # the SUB sockets connect (no replay to catch up)
            tb = blocks(2, 8)
            await e.publish(3, [stored([10, 11, 12], None, tb[:3])])
            await e.publish(3, [stored([13, 14, 15, 16, 17], 12, tb[3:])])
            t3 = rows(r, w)[3]
            idx = index_of(r)
            await until(lambda: idx.blocks(t3) == 8, 5.0, "8 chained blocks")
            ids = [t for b in tb for t in b]
            assert idx.hits(ids, [t3]) == [8]
            assert idx.hits(ids[: 5 * BS] + [0] * BS, [t3]) == [5]
            # A child whose parent was never seen is not indexed (an orphan).
            await e.publish(3, [stored([99], 12345, blocks(3, 1))])
            await until(lambda: idx.ranks[t3].orphans == 1, 5.0, "orphan counted")
            assert chain(ids, BS)[:8] == chain(ids, BS, 8)

    run(go())


def test_a_skipped_seq_is_recovered_through_the_replay_socket() -> None:
    async def go() -> None:
        async with engine_and_router() as (e, w, r):
            await subscribed(r, w)
            a, b, c = blocks(4, 1), blocks(5, 1), blocks(6, 1)
            await e.publish(6, [stored([1], None, a)])
            await e.publish(6, [stored([2], 1, b)], drop=True)  # never sent live
            await e.publish(6, [stored([3], 2, c)])
            t6 = rows(r, w)[6]
            idx = index_of(r)
            await until(lambda: idx.blocks(t6) == 3, 5.0, "the lost batch replayed")
            s = stream(r, w, 6)
            assert (s.gaps, s.replays, s.resyncs) == (1, 1, 0)
            assert idx.state(t6) == "fresh"
            await generate(r, a[0] + b[0] + c[0])
            assert last_rank(w) == 6

    run(go())


def test_a_gap_the_replay_cannot_fill_marks_the_rank_stale_and_placement_falls_back() -> None:
    async def go() -> None:
        async with engine_and_router() as (e, w, r):
            await subscribed(r, w)
            await e.publish(1, [stored([1], None, blocks(7, 1))])
            await e.publish(1, [stored([2], 1, blocks(8, 1))], drop=True)
            e.buffer[1] = [x for x in e.buffer[1] if x[0] != 1]  # gone from the replay buffer too
            await e.publish(1, [stored([3], None, blocks(9, 1))])
            s = stream(r, w, 1)
            idx = index_of(r)
            t1 = rows(r, w)[1]
            await until(lambda: s.resyncs == 1, 5.0, "resync counted")
            assert idx.state(t1) == "warming"
            before = idx.fallbacks["stale"]
            await generate(r, blocks(9, 1)[0])
            assert idx.fallbacks["stale"] == before + 1
            body = await metrics(r)
            assert f'fastroute_kv_rank_stale{{dp_rank="1",worker="{w.url}"}} 1.0' in body
            assert f'fastroute_kv_event_resyncs_total{{dp_rank="1",worker="{w.url}"}} 1.0' in body

    run(go())


async def metrics(r: Router) -> str:
    from fastroute.sim.http import HttpConnection

    conn = HttpConnection("127.0.0.1", r.server.metrics.port)
    try:
        status, _, body = await conn.request("GET", "/metrics", b"")
    finally:
        conn.close()
    assert status == 200
    return body.decode()


def test_a_restarted_or_silent_publisher_marks_the_rank_stale() -> None:
    async def go() -> None:
        async with engine_and_router(loads=False, kv_events_stale_secs=0.6) as (e, w, r):
            await subscribed(r, w)
            idx = index_of(r)
            t4, t0 = rows(r, w)[4], rows(r, w)[0]
            for i in range(3):
                await e.publish(4, [stored([i + 1], i or None, blocks(10 + i, 1))])
            await until(lambda: idx.blocks(t4) == 3, 5.0, "3 blocks")
            e.restart(4)
            await e.publish(4, [stored([1], None, blocks(20, 1))])
            await until(lambda: stream(r, w, 4).resyncs >= 1, 5.0, "restart seen")
            assert idx.blocks(t4) == 1  # cleared, then the new publisher's first block
            assert idx.state(t4) != "fresh"
            # Rank 0 publishes nothing and there is no load socket: silence makes it stale.
            await until(lambda: stream(r, w, 0).stale, 5.0, "silent rank stale")
            assert idx.state(t0) == "stale"

    run(go())


def test_a_malformed_batch_is_counted_and_skipped() -> None:
    async def go() -> None:
        async with engine_and_router() as (e, w, r):
            await subscribed(r, w)
            await e.publish(2, [], raw=b"\xc1 not msgpack")
            await e.publish(2, [{"type": "BlockStored", "block_hashes": "x"}, stored([5], None, blocks(30, 1))])
            await e.publish(2, [{"type": "SomethingNew", "x": 1}])
            await e.publish(2, [stored([6], 5, blocks(31, 1))])
            s = stream(r, w, 2)
            idx = index_of(r)
            await until(lambda: idx.blocks(rows(r, w)[2]) == 2, 5.0, "good events applied")
            assert s.malformed == 3 and s.gaps == 0 and s.resyncs == 0
            assert idx.state(rows(r, w)[2]) == "fresh"

    run(go())


def test_pushed_loads_fill_the_table_and_a_long_queue_loses_to_an_idle_miss() -> None:
    async def go() -> None:
        async with engine_and_router() as (e, w, r):
            await subscribed(r, w)
            tab = r.server.table.array
            trs = rows(r, w)
            tb = blocks(40, 4)  # 64 tokens cached on rank 3
            await store_chain(e, 3, tb, 300)
            for rank in range(DP):
                await e.load(rank, 0, 0, 0, 0)
            await until(lambda: index_of(r).blocks(trs[3]) == 4, 5.0, "indexed")
            await until(lambda: all(index_of(r).ranks[t].queue_tokens == 0 for t in trs), 5.0, "loads")
            prompt = [t for b in tb for t in b] + list(range(64))
            await generate(r, prompt)
            assert last_rank(w) == 3
            # Rank 3 now has 5,000 uncached tokens waiting: the 64-token hit saves less.
            await e.load(3, 1, 4, 1000, 5000)
            await until(lambda: tab[trs[3], COL_POLLED_RUNNING] == 1, 5.0, "pushed load")
            await until(lambda: index_of(r).ranks[trs[3]].queue_tokens == 5000, 5.0, "queue")
            await generate(r, prompt)
            assert last_rank(w) != 3
            # A regular worker's uncached tokens stay out of the table's prefill cell.
            assert tab[trs[3], COL_POLLED_UNCACHED] == -1
            assert r.server.monitor.pushed(trs[3])

    run(go())


def test_removed_and_resized_workers_drop_and_add_subscriptions() -> None:
    async def go() -> None:
        e = Engine(dp=4)
        w = await KvWorker(e, dp_size=4).start()
        e2 = Engine(dp=2)
        w2 = await KvWorker(e2, dp_size=2).start()
        try:
            async with router(w) as r:
                kv = r.server.kv_events
                await until(lambda: len(kv.streams) == 4, 5.0, "4 subscriptions")
                reg = r.server.registry
                reg.add_worker(w2.url, "regular")
                await until(lambda: len(kv.streams) == 6, 10.0, "the added worker's 2 ranks")
                reg.remove_worker(reg.find(w.url))
                await until(lambda: len(kv.streams) == 2, 5.0, "removed worker dropped")
                assert {s.worker for s in kv.streams.values()} == {w2.url}
                # w2 restarts with 4 ranks: re-read, resized, resubscribed.
                await e2.close()
                e3 = Engine(dp=4)
                w2.engine, w2.dp_size = e3, 4
                try:
                    reg.recheck_dp(reg.find(w2.url), "test")
                    await until(lambda: len(kv.streams) == 4, 10.0, "resized worker resubscribed")
                    assert {s.kv_endpoint for s in kv.streams.values()} == {
                        f"tcp://127.0.0.1:{e3.kv_base + i}" for i in range(4)
                    }
                finally:
                    await e3.close()
        finally:
            await w.stop()
            await w2.stop()
            await e.close()

    run(go(), timeout=60)


def test_replicas_without_redis_converge_on_the_engine_view() -> None:
    async def go() -> None:
        e = Engine()
        w = await KvWorker(e).start()
        try:
            async with router(w) as r1, router(w) as r2:
                await subscribed(r1, w)
                await subscribed(r2, w)
                prefixes = [blocks(50 + k, 3) for k in range(DP)]
                for rank, tb in enumerate(prefixes):
                    await store_chain(e, rank, tb, 1000 * (rank + 1))
                i1, i2 = index_of(r1), index_of(r2)
                await until(lambda: all(i1.blocks(t) == 3 for t in rows(r1, w)), 5.0, "replica 1 indexed")
                await until(lambda: all(i2.blocks(t) == 3 for t in rows(r2, w)), 5.0, "replica 2 indexed")
                # One request each alternately, same prefixes: both replicas send each to the
                # rank that holds it.
                for k, tb in enumerate(prefixes * 2):
                    rr = r1 if k % 2 == 0 else r2
                    await generate(rr, [t for b in tb for t in b] + [1, 2, 3])
                    assert last_rank(w) == k % DP
        finally:
            await w.stop()
            await e.close()

    run(go(), timeout=60)


def test_text_requests_and_kv_events_off_keep_the_tree() -> None:
    async def go() -> None:
        e = Engine()
        w = await KvWorker(e).start()
        try:
            async with router(w) as r:
                await subscribed(r, w)
                resp = await call(
                    r.port, post("/generate", {"text": "hello", "sampling_params": {"max_new_tokens": 2}})
                )
                assert resp.status == 200
                assert index_of(r).fallbacks["no_ids"] == 1
            async with router(w, kv_events="off") as r:
                assert index_of(r) is None and r.server.kv_events is None
        finally:
            await w.stop()
            await e.close()

    run(go())


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"kv_events": "sometimes"}, "--kv-events"),
        ({"kv_events_endpoint": "udp://x:1"}, "--kv-events-endpoint"),
        ({"kv_events_endpoint": "tcp://*:5557,replay=abc"}, "--kv-events-endpoint"),
        ({"kv_events": "off", "kv_events_endpoint": "tcp://*:5557"}, "--kv-events-endpoint"),
        ({"block_size": 0}, "--block-size"),
        ({"kv_events_stale_secs": 0}, "--kv-events-stale-secs"),
    ],
)
def test_bad_flags_are_refused_by_name(flags: dict[str, Any], message: str) -> None:
    from fastroute.config import Config, ConfigError

    with pytest.raises(ConfigError, match=message):
        Config(worker_urls=["http://127.0.0.1:1"], **flags)


def test_a_burst_is_applied_in_slices_without_holding_the_loop() -> None:
    async def go() -> None:
        async with engine_and_router(loads=False) as (e, w, r):
            await subscribed(r, w)
            idx = index_of(r)
            t7 = rows(r, w)[7]
            n = 20_000
            tb = [[i * 100 + k for k in range(BS)] for i in range(n)]
            seen_partial = 0

            async def ticker() -> None:
                nonlocal seen_partial
                while idx.blocks(t7) < n:
                    if idx.blocks(t7) > 0:
                        seen_partial += 1  # the loop ran while the burst was half applied
                    await asyncio.sleep(0)

            tick = asyncio.ensure_future(ticker())
            await e.publish(7, [stored(list(range(1, n + 1)), None, tb)])
            await until(lambda: idx.blocks(t7) == n, 20.0, "the burst applied")
            await tick
            assert seen_partial > 0
            ids = [t for b in tb[:100] for t in b]
            assert idx.hits(ids, [t7]) == [100]

    run(go(), timeout=60)


class _Lying(DataWorker):
    """A worker whose kv_events block names ports it must not send the router to."""

    def __init__(self, block: dict[str, Any]) -> None:
        super().__init__(dp_size=2)
        self.block = block

    def control(self, path: str) -> tuple[int, bytes] | None:
        got = super().control(path)
        if got is not None and path in ("/server_info", "/get_server_info"):
            info = json.loads(got[1])
            info["kv_events"] = dict(self.block, dp_size=2, block_size=BS, publisher="zmq", endpoint_host="*")
            return 200, json.dumps(info).encode()
        return got


def test_ports_that_are_the_router_or_overlap_are_never_dialed(caplog) -> None:
    async def go() -> None:
        lying = await _Lying({}).start()
        overlap = await _Lying({}).start()
        own = await _Lying({}).start()
        try:
            async with router(lying, prometheus_port=0) as r:
                kv = r.server.kv_events
                lying.block = {"endpoint_port_base": lying.port - 1}  # rank 1 = its HTTP port
                overlap.block = {"endpoint_port_base": 20000, "replay_endpoint_port_base": 20001}
                own.block = {"endpoint_port_base": r.port}  # the router's own listener
                reg = r.server.registry
                reg.remove_worker(reg.find(lying.url))
                for w in (lying, overlap, own):
                    reg.add_worker(w.url, "regular")
                await until(lambda: len(reg.ready_workers()) == 3, 10.0, "registered")
                kv.sync(reg.ready_workers())
                assert kv.streams == {}
        finally:
            for w in (lying, overlap, own):
                await w.stop()

    run(go())
    said = " ".join(rec.getMessage() for rec in caplog.records)
    assert "includes its own HTTP port" in said
    assert "port ranges overlap at 20001" in said
    assert "is this router's own listener" in said
