"""KV-event benchmark: the Mooncake conversation trace through the router with and without the
engine's KV events (``python bench/kv_events.py``).

The cluster is 1 prefill (DP 8, every rank with its own LRU prefix cache, sized to about a third
of the replayed window's working set) and 1 or 2 decode servers (DP 8). The prefills publish
their KV events and LoadStat per rank over ZMQ exactly as SGLang 0.5.23 does (``sim.kvevents``).
The trace is Mooncake's FAST'25 conversation trace (``bench/data/``): each request's
``hash_ids`` (512-token blocks, 36.6% of them reused) become ``input_ids``, every block id the
same 512 token ids wherever it appears, so requests share prefixes exactly as the trace's did.
Its timestamps are replayed open loop, compressed to the requested rate.

Rows (one fresh cluster per row, so every row starts with cold caches and warms up alike):
* ``least_requests``: both legs, no prefix affinity;
* ``cache_aware, approximate tree``: the default policy with ``--kv-events off`` (the tree
  keys on the ids the router sent);
* ``cache_aware, KV events``: the default policy and flags (the prefill publishes);
* ``SGLang total_tokens``: the router places no rank (no ``--dp-aware``); the engines' own
  DP controllers balance by ``--load-balance-method total_tokens``;
* ``oracle``: the prefill engine places each request itself, knowing every rank's cache and
  queue exactly (the rank of least queued + uncached tokens); the router balances decode.

Each row reports TTFT p50/p90/p99, the prefill's prefix hit rate (cached / input tokens of the
prefills started in the measured window), the busiest decode batch and TPOT p50/p90.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from dataclasses import replace

import uvloop

from fastroute.sim.balance import (
    Cell,
    RouterProcess,
    _drain,
    _f,
    _free_port,
    balance_stats,
    fetch,
    merge_samples,
    router_command,
)
from fastroute.sim.conversations import (
    BLOCK_BYTES,
    Arrival,
    conversation_trace,
    mooncake_arrivals,
    read_mooncake_trace,
    run_open_loop,
    working_set_tokens,
)
from fastroute.sim.engine import SimParams
from fastroute.sim.http import HttpError
from fastroute.sim.loadgen import _percentile, scale_summary
from fastroute.sim.tokenizer import train as train_tokenizer
from fastroute.sim.worker import start_cluster

TRACE = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "data", "mooncake_conversation_trace.jsonl.gz")
BLOCK = 512
LEAST = ["--policy", "power_of_two", "--p2c-load-metric", "least_requests"]


def cells() -> list[Cell]:
    return [
        Cell("least_requests", "fastroute", LEAST + ["--kv-events", "off"]),
        Cell("cache_aware, approximate tree", "fastroute", ["--kv-events", "off"]),
        Cell("cache_aware, KV events", "fastroute", []),
        Cell(
            "SGLang total_tokens",
            "fastroute",
            LEAST + ["--kv-events", "off"],
            dp_aware=False,
            sim={"load_balance_method": "total_tokens"},
        ),
        Cell(
            "oracle (engine knows every cache)",
            "fastroute",
            LEAST + ["--kv-events", "off"],
            sim={"load_balance_method": "cache_oracle"},
        ),
    ]


def chat_cells(tokenizer: str) -> list[Cell]:
    """Chat traffic: the router's token estimates against its tokenizer (--tokenizer-path)."""
    # The pool's bound raised: this 2-core machine runs the simulator and the load generator too.
    exact = ["--tokenizer-path", tokenizer, "--tokenizer-cache-enable-l1", "--tokenize-timeout-ms", "500"]
    fit = ["--decode-input-demand", "on", "--decode-kv-fit", "on"]
    return [
        Cell("KV events, estimated tokens", "fastroute", []),
        Cell("KV events, exact tokens", "fastroute", exact),
        Cell("demand + KV fit, estimated tokens", "fastroute", fit),
        Cell("demand + KV fit, exact tokens", "fastroute", fit + exact),
    ]


