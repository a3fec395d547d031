"""Hardening, over real sockets: each hostile input gets a clear answer and
leaves the router fully working (scrapes, leases, later requests)."""

from __future__ import annotations

import asyncio
import email.utils
import json
import ssl
import time

from conftest import DataWorker, RawClient, Router, call, get, post, run, until, workers


class OddModelWorker(DataWorker):
    """A worker whose served_model_name holds a lone surrogate (a JSON "\\ud800" escape)."""

    def control(self, path: str):
        if path in ("/server_info", "/get_server_info"):
            info = {
                "model_path": "/models/fake-model",
                "served_model_name": "odd\ud800name",
                "dp_size": 1,
                "tp_size": 1,
                "max_total_num_tokens": 100000,
                "disaggregation_mode": "null",
            }
            return 200, json.dumps(info).encode()  # ensure_ascii: the escape on the wire
        return super().control(path)


async def scrape(r: Router) -> tuple[int, str]:
    res = await call(r.server.metrics.port, get("/metrics"))
    return res.status, res.body.decode("utf-8")


def test_lone_surrogates_in_model_names_never_blind_metrics() -> None:
    async def body() -> None:
        w = await OddModelWorker().start()
        async with Router(worker_urls=[w.url]) as r:
            assert (await scrape(r))[0] == 200
            raw = b'{"text": "x", "model": "\\ud800"}'
            res = await call(r.port, post("/generate", raw))
            assert res.status == 200, res.body
            for _ in range(2):  # every later scrape works, not just the next one
                status, text = await scrape(r)
                assert status == 200
                assert 'model="\\\\ud800"' in text  # the escape, as a label value
                assert 'model="odd\\\\ud800name"' in text
            assert r.in_flight(w) == 0
            assert (await call(r.port, post("/generate", {"text": "again"}))).status == 200
        await w.stop()

    run(body())


def chunked(path: str, body: bytes, head: dict[str, str], trailer: dict[str, str]) -> bytes:
    h = "".join(f"{k}: {v}\r\n" for k, v in head.items())
    t = "".join(f"{k}: {v}\r\n" for k, v in trailer.items())
    return (
        f"POST {path} HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        f"Transfer-Encoding: chunked\r\n{h}\r\n"
    ).encode() + b"%x\r\n%b\r\n0\r\n%b\r\n" % (len(body), body, t.encode())


def test_trailers_are_never_request_headers() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url], api_key="secret") as r:
            # The data-plane key only in the trailer: not authenticated.
            res = await call(r.port, chunked("/generate", b'{"text": "hi"}', {}, {"Authorization": "Bearer secret"}))
            assert res.status == 401, res.body
            ok = await call(
                r.port,
                chunked(
                    "/generate",
                    b'{"text": "hi"}',
                    {"Authorization": "Bearer secret"},
                    {"X-SMG-Routing-Key": "k", "X-Request-Id": "forged"},
                ),
            )
            assert ok.status == 200
            (rec,) = w.inference()
            assert "x-smg-routing-key" not in rec.headers and rec.headers.get("x-request-id") != "forged"
            assert r.in_flight(w) == 0
        await w.stop()

    run(body())


def test_user_key_in_head_and_admin_key_in_trailer_is_still_a_user() -> None:
    keys = ["u:ops:user:ukey", "a:root:admin:akey"]

    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url], control_plane_api_keys=keys) as r:
            c = await RawClient(r.port).connect()
            try:
                # Pipelined behind a read, so the mutation's head is parsed while busy.
                c.send(
                    get("/list_workers", {"Authorization": "Bearer ukey"})
                    + chunked(
                        "/workers",
                        json.dumps({"url": "http://127.0.0.1:9"}).encode(),
                        {"Authorization": "Bearer ukey"},
                        {"Authorization": "Bearer akey"},
                    )
                )
                first = await c.response(0)
                second = await c.response(1)
            finally:
                c.close()
            assert first.status == 200
            assert second.status == 403, second.body
            assert [x.url for x in r.server.registry.workers] == [w.url]
        await w.stop()

    run(body())


