"""Flow control on the simulator: interactive latency under 2x overload, with and without the
priority scheduler.

``python bench/flow_control.py [--rate 4] [--duration 40] [--smg-python /tmp/venv/bin/python]``

A 1P1D simulated cluster (DP 2 per server, 16 running requests per decode rank, so 32 at once)
behind a router subprocess. The open-loop workload arrives as a Poisson process: 20% interactive
(256-token prompt, 16 output tokens, ``x-smg-priority: interactive``) and 80% bulk (2048-token
prompt, 128 output tokens, ``x-smg-priority: bulk``), each request from one of two tenants
(``x-smg-tenant-id: a`` or ``b``, 50/50). Each cell runs at ``--rate`` (1x) and twice that (2x):

* ``off``: fastroute without flow control (the engines queue what exceeds their batch);
* ``scheduler``: ``--priority-scheduler-enabled --trust-tenant-header`` with the YAML below
  (capacity from the ranks' ``max_running_requests``, 4 slots reserved for interactive,
  bulk queue bounded at 64);
* ``scheduler, waiting gate off``: the same with ``--worker-overload-waiting-requests 0`` (the
  simulated decode counts requests still in prefill as waiting, so the default gate of 8 holds
  every class while a burst is in prefill);
* ``smg 1.13 scheduler``: smg with the same flags and YAML, when ``--smg-python`` has smg.

Each row: interactive TTFT p50/p90, bulk completions per second in the window (goodput), the
refusals by status and smg error code, and the decode's busiest running batch (mean over
samples of the largest rank batch). Percentiles are over requests that started and ended in the
measured window (after ``--warmup``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import uvloop  # noqa: E402

from fastroute.sim.balance import Cell, RouterProcess, _drain, _free_port, balance_stats, router_command  # noqa: E402
from fastroute.sim.engine import SimParams  # noqa: E402
from fastroute.sim.http import HttpConnection  # noqa: E402
from fastroute.sim.loadgen import ReqRecord, Target, TraceItem, _one, _percentile, encode_request  # noqa: E402
from fastroute.sim.worker import start_cluster  # noqa: E402

SCHEDULER_YAML = """\
classes:  # smg 1.13 wants every field of a class it lists
  interactive:
    {reserved_floor: 4, queue_size: 256, queue_timeout_secs: 30, starvation_threshold_secs: 5, can_preempt: false}
  bulk: {reserved_floor: 0, queue_size: 64, queue_timeout_secs: 120, starvation_threshold_secs: 120, can_preempt: false}
tenant_policies:
  "header:a": {max_class: interactive}
  "header:b": {max_class: interactive}
