"""Fleet-scale costs of the router: how a pick, a replica sync tick and worker polling grow with
the number of targets (issue 52).

Sections (each runnable alone, ``--only NAME``):

* ``picks``: ns per pick + book + release through the compiled group (``core.routing``) per
  policy, at 8, 512, 4,096 and 8,192 targets of one table, every target polled and idle, a
  request of 100 input tokens; the fastest of ``--repeats`` timed loops of ``--picks`` calls.
* ``coordinated``: the same loop for the policies synced replicas plan with (least_requests,
  demand, KV fit), the header saying ``--replicas`` (8) live replicas, every target busy at
  the others (1-3 requests in flight there: the view is never idle) and one sync tick for the
  whole loop, so every pick after the first plans ``--replicas`` placements and books the
  others' as their estimate.  ``--tree DIR`` imports ``fastroute`` from another built
  checkout (e.g. ``/work/main``) to measure before and after in one run.
* ``sync``: one replica sync tick (``control.replica.ReplicaSync.tick`` against a real
  ``redis-server``) with every target busy at every replica and ``--churn`` of them (5%)
  changing their in-flight count at every replica between two ticks, at 512 and 4,096 targets and 2, 4
  and 8 replicas: the CPU of one replica's tick (``time.process_time`` around it: encode,
  the script call, decoding the peers' entries, applying them to the table), median of
  ``--ticks`` ticks, on uvloop as in the router (``--loop asyncio`` for the default loop),
  the Redis commands one tick costs (``INFO commandstats``) and what that makes per second for
  all the replicas at the default 10 ms interval; then 8 replicas' running sync loops at 512
  targets: Redis commands per second while no load moves (quiet ticks space out to
  heartbeats) and while every replica's load moves every 10 ms.
* ``fleet``: ``--servers`` simulated DP-8 servers (``fastroute.sim``, one process) behind a
  real router process (``--dp-aware``): registration time, the router's RSS, its CPU while it
  only polls, and ``/health`` latency (p50/p99/max) sampled while the polls run;
  ``--profile FILE`` runs the router under cProfile (its numbers then include cProfile's cost);
  ``--stalls`` runs it under ``bench/loopwatch.py`` and adds its loop's stalls counted in CPU
  time (intervals over 3 ms, over 10 ms, the longest) and its full collections in the window,
  which unlike ``/health`` latency do not move with other work on the machine.

Usage: ``python bench/fleet_scale.py [--only picks|coordinated|sync|fleet] [--replicas N] [--tree DIR]
[--sizes 8 512 4096 8192]
[--picks N] [--repeats N] [--servers N] [--seconds S] [--stalls]``.  Numbers move with the load of a
shared machine: compare rows of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
# --tree DIR: the fastroute package of another built checkout (a before/after comparison)
TREE = Path(sys.argv[sys.argv.index("--tree") + 1]).resolve() if "--tree" in sys.argv[:-1] else REPO
sys.path.insert(0, str(TREE))

from fastroute.core.routing import Router  # noqa: E402
from fastroute.core.table import TargetTable  # noqa: E402

# (label, policy, load metric, decode input demand, KV fit)
POLICIES = [
    ("power_of_two", "power_of_two", "tokens", "off", "off"),
    ("least_requests", "power_of_two", "least_requests", "off", "off"),
    ("demand", "power_of_two", "tokens", "on", "off"),
    ("kv_fit", "power_of_two", "tokens", "off", "on"),
    ("cache_aware", "cache_aware", "tokens", "off", "off"),
    ("cache_aware + kv_fit", "cache_aware", "tokens", "off", "on"),
]


class _Meta:
    """What cache_aware reads of a request: its routing text."""

    def __init__(self, text: str) -> None:
        self._text = text

    def routing_text(self) -> str:
        return self._text

    def routing_ids(self) -> None:
        return None


def pick_costs(sizes: list[int], picks: int, repeats: int) -> dict[str, dict[int, float]]:
    """ns per acquire + release, per policy label and target count."""
    out: dict[str, dict[int, float]] = {}
    table = TargetTable(max(sizes))
    try:
        for _ in range(max(sizes)):
            t = table.alloc()
            table.set_polled(t, 1, 0, 100, max_tokens=1_000_000)
        router = Router(table, seed=1)
        for label, policy, metric, demand, kv in POLICIES:
            row = out.setdefault(label, {})
            for n in sizes:
                g = router.group(list(range(n)), policy, load_metric=metric, demand=demand, kv_fit=kv)
                acquire = g.acquire
                prompt = _Meta("a fixed prompt of a few words")
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter_ns()
                    if policy == "cache_aware":
                        for _ in range(picks):
                            acquire(100, None, prompt).release()
                    else:
                        for _ in range(picks):
                            acquire(100).release()
                    times.append((time.perf_counter_ns() - t0) / picks)
                row[n] = min(times)  # the least disturbed loop of a shared machine
                assert all(table.in_flight(t) == 0 for t in range(n))
    finally:
        table.close()
        table.unlink()
    return out


def coordinated_costs(sizes: list[int], picks: int, repeats: int, replicas: int) -> dict[str, dict[int, float]]:
    """ns per acquire + release of a synced replica's planned pick, per policy and target count."""
    from fastroute.core.table import COL_ORDER_KEY, COL_OTHERS_IN_FLIGHT

    out: dict[str, dict[int, float]] = {}
    for label, policy, metric, demand, kv in POLICIES:
        if label not in ("least_requests", "demand", "kv_fit"):
            continue
        row = out.setdefault(label, {})
        for n in sizes:
            table = TargetTable(n)
            try:
                for _ in range(n):
                    t = table.alloc()
                    table.set_polled(t, 1, 0, 100, max_tokens=1_000_000)
                    table.cells.store(t, COL_ORDER_KEY, (t * 2654435761) % (1 << 31))
                    table.cells.store(t, COL_OTHERS_IN_FLIGHT, 1 + t % 3)
                table.set_replicas(replicas, 3)
                table.count_sync_tick()
                g = Router(table, seed=1).group(list(range(n)), policy, load_metric=metric, demand=demand, kv_fit=kv)
                acquire = g.acquire
                times = []
                for _ in range(repeats):
                    t0 = time.perf_counter_ns()
                    for _ in range(picks):
                        acquire(100).release()
                    times.append((time.perf_counter_ns() - t0) / picks)
                assert g.kernel.coordinated_picks == picks * repeats  # every pick was planned
                row[n] = min(times)
                del g, acquire
            finally:
                table.close()
                table.unlink()
    return out