async def run_point(cell: Cell, ns: argparse.Namespace, arr: list[Arrival], cache_tokens: int, tag: str) -> dict:
    tok = ns.tokenizer if ns.chat else ""  # the engines tokenize chat as SGLang does
    decode_p = SimParams(
        dp_size=8, time_scale=ns.time_scale, max_total_num_tokens=ns.decode_kv_tokens, tokenizer_path=tok
    )
    prefill_p = SimParams(
        dp_size=8,
        time_scale=ns.time_scale,
        prefix_cache_tokens=cache_tokens,
        prefix_block_tokens=BLOCK,
        prefill_tokens_per_s=ns.prefill_tokens_per_s,
        kv_events_port_base=-1,
        tokenizer_path=tok,
    )
    sim = dict(cell.sim)
    if sim:
        # the engines' own balancing: the decode's controller too (the router names no rank)
        decode_p = replace(
            decode_p, **{k: v for k, v in sim.items() if k != "load_balance_method" or v != "cache_oracle"}
        )
        prefill_p = replace(prefill_p, **sim)
    cluster = await start_cluster(1, ns.decodes, decode_p, prefill_p)
    prefill = cluster.prefills[0]
    pe = prefill.prefill
    assert pe is not None and prefill.bootstrap_port is not None  # a started prefill has both
    port, prom = _free_port(), _free_port()
    cmd = router_command(cell, prefill.url, prefill.bootstrap_port, [d.url for d in cluster.decodes], port, prom)
    safe = "".join(ch if ch.isalnum() else "_" for ch in cell.label + "_" + tag)
    rp = RouterProcess(cmd, port, os.path.join(ns.out, f"kv_{safe}.log"))
    try:
        await rp.start()
        loop = asyncio.get_running_loop()
        wall_offset = time.time() - loop.time()
        mark: list[tuple[int, int]] = []

        async def marker() -> None:
            await asyncio.sleep(ns.warmup)
            mark.append((pe.hit_tokens, pe.input_tokens))

        task = loop.create_task(marker())
        assert rp.proc is not None
        cpu0 = _cpu_seconds(rp.proc.pid)
        res = await run_open_loop("127.0.0.1", (port,), arr, ns.time_scale, ns.warmup, ns.duration, chat=bool(ns.chat))
        cpu = _cpu_seconds(rp.proc.pid) - cpu0
        task.cancel()
        picks = await _precise_picks(prom)
        h0, i0 = mark[0] if mark else (0, 0)
        hit_rate = (pe.hit_tokens - h0) / max(1, pe.input_tokens - i0)
    finally:
        await rp.stop()
        await _drain(cluster)
        await cluster.stop()
    t0, t1 = res.window[0] + wall_offset, res.window[1] + wall_offset
    samples = merge_samples(
        [[s for s in d.decode.samples if t0 <= s[0] <= t1] for d in cluster.decodes if d.decode is not None]
    )
    load = scale_summary(res.summary(), ns.time_scale)
    done = [r for r in res.records if r.ok and r.t_start >= res.window[0] and r.t_last <= res.window[1]]
    ttft = [(r.t_first - r.t_start) * 1000 / ns.time_scale for r in done if r.n_tokens]
    load["ttft_p99_ms"] = _percentile(ttft, 99)
    return {
        "label": cell.label,
        "tag": tag,
        "load": load,
        "balance": balance_stats(samples),
        "hit_rate": hit_rate,
        "picks": picks,
        # the router process's CPU over the whole replay (warm-up included), per request sent
        "cpu_ms_per_request": 1000.0 * cpu / max(1, len(res.records)),
    }


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _precise_picks(prom_port: int) -> str:
    """The router's precise picks and fallbacks from its /metrics ("-" where it has none)."""
    try:
        status, body = await fetch("127.0.0.1", prom_port, "GET", "/metrics", timeout=5.0)
    except (OSError, asyncio.TimeoutError, HttpError):
        return "-"
    if status != 200:
        return "-"
    got: dict[str, float] = {}
    for line in body.decode().splitlines():
        if line.startswith("fastroute_kv_pick_hit_blocks_count "):
            got["precise"] = float(line.split()[-1])
        elif line.startswith("fastroute_kv_pick_fallbacks_total{"):
            got[line.split('"')[1]] = float(line.split()[-1])
        elif line.startswith("fastroute_kv_events_total{"):
            got["events applied"] = got.get("events applied", 0.0) + float(line.split()[-1])
    return ", ".join(f"{k} {v:.0f}" for k, v in got.items() if v) or "-"


