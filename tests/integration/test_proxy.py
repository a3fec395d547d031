"""Regular-mode data path over real loopback sockets: wire compatibility, streaming,
in-flight accounting, keep-alive, pipelining, bad inputs, auth, dp-aware balance."""

from __future__ import annotations

import asyncio

from tests.integration.conftest import (
    DataWorker,
    RawClient,
    Router,
    call,
    get,
    post,
    run,
    until,
    wait_port,
    workers,
)


def test_generate_forwards_body_and_whitelisted_headers_only() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url]) as r:
            raw = b'{"text": "hi",  "sampling_params": {"max_new_tokens": 2}, "x": "\\u00e9"}'
            res = await call(
                r.port,
                post(
                    "/generate",
                    raw,
                    {
                        "Authorization": "Bearer client",
                        "X-Request-Id": "abc",
                        "traceparent": "tp",
                        "x-request-id-extra": "e",
                        "User-Agent": "ua",
                        "X-Other": "no",
                        "X-SMG-Routing-Key": "k1",
                    },
                ),
            )
            assert res.status == 200
            assert res.json["text"] == f"hello from {w.name}"
            assert res.headers["x-request-id"] == "abc"
            assert res.headers["content-type"] == "application/json"
            (rec,) = w.inference()
            assert rec.method == "POST" and rec.path == "/generate"
            assert rec.body == raw  # forwarded byte for byte
            h = rec.headers
            assert h["authorization"] == "Bearer client"
            assert h["x-request-id"] == "abc" and h["traceparent"] == "tp"
            assert h["x-request-id-extra"] == "e" and h["x-smg-routing-key"] == "k1"
            assert h["content-type"] == "application/json"
            assert h["content-length"] == str(len(raw))
            assert "user-agent" not in h and "x-other" not in h

    run(body())


def test_request_id_generated_with_path_prefix() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url]) as r:
            for path, prefix in (
                ("/generate", "gnt-"),
                ("/v1/completions", "cmpl-"),
                ("/v1/chat/completions", "chatcmpl-"),
            ):
                obj = (
                    {"messages": [{"role": "user", "content": "x"}]}
                    if "chat" in path
                    else {"prompt": "x"}
                    if "compl" in path
                    else {"text": "x"}
                )
                res = await call(r.port, post(path, obj))
                rid = res.headers["x-request-id"]
                assert rid.startswith(prefix) and len(rid) == len(prefix) + 24 and rid[len(prefix) :].isalnum()
            res = await call(r.port, post("/generate", {"text": "x"}, {"x-correlation-id": "corr-1"}))
            assert res.headers["x-request-id"] == "corr-1"

    run(body())


def test_sse_stream_is_relayed_byte_exact_and_chunked() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        w.events = 5
        async with Router(worker_urls=[w.url]) as r:
            c = await RawClient(r.port).connect()
            c.send(post("/generate", {"text": "x", "stream": True}))
            res = await c.response()
            assert res.status == 200 and res.chunked
            assert res.headers["content-type"] == "text/event-stream"
            expected = b"".join(w.sse_event(i, {}) for i in range(5)) + b"data: [DONE]\n\n"
            assert res.body == expected
            assert await until_zero(r, w)
            c.close()

    run(body())


async def until_zero(r: Router, w: DataWorker) -> bool:
    await until(lambda: r.in_flight(w) == 0, 5.0, "in_flight back to 0")
    return True


def test_in_flight_visible_while_held_and_zero_after_eof() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url]) as r:
            w.hold()
            clients = [await RawClient(r.port).connect() for _ in range(3)]
            for c in clients:
                c.send(post("/generate", {"text": "x"}))
            await until(lambda: w.held == 3, what="3 held")
            assert r.in_flight(w) == 3
            w.release()
            for c in clients:
                assert (await c.response()).status == 200
                c.close()
            await until_zero(r, w)

    run(body())


def test_client_disconnect_mid_stream_aborts_upstream_and_releases() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        w.stream_gate = asyncio.Event()
        async with Router(worker_urls=[w.url]) as r:
            c = await RawClient(r.port).connect()
            c.send(post("/generate", {"text": "x", "stream": True}))
            await c.until_body(b"tok0")
            assert r.in_flight(w) == 1
            c.close()
            await until(lambda: w.aborted == 1, what="worker sees the disconnect")
            await until_zero(r, w)
            # still serving
            assert (await call(r.port, post("/generate", {"text": "x"}))).status == 200

    run(body())