def test_health_generate_needs_a_key_when_only_control_plane_keys_exist() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url], control_plane_api_keys=["u:ops:user:ukey"]) as r:
            res = await call(r.port, get("/health_generate"))
            assert res.status == 401 and res.json["error"]["code"]
            res = await call(r.port, get("/health_generate", {"Authorization": "Bearer nope"}))
            assert res.status == 401
            res = await call(r.port, get("/health_generate", {"Authorization": "Bearer ukey"}))
            assert res.status == 200, res.body
            # Probes stay open.
            assert (await call(r.port, get("/health"))).status == 200
        async with Router(worker_urls=[w.url], api_key="dk", control_plane_api_keys=["u:ops:user:ukey"]) as r:
            assert (await call(r.port, get("/health_generate"))).status == 401
            res = await call(r.port, get("/health_generate", {"Authorization": "Bearer dk"}))
            assert res.status == 200
        await w.stop()

    run(body())


def test_over_limit_chunked_admin_body_is_413() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url], max_payload_size=1000) as r:
            big = json.dumps({"url": "http://127.0.0.1:9", "pad": "x" * 5000}).encode()
            res = await call(r.port, chunked("/workers", big, {}, {}))
            assert res.status == 413, res.body
            assert res.json["error"]["code"]
            assert [x.url for x in r.server.registry.workers] == [w.url]
            assert (await call(r.port, post("/generate", {"text": "hi"}))).status == 200
        await w.stop()

    run(body())


