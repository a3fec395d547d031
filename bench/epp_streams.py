"""How many concurrent ext_proc streams ``fastroute epp`` holds: served or refused, counted.

Starts one simulated worker (fastroute.sim) and ``fastroute epp`` (round robin: the pick is made on
the request headers) as a subprocess on loopback, then opens ``--streams`` Process streams at
once over ``--channels`` gRPC channels. Each stream sends its request headers and waits for the
pick; every stream stays open until all have an answer or failed, then all are cancelled. Prints
the streams served (picked), the ones that failed by gRPC status, the picker's own counters
(``fastroute_epp_streams_refused_total``, ``fastroute_epp_streams_open``) and resident memory
while they are open, the in-flight count after the streams end, and the picker's log lines.

Usage: ``python bench/epp_streams.py [--streams 5000] [--channels 1] [--timeout 60]``.
Every wait is bounded by ``--timeout``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import grpc  # noqa: E402
from envoy.config.core.v3 import base_pb2  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from fastroute.sim.worker import start_cluster  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rss_mb(pid: int) -> float:
    """Resident memory of a process in MB (Linux /proc), 0 when unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def _headers() -> Any:
    hm = pb.HttpHeaders(end_of_stream=False)
    for k, v in ((":method", "POST"), (":path", "/generate"), (":authority", "bench")):
        hm.headers.headers.append(base_pb2.HeaderValue(key=k, raw_value=v.encode()))
    return pb.ProcessingRequest(request_headers=hm)


async def _metrics(port: int) -> dict[str, float]:
    r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
    w.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
    data = await asyncio.wait_for(r.read(), 10)
    w.close()
    out: dict[str, float] = {}
    for line in data.split(b"\r\n\r\n", 1)[-1].decode().splitlines():
        if line.startswith("fastroute_epp_") or line.startswith("fastroute_target_in_flight"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


async def _wait_serving(port: int, deadline: float) -> None:
    loop = asyncio.get_running_loop()
    while loop.time() < deadline:
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=1)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        except grpc.aio.AioRpcError:
            pass
        await asyncio.sleep(0.1)
    raise SystemExit("the picker never became SERVING")


async def run(ns: argparse.Namespace) -> int:
    loop = asyncio.get_running_loop()
    cluster = await start_cluster(0, 1)
    worker = cluster.decodes[0]
    grpc_port, mport = free_port(), free_port()
    log_path = os.path.join(tempfile.mkdtemp(prefix="epp-streams-"), "epp.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "fastroute",
                "epp",
                "--host",
                "127.0.0.1",
                "--grpc-port",
                str(grpc_port),
                "--worker-urls",
                worker.url,
                "--policy",
                "round_robin",
                "--disable-health-check",
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(mport),
                "--log-level",
                "warning",
                *ns.epp_flag,
            ],
            stderr=log,
            env={**os.environ, "PYTHONPATH": REPO},
        )
    try:
        await _wait_serving(grpc_port, loop.time() + ns.timeout)
        rss_idle = _rss_mb(proc.pid)
        # a local subchannel pool each: one TCP connection per channel
        opts = [("grpc.use_local_subchannel_pool", 1)]
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}", options=opts) for _ in range(ns.channels)]
        calls: list[Any] = []
        outcome: Counter[str] = Counter()
        details: dict[str, str] = {}  # one failure's details per status
        all_answered = asyncio.Event()
        pending = [ns.streams]

        async def one(i: int) -> None:
            call = pb_grpc.ExternalProcessorStub(channels[i % len(channels)]).Process()
            calls.append(call)
            stage = "write"
            try:
                await call.write(_headers())
                stage = "read"
                ans = await call.read()
                kind = "EOF" if ans is grpc.aio.EOF else ans.WhichOneof("response")
                if kind == "request_headers":
                    outcome["served"] += 1
                elif kind == "immediate_response":
                    outcome[f"immediate {ans.immediate_response.status.code}"] += 1
                else:
                    outcome[f"answer {kind}"] += 1
            except grpc.aio.AioRpcError as exc:
                # A write the server already ended fails in the client's core with INTERNAL;
                # the call's own status says why the server ended it.
                code, text = exc.code(), exc.details()
                if code == grpc.StatusCode.INTERNAL:
                    try:
                        code = await asyncio.wait_for(call.code(), 5)
                        text = await call.details()
                    except (asyncio.TimeoutError, grpc.aio.AioRpcError):
                        pass
                outcome[f"failed {code.name} at {stage}"] += 1
                details.setdefault(code.name, str(text)[:200])
            except asyncio.CancelledError:
                outcome["unanswered"] += 1
                raise
            finally:
                pending[0] -= 1
                if pending[0] == 0:
                    all_answered.set()

        t0 = time.perf_counter()
        tasks = []
        for i in range(ns.streams):
            tasks.append(loop.create_task(one(i)))
            if ns.wave and (i + 1) % ns.wave == 0:
                await asyncio.sleep(0.05)  # let this wave's streams start before the next
        try:
            await asyncio.wait_for(all_answered.wait(), ns.timeout)
        except asyncio.TimeoutError:
            pass
        took = time.perf_counter() - t0
        during = await _metrics(mport)
        rss_open = _rss_mb(proc.pid)
        for t in tasks:
            t.cancel()
        for c in calls:
            c.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for ch in channels:
            await ch.close()
        after: dict[str, float] = {}
        deadline = loop.time() + ns.timeout
        while loop.time() < deadline:
            after = await _metrics(mport)
            if after.get("fastroute_epp_streams_open", 0.0) == 0.0:
                break
            await asyncio.sleep(0.2)
        print(f"streams {ns.streams} over {ns.channels} channel(s), answered in {took:.1f} s")
        for k, v in sorted(outcome.items()):
            print(f"  {k}: {v}")
        for code, text in sorted(details.items()):
            print(f"  e.g. {code}: {text}")
        print(
            "picker while open:",
            {k: v for k, v in during.items() if "refused" in k or "open" in k},
            f"RSS {rss_open:.0f} MB (idle {rss_idle:.0f} MB)",
        )
        in_flight = sum(v for k, v in after.items() if k.startswith("fastroute_target_in_flight"))
        print(
            "picker after:", {k: v for k, v in after.items() if "refused" in k or "open" in k}, "in flight", in_flight
        )
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        await cluster.stop()
    with open(log_path, errors="replace") as f:
        lines = f.read().splitlines()
    print(f"picker log: {len(lines)} line(s)")
    for line in lines[: ns.show_log]:
        print("  " + line[:200])
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=5000, help="concurrent Process streams (default 5000)")
    ap.add_argument("--channels", type=int, default=1, help="gRPC channels they share (default 1)")
    ap.add_argument("--timeout", type=float, default=60.0, help="bound of every wait, seconds (default 60)")
    ap.add_argument("--wave", type=int, default=0, help="open the streams this many at a time (default: all at once)")
    ap.add_argument("--show-log", type=int, default=10, help="picker log lines printed (default 10)")
    ap.add_argument("--epp-flag", action="append", default=[], help="one more flag for the picker (repeatable)")
    ns = ap.parse_args()
    return asyncio.run(run(ns))


if __name__ == "__main__":
    raise SystemExit(main())