def test_worker_dying_mid_stream_truncates_client_and_releases() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        w.events, w.die_after = 5, 2
        async with Router(worker_urls=[w.url]) as r:
            c = await RawClient(r.port).connect()
            c.send(post("/generate", {"text": "x", "stream": True}))
            assert await c.closed()
            res = c.p.responses[0]
            assert res.status == 200 and not res.done  # no terminating chunk
            assert b"tok1" in res.body and b"[DONE]" not in res.body
            await until_zero(r, w)

    run(body())


def test_keep_alive_reuses_client_and_upstream_connections() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url]) as r:
            base = w.connections
            c = await RawClient(r.port).connect()
            for i in range(5):
                c.send(post("/generate", {"text": f"x{i}"}))
                assert (await c.response()).status == 200
            c.close()
            conn_ids = {rec.conn_id for rec in w.inference()}
            assert len(conn_ids) == 1 and w.connections == base + 1

    run(body())


def test_pipelined_requests_answered_in_order() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url]) as r:
            c = await RawClient(r.port).connect()
            c.send(
                post("/generate", {"text": "a"}, {"X-Request-Id": "r1"})
                + get("/health")
                + post("/generate", {"text": "b", "stream": True}, {"X-Request-Id": "r3"})
                + get("/nope")
            )
            res = [await c.response(i) for i in range(4)]
            assert [x.status for x in res] == [200, 200, 200, 404]
            assert res[0].headers["x-request-id"] == "r1" and res[1].body == b"OK"
            assert res[2].headers["x-request-id"] == "r3" and res[2].body.endswith(b"data: [DONE]\n\n")
            assert res[3].json["error"]["code"] == "unknown_url"
            c.close()

    run(body())


def test_chunked_request_body_is_forwarded_with_content_length() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url]) as r:
            payload = b'{"text": "chunked body"}'
            data = (
                b"POST /generate HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"
                + b"%x\r\n%b\r\n" % (5, payload[:5])
                + b"%x\r\n%b\r\n" % (len(payload) - 5, payload[5:])
                + b"0\r\n\r\n"
            )
            res = await call(r.port, data)
            assert res.status == 200
            (rec,) = w.inference()
            assert rec.body == payload and rec.headers["content-length"] == str(len(payload))
            assert "transfer-encoding" not in rec.headers

    run(body())


def test_bad_inputs_get_json_errors_and_router_keeps_serving() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url], max_payload_size=1000) as r:
            c = await RawClient(r.port).connect()
            c.send(b"GARBAGE\x00 / HTTP/9\r\n\r\n")
            res = await c.response()
            assert res.status == 400 and res.json["error"]["code"] == "bad_request"
            assert await c.closed()
            res = await call(r.port, post("/generate", b'{"text": '))
            assert res.status == 400 and "error" in res.json
            res = await call(r.port, post("/generate", {"text": "x" * 2000}))
            assert res.status == 413 and res.json["error"]["code"] == "payload_too_large"
            res = await call(r.port, get("/no/such/path"))
            assert res.status == 404 and res.json["error"]["code"] == "unknown_url"
            assert w.inference() == []
            res = await call(r.port, post("/generate", {"text": "ok"}))
            assert res.status == 200

    run(body())


def test_api_key_gates_data_plane_and_is_sent_to_workers() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url], api_key="sekret") as r:
            res = await call(r.port, post("/generate", {"text": "x"}))
            assert res.status == 401 and res.json["error"]["code"] == "invalid_api_key"
            assert res.headers["www-authenticate"].startswith("Bearer")
            res = await call(r.port, post("/generate", {"text": "x"}, {"Authorization": "Bearer wrong"}))
            assert res.status == 401
            res = await call(r.port, get("/workers"))
            assert res.status == 401
            for open_path in ("/health", "/liveness", "/readiness", "/v1/models"):
                assert (await call(r.port, get(open_path))).status == 200, open_path
            res = await call(r.port, post("/generate", {"text": "x"}, {"Authorization": "Bearer sekret"}))
            assert res.status == 200
            (rec,) = w.inference()
            assert rec.headers["authorization"] == "Bearer sekret"
            assert (await call(r.port, get("/workers", {"Authorization": "Bearer sekret"}))).status == 200

    run(body())


