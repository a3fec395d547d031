"""Trace mode of the conversation workload: Mooncake-shaped rows (generated with the trace's
statistics, or read from a JSON lines copy) replayed as ``/generate`` with ``input_ids`` into a
simulated prefill whose per-rank cache publishes the blocks it stores."""

from __future__ import annotations

import asyncio
import json
import statistics

import msgspec
import pytest
import zmq
import zmq.asyncio

from fastroute.sim.conversations import (
    BLOCK_TOKENS,
    VOCAB,
    block_reuse,
    block_token_ids,
    mooncake_arrivals,
    mooncake_like_trace,
    read_mooncake_trace,
    working_set_tokens,
)
from fastroute.sim.engine import SimParams
from fastroute.sim.http import fetch
from fastroute.sim.loadgen import encode_request
from fastroute.sim.server import SimWorker
from tests.integration.conftest import run

END = (-1).to_bytes(8, "big", signed=True)


def test_generated_trace_has_the_mooncake_statistics():
    for seed in (0, 1):
        rows = mooncake_like_trace(3000, 3.0, seed=seed)
        assert 0.33 <= block_reuse(rows) <= 0.40  # Mooncake's conversation trace: 36.6%
        assert 10_500 <= statistics.mean(r["input_length"] for r in rows) <= 13_500
        assert 250 <= statistics.mean(r["output_length"] for r in rows) <= 450
        for r in rows[:200]:
            blocks = len(r["hash_ids"])
            assert (blocks - 1) * BLOCK_TOKENS < r["input_length"] <= blocks * BLOCK_TOKENS
        ts = [r["timestamp"] for r in rows]
        assert ts == sorted(ts) and 0.8 < 3000 / (ts[-1] / 1000) / 3.0 < 1.2


def test_token_ids_follow_the_hash_ids_and_files_read_back(tmp_path):
    a = block_token_ids((7, 8), 2 * BLOCK_TOKENS)
    b = block_token_ids((7, 9), 2 * BLOCK_TOKENS - 5)
    assert a[:BLOCK_TOKENS] == b[:BLOCK_TOKENS] and a[BLOCK_TOKENS:] != b[BLOCK_TOKENS:]
    assert len(b) == 2 * BLOCK_TOKENS - 5 and all(0 <= t < VOCAB for t in a)
    assert block_token_ids((8,), BLOCK_TOKENS) == a[BLOCK_TOKENS:]  # a block's ids depend on its id only
    rows = mooncake_like_trace(50, 2.0, seed=3)
    distinct = {h for r in rows for h in r["hash_ids"]}
    assert working_set_tokens(rows) == BLOCK_TOKENS * len(distinct)
    path = tmp_path / "conversation_trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert read_mooncake_trace(str(path)) == rows
    arr = mooncake_arrivals(rows, rate=4.0)
    assert len(arr) == 50 and arr[0].t == 0.0 and abs(49 / arr[-1].t - 4.0) < 1e-6
    assert arr[3].hash_ids == tuple(rows[3]["hash_ids"]) and arr[3].item.output_tokens == rows[3]["output_length"]
    req = arr[3].request()
    assert req.input_ids == block_token_ids(rows[3]["hash_ids"], rows[3]["input_length"])
    (tmp_path / "bad.jsonl").write_text('{"timestamp": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1: not a Mooncake trace row"):
        read_mooncake_trace(str(tmp_path / "bad.jsonl"))


def test_trace_requests_hit_the_rank_cache_and_publish_their_token_ids():
    # Two rows of one conversation: the second extends the first's blocks.
    rows = [
        {"timestamp": 0, "input_length": 3 * BLOCK_TOKENS - 100, "output_length": 2, "hash_ids": [11, 12, 13]},
        {"timestamp": 10, "input_length": 5 * BLOCK_TOKENS, "output_length": 3, "hash_ids": [11, 12, 13, 14, 15]},
    ]
    arr = mooncake_arrivals(rows)

    async def body():
        p = SimParams(dp_size=1, prefix_cache_tokens=64 * BLOCK_TOKENS, kv_events_port_base=-1, time_scale=0.01)
        w = SimWorker("prefill", p)
        await w.start()
        ctx = zmq.asyncio.Context()
        try:
            for a in arr:
                status, _ = await fetch("127.0.0.1", w.port, "POST", "/generate", encode_request(a.request()))
                assert status == 200
            assert w.prefill is not None and w.prefill.hit_tokens == 2 * BLOCK_TOKENS
            assert w.kv_events is not None
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(f"tcp://127.0.0.1:{w.kv_events.kv_base + 1}")
            await d.send_multipart([b"", (1).to_bytes(8, "big")])
            stored = []
            while True:
                frames = await asyncio.wait_for(d.recv_multipart(), 5)
                if frames[2] == END:
                    break
                stored += msgspec.msgpack.decode(frames[3])[1]
            full = block_token_ids((11, 12, 13, 14, 15), 5 * BLOCK_TOKENS)
            assert [e["token_ids"] for e in stored] == [full[: 2 * BLOCK_TOKENS], full[2 * BLOCK_TOKENS :]]
            assert stored[1]["parent_block_hash"] == stored[0]["block_hashes"][-1]
        finally:
            ctx.destroy(linger=0)
            await w.stop()

    run(body())
