"""What a benchmark run of :mod:`fastroute.sim.balance` writes: the markdown tables (the policy
matrix, the KV-tight scenario's medians), the PNG plots (when matplotlib is installed), the
JSON results, and the list of cells that failed. Reads the result dicts ``run_cell`` returns;
runs nothing itself.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from fastroute.sim.params import SimParams


def _f(x: Any, nd: int = 2) -> str:
    if x is None:
        return "-"
    try:
        if x != x:  # NaN
            return "-"
        return f"{x:.{nd}f}"
    except (TypeError, ValueError):
        return str(x)


def markdown_table(results: list[dict], time_scale: float) -> str:
    """One table per concurrency, columns as in seed 001's balance table plus latency/throughput."""
    lines = []
    for conc in sorted({r["concurrency"] for r in results}):
        lines.append(
            f"\n### concurrency {conc} (1P1D, decode 8 DP ranks, time scale {time_scale:g}; times in simulated ms)\n"
        )
        lines.append(
            "| policy | outstanding CV | running CV | busiest batch | KV busiest/mean | step ms "
            "| TPOT p50 / p90 | TTFT p50 / p90 | interactivity p50 / p90 | out tok/s (simulated) | done | err |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in results:
            if r["concurrency"] != conc:
                continue
            b, ld = r["balance"], r["load"]
            lines.append(
                f"| {r['label']} | {_f(b.get('outstanding_cv'))} | {_f(b.get('running_cv'))} | "
                f"{_f(b.get('busiest_batch'), 1)} | {_f(b.get('kv_busiest_over_mean'))} | {_f(b.get('step_ms'), 1)} | "
                f"{_f(ld['tpot_p50_ms'], 1)} / {_f(ld['tpot_p90_ms'], 1)} | "
                f"{_f(ld['ttft_p50_ms'], 0)} / {_f(ld['ttft_p90_ms'], 0)} | "
                f"{_f(ld['interactivity_p50'], 1)} / {_f(ld['interactivity_p90'], 1)} | "
                f"{_f(ld['output_tok_s'], 0)} | {ld['completed']} | {ld['errors']} |"
            )
        lines.append(
            f"\nThroughput per simulated second; the wall-clock throughput is that divided by the time "
            f"scale ({time_scale:g}), as the progress lines (`out_tok/s~ ... wall-clock`) show it."
        )
    return "\n".join(lines) + "\n"


def _median(xs: list) -> Any:
    xs = sorted(x for x in xs if x is not None and x == x)
    if not xs:
        return None
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def kv_markdown_table(results: list[dict], time_scale: float, params: SimParams) -> str:
    """The KV-tight scenario's table: per policy, the median over repeats (each run's value in brackets for
    the headline numbers), prealloc queue per rank and the kv-fit shadow agreement."""
    lines = []
    for conc in sorted({r["concurrency"] for r in results}):
        rows = [r for r in results if r["concurrency"] == conc]
        n_rep = len({r.get("repeat", 0) for r in rows})
        lines.append(
            f"\n### KV-tight, concurrency {conc}: 1P1D, decode {params.dp_size} DP ranks x "
            f"{params.max_total_num_tokens:,} KV tokens, time scale {time_scale:g}, "
            f"median of {n_rep} run(s); times in simulated ms\n"
        )
        lines.append(
            "| policy | TTFT p50 | TTFT p90 (runs) | TPOT p50 | TPOT p90 (runs) | out tok/s (runs) "
            "| prealloc waiting per rank (mean) | busiest batch | step ms | retractions "
            "| kv-fit shadow agree / disagree | done | err |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        labels = list(dict.fromkeys(r["label"] for r in rows))
        for label in labels:
            rr = [r for r in rows if r["label"] == label]
            ld = [r["load"] for r in rr]

            def med(key: str, src: list = ld) -> Any:
                return _median([x.get(key) for x in src])

            def runs(key: str, nd: int, src: list = ld) -> str:
                return " (" + ", ".join(_f(x[key], nd) for x in src) + ")" if len(src) > 1 else ""

            pre = [r["balance"].get("prealloc_per_rank") or [] for r in rr]
            pre_med = [_median([p[k] for p in pre if len(p) > k]) for k in range(max(map(len, pre), default=0))]
            kvs = [r.get("kv_fit") or {} for r in rr]
            agree = sum(k.get("agree", 0) for k in kvs)
            dis = sum(k.get("disagree", 0) for k in kvs)
            shadow = (
                f"{agree:.0f} / {dis:.0f} ({100 * agree / (agree + dis):.0f}% agree)"
                if "shadow" in rr[0].get("args", []) and agree + dis > 0
                else "-"
            )
            lines.append(
                f"| {label} | {_f(med('ttft_p50_ms'), 0)} | {_f(med('ttft_p90_ms'), 0)}{runs('ttft_p90_ms', 0)} | "
                f"{_f(med('tpot_p50_ms'), 1)} | {_f(med('tpot_p90_ms'), 1)}{runs('tpot_p90_ms', 1)} | "
                f"{_f(med('output_tok_s'), 0)}{runs('output_tok_s', 0)} | "
                f"{' '.join(_f(x, 1) for x in pre_med) or '-'} | "
                f"{_f(_median([r['balance'].get('busiest_batch') for r in rr]), 1)} | "
                f"{_f(_median([r['balance'].get('step_ms') for r in rr]), 1)} | "
                f"{sum(r.get('retractions', 0) for r in rr)} | {shadow} | "
                f"{sum(x['completed'] for x in ld)} | {sum(x['errors'] for x in ld)} |"
            )
    return "\n".join(lines) + "\n"


def write_plots(results: list[dict], out_dir: str) -> list[str]:
    """Per-rank outstanding requests over time, one panel per policy, one PNG per concurrency."""
    try:  # deferred: matplotlib is an optional, heavy dependency used only for the plots
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping plots (pip install matplotlib)", file=sys.stderr)
        return []
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for conc in sorted({r["concurrency"] for r in results}):
        fig = outstanding_figure(results, conc)
        if fig is None:
            continue
        path = os.path.join(out_dir, f"outstanding_c{conc}.png")
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def outstanding_figure(results: list[dict], conc: int) -> Any:
    """The figure of one concurrency (None: no samples): a panel per policy, every panel on one
    y scale (a balanced policy looks flat next to round robin) with whole-request ticks."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = [r for r in results if r["concurrency"] == conc and r["samples"]]
    if not rows:
        return None
    fig, axes = plt.subplots(len(rows), 1, figsize=(10, 2.2 * len(rows)), sharex=True, sharey=True, squeeze=False)
    for ax, r in zip(axes[:, 0], rows):
        t = [s[0] - r["t0"] for s in r["samples"]]
        n_ranks = len(r["samples"][0][3])
        for k in range(n_ranks):
            ax.plot(t, [s[3][k] for s in r["samples"]], lw=0.8, label=f"rank {k}")
        ax.set_title(f"{r['label']}: outstanding CV {_f(r['balance'].get('outstanding_cv'))}", fontsize=9)
        ax.set_ylabel("outstanding")
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1, 0].set_xlabel("seconds (wall) in the measured window")
    fig.legend(*axes[0, 0].get_legend_handles_labels(), ncol=8, fontsize=7, loc="lower center")
    fig.suptitle(f"Per-rank outstanding requests (running + waiting), concurrency {conc}")
    fig.tight_layout(rect=(0, 0.03, 1, 0.97))  # leave room for the suptitle
    return fig


def write_outputs(results: list[dict], out_dir: str, time_scale: float, kv_params: SimParams | None = None) -> str:
    os.makedirs(out_dir, exist_ok=True)
    table = (
        markdown_table(results, time_scale) if kv_params is None else kv_markdown_table(results, time_scale, kv_params)
    )
    with open(os.path.join(out_dir, "balance.md"), "w") as fh:
        fh.write(table)
    with open(os.path.join(out_dir, "balance.json"), "w") as fh:
        json.dump([{k: v for k, v in r.items() if k != "samples"} for r in results], fh, indent=1)
    write_plots(results, out_dir)
    return table


def failed_cells(results: list[dict]) -> list[str]:
    """Labels of points where no request completed (router broken, sim misconfigured...)."""
    return [f"{r['label']} @ C={r['concurrency']}" for r in results if not r["load"]["completed_total"]]
