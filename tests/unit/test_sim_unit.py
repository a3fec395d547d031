"""Simulator pieces without sockets: request parsing, the decode engine's step model, KV
prealloc and abort, retraction, the KV transfer stage, the slow rank, /v1/loads queue shapes,
room rendezvous, trace/encoding, SSE counting and balance statistics."""

from __future__ import annotations

import argparse
import asyncio
import json
import math

import pytest

from fastroute.sim.api import estimate_text_tokens, parse_inference
from fastroute.sim.balance import (
    balance_stats,
    fastroute_cells,
    kv_markdown_table,
    kv_tight_cells,
    markdown_table,
    parse_kv_fit_metrics,
)
from fastroute.sim.engine import BadRequest, DecodeEngine, DecodeReq, Rendezvous, SimParams
from fastroute.sim.loadgen import ReqRecord, TraceItem, _SSECounter, encode_request, load_trace, synthetic_trace
from fastroute.sim.server import LOAD_SECTIONS, SimWorker
from fastroute.sim.worker import add_param_flags, params_from_args


def run(coro, timeout: float = 20.0):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


P = SimParams()


# -- parsing ----------------------------------------------------------------------------------


def test_parse_generate_ids_text_and_rank_fields() -> None:
    g = parse_inference(
        "/generate",
        json.dumps(
            {
                "input_ids": [1] * 37,
                "sampling_params": {"max_new_tokens": 9},
                "routed_dp_rank": 5,
                "data_parallel_rank": 2,
                "bootstrap_room": 7,
                "bootstrap_port": 8998,
                "bootstrap_host": "h",
                "stream": True,
            }
        ).encode(),
        P,
    )
    assert (g.input_tokens, g.max_new, g.rank, g.room, g.bootstrap_port, g.stream) == (37, 9, 5, 7, 8998, True)
    g = parse_inference("/generate", b'{"text": "abcdefghi", "data_parallel_rank": 3}', P)
    assert g.input_tokens == 3 and g.rank == 3 and g.max_new == P.max_new_tokens and g.room is None


def test_parse_openai_paths() -> None:
    g = parse_inference("/v1/completions", b'{"prompt": [1,2,3,4], "max_tokens": 4}', P)
    assert (g.kind, g.input_tokens, g.max_new) == ("completions", 4, 4)
    g = parse_inference(
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "abcdefgh"}], "max_completion_tokens": 2,'
        b' "stream": true, "stream_options": {"include_usage": true}}',
        P,
    )
    assert (g.kind, g.input_tokens, g.max_new, g.include_usage) == ("chat", 4 + 2, 2, True)


@pytest.mark.parametrize(
    "body",
    [
        b"[1]",
        b"{bad",
        b'{"input_ids": [1], "routed_dp_rank": "1"}',
        b'{"text": "x", "sampling_params": {"max_new_tokens": 0}}',
        b"{}",
        b'{"input_ids": [[1], 2]}',
        b'{"text": "x", "bootstrap_room": 1.5}',
        b'{"text": ["a", "b"], "bootstrap_room": [1]}',
    ],
)
def test_parse_rejects_malformed(body: bytes) -> None:
    with pytest.raises(BadRequest):
        parse_inference("/generate", body, P)


def test_text_estimate_agrees_with_router_estimator() -> None:
    body = pytest.importorskip("fastroute.dataplane.body")
    for text in ["", "a", "abcd", "abcde", "héllo wörld", "日本語のテキスト" * 3, "x" * 4001]:
        assert estimate_text_tokens(text) == (body.estimate_tokens(text) if text else 0)


def test_encoded_requests_weigh_the_same_for_router_and_sim() -> None:
    body = pytest.importorskip("fastroute.dataplane.body")
    for item in [
        TraceItem(1, 5),
        TraceItem(31_000, 200),
        TraceItem(300_000, 100),
        TraceItem(3, 7, text="héllo"),
        TraceItem(3, 7, input_ids=[4, 5, 6]),
    ]:
        for fmt in ("text", "ids"):
            raw = encode_request(item, fmt)
            meta = body.parse_request("/generate", raw)
            g = parse_inference("/generate", raw, P)
            assert meta.input_tokens == g.input_tokens
            assert meta.stream and g.max_new == item.output_tokens
            if item.text is None and item.input_ids is None:
                assert g.input_tokens == item.input_tokens


