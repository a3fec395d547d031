"""The router's RSS after many workers are added and removed through the admin API.

``PYTHONPATH=. python3 bench/worker_churn.py [--workers 10000] [--batch 500]``

A router process (``python -m fastroute`` on 127.0.0.1, round_robin, --dp-aware off) and one
fake worker on 0.0.0.0 that answers for every 127.x.y.z address (tests/integration's
PodWorker), in a child process of its own. ``--batch`` workers at a time are added with
``POST /workers`` (each a distinct address ``http://127.A.B.C:PORT``), awaited until every one
is ready, sent one request each, then removed with ``DELETE /workers/{id}``, until
``--workers`` have come and gone. The router's VmRSS (``/proc/PID/status``) is read after
start, after the first batch (the allocator's and the caches' working set) and at the end.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))

from test_discovery import PodWorker  # noqa: E402

from fastroute.sim.http import HttpError, fetch  # noqa: E402

H = "127.0.0.1"


def ip(i: int) -> str:
    return f"127.{1 + i // 62500}.{i // 250 % 250}.{i % 250 + 1}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((H, 0))
        return s.getsockname()[1]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return -1


def _worker(conn) -> None:
    async def run() -> None:
        w = await PodWorker("0.0.0.0").start()
        conn.send(w.port)
        await asyncio.get_running_loop().run_in_executor(None, conn.recv)
        await w.stop()

    asyncio.run(run())


async def churn(port: int, worker_port: int, first: int, n: int) -> None:
    ids = []
    for i in range(first, first + n):
        body = json.dumps({"url": f"http://{ip(i)}:{worker_port}"}).encode()
        status, doc = await fetch(H, port, "POST", "/workers", body)
        assert status == 202, doc
        ids.append(json.loads(doc)["worker_id"])
    deadline = time.monotonic() + 120
    while True:
        status, doc = await fetch(H, port, "GET", "/workers")
        listed = json.loads(doc)["workers"]
        if sum(1 for w in listed if w["status"] == "ready") == n:
            break
        assert time.monotonic() < deadline, "workers not ready"
        await asyncio.sleep(0.1)
    gen = json.dumps({"text": "hello"}).encode()
    for _ in range(n):
        status, _ = await fetch(H, port, "POST", "/generate", gen)
        assert status == 200
    for wid in ids:
        status, doc = await fetch(H, port, "DELETE", f"/workers/{wid}")
        assert status == 202, doc


async def main(total: int, batch: int) -> dict:
    parent, child = multiprocessing.Pipe()
    wproc = multiprocessing.get_context("fork").Process(target=_worker, args=(child,))
    wproc.start()
    worker_port = parent.recv()
    port = free_port()
    router = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fastroute",
            "--host",
            H,
            "--port",
            str(port),
            "--prometheus-host",
            H,
            "--prometheus-port",
            str(free_port()),
            "--policy",
            "round_robin",
            "--disable-health-check",
            "--worker-startup-check-interval",
            "1",
            "--log-level",
            "warning",
        ],
        env={**os.environ, "PYTHONPATH": ROOT},
    )
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                await fetch(H, port, "GET", "/health")
                break
            except (OSError, HttpError):
                assert time.monotonic() < deadline, "router not up"
                await asyncio.sleep(0.1)
        out = {"workers": total, "batch": batch, "rss_kib_start": rss_kib(router.pid)}
        done = 0
        t0 = time.monotonic()
        while done < total:
            n = min(batch, total - done)
            await churn(port, worker_port, done, n)
            done += n
            if done == n:
                out["rss_kib_after_first_batch"] = rss_kib(router.pid)
        await asyncio.sleep(1.0)  # let the reaper and the monitor settle
        out["rss_kib_end"] = rss_kib(router.pid)
        status, doc = await fetch(H, port, "GET", "/workers")
        out["workers_left"] = json.loads(doc)["total"]
        out["seconds"] = round(time.monotonic() - t0, 1)
        return out
    finally:
        router.terminate()
        router.wait(20)
        parent.send("stop")
        wproc.join(10)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=10_000)
    ap.add_argument("--batch", type=int, default=500)
    ns = ap.parse_args()
    print(json.dumps(asyncio.run(main(ns.workers, ns.batch))))