def print_picks(costs: dict[str, dict[int, float]], sizes: list[int]) -> None:
    print("| policy | " + " | ".join(f"{n} targets" for n in sizes) + f" | {sizes[-1]} / {sizes[0]} |")
    print("|---" * (len(sizes) + 2) + "|")
    for label, row in costs.items():
        cells = " | ".join(f"{row[n]:,.0f} ns" for n in sizes)
        print(f"| {label} | {cells} | {row[sizes[-1]] / row[sizes[0]]:.1f}x |")


# ---- sync: one replica tick ------------------------------------------------------------------


class _Targets:
    """What the sync reads of a registry: a name per table row in use."""

    def __init__(self, n: int) -> None:
        self.target_info = [("w", r) for r in range(n)]
        self._names = [f"http://10.0.{r // 8 // 250}.{r // 8 % 250}:30000@{r % 8}" for r in range(n)]
        self.background = None

    def target_name(self, t: int) -> str:
        return self._names[t]


async def sync_costs(
    sizes: list[int], replicas: list[int], ticks: int, churn: float
) -> dict[tuple[int, int], dict[str, float]]:
    import redis as redis_sync

    from fastroute.control.replica import ReplicaSync
    from fastroute.sim.redisproc import RedisProcess

    out: dict[tuple[int, int], dict[str, float]] = {}
    with RedisProcess() as rp:
        admin = redis_sync.Redis.from_url(rp.url)
        for n in sizes:
            for k in replicas:
                admin.flushall()
                tables, syncs = [], []
                for i in range(k):
                    tab = TargetTable(n)
                    for _ in range(n):
                        t = tab.alloc()
                        tab.cells.store(t, 0, 1 + (t + i) % 3)  # COL_IN_FLIGHT: busy everywhere
                        tab.cells.store(t, 1, 1000 * (1 + t % 5))  # COL_IN_FLIGHT_TOKENS
                    tables.append(tab)
                    syncs.append(ReplicaSync(rp.url, f"r{i}", tab, _Targets(n), 0.01, 5.0))
                try:
                    for s in syncs:  # every replica has published once
                        await s.tick()
                    cpu = []
                    calls0 = _redis_calls(admin)
                    rs = np.random.default_rng(1)
                    moved = max(1, int(churn * n))
                    for _ in range(ticks):
                        for tab in tables:  # every replica's requests start and end on some targets
                            for t in rs.choice(n, moved, replace=False).tolist():
                                tab.cells.store(t, 0, int(rs.integers(0, 4)))
                        for s in syncs[1:]:
                            await s.tick()
                        c0 = time.process_time_ns()
                        peers = await syncs[0].tick()
                        cpu.append((time.process_time_ns() - c0) / 1000)
                        assert peers == k - 1
                    calls1 = _redis_calls(admin)
                    out[(n, k)] = {
                        "tick_us": statistics.median(cpu),
                        "round_trips_per_tick": (calls1[0] - calls0[0]) / (ticks * k),
                        "redis_commands_per_tick": (calls1[1] - calls0[1]) / (ticks * k),
                    }
                finally:
                    for s in syncs:
                        await s.client.aclose()
                    for tab in tables:
                        tab.close()
                        tab.unlink()
    return out