# -- decode engine ----------------------------------------------------------------------------


def _req(eng: DecodeEngine, rank: int, n_in: int, n_out: int, tokens: list | None = None) -> DecodeReq:
    loop = asyncio.get_running_loop()
    emit = (lambda r: tokens.append((r.rid, r.generated))) if tokens is not None else None
    r = DecodeReq(f"r{rank}-{n_in}-{id(object())}", rank, n_in, n_out, emit, loop.create_future())
    eng.submit(r)
    eng.kv_arrived(r)
    return r


def test_step_time_is_set_by_the_busiest_rank() -> None:
    async def scenario(per_rank: list[int], n_in: int) -> float:
        p = SimParams(dp_size=8, time_scale=0.001, sample_interval_s=0.0)
        eng = DecodeEngine(p)
        eng.start()
        reqs = [_req(eng, rank, n_in, 3) for rank, n in enumerate(per_rank) for _ in range(n)]
        await asyncio.gather(*(r.done for r in reqs))
        await eng.stop()
        # First step of the batch: every request present with its input as context.
        return max(s[1] for s in eng.samples)

    p = SimParams()
    spread = run(scenario([1] * 8, 30_000))
    hot = run(scenario([8] + [0] * 7, 30_000))
    assert spread == pytest.approx(p.step_base_ms + p.step_request_ms * 1 + p.step_mtoken_ms * 30_001 / 1e6, abs=0.01)
    assert hot == pytest.approx(p.step_base_ms + p.step_request_ms * 8 + p.step_mtoken_ms * 8 * 30_000 / 1e6, abs=0.05)
    # The seed-000 calibration: 6 -> ~40 ms, 8 -> ~44 ms, 9 -> ~46-48 ms at ~30k context each.
    six, eight, nine = (p.step_base_ms + p.step_seconds(n, n * 30_000) for n in (6, 8, 9))
    assert 39 <= six <= 42 and 43 <= eight <= 46 and 45 <= nine <= 49
    # Context alone moves it too: 0.5M more tokens cost one more request.
    assert p.step_seconds(1, 500_000) == pytest.approx(p.step_seconds(2, 0))


def test_kv_prealloc_queues_until_the_rank_has_room_and_abort_frees() -> None:
    async def scenario() -> None:
        p = SimParams(dp_size=2, max_total_num_tokens=1_000, time_scale=0.001)
        eng = DecodeEngine(p)
        eng.start()
        first = _req(eng, 0, 600, 50)
        second = _req(eng, 0, 600, 50)  # does not fit next to the first: waits in prealloc
        assert first.state in ("ready", "running") and second.state == "prealloc"
        assert eng.rank_loads()[0][1] >= 1  # reported as waiting
        third = _req(eng, 1, 600, 50)  # the other rank is free
        assert third.state != "prealloc"
        await first.done
        for _ in range(100):
            if second.state in ("ready", "running"):
                break
            await asyncio.sleep(0.001)
        assert second.state in ("ready", "running")
        eng.abort(second)
        eng.abort(second)  # idempotent
        assert second.state == "done"
        await third.done
        assert eng.rank_loads() == [(0, 0, 0), (0, 0, 0)]
        assert all(r.used == 0 and r.held == 0 and r.ctx == 0 for r in eng.ranks)
        assert eng.completed == 2 and eng.aborted == 1
        await eng.stop()

    run(scenario())


def test_one_token_per_step_and_rank_round_robin() -> None:
    async def scenario() -> None:
        eng = DecodeEngine(SimParams(dp_size=3, time_scale=0.001))
        assert [eng.pick_rank(None) for _ in range(5)] == [0, 1, 2, 0, 1]
        assert eng.pick_rank(2) == 2
        with pytest.raises(BadRequest):
            eng.pick_rank(3)
        eng.start()
        toks: list = []
        r = _req(eng, 0, 10, 4, toks)
        await r.done
        assert [n for _, n in toks] == [1, 2, 3, 4] and eng.tokens_out == 4
        await eng.stop()

    run(scenario())


