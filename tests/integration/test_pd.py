"""PD data path over real loopback sockets: injected bootstrap keys, rank fields, error
mapping per failing leg, cancellation of both legs, logprob merge, decode-rank balance."""

from __future__ import annotations

import collections
import json

from tests.integration.conftest import RawClient, Router, call, post, run, until, workers


def pd_router(prefills, decodes, **kw) -> Router:
    kw.setdefault("policy", "round_robin")
    return Router(
        pd_disaggregation=True,
        prefill=[(p.url, 8998 + i) for i, p in enumerate(prefills)],
        decode=[d.url for d in decodes],
        **kw,
    )


def test_both_legs_get_same_room_and_bootstrap_of_prefill() -> None:
    async def body() -> None:
        (p,) = await workers(1, role="prefill")
        (d,) = await workers(1, role="decode")
        async with pd_router([p], [d]) as r:
            raw = b'{"text": "hello world", "sampling_params": {"max_new_tokens": 2}}'
            res = await call(r.port, post("/generate", raw, {"X-Request-Id": "q1", "User-Agent": "x"}))
            assert res.status == 200 and res.json["text"] == f"hello from {d.name}"
            (pr,), (dr,) = p.inference(), d.inference()
            assert pr.path == dr.path == "/generate"
            pj, dj = pr.json, dr.json
            assert pj == dj
            assert pj["bootstrap_host"] == "127.0.0.1" and pj["bootstrap_port"] == 8998
            assert 0 <= pj["bootstrap_room"] < 2**63 - 2**16
            assert pj["text"] == "hello world" and pj["sampling_params"] == {"max_new_tokens": 2}
            assert pr.body.startswith(raw[:-1])  # client bytes kept, keys appended
            assert pr.headers["x-request-id"] == "q1" and "user-agent" not in pr.headers
            # a fresh room per request
            await call(r.port, post("/generate", raw))
            assert p.inference()[1].json["bootstrap_room"] != pj["bootstrap_room"]
            await until(lambda: r.in_flight(p) == 0 and r.in_flight(d) == 0, what="released")

    run(body())


def test_batch_gets_room_lists() -> None:
    async def body() -> None:
        (p,) = await workers(1, role="prefill")
        (d,) = await workers(1, role="decode")
        async with pd_router([p], [d]) as r:
            res = await call(r.port, post("/generate", {"input_ids": [[1, 2], [3, 4]]}))
            assert res.status == 200
            j = d.inference()[0].json
            assert j["bootstrap_host"] == ["127.0.0.1"] * 2 and len(set(j["bootstrap_room"])) == 2
            assert p.inference()[0].json["bootstrap_room"] == j["bootstrap_room"]

    run(body())


def test_dp_aware_rank_on_decode_leg_and_room_arithmetic_for_prefill() -> None:
    async def body() -> None:
        (p,) = await workers(1, role="prefill", dp_size=2)
        (d,) = await workers(1, role="decode", dp_size=4)
        async with pd_router([p], [d], dp_aware=True) as r:
            for _ in range(8):
                assert (await call(r.port, post("/generate", {"text": "x"}))).status == 200
            for pr, dr in zip(p.inference(), d.inference()):
                pj, dj = pr.json, dr.json
                assert "routed_dp_rank" not in pj and "data_parallel_rank" not in pj
                assert pj["bootstrap_room"] == dj["bootstrap_room"]
                assert 0 <= dj["routed_dp_rank"] < 4
            assert sorted(rec.json["routed_dp_rank"] for rec in d.inference()) == [0, 0, 1, 1, 2, 2, 3, 3]
            # round robin over the 2 prefill ranks, carried by room % 2
            assert sorted(rec.json["bootstrap_room"] % 2 for rec in p.inference()) == [0] * 4 + [1] * 4

    run(body())


