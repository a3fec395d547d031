"""The engine-balance benchmark: SGLang balancing its own DP ranks vs fastroute placing them.

``python bench/balance.py --engine-balance`` runs here. Scenarios: a DP-8 prefill and 1 or 2
decode servers of 8 DP ranks each (1P1D, 1P2D), closed-loop concurrency 192 and 512, the
input-heavy synthetic trace. Rows (``engine_cells``; append a ``Cell`` to extend):

* "no --dp-aware, SGLang <method>": fastroute picks only the server (least_requests over the
  decodes); the simulated engines place the rank themselves with ``--load-balance-method``
  (``fastroute.sim.dispatch``), the same method on the prefill and the decodes. ``auto`` is
  SGLang's default (the prefill follows the random bootstrap room, the decode round robin).
* fastroute with ``--dp-aware``: least_requests on both legs, + decode KV fit, decode input
  demand (W = 1e6), and prefill input demand on (when this checkout's router has the flag).

Columns: TTFT and TPOT p50 / p90 (simulated ms), the busiest decode rank's running batch (mean
over 100 ms samples, all decode ranks together), the prefill-rank queue CV (mean over samples of
std / mean across the 8 prefill ranks of the requests running or queued; token CV beside it)
and the modelled decode step. Every result is in ``engine_balance.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import uvloop

from fastroute.sim.balance import Cell, _f, add_common_flags, failed_cells, run_matrix
from fastroute.sim.engine import SimParams

LEAST = ["--policy", "power_of_two", "--p2c-load-metric", "least_requests"]
SGLANG_METHODS = ("auto", "round_robin", "total_requests", "total_tokens")


def router_has_flag(flag: str) -> bool:
    """Whether this checkout's router takes ``flag`` (its --help names it)."""
    try:
        out = subprocess.run([sys.executable, "-m", "fastroute", "--help"], capture_output=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return flag.encode() in out.stdout


def engine_cells(prefill_demand: bool | None = None) -> list[Cell]:
    """The rows: SGLang's own balancing (no router rank), then fastroute's policies."""
    cells = [
        Cell(
            f"no --dp-aware, SGLang {m}" + (" (prefill: room, decode: round_robin)" if m == "auto" else ""),
            "fastroute",
            LEAST,
            dp_aware=False,
            sim={"load_balance_method": m},
        )
        for m in SGLANG_METHODS
    ]
    cells += [
        Cell("least_requests", "fastroute", LEAST),
        Cell("least_requests + KV fit", "fastroute", LEAST + ["--decode-kv-fit", "on"]),
        Cell(
            "demand W=1e6", "fastroute", LEAST + ["--decode-input-demand", "on", "--decode-request-weight", "1000000"]
        ),
    ]
    if prefill_demand is None:
        prefill_demand = router_has_flag("--prefill-input-demand")
        if not prefill_demand:
            print("router has no --prefill-input-demand: its row is left out", file=sys.stderr)
    if prefill_demand:
        cells.append(
            Cell("least_requests + prefill input demand on", "fastroute", LEAST + ["--prefill-input-demand", "on"])
        )
    return cells


def table(results: list[dict], time_scale: float, params: SimParams, prefill: SimParams) -> str:
    lines = []
    keys = sorted({(r["n_decode"], r["concurrency"]) for r in results})
    for n_dec, conc in keys:
        rows = [r for r in results if r["n_decode"] == n_dec and r["concurrency"] == conc]
        n_rep = len({r.get("repeat", 0) for r in rows})
        lines.append(
            f"\n#### 1P{n_dec}D ({n_dec * params.dp_size} decode ranks, DP-{prefill.dp_size} prefill at "
            f"{prefill.prefill_tokens_per_s:,.0f} tokens/s per rank), C={conc}, time scale {time_scale:g}"
            + (f", {n_rep} runs (one row each)" if n_rep > 1 else "")
            + "; times in simulated ms\n"
        )
        lines.append(
            "| rows | TTFT p50 / p90 | TPOT p50 / p90 | busiest decode batch (mean) | step ms "
            "| prefill queue CV (req / tok) | out tok/s | done | err |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            b, ld, pf = r["balance"], r["load"], r.get("prefill") or {}
            tag = f" #{r['repeat'] + 1}" if n_rep > 1 else ""
            lines.append(
                f"| {r['label']}{tag} | {_f(ld['ttft_p50_ms'], 0)} / {_f(ld['ttft_p90_ms'], 0)} | "
                f"{_f(ld['tpot_p50_ms'], 1)} / {_f(ld['tpot_p90_ms'], 1)} | "
                f"{_f(b.get('busiest_batch'), 1)} ({_f(b.get('mean_batch'), 1)}) | {_f(b.get('step_ms'), 1)} | "
                f"{_f(pf.get('queue_cv'))} / {_f(pf.get('token_cv'))} | {_f(ld['output_tok_s'], 0)} | "
                f"{ld['completed']} | {ld['errors']} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/balance.py --engine-balance", description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[192, 512])
    ap.add_argument("--decodes", type=int, nargs="+", default=[1, 2], help="decode servers: 1 = 1P1D, 2 = 1P2D")
    ap.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=60_000.0,
        help="prefill compute per DP rank (the simulator's default is 120k)",
    )
    ap.add_argument("--input-mean", type=float, default=30_000.0)
    ap.add_argument("--repeat", type=int, default=1, help="interleaved runs of every row (trace seed + k)")
    ap.add_argument("--only", nargs="*", help="run only rows whose label contains one of these")
    ap.add_argument("--no-prefill-demand", action="store_true", help="leave out the prefill input demand row")
    add_common_flags(ap, duration=20.0, warmup=6.0, time_scale=0.25)
    ap.set_defaults(out="bench/out/engine_balance")
    ns = ap.parse_args(argv)
    cells = engine_cells(False if ns.no_prefill_demand else None)
    if ns.only:
        cells = [c for c in cells if any(o in c.label for o in ns.only)]
    params = SimParams(dp_size=ns.dp_size, time_scale=ns.time_scale)
    prefill = SimParams(dp_size=8, time_scale=ns.time_scale, prefill_tokens_per_s=ns.prefill_tokens_per_s)
    os.makedirs(ns.out, exist_ok=True)
    results: list[dict] = []
    for n_dec in ns.decodes:
        print(f"=== 1P{n_dec}D", file=sys.stderr, flush=True)
        results += uvloop.run(
            run_matrix(
                cells,
                ns.concurrency,
                ns.duration,
                ns.warmup,
                params,
                ns.out,
                ns.seed,
                not ns.quiet,
                prefill_params=prefill,
                repeat=ns.repeat,
                trace_kwargs={"input_mean": ns.input_mean},
                n_decode=n_dec,
            )
        )
        for r in results:
            r.pop("samples", None)
        out = table(results, ns.time_scale, params, prefill)
        with open(os.path.join(ns.out, "engine_balance.md"), "w") as fh:
            fh.write(out)
        with open(os.path.join(ns.out, "engine_balance.json"), "w") as fh:
            json.dump(results, fh, indent=1)
    print(out)
    bad = failed_cells(results)
    if bad:
        print(f"no request completed in: {', '.join(bad)} (router logs in {ns.out}/)", file=sys.stderr)
    return 0 if results and not bad else 1