def test_request_larger_than_a_rank_is_rejected() -> None:
    async def scenario() -> None:
        eng = DecodeEngine(SimParams(dp_size=1, max_total_num_tokens=100))
        with pytest.raises(BadRequest):
            _req(eng, 0, 95, 10)

    run(scenario())


# -- rendezvous -------------------------------------------------------------------------------


def test_rendezvous_orders_and_timeout() -> None:
    async def scenario() -> None:
        b = Rendezvous()
        b.mark_ready(1)  # prefill first
        assert await b.wait(1, 1.0) is True
        assert not b.is_ready(1)  # consumed
        w = asyncio.ensure_future(b.wait(2, 5.0))  # decode first
        await asyncio.sleep(0)
        assert not w.done()
        b.mark_ready(2)
        assert await w is True
        assert await b.wait(3, 0.01) is False  # never ready
        assert b.pending() == 0

    run(scenario())


def test_rendezvous_forgets_unclaimed_rooms_after_ttl() -> None:
    b = Rendezvous(ttl_s=0.0)
    b.mark_ready(10)
    b.mark_ready(11)  # prunes everything older than the TTL
    assert not b.is_ready(10)


# -- loadgen pieces ---------------------------------------------------------------------------


def test_synthetic_trace_is_seeded_and_input_heavy() -> None:
    a, b, c = synthetic_trace(2000, seed=1), synthetic_trace(2000, seed=1), synthetic_trace(2000, seed=2)
    assert a == b and a != c
    mean_in = sum(t.input_tokens for t in a) / len(a)
    mean_out = sum(t.output_tokens for t in a) / len(a)
    assert 20_000 <= mean_in <= 40_000
    assert min(t.output_tokens for t in a) >= 100 and max(t.output_tokens for t in a) <= 500
    assert 180 <= mean_out <= 320
    assert max(t.input_tokens for t in a) > 4 * mean_in  # heavy tail