def _redis_calls(admin) -> tuple[int, int]:
    """(round trips: scripts and transactions, commands Redis ran: those inside them too)."""
    stats = admin.info("commandstats")
    calls = {name: int(v["calls"]) for name, v in stats.items() if name != "cmdstat_info"}
    trips = sum(v for name, v in calls.items() if name in ("cmdstat_evalsha", "cmdstat_eval", "cmdstat_exec"))
    return trips, sum(calls.values())


async def sync_rates(n: int, k: int, seconds: float) -> dict[str, float]:
    """Redis commands per second of ``k`` replicas' running sync loops (10 ms interval, 3 s
    TTL) at ``n`` targets: quiet (no load moves; after 3 s for the heartbeats to space out),
    then busy (every replica's load moves every 10 ms)."""
    import redis as redis_sync

    from fastroute.control.replica import ReplicaSync
    from fastroute.sim.redisproc import RedisProcess

    with RedisProcess() as rp:
        admin = redis_sync.Redis.from_url(rp.url)
        tables, syncs = [], []
        for i in range(k):
            tab = TargetTable(n)
            for _ in range(n):
                tab.alloc()
            tables.append(tab)
            syncs.append(ReplicaSync(rp.url, f"r{i}", tab, _Targets(n), 0.01, 3.0))
        try:
            for s in syncs:
                s.start()
            await asyncio.sleep(3.0)
            c0 = _redis_calls(admin)[1]
            await asyncio.sleep(seconds)
            quiet = (_redis_calls(admin)[1] - c0) / seconds
            rs = np.random.default_rng(2)
            c0 = _redis_calls(admin)[1]
            for step in range(int(seconds / 0.01)):
                for tab in tables:
                    tab.cells.store(int(rs.integers(0, n)), 0, step % 4)
                await asyncio.sleep(0.01)
            busy = (_redis_calls(admin)[1] - c0) / seconds
        finally:
            for s in syncs:
                await s.stop()
            for tab in tables:
                tab.close()
                tab.unlink()
    return {"quiet": quiet, "busy": busy}


def print_sync(costs: dict[tuple[int, int], dict[str, float]]) -> None:
    print(
        "| targets | replicas | one tick's CPU | round trips per tick | Redis commands per tick "
        "| Redis commands/s (all replicas, 10 ms ticks) |"
    )
    print("|---|---|---|---|---|---|")
    for (n, k), row in costs.items():
        print(
            f"| {n:,} | {k} | {row['tick_us']:,.0f} us | {row['round_trips_per_tick']:.1f} "
            f"| {row['redis_commands_per_tick']:.1f} | {row['redis_commands_per_tick'] * k * 100:,.0f} |"
        )


# ---- fleet: 1,000 DP-8 servers behind a router process --------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


# The simulated servers run in a process of their own, so that the /health client below is
# not delayed by the same event loop answering the router's polls.
SIMS = """
import asyncio, json, sys
from fastroute.sim.engine import SimParams
from fastroute.sim.server import SimWorker

async def main(n, dp):
    sims = [SimWorker("regular", SimParams(dp_size=dp, time_scale=0.001)) for _ in range(n)]
    for s in sims:
        await s.start()
    print(json.dumps([s.port for s in sims]), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    for s in sims:
        await s.stop()

asyncio.run(main(int(sys.argv[1]), int(sys.argv[2])))
"""


