"""Hostile clients and misbehaving workers over real sockets.

Every case asserts the answer the client gets, that in-flight counts return to 0, and that the
router keeps serving. The misbehaving worker is the recording ``DataWorker`` with a scripted
answer per inference request: informational (1xx) heads before the answer, unsolicited extra
responses on a kept-alive connection, huge heads.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import urllib.request

import pytest

from tests.integration.conftest import (
    DataWorker,
    RawClient,
    Rec,
    Router,
    _WorkerConn,
    call,
    get,
    post,
    run,
    until,
    workers,
)

# ------------------------------------------------------------------------------ misbehaving worker

RESET = object()  # in a script: abort the connection (a TCP reset)


class _ScriptedConn(_WorkerConn):
    """Answers inference requests with ``w.script(rec)``: bytes, pauses (floats) and RESET
    (control paths as usual)."""

    async def _respond(self, rec: Rec, keep: bool) -> None:
        w = self.w
        if w.control(rec.path) is not None or not isinstance(w, ScriptedWorker) or w.script is None:
            await super()._respond(rec, keep)
            return
        for part in w.script(rec):
            if part is RESET:
                self.transport.abort()
                return
            if isinstance(part, float):
                await asyncio.sleep(part)
            elif not self._write(part):
                return
        self.busy = False


class ScriptedWorker(DataWorker):
    """DataWorker whose inference answers are scripted byte sequences (floats are pauses, RESET
    aborts); ``loads_override`` replaces its /v1/loads answer."""

    def __init__(self, **kw) -> None:
        super().__init__(**kw)
        self.script = None
        self.loads_override: bytes | None = None

    def control(self, path: str):
        if path == "/v1/loads" and self.loads_override is not None:
            return 200, self.loads_override
        return super().control(path)

    async def start(self) -> ScriptedWorker:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _ScriptedConn(self), "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self


def tag_of(rec: Rec) -> bytes:
    return json.loads(rec.body)["text"].encode()


def answer(rec: Rec, extra_head: bytes = b"") -> bytes:
    body = b'{"text": "answer to ' + tag_of(rec) + b'"}'
    return (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        + extra_head
        + b"content-length: %d\r\n\r\n" % len(body)
        + body
    )


_STRAY_BODY = b'{"text": "stray-bytes"}'
STRAY = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b" % (
    len(_STRAY_BODY),
    _STRAY_BODY,
)

SCRIPTS = {
    "103-early-hints": lambda rec: [b"HTTP/1.1 103 Early Hints\r\nlink: </x.css>; rel=preload\r\n\r\n", answer(rec)],
    "100-continue": lambda rec: [b"HTTP/1.1 100 Continue\r\n\r\n", answer(rec)],
    "two-1xx": lambda rec: [b"HTTP/1.1 102 Processing\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\n\r\n", answer(rec)],
    "extra-response": lambda rec: [answer(rec), STRAY],
    "late-response": lambda rec: [answer(rec), 0.05, STRAY],
}


async def distinct_answers(port: int, n: int) -> None:
    """n sequential then n concurrent requests, each must get the answer to its own tag."""
    for i in range(n):
        res = await call(port, post("/generate", {"text": f"seq-{i}"}))
        assert res.status == 200, res.body
        assert res.json["text"] == f"answer to seq-{i}"

    async def one(i: int) -> None:
        res = await call(port, post("/generate", {"text": f"par-{i}"}))
        assert res.status == 200, res.body
        assert res.json["text"] == f"answer to par-{i}"

    await asyncio.gather(*(one(i) for i in range(n)))


@pytest.mark.parametrize("case", sorted(SCRIPTS))
def test_no_crossed_responses_regular(case: str) -> None:
    async def body() -> None:
        w = await ScriptedWorker().start()
        w.script = SCRIPTS[case]
        async with Router(worker_urls=[w.url], request_timeout_secs=5) as r:
            await distinct_answers(r.port, 6)
            await until(lambda: r.in_flight(w) == 0, what="released")

    run(body())


@pytest.mark.parametrize("case", ["103-early-hints", "extra-response", "late-response"])
def test_no_crossed_responses_pd(case: str) -> None:
    async def body() -> None:
        (p,) = await workers(1, role="prefill")
        d = await ScriptedWorker(role="decode").start()
        d.script = SCRIPTS[case]
        async with Router(pd_disaggregation=True, prefill=[(p.url, 8998)], decode=[d.url], request_timeout_secs=5) as r:
            await distinct_answers(r.port, 6)
            await until(lambda: r.in_flight(p) == 0 and r.in_flight(d) == 0, what="released")

    run(body())


def fails_with_502_then_serves(script) -> None:
    """A worker answering with ``script`` gets the client a 502, the booking is released and the
    next, normal answer is served."""

    async def body() -> None:
        w = await ScriptedWorker().start()
        w.script = script
        async with Router(worker_urls=[w.url], request_timeout_secs=5) as r:
            res = await call(r.port, post("/generate", {"text": "x"}))
            assert res.status == 502, res.body
            await until(lambda: r.in_flight(w) == 0, what="released")
            w.script = None
            assert (await call(r.port, post("/generate", {"text": "y"}))).status == 200

    run(body())


def test_101_is_not_relayed_as_a_final_answer() -> None:
    fails_with_502_then_serves(
        lambda rec: [b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\nconnection: upgrade\r\n\r\n"]
    )


def test_request_after_a_5mb_response_head_is_served() -> None:
    async def body() -> None:
        w = await ScriptedWorker().start()
        pad = b"x-pad: " + b"p" * (5 << 20) + b"\r\n"
        w.script = lambda rec: [answer(rec, pad if tag_of(rec) == b"big" else b"")]
        async with Router(worker_urls=[w.url], request_timeout_secs=5) as r:
            c = await RawClient(r.port).connect()
            try:
                c.send(post("/generate", {"text": "big"}))
                res = await c.response(timeout=10)
                assert res.status == 200 and res.json["text"] == "answer to big"
                for i in range(3):
                    c.send(post("/generate", {"text": f"after-{i}"}))
                    res = await c.response(timeout=5)
                    assert res.status == 200 and res.json["text"] == f"answer to after-{i}"
            finally:
                c.close()
            await until(lambda: r.in_flight(w) == 0, what="released")

    run(body())


# ------------------------------------------------------------------------------ hostile clients


@pytest.mark.parametrize("field", ["max_new_tokens", "max_tokens", "max_completion_tokens"])
def test_huge_token_counts_are_400_at_once(field: str) -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url], max_concurrent_requests=1) as r:
            for value in (2**63, 2**64 + 5, -1, 1e300):
                doc = (
                    {"text": "x", "sampling_params": {field: value}}
                    if field == "max_new_tokens"
                    else {"model": "m", "messages": [{"role": "user", "content": "x"}], field: value}
                )
                path = "/generate" if field == "max_new_tokens" else "/v1/chat/completions"
                t0 = time.monotonic()
                res = await call(r.port, post(path, doc), timeout=3)
                assert res.status == 400, (value, res.status, res.body)
                assert time.monotonic() - t0 < 1.0
                assert res.json["error"]["message"]
            assert w.inference() == []
            assert r.in_flight(w) == 0
            # the one admission slot is free again
            ok = await call(r.port, post("/generate", {"text": "fine"}))
            assert ok.status == 200

    run(body())


def test_stalled_body_is_closed_by_its_deadline() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url], header_read_timeout_secs=0.5) as r:
            c = await RawClient(r.port).connect()
            try:
                c.send(
                    b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b'Content-Length: 100\r\n\r\n{"text": '
                )
                t0 = time.monotonic()
                assert await c.closed(timeout=5)
                assert time.monotonic() - t0 < 3.0
                if c.p.responses:
                    assert c.p.responses[0].status == 408
            finally:
                c.close()
            assert w.inference() == []
            res = await call(r.port, post("/generate", {"text": "still"}))
            assert res.status == 200

    run(body())


def test_unterminated_header_is_cut_off_without_stalling_others() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url]) as r:
            c = await RawClient(r.port).connect()
            worst = 0.0
            stop = asyncio.Event()

            async def prober() -> None:
                nonlocal worst
                while not stop.is_set():
                    t0 = time.monotonic()
                    res = await call(r.port, get("/health"))
                    assert res.status == 200
                    worst = max(worst, time.monotonic() - t0)
                    await asyncio.sleep(0.01)

            task = asyncio.create_task(prober())
            try:
                c.send(b"POST /generate HTTP/1.1\r\nHost: x\r\nX-Big: ")
                chunk = b"a" * (1 << 20)
                closed = False
                for _ in range(32):
                    try:
                        c.send(chunk)
                        await c.writer.drain()
                    except (ConnectionError, OSError):
                        closed = True
                        break
                if not closed:
                    assert await c.closed(timeout=5)
                if c.p.responses:
                    assert c.p.responses[0].status == 431
            finally:
                stop.set()
                await task
                c.close()
            assert worst < 0.5, worst

    run(body())


def test_head_health_has_no_body_and_keeps_the_connection_usable() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url]) as r:
            reader, writer = await asyncio.open_connection("127.0.0.1", r.port)
            try:
                writer.write(b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                data = b""
                while data.count(b"HTTP/1.1 200") < 2 or not data.endswith(b"OK"):
                    chunk = await asyncio.wait_for(reader.read(65536), 3)
                    assert chunk, data
                    data += chunk
                first, _, rest = data.partition(b"\r\n\r\n")
                assert b"content-length: 2" in first.lower()
                assert rest.startswith(b"HTTP/1.1 200"), data  # no body bytes after the HEAD answer
            finally:
                writer.close()

    run(body())


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def test_big_bodies_do_not_outlive_their_request() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url]) as r:
            big = b'{"text": "' + b"a" * (50 << 20) + b'", "sampling_params": {"max_new_tokens": "x"}}'
            await call(r.port, post("/generate", {"text": "warm"}))
            start = _rss_mb()
            for _ in range(10):
                c = await RawClient(r.port).connect()
                try:
                    c.send(post("/generate", big))
                    res = await c.response(timeout=20)
                    assert res.status == 400
                finally:
                    c.close()
            del big
            await asyncio.sleep(0.1)
            grown = _rss_mb() - start
            assert grown < 100, f"RSS grew by {grown:.0f} MB"

    run(body(), timeout=120)


def test_pd_batch_over_the_cap_is_refused() -> None:
    async def body() -> None:
        (p,) = await workers(1, role="prefill")
        (d,) = await workers(1, role="decode")
        async with Router(pd_disaggregation=True, prefill=[(p.url, 8998)], decode=[d.url]) as r:
            res = await call(r.port, post("/generate", {"text": [""] * 1_000_000}), timeout=10)
            assert res.status in (400, 413), res.body
            assert res.json["error"]["message"]
            assert p.inference() == [] and d.inference() == []
            ok = await call(r.port, post("/generate", {"text": ["a", "b"]}))
            assert ok.status == 200

    run(body())


def test_client_rank_fields_do_not_reach_the_prefill_leg() -> None:
    async def body() -> None:
        (p,) = await workers(1, role="prefill", dp_size=2)
        (d,) = await workers(1, role="decode", dp_size=2)
        async with Router(pd_disaggregation=True, prefill=[(p.url, 8998)], decode=[d.url], dp_aware=True) as r:
            res = await call(r.port, post("/generate", {"text": "x", "routed_dp_rank": 1, "data_parallel_rank": 1}))
            assert res.status in (200, 400), res.body
            for rec in p.inference():
                j = rec.json
                assert "routed_dp_rank" not in j and "data_parallel_rank" not in j, j

    run(body())


# ------------------------------------------------------------------------------ control plane


async def _admin(port: int, method: str, path: str, doc=None) -> tuple[int, bytes]:
    data = json.dumps(doc).encode() if doc is not None else b""
    raw = (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    ).encode() + data
    res = await call(port, raw)
    return res.status, res.body


def test_worker_url_credentials_are_never_shown(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="fastroute")

    async def body() -> None:
        (w,) = await workers(1)
        (w2,) = await workers(1)
        secret_url = w2.url.replace("http://", "http://alice:s3cretpass@")
        async with Router(worker_urls=[w.url]) as r:
            status, doc = await _admin(r.port, "POST", "/workers", {"url": secret_url})
            assert status in (200, 201, 202), doc
            assert b"s3cretpass" not in doc
            await until(
                lambda: (
                    r.server.registry.find(w2.url) is not None
                    or any("127.0.0.1:%d" % w2.port in str(x.url) for x in r.server.registry.workers.values())
                ),
                what="registered",
            )
            status, doc = await _admin(r.port, "GET", "/workers")
            assert status == 200 and b"s3cretpass" not in doc
            json.loads(doc)
            mport = r.server.metrics.port
            text = await asyncio.to_thread(
                lambda: urllib.request.urlopen(f"http://127.0.0.1:{mport}/metrics", timeout=5).read()
            )
            assert b"s3cretpass" not in text

    run(body())
    assert "s3cretpass" not in caplog.text


@pytest.mark.parametrize(
    "doc",
    [
        {"api_key": 123},
        {"api_key": ["k"]},
        {"priority": 1e400},
        {"priority": "high"},
        {"cost": float("inf")},
        {"cost": float("nan")},
        {"cost": -1},
    ],
    ids=["key-int", "key-list", "priority-huge", "priority-str", "cost-inf", "cost-nan", "cost-neg"],
)
def test_bad_worker_fields_are_400(doc: dict) -> None:
    async def body() -> None:
        (w,) = await workers(1)
        (w2,) = await workers(1)
        async with Router(worker_urls=[w.url]) as r:
            raw = json.dumps({"url": w2.url, **doc}).encode()  # allows Infinity/NaN like a careless client
            req = (
                b"POST /workers HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%b" % (len(raw), raw)
            )
            res = await call(r.port, req)
            assert res.status == 400, res.body
            status, listing = await _admin(r.port, "GET", "/workers")
            assert status == 200
            json.loads(listing)  # strict JSON, no Infinity
            assert b"Infinity" not in listing and b"NaN" not in listing

    run(body())


def test_alias_spellings_of_one_backend_register_once() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url]) as r:
            for alias in (
                f"http://localhost:{w.port}",
                f"http://0x7f000001:{w.port}",
                f"http://127.0.0.1:{w.port}/",
                f"HTTP://127.0.0.1:{w.port}",
            ):
                status, doc = await _admin(r.port, "POST", "/workers", {"url": alias})
                assert status in (200, 202, 409), (alias, status, doc)
            await asyncio.sleep(0.3)
            status, doc = await _admin(r.port, "GET", "/workers")
            listing = json.loads(doc)
            ws = listing["workers"] if isinstance(listing, dict) else listing
            assert len(ws) == 1, ws

    run(body())
