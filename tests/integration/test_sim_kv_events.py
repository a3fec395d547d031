"""The simulated SGLang worker's KV events and pushed loads, over real ZMQ sockets.

The test side is plain pyzmq (SUB, DEALER) and ``msgspec.msgpack.decode`` into Python objects:
no class is shared with the publisher, so what is checked is the bytes on the wire (SGLang
0.5.23's: ``[topic, seq, msgpack [ts, events, rank]]``, tagged event maps, a replay ROUTER with
an end marker, ``[b"load", seq, ["LoadStat", ...11 fields]]``)."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from fastroute.sim.engine import SimParams
from fastroute.sim.http import fetch
from fastroute.sim.server import SimWorker
from tests.integration.conftest import run

H = "127.0.0.1"
BS = 4  # tokens per block in these tests
END = (-1).to_bytes(8, "big", signed=True)


def params(**kw) -> SimParams:
    base = dict(
        dp_size=4,
        prefix_block_tokens=BS,
        prefix_cache_tokens=4 * BS,
        kv_events_port_base=-1,
        time_scale=0.01,
        prefill_base_ms=1.0,
    )
    base.update(kw)
    return SimParams(**base)


async def get_json(port: int, path: str) -> dict:
    status, body = await fetch(H, port, "GET", path)
    assert status == 200
    return json.loads(body)


async def generate(port: int, ids: list[int], rank: int, max_new: int = 1) -> tuple[int, bytes]:
    body = {"input_ids": ids, "routed_dp_rank": rank, "sampling_params": {"max_new_tokens": max_new}}
    return await fetch(H, port, "POST", "/generate", json.dumps(body).encode())


async def sub(ctx: zmq.asyncio.Context, port: int, topic: bytes = b"") -> zmq.asyncio.Socket:
    """A SUB connected to ``port`` whose subscription the publisher has had time to see: the
    handshake is awaited on the socket monitor, then a short grace for the subscription frame."""
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SUBSCRIBE, topic)
    mon = s.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    s.connect(f"tcp://{H}:{port}")
    try:
        while True:
            ev = await asyncio.wait_for(recv_monitor_message(mon), 5)
            if ev["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                break
    finally:
        s.disable_monitor()
        mon.close(linger=0)
    await asyncio.sleep(0.2)
    return s


async def recv_batch(s: zmq.asyncio.Socket) -> tuple[bytes, int, list]:
    frames = await asyncio.wait_for(s.recv_multipart(), 5)
    assert len(frames) == 3 and len(frames[1]) == 8
    return frames[0], int.from_bytes(frames[1], "big"), msgspec.msgpack.decode(frames[2])


async def replay(ctx: zmq.asyncio.Context, port: int, start: int) -> list[tuple[int, list]]:
    """Ask a replay ROUTER for everything from ``start`` with a DEALER; up to the end marker."""
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(f"tcp://{H}:{port}")
    try:
        await d.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            frames = await asyncio.wait_for(d.recv_multipart(), 5)
            assert len(frames) == 4 and frames[0] == b""  # the DEALER sees [b"", topic, seq, payload]
            if frames[2] == END:
                assert frames[1] == b"" and frames[3] == b""
                return out
            assert len(frames[2]) == 8
            out.append((int.from_bytes(frames[2], "big"), msgspec.msgpack.decode(frames[3])))
    finally:
        d.close(linger=0)


def test_server_info_advertises_the_block_and_the_flags_switch_keys():
    async def body():
        w = SimWorker("prefill", params(kv_events_topic="kv"))
        await w.start()
        try:
            for path in ("/server_info", "/get_server_info"):
                kv = (await get_json(w.port, path))["kv_events"]
                hub = w.kv_events
                assert hub is not None
                assert kv == {
                    "publisher": "zmq",
                    "endpoint_host": "*",
                    "endpoint_port_base": hub.kv_base,
                    "topic": "kv",
                    "block_size": BS,
                    "dp_size": 4,
                    "replay_endpoint_port_base": hub.kv_base + 4,
                    "load_endpoint_port_base": hub.kv_base + 8,
                    "load_topic": "load",
                }
        finally:
            await w.stop()
        # No replay, no loads: their keys go; --no-kv-events-advertise: no block, still publishing.
        w = SimWorker("prefill", params(kv_events_replay_port_base=0, load_publish_port_base=0))
        await w.start()
        try:
            kv = (await get_json(w.port, "/server_info"))["kv_events"]
            assert "replay_endpoint_port_base" not in kv and "load_endpoint_port_base" not in kv
            assert "load_topic" not in kv
        finally:
            await w.stop()
        w = SimWorker("prefill", params(kv_events_advertise=False))
        await w.start()
        ctx = zmq.asyncio.Context()
        try:
            assert "kv_events" not in await get_json(w.port, "/server_info")
            assert w.kv_events is not None
            got = await replay(ctx, w.kv_events.kv_base + 4, 0)
            assert got and got[0][0] == 0 and got[0][1][1] == [{"type": "AllBlocksCleared"}]
        finally:
            ctx.destroy(linger=0)
            await w.stop()

    run(body())


def test_block_stored_on_the_computing_rank_chained_then_evicted_then_replayed():
    async def body():
        w = SimWorker("prefill", params())
        await w.start()
        ctx = zmq.asyncio.Context()
        try:
            assert w.kv_events is not None
            base = w.kv_events.kv_base
            s2 = await sub(ctx, base + 2)
            a = list(range(100, 110))  # 2 full blocks and 2 tokens that are not cached
            status, _ = await generate(w.port, a, 2)
            assert status == 200
            topic, seq, batch = await recv_batch(s2)
            assert topic == b"" and seq == 1  # seq 0 is the start-up AllBlocksCleared
            ts, events, rank = batch
            assert isinstance(ts, float) and rank == 2 and len(events) == 1
            ev = events[0]
            assert set(ev) == {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size"} | {
                "lora_id",
                "medium",
            }
            assert ev["type"] == "BlockStored" and ev["parent_block_hash"] is None and ev["lora_id"] is None
            assert ev["token_ids"] == a[:8] and ev["block_size"] == BS and ev["medium"] == "GPU"
            h1, h2 = ev["block_hashes"]
            assert all(-(2**63) <= h < 2**63 for h in (h1, h2)) and h1 != h2

            # The same prefix extended by two blocks: only the new blocks, chained to h2.
            b = a[:8] + list(range(200, 208))
            assert (await generate(w.port, b, 2))[0] == 200
            _, seq, (_, events, _) = await recv_batch(s2)
            assert seq == 2 and len(events) == 1
            assert events[0]["parent_block_hash"] == h2 and events[0]["token_ids"] == b[8:]
            h3, h4 = events[0]["block_hashes"]

            # The cache holds 4 blocks: 2 new ones evict the two deepest (leaves first).
            c = list(range(300, 308))
            assert (await generate(w.port, c, 2))[0] == 200
            _, seq, (_, events, _) = await recv_batch(s2)
            assert seq == 3 and [e["type"] for e in events] == ["BlockRemoved", "BlockStored"]
            assert events[0] == {"type": "BlockRemoved", "block_hashes": [h4, h3], "medium": "GPU"}
            assert events[1]["parent_block_hash"] is None and events[1]["token_ids"] == c

            # Replay from seq 1: the same three batches, then the end marker; other ranks only
            # have their start-up clear.
            got = await replay(ctx, base + 4 + 2, 1)
            assert [g[0] for g in got] == [1, 2, 3]
            assert got[2][1][1] == events
            for r in (0, 1, 3):
                assert [(q, e) for q, (_, e, _) in await replay(ctx, base + 4 + r, 0)] == [
                    (0, [{"type": "AllBlocksCleared"}])
                ]
            assert await replay(ctx, base + 4 + 2, 99) == []
            # A malformed request is skipped; the socket keeps serving the same client.
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(f"tcp://{H}:{base + 6}")
            await d.send_multipart([b"x", b"y", b"z"])
            await d.send_multipart([b"", (3).to_bytes(8, "big")])
            frames = await asyncio.wait_for(d.recv_multipart(), 5)
            assert frames[2] == (3).to_bytes(8, "big")
            assert (await asyncio.wait_for(d.recv_multipart(), 5))[2] == END
            d.close(linger=0)
            assert w.kv_events.bad_replay_requests == 1
        finally:
            ctx.destroy(linger=0)
            await w.stop()

    run(body())


def test_flush_cache_clears_every_rank_and_refuses_while_busy():
    async def body():
        w = SimWorker("prefill", params(dp_size=2, time_scale=1.0, prefill_base_ms=400.0))
        await w.start()
        ctx = zmq.asyncio.Context()
        try:
            assert w.kv_events is not None
            base = w.kv_events.kv_base
            subs = [await sub(ctx, base + r) for r in range(2)]
            ids = list(range(8))
            task = asyncio.ensure_future(generate(w.port, ids, 1))
            _, seq, (_, events, _) = await recv_batch(subs[1])  # stored when its compute starts
            assert events[0]["type"] == "BlockStored"
            status, text = await fetch(H, w.port, "POST", "/flush_cache")
            assert status == 400 and text == b"Flush cache failed.\n"
            assert (await task)[0] == 200
            status, _ = await fetch(H, w.port, "POST", "/flush_cache")
            assert status == 200
            for r in range(2):
                _, seq, (_, events, rank) = await recv_batch(subs[r])
                assert events == [{"type": "AllBlocksCleared"}] and rank == r
            # The flushed cache stores the prompt again from the root.
            assert (await generate(w.port, ids, 1))[0] == 200
            _, seq, (_, events, _) = await recv_batch(subs[1])
            assert events[0]["parent_block_hash"] is None and events[0]["token_ids"] == ids
        finally:
            ctx.destroy(linger=0)
            await w.stop()

    run(body())


def test_restart_publishes_from_seq_zero_with_all_blocks_cleared():
    async def body():
        w = SimWorker("prefill", params(dp_size=1))
        await w.start()
        ctx = zmq.asyncio.Context()
        try:
            assert w.kv_events is not None
            base = w.kv_events.kv_base
            assert (await generate(w.port, list(range(8)), 0))[0] == 200
            assert [q for q, _ in await replay(ctx, base + 1, 0)] == [0, 1]
            await w.stop()
            w.p.kv_events_port_base = base  # the same ports again
            await w.start()
            got = await replay(ctx, base + 1, 0)
            assert got == [(0, got[0][1])] and got[0][1][1] == [{"type": "AllBlocksCleared"}]
            # The cache restarted empty: the same prompt is stored again from the root.
            assert (await generate(w.port, list(range(8)), 0))[0] == 200
            got = await replay(ctx, base + 1, 1)
            assert got[0][1][1][0]["parent_block_hash"] is None
        finally:
            ctx.destroy(linger=0)
            await w.stop()

    run(body())


def test_loadstat_per_rank_shape_and_a_queued_request():
    async def body():
        w = SimWorker("prefill", params(dp_size=2, time_scale=1.0, prefill_base_ms=400.0, max_running_requests=7))
        await w.start()
        ctx = zmq.asyncio.Context()
        try:
            assert w.kv_events is not None and w.kv_events.load_base is not None
            lb = w.kv_events.load_base
            subs = [await sub(ctx, lb + r, b"load") for r in range(2)]
            for r in range(2):  # the heartbeat reaches a subscriber that missed the start
                topic, _, stat = await recv_batch(subs[r])
                assert topic == b"load" and len(stat) == 11 and stat[0] == "LoadStat"
                assert stat[1:6] == [0, 0, 0, w.p.max_total_num_tokens, r] and stat[8] == 7
            ids = list(range(10))
            first = asyncio.ensure_future(generate(w.port, ids, 1))
            await asyncio.sleep(0.05)
            second = asyncio.ensure_future(generate(w.port, ids, 1))  # queued behind the first
            want = None
            while want is None:
                _, _, stat = await recv_batch(subs[1])
                if stat[1] == 1 and stat[2] == 1:
                    want = stat
            # Running 10 tokens, queued 10 of which 8 are cached by the first: 2 uncached.
            assert want[3] == 10 and want[6] == 2 and want[7] == 20
            assert (await first)[0] == 200 and (await second)[0] == 200
            while True:
                _, _, stat = await recv_batch(subs[1])
                if stat[1] == 0 and stat[2] == 0 and stat[9] == 12:
                    break  # 10 + 2 tokens computed in all
            assert stat[10] > 0 and stat[6] == 0
        finally:
            ctx.destroy(linger=0)
            await w.stop()

    run(body())


def test_regular_server_publishes_its_ranks_cache_and_decode_loads():
    async def body():
        w = SimWorker("regular", params(dp_size=2, max_new_tokens=2))
        await w.start()
        ctx = zmq.asyncio.Context()
        try:
            assert w.kv_events is not None and w.kv_events.load_base is not None
            base = w.kv_events.kv_base
            assert (await generate(w.port, list(range(9)), 1))[0] == 200
            got = await replay(ctx, base + 2 + 1, 1)
            assert got[0][1][1][0]["token_ids"] == list(range(8)) and got[0][1][2] == 1
            s = await sub(ctx, w.kv_events.load_base, b"load")
            _, _, stat = await recv_batch(s)
            assert stat[0] == "LoadStat" and stat[5] == 0 and len(stat) == 11
        finally:
            ctx.destroy(linger=0)
            await w.stop()

    run(body())


def test_text_requests_publish_nothing_and_bad_ids_are_refused():
    async def body():
        w = SimWorker("prefill", params(dp_size=1))
        await w.start()
        ctx = zmq.asyncio.Context()
        try:
            assert w.kv_events is not None
            body = json.dumps({"text": "x" * 64, "sampling_params": {"max_new_tokens": 1}}).encode()
            assert (await fetch(H, w.port, "POST", "/generate", body))[0] == 200
            assert len(w.caches[0]) == 4  # cached, without events (no token ids to publish)
            assert [q for q, _ in await replay(ctx, w.kv_events.kv_base + 1, 0)] == [0]
            bad = json.dumps({"input_ids": [1, "a", 3, 4]}).encode()
            status, doc = await fetch(H, w.port, "POST", "/generate", bad)
            assert status == 400 and "input_ids must be integers" in json.loads(doc)["message"]
            assert w.prefill is not None and w.prefill.load_stat(0)[:2] == (0, 0)
        finally:
            ctx.destroy(linger=0)
            await w.stop()

    run(body())


def test_bad_port_flags_refuse_to_start():
    with pytest.raises(ValueError, match="--kv-events-port-base on a prefill server needs --prefix-cache-tokens"):
        SimWorker("prefill", params(prefix_cache_tokens=0))

    async def body():
        w = SimWorker("prefill", params(kv_events_port_base=21000, kv_events_replay_port_base=21002))
        with pytest.raises(ValueError, match="--kv-events-replay-port-base: ports \\[21002, 21006\\) overlap"):
            await w.start()

    run(body())


def test_worker_cli_flags_publish_and_refuse():
    """``python -m fastroute.sim.worker`` with the KV event flags: it prints and advertises its
    ports, a SUB on them gets the flagged topic; a prefill without a cache refuses to start."""
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind((H, 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "fastroute.sim.worker", "--role", "prefill", "--port", str(port)]
    bad = subprocess.run(cmd + ["--kv-events-port-base", "-1"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--kv-events-port-base on a prefill server needs --prefix-cache-tokens" in bad.stderr
    flags = ["--dp-size", "2", "--prefix-cache-tokens", "64", "--prefix-block-tokens", "4", "--time-scale", "0.01"]
    flags += ["--kv-events-port-base", "-1", "--load-publish-port-base", "0", "--kv-events-topic", "kv"]
    proc = subprocess.Popen(cmd + flags, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "kv_events_port_base=" in line and "load_port_base=0" in line, line

        async def body():
            kv = (await get_json(port, "/server_info"))["kv_events"]
            assert kv["topic"] == "kv" and kv["dp_size"] == 2 and "load_endpoint_port_base" not in kv
            assert f"kv_events_port_base={kv['endpoint_port_base']}" in line
            ctx = zmq.asyncio.Context()
            try:
                s1 = await sub(ctx, kv["endpoint_port_base"] + 1, b"kv")
                assert (await generate(port, list(range(4)), 1))[0] == 200
                topic, seq, (_, events, rank) = await recv_batch(s1)
                assert topic == b"kv" and seq == 1 and rank == 1 and events[0]["token_ids"] == [0, 1, 2, 3]
            finally:
                ctx.destroy(linger=0)

        run(body())
    finally:
        proc.terminate()
        proc.wait(10)


def test_dropped_batch_leaves_a_gap_that_replay_fills():
    async def body():
        w = SimWorker("prefill", params(dp_size=2))
        await w.start()
        ctx = zmq.asyncio.Context()
        try:
            assert w.kv_events is not None
            base = w.kv_events.kv_base
            s1 = await sub(ctx, base + 1)
            status, doc = await fetch(H, w.port, "POST", "/sim/kv_events/drop?rank=1&n=1")
            assert status == 200 and json.loads(doc) == {"rank": 1, "drop": 1}
            assert (await fetch(H, w.port, "POST", "/sim/kv_events/drop?rank=9"))[0] == 400
            assert (await generate(w.port, list(range(4)), 1))[0] == 200  # seq 1: not sent
            assert (await generate(w.port, list(range(10, 14)), 1))[0] == 200  # seq 2: sent
            _, seq, (_, events, _) = await recv_batch(s1)
            assert seq == 2 and events[0]["token_ids"] == [10, 11, 12, 13]
            got = await replay(ctx, base + 2 + 1, 1)
            assert [q for q, _ in got] == [1, 2] and got[0][1][1][0]["token_ids"] == [0, 1, 2, 3]
        finally:
            ctx.destroy(linger=0)
            await w.stop()

    run(body())
