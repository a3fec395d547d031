"""Event-loop lag while Kubernetes discovery takes a burst of pods (a slow pass would stall
every request on the same loop).

``PYTHONPATH=. python3 bench/discovery_burst.py [--listed 1000] [--events 500]``

The Kubernetes API stand-in of the tests (tests/integration/kubeapi.py) lists ``--listed``
pods (70 % Ready) to a router in this process, then ``--events`` watch events arrive (the
other 30 % turn Ready, the rest are new pods not Ready yet). One fake worker on 0.0.0.0
answers for every 127.x.y.z pod IP (the table holds 1,024 targets, so at most 1,000 become
workers); it and the stand-in run in a child process, so their work is not counted. A
ticker measures how late a 5 ms sleep wakes up (the longest the loop was blocked) and a client
times GET /health on the router meanwhile. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests", "integration"))

from conftest import call, get  # noqa: E402
from kubeapi import KubeApi, pod  # noqa: E402
from test_discovery import PodWorker  # noqa: E402

from fastroute.config import Config  # noqa: E402
from fastroute.runtime.assemble import freeze_heap  # noqa: E402
from fastroute.runtime.server import Server  # noqa: E402


def ip(i: int) -> str:
    return f"127.1.{i // 250}.{i % 250 + 1}"


def _cluster(listed: int, events: int, conn) -> None:
    """The API stand-in and the fake worker, in a process of their own (their heap and
    work are not the router's): lists ``listed`` pods, then on "go" sends the events."""

    async def run() -> None:
        api = await KubeApi().start()
        worker = await PodWorker("0.0.0.0").start()
        ready_listed = listed * 7 // 10
        for i in range(listed):
            api.pods[("team-a", f"p{i}")] = pod(f"p{i}", ip(i), ready=i < ready_listed)
        conn.send((api.kubeconfig(), worker.port))
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, conn.recv)
        for i in range(ready_listed, listed):
            await api.put(pod(f"p{i}", ip(i)))
            await asyncio.sleep(0)
        for i in range(listed, listed + events - (listed - ready_listed)):
            await api.put(pod(f"p{i}", ip(i), ready=False))
            await asyncio.sleep(0)
        await loop.run_in_executor(None, conn.recv)
        await api.stop()
        await worker.stop()

    asyncio.run(run())


async def main(listed: int, events: int) -> dict:
    parent, child = multiprocessing.Pipe()
    cluster = multiprocessing.get_context("fork").Process(target=_cluster, args=(listed, events, child))
    cluster.start()
    kubeconfig, worker_port = parent.recv()
    tmp = tempfile.mkdtemp()
    with open(os.path.join(tmp, "kubeconfig"), "w") as f:
        f.write(kubeconfig)
    os.environ["KUBECONFIG"] = os.path.join(tmp, "kubeconfig")
    os.environ.pop("KUBERNETES_SERVICE_HOST", None)
    loop = asyncio.get_running_loop()
    gc_max = [0.0, 0.0]

    def gc_timer(phase, info):
        if phase == "start":
            gc_max[1] = time.perf_counter()
        else:
            gc_max[0] = max(gc_max[0], time.perf_counter() - gc_max[1])

    gc.callbacks.append(gc_timer)
    lag = [0.0]
    health: list[float] = []

    async def ticker():
        while True:
            t = loop.time()
            await asyncio.sleep(0.005)
            lag[0] = max(lag[0], loop.time() - t - 0.005)

    async def prober(port: int):
        while True:
            t = time.perf_counter()
            await call(port, get("/health"), timeout=120)
            health.append(time.perf_counter() - t)
            await asyncio.sleep(0.01)

    server = Server(
        Config(
            host="127.0.0.1",
            port=0,
            policy="round_robin",
            worker_startup_check_interval=1,
            disable_health_check=True,
            disable_load_monitoring=True,
            shutdown_grace_period_secs=1,
            prometheus_host="127.0.0.1",
            prometheus_port=0,
            service_discovery=True,
            selector=["app=sglang"],
            service_discovery_namespace="team-a",
            service_discovery_port=worker_port,
        )
    )
    t0 = time.perf_counter()
    await server.start()
    freeze_heap()  # as serve() does after start-up
    gc_max[0] = 0.0  # (freeze_heap's own full collection is start-up)
    tasks = [loop.create_task(ticker()), loop.create_task(prober(server.port))]
    want = min(listed, 1000)  # every listed pod ends Ready; the new ones are not yet
    try:
        while len(server.registry.workers) < listed * 7 // 10:  # the list is in
            await asyncio.sleep(0.01)
        parent.send("go")
        while sum(1 for w in server.registry.workers if w.status == "ready") < want:
            await asyncio.sleep(0.05)
        took = time.perf_counter() - t0
    finally:
        for t in tasks:
            t.cancel()
        await server.stop(grace=0.5)
        parent.send("stop")
        cluster.join(10)
    return {
        "listed": listed,
        "events": events,
        "workers": want,
        "seconds_to_all": round(took, 2),
        "max_loop_lag_ms": round(lag[0] * 1000, 1),
        "max_gc_pause_ms": round(gc_max[0] * 1000, 1),
        "health_max_ms": round(max(health) * 1000, 1) if health else None,
        "health_p50_ms": round(sorted(health)[len(health) // 2] * 1000, 2) if health else None,
        "health_probes": len(health),
    }


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--listed", type=int, default=1000)
    ap.add_argument("--events", type=int, default=500)
    a = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.WARNING)
    print(json.dumps(asyncio.run(main(a.listed, a.events))))
