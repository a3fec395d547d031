"""HTTP/1.0 clients that ask for keep-alive (issue 50, item 8), over real sockets.

An HTTP/1.0 connection closes after each response unless the response says
``Connection: keep-alive`` (RFC 9112 9.3). The router keeps such a connection open, so every
answer it gives one (proxied, health, admin, errors, CORS preflight; regular and PD) must say
so, or the client closes it after the first response and the next request is refused. An
HTTP/1.0 request without the header still gets ``connection: close``.
"""

from __future__ import annotations

import json

from tests.integration.conftest import DataWorker, RawClient, Router, run


def _req(method: str, path: str, body: bytes = b"", keep: bool = True, extra: str = "") -> bytes:
    head = f"{method} {path} HTTP/1.0\r\nHost: x\r\n{extra}"
    if keep:
        head += "Connection: keep-alive\r\n"
    if body or method == "POST":
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return (head + "\r\n").encode() + body


GEN = json.dumps({"text": "hi"}).encode()


async def _round(port: int) -> None:
    cl = await RawClient(port).connect()
    try:
        cases = [
            _req("POST", "/generate", GEN),
            _req("GET", "/health"),
            _req("GET", "/workers"),
            _req("GET", "/no-such-path"),
            _req(
                "OPTIONS", "/generate", extra="Origin: https://app.example\r\nAccess-Control-Request-Method: POST\r\n"
            ),
            _req("POST", "/v1/completions", json.dumps({"prompt": "hi", "model": "m"}).encode()),
        ]
        for i, raw in enumerate(cases):
            cl.send(raw)  # the same connection each time: it stays open
            res = await cl.response(i)
            assert res.status in (200, 204, 404), (raw, res.status, res.body)
            assert res.headers.get("connection", "").lower() == "keep-alive", (raw, res.headers)
        cl.send(_req("GET", "/health", keep=False))
        res = await cl.response(len(cases))
        assert res.status == 200 and res.headers.get("connection", "").lower() == "close", res.headers
    finally:
        cl.close()


def test_http10_keep_alive_answers_say_so() -> None:
    async def body() -> None:
        w = await DataWorker().start()
        try:
            async with Router(worker_urls=[w.url], cors_allowed_origins=["https://app.example"]) as r:
                await _round(r.port)
        finally:
            await w.stop()

    run(body())


def test_http10_keep_alive_answers_say_so_in_pd_mode() -> None:
    async def body() -> None:
        p, d = await DataWorker(role="prefill").start(), await DataWorker(role="decode").start()
        try:
            async with Router(
                pd_disaggregation=True,
                prefill=[(p.url, None)],
                decode=[d.url],
                cors_allowed_origins=["https://app.example"],
            ) as r:
                await _round(r.port)
        finally:
            await p.stop()
            await d.stop()

    run(body())