"""


@dataclass
class Req:
    t: float
    interactive: bool
    tenant: str


def workload(rate: float, span: float, seed: int) -> list[Req]:
    rng = random.Random(seed)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if t >= span:
            return out
        out.append(Req(t, rng.random() < 0.2, "a" if rng.random() < 0.5 else "b"))


async def run_point(cell: Cell, rate: float, ns: argparse.Namespace, cfg: str, out_dir: str) -> dict:
    dec = SimParams(dp_size=2, max_running_requests=16, time_scale=1.0)
    pre = SimParams(dp_size=2, time_scale=1.0)
    cluster = await start_cluster(1, 1, dec, pre)
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    assert prefill.bootstrap_port is not None and decode.decode is not None
    port, prom = _free_port(), _free_port()
    cmd = router_command(cell, prefill.url, prefill.bootstrap_port, decode.url, port, prom)
    cmd = [a if a != "@CFG" else cfg for a in cmd]
    safe = "".join(ch if ch.isalnum() else "_" for ch in f"{cell.label}_{rate}")
    router = RouterProcess(cmd, port, os.path.join(out_dir, f"flow_{safe}.log"))
    loop = asyncio.get_running_loop()
    records: list[tuple[Req, ReqRecord]] = []
    reasons: dict[str, int] = {}
    try:
        await router.start()
        wall0 = time.time() - loop.time()
        span = ns.warmup + ns.duration
        reqs = workload(rate, span, ns.seed)
        t0 = loop.time()
        rng = random.Random(ns.seed)
        tasks = []

        async def one(r: Req) -> None:
            await asyncio.sleep(max(0.0, t0 + r.t - loop.time()))
            item = TraceItem(256, 16) if r.interactive else TraceItem(2048, 128)
            headers = {"x-smg-priority": "interactive" if r.interactive else "bulk", "x-smg-tenant-id": r.tenant}
            rec = ReqRecord(loop.time(), item.input_tokens)
            records.append((r, rec))
            conn = HttpConnection("127.0.0.1", port)
            try:
                await _one(conn, None, Target("127.0.0.1", port, headers=headers), encode_request(item), rec, rng, 600)
            finally:
                conn.close()

        for r in reqs:
            tasks.append(loop.create_task(one(r)))
        await asyncio.sleep(span)
        window = (t0 + ns.warmup, t0 + span)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        reasons = await loop.run_in_executor(None, refusal_reasons, prom)
    finally:
        await router.stop()
        await _drain(cluster)
        samples = list(decode.decode.samples)
        await cluster.stop()
    lo, hi = window
    started = [(r, rec) for r, rec in records if lo <= rec.t_start]
    done = [(r, rec) for r, rec in started if rec.ok and rec.t_last <= hi]
    inter_ttft = [(rec.t_first - rec.t_start) * 1000 for r, rec in done if r.interactive and rec.n_tokens]
    # Goodput: bulk requests completed inside the window, whenever they were sent.
    bulk_done = sum(1 for r, rec in records if not r.interactive and rec.ok and lo <= rec.t_last <= hi)
    refused = Counter(rec.error for _, rec in started if rec.error and rec.error.startswith("status"))
    stats = balance_stats([s for s in samples if lo + wall0 <= s[0] <= hi + wall0])
    return {
        "label": cell.label,
        "rate": rate,
        "inter_ttft_p50": _percentile(inter_ttft, 50),
        "inter_ttft_p90": _percentile(inter_ttft, 90),
        "inter_done": len(inter_ttft),
        "bulk_per_s": bulk_done / (hi - lo),
        "refused": dict(refused),
        "reasons": reasons,
        "busiest": stats.get("busiest_batch", float("nan")),
    }


def refusal_reasons(prom: int) -> dict[str, int]:
    """Refusals by reason from the router's /metrics: fastroute_flow_refusals_total, or smg's
    scheduler outcomes (smg_scheduler_admit_total other than admitted)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{prom}/metrics", timeout=10) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: Counter[str] = Counter()
    for line in text.splitlines():
        m = re.match(r"(fastroute_flow_refusals_total|smg_scheduler_admit_total)\{(.*)\} ([0-9.e+]+)$", line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
        reason = labels.get("reason") or labels.get("outcome", "")
        if reason and reason != "admitted":
            out[reason] += int(float(m.group(3)))
    return dict(out)


def cells(smg_python: str | None) -> list[Cell]:
    sched = ["--priority-scheduler-enabled", "--trust-tenant-header", "--priority-scheduler-config", "@CFG"]
    out = [
        Cell("fastroute, flow control off", "fastroute", ["--policy", "round_robin"]),
        Cell("fastroute, scheduler", "fastroute", ["--policy", "round_robin"] + sched),
        Cell(
            "fastroute, scheduler, waiting gate off",
            "fastroute",
            ["--policy", "round_robin", "--worker-overload-waiting-requests", "0"] + sched,
        ),
    ]
    if smg_python:
        out.append(Cell("smg 1.13, scheduler", "smg", ["--policy", "round_robin"] + sched, smg_python, dp_aware=False))
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "| router | rate | interactive TTFT p50 / p90 (ms) | interactive done | bulk done/s | refused | "
        "decode busiest batch |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        refused = ", ".join(f"{k.split()[-1]} x{v}" for k, v in sorted(r["refused"].items())) or "none"
        if r["reasons"]:
            refused += " (" + ", ".join(f"{k} {v}" for k, v in sorted(r["reasons"].items())) + ")"
        lines.append(
            f"| {r['label']} | {r['rate']:g}/s | {r['inter_ttft_p50']:.0f} / {r['inter_ttft_p90']:.0f} | "
            f"{r['inter_done']} | {r['bulk_per_s']:.2f} | {refused} | {r['busiest']:.1f} |"
        )
    return "\n".join(lines)


async def main_async(ns: argparse.Namespace) -> list[dict]:
    out_dir = tempfile.mkdtemp(prefix="flow-bench-")
    cfg = os.path.join(out_dir, "priority.yaml")
    with open(cfg, "w") as f:
        f.write(SCHEDULER_YAML)
    rows = []
    for cell in [c for c in cells(ns.smg_python) if ns.only in c.label]:
        for mult in (1, 2):
            row = await run_point(cell, ns.rate * mult, ns, cfg, out_dir)
            print(row, flush=True)
            rows.append(row)
    print(f"logs in {out_dir}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=4.0, help="1x arrival rate, requests/s (2x is also run)")
    ap.add_argument("--duration", type=float, default=40.0, help="measured seconds per point")
    ap.add_argument("--warmup", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--smg-python", default=None, help="interpreter with smg 1.13 installed (a row when given)")
    ap.add_argument("--only", default="", help="run only the cells whose label contains this")
    ns = ap.parse_args(argv)
    rows = uvloop.run(main_async(ns))
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
