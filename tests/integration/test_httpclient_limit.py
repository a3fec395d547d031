"""A worker's answer to a control call is bounded: past the limit it is refused, not buffered."""

from __future__ import annotations

import asyncio

import pytest

from fastroute.control import httpclient
from fastroute.control.httpclient import MAX_RESPONSE_BYTES, HttpProtocolError
from tests.integration.conftest import run

_CHUNK = b"\0" * (1 << 20)


async def _huge_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Answers any request with a well-framed body twice the client's limit."""
    await reader.readuntil(b"\r\n\r\n")
    size = 2 * MAX_RESPONSE_BYTES
    writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {size}\r\n\r\n".encode())
    try:
        for _ in range(size // len(_CHUNK)):
            writer.write(_CHUNK)
            await writer.drain()
    except ConnectionError:
        pass  # the client gave up, as it should
    finally:
        writer.close()


@pytest.mark.parametrize("pooled", [False, True])
def test_an_answer_over_the_limit_is_refused_as_malformed(pooled: bool) -> None:
    async def go() -> None:
        server = await asyncio.start_server(_huge_answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        pool = httpclient.Pool() if pooled else None
        try:
            with pytest.raises(HttpProtocolError, match="exceeds"):
                await httpclient.request("GET", f"http://127.0.0.1:{port}/v1/loads", timeout=60, pool=pool)
            assert pool is None or len(pool) == 0  # the connection is not kept
        finally:
            if pool is not None:
                pool.close()
            server.close()
            await server.wait_closed()

    run(go(), timeout=90)
