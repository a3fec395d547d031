"""``fastroute epp --epp-mode http`` behind a real Envoy 1.40: ext_proc's ``http_service`` asks
the picker over HTTP/1.1 (one POST per processing step) instead of a gRPC stream. Picks on the
headers: 64 requests held by eight workers before their answer land 8 per worker and stay
booked until the answers' headers pass Envoy, then go back to 0. Envoy sends nothing when a
stream ends without response headers (client reset, Envoy killed): those leases come back at
``--silent-stream-timeout-secs``, counted as ``silent``. A stream's lease ends at its first
byte (its response headers)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

from tests.integration.conftest import RawClient, call, get, post, run, workers
from tests.integration.envoy_harness import Gateway

FLAGS = ("--epp-mode", "http", "--policy", "power_of_two", "--p2c-load-metric", "least_requests")
HEADER = "x-gateway-destination-endpoint"


# --silent-stream-timeout-secs where a test waits for it: long enough to open 64 requests and
# see them all held before the first lease ends (5-6 s after its pick, at the once-a-second
# sweep); with 1 s a loaded machine saw the first leases end before the last were booked.
SILENT = "5"


async def _open_64(g: Gateway, ws: list) -> list[RawClient]:
    for w in ws:
        w.hold()  # held before the answer's head
    clients = []
    for i in range(64):
        c = await RawClient(g.port).connect()
        c.send(post("/generate", {"text": f"h{i}"}))
        clients.append(c)
    await g.until_in_flight(lambda f: len(f) == 8 and set(f.values()) == {8.0}, 15, "8 in flight per worker")
    return clients


def _reclaimed_silent(m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith("fastroute_leases_reclaimed_total") and 'reason="silent"' in k)


def test_held_requests_book_8_each_and_release_at_the_answer() -> None:
    async def body() -> None:
        ws = await workers(8)
        async with Gateway([w.url for w in ws], *FLAGS) as g:
            clients = await _open_64(g, ws)
            assert sorted(len(w.inference()) for w in ws) == [8] * 8
            for w in ws:
                rec = w.inference()[0]
                assert rec.headers[HEADER] == f"127.0.0.1:{w.port}"  # the picker's header mutation
                w.release()
            for c in clients:
                resp = await c.response(timeout=20)
                assert resp.status == 200
                c.close()
            await g.until_in_flight(lambda f: sum(f.values()) == 0, 10, "released at the answers")
            assert _reclaimed_silent(await g.metrics()) == 0  # by the response headers, not a bound

    run(body(), 90)


def test_client_reset_and_envoy_killed_release_at_the_silence_bound() -> None:
    async def body() -> None:
        ws = await workers(8)
        async with Gateway([w.url for w in ws], *FLAGS, "--silent-stream-timeout-secs", SILENT) as g:
            clients = await _open_64(g, ws)
            for c in clients:
                c.close()  # the clients are gone: Envoy tells the picker nothing
            await g.until_in_flight(lambda f: sum(f.values()) == 0, 15, "released by the silence bound")
            assert _reclaimed_silent(await g.metrics()) == 64
            for w in ws:
                w.release()
            # the ledger is usable again, then Envoy dies with 64 more held
            clients = await _open_64(g, ws)
            g.kill_envoy()
            assert g.envoy is not None
            await g.envoy.wait()
            await g.until_in_flight(lambda f: sum(f.values()) == 0, 15, "released after Envoy's death")
            assert _reclaimed_silent(await g.metrics()) == 128
            for c in clients:
                c.close()
            for w in ws:
                w.release()

    run(body(), 120)


def test_a_stream_is_released_at_its_first_byte_and_refusals_book_nothing() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Gateway([w.url], *FLAGS, "--api-key", "k") as g:
            r = await call(g.port, post("/generate", {"text": "no key"}), timeout=10)
            assert r.status == 401 and r.json["error"]["code"] == "invalid_api_key", r.body
            w.stream_gate = asyncio.Event()
            c = await RawClient(g.port).connect()
            c.send(post("/generate", {"text": "s", "stream": True}, headers={"authorization": "Bearer k"}))
            await c.until_body(b"data: ", timeout=20)
            # the stream runs on, held by the worker; its lease ended with the response headers
            await g.until_in_flight(lambda f: sum(f.values()) == 0, 10, "released at the first byte")
            w.stream_gate.set()
            resp = await c.response(timeout=20)
            assert resp.body.endswith(b"data: [DONE]\n\n")
            c.close()
            assert w.inference()[-1].headers.get("authorization") == "Bearer k"

    run(body(), 90)


def test_http_mode_refuses_picks_that_read_the_body() -> None:
    argv = [sys.executable, "-m", "fastroute", "epp", "--grpc-port", "22998", "--epp-mode", "http"]
    argv += ["--worker-urls", "http://127.0.0.1:22997", "--policy", "cache_aware"]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "--epp-mode" in p.stderr and "read the body" in p.stderr, p.stderr


def test_admission_queues_and_sheds_over_http() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        flags = (*FLAGS, "--max-concurrent-requests", "1", "--queue-size", "1", "--queue-timeout-secs", "20")
        async with Gateway([w.url], *flags) as g:
            w.hold()
            first = asyncio.create_task(call(g.port, post("/generate", {"text": "a"}), timeout=30))
            await g.until_in_flight(lambda f: sum(f.values()) == 1, 10, "the first booked")
            second = asyncio.create_task(call(g.port, post("/generate", {"text": "b"}), timeout=30))
            await asyncio.sleep(0.3)  # the second waits in the queue (no lease yet)
            third = await call(g.port, post("/generate", {"text": "c"}), timeout=10)
            assert third.status == 429 and third.json["error"]["code"] == "queue_full", third.body
            assert len(w.inference()) == 1
            w.release()  # the first answers; its response headers free the slot for the second
            assert (await first).status == 200
            assert (await second).status == 200
            assert len(w.inference()) == 2
            await g.until_in_flight(lambda f: sum(f.values()) == 0, 10, "all released")

    run(body(), 90)


def test_the_http_listener_answers_bad_calls_with_a_reason_and_books_nothing() -> None:
    import base64

    def headers_call(rid: str | None, **extra: str) -> bytes:
        hs = {":method": "POST", ":path": "/generate", **extra}
        doc = {
            "request_headers": {
                "headers": {
                    "headers": [{"key": k, "raw_value": base64.b64encode(v.encode()).decode()} for k, v in hs.items()]
                }
            }
        }
        return post("/process", doc, headers={"x-request-id": rid} if rid else None)

    async def body() -> None:
        ws = await workers(2)
        async with Gateway([w.url for w in ws], *FLAGS) as g:
            port = g.grpc_port  # the picker's own HTTP/1.1 listener
            r = await call(port, get("/process"))
            assert r.status == 404, r.body
            r = await call(port, post("/process", b"{not json", headers={"x-request-id": "1"}))
            assert r.status == 400 and r.json["error"]["code"] == "malformed_message", r.body
            r = await call(port, headers_call(None))
            assert r.status == 400 and "x-request-id" in r.json["error"]["message"], r.body
            assert sum((await g.in_flight()).values()) == 0
            # a well-formed pair books, then releases, one lease
            r = await call(port, headers_call("s1"))
            assert r.status == 200, r.body
            sets = r.json["request_headers"]["response"]["header_mutation"]["set_headers"]
            endpoint = base64.b64decode(sets[0]["header"]["raw_value"]).decode()
            assert endpoint in {f"127.0.0.1:{w.port}" for w in ws}
            assert r.json["dynamic_metadata"]["envoy.lb"][HEADER] == endpoint
            assert sum((await g.in_flight()).values()) == 1
            r = await call(port, post("/process", {"response_headers": {}}, headers={"x-request-id": "s1"}))
            assert r.status == 200 and r.json == {"response_headers": {}}, r.body
            assert sum((await g.in_flight()).values()) == 0

    run(body(), 90)


def test_64_requests_land_8_per_rank_of_a_dp8_server_and_come_back() -> None:
    """A DP-8 server with a port per rank (each rank its own endpoint, so the pick needs no
    body): 64 long non-streaming requests are booked 8 per rank while they run and released at
    their answers; 64 whose clients reset, and 64 more when Envoy is killed, come back at the
    silence bound (which also ends the lease of a request running longer than it: docs)."""
    from fastroute.sim.engine import SimParams
    from fastroute.sim.server import SimWorker

    async def body() -> None:
        w = SimWorker("regular", SimParams(dp_size=8, time_scale=1.0), "127.0.0.1", rank_ports=True)
        await w.start()
        long = {"text": "hold", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}

        async def open_64(g: Gateway) -> list[RawClient]:
            clients = []
            for _ in range(64):
                c = await RawClient(g.port).connect()
                c.send(post("/generate", long))
                clients.append(c)
            await g.until_in_flight(lambda f: len(f) == 8 and set(f.values()) == {8.0}, 20, "8 per rank")
            return clients

        try:
            # the default silence bound (30 s) is longer than these requests (about 11 s)
            async with Gateway([w.rank_url(0)], *FLAGS) as g:
                clients = await open_64(g)
                for _ in range(200):  # the picks are booked; the requests are on their way
                    if sum(w.port_requests) == 64:
                        break
                    await asyncio.sleep(0.05)
                assert w.port_requests == [8] * 8
                for c in clients:
                    resp = await c.response(timeout=60)
                    assert resp.status == 200, resp.body
                    c.close()
                await g.until_in_flight(lambda f: sum(f.values()) == 0, 10, "released at the answers")
                assert _reclaimed_silent(await g.metrics()) == 0
            # the silence bound: the only end Envoy gives a reset or killed stream in this mode
            async with Gateway([w.rank_url(0)], *FLAGS, "--silent-stream-timeout-secs", SILENT) as g:
                for c in await open_64(g):
                    c.close()  # client reset: Envoy tells the picker nothing
                await g.until_in_flight(lambda f: sum(f.values()) == 0, 15, "released by the silence bound")
                assert _reclaimed_silent(await g.metrics()) == 64
                clients = await open_64(g)
                g.kill_envoy()
                assert g.envoy is not None
                await g.envoy.wait()
                await g.until_in_flight(lambda f: sum(f.values()) == 0, 15, "released after Envoy's death")
                assert _reclaimed_silent(await g.metrics()) == 128
                for c in clients:
                    c.close()
        finally:
            await w.stop()

    run(body(), 150)
