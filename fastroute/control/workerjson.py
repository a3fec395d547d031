"""The JSON shapes of a worker and of its ranks' polled load, as the admin API answers them
(GET /workers, /workers/<id>, /get_loads): smg's field names, plus per-rank detail when a worker
is split per DP rank."""

from __future__ import annotations

from typing import Any

from fastroute.control.worker import Worker
from fastroute.core.table import (
    COL_POLLED_AT,
    COL_POLLED_MAX_TOKENS,
    COL_POLLED_RUNNING,
    COL_POLLED_TOKENS,
    COL_POLLED_WAITING,
    TargetTable,
)

# server_info keys copied (as strings) into the /workers "metadata" object.
_META_KEYS = (
    "model_path",
    "served_model_name",
    "tokenizer_path",
    "tp_size",
    "dp_size",
    "load_balance_method",
    "disaggregation_mode",
    "disaggregation_bootstrap_port",
    "enable_dp_attention",
    "max_running_requests",
    "max_total_num_tokens",
    "version",
)


def polled(tab: TargetTable, t: int) -> dict[str, Any]:
    """Polled engine values of a target; all None when never polled / unknown."""
    if tab.get(t, COL_POLLED_AT) < 0:
        return {
            "num_running_reqs": None,
            "num_waiting_reqs": None,
            "num_total_reqs": None,
            "num_used_tokens": None,
            "max_total_num_tokens": None,
            "polled_at_ms": None,
        }
    running = tab.get(t, COL_POLLED_RUNNING)
    waiting = tab.get(t, COL_POLLED_WAITING)
    mx = tab.get(t, COL_POLLED_MAX_TOKENS)
    return {
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_total_reqs": running + waiting,
        "num_used_tokens": tab.get(t, COL_POLLED_TOKENS),
        "max_total_num_tokens": mx if mx >= 0 else None,
        "polled_at_ms": tab.get(t, COL_POLLED_AT),
    }


def worker_json(w: Worker, tab: TargetTable) -> dict[str, Any]:
    """One entry of GET /workers (smg field names, plus per-rank detail when split)."""
    live = w.status == "ready"
    d: dict[str, Any] = {
        "id": w.id,
        "url": w.url,
        "model_id": w.model_id,
        "worker_type": w.role,
        "is_healthy": w.healthy and live,
        "status": w.status,
        "load": sum(tab.in_flight(t) for t in w.targets) if live else 0,
        "connection_mode": "http",
        "priority": w.priority,
        "cost": w.cost,
        "labels": dict(w.labels),
        "metadata": {k: str(w.server_info[k]) for k in _META_KEYS if k in w.server_info},
        "dp_size": w.dp_size,
    }
    if w.role == "prefill":
        d["bootstrap_port"] = w.bootstrap_port
    if w.error and not live:
        d["error"] = w.error
    if live:
        if w.split:
            ids = w.rank_ids or range(len(w.targets))
            d["dp_ranks"] = [
                {
                    "url": name,
                    "dp_rank": ids[r],
                    "load": tab.in_flight(t),
                    "is_healthy": w.target_healthy(r),
                    **polled(tab, t),
                }
                for r, (t, name) in enumerate(zip(w.targets, w.names))
            ]
            if w.rank_ports:  # each rank listens on a port of its own
                d["rank_ports"] = True
        else:
            d["engine_load"] = polled(tab, w.targets[0])
    return d
