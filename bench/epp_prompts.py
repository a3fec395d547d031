"""The picker's CPU per decision by prompt size: ``fastroute epp --policy cache_aware`` as a
subprocess over two simulated workers (``fastroute.sim.worker``), asked over gRPC the way the
printed bootstrap asks (request headers, then the whole body in one buffered message, then the
stream's end), by a client in this process. Prompts of ``--sizes`` KB share all but their last
few characters (a long document asked several questions: the prefix tree matches the whole
prompt, its worst case). The picker's CPU time (``/proc``) over ``--requests`` decisions per
size, after a warm-up, divided by the decisions.

Usage: ``python bench/epp_prompts.py [--sizes 2 48 200] [--requests 300] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 48, 200], help="prompt sizes in KB")
    ap.add_argument("--requests", type=int, default=300, help="decisions measured per size and round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; the median is reported")
    ap.add_argument("--policy", default="cache_aware")
    return ap.parse_args(argv)


async def decisions(port: int, bodies: list[bytes]) -> None:
    import grpc
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", -1)]) as ch:
        stub = pb_grpc.ExternalProcessorStub(ch)
        for body in bodies:
            hm = pb.HttpHeaders()
            for k, v in ((":method", "POST"), (":path", "/generate"), (":authority", "gw")):
                hm.headers.headers.append(base_pb2.HeaderValue(key=k, raw_value=v.encode()))
            hm.headers.headers.append(base_pb2.HeaderValue(key="content-length", raw_value=str(len(body)).encode()))
            call = stub.Process()
            await call.write(pb.ProcessingRequest(request_headers=hm))
            await call.read()
            await call.write(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
            ans = await call.read()
            if ans.WhichOneof("response") != "request_body":
                raise RuntimeError(f"not routed: {ans}")
            await call.done_writing()
            await call.read()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs: list[subprocess.Popen[Any]] = []
    try:
        wports = [free_port(), free_port()]
        for p in wports:
            argv_w = [sys.executable, "-m", "fastroute.sim.worker", "--role", "regular", "--host", "127.0.0.1"]
            procs.append(subprocess.Popen([*argv_w, "--port", str(p)], env=env, stdout=subprocess.DEVNULL))
        gport = free_port()
        epp = [
            sys.executable,
            "-m",
            "fastroute",
            "epp",
            "--host",
            "127.0.0.1",
            "--grpc-port",
            str(gport),
            "--worker-urls",
            *[f"http://127.0.0.1:{p}" for p in wports],
            "--worker-startup-check-interval",
            "1",
            "--policy",
            args.policy,
            "--log-level",
            "warning",
        ]
        picker = subprocess.Popen(epp, env=env, cwd=REPO)
        procs.append(picker)
        rng = random.Random(7)
        results: dict[int, list[float]] = {kb: [] for kb in args.sizes}
        deadline = time.monotonic() + 60
        while True:  # ready: a decision is answered
            try:
                asyncio.run(decisions(gport, [b'{"text": "hi"}']))
                break
            except Exception:
                if time.monotonic() > deadline or picker.poll() is not None:
                    raise
                time.sleep(0.5)
        for _ in range(args.rounds):
            for kb in args.sizes:
                doc = "".join(rng.choice("abcdefghij klmnop") for _ in range(kb * 1024))
                bodies = [
                    json.dumps({"text": f"{doc} question {i}?", "sampling_params": {"max_new_tokens": 8}}).encode()
                    for i in range(args.requests + 20)
                ]
                asyncio.run(decisions(gport, bodies[:20]))  # warm: the document is in the tree
                t0 = cpu_seconds(picker.pid)
                asyncio.run(decisions(gport, bodies[20:]))
                results[kb].append((cpu_seconds(picker.pid) - t0) / args.requests * 1e6)
        cmd = "python bench/epp_prompts.py " + " ".join(argv if argv is not None else sys.argv[1:])
        print(f"# {cmd.strip()}\n\n| prompt | picker CPU per decision (us), median of {args.rounds} |\n|---|---|")
        base = statistics.median(results[args.sizes[0]])
        for kb in args.sizes:
            med = statistics.median(results[kb])
            print(f"| {kb} KB | {med:.0f} ({med / base:.2f}x) |")
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
