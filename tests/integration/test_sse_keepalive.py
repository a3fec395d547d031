"""SSE keep-alive comments over real sockets (so idle proxies do not cut a waiting stream).

While a stream waits for its first upstream byte (a long prefill, a queue in the engine), the
router sends ``: keep-alive`` comments every ``--sse-keepalive-secs`` under a committed 200
``text/event-stream`` head; the first upstream byte stops them and the events follow as usual.
"""

from __future__ import annotations

import asyncio
import json

import httptools

from tests.integration.conftest import Router, call, post, run, until, workers

KA = b": keep-alive\n\n"


class _Body:
    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.body = b""
        self.done = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.lower()] = value

    def on_body(self, data: bytes) -> None:
        self.body += data

    def on_message_complete(self) -> None:
        self.done = True


async def _open_stream(
    port: int, path: str, doc: dict
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, _Body, httptools.HttpResponseParser]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(post(path, doc))
    b = _Body()
    return reader, writer, b, httptools.HttpResponseParser(b)


async def _read_until(reader, parser, b: _Body, cond, timeout: float = 5.0) -> None:
    async def loop() -> None:
        while not cond():
            data = await reader.read(65536)
            if not data:
                return
            parser.feed_data(data)

    await asyncio.wait_for(loop(), timeout)


def test_keepalive_while_the_first_token_is_late_then_the_stream_ends_with_done() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url], sse_keepalive_secs=0.1) as r:
            w.hold()  # the worker holds the response head: the "first token" is late
            reader, writer, b, parser = await _open_stream(
                r.port,
                "/v1/chat/completions",
                {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True},
            )
            await _read_until(reader, parser, b, lambda: b.body.count(KA) >= 3)
            assert parser.get_status_code() == 200
            assert b.headers[b"content-type"].startswith(b"text/event-stream")
            assert b"data:" not in b.body  # only comments so far
            n = b.body.count(KA)
            w.release()
            await _read_until(reader, parser, b, lambda: b.done)
            assert b.done and b.body.endswith(b"data: [DONE]\n\n")
            events = b.body.split(b"\n\n")
            # comments only before the first event, never inside one, none after it
            first = next(i for i, e in enumerate(events) if e.startswith(b"data:"))
            assert all(e == b": keep-alive" for e in events[:first])
            assert b": keep-alive" not in events[first:]
            assert first == n
            writer.close()
            # the connection still works for the next request (keep-alive)
            res = await call(r.port, post("/generate", {"text": "x"}))
            assert res.status == 200

    run(body())


def test_no_keepalive_when_the_first_byte_is_prompt_or_when_off() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        for ka in (0.2, 0.0):
            async with Router(worker_urls=[w.url], sse_keepalive_secs=ka) as r:
                res = await call(r.port, post("/generate", {"text": "x", "stream": True}))
                assert res.status == 200 and KA not in res.body
                assert res.body.endswith(b"data: [DONE]\n\n")

    run(body())


def test_keepalive_on_the_pd_path_while_the_prefill_runs() -> None:
    async def body() -> None:
        (p,) = await workers(1, role="prefill")
        (d,) = await workers(1, role="decode")
        async with Router(pd_disaggregation=True, prefill=[(p.url, 8998)], decode=[d.url], sse_keepalive_secs=0.1) as r:
            p.hold()  # a long prefill: the decode waits for it, so nothing reaches the client
            reader, writer, b, parser = await _open_stream(r.port, "/generate", {"text": "x", "stream": True})
            await _read_until(reader, parser, b, lambda: b.body.count(KA) >= 2)
            assert b"data:" not in b.body
            p.release()
            await _read_until(reader, parser, b, lambda: b.done)
            assert b.body.endswith(b"data: [DONE]\n\n")
            assert b.body.count(b"data: {") == d.events
            writer.close()

    run(body())


def test_worker_error_after_keepalive_is_an_sse_error_event() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url], sse_keepalive_secs=0.1, disable_retries=True) as r:
            w.hold()
            w.status = 400
            reader, writer, b, parser = await _open_stream(r.port, "/generate", {"text": "x", "stream": True})
            await _read_until(reader, parser, b, lambda: KA in b.body)
            w.release()
            await _read_until(reader, parser, b, lambda: b.done)
            assert b.done and b.body.endswith(b"data: [DONE]\n\n")
            err = [e for e in b.body.split(b"\n\n") if e.startswith(b"data: {")]
            assert json.loads(err[0][6:])["error"]["status"] == 400
            writer.close()
            await until(lambda: r.in_flight(w) == 0, what="released")

    run(body())


def _comments_then_events(body: bytes) -> None:
    events = body.split(b"\n\n")
    first = next(i for i, e in enumerate(events) if e.startswith(b"data:"))
    assert first >= 2 and all(e == b": keep-alive" for e in events[:first]), events[: first + 1]
    assert b": keep-alive" not in events[first:]


def test_keepalive_goes_on_after_the_workers_head_until_the_first_event() -> None:
    """SGLang (uvicorn) sends the event-stream head at once and the first event after the
    prefill: the router forwards that head and keeps sending comments until the event."""

    async def body() -> None:
        (w,) = await workers(1)
        async with Router(worker_urls=[w.url], sse_keepalive_secs=0.1) as r:
            w.head_gate = asyncio.Event()
            reader, writer, b, parser = await _open_stream(r.port, "/generate", {"text": "x", "stream": True})
            await until(lambda: w.held == 1, 5, "the worker sent its head and holds")
            await _read_until(reader, parser, b, lambda: b.body.count(KA) >= 3)
            assert parser.get_status_code() == 200 and b"data:" not in b.body
            assert b.headers[b"content-type"].startswith(b"text/event-stream")
            w.head_gate.set()
            await _read_until(reader, parser, b, lambda: b.done)
            assert b.body.endswith(b"data: [DONE]\n\n")
            _comments_then_events(b.body)
            writer.close()

    run(body())


def test_pd_decode_head_before_the_first_event_gets_keepalives() -> None:
    async def body() -> None:
        (p,) = await workers(1, role="prefill")
        (d,) = await workers(1, role="decode")
        async with Router(pd_disaggregation=True, prefill=[(p.url, 8998)], decode=[d.url], sse_keepalive_secs=0.1) as r:
            d.head_gate = asyncio.Event()
            reader, writer, b, parser = await _open_stream(r.port, "/generate", {"text": "x", "stream": True})
            await _read_until(reader, parser, b, lambda: b.body.count(KA) >= 3)
            assert parser.get_status_code() == 200 and b"data:" not in b.body
            d.head_gate.set()
            await _read_until(reader, parser, b, lambda: b.done)
            assert b.body.endswith(b"data: [DONE]\n\n")
            _comments_then_events(b.body)
            writer.close()

    run(body())