async def fleet(
    servers: int, dp: int, seconds: float, interval: float, profile: str = "", stalls: bool = False
) -> dict[str, float]:
    from fastroute.sim.http import HttpConnection

    sim = subprocess.Popen(
        [sys.executable, "-c", SIMS, str(servers), str(dp)], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert sim.stdout is not None and sim.stdin is not None
    ports = json.loads(sim.stdout.readline())
    port, mport = _free_port(), _free_port()
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    # --profile: the router runs under cProfile (its numbers then include cProfile's own cost)
    prof = ["-m", "cProfile", "-o", profile] if profile else []
    # --stalls: the router runs under bench/loopwatch.py (its loop's stalls in CPU time)
    watch_out = os.path.join(tempfile.mkdtemp(prefix="fleet-stalls-"), "stalls.json") if stalls else ""
    watch = [os.path.join(REPO, "bench", "loopwatch.py"), watch_out] if stalls else []
    argv = [sys.executable, *prof, *watch, "-m", "fastroute", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(mport), "--dp-aware"]
    argv += [
        "--policy",
        "power_of_two",
        "--p2c-load-metric",
        "tokens",
        "--load-monitor-interval",
        str(interval),
        "--log-level",
        "warning",
    ]
    argv += ["--worker-startup-timeout-secs", "600", "--worker-urls", *urls]
    proc = subprocess.Popen(argv, cwd=REPO)
    res: dict[str, float] = {}
    try:
        conn = HttpConnection("127.0.0.1", port)
        t0 = time.monotonic()
        while True:
            try:
                st, _, body = await conn.request("GET", "/workers")
                if st == 200 and len(json.loads(body).get("workers", [])) == servers:
                    break
            except Exception:
                pass
            if proc.poll() is not None:
                raise RuntimeError("the router exited")
            await asyncio.sleep(0.2)
        # ready once every worker answered /v1/loads once (registration ends with a poll)
        registered = time.monotonic()
        res["register_s"] = registered - t0
        await asyncio.sleep(2 * interval)
        cpu0, w0 = _proc_cpu_s(proc.pid), time.monotonic()
        lat = []
        end = w0 + seconds
        while time.monotonic() < end:
            a = time.perf_counter()
            st, _, _ = await conn.request("GET", "/health")
            lat.append((time.perf_counter() - a) * 1000)
            assert st == 200
            await asyncio.sleep(0.01)
        res["poll_cpu_share"] = (_proc_cpu_s(proc.pid) - cpu0) / (time.monotonic() - w0)
        res["rss_mib"] = _rss_mib(proc.pid)
        q = np.percentile(lat, [50, 99])
        res["health_p50_ms"], res["health_p99_ms"], res["health_max_ms"] = float(q[0]), float(q[1]), max(lat)
        res["health_samples"] = len(lat)
    finally:
        proc.terminate()
        proc.wait(10)
        sim.stdin.close()
        sim.wait(30)
    if stalls:
        with open(watch_out) as f:
            seen = json.load(f)
        inside = [ms for t, ms in seen["stalls"] if w0 <= t <= end]
        res["stalls_over_3ms"] = len(inside)
        res["stalls_over_10ms"] = sum(1 for ms in inside if ms > 10)
        res["stall_max_cpu_ms"] = max(inside, default=0.0)
        res["full_collections"] = sum(1 for t, _ in seen["gen2"] if w0 <= t <= end)
        # while the fleet registered (from the router's start to the last worker listed)
        during = [ms for t, ms in seen["stalls"] if t <= registered]
        res["registration_stalls_over_3ms"] = len(during)
        res["registration_stall_cpu_ms"] = round(sum(during), 1)
        res["full_collection_max_cpu_ms"] = max((ms for t, ms in seen["gen2"] if w0 <= t <= end), default=0.0)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", choices=("picks", "coordinated", "sync", "fleet"), default=None)
    ap.add_argument("--replicas", type=int, default=8, help="coordinated: live synced replicas the header says")
    ap.add_argument("--tree", default=str(REPO), help="import fastroute from this built checkout (before/after runs)")
    ap.add_argument("--ticks", type=int, default=50)
    ap.add_argument("--churn", type=float, default=0.05, help="share of targets whose load moves per replica per tick")
    ap.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop", help="sync: the event loop of the ticks")
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 512, 4096, 8192])
    ap.add_argument("--picks", type=int, default=20_000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--servers", type=int, default=1000)
    ap.add_argument("--dp", type=int, default=8)
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--interval", type=float, default=1.0, help="--load-monitor-interval of the router")
    ap.add_argument("--profile", default="", help="fleet: write the router's cProfile stats to this file")
    ap.add_argument(
        "--stalls",
        action="store_true",
        help="fleet: also count the router loop's stalls in CPU time (bench/loopwatch.py): intervals of the"
        " loop that used over 3 ms of CPU, and full collections, while /health is sampled",
    )
    a = ap.parse_args()
    if a.only in (None, "picks"):
        print_picks(pick_costs(a.sizes, a.picks, a.repeats), a.sizes)
    if a.only in (None, "coordinated"):
        import fastroute

        print(f"coordinated picks, {a.replicas} replicas, fastroute from {Path(fastroute.__file__).parent.parent}")
        print_picks(coordinated_costs(a.sizes, a.picks, a.repeats, a.replicas), a.sizes)
    if a.only in (None, "sync"):
        runner = asyncio.run
        if a.loop == "uvloop":
            import uvloop

            runner = uvloop.run
        print_sync(runner(sync_costs([512, 4096], [2, 4, 8], a.ticks, a.churn)))
        rates = runner(sync_rates(512, 8, 3.0))
        print(
            f"8 replicas x 512 targets, running loops: {rates['quiet']:,.0f} Redis commands/s quiet, "
            f"{rates['busy']:,.0f} busy"
        )
    if a.only in (None, "fleet"):
        res = asyncio.run(fleet(a.servers, a.dp, a.seconds, a.interval, a.profile, a.stalls))
        print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
