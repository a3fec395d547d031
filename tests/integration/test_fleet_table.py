"""A fleet-sized target table: 8,192 DP ranks register and every one of them is routed to (real
router, 32 simulated DP-256 SGLang servers over loopback), and a --max-targets that the shared
memory cannot hold refuses to start naming the flag (a real router process)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tracemalloc

from fastroute.core.table import NCOLS, NHDR
from fastroute.sim.engine import SimParams
from fastroute.sim.http import HttpConnection
from fastroute.sim.server import SimWorker
from tests.integration.conftest import Router, run, until

SERVERS, DP = 32, 256  # 8,192 targets: the default --max-targets


def test_8192_ranks_register_and_each_is_routed_to():
    async def body():
        params = SimParams(dp_size=DP, time_scale=0.0001, max_new_tokens=1)
        sims = [SimWorker("regular", params) for _ in range(SERVERS)]
        for s in sims:
            await s.start()
        try:
            urls = [f"http://127.0.0.1:{s.port}" for s in sims]
            async with Router(
                worker_urls=urls,
                dp_aware=True,
                policy="round_robin",
                max_targets_per_worker=DP,
                disable_load_monitoring=True,
                worker_startup_timeout_secs=60,
            ) as r:
                reg, tab = r.server.registry, r.server.table

                def registered() -> int:
                    return sum(len(w.targets) for u in urls if (w := reg.find(u)) is not None and w.status == "ready")

                await until(lambda: registered() == SERVERS * DP, 60, "every rank registered")
                rows = [t for u in urls for t in reg.find(u).targets]
                assert len(rows) == len(set(rows)) == SERVERS * DP
                assert tab.capacity >= SERVERS * DP
                # One pass of round robin over every rank: each rank of each server gets one.
                conns = [HttpConnection("127.0.0.1", r.port) for _ in range(16)]
                req = json.dumps({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}).encode()

                async def client(c: HttpConnection, n: int) -> list[int]:
                    out = []
                    for _ in range(n):
                        status, _, _ = await c.request("POST", "/generate", req)
                        out.append(status)
                    return out

                per = SERVERS * DP // len(conns)
                statuses = [s for got in await asyncio.gather(*(client(c, per) for c in conns)) for s in got]
                assert statuses == [200] * (SERVERS * DP)
                await until(lambda: all(tab.in_flight(t) == 0 for t in rows), 10, "every lease released")
                for s in sims:
                    assert s.decode is not None
                    assert s.decode.placed == [1] * DP, f"worker {s.port}: ranks placed {s.decode.placed}"
        finally:
            for s in sims:
                await s.stop()

    run(body(), 120)


def test_a_table_larger_than_the_shared_memory_refuses_to_start_naming_the_flag():
    st = os.statvfs("/dev/shm")
    free = st.f_bavail * st.f_frsize
    workers, rows = 8, 1 << 24  # the largest --max-targets, once for the table, once per ledger
    need = (workers + 1) * (NHDR + rows * NCOLS) * 8
    assert need > free, f"/dev/shm holds {free} bytes: more than this test can ask for ({need})"
    argv = [sys.executable, "-m", "fastroute", "--host", "127.0.0.1", "--port", "20417"]
    argv += ["--workers", str(workers), "--max-targets", str(rows), "--prometheus-port", "20418"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # a router that started after all: stop it and its processes
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 1, stderr
    last = stderr.strip().splitlines()[-1]
    assert "--max-targets 16777216" in last and "shared memory" in last and "/dev/shm" in last, stderr


def test_a_scrape_reads_the_rows_in_use_not_the_whole_table():
    """With the default --max-targets (8,192 rows, 1.5 MB per copy) and two workers, a
    /metrics render allocates what the two workers need, not a copy of the whole table."""

    async def body():
        params = SimParams(dp_size=2, time_scale=0.001)
        sims = [SimWorker("regular", params) for _ in range(2)]
        for s in sims:
            await s.start()
        try:
            urls = [f"http://127.0.0.1:{s.port}" for s in sims]
            async with Router(worker_urls=urls, dp_aware=True, disable_load_monitoring=True) as r:
                assert r.server.table.capacity == 8192
                metrics = r.server.metrics
                assert b'smg_worker_requests_active{worker="' in metrics.render()  # warm
                tracemalloc.start()
                try:
                    tracemalloc.reset_peak()
                    text = metrics.render()
                    peak = tracemalloc.get_traced_memory()[1]
                finally:
                    tracemalloc.stop()
                assert urls[0].encode() in text
                assert peak < NHDR * 8 + 8192 * NCOLS * 8 // 2, peak  # under half a table copy
        finally:
            for s in sims:
                await s.stop()

    run(body(), 60)
