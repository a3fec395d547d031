"""Drain as smg does (so a rollout loses no request): on SIGTERM ``/readiness`` answers 503 at once on the main
port and the probe port, in every process, while the listener goes on accepting and serving new
requests as long as requests are in flight; the SSE streams in flight finish, then the router
exits 0 and the port refuses. A real router process (``--workers 1`` and ``2``), fake SGLang
workers holding streams open in the test's event loop."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys

import pytest

from tests.integration.conftest import RawClient, call, get, post, refuses, run, until, workers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _status(port: int, data: bytes) -> int | None:
    try:
        return (await call(port, data, timeout=5)).status
    except (OSError, EOFError, asyncio.TimeoutError):
        return None


@pytest.mark.parametrize("procs", ["1", "2"])
def test_sigterm_readiness_503_everywhere_while_streams_finish_and_new_requests_are_served(procs: str) -> None:
    async def body() -> None:
        (w,) = await workers(1)
        port, probe = _free_port(), _free_port()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "fastroute",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--health-check-port",
            str(probe),
            "--worker-urls",
            w.url,
            "--policy",
            "round_robin",
            "--prometheus-port",
            "0",
            "--workers",
            procs,
            "--shutdown-grace-period-secs",
            "120",
            "--worker-startup-check-interval",
            "1",
            "--disable-health-check",
            "--log-level",
            "warning",
            env={**os.environ, "PYTHONPATH": os.getcwd()},
        )
        streams: list[RawClient] = []
        try:

            async def every_process_ready() -> None:
                while True:  # 20 fresh connections in a row: both processes under --workers 2
                    if all([await _status(port, get("/readiness")) == 200 for _ in range(20)]):
                        return
                    await asyncio.sleep(0.05)

            await asyncio.wait_for(every_process_ready(), 30)
            assert await _status(probe, get("/readiness")) == 200

            w.stream_gate = asyncio.Event()  # streams stop after their first event
            for i in range(4):
                c = await RawClient(port).connect()
                c.send(post("/generate", {"text": f"stream {i}", "stream": True}))
                streams.append(c)
            await until(lambda: w.held == 4, 10.0, "4 streams in flight")
            for c in streams:
                await c.until_body(b"tok0", timeout=10)

            proc.send_signal(signal.SIGTERM)

            async def draining_everywhere() -> None:
                while True:
                    main = [await _status(port, get("/readiness")) for _ in range(20)]
                    if main == [503] * 20 and await _status(probe, get("/readiness")) == 503:
                        return
                    assert None not in main, f"a connection was refused while draining: {main}"
                    await asyncio.sleep(0.01)

            await asyncio.wait_for(draining_everywhere(), 20)

            # A client that keeps sending during the grace period is served, on new connections.
            served = 0
            for i in range(30):
                res = await call(port, post("/generate", {"text": f"new {i}"}), timeout=10)
                assert res.status == 200, res.body
                assert res.headers.get("connection") == "close"  # moves on to another router
                served += 1
                assert (await call(port, get("/health"))).status == 200
            assert served == 30 and proc.returncode is None
            assert await _status(port, get("/readiness")) == 503
            assert await _status(probe, get("/readiness")) == 503

            w.stream_gate.set()  # the streams in flight finish
            for c in streams:
                res = await c.response(timeout=20)
                assert res.status == 200 and b"data: [DONE]" in res.body
                assert b"tok2" in res.body
            assert await asyncio.wait_for(proc.wait(), 60) == 0
            assert await refuses(port) and await refuses(probe)
        finally:
            for c in streams:
                c.close()
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await w.stop()

    run(body(), timeout=150)
