"""Conversation benchmark: the default policy and router replicas on prefix-sharing traffic.

``python bench/balance.py --conversations`` (policies) and ``python bench/replicas.py``
(replicas) run here. The cluster is 1 prefill + 1 decode, each with 8 DP-attention ranks; every
prefill rank has its own prefix cache (``SimParams.prefix_cache_tokens``), so routing a prompt
to the rank that computed its prefix shortens its prefill. The conversation trace
(``fastroute.sim.conversations``) is replayed open loop, smooth or in bursts, and each row
reports decode balance (TPOT, busiest running batch, CV of outstanding requests per rank), TTFT
and the prefill's prefix hit rate (cached / input tokens of the prefills started in the window).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
import time

import uvloop

from fastroute.sim.balance import Cell, RouterProcess, _drain, _f, _free_port, balance_stats, router_command
from fastroute.sim.conversations import (
    burstify,
    conversation_trace,
    mooncake_arrivals,
    mooncake_like_trace,
    read_mooncake_trace,
    run_open_loop,
)
from fastroute.sim.engine import SimParams
from fastroute.sim.loadgen import _percentile, scale_summary
from fastroute.sim.redisproc import RedisProcess
from fastroute.sim.worker import SimCluster, start_cluster

LEAST = ["--policy", "power_of_two", "--p2c-load-metric", "least_requests"]


def policy_cells(kv_fit: bool = False) -> list[Cell]:
    """The conversation benchmark's comparison: the default (no policy flag), least_requests, round robin and
    cache_aware on both legs with affinity on decode too (what the default did before)."""
    kv = ["--decode-kv-fit", "on"] if kv_fit else []
    cells = [
        Cell("default (cache_aware)", "fastroute", kv),
        Cell("least_requests", "fastroute", LEAST + kv),
        Cell(
            "cache_aware, affinity on decode too",
            "fastroute",
            ["--policy", "cache_aware", "--decode-policy", "cache_aware"] + kv,
        ),
    ]
    if not kv_fit:
        cells.append(Cell("round_robin", "fastroute", ["--policy", "round_robin"]))
    return cells


def replica_cells(ns: list[int], args: list[str] | None = None) -> list[Cell]:
    """One router, then N unsynced and N synced replicas for each N."""
    args = LEAST if args is None else args
    cells = [Cell("1 router", "fastroute", args)]
    for n in ns:
        cells += [
            Cell(f"{n} replicas, no sync", "fastroute", args, replicas=n),
            Cell(f"{n} replicas, synced", "fastroute", args, replicas=n, sync=True),
        ]
    return cells


async def run_point(
    cell: Cell,
    cluster: SimCluster,
    arrivals: list,
    warmup: float,
    duration: float,
    out_dir: str,
    tag: str,
    extra: list[str] | None = None,
    sync_ms: int | None = None,
) -> dict:
    prefill, decode = cluster.prefills[0], cluster.decodes[0]
    assert prefill.prefill is not None and decode.decode is not None and prefill.bootstrap_port is not None
    redis_proc = RedisProcess().start() if cell.sync else None
    replicas: list[RouterProcess] = []
    safe = "".join(ch if ch.isalnum() else "_" for ch in cell.label + "_" + tag)
    try:
        ports = []
        for k in range(cell.replicas):
            port, prom = _free_port(), _free_port()
            cmd = router_command(cell, prefill.url, prefill.bootstrap_port, decode.url, port, prom)
            cmd += extra or []
            if redis_proc is not None:
                cmd += ["--replica-sync", redis_proc.url, "--replica-id", f"r{k}"]
                if sync_ms is not None:
                    cmd += ["--replica-sync-interval-ms", str(sync_ms)]
            replicas.append(RouterProcess(cmd, port, os.path.join(out_dir, f"conv_{safe}_r{k}.log")))
            await replicas[-1].start()
            ports.append(port)
        loop = asyncio.get_running_loop()
        wall_offset = time.time() - loop.time()
        pe = prefill.prefill
        hits0, in0 = pe.hit_tokens, pe.input_tokens
        hit_mark: list[tuple[int, int]] = []

        async def mark() -> None:
            await asyncio.sleep(warmup)
            hit_mark.append((pe.hit_tokens, pe.input_tokens))

        marker = loop.create_task(mark())
        res = await run_open_loop("127.0.0.1", tuple(ports), arrivals, decode.p.time_scale, warmup, duration)
        marker.cancel()
        h0, i0 = hit_mark[0] if hit_mark else (hits0, in0)
        hit_rate = (pe.hit_tokens - h0) / max(1, pe.input_tokens - i0)
    finally:
        for rp in replicas:
            await rp.stop()
        if redis_proc is not None:
            redis_proc.stop()
        await _drain(cluster)
    t0, t1 = res.window[0] + wall_offset, res.window[1] + wall_offset
    samples = [s for s in decode.decode.samples if t0 <= s[0] <= t1]
    load = scale_summary(res.summary(), decode.p.time_scale)
    done = [r for r in res.records if r.ok and r.t_start >= res.window[0] and r.t_last <= res.window[1]]
    ttft = [(r.t_first - r.t_start) * 1000 / decode.p.time_scale for r in done if r.n_tokens]
    load["ttft_p99_ms"] = _percentile(ttft, 99)
    return {
        "label": cell.label,
        "tag": tag,
        "load": load,
        "balance": balance_stats(samples),
        "hit_rate": hit_rate,
        "args": cell.args,
    }


def table(results: list[dict]) -> str:
    head = (
        "| arrivals | router | TPOT p50 / p90 ms | busiest batch | mean batch | busiest - mean | "
        "CV of outstanding | step ms | TTFT p50 / p90 / p99 ms | prefill prefix hits | completed | "
        "errors |\n|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for r in results:
        ld, b = r["load"], r["balance"]
        rows.append(
            f"| {r['tag']} | {r['label']} | {_f(ld['tpot_p50_ms'], 1)} / {_f(ld['tpot_p90_ms'], 1)} | "
            f"{_f(b.get('busiest_batch'), 1)} | {_f(b.get('mean_batch'), 1)} | "
            f"{_f(b.get('busiest_batch', 0) - b.get('mean_batch', 0), 2)} | "
            f"{_f(b.get('outstanding_cv'), 3)} | {_f(b.get('step_ms'), 1)} | "
            f"{_f(ld['ttft_p50_ms'], 0)} / {_f(ld['ttft_p90_ms'], 0)} / {_f(ld['ttft_p99_ms'], 0)} | "
            f"{100 * r['hit_rate']:.1f}% | {ld['completed']} | {ld['errors']} |"
        )
    return head + "\n".join(rows) + "\n"


def sim_params(ns: argparse.Namespace) -> tuple[SimParams, SimParams]:
    decode = SimParams(
        dp_size=ns.dp_size,
        time_scale=ns.time_scale,
        max_total_num_tokens=ns.max_total_num_tokens,
        kv_transfer_tokens_per_s=ns.kv_transfer_tokens_per_s,
    )
    prefill = SimParams(
        dp_size=ns.dp_size,
        time_scale=ns.time_scale,
        prefix_cache_tokens=ns.prefix_cache_tokens,
        kv_events_port_base=-1 if ns.kv_events else 0,
    )
    return decode, prefill


def trace_arrivals(ns: argparse.Namespace, span: float, seed: int) -> list:
    """The replayed arrivals: the session trace (text prompts), or trace mode (``input_ids``
    from Mooncake hash ids: ``--trace-file`` or a generated trace), at ``--rate``."""
    if ns.trace == "sessions":
        return conversation_trace(span, ns.rate, seed=seed)
    if ns.trace_file:
        rows = read_mooncake_trace(ns.trace_file)
    else:
        rows = mooncake_like_trace(int(span * ns.rate * 1.2) + 10, ns.rate, seed=seed)
    return mooncake_arrivals(rows, ns.rate, span)


def add_flags(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--rate", type=float, default=6.5, help="arrivals per simulated second")
    ap.add_argument("--arrivals", nargs="+", choices=("smooth", "bursty"), default=["bursty", "smooth"])
    ap.add_argument("--burst", type=float, default=10.0, help="mean requests per burst (bursty arrivals)")
    ap.add_argument("--duration", type=float, default=30.0, help="measured wall seconds per point")
    ap.add_argument("--warmup", type=float, default=10.0, help="unmeasured wall seconds per point")
    ap.add_argument("--time-scale", type=float, default=0.25)
    ap.add_argument("--dp-size", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1, help="interleaved runs (trace seed + k); tables list each")
    ap.add_argument("--max-total-num-tokens", type=int, default=1_500_000, help="decode KV per rank")
    ap.add_argument(
        "--kv-tight", action="store_true", help="420k KV tokens per decode rank and a 2M tokens/s KV transfer channel"
    )
    ap.add_argument("--kv-transfer-tokens-per-s", type=float, default=0.0)
    ap.add_argument("--prefix-cache-tokens", type=int, default=500_000, help="prefix cache per prefill rank")
    ap.add_argument("--only", nargs="*", help="run only cells whose label contains one of these")
    ap.add_argument(
        "--trace",
        choices=("sessions", "mooncake"),
        default="sessions",
        help="sessions: text prompts of multi-turn sessions; mooncake: input_ids from Mooncake "
        "conversation-trace hash ids (512-token blocks, ~36.6%% block reuse)",
    )
    ap.add_argument(
        "--trace-file",
        metavar="JSONL",
        help="--trace mooncake: replay this copy of FAST25-release/traces/conversation_trace.jsonl "
        "(times stretched to --rate) instead of a generated trace",
    )
    ap.add_argument(
        "--kv-events",
        action="store_true",
        help="the prefill publishes KV events and LoadStat per rank (advertised in /server_info)",
    )
    ap.add_argument("--router-args", default="", help="extra flags for every fastroute (one string)")
    ap.add_argument("--out", default="bench/out/conversations")
    ap.add_argument(
        "--router-checkout",
        metavar="DIR",
        help="run the routers from this checkout (built in place), e.g. an older commit",
    )
    ap.add_argument("--quiet", action="store_true")


def wall_sync_ms(ns: argparse.Namespace) -> int | None:
    """The synced replicas' ``--replica-sync-interval-ms``: ``--sync-interval-sim-ms`` of simulated
    time in wall ms (at least 1, rounded up), or None (the router's default, in wall time)."""
    sim_ms = getattr(ns, "sync_interval_sim_ms", None)
    if sim_ms is None:
        return None
    return max(1, math.ceil(sim_ms * ns.time_scale))


async def run_all(cells: list[Cell], ns: argparse.Namespace) -> list[dict]:
    decode_p, prefill_p = sim_params(ns)
    os.makedirs(ns.out, exist_ok=True)
    cluster = await start_cluster(1, 1, decode_p, prefill_p)
    results = []
    extra = ns.router_args.split() if ns.router_args else []
    try:
        for rep in range(ns.repeat):
            span = (ns.warmup + ns.duration) / ns.time_scale + 5
            base = trace_arrivals(ns, span, ns.seed + rep)
            for kind in ns.arrivals:
                arrivals = burstify(base, ns.rate, ns.burst) if kind == "bursty" else base
                for cell in cells:
                    tag = kind + (f" #{rep + 1}" if ns.repeat > 1 else "")
                    if not ns.quiet:
                        print(f"== {cell.label} ({tag})", file=sys.stderr, flush=True)
                    try:
                        r = await run_point(
                            cell, cluster, arrivals, ns.warmup, ns.duration, ns.out, tag, extra, wall_sync_ms(ns)
                        )
                    except RuntimeError as exc:
                        print(f"   skipped: {exc}", file=sys.stderr, flush=True)
                        continue
                    if not ns.quiet:
                        print("   " + table([r]).splitlines()[-1], file=sys.stderr, flush=True)
                    results.append(r)
    finally:
        await cluster.stop()
    return results


def main(argv: list[str] | None = None, mode: str = "policies") -> int:
    ap = argparse.ArgumentParser(
        prog="python bench/replicas.py" if mode == "replicas" else "python bench/balance.py --conversations",
        description=__doc__.split("\n")[0],
    )
    add_flags(ap)
    if mode == "replicas":
        ap.add_argument("--replicas", type=int, nargs="+", default=[3], help="N of the N-replica rows")
        ap.add_argument("--kv-fit", action="store_true", help="every router with --decode-kv-fit on")
        ap.add_argument(
            "--sync-interval-sim-ms",
            type=float,
            default=None,
            metavar="MS",
            help="the synced replicas' sync interval in simulated ms (wall ms = MS x time "
            "scale, rounded up): the simulator runs 1/time-scale times faster than "
            "real time, so the router's default 10 wall ms is 10/time-scale simulated "
            "ms here; default: the router's own default",
        )
    else:
        ap.add_argument("--kv-fit", action="store_true", help="every row with --decode-kv-fit on")
    ns = ap.parse_args(argv)
    if ns.trace_file and ns.trace != "mooncake":
        ap.error("--trace-file needs --trace mooncake")
    if ns.router_checkout:
        # Only the router subprocesses see it; the simulators here are already imported.
        os.environ["PYTHONPATH"] = os.path.abspath(ns.router_checkout)
    if ns.kv_tight:
        ns.max_total_num_tokens = 420_000
        ns.kv_transfer_tokens_per_s = ns.kv_transfer_tokens_per_s or 2e6
    if mode == "replicas":
        cells = replica_cells(ns.replicas, LEAST + (["--decode-kv-fit", "on"] if ns.kv_fit else []))
    else:
        cells = policy_cells(ns.kv_fit)
        if ns.arrivals == ["bursty", "smooth"]:
            ns.arrivals = ["bursty"]
    if ns.only:
        cells = [c for c in cells if any(o in c.label for o in ns.only)]
    results = uvloop.run(run_all(cells, ns))
    out = table(results)
    with open(os.path.join(ns.out, f"{mode}.md"), "w") as fh:
        fh.write(out)
    print(out)
    return 0 if results and all(r["load"]["completed"] for r in results) else 1
