"""``fastroute demo``: a short look at decode-rank balancing on simulated hardware.

Owns only the demo's choices: 1 simulated prefill + 1 simulated decode of 8 DP ranks in this
process, the router as a subprocess in PD + --dp-aware mode, three policies (round_robin,
power_of_two least_requests, decode demand with W = 1e6) and, as the baseline, the router
without --dp-aware leaving the rank to SGLang's own ``--load-balance-method total_requests``;
the comparison table on stdout and the per-rank plot; then the same cluster with a prefix cache per prefill rank under
conversation traffic (bursts, prompts that share prefixes): the default policy, least_requests
and cache_aware with affinity on decode too, with the prefill's prefix hit rate beside the
balance. The machinery is fastroute.sim.balance and fastroute.sim.convbench.
"""

from __future__ import annotations

import argparse
import sys

import uvloop

from fastroute.sim import convbench
from fastroute.sim.balance import Cell, add_common_flags, failed_cells, fastroute_cells, run_matrix, write_outputs
from fastroute.sim.engine import SimParams
from fastroute.sim.enginebench import engine_cells

DEMO_LABELS = ("round_robin", "p2c least_requests", "demand W=1e+06")
ENGINE_LABEL = "no --dp-aware, SGLang total_requests"


def demo_cells() -> list[Cell]:
    by_label = {c.label: c for c in fastroute_cells()}
    by_label.update((c.label, c) for c in engine_cells(prefill_demand=False))
    return [by_label[label] for label in DEMO_LABELS + (ENGINE_LABEL,)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="fastroute demo", description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument(
        "--conversation-rate", type=float, default=6.5, help="arrivals per simulated second of the conversation part"
    )
    ap.add_argument("--no-conversations", action="store_true", help="skip the conversation part")
    add_common_flags(ap, duration=60.0, warmup=0.0, time_scale=0.25)
    ap.set_defaults(out="bench/out/demo")
    ns = ap.parse_args(argv)
    cells = demo_cells()
    # --duration is the whole demo; each policy gets a quarter, a quarter of which is warm-up
    # unless --warmup says otherwise.
    per_cell = ns.duration / len(cells)
    warmup = ns.warmup if ns.warmup > 0 else per_cell * 0.25
    measured = max(0.5, per_cell - warmup)
    params = SimParams(dp_size=ns.dp_size, time_scale=ns.time_scale)
    print(
        f"fastroute demo: 1 prefill + 1 decode x {ns.dp_size} DP ranks (simulated, time scale "
        f"{ns.time_scale:g}), concurrency {ns.concurrency}, {len(cells)} policies x "
        f"({warmup:.1f} s warm-up + {measured:.1f} s measured)",
        flush=True,
    )

    async def go() -> list[dict]:
        return await run_matrix(cells, [ns.concurrency], measured, warmup, params, ns.out, ns.seed, not ns.quiet)

    results = uvloop.run(go())
    if not results:
        print("demo: no policy ran (see the router logs in the output directory)", file=sys.stderr)
        return 1
    print(write_outputs(results, ns.out, ns.time_scale))
    print(f"table, JSON and plot written to {ns.out}/", flush=True)
    bad = failed_cells(results)
    if not ns.no_conversations:
        cap = argparse.ArgumentParser()
        convbench.add_flags(cap)
        cns = cap.parse_args(
            [
                "--duration",
                str(measured),
                "--warmup",
                str(warmup),
                "--time-scale",
                str(ns.time_scale),
                "--rate",
                str(ns.conversation_rate),
                "--arrivals",
                "bursty",
                "--out",
                f"{ns.out}/conversations",
                "--seed",
                str(ns.seed),
            ]
            + (["--quiet"] if ns.quiet else [])
        )
        cells = [c for c in convbench.policy_cells() if c.label != "round_robin"]
        print("conversations (bursts, shared prefixes, a prefix cache per prefill rank):", flush=True)
        conv = uvloop.run(convbench.run_all(cells, cns))
        print(convbench.table(conv))
        bad += [r["label"] for r in conv if not r["load"]["completed"]]
        if len(conv) < len(cells):
            bad.append("conversations")
    if bad:
        print(f"demo: no request completed in {', '.join(bad)}; see the router logs in {ns.out}/", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
