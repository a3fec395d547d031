"""More hostile clients and misbehaving workers over real sockets, beside
``test_hostile.py``: resets and dribbling workers, a 101 on the PD decode leg, head and body
deadlines (inactivity and total), ``HEAD`` on every kind of path, PD refusals and the bounded
logprob merge, and the control plane (oversized ``/v1/loads``, Basic auth from a URL, alias
and field checks on every registration path).

Every case asserts the answer, that in-flight counts return to 0 where a request was booked,
and that the router keeps serving.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import time

import pytest

from fastroute.dataplane import pd as _pd
from tests.integration.conftest import RawClient, Router, call, post, run, until, workers
from tests.integration.test_hostile import RESET, ScriptedWorker, answer, fails_with_502_then_serves


def _dribble(data: bytes, pause: float = 0.002) -> list:
    out: list = []
    for i in range(len(data)):
        out += [data[i : i + 1], pause]
    return out


# ------------------------------------------------------------------------------ misbehaving workers


def test_reset_before_the_answer_is_502_and_released() -> None:
    fails_with_502_then_serves(lambda rec: [RESET])


def test_reset_mid_body_cuts_the_client_stream() -> None:
    async def body() -> None:
        w = await ScriptedWorker().start()
        w.script = lambda rec: [b'HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{"text": ', 0.05, RESET]
        async with Router(worker_urls=[w.url], request_timeout_secs=5) as r:
            c = await RawClient(r.port).connect()
            try:
                c.send(post("/generate", {"text": "x"}))
                assert await c.closed(timeout=5)
                assert not (c.p.responses and c.p.responses[0].done)  # truncated, never "complete"
            finally:
                c.close()
            await until(lambda: r.in_flight(w) == 0, what="released")

    run(body())


def test_dribbling_worker_is_relayed_whole() -> None:
    async def body() -> None:
        w = await ScriptedWorker().start()
        w.script = lambda rec: _dribble(answer(rec))
        async with Router(worker_urls=[w.url], request_timeout_secs=10) as r:
            for i in range(2):
                res = await call(r.port, post("/generate", {"text": f"d{i}"}), timeout=10)
                assert res.status == 200 and res.json["text"] == f"answer to d{i}"
            await until(lambda: r.in_flight(w) == 0, what="released")

    run(body())


def test_worker_stalled_mid_head_is_504_after_the_request_timeout() -> None:
    async def body() -> None:
        w = await ScriptedWorker().start()
        w.script = lambda rec: [b"HTTP/1.1 200 OK\r\ncontent-le", 30.0]
        async with Router(worker_urls=[w.url], request_timeout_secs=1) as r:
            t0 = time.monotonic()
            res = await call(r.port, post("/generate", {"text": "x"}), timeout=5)
            assert res.status == 504 and time.monotonic() - t0 < 3.5
            await until(lambda: r.in_flight(w) == 0, what="released")
            w.script = None
            assert (await call(r.port, post("/generate", {"text": "y"}))).status == 200

    run(body())


def test_101_on_the_pd_decode_leg_is_502() -> None:
    async def body() -> None:
        (p,) = await workers(1, role="prefill")
        d = await ScriptedWorker(role="decode").start()
        d.script = lambda rec: [b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\nconnection: upgrade\r\n\r\n"]
        async with Router(pd_disaggregation=True, prefill=[(p.url, 8998)], decode=[d.url], request_timeout_secs=5) as r:
            res = await call(r.port, post("/generate", {"text": "x"}))
            assert res.status == 502, res.body
            await until(lambda: r.in_flight(p) == 0 and r.in_flight(d) == 0, what="released")

    run(body())


def test_garbage_after_the_answer_never_reaches_the_next_request() -> None:
    async def body() -> None:
        w = await ScriptedWorker().start()
        w.script = lambda rec: [answer(rec) + b"\r\nGARBAGE"]
        async with Router(worker_urls=[w.url], request_timeout_secs=5) as r:
            for i in range(4):
                res = await call(r.port, post("/generate", {"text": f"g{i}"}))
                assert res.status == 200 and res.json["text"] == f"answer to g{i}"
            await until(lambda: r.in_flight(w) == 0, what="released")
            # every answer left junk behind: no connection was pooled with it
            pool = next(iter(r.server.app.upstreams.routes.values())).pool
            assert all(not c.closed for c in pool.idle)

    run(body())


# ------------------------------------------------------------------------------ hostile clients


def test_stalled_and_dribbled_heads_are_cut_by_the_total_head_deadline() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url], header_read_timeout_secs=0.5) as r:
            stalled = await RawClient(r.port).connect()
            dribbler = await RawClient(r.port).connect()
            stop = asyncio.Event()

            async def dribble() -> None:
                head = b"POST /generate HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"s" * 1000
                for i in range(len(head)):
                    if stop.is_set():
                        return
                    try:
                        dribbler.send(head[i : i + 1])
                    except (ConnectionError, OSError):
                        return
                    await asyncio.sleep(0.05)

            task = asyncio.create_task(dribble())
            try:
                stalled.send(b"POST /generate HTTP/1.1\r\nHost: x\r\n")
                t0 = time.monotonic()
                assert await stalled.closed(timeout=5)
                assert await dribbler.closed(timeout=5)  # bytes keep coming: the total deadline
                assert time.monotonic() - t0 < 3.0
            finally:
                stop.set()
                await task
                stalled.close()
                dribbler.close()
            assert w.inference() == []
            assert (await call(r.port, post("/generate", {"text": "ok"}))).status == 200

    run(body())


def test_dribbled_body_is_cut_by_the_total_body_deadline() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url], header_read_timeout_secs=0.4, body_read_timeout_secs=1.0) as r:
            c = await RawClient(r.port).connect()
            try:
                c.send(
                    b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100000\r\n\r\n"
                )
                t0 = time.monotonic()

                async def dribble() -> None:
                    for _ in range(200):  # a byte every 0.1 s: never idle for the 0.4 s
                        c.send(b" ")
                        await asyncio.sleep(0.1)

                task = asyncio.create_task(dribble())
                try:
                    res = await c.response(timeout=5)
                finally:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                assert res.status == 408, res.body
                assert res.json["error"]["message"]
                assert 0.9 < time.monotonic() - t0 < 3.0
                assert await c.closed(timeout=3)
            finally:
                c.close()
            assert w.inference() == []
            assert (await call(r.port, post("/generate", {"text": "ok"}))).status == 200

    run(body())


def test_a_slow_but_steady_body_within_the_deadlines_is_served() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url], header_read_timeout_secs=0.4) as r:
            doc = json.dumps({"text": "slow"}).encode()
            c = await RawClient(r.port).connect()
            try:
                c.send(
                    b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % len(doc)
                )
                for i in range(0, len(doc), 2):  # 0.15 s between pieces, ~1.2 s in all
                    c.send(doc[i : i + 2])
                    await asyncio.sleep(0.15)
                res = await c.response(timeout=5)
                assert res.status == 200, res.body
            finally:
                c.close()
            assert len(w.inference()) == 1

    run(body())


@pytest.mark.parametrize(
    "method,path,status",
    [
        ("HEAD", "/generate", 405),
        ("HEAD", "/nope", 404),
        ("HEAD", "/v1/models", None),
        ("HEAD", "/liveness", 200),
    ],
)
def test_head_answers_carry_no_body_on_any_path(method: str, path: str, status: int | None) -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url]) as r:
            reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
            try:
                writer.write(
                    f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode() + b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
                )
                data = b""
                while not data.endswith(b"\r\n\r\nOK"):
                    chunk = await asyncio.wait_for(reader.read(65536), 3)
                    assert chunk, data
                    data += chunk
                first, _, rest = data.partition(b"\r\n\r\n")
                if status is not None:
                    assert first.startswith(b"HTTP/1.1 %d" % status), first
                assert rest.startswith(b"HTTP/1.1 200"), data  # no body bytes after the HEAD answer
            finally:
                writer.close()

    run(body())


@pytest.mark.parametrize(
    "doc",
    [
        {"text": "x", "sampling_params": {"n": 2**63}},
        {"text": ["a", "b"], "sampling_params": [{"max_new_tokens": 1}, {"max_new_tokens": 2**70}]},
        {"text": "x", "sampling_params": {"max_new_tokens": True}},
    ],
    ids=["n-huge", "batch-item-huge", "bool"],
)
def test_other_bad_counts_are_400(doc: dict) -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url], max_concurrent_requests=1) as r:
            res = await call(r.port, post("/generate", doc), timeout=3)
            assert res.status == 400 and res.json["error"]["message"], res.body
            assert w.inference() == [] and r.in_flight(w) == 0
            assert (await call(r.port, post("/generate", {"text": "fine"}))).status == 200

    run(body())


# ------------------------------------------------------------------------------ PD


def test_pd_client_rank_fields_are_400_and_reach_no_worker() -> None:
    async def body() -> None:
        (p,) = await workers(1, role="prefill")
        (d,) = await workers(1, role="decode")
        async with Router(pd_disaggregation=True, prefill=[(p.url, 8998)], decode=[d.url]) as r:
            for field in ("routed_dp_rank", "data_parallel_rank"):
                res = await call(r.port, post("/generate", {"text": "x", field: 0}))
                assert res.status == 400 and field in res.json["error"]["message"], res.body
            assert p.inference() == [] and d.inference() == []
            assert r.in_flight(p) == 0 and r.in_flight(d) == 0
            assert (await call(r.port, post("/generate", {"text": "x"}))).status == 200

    run(body())


def test_pd_batch_cap_is_configurable_and_inclusive() -> None:
    async def body() -> None:
        (p,) = await workers(1, role="prefill")
        (d,) = await workers(1, role="decode")
        async with Router(pd_disaggregation=True, prefill=[(p.url, 8998)], decode=[d.url], pd_max_batch_size=3) as r:
            assert (await call(r.port, post("/generate", {"text": ["a", "b", "c"]}))).status == 200
            res = await call(r.port, post("/generate", {"text": ["a", "b", "c", "d"]}))
            assert res.status == 413 and "--pd-max-batch-size" in res.json["error"]["message"]
            res = await call(
                r.port,
                post("/v1/chat/completions", {"model": "m", "n": 4, "messages": [{"role": "user", "content": "x"}]}),
            )
            assert res.status == 413
            assert len(p.inference()) == 1 and len(d.inference()) == 1
            assert r.in_flight(p) == 0 and r.in_flight(d) == 0

    run(body())


@pytest.mark.parametrize("stream", [False, True])
def test_logprob_merge_over_its_bound_relays_the_decode_unmerged(
    stream: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(_pd, "_MERGE_LIMIT", 16)
    caplog.set_level(logging.WARNING, logger="fastroute.proxy")

    async def body() -> None:
        (p,) = await workers(1, role="prefill")
        (d,) = await workers(1, role="decode")
        p.input_logprobs = [[-9.0, 987654, None]]  # (6 digits: never part of a port number)
        async with Router(pd_disaggregation=True, prefill=[(p.url, 8998)], decode=[d.url]) as r:
            res = await call(r.port, post("/generate", {"text": "x", "return_logprob": True, "stream": stream}))
            assert res.status == 200, res.body
            assert b"987654" not in res.body  # the prefill's logprobs were not merged in
            assert b"input_token_logprobs" in res.body  # the decode's answer, as it came
            await until(lambda: r.in_flight(p) == 0 and r.in_flight(d) == 0, what="released")

    run(body())
    assert "input logprobs not merged" in caplog.text


# ------------------------------------------------------------------------------ control plane


async def _admin(port: int, method: str, path: str, doc=None) -> tuple[int, bytes]:
    data = json.dumps(doc).encode() if doc is not None else b""
    raw = (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode() + data
    res = await call(port, raw)
    return res.status, res.body


def test_oversized_loads_are_unpolled_and_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="fastroute")

    async def body() -> None:
        w = await ScriptedWorker().start()
        w.loads_override = json.dumps(
            {
                "loads": [
                    {
                        "dp_rank": 0,
                        "num_running_reqs": 2**70,
                        "num_waiting_reqs": 0,
                        "num_used_tokens": 1e300,
                        "max_total_num_tokens": 100000,
                    }
                ]
            }
        ).encode()
        async with Router(worker_urls=[w.url], load_monitor_interval=0.1) as r:
            await until(
                lambda: sum(n for (url, mode), n in r.server.monitor.polls.items() if mode == "v1_loads") >= 4,
                what="four polls",
            )
            status, doc = await _admin(r.port, "GET", "/workers")
            entry = json.loads(doc)["workers"][0]
            assert entry["engine_load"]["num_running_reqs"] is None
            assert (await call(r.port, post("/generate", {"text": "x"}))).status == 200

    run(body())
    assert "Traceback" not in caplog.text and "monitor tick failed" not in caplog.text
    assert caplog.text.count("out-of-range counts") == 1


def test_url_credentials_become_basic_auth_and_are_never_shown(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="fastroute")

    async def body() -> None:
        (w,) = await workers(1)
        secret = w.url.replace("http://", "http://bob:pa%40ss@")
        async with Router(worker_urls=[secret]) as r:
            res = await call(r.port, post("/generate", {"text": "x"}))
            assert res.status == 200
            token = base64.b64encode(b"bob:pa@ss").decode()
            assert w.inference()[0].headers["authorization"] == "Basic " + token
            health = [rec for rec in w.requests if rec.path == "/health"]
            assert health and health[0].headers.get("authorization") == "Basic " + token
            status, doc = await _admin(r.port, "GET", "/workers")
            assert b"pa%40ss" not in doc and b"pa@ss" not in doc
            assert "bob" not in repr(r.server.registry.workers)

    run(body())
    assert "pa%40ss" not in caplog.text and "pa@ss" not in caplog.text


def test_legacy_add_worker_refuses_an_alias_too() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url]) as r:
            res = await call(
                r.port,
                f"POST /add_worker?url=http://localhost:{w.port}/ HTTP/1.1\r\n"
                f"Host: x\r\nContent-Length: 0\r\n\r\n".encode(),
            )
            assert res.status == 400 and b"same address" in res.body
            status, doc = await _admin(r.port, "POST", "/workers", {"url": f"http://LOCALHOST:{w.port}"})
            assert status == 409, doc
            assert len(r.server.registry.workers) == 1

    run(body())


@pytest.mark.parametrize(
    "doc,status",
    [
        ({"api_key": "a\r\nx-injected: 1"}, 400),
        ({"priority": -1}, 400),
        ({"priority": True}, 400),
    ],
    ids=["key-crlf", "priority-negative", "priority-bool"],
)
def test_more_bad_worker_fields_are_refused(doc: dict, status: int) -> None:
    async def body() -> None:
        (w,) = await workers(1)
        (w2,) = await workers(1)
        async with Router(worker_urls=[w.url]) as r:
            got, answer = await _admin(r.port, "POST", "/workers", {"url": w2.url, **doc})
            assert got == status, answer
            assert len(r.server.registry.workers) == 1

    run(body())


def test_put_worker_refuses_non_finite_fields() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url]) as r:
            wid = r.server.registry.workers[0].id
            for upd in ('{"priority": 1e400}', '{"cost": Infinity}', '{"cost": NaN}'):
                raw = upd.encode()
                res = await call(
                    r.port,
                    b"PUT /workers/%b HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%b" % (wid.encode(), len(raw), raw),
                )
                assert res.status in (400, 422), (upd, res.status, res.body)
            status, listing = await _admin(r.port, "GET", "/workers")
            assert status == 200 and json.loads(listing)["workers"][0]["cost"] == 1.0
            assert b"Infinity" not in listing and b"NaN" not in listing

    run(body())


def test_head_bytes_are_counted_per_message_not_per_read() -> None:
    """A read that ends one head, carries its 100 KB body and starts the next head is not
    counted against the next head's 64 KiB."""

    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url]) as r:
            doc = json.dumps({"text": "a" * 100_000}).encode()
            first = post("/generate", doc)
            split = first.index(b"\r\n") + 2
            second = post("/generate", {"text": "b"})
            c = await RawClient(r.port).connect()
            try:
                c.send(first[:split])
                await asyncio.sleep(0.1)
                c.send(first[split:] + second[:30])
                await asyncio.sleep(0.1)
                c.send(second[30:])
                assert (await c.response(timeout=5)).status == 200
                assert (await c.response(timeout=5)).status == 200
            finally:
                c.close()
            assert len(w.inference()) == 2

    run(body())