def test_no_worker_ready_gives_503() -> None:
    async def body() -> None:
        w = await DataWorker().start()
        await w.stop()  # nothing listens there: registration never completes
        r = Router(worker_urls=[w.url])
        await r.server.start()
        try:
            res = await call(r.port, post("/generate", {"text": "x"}))
            assert res.status == 503 and res.json["error"]["code"] == "no_available_workers"
            assert (await call(r.port, get("/health"))).status == 200
        finally:
            await r.server.stop(grace=0.1)

    run(body())


def test_dead_worker_gives_502_and_releases() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url]) as r:
            await w.stop()
            res = await call(r.port, post("/generate", {"text": "x"}))
            assert res.status == 502 and res.json["error"]["code"] == "bad_gateway"
            await until_zero(r, w)

    run(body())


def test_dp_aware_regular_injects_data_parallel_rank() -> None:
    async def body() -> None:
        (w,) = await workers(1, dp_size=4)
        async with Router(worker_urls=[w.url], dp_aware=True) as r:
            for _i in range(8):
                assert (await call(r.port, post("/generate", {"text": "x"}))).status == 200
            ranks = [rec.json["data_parallel_rank"] for rec in w.inference()]
            assert sorted(ranks) == [0, 0, 1, 1, 2, 2, 3, 3]

    run(body())


def test_admin_paths_are_delegated_to_registry() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url]) as r:
            res = await call(r.port, get("/workers"))
            assert res.status == 200 and res.json["workers"][0]["url"] == w.url
            assert (await call(r.port, get("/readiness"))).status == 200

    run(body())


def test_openai_client_streaming_and_not() -> None:
    import openai

    async def body() -> None:
        (w,) = await workers(1)
        w.events = 4
        async with Router(worker_urls=[w.url]) as r:
            client = openai.AsyncOpenAI(base_url=r.url + "/v1", api_key="k", max_retries=0, timeout=10)
            out = await client.chat.completions.create(model="fake-model", messages=[{"role": "user", "content": "hi"}])
            assert out.choices[0].message.content == f"hi from {w.name}"
            stream = await client.chat.completions.create(
                model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True
            )
            parts = [chunk.choices[0].delta.content async for chunk in stream]
            assert "".join(p or "" for p in parts) == "t0 t1 t2 t3 "
            await client.close()
            await until_zero(r, w)
            assert all(rec.headers["authorization"] == "Bearer k" for rec in w.inference())

    run(body())


def test_slow_client_header_read_timeout_closes_connection() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url], header_read_timeout_secs=0.2) as r:
            c = await RawClient(r.port).connect()
            c.send(b"POST /generate HTTP/1.1\r\nHost: r\r\nContent-")  # head never completes
            assert await c.closed(timeout=5.0)
            assert w.inference() == []
            assert (await call(r.port, post("/generate", {"text": "x"}))).status == 200

    run(body())


def test_request_timeout_gives_504_and_aborts_upstream() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url], request_timeout_secs=1) as r:
            w.hold()
            res = await call(r.port, post("/generate", {"text": "x"}))
            assert res.status == 504 and res.json["error"]["code"] == "gateway_timeout"
            await until(lambda: w.aborted == 1, what="upstream closed on timeout")
            await until_zero(r, w)
            w.release()

    run(body())


def test_graceful_stop_serves_while_in_flight_then_refuses() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        r = Router(worker_urls=[w.url])
        await r.__aenter__()
        port = r.port
        w.hold()
        c = await RawClient(port).connect()
        c.send(post("/generate", {"text": "x"}))
        await until(lambda: w.held == 1, what="held")
        stopping = asyncio.get_running_loop().create_task(r.server.stop(grace=10))
        await until(lambda: r.server.app.endpoints.draining, what="draining")
        ready = await call(port, get("/readiness"))  # the listener still answers
        assert ready.status == 503 and b"draining" in ready.body
        assert (await call(port, get("/health"))).status == 200
        assert not stopping.done()  # waiting for the held request
        w.release()
        res = await c.response()
        assert res.status == 200 and res.headers.get("connection") == "close"
        await asyncio.wait_for(stopping, 5)
        try:
            await call(port, get("/health"), timeout=2)
            refused = False
        except OSError:
            refused = True
        assert refused

    run(body())


