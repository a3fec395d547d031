"""Scale-out benchmark: fastroute throughput with ``--workers 1`` and ``--workers 2`` in one run.

Owns one run: nginx fake SGLang workers with fixed answers (the configuration and helpers of
``bench/overhead.py``, imported read-only), then for each mode (regular; PD with a dp_size 8
decode worker under ``--dp-aware``) one fastroute per process count, all started up front, and
``wrk -t1`` at 256 keep-alive connections against each in alternating rounds (so slow drift of a
shared machine is spread over both).  For every measurement it reports requests/s and the CPU
that each party used over the measured interval, in cores (CPU-seconds per second):

* router: the fastroute process tree (supervisor + proxy processes), from /proc;
* backend: the nginx process tree, from /proc;
* load generator: wrk, from this process's child rusage.

On a 2-core machine the three parties compete for the same two cores, so read the router's
share next to the others: it says what a second proxy process bought, not what it would buy on
free cores.  Usage: ``python bench/scale.py [--duration S] [--rounds N] [--modes regular pd]
[--processes 1 2] [--connections 256] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from overhead import (  # noqa: E402 - bench/ is on sys.path only from the line above
    CLK_TCK,
    JSON_BODY,
    JSON_PATH,
    SSE_BODY,
    SSE_PATH,
    Backends,  # noqa: E402
    Procs,
    detect_peer,
    free_port,
    parse_wrk,
    router_commands,
    tree_cpu_ticks,
    wait_ready,
    write_lua,
    write_nginx,
)


def router_argv(mode: str, be: Backends, processes: int, port: int, mport: int) -> list[str]:
    """The fastroute command line used by bench/overhead.py, plus ``--workers``."""
    argv = [
        sys.executable,
        "-m",
        "fastroute",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(mport),
        "--worker-startup-check-interval",
        "1",
        "--log-level",
        "warning",
        "--workers",
        str(processes),
    ]
    if mode == "regular":
        argv += [
            "--worker-urls",
            *[f"http://127.0.0.1:{p}" for p in be.regular],
            "--policy",
            "power_of_two",
            "--p2c-load-metric",
            "requests",
        ]
    else:
        argv += [
            "--pd-disaggregation",
            "--prefill",
            f"http://127.0.0.1:{be.prefill}",
            str(be.bootstrap),
            "--decode",
            f"http://127.0.0.1:{be.decode}",
            "--policy",
            "power_of_two",
            "--p2c-load-metric",
            "least_requests",
            "--dp-aware",
        ]
    return argv


def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def measure(
    wrk: str, port: int, lua: Path, conns: int, seconds: int, router_pid: int, nginx_pid: int
) -> dict[str, Any]:
    """One wrk run -> rps, errors and the cores used by router, backend and load generator."""
    r0, n0, w0 = tree_cpu_ticks(router_pid), tree_cpu_ticks(nginx_pid), children_cpu()
    t0 = time.monotonic()
    argv = [
        wrk,
        "-t1",
        f"-c{conns}",
        f"-d{seconds}s",
        "--timeout",
        "10s",
        "--latency",
        "-s",
        str(lua),
        f"http://127.0.0.1:{port}",
    ]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60).stdout
    wall = time.monotonic() - t0
    r1, n1, w1 = tree_cpu_ticks(router_pid), tree_cpu_ticks(nginx_pid), children_cpu()
    res = parse_wrk(out)
    return {
        "rps": res["rps"],
        "errors": res["non2xx"] + res["socket_errors"],
        "p99_ms": res.get("p99", 0.0) * 1e3,
        "router_cores": (r1 - r0) / CLK_TCK / wall,
        "nginx_cores": (n1 - n0) / CLK_TCK / wall,
        "wrk_cores": (w1 - w0) / wall,
    }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=int, default=5, help="seconds per wrk run (default 5)")
    ap.add_argument("--rounds", type=int, default=2, help="alternating rounds (default 2)")
    ap.add_argument("--modes", nargs="+", default=["regular", "pd"], choices=["regular", "pd"])
    ap.add_argument("--processes", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--connections", type=int, default=256)
    ap.add_argument("--kinds", nargs="+", default=["json", "sse"], choices=["json", "sse"])
    ap.add_argument("--out", default="", help="also write the markdown table here")
    ap.add_argument(
        "--smg-python",
        default=None,
        help="interpreter with smg installed, measured in the same rounds (default: "
        "auto-detect like bench/overhead.py; skipped when absent)",
    )
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    nginx, wrk = shutil.which("nginx") or "/usr/sbin/nginx", shutil.which("wrk")
    if not os.path.exists(nginx) or not wrk:
        print("needs nginx and wrk: apt-get update && apt-get install -y nginx wrk", file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="fastroute-scale-"))
    procs = Procs(tmp)
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rows: list[tuple[str, int, str, dict[str, float]]] = []
    commands: list[str] = []
    try:
        be = Backends(
            regular=[free_port(), free_port()], prefill=free_port(), decode=free_port(), bootstrap=free_port()
        )
        conf = write_nginx(tmp, be)
        nginx_proc = procs.start("nginx", [nginx, "-c", str(conf), "-p", str(tmp), "-e", str(tmp / "error.log")])
        for port in (*be.regular, be.prefill, be.decode):
            err = wait_ready(port, nginx_proc, timeout=20)
            if err:
                raise RuntimeError(f"nginx not serving on {port}: {err}")
        luas = {"json": write_lua(tmp, "json", JSON_PATH, JSON_BODY), "sse": write_lua(tmp, "sse", SSE_PATH, SSE_BODY)}
        smg_py, smg_info = detect_peer("smg", args.smg_python)
        print(smg_info, flush=True)
        for mode in args.modes:
            # Keyed by label: the process counts, and "smg" when installed (same rounds).
            routers: dict[Any, tuple[int, Any]] = {}
            for n in args.processes:
                port = free_port()
                argv = router_argv(mode, be, n, port, free_port())
                commands.append(shlex.join(argv))
                routers[n] = (port, procs.start(f"{mode}-w{n}", argv, env, cwd=REPO))
            if smg_py:
                peer = next(r for r in router_commands(mode, be, {"smg": smg_py}) if r.name == "smg")
                commands.append(shlex.join(peer.argv))
                routers["smg"] = (peer.port, procs.start(f"{mode}-wsmg", peer.argv, peer.env))
            for n, (port, p) in routers.items():
                err = wait_ready(port, p)
                if err:
                    raise RuntimeError(f"{mode} --workers {n}: {err}\n{procs.log_tail(f'{mode}-w{n}')}")
                for kind in args.kinds:  # warm-up: pools, first load polls
                    measure(wrk, port, luas[kind], 64, 1, p.pid, nginx_proc.pid)
            samples: dict[tuple[int, str], list[dict[str, float]]] = {}
            for rnd in range(args.rounds):
                order = list(routers) if rnd % 2 == 0 else list(routers)[::-1]
                for n in order:
                    port, p = routers[n]
                    for kind in args.kinds:
                        m = measure(wrk, port, luas[kind], args.connections, args.duration, p.pid, nginx_proc.pid)
                        samples.setdefault((n, kind), []).append(m)
                        print(
                            f"  {mode:7s} workers={n} {kind:4s} {m['rps']:8.0f} req/s  "
                            f"router={m['router_cores']:.2f} nginx={m['nginx_cores']:.2f} "
                            f"wrk={m['wrk_cores']:.2f} cores  errors={m['errors']}",
                            flush=True,
                        )
            for (n, kind), ms in sorted(samples.items(), key=lambda kv: (str(kv[0][0]), kv[0][1])):
                med = {k: statistics.median(m[k] for m in ms) for k in ms[0]}
                rows.append((mode, n, kind, med))
            for n in routers:
                procs.stop(f"{mode}-w{n}")
    finally:
        procs.stop_all()
    lines = [
        f"fastroute scale-out, wrk -t1 -c{args.connections} -d{args.duration}s, "
        f"median of {args.rounds} rounds, {os.cpu_count()} cores",
        "",
        "| mode | --workers | body | req/s | vs 1 | router cores | nginx cores | wrk cores "
        "| p99 ms | errors | vs smg |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {(mode, kind): m["rps"] for mode, n, kind, m in rows if n == min(args.processes)}
    peer = {(mode, kind): m["rps"] for mode, n, kind, m in rows if n == "smg"}
    for mode, n, kind, m in rows:
        ratio = m["rps"] / base[(mode, kind)] if base.get((mode, kind)) else float("nan")
        lines.append(
            f"| {mode} | {n} | {kind} | {m['rps']:.0f} | {ratio:.2f}x | "
            f"{m['router_cores']:.2f} | {m['nginx_cores']:.2f} | {m['wrk_cores']:.2f} | "
            f"{m['p99_ms']:.1f} | {m['errors']:.0f} | "
            + (f"{m['rps'] / peer[(mode, kind)]:.2f}x |" if peer.get((mode, kind)) else "- |")
        )
    lines += ["", "Routers:", *[f"    {c}" for c in commands]]
    report = "\n".join(lines)
    print(report)
    if args.out:
        Path(args.out).write_text(report + "\n")
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
