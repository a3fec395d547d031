"""The ``/v1/loads`` document of a simulated server (SGLang's per-rank load report)."""

from __future__ import annotations

import time
from typing import Any

SIM_VERSION = "0.5.0-sim"


def _now_ts() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + "+00:00"


def _hit_rate(w: Any, i: int) -> float:
    """Rank ``i``'s prefix-cache hit rate: cached over computed prompt tokens (a prefill's ranks;
    0.0 elsewhere, as an engine without a cache reports)."""
    ranks = w.prefill.ranks if w.prefill is not None else None
    if not ranks or i >= len(ranks) or not ranks[i].input_tokens:
        return 0.0
    return round(ranks[i].hit_tokens / ranks[i].input_tokens, 6)


def loads_doc(w: Any, sections: set[str], dp_rank: int | None) -> dict:
    """The ``/v1/loads`` document of ``w``, a ``server.SimWorker`` (its ``loads_json``)."""
    p = w.p
    cap = p.max_total_num_tokens
    ts = time.time()
    out = []
    tot_run = tot_wait = tot_used = 0
    for i, (run, wait, used) in enumerate(w.rank_loads()):
        if dp_rank is not None and i != dp_rank:
            continue
        tot_run += run
        tot_wait += wait
        tot_used += used
        e: dict[str, Any] = {
            "dp_rank": i,
            "timestamp": ts,
            "num_running_reqs": run,
            "num_waiting_reqs": wait,
            "num_total_reqs": run + wait,
            "num_used_tokens": used,
            "max_total_num_tokens": cap,
            "token_usage": round(used / cap, 6) if cap else 0.0,
            "gen_throughput": 0.0,
            "cache_hit_rate": _hit_rate(w, i),
            "utilization": round(min(1.0, run / max(1, p.max_running_requests)), 6),
            "max_running_requests": p.max_running_requests,
            "num_waiting_uncached_tokens": w.prefill.waiting_uncached(i) if w.prefill is not None else 0,
        }
        if "memory" in sections:
            e["memory"] = {"weight_gb": 0.0, "kv_cache_gb": 0.0, "graph_gb": 0.0, "token_capacity": cap}
        if "spec" in sections:
            e["speculative"] = {"accept_length": 0.0, "accept_rate": 0.0}
        if "lora" in sections:
            e["lora"] = {"slots_used": 0, "slots_total": 0, "utilization": 0.0}
        if "disagg" in sections:
            d = {
                "mode": {"prefill": "prefill", "decode": "decode", "regular": "null"}[w.role],
                "prefill_prealloc_queue_reqs": 0,
                "prefill_inflight_queue_reqs": 0,
                "decode_prealloc_queue_reqs": 0,
                "decode_transfer_queue_reqs": 0,
                "decode_retracted_queue_reqs": 0,
                "kv_transfer_speed_gb_s": 0.0,
                "kv_transfer_latency_ms": 0.0,
            }
            if w.role == "prefill":
                d["prefill_prealloc_queue_reqs"] = wait
            elif w.decode is not None:
                pre, trans, _, ret = w.decode.rank_queues(i)
                d["decode_prealloc_queue_reqs"] = pre
                d["decode_transfer_queue_reqs"] = trans
                d["decode_retracted_queue_reqs"] = ret
            e["disaggregation"] = d
        if "queues" in sections:
            ret = w.decode.rank_queues(i)[3] if w.decode is not None else 0
            e["queues"] = {"waiting": wait - ret, "grammar": 0, "paused": 0, "retracted": ret}
        out.append(e)
    n = max(1, len(out))
    return {
        "timestamp": _now_ts(),
        "version": SIM_VERSION,
        "dp_rank_count": len(out),
        "loads": out,
        "aggregate": {
            "total_running_reqs": tot_run,
            "total_waiting_reqs": tot_wait,
            "total_reqs": tot_run + tot_wait,
            "total_used_tokens": tot_used,
            "avg_token_usage": round(tot_used / (cap * n), 6) if cap else 0.0,
            "avg_throughput": 0.0,
            "avg_utilization": 0.0,
        },
    }