def table(results: list[dict]) -> str:
    head = (
        "| point | router | TTFT p50 / p90 / p99 ms | prefill prefix hits | busiest batch | "
        "TPOT p50 / p90 ms | completed | errors | router CPU ms / request | picks by the index |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for r in results:
        ld, b = r["load"], r["balance"]
        rows.append(
            f"| {r['tag']} | {r['label']} | {_f(ld['ttft_p50_ms'], 0)} / {_f(ld['ttft_p90_ms'], 0)} / "
            f"{_f(ld['ttft_p99_ms'], 0)} | {100 * r['hit_rate']:.1f}% | {_f(b.get('busiest_batch'), 1)} | "
            f"{_f(ld['tpot_p50_ms'], 1)} / {_f(ld['tpot_p90_ms'], 1)} | {ld['completed']} | {ld['errors']} | "
            f"{_f(r.get('cpu_ms_per_request'), 2)} | {r.get('picks', '-')} |"
        )
    return head + "\n".join(rows) + "\n"


def chat_working_set(arr: list[Arrival], tokenizer: str) -> int:
    """Tokens of the distinct 2 KB blocks of the conversations' prompts, as the tokenizer counts."""
    from fastroute.dataplane.tokenize import ModelTokenizer

    tok = ModelTokenizer(tokenizer)
    blocks = {
        a.item.text[i : i + BLOCK_BYTES] for a in arr if a.item.text for i in range(0, len(a.item.text), BLOCK_BYTES)
    }
    sample = sorted(blocks)[:50]
    per_block = sum(len(tok.encode(b, False)) for b in sample) / max(1, len(sample))
    return int(len(blocks) * per_block)


async def run_all(ns: argparse.Namespace) -> list[dict]:
    rows = [] if ns.chat else read_mooncake_trace(ns.trace)
    results = []
    span = (ns.warmup + ns.duration) / ns.time_scale + 5
    for rep in range(ns.repeat):
        for rate in ns.rates:
            if ns.chat:
                arr = conversation_trace(span, rate, seed=ns.seed + rep)
                cache = int(chat_working_set(arr, ns.tokenizer) * ns.cache_fraction / 8)
            else:
                window = rows[ns.start + rep * ns.stride :]
                arr = mooncake_arrivals(window, rate, span)
                cache = int(working_set_tokens(window[: len(arr)]) * ns.cache_fraction / 8)
            tag = ("chat, " if ns.chat else f"{ns.decodes}D, ") + f"{rate:g} req/s"
            tag += f" #{rep + 1}" if ns.repeat > 1 else ""
            if not ns.quiet:
                print(f"== {tag}: {len(arr)} arrivals, prefix cache {cache} tokens per rank", file=sys.stderr)
            for cell in chat_cells(ns.tokenizer) if ns.chat else cells():
                if ns.only and not any(o in cell.label for o in ns.only):
                    continue
                if not ns.quiet:
                    print(f"   {cell.label}", file=sys.stderr, flush=True)
                r = await run_point(cell, ns, arr, cache, tag)
                if not ns.quiet:
                    print("   " + table([r]).splitlines()[-1], file=sys.stderr, flush=True)
                results.append(r)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python bench/kv_events.py", description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=TRACE, help="the Mooncake conversation trace (JSONL, .gz allowed)")
    ap.add_argument("--rates", type=float, nargs="+", default=[4.0, 6.0], help="arrivals per simulated second")
    ap.add_argument("--decodes", type=int, default=1, help="decode servers (DP 8 each)")
    ap.add_argument("--duration", type=float, default=40.0, help="measured wall seconds per row")
    ap.add_argument("--warmup", type=float, default=20.0, help="unmeasured wall seconds per row")
    ap.add_argument("--time-scale", type=float, default=0.25, help="wall seconds per simulated second")
    ap.add_argument("--prefill-tokens-per-s", type=float, default=12_000.0, help="per prefill rank")
    ap.add_argument("--cache-fraction", type=float, default=1 / 3, help="all ranks' caches / the working set")
    ap.add_argument("--start", type=int, default=0, help="first trace row")
    ap.add_argument("--stride", type=int, default=3000, help="rows between repeats' starts")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--only", nargs="*", help="rows whose label contains one of these")
    ap.add_argument("--out", default="bench/out/kv_events")
    ap.add_argument("--seed", type=int, default=0, help="the chat conversations' seed")
    ap.add_argument(
        "--chat",
        action="store_true",
        help="chat traffic instead of the trace: the conversation workload's prompts as chat messages, "
        "the engines tokenizing them with a BPE trained here; rows with and without the router's tokenizer",
    )
    ap.add_argument("--tokenizer", default=os.path.join(tempfile.gettempdir(), "fastroute-bench-tokenizer"))
    ap.add_argument("--decode-kv-tokens", type=int, default=1_500_000, help="KV tokens per decode rank")
    ap.add_argument("--quiet", action="store_true")
    ns = ap.parse_args(argv)
    if ns.chat:
        ns.tokenizer = train_tokenizer(ns.tokenizer)
    os.makedirs(ns.out, exist_ok=True)
    results = uvloop.run(run_all(ns))
    out = table(results)
    with open(os.path.join(ns.out, "kv_events_chat.md" if ns.chat else f"kv_events_{ns.decodes}d.md"), "w") as fh:
        fh.write(out)
    print(out)
    return 0 if results and all(r["load"]["completed"] for r in results) else 1
