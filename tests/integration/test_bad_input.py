"""Hostile and malformed client input over real sockets: each gets its documented status
(400 malformed / smuggling, 431 oversized head, 413 oversized body, 400 bad JSON or field types,
a closed connection for a slow-loris head) and the router keeps serving afterwards.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from conftest import RawClient, Router, call, post, run, until, workers


async def serving(r: Router) -> None:
    res = await call(r.port, post("/generate", {"text": "still here"}))
    assert res.status == 200, res.body


async def raw_status(port: int, data: bytes) -> tuple[int, bool, dict]:
    """Send raw bytes; -> (status, connection closed by the router, error JSON)."""
    c = await RawClient(port).connect()
    try:
        c.send(data)
        res = await c.response()
        closed = await c.closed()
        return res.status, closed, json.loads(res.body) if res.body else {}
    finally:
        c.close()


MALFORMED = [
    pytest.param(b"GARBAGE\r\n\r\n", id="request-line"),
    pytest.param(b"GET / HTTP/9.x\r\n\r\n", id="version"),
    pytest.param(b"GET /\x01 HTTP/1.1\r\nHost: x\r\n\r\n", id="url-control-char"),
    pytest.param(b"GET / HTTP/1.1\r\nHost : x\r\n\r\n", id="header-space-before-colon"),
    pytest.param(b"GET / HTTP/1.1\r\nNoColonHere\r\n\r\n", id="header-no-colon"),
    pytest.param(
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        id="smuggling-cl-te",
    ),
    pytest.param(
        b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 30\r\n\r\n{}",
        id="duplicate-content-length",
    ),
    pytest.param(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", id="negative-length"),
    pytest.param(b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nZZ\r\n", id="bad-chunk"),
]


@pytest.mark.parametrize("data", MALFORMED)
def test_malformed_http_is_400_and_closes(data: bytes) -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url]) as r:
            status, closed, doc = await raw_status(r.port, data)
            assert status == 400 and closed
            assert doc["error"]["code"] == "bad_request"
            assert w.inference() == []
            await serving(r)
            assert r.in_flight(w) == 0

    run(body())


def test_oversized_head_is_431_and_closes() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url]) as r:
            for data in (
                b"GET /" + b"a" * 70_000 + b" HTTP/1.1\r\n\r\n",
                post("/generate", {"text": "x"}, {"X-Big": "v" * 70_000}),
                b"GET / HTTP/1.1\r\n" + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 100) for i in range(1000)) + b"\r\n",
            ):
                status, closed, doc = await raw_status(r.port, data)
                assert status == 431 and closed, status
                assert doc["error"]["code"] == "header_too_large"
            # Just under the limit is fine.
            res = await call(r.port, post("/generate", {"text": "x"}, {"X-Big": "v" * 60_000}))
            assert res.status == 200
            assert len(w.inference()) == 1
            await serving(r)
            st = r.server.app.stats
            assert st.http_responses[("431", "header_too_large", "other")] == 3

    run(body())


def test_oversized_body_is_413() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url], max_payload_size=1000) as r:
            status, closed, doc = await raw_status(r.port, post("/generate", {"text": "x" * 2000}))
            assert status == 413 and closed and doc["error"]["code"] == "payload_too_large"
            chunked = (
                b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                + b"".join(b"100\r\n" + b"a" * 256 + b"\r\n" for _ in range(8))
                + b"0\r\n\r\n"
            )
            # Chunked: the size is known only once read, so the connection stays usable.
            c = await RawClient(r.port).connect()
            c.send(chunked)
            res = await c.response()
            assert res.status == 413 and res.json["error"]["code"] == "payload_too_large"
            c.send(post("/generate", {"text": "y"}))
            assert (await c.response()).status == 200
            c.close()
            assert len(w.inference()) == 1
            await serving(r)

    run(body())


BAD_BODIES = [
    ("/generate", b"{bad"),
    ("/generate", b"\xff\xfe{}"),
    ("/generate", b"[1, 2]"),
    ("/generate", b'"text"'),
    ("/generate", b"[" * 100_000 + b"]" * 100_000),
    ("/generate", b'{"stream": "yes"}'),
    ("/generate", b'{"text": 5}'),
    ("/generate", b'{"input_ids": "x"}'),
    ("/generate", b'{"sampling_params": 3}'),
    ("/generate", b'{"sampling_params": {"max_new_tokens": "x"}}'),
    ("/generate", b'{"return_logprob": "y"}'),
    ("/generate", b'{"model": 5}'),
    ("/v1/chat/completions", b'{"messages": "hi"}'),
    ("/v1/chat/completions", b'{"messages": [], "max_tokens": "5"}'),
    ("/v1/completions", b'{"prompt": 3}'),
]


def test_invalid_json_and_wrong_field_types_are_400_on_a_kept_connection() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url], max_payload_size=1 << 20) as r:
            c = await RawClient(r.port).connect()
            for path, raw in BAD_BODIES:
                c.send(post(path, raw))
                res = await c.response()
                assert res.status == 400, (path, raw[:40], res.status)
                assert res.json["error"]["code"] == "bad_request"
            # The connection is still usable, nothing reached the worker, nothing is booked.
            c.send(post("/generate", {"text": "ok"}))
            assert (await c.response()).status == 200
            c.close()
            assert len(w.inference()) == 1 and r.in_flight(w) == 0

    run(body())


def test_slow_loris_head_is_cut_at_the_header_read_timeout() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url], header_read_timeout_secs=0.3) as r:
            c = await RawClient(r.port).connect()
            c.send(b"POST /generate HTTP/1.1\r\nHost: x\r\n")

            async def trickle() -> None:
                for i in range(100):  # a header line every 50 ms, never finishing the head
                    if c.writer.is_closing():
                        return
                    c.send(b"X-Slow-%d: 1\r\n" % i)
                    await asyncio.sleep(0.05)

            t = asyncio.ensure_future(trickle())
            try:
                assert await c.closed(timeout=3.0)
            finally:
                t.cancel()
            assert c.p.responses == []  # closed without an answer, nothing routed
            await until(lambda: len(r.server.app.live.connections) == 0, what="connection dropped")
            await serving(r)
            assert w.inference()[-1].json["text"] == "still here"

    run(body())
