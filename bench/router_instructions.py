"""Instructions per request of a whole router process under load, counted by valgrind.

bench/instructions.py counts fastroute's request path in-process (no sockets, no httptools, no
event loop). This counts a real router process serving real HTTP from wrk: the process runs
under ``valgrind --tool=callgrind``, the counters are zeroed after a warm-up, wrk sends N
seconds of distinct bodies (bench/floor.py's) at 16 connections (`--connections`) to nginx
workers, and the dump gives every user-space instruction the process executed (Python, uvloop,
httptools, libc; the kernel's socket work is not counted). Divided by the requests wrk
completed, that is the router's own CPU cost per request, free of the machine's noise,
comparable between fastroute, an older checkout and the lean relays. Runs are ~50x slower under
valgrind: a few thousand requests each.

Also prints the heaviest functions of each run (own instructions per request, by shared object
and by symbol), which is where to look for the next saving.

Usage: ``python bench/router_instructions.py [--router fastroute lean ...] [--mode regular|pd]
[--kind gen|chat] [--size 2048] [--seconds 20] [--checkout DIR ...] [--trace]``. Needs valgrind and nginx.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import floor  # noqa: E402
import overhead as ov  # noqa: E402

_NAME = re.compile(r"\((\d+)\)(?: (.*))?")


def self_costs(path: Path) -> tuple[collections.Counter, collections.Counter]:
    """Own instructions (calls excluded) by shared object and by (object, function), from a
    callgrind output file (name compression resolved)."""
    names: dict[tuple[str, str], str] = {}

    def name(kind: str, v: str) -> str:
        m = _NAME.match(v)
        if not m:
            return v
        key = (kind, m.group(1))
        if m.group(2) is not None:
            names[key] = m.group(2)
        return names.get(key, v)

    ob = fn = ""
    by_ob: collections.Counter = collections.Counter()
    by_fn: collections.Counter = collections.Counter()
    call_line = False
    with open(path) as f:
        for line in f:
            if line.startswith("ob="):
                ob = name("ob", line[3:].strip()).rsplit("/", 1)[-1]
            elif line.startswith("fn="):
                fn = name("fn", line[3:].strip())
            elif line.startswith("cob="):
                name("ob", line[4:].strip())
            elif line.startswith("cfn="):
                name("fn", line[4:].strip())
            elif line.startswith("calls="):
                call_line = True  # the next cost line is the callee's inclusive cost
            elif line[:1].isdigit() or line[:1] in "+-*":
                if call_line:
                    call_line = False
                    continue
                parts = line.split()
                if len(parts) >= 2:
                    by_ob[ob] += int(parts[1])
                    by_fn[(ob, fn)] += int(parts[1])
    return by_ob, by_fn


def trace_args(a: argparse.Namespace) -> list[str]:
    """With --trace: fastroute's flags to export its spans to an OTLP collector that accepts and
    drops them (started here, outside the counted process)."""
    if not a.trace:
        return []
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class Sink(trace_service_pb2_grpc.TraceServiceServicer):
        spans = 0

        def Export(self, request, context):  # noqa: N802 (the gRPC method's name)
            Sink.spans += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Sink(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    a.sink = (server, Sink)
    return ["--enable-trace", "--otlp-traces-endpoint", f"127.0.0.1:{port}"]


def run_one(
    a: argparse.Namespace, router: str, checkout: Path, tmp: Path
) -> tuple[int, collections.Counter, collections.Counter]:
    """Requests served, and own instructions by shared object and by function, of one run."""
    be = ov.Backends.fresh()
    procs = ov.Procs(tmp)
    try:
        procs.start("nginx", ["nginx", "-c", str(ov.write_nginx(tmp, be)), "-p", str(tmp), "-e", str(tmp / "err.log")])
        r = next(x for x in floor.routers(a.mode, be, {}, tmp, "cg", "nginx") if x.name == router)
        out = tmp / f"{router}.%p.out"
        extra = trace_args(a) if router == "fastroute" else []
        argv = [sys.executable, *r.argv[1:], *extra]
        if not a.cpu:
            argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", *argv]
        env = dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=str(checkout))
        p = procs.start("router", argv, env, cwd=checkout)
        err = ov.wait_ready(r.port, p, timeout=300)
        if err:
            raise SystemExit(f"{router} did not start under valgrind: {err}\n{procs.log_tail('router')}")
        make = floor.generate_obj if a.kind == "gen" else floor.chat_obj
        path = ov.JSON_PATH if a.kind == "gen" else ov.SSE_PATH
        lua = floor.write_lua(tmp, a.kind, path, floor.variants(make, a.size, False, a.size))
        s = ov.Settings(duration=a.seconds, rounds=1, modes=[a.mode], lat_json=0, lat_sse=0)
        ov.run_wrk(s, r.port, lua, a.connections, a.warmup)  # warm-up: connections, first-use paths
        if a.cpu:  # full speed: the router's CPU time (user + system, its threads included)
            t0 = ov.tree_cpu_ticks(p.pid)
            res = ov.run_wrk(s, r.port, lua, a.connections, a.seconds)
            ticks = ov.tree_cpu_ticks(p.pid) - t0
            return res["requests"], collections.Counter({"cpu_us": ticks / ov.CLK_TCK * 1e6}), collections.Counter()
        subprocess.run(["callgrind_control", "-z", str(p.pid)], check=True, capture_output=True)
        res = ov.run_wrk(s, r.port, lua, a.connections, a.seconds)
        subprocess.run(["callgrind_control", "-d", str(p.pid)], check=True, capture_output=True)
        if res["non2xx"] or res["socket_errors"]:
            raise SystemExit(f"{router}: {res['non2xx']} non-2xx answers, {res['socket_errors']} socket errors")
        dumps = sorted(tmp.glob(f"{router}.*.out.1"), key=lambda q: q.stat().st_size, reverse=True)
        return (res["requests"], *self_costs(dumps[0]))
    finally:
        procs.stop_all()
        sink = getattr(a, "sink", None)
        if sink is not None:
            a.sink = None
            sink[0].stop(0)
            print(f"(the collector received {sink[1].spans:,} spans)", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--router", nargs="+", default=["fastroute", "lean"], choices=("fastroute", "lean", "bare"))
    ap.add_argument("--mode", choices=("regular", "pd"), default="pd")
    ap.add_argument("--kind", choices=("gen", "chat"), default="gen")
    ap.add_argument("--size", type=int, default=2048, help="body bytes (bench/floor.py's bodies)")
    ap.add_argument("--seconds", type=int, default=20)
    ap.add_argument("--checkout", action="append", type=Path, help="fastroute checkout(s), built in place")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument(
        "--connections",
        type=int,
        default=16,
        help="wrk connections (1: every request alone, the event loop's turn per request included)",
    )
    ap.add_argument(
        "--warmup",
        type=int,
        default=3,
        help="seconds of load before the count starts (with --trace, past the span processor's 5 s first export)",
    )
    ap.add_argument(
        "--cpu",
        action="store_true",
        help="no valgrind: the router's CPU microseconds per request at full speed (noisier; counts its threads)",
    )
    ap.add_argument(
        "--trace",
        action="store_true",
        help="run fastroute with --enable-trace, exporting to a collector in this process that drops the spans",
    )
    a = ap.parse_args(argv)
    if a.checkout and "fastroute" not in a.router:
        ap.error("--checkout selects fastroute builds: give --router fastroute too")
    for tool in ("nginx", "wrk") if a.cpu else ("valgrind", "callgrind_control", "nginx", "wrk"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} not found (Debian: valgrind, nginx, wrk)")
    runs = []
    for router in a.router:
        for c in a.checkout or [ov.REPO] if router == "fastroute" else [ov.REPO]:
            tmp = Path(tempfile.mkdtemp(prefix="fastroute-cg-"))
            n, by_ob, by_fn = run_one(a, router, c.resolve(), tmp)
            per = sum(by_ob.values()) / n
            if a.cpu:
                print(
                    f"{router}{' --enable-trace' if a.trace else ''}: {per:,.1f} us of router CPU per request "
                    f"({n:,} requests in {a.seconds} s)",
                    flush=True,
                )
                continue
            label = router if router != "fastroute" or not a.checkout else f"fastroute@{c}"
            runs.append((label, per, n, by_ob, by_fn))
            if router == "fastroute" and a.trace:
                label += " --enable-trace"
            print(f"{label}: {per:,.0f} instructions per request ({n:,} requests)", flush=True)
    if a.cpu:
        return 0
    print(f"\n### {a.mode} {a.kind} {a.size} B, wrk -c{a.connections}, {a.seconds} s under callgrind\n")
    print("| router | instructions per request | requests |")
    print("|---|---|---|")
    for label, per, n, _, _ in runs:
        print(f"| {label} | {per:,.0f} | {n:,} |")
    for label, _, n, by_ob, by_fn in runs:
        print(f"\n{label}: own instructions per request by shared object, then by function")
        for k, v in by_ob.most_common(8):
            print(f"  {v / n:9,.0f}  {k}")
        for (o, f), v in by_fn.most_common(a.top):
            print(f"  {v / n:9,.0f}  {o[:24]:24s} {f[:90]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
