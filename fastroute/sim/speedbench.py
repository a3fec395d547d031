"""Speed-aware placement on mixed hardware (``python bench/speed_aware.py``, issue 47).

The cluster is 1 prefill and 2 decode servers, DP 8 each; the second decode server is
``ratio`` times slower (``--speed-factor``), or, in the ``slowdown`` point, as fast as the first
until the middle of the measured window and then 2 times slower (``--slowdown-at``). The
workload is the conversation workload (``conversations.conversation_trace``) replayed open loop.
The ``--slo-points`` are run again with 30% of the requests (every request whose index is 3, 6
or 9 mod 10) carrying a TPOT target (``x-slo-tpot-ms``) of 0.95 x ratio x the step base: the slow
server's step alone is longer, the fast one meets it at a light batch.

Rows: ``least_requests`` (p2c least_requests on both legs), ``demand`` (with
``--decode-input-demand on``), ``speed-aware`` (least_requests with ``--speed-aware on``). Each
row on a fresh cluster; per row TPOT p50/p90 of the requests that started and ended in the
window, output tokens/s, and the share of the target-carrying requests whose measured TPOT met
the target.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

import uvloop

from fastroute.sim.balance import (
    Cell,
    RouterProcess,
    _drain,
    _f,
    _free_port,
    balance_stats,
    merge_samples,
    router_command,
)
from fastroute.sim.conversations import conversation_trace, run_open_loop
from fastroute.sim.engine import SimParams
from fastroute.sim.loadgen import _percentile
from fastroute.sim.worker import start_cluster

LEAST = ["--policy", "power_of_two", "--p2c-load-metric", "least_requests", "--prefill-policy", "round_robin"]
CELLS = [
    Cell("least_requests", "fastroute", LEAST),
    Cell("demand", "fastroute", LEAST + ["--decode-input-demand", "on"]),
    Cell("speed-aware", "fastroute", LEAST + ["--speed-aware", "on"]),
]
SLOWDOWN = 2.0
MIN_TOKENS = 10


def _slo_ms(ratio: float) -> float:
    return 0.95 * ratio * SimParams().step_base_ms


async def run_point(cell: Cell, ns: argparse.Namespace, point: str, ratio: float, with_slo: bool) -> dict:
    fast = SimParams(dp_size=8, time_scale=ns.time_scale)
    if point == "slowdown":
        slow = SimParams(
            dp_size=8,
            time_scale=ns.time_scale,
            slowdown_at=ns.warmup + ns.duration / 2,
            slowdown_factor=SLOWDOWN,
        )
        slo = _slo_ms(SLOWDOWN) if with_slo else 0.0
    else:
        slow = SimParams(dp_size=8, time_scale=ns.time_scale, speed_factor=ratio)
        slo = _slo_ms(ratio) if ratio > 1.0 and with_slo else 0.0
    prefill = SimParams(dp_size=8, time_scale=ns.time_scale, prefill_tokens_per_s=ns.prefill_tokens_per_s)
    cluster = await start_cluster(1, 2, fast, prefill, decode_params=[fast, slow])
    p = cluster.prefills[0]
    assert p.bootstrap_port is not None
    port, prom = _free_port(), _free_port()
    cmd = router_command(cell, p.url, p.bootstrap_port, [d.url for d in cluster.decodes], port, prom)
    safe = "".join(ch if ch.isalnum() else "_" for ch in f"{cell.label}_{point}")
    rp = RouterProcess(cmd, port, os.path.join(ns.out, f"speed_{safe}.log"))
    span = (ns.warmup + ns.duration) / ns.time_scale + 5
    arr = conversation_trace(span, ns.rate, seed=ns.seed)
    slo_hdr = {"x-slo-tpot-ms": f"{slo:g}"} if slo > 0 else None

    def headers_of(i: int) -> dict[str, str] | None:
        return slo_hdr if i % 10 in (3, 6, 9) else None

    try:
        await rp.start()
        wall_offset = time.time() - asyncio.get_running_loop().time()
        res = await run_open_loop(
            "127.0.0.1", (port,), arr, ns.time_scale, ns.warmup, ns.duration, ns.seed, 600.0, False, headers_of
        )
    finally:
        await rp.stop()
        await _drain(cluster)
        await cluster.stop()
    t0, t1 = res.window
    # Per request, its time per output token over the tokens it received inside the window (at
    # least MIN_TOKENS): requests of ~343 tokens outlast a short window, so completed ones alone
    # would be few and biased to the short.
    tpot: list[float] = []
    targeted: list[float] = []
    for r in res.records:
        tt = [t for t in r.token_times if t0 <= t <= t1]
        if len(tt) < MIN_TOKENS:
            continue
        x = (tt[-1] - tt[0]) * 1000 / ns.time_scale / (len(tt) - 1)
        tpot.append(x)
        if r.headers is not None:
            targeted.append(x)
    toks = sum(1 for r in res.records for t in r.token_times if t0 <= t <= t1)
    done = [r for r in res.records if r.ok and r.t_start >= t0 and r.t_last <= t1]
    decs = [d.decode for d in cluster.decodes if d.decode is not None]
    samples = merge_samples([[s for s in d.samples if t0 + wall_offset <= s[0] <= t1 + wall_offset] for d in decs])
    per_server = [sum(d.placed) for d in decs]
    return {
        "label": cell.label,
        "point": point,
        "tpot_p50": _percentile(tpot, 50),
        "tpot_p90": _percentile(tpot, 90),
        "tok_s": toks / max(1e-9, t1 - t0) / ns.time_scale,
        "completed": len(done),
        "measured": len(tpot),
        "errors": res.errors,
        "slo_ms": slo,
        "slo_met": (sum(1 for x in targeted if x <= slo) / len(targeted)) if targeted and slo > 0 else None,
        "slo_n": len(targeted),
        "split": per_server,
        "busiest": balance_stats(samples).get("busiest_batch"),
    }


def table(results: list[dict]) -> str:
    head = (
        "| point | router | TPOT p50 / p90 ms | output tok/s | TPOT target met | requests fast / slow server | "
        "measured / completed | errors |\n|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for r in results:
        met = "-" if r["slo_met"] is None else f"{100 * r['slo_met']:.0f}% of {r['slo_n']} ({r['slo_ms']:.1f} ms)"
        rows.append(
            f"| {r['point']} | {r['label']} | {_f(r['tpot_p50'], 1)} / {_f(r['tpot_p90'], 1)} | {r['tok_s']:.0f} | "
            f"{met} | {r['split'][0]} / {r['split'][1]} | {r['measured']} / {r['completed']} | {r['errors']} |"
        )
    return head + "\n".join(rows) + "\n"


async def run_all(ns: argparse.Namespace) -> list[dict]:
    results = []
    todo = [(p, False) for p in ns.points] + [(p, True) for p in ns.slo_points]
    for point, with_slo in todo:
        ratio = 1.0 if point == "slowdown" else float(point)
        name = point if point == "slowdown" else f"ratio {ratio:g}"
        name += ", 30% with a TPOT target" if with_slo else ""
        for cell in CELLS:
            if ns.only and not any(o in cell.label for o in ns.only):
                continue
            if with_slo and cell.label == "demand":
                continue
            print(f"== {name}: {cell.label}", file=sys.stderr, flush=True)
            r = await run_point(cell, ns, name, ratio, with_slo)
            print("   " + table([r]).splitlines()[-1], file=sys.stderr, flush=True)
            results.append(r)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/speed_aware.py", description=__doc__.split("\n")[0])
    ap.add_argument("--points", nargs="*", default=["1.0", "1.6", "2.5", "slowdown"])
    ap.add_argument(
        "--slo-points",
        nargs="*",
        default=["1.6", "2.5"],
        help="points run again with 30%% of requests carrying a TPOT target (least_requests, speed-aware)",
    )
    ap.add_argument("--rate", type=float, default=6.0, help="arrivals per simulated second")
    ap.add_argument("--duration", type=float, default=30.0, help="measured wall seconds per row")
    ap.add_argument("--warmup", type=float, default=10.0, help="unmeasured wall seconds per row")
    ap.add_argument("--time-scale", type=float, default=1.0, help="wall seconds per simulated second")
    ap.add_argument("--prefill-tokens-per-s", type=float, default=120_000.0, help="per prefill rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", nargs="*", help="rows whose label contains one of these")
    ap.add_argument("--out", default="bench/out/speed_aware")
    ns = ap.parse_args(argv)
    os.makedirs(ns.out, exist_ok=True)
    results = uvloop.run(run_all(ns))
    out = table(results)
    with open(os.path.join(ns.out, "speed_aware.md"), "w") as fh:
        fh.write(out)
    print(out)
    return 0 if results and all(r["completed"] for r in results) else 1
