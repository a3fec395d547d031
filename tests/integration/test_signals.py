"""A real router process and the signals operators and terminals send:
SIGHUP and SIGQUIT drain like SIGTERM (readiness 503, the request in flight finishes, then the
listener closes, exit 0), SIGUSR1 is ignored and the router keeps serving."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys

import pytest
from conftest import RawClient, call, get, post, refuses, run, until, workers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def start_router(w_url: str, *extra: str) -> tuple[asyncio.subprocess.Process, int]:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "fastroute",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        w_url,
        "--policy",
        "round_robin",
        "--prometheus-port",
        "0",
        "--shutdown-grace-period-secs",
        "30",
        "--log-level",
        "warn",
        *extra,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )

    async def ready() -> None:
        while True:
            try:
                if (await call(port, post("/generate", {"text": "up?"}), timeout=2)).status == 200:
                    return
            except OSError:
                pass
            await asyncio.sleep(0.05)

    try:
        await asyncio.wait_for(ready(), 20)
    except BaseException:
        proc.kill()
        await proc.wait()
        raise
    return proc, port


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGQUIT], ids=["SIGHUP", "SIGQUIT"])
@pytest.mark.parametrize("procs", ["1", "2"])
def test_hup_and_quit_drain_like_term(sig: signal.Signals, procs: str) -> None:
    async def body() -> None:
        (w,) = await workers(1)
        proc, port = await start_router(w.url, "--workers", procs)
        try:
            w.hold()
            c = await RawClient(port).connect()
            c.send(post("/generate", {"text": "in flight"}))
            await until(lambda: w.held == 1, 10.0, "request held by the worker")
            proc.send_signal(sig)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20
            # draining: /readiness 503 while the listener still answers (smg's drain). With two
            # processes on one SO_REUSEPORT port the idle one stops at once: a poll queued on its
            # closing listener is reset by the kernel, which is no answer either way.
            while True:
                try:
                    if (await call(port, get("/readiness"), timeout=5)).status == 503:
                        break
                except ConnectionResetError:
                    pass
                assert proc.returncode is None and loop.time() < deadline
                await asyncio.sleep(0.05)
            assert proc.returncode is None  # still waiting for the held request
            w.release()
            res = await c.response(timeout=10)
            assert res.status == 200, res.body
            assert await asyncio.wait_for(proc.wait(), 20) == 0
            assert await refuses(port)
            c.close()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await w.stop()

    run(body(), timeout=90)


def test_usr1_is_ignored() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        proc, port = await start_router(w.url)
        try:
            for _ in range(3):
                proc.send_signal(signal.SIGUSR1)
            res = await call(port, post("/generate", {"text": "still here"}), timeout=5)
            assert res.status == 200 and proc.returncode is None
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 20) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await w.stop()

    run(body(), timeout=60)
