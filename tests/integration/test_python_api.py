"""A script that starts fastroute through the SGLang router's Python API serves traffic."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import textwrap

from tests.integration.conftest import call, get, post, run, workers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_router_args_and_launch_router_serve_traffic() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        port, mport = _free_port(), _free_port()
        script = textwrap.dedent(f"""
            from fastroute.launch_router import RouterArgs, launch_router
            launch_router(RouterArgs(worker_urls=[{w.url!r}], host="127.0.0.1", port={port},
                                     prometheus_host="127.0.0.1", prometheus_port={mport},
                                     policy="round_robin", worker_startup_check_interval=1,
                                     disable_health_check=True, shutdown_grace_period_secs=1))
        """)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", script, env={**os.environ, "PYTHONPATH": os.getcwd()}
        )
        try:

            async def ready() -> bool:
                try:
                    return (await call(port, get("/readiness"), timeout=1)).status == 200
                except (OSError, EOFError, asyncio.TimeoutError):
                    return False

            deadline = asyncio.get_running_loop().time() + 20
            while not await ready():
                assert proc.returncode is None, "router exited"
                assert asyncio.get_running_loop().time() < deadline, "router never became ready"
                await asyncio.sleep(0.1)
            for i in range(4):
                res = await call(port, post("/generate", {"text": f"hi {i}"}))
                assert res.status == 200 and res.json["text"] == f"hello from {w.name}"
            assert len(w.inference()) == 4
        finally:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 15)

    run(body(), timeout=60)