def test_subprocess_router_serves_and_exits_on_sigterm() -> None:
    import os
    import signal
    import socket
    import sys

    async def body() -> None:
        (w,) = await workers(1)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            mport = s.getsockname()[1]
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "fastroute",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            w.url,
            "--policy",
            "round_robin",
            "--prometheus-port",
            str(mport),
            "--log-level",
            "warn",
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )
        try:

            async def ready() -> None:
                while True:
                    try:
                        res = await call(port, post("/generate", {"text": "x"}), timeout=2)
                        if res.status == 200:
                            return
                    except OSError:
                        pass
                    await asyncio.sleep(0.05)

            await asyncio.wait_for(ready(), 15)
            assert w.inference()[-1].json == {"text": "x"}
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 15) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()

    run(body(), timeout=40)


def test_sigterm_as_soon_as_the_port_accepts_stops_cleanly() -> None:
    """A SIGTERM that lands while the router is still finishing its start-up (the listener
    already accepts) stops it like any other: exit 0 and its shared table unlinked, never a
    kill by the default handler that leaves the shared memory behind."""
    import os
    import signal
    import socket
    import subprocess
    import sys

    for _ in range(4):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fastroute",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--prometheus-port",
                "0",
                "--log-level",
                "warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )
        try:
            wait_port(port, poll=0.01)
            proc.send_signal(signal.SIGTERM)
            _, err = proc.communicate(timeout=20)
        finally:
            if proc.returncode is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 0, err
        assert "leaked shared_memory" not in err, err


def test_routing_key_header_sticks_under_consistent_hashing() -> None:
    async def body() -> None:
        ws = await workers(3)
        async with Router(
            worker_urls=[w.url for w in ws], policy="consistent_hashing", routing_key_headers=["x-session"]
        ) as r:
            for key_header in ("X-SMG-Routing-Key", "X-Session"):
                for key in ("alpha", "beta", "gamma"):
                    before = [len(w.inference()) for w in ws]
                    for _ in range(4):
                        res = await call(r.port, post("/generate", {"text": "x"}, {key_header: key}))
                        assert res.status == 200
                    gained = [len(w.inference()) - b for w, b in zip(ws, before)]
                    assert sorted(gained) == [0, 0, 4], (key_header, key, gained)

    run(body())


def test_close_delimited_upstream_stream_reaches_client_chunked() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        w.sse_chunked = False
        async with Router(worker_urls=[w.url]) as r:
            c = await RawClient(r.port).connect()
            for _ in range(2):
                c.send(post("/generate", {"text": "x", "stream": True}))
                res = await c.response()
                assert res.chunked and res.body.endswith(b"data: [DONE]\n\n")
            assert len({rec.conn_id for rec in w.inference()}) == 2  # not reused after EOF framing
            c.close()
            await until_zero(r, w)

    run(body())


def test_request_metrics_are_counted() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url]) as r:
            assert (await call(r.port, post("/generate", {"text": "x"}))).status == 200
            assert (await call(r.port, post("/generate", {"text": "x", "stream": True}))).status == 200
            assert (await call(r.port, post("/generate", b"{bad"))).status == 400
            assert (await call(r.port, get("/health"))).status == 200
            res = await call(r.server.metrics.port, get("/metrics"))
            text = res.body.decode()
            lines = [line for line in text.splitlines() if not line.startswith("#")]

            def value(prefix: str, *needles: str) -> float:
                for line in lines:
                    if line.startswith(prefix) and all(n in line for n in needles):
                        return float(line.rsplit(" ", 1)[1])
                raise AssertionError(f"{prefix} {needles} missing")

            assert value("smg_router_requests_total", 'endpoint="generate"', 'streaming="false"') == 1
            assert value("smg_router_requests_total", 'endpoint="generate"', 'streaming="true"') == 1
            assert value("smg_http_requests_total", 'path="/generate"', 'method="POST"') == 3
            assert value("smg_http_responses_total", 'path="/generate"', 'status_code="200"', 'error_code=""') == 2
            assert value("smg_http_responses_total", 'path="/health"', 'status_code="200"') == 1
            assert value("smg_http_responses_total", 'status_code="400"') == 1
            assert value("smg_router_request_duration_seconds_count", 'endpoint="generate"') == 2

    run(body())