def test_absolute_form_targets_route_by_path() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url]) as r:
            data = post("/generate", {"text": "hi"}).replace(
                b"POST /generate ", b"POST http://router.example:8080/generate ", 1
            )
            res = await call(r.port, data)
            assert res.status == 200, res.body
            assert w.inference()[0].path == "/generate"
            res = await call(r.port, b"GET HTTPS://router.example/health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert res.status == 200
            res = await call(r.port, b"GET http://router.example/list_workers?x=1 HTTP/1.1\r\nHost: x\r\n\r\n")
            assert res.status == 200 and res.json["urls"] == [w.url]
            res = await call(r.port, b"GET http://router.example HTTP/1.1\r\nHost: x\r\n\r\n")
            assert res.status == 404
            assert r.in_flight(w) == 0
        await w.stop()

    run(body())


def legacy_add(url: str) -> bytes:
    return f"POST /add_worker?url={url} HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n".encode()


def test_legacy_add_worker_answers_promptly_for_an_unreachable_worker() -> None:
    async def body() -> None:
        w, late = await workers(2)
        dead = f"http://127.0.0.1:{late.port}"
        await late.stop()  # nothing listens there now
        async with Router(worker_urls=[w.url], worker_startup_timeout_secs=600) as r:
            res = await call(r.port, legacy_add(dead), timeout=10.0)  # a bound, not a timing
            assert res.status == 202, res.body
            assert b"background" in res.body
            (pending,) = [x for x in r.server.registry.workers if x.url == dead]
            assert pending.status == "pending"
            listed = await call(r.port, get("/workers"))
            assert {x["url"]: x["status"] for x in listed.json["workers"]}[dead] == "pending"
            # A worker that answers still gets the synchronous 200 of the legacy API.
            (ok,) = await workers(1)
            res = await call(r.port, legacy_add(ok.url), timeout=10.0)
            assert res.status == 200 and res.body == f"Successfully added worker: {ok.url}".encode()
            await ok.stop()
        await w.stop()

    run(body())


def test_retry_after_too_long_for_the_timeout_is_relayed_not_retried() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        w.status = 429
        later = email.utils.formatdate(time.time() + 3600, usegmt=True)
        async with Router(worker_urls=[w.url], request_timeout_secs=30) as r:
            for value in (b"3600", later.encode()):
                w.error_headers = b"retry-after: %b\r\n" % value
                before = len(w.inference())
                res = await call(r.port, post("/generate", {"text": "x"}))
                assert res.status == 429, res.body
                assert len(w.inference()) == before + 1  # no attempt past the deadline
            assert r.in_flight(w) == 0

    run(body())


def test_retry_waits_for_the_workers_retry_after() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        w.status = 503
        w.error_headers = b"Retry-After: 2\r\n"
        async with Router(
            worker_urls=[w.url], retry_initial_backoff_ms=1, retry_max_backoff_ms=1, request_timeout_secs=30
        ) as r:
            c = await RawClient(r.port).connect()
            c.send(post("/generate", {"text": "x"}))
            live = r.server.app.live.exchanges
            await until(lambda: any(ex.retry_handle is not None for ex in live), 5.0, "retry scheduled")
            (ex,) = live
            # The retry timer is set for the worker's 2 s, not the 1 ms backoff.
            assert ex.retry_handle.when() - asyncio.get_running_loop().time() > 1.0
            assert len(w.inference()) == 1 and r.in_flight(w) == 0  # lease given back meanwhile
            w.status = 200
            res = await c.response(timeout=10)
            assert res.status == 200 and len(w.inference()) == 2
            c.close()
            assert r.in_flight(w) == 0

    run(body())


def connections_gauge(r: Router) -> float:
    for line in r.server.metrics.render().decode().splitlines():
        if line.startswith("smg_http_connections_active "):
            return float(line.split()[1])
    raise AssertionError("no smg_http_connections_active")


def test_tls_handshakes_are_bounded_and_counted(tmp_path) -> None:
    from test_security import make_ca_and_cert

    ca, cert, key = make_ca_and_cert(tmp_path)

    async def body() -> None:
        (w,) = await workers(1)
        async with Router(
            worker_urls=[w.url], tls_cert_path=str(cert), tls_key_path=str(key), header_read_timeout_secs=0.5
        ) as r:
            silent = [await asyncio.open_connection("127.0.0.1", r.port) for _ in range(30)]
            # Every silent socket is an open connection, though no handshake finished.
            await until(lambda: connections_gauge(r) == 30, 5.0, "handshaking counted")
            for reader, _ in silent:  # closed by the router after the head timeout
                assert await asyncio.wait_for(reader.read(), 20) == b""
            await until(lambda: connections_gauge(r) == 0, 5.0, "gauge back to zero")
            for _, writer in silent:
                writer.close()
            # A real TLS client is served and counted once.
            ctx = ssl.create_default_context(cafile=str(ca))
            reader, writer = await asyncio.open_connection("127.0.0.1", r.port, ssl=ctx, server_hostname="localhost")
            await until(lambda: connections_gauge(r) == 1, 5.0, "tls client counted")
            writer.write(post("/generate", {"text": "hi"}, keep_alive=False))
            data = await asyncio.wait_for(reader.read(), 10)
            assert data.startswith(b"HTTP/1.1 200"), data[:100]
            writer.close()
            await until(lambda: connections_gauge(r) == 0, 5.0, "tls client uncounted")
        await w.stop()

    run(body(), 60)


def test_manual_policy_keys_are_bounded_and_evictions_counted() -> None:
    async def body() -> None:
        ws = await workers(2)
        async with Router(worker_urls=[w.url for w in ws], policy="manual", max_manual_keys=8) as r:
            for i in range(40):
                res = await call(r.port, post("/generate", {"text": "x"}, {"X-SMG-Routing-Key": f"user-{i}"}))
                assert res.status == 200
            keys = r.server.registry.group("regular").key_table
            assert keys.count <= 8 and keys.evicted >= 32
            text = r.server.metrics.render().decode()
            line = [x for x in text.splitlines() if x.startswith('fastroute_manual_keys_evicted_total{role="regular"}')]
            assert line and float(line[0].split()[1]) == keys.evicted
            # The most recent key still sticks to its worker.
            first = sum(len(w.inference()) for w in ws)
            for _ in range(3):
                await call(r.port, post("/generate", {"text": "x"}, {"X-SMG-Routing-Key": "user-39"}))
            assert sum(len(w.inference()) for w in ws) == first + 3
            assert max(len(w.inference()) for w in ws) >= 3
        for w in ws:
            await w.stop()

    run(body())


def test_pd_leg_retry_after_past_the_deadline_is_relayed() -> None:
    async def body() -> None:
        (p,) = await workers(1, role="prefill")
        (d,) = await workers(1, role="decode")
        d.status = 503
        d.error_headers = b"Retry-After: 3600\r\n"
        async with Router(
            pd_disaggregation=True, prefill=[(p.url, 8998)], decode=[d.url], request_timeout_secs=30
        ) as r:
            res = await call(r.port, post("/generate", {"text": "x"}))
            assert res.status == 503, res.body
            assert len(d.inference()) == 1  # not retried
            await until(lambda: r.in_flight(p) == 0 and r.in_flight(d) == 0, 5.0, "released")

    run(body())