def test_dp_rank_field_override() -> None:
    async def body() -> None:
        (p,) = await workers(1, role="prefill")
        (d,) = await workers(1, role="decode", dp_size=2)
        async with pd_router([p], [d], dp_aware=True, dp_rank_field="data_parallel_rank") as r:
            assert (await call(r.port, post("/generate", {"text": "x"}))).status == 200
            dj = d.inference()[0].json
            assert "data_parallel_rank" in dj and "routed_dp_rank" not in dj

    run(body())


def test_decode_error_is_mapped_first() -> None:
    async def body() -> None:
        (p,) = await workers(1, role="prefill")
        (d,) = await workers(1, role="decode")
        async with pd_router([p], [d]) as r:
            d.status, d.error_body = 503, b'{"error": {"message": "decode overloaded"}}'
            p.status = 500  # decode is looked at first
            res = await call(r.port, post("/generate", {"text": "x"}))
            assert res.status == 503
            err = res.json["error"]
            assert err["code"] == "decode_unavailable" and err["message"] == "decode overloaded"
            assert res.headers["x-smg-error-code"] == "decode_unavailable"
            d.status = 418
            res = await call(r.port, post("/generate", {"text": "x"}))
            assert res.status == 500 and res.json["error"]["code"] == "decode_error"
            await until(lambda: r.in_flight(p) == 0 and r.in_flight(d) == 0, what="released")

    run(body())


def test_prefill_error_surfaces_even_if_decode_ok() -> None:
    async def body() -> None:
        (p,) = await workers(1, role="prefill")
        (d,) = await workers(1, role="decode")
        async with pd_router([p], [d]) as r:
            p.status, p.error_body = 400, b'{"error": {"message": "bad prompt"}}'
            res = await call(r.port, post("/generate", {"text": "x"}))
            assert res.status == 400
            err = res.json["error"]
            assert err["code"] == "prefill_bad_request" and "bad prompt" in err["message"]
            await until(lambda: r.in_flight(p) == 0 and r.in_flight(d) == 0, what="released")

    run(body())


def test_streaming_decode_error_is_a_complete_sse_event() -> None:
    async def body() -> None:
        (p,) = await workers(1, role="prefill")
        (d,) = await workers(1, role="decode")
        async with pd_router([p], [d]) as r:
            d.status, d.error_body = 500, b'{"error": {"message": "boom"}}'
            res = await call(r.port, post("/generate", {"text": "x", "stream": True}))
            assert res.status == 500
            assert res.headers["content-type"] == "text/event-stream"
            events = [e for e in res.body.split(b"\n\n") if e]
            assert events[-1] == b"data: [DONE]"
            first = json.loads(events[0][len(b"data: ") :])
            assert first == {"error": {"message": "boom", "status": 500}}

    run(body())


def test_streaming_relays_decode_bytes() -> None:
    async def body() -> None:
        (p,) = await workers(1, role="prefill")
        (d,) = await workers(1, role="decode")
        d.events = 4
        async with pd_router([p], [d]) as r:
            res = await call(r.port, post("/v1/completions", {"prompt": "x", "stream": True}))
            assert res.status == 200 and res.chunked
            assert res.body == b"".join(d.sse_event(i, {}) for i in range(4)) + b"data: [DONE]\n\n"
            assert p.inference()[0].path == "/v1/completions"

    run(body())


def test_transport_failure_of_one_leg_is_502_and_cancels_the_other() -> None:
    async def body() -> None:
        (p,) = await workers(1, role="prefill")
        (d,) = await workers(1, role="decode")
        async with pd_router([p], [d]) as r:
            p.hold()
            d.hold()
            c = await RawClient(r.port).connect()
            c.send(post("/generate", {"text": "x"}))
            await until(lambda: p.held == 1 and d.held == 1, what="both legs held")
            await p.stop()  # prefill dies with the request open
            res = await c.response()
            c.close()
            assert res.status == 502 and res.json["error"]["code"] == "bad_gateway"
            await until(lambda: d.aborted == 1, what="decode leg cancelled")
            await until(lambda: r.in_flight(p) == 0 and r.in_flight(d) == 0, what="released")
            d.release()
            p.release()

    run(body())


