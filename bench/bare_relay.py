"""Bare relay: the "Python floor" of a router's data path, used only by bench/overhead.py.

uvloop + httptools, round robin over upstream workers, keep-alive upstream connections, upstream
response bytes written to the client verbatim (no re-framing, no body parsing, no metrics, no
backpressure, no retries). With ``--prefill`` it also sends every request to a prefill worker at
the same time and discards that answer (mini_lb-like PD floor: two legs, no body rewriting).
Usage: ``python bench/bare_relay.py --port P --upstream http://127.0.0.1:A [--prefill URL ...]``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from urllib.parse import urlsplit

import httptools
import uvloop


class Pool:
    """Idle keep-alive connections to one worker."""

    def __init__(self, url: str) -> None:
        u = urlsplit(url)
        self.host, self.port = u.hostname or "127.0.0.1", u.port or 80
        self.host_hdr = u.netloc.encode()
        self.idle: list[Upstream] = []

    async def get(self) -> Upstream:
        if self.idle:
            return self.idle.pop()
        loop = asyncio.get_running_loop()
        _, conn = await loop.create_connection(lambda: Upstream(self), self.host, self.port)
        return conn


class Upstream(asyncio.Protocol):
    """One upstream connection; bytes of the current response go to ``sink`` (or nowhere)."""

    def __init__(self, pool: Pool) -> None:
        self.pool, self.parser = pool, httptools.HttpResponseParser(self)
        self.sink: asyncio.Transport | None = None
        self.done: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        sink = self.sink
        if sink is not None and not sink.is_closing():
            sink.write(data)
        self.parser.feed_data(data)  # fires on_message_complete at the end of the response

    def on_message_complete(self) -> None:
        done, self.done, self.sink = self.done, None, None
        if self.parser.should_keep_alive():
            self.pool.idle.append(self)  # invariant: only idle connections sit in the pool
        else:
            self.transport.close()
        if done is not None and not done.done():
            done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.pool.idle:
            self.pool.idle.remove(self)
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError("upstream closed"))


class Client(asyncio.Protocol):
    """One client connection; requests are relayed one after another (pipelining is serialised)."""

    def __init__(self, decode: itertools.cycle, prefill: itertools.cycle | None) -> None:
        self.decode, self.prefill = decode, prefill
        self.parser = httptools.HttpRequestParser(self)
        self.url, self.body, self.ctype = b"", [], b"application/json"
        self.tail: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"content-type":
            self.ctype = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self.body)
        head = b"%s %s HTTP/1.1\r\nContent-Type: %s\r\nContent-Length: %d\r\n" % (
            self.parser.get_method(),
            self.url,
            self.ctype,
            len(body),
        )
        self.url, self.body = b"", []
        self.tail = asyncio.ensure_future(self.relay(head, body, self.tail))

    async def relay(self, head: bytes, body: bytes, prev: asyncio.Future[None] | None) -> None:
        if prev is not None:
            await prev
        legs = [self.leg(next(self.decode), head, body, self.transport)]
        if self.prefill is not None:
            legs.append(self.leg(next(self.prefill), head, body, None))
        try:
            await asyncio.gather(*legs)
        except Exception:  # the floor has no error mapping: drop the client connection
            self.transport.close()

    @staticmethod
    async def leg(pool: Pool, head: bytes, body: bytes, sink: asyncio.Transport | None) -> None:
        conn = await pool.get()
        conn.sink, conn.done = sink, asyncio.get_running_loop().create_future()
        conn.transport.write(head + b"Host: " + pool.host_hdr + b"\r\n\r\n" + body)
        await conn.done


async def serve(args: argparse.Namespace) -> None:
    decode = itertools.cycle([Pool(u) for u in args.upstream])
    prefill = itertools.cycle([Pool(u) for u in args.prefill]) if args.prefill else None
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Client(decode, prefill), args.host, args.port, backlog=4096)
    async with server:
        await server.serve_forever()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--upstream", nargs="+", required=True, help="worker (decode) URLs")
    ap.add_argument("--prefill", nargs="*", default=[], help="prefill URLs (PD floor)")
    uvloop.run(serve(ap.parse_args()))


if __name__ == "__main__":
    main()
