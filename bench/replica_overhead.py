"""Replica sync overhead: req/s of one fastroute with ``--replica-sync`` off vs on, same run.

Same backends and client as ``bench/overhead.py`` (nginx fake workers, ``wrk -t1``), PD mode
with ``--dp-aware`` over the 8-rank decode (the table the sync publishes has 9 targets). "on"
is a router publishing to a real ``redis-server`` every ``--interval-ms`` beside two more
synced replicas (idle, so the measured router reads two peers' entries every tick). The two
routers are measured in alternating rounds, order rotated, and the table reports medians and
the on/off ratio per connection count, the router's CPU per request (its process group's
utime + stime over each wrk run, divided by the requests wrk counted) and the Redis round trips a
synced replica makes per second (script and transaction calls in ``INFO commandstats`` over the
run, divided by the three synced replicas).

Usage: ``python bench/replica_overhead.py [--duration S] [--rounds N] [--interval-ms MS]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import overhead as ov  # noqa: E402  (bench/ is not a package)
import redis as redis_sync  # noqa: E402

from fastroute.sim.redisproc import RedisProcess  # noqa: E402


def fastroute_pd(be: ov.Backends, port: int, extra: list[str]) -> list[str]:
    pre, dec = f"http://127.0.0.1:{be.prefill}", f"http://127.0.0.1:{be.decode}"
    return [
        sys.executable,
        "-m",
        "fastroute",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-port",
        str(ov.free_port()),
        "--worker-startup-check-interval",
        "1",
        "--log-level",
        "warning",
        "--pd-disaggregation",
        "--prefill",
        pre,
        str(be.bootstrap),
        "--decode",
        dec,
        "--policy",
        "power_of_two",
        "--p2c-load-metric",
        "least_requests",
        "--dp-aware",
        *extra,
    ]


def group_cpu_seconds(pid: int) -> float:
    """utime + stime of every live process in ``pid``'s session (the router and any children)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # after the command: state ppid pgrp session ... utime(12) stime(13)
        if int(fields[3]) == pid:
            total += int(fields[11]) + int(fields[12])
    return total / tick


def redis_round_trips(port: int) -> int:
    """Script and transaction calls Redis has served (``INFO commandstats``: EVALSHA, EVAL,
    EXEC): one round trip each. A tick is one script call; the commands a script runs inside
    Redis are counted under their own names and are not round trips, so they are left out."""
    client = redis_sync.Redis(host="127.0.0.1", port=port, socket_timeout=2.0)
    try:
        stats = client.info("commandstats")
    finally:
        client.close()
    return sum(int(stats.get(k, {}).get("calls", 0)) for k in ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_exec"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=int, default=10, help="seconds per wrk run")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--connections", type=int, nargs="+", default=[256])
    ap.add_argument("--interval-ms", type=int, default=10, help="--replica-sync-interval-ms")
    ap.add_argument("--out", default=str(HERE / "out" / "replica_overhead.md"))
    args = ap.parse_args(argv)
    nginx, wrk = shutil.which("nginx") or "/usr/sbin/nginx", shutil.which("wrk")
    if not os.path.exists(nginx) or not wrk:
        print("needs nginx and wrk: apt-get install -y nginx wrk", file=sys.stderr)
        return 2
    s = ov.Settings(
        duration=args.duration,
        rounds=args.rounds,
        modes=["pd"],
        lat_json=0,
        lat_sse=0,
        connections=tuple(args.connections),
        wrk=wrk,
    )
    tmp = Path(tempfile.mkdtemp(prefix="fastroute-replica-overhead-"))
    procs = ov.Procs(tmp)
    env = dict(os.environ, PYTHONPATH=str(HERE.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    rps: dict[tuple[str, int], list[float]] = {}
    cpu_us: dict[tuple[str, int], list[float]] = {}
    trips: list[float] = []
    with RedisProcess() as redis:
        try:
            be = ov.Backends(
                regular=[ov.free_port()], prefill=ov.free_port(), decode=ov.free_port(), bootstrap=ov.free_port()
            )
            conf = ov.write_nginx(tmp, be)
            procs.start("nginx", [nginx, "-c", str(conf), "-p", str(tmp), "-e", str(tmp / "error.log")])
            lua = ov.write_lua(tmp, "json", ov.JSON_PATH, ov.JSON_BODY)
            sync = ["--replica-sync", redis.url, "--replica-sync-interval-ms", str(args.interval_ms)]
            ports = {"off": ov.free_port(), "on": ov.free_port()}
            procs.start("off", fastroute_pd(be, ports["off"], []), env, cwd=HERE.parent)
            procs.start("on", fastroute_pd(be, ports["on"], sync + ["--replica-id", "measured"]), env, cwd=HERE.parent)
            for k in range(2):
                procs.start(
                    f"peer{k}",
                    fastroute_pd(be, ov.free_port(), sync + ["--replica-id", f"peer{k}"]),
                    env,
                    cwd=HERE.parent,
                )
            for name, port in ports.items():
                err = ov.wait_ready(port, procs.procs[name])
                if err:
                    raise RuntimeError(f"{name}: {err}\n{procs.log_tail(name)}")
                ov.run_wrk(s, port, lua, 64, 2)  # warm-up
            order = ["off", "on"]
            for rnd in range(s.rounds):
                for name in order if rnd % 2 == 0 else order[::-1]:
                    for c in s.connections:
                        pid = procs.procs[name].pid
                        cpu0, calls0, t0 = group_cpu_seconds(pid), redis_round_trips(redis.port), time.monotonic()
                        res = ov.run_wrk(s, ports[name], lua, c, s.duration)
                        cpu1, calls1, t1 = group_cpu_seconds(pid), redis_round_trips(redis.port), time.monotonic()
                        served = max(1.0, res["rps"] * s.duration)
                        rps.setdefault((name, c), []).append(res["rps"])
                        cpu_us.setdefault((name, c), []).append((cpu1 - cpu0) * 1e6 / served)
                        trips.append((calls1 - calls0) / (t1 - t0) / 3)
                        print(
                            f"  round {rnd + 1} sync {name:3s} c={c}: {res['rps']:9.0f} req/s "
                            f"{cpu_us[(name, c)][-1]:6.1f} us CPU/req "
                            f"errors={res['non2xx'] + res['socket_errors']}",
                            flush=True,
                        )
        finally:
            procs.stop_all()
    lines = [
        "| connections | sync off req/s (median) | sync on req/s (median) | on / off | runs off | runs on "
        "| CPU us/req off | CPU us/req on |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for c in s.connections:
        off, on = statistics.median(rps[("off", c)]), statistics.median(rps[("on", c)])
        lines.append(
            f"| {c} | {off:.0f} | {on:.0f} | {on / off:.3f} | "
            + ", ".join(f"{x:.0f}" for x in rps[("off", c)])
            + " | "
            + ", ".join(f"{x:.0f}" for x in rps[("on", c)])
            + " | "
            + f"{statistics.median(cpu_us[('off', c)]):.1f} | "
            + f"{statistics.median(cpu_us[('on', c)]):.1f} |"
        )
    table = "\n".join(lines) + "\n"
    table += (
        f"\nRedis round trips per synced replica per second (interval {args.interval_ms} ms): median "
        f"{statistics.median(trips):.1f} (min {min(trips):.1f}, max {max(trips):.1f})\n"
    )
    print(table)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(f"`{' '.join([sys.executable, *sys.argv])}`\n\n{table}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
