"""Admin auth decided from the request head (the body is never read), and CORS lines on every
kind of response head (the fail-closed rules as the data plane applies them)."""

from __future__ import annotations

import asyncio

from tests.integration.conftest import Router, call, get, post, run, workers

KEYS = ["a1:Admin:admin:sk-admin-1", "u1:Reader:user:sk-user-1"]


async def _head_only(port: int, head: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head)  # announces a large body and never sends it
    data = await asyncio.wait_for(reader.read(65536), 2.0)
    rest = await asyncio.wait_for(reader.read(65536), 2.0)  # then the router closes
    writer.close()
    return data + rest


def test_admin_refused_before_the_body_is_read() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url], control_plane_api_keys=KEYS) as r:
            for auth, status in (
                (b"", b"401"),
                (b"Authorization: Bearer sk-user-1\r\n", b"403"),
                (b"Authorization: Bearer nope\r\n", b"401"),
            ):
                data = await _head_only(
                    r.port,
                    b"POST /workers HTTP/1.1\r\nHost: x\r\n" + auth + b"Content-Type: application/json\r\n"
                    b"Content-Length: 10000000\r\n\r\n",
                )
                assert data.startswith(b"HTTP/1.1 " + status), data
                assert b"connection: close" in data.lower()
        async with Router(worker_urls=[w.url], api_key="k1") as r:
            data = await _head_only(r.port, b"DELETE /workers/x HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n")
            assert data.startswith(b"HTTP/1.1 401")

    run(body())


def test_cors_lines_on_errors_health_and_streams() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        origin = {"Origin": "https://app.example.com"}
        async with Router(worker_urls=[w.url], cors_allowed_origins=["https://app.example.com"], api_key="k1") as r:
            res = await call(r.port, post("/generate", {"text": "x"}, origin))
            assert res.status == 401
            assert res.headers["access-control-allow-origin"] == "https://app.example.com"
            res = await call(r.port, get("/health", origin))
            assert res.status == 200 and "access-control-allow-origin" in res.headers
            assert res.body == b"OK"
            res = await call(
                r.port, post("/generate", {"text": "x", "stream": True}, {**origin, "Authorization": "Bearer k1"})
            )
            assert res.status == 200 and "access-control-allow-origin" in res.headers
            res = await call(r.port, get("/nope", origin))
            assert res.status == 404 and "access-control-allow-origin" in res.headers

    run(body())