def test_client_disconnect_cancels_both_legs_and_releases_both_leases() -> None:
    async def body() -> None:
        (p,) = await workers(1, role="prefill")
        (d,) = await workers(1, role="decode")
        async with pd_router([p], [d]) as r:
            p.hold()
            d.hold()
            c = await RawClient(r.port).connect()
            c.send(post("/generate", {"text": "x", "stream": True}))
            await until(lambda: p.held == 1 and d.held == 1, what="both legs held")
            assert r.in_flight(p) == 1 and r.in_flight(d) == 1
            c.close()
            await until(lambda: p.aborted == 1 and d.aborted == 1, what="both legs cancelled")
            await until(lambda: r.in_flight(p) == 0 and r.in_flight(d) == 0, what="released")
            p.release()
            d.release()

    run(body())


def test_logprobs_merged_non_streaming_and_streaming() -> None:
    async def body() -> None:
        (p,) = await workers(1, role="prefill")
        (d,) = await workers(1, role="decode")
        p.input_logprobs = [[-1.0, 11, None], [-2.0, 12, None]]
        d.input_logprobs = [[-9.0, 99, None]]
        async with pd_router([p], [d]) as r:
            res = await call(r.port, post("/generate", {"text": "x", "return_logprob": True}))
            assert res.status == 200
            assert res.json["meta_info"]["input_token_logprobs"] == [
                [-1.0, 11, None],
                [-2.0, 12, None],
                [-9.0, 99, None],
            ]
            assert res.headers["content-length"] == str(len(res.body))
            d.events = 2
            res = await call(r.port, post("/generate", {"text": "x", "stream": True, "return_logprob": True}))
            events = [e for e in res.body.split(b"\n\n") if e]
            assert events[-1] == b"data: [DONE]" and len(events) == 3
            for e in events[:2]:
                lp = json.loads(e[len(b"data: ") :])["meta_info"]["input_token_logprobs"]
                assert lp == [[-1.0, 11, None], [-2.0, 12, None], [-9.0, 99, None]]

    run(body())


def test_least_requests_spreads_64_held_requests_over_8_decode_ranks() -> None:
    async def body() -> None:
        (p,) = await workers(1, role="prefill")
        (d,) = await workers(1, role="decode", dp_size=8)
        async with pd_router(
            [p], [d], policy="power_of_two", p2c_load_metric="least_requests", dp_aware=True, seed=7
        ) as r:
            d.hold()
            clients = [await RawClient(r.port).connect() for _ in range(64)]
            for c in clients:
                c.send(post("/generate", {"text": "x"}))
            await until(lambda: d.held == 64, 10.0, "64 held on decode")
            assert r.rank_in_flight(d) == [8] * 8
            per_rank = collections.Counter(rec.json["routed_dp_rank"] for rec in d.inference())
            assert per_rank == {rank: 8 for rank in range(8)}
            d.release()
            for c in clients:
                assert (await c.response()).status == 200
                c.close()
            await until(lambda: r.rank_in_flight(d) == [0] * 8, what="all released")

    run(body(), timeout=60)


def test_decode_error_answers_without_waiting_for_a_stuck_prefill() -> None:
    async def body() -> None:
        (p,) = await workers(1, role="prefill")
        (d,) = await workers(1, role="decode")
        async with pd_router([p], [d]) as r:
            p.hold()  # the prefill is stuck; the decode fails
            d.status, d.error_body = 400, b'{"error": {"message": "bad"}}'
            res = await call(r.port, post("/generate", {"text": "x"}))
            assert res.status == 400 and res.json["error"]["code"] == "decode_bad_request"
            await until(lambda: p.aborted == 1, what="prefill leg cancelled")
            await until(lambda: r.in_flight(p) == 0 and r.in_flight(d) == 0, what="released")
            p.release()

    run(body())