def test_load_trace_jsonl(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    path.write_text(
        '{"input_tokens": 100, "output_tokens": 7}\n\n{"text": "abcdefgh", "output_tokens": 3}\n'
        '{"input_ids": [1,2,3]}\n'
    )
    items = load_trace(str(path))
    assert [(i.input_tokens, i.output_tokens) for i in items] == [(100, 7), (2, 3), (3, 256)]
    path.write_text('{"output_tokens": 3}\n')
    with pytest.raises(ValueError):
        load_trace(str(path))


def test_sse_counter_handles_split_events() -> None:
    clock = iter(range(100))
    rec = ReqRecord(0.0, 1)
    c = _SSECounter(rec, lambda: float(next(clock)))
    stream = b'data: {"a":1}\n\ndata: {"a":2}\n\n: keep-alive\n\ndata: {"a":3}\n\ndata: [DONE]\n\n'
    for i in range(0, len(stream), 7):
        c.feed(stream[i : i + 7])
    assert rec.n_tokens == 3 and c.done and not c.error
    rec2 = ReqRecord(0.0, 1)
    c2 = _SSECounter(rec2, lambda: 1.0)
    c2.feed(b'data: {"error": {"message": "boom"}}\n\ndata: [DONE]\n\n')
    assert "boom" in c2.error and rec2.n_tokens == 0


# -- balance statistics -----------------------------------------------------------------------


def test_balance_stats_of_known_samples() -> None:
    even = (0.0, 40.0, (4, 4, 4, 4), (5, 5, 5, 5), (100, 100, 100, 100))
    skew = (0.1, 50.0, (8, 0, 4, 4), (10, 0, 5, 5), (300, 100, 0, 0))
    idle = (0.2, 0.0, (0, 0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0))
    s = balance_stats([even, skew, idle])
    assert s["samples"] == 2  # idle samples are left out
    cv_skew = math.sqrt(((10 - 5) ** 2 + 25 + 0 + 0) / 4) / 5
    assert s["outstanding_cv"] == pytest.approx(cv_skew / 2)
    assert s["busiest_batch"] == pytest.approx(6.0)
    assert s["kv_busiest_over_mean"] == pytest.approx((1.0 + 3.0) / 2)
    assert s["step_ms"] == pytest.approx(45.0)
    assert balance_stats([idle]) == {"samples": 0}


def test_matrix_and_table_shape() -> None:
    labels = [c.label for c in fastroute_cells()]
    assert labels == [
        "round_robin",
        "p2c tokens",
        "p2c requests",
        "p2c least_requests",
        "cache_aware",
        "demand W=0",
        "demand W=1e+06",
    ]
    assert len(fastroute_cells(sweep=True)) == 5 + 5
    load = {
        k: 1.0
        for k in (
            "ttft_p50_ms",
            "ttft_p90_ms",
            "tpot_p50_ms",
            "tpot_p90_ms",
            "interactivity_p50",
            "interactivity_p90",
            "output_tok_s",
        )
    }
    load.update(completed=3, errors=0)
    res = [
        {
            "label": "round_robin",
            "concurrency": 64,
            "load": load,
            "balance": {
                "outstanding_cv": 0.2,
                "running_cv": 0.1,
                "busiest_batch": 9.0,
                "kv_busiest_over_mean": 1.4,
                "step_ms": 44.0,
            },
        },
        {"label": "p2c requests", "concurrency": 192, "load": load, "balance": {"samples": 0}},
    ]
    md = markdown_table(res, 0.25)
    assert "### concurrency 64" in md and "### concurrency 192" in md
    row = [ln for ln in md.splitlines() if ln.startswith("| round_robin")][0]
    assert row.count("|") == 13 and "0.20" in row and "9.0" in row


def test_parse_batches_per_protocol_3_3() -> None:
    g = parse_inference(
        "/generate",
        json.dumps(
            {
                "input_ids": [[1, 2], [3, 4, 5]],
                "bootstrap_host": ["h", "h"],
                "bootstrap_port": [7, 7],
                "bootstrap_room": [10, 20],
                "routed_dp_rank": [1, 0],
                "sampling_params": [{"max_new_tokens": 3}, {"max_new_tokens": 4}],
            }
        ).encode(),
        P,
    )
    assert g.batch == 2 and g.input_tokens == 5
    assert [(i.index, i.input_tokens, i.room, i.rank, i.max_new, i.bootstrap_port) for i in g.items] == [
        (0, 2, 10, 1, 3, 7),
        (1, 3, 20, 0, 4, 7),
    ]
    g = parse_inference("/generate", b'{"text": ["abcd", "abcdefgh", "x"], "bootstrap_room": 5}', P)
    assert [(i.input_tokens, i.room) for i in g.items] == [(1, 5), (2, 6), (1, 7)]  # scalar room expands
    g = parse_inference("/v1/completions", b'{"prompt": ["abcd", "abcd"], "bootstrap_room": [1, 2]}', P)
    assert g.batch == 2 and [i.room for i in g.items] == [1, 2]
    g = parse_inference("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "abcd"}], "n": 3}', P)
    assert g.batch == 3 and all(i.input_tokens == 5 for i in g.items)
    g = parse_inference("/generate", b'{"input_ids": [1, 2, 3]}', P)
    assert g.batch is None and g.items == [g]


def test_scale_summary_converts_to_simulated_time() -> None:
    from fastroute.sim.loadgen import scale_summary

    s = {
        "ttft_p50_ms": 10.0,
        "ttft_p90_ms": 20.0,
        "tpot_p50_ms": 5.0,
        "tpot_p90_ms": 6.0,
        "itl_p50_ms": 5.0,
        "itl_p90_ms": 7.0,
        "output_tok_s": 400.0,
        "requests_per_s": 2.0,
        "interactivity_p50": 200.0,
        "interactivity_p90": 160.0,
        "completed": 3,
    }
    out = scale_summary(s, 0.25)
    assert out["tpot_p50_ms"] == 20.0 and out["ttft_p90_ms"] == 80.0 and out["output_tok_s"] == 100.0
    assert out["interactivity_p50"] == 50.0 and out["completed"] == 3 and s["tpot_p50_ms"] == 5.0


# -- KV model: retraction, transfer stage, slow rank, /v1/loads shapes -------------------------


async def _until(pred, timeout: float = 5.0, what: str = "condition") -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not pred():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.001)


def test_without_retract_the_whole_output_is_reserved_and_nothing_is_retracted() -> None:
    async def scenario() -> None:
        eng = DecodeEngine(SimParams(dp_size=1, max_total_num_tokens=1_000, time_scale=0.0005))
        eng.start()
        a = _req(eng, 0, 450, 100)
        b = _req(eng, 0, 450, 100)  # 450 + 100 does not fit next to a's 550: waits in prealloc
        assert b.state == "prealloc" and eng.rank_queues(0) == (1, 0, 1, 0)
        assert eng.ranks[0].used == 450 and eng.ranks[0].held == 100  # allocated vs held back
        await asyncio.gather(a.done, b.done)
        assert eng.retractions == 0 and eng.completed == 2
        await eng.stop()

    run(scenario())


def test_retract_overcommits_then_retracts_the_newest_and_resumes_it() -> None:
    async def scenario() -> None:
        p = SimParams(dp_size=1, max_total_num_tokens=1_000, time_scale=0.0005, retract=True, reserved_decode_tokens=10)
        eng = DecodeEngine(p)
        eng.start()
        toks: list = []
        a = _req(eng, 0, 450, 100, toks)
        b = _req(eng, 0, 451, 100, toks)  # only 10 output tokens held back each: both admitted
        assert a.state != "prealloc" and b.state != "prealloc"
        await _until(lambda: b.state == "retracted", what="b retracted when the pool runs out")
        rk = eng.ranks[0]
        assert eng.rank_queues(0)[3] == 1 and rk.used + len(rk.running) <= p.max_total_num_tokens
        assert rk.used == 450 + a.generated  # b's KV (input + generated) was freed
        kept = b.generated
        await asyncio.gather(a.done, b.done)
        assert eng.retractions >= 1 and a.generated == b.generated == 100 and kept > 0
        # b resumed where it stopped: every token index once, in order
        assert [n for rid, n in toks if rid == b.rid] == list(range(1, 101))
        assert rk.used == rk.held == rk.ctx == 0
        await eng.stop()

    run(scenario())


def test_abort_of_a_retracted_request_frees_the_queue() -> None:
    async def scenario() -> None:
        p = SimParams(dp_size=1, max_total_num_tokens=1_000, time_scale=0.0005, retract=True, reserved_decode_tokens=0)
        eng = DecodeEngine(p)
        eng.start()
        a = _req(eng, 0, 480, 200)
        b = _req(eng, 0, 480, 200)
        await _until(lambda: b.state == "retracted", what="b retracted")
        eng.abort(b)
        assert b.state == "done" and eng.rank_queues(0) == (0, 0, 0, 0)
        await a.done
        assert eng.ranks[0].used == 0 and eng.aborted == 1
        await eng.stop()

    run(scenario())


def test_kv_transfer_channel_is_fifo_per_server_or_per_rank() -> None:
    async def scenario(scope: str) -> list:
        # 1000 tokens/s: a 200-token input takes 0.2 s of the channel.
        p = SimParams(dp_size=2, time_scale=1.0, kv_transfer_tokens_per_s=1_000, kv_transfer_scope=scope)
        eng = DecodeEngine(p)
        eng.start()
        reqs = [_req(eng, r, 200, 2) for r in (0, 1, 0)]
        assert all(r.state == "transfer" for r in reqs)  # KV allocated, waiting for the transfer
        assert eng.rank_queues(0)[1] == 2 and eng.rank_loads()[0][2] == 400
        ends = [r.xfer.when() for r in reqs]
        for r in reqs:
            eng.abort(r)
        assert all(r.xfer is None for r in reqs) and eng.rank_loads() == [(0, 0, 0), (0, 0, 0)]
        await eng.stop()
        return ends

    ends = run(scenario("server"))
    assert ends[1] - ends[0] == pytest.approx(0.2) and ends[2] - ends[1] == pytest.approx(0.2)
    ends = run(scenario("rank"))
    assert ends[0] == pytest.approx(ends[1]) and ends[2] - ends[0] == pytest.approx(0.2)


def test_transfer_then_batch_end_to_end() -> None:
    async def scenario() -> None:
        eng = DecodeEngine(SimParams(dp_size=2, time_scale=0.001, kv_transfer_tokens_per_s=1_000))
        eng.start()
        reqs = [_req(eng, r % 2, 100, 3) for r in range(4)]
        await asyncio.gather(*(r.done for r in reqs))
        assert eng.completed == 4 and all(r.xfer is None for r in reqs)
        await eng.stop()

    run(scenario())


def test_slow_rank_multiplies_its_share_of_the_step() -> None:
    async def first_step(slow_rank: int) -> float:
        p = SimParams(dp_size=2, time_scale=0.001, sample_interval_s=0.0, slow_rank=slow_rank, slow_factor=3.0)
        eng = DecodeEngine(p)
        eng.start()
        reqs = [_req(eng, 0, 1_000_000, 2), _req(eng, 1, 0 + 1, 2)]
        await asyncio.gather(*(r.done for r in reqs))
        await eng.stop()
        return max(s[1] for s in eng.samples)

    p = SimParams()
    big = p.step_request_ms + p.step_mtoken_ms * 1.0  # rank 0's share (1M context)
    small = p.step_request_ms + p.step_mtoken_ms * 1e-6
    assert run(first_step(-1)) == pytest.approx(p.step_base_ms + big, abs=0.01)
    assert run(first_step(0)) == pytest.approx(p.step_base_ms + 3 * big, abs=0.01)
    # a slow rank with a light batch can still be the one that paces the step
    assert run(first_step(1)) == pytest.approx(p.step_base_ms + max(big, 3 * small), abs=0.01)


def test_v1_loads_reports_the_queues_in_sglang_shapes() -> None:
    async def scenario() -> dict:
        p = SimParams(dp_size=2, max_total_num_tokens=1_000, kv_transfer_tokens_per_s=10.0)
        w = SimWorker("decode", p)  # not started: the engine is driven directly
        eng = w.decode
        loop = asyncio.get_running_loop()
        eng._loop_ref = loop
        reqs = []
        for n_in in (400, 300, 400):  # 400+128 and 300+128 fit; the next 400+128 waits
            r = DecodeReq(f"r{n_in}", 0, n_in, 128, None, loop.create_future())
            eng.submit(r)
            reqs.append(r)
        eng.kv_arrived(reqs[0])  # transferring; reqs[1] still waits for its room
        doc = w.loads_json(set(LOAD_SECTIONS), None)
        for r in reqs:
            eng.abort(r)
        return doc

    doc = run(scenario())
    e0, e1 = doc["loads"]
    assert e0["num_running_reqs"] == 0 and e0["num_waiting_reqs"] == 3 and e0["num_total_reqs"] == 3
    assert e0["num_used_tokens"] == 700 and e0["max_total_num_tokens"] == 1_000
    d = e0["disaggregation"]
    assert d["mode"] == "decode" and d["decode_prealloc_queue_reqs"] == 1
    assert d["decode_transfer_queue_reqs"] == 2 and d["decode_retracted_queue_reqs"] == 0
    assert e0["queues"]["retracted"] == 0
    assert e1["num_waiting_reqs"] == 0 and e1["disaggregation"]["decode_prealloc_queue_reqs"] == 0
    assert doc["aggregate"]["total_waiting_reqs"] == 3 and doc["aggregate"]["total_used_tokens"] == 700


def test_worker_cli_flags_for_the_kv_model() -> None:
    ap = argparse.ArgumentParser()
    add_param_flags(ap)
    p = params_from_args(
        ap.parse_args(
            [
                "--retract",
                "--slow-rank",
                "3",
                "--slow-factor",
                "1.5",
                "--kv-transfer-tokens-per-s",
                "2e6",
                "--kv-transfer-scope",
                "rank",
            ]
        )
    )
    assert p.retract is True and p.slow_rank == 3 and p.slow_factor == 1.5
    assert p.kv_transfer_tokens_per_s == 2e6 and p.kv_transfer_scope == "rank"
    assert params_from_args(ap.parse_args([])).retract is False
    with pytest.raises(SystemExit):
        ap.parse_args(["--kv-transfer-scope", "rack"])


# -- KV-tight benchmark pieces ----------------------------------------------------------------


def test_balance_stats_prealloc_per_rank() -> None:
    a = (0.0, 40.0, (4, 4), (5, 5), (100, 100), (0, 3))
    b = (0.1, 40.0, (4, 4), (5, 5), (100, 100), (2, 1))
    assert balance_stats([a, b])["prealloc_per_rank"] == [1.0, 2.0]
    assert balance_stats([a[:5], b[:5]])["prealloc_per_rank"] == []  # older 5-field samples


def test_kv_fit_counters_are_parsed_from_router_metrics() -> None:
    text = (
        "# HELP fastroute_decode_kv_fit_decisions_total KV-fit placement\n"
        "# TYPE fastroute_decode_kv_fit_decisions_total counter\n"
        'fastroute_decode_kv_fit_decisions_total{role="decode",result="agree"} 120.0\n'
        'fastroute_decode_kv_fit_decisions_total{role="decode",result="disagree"} 30.0\n'
        'fastroute_decode_kv_fit_decisions_total{role="prefill",result="agree"} 999.0\n'
        'fastroute_decode_kv_fit_decisions_created{role="decode",result="agree"} 1.7e9\n'
        'fastroute_target_kv_free_tokens{target="x@0"} 5.0\n'
    )
    got = parse_kv_fit_metrics(text)
    assert got["agree"] == 120.0 and got["disagree"] == 30.0
    assert parse_kv_fit_metrics("") == {}


def test_kv_tight_cells_and_table() -> None:
    cells = kv_tight_cells(reserve=500)
    assert [c.label for c in cells] == [
        "least_requests",
        "demand W=1e6",
        "least_requests + kv-fit",
        "demand W=1e6 + kv-fit",
    ]
    for c in cells:
        mode = c.args[c.args.index("--decode-kv-fit") + 1]
        assert mode == ("on" if "kv-fit" in c.label else "shadow")
        assert c.args[c.args.index("--decode-kv-reserve-tokens") + 1] == "500"
        assert ("--decode-input-demand" in c.args) == c.label.startswith("demand")

    def res(label: str, rep: int, ttft90: float, args: list) -> dict:
        load = {k: 10.0 for k in ("ttft_p50_ms", "tpot_p50_ms", "tpot_p90_ms", "output_tok_s")}
        load.update(ttft_p90_ms=ttft90, completed=5, errors=0)
        return {
            "label": label,
            "concurrency": 192,
            "repeat": rep,
            "load": load,
            "args": args,
            "balance": {"prealloc_per_rank": [float(rep), 0.0], "busiest_batch": 24.0, "step_ms": 80.0},
            "kv_fit": {"agree": 3.0, "disagree": 1.0},
            "retractions": 0,
        }

    rows = [res("least_requests", k, t, cells[0].args) for k, t in enumerate((300.0, 100.0, 200.0))]
    rows.append(res("least_requests + kv-fit", 0, 50.0, cells[2].args))
    md = kv_markdown_table(rows, 0.5, SimParams(dp_size=2, max_total_num_tokens=1_000_000))
    lr = [ln for ln in md.splitlines() if ln.startswith("| least_requests |")][0]
    assert "| 200 (300, 100, 200) |" in lr  # median of the runs, then each run
    assert "| 1.0 0.0 |" in lr and "9 / 3 (75% agree)" in lr and lr.endswith("| 15 | 0 |")
    on = [ln for ln in md.splitlines() if ln.startswith("| least_requests + kv-fit |")][0]
    assert "| 50 |" in on and "agree" not in on  # no shadow counters when kv-fit is on
    assert "median of 3 run(s)" in md and "1,000,000 KV tokens" in md
