"""Metrics parity with smg: every metric family smg describes, and what fastroute does with it.

``FAMILIES`` lists smg's families (the ``describe_*!`` calls of its
``observability/metrics.rs``, its policy-branch counters and the series observed on smg 1.13 in
protocol.md 8.1) with smg's type and label names. Each row is ``exported`` (fastroute emits the
same name, type and label names, checked against a scrape by
``tests/integration/test_metrics_parity.py``) or ``not exported`` with the reason: fastroute has
no such data, or no such feature.

docs/metrics.md's table is generated from here (``python -m fastroute.control.parity``; a test
checks the page against it). Pure Python with no imports from the rest of fastroute.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

EXPORTED, NOT_EXPORTED = "exported", "not exported"


@dataclass(frozen=True)
class Family:
    name: str
    kind: str  # counter | gauge | histogram
    labels: tuple[str, ...]
    status: str
    why: str = ""  # for a family not exported: why; else a note (or "")


_R = ("router_type", "backend_type", "connection_mode", "model", "endpoint")
_E = ("worker", "model", "dp_rank")
_PDG = ("worker", "role", "dp_rank")
_NO_TOKENS = "fastroute relays bytes and never tokenizes or parses the generated output"
_NO_GRPC = "only smg's gRPC path measures it; fastroute speaks HTTP to workers"
_NO_PD_PHASES = (
    "fastroute does not time the PD phases apart; smg_pd_ttft_seconds covers the request to the decode's first byte"
)
_NO_MCP = "fastroute serves no MCP tools"
_NO_DB = "fastroute stores no conversations or responses"
_NO_MM = "fastroute forwards multimodal requests as they are and never processes media"
_PD_NOTE = "from /v1/loads?include=disagg (control/engine.py sums the queue fields)"

FAMILIES: tuple[Family, ...] = (
    # ---- HTTP layer -------------------------------------------------------------------------
    Family("smg_http_requests_total", "counter", ("method", "path"), EXPORTED),
    Family("smg_http_request_duration_seconds", "histogram", ("method", "path"), EXPORTED),
    Family("smg_http_responses_total", "counter", ("path", "status_code", "error_code"), EXPORTED),
    Family("smg_http_connections_active", "gauge", (), EXPORTED),
    Family(
        "smg_http_inflight_request_age_count",
        "gauge",
        ("gt", "le"),
        NOT_EXPORTED,
        "fastroute counts in-flight requests per target, not by age",
    ),
    Family("smg_http_rate_limit_total", "counter", ("result",), EXPORTED),
    # ---- router layer -----------------------------------------------------------------------
    Family("smg_router_requests_total", "counter", _R + ("streaming",), EXPORTED),
    Family("smg_router_request_duration_seconds", "histogram", _R, EXPORTED),
    Family("smg_router_request_errors_total", "counter", _R + ("error_type",), EXPORTED),
    Family(
        "smg_router_stage_duration_seconds",
        "histogram",
        ("router_type", "stage"),
        NOT_EXPORTED,
        "names smg's pipeline stages; fastroute_pick_seconds and "
        "fastroute_router_overhead_seconds time the router's own work",
    ),
    Family(
        "smg_router_upstream_responses_total",
        "counter",
        ("router_type", "status_code", "error_code"),
        NOT_EXPORTED,
        "worker answers are counted by smg_worker_errors_total and the circuit outcomes",
    ),
    Family(
        "smg_router_ttft_seconds",
        "histogram",
        ("router_type", "backend_type", "model", "endpoint"),
        NOT_EXPORTED,
        _NO_TOKENS + " (smg_pd_ttft_seconds is exported)",
    ),
    Family(
        "smg_router_tpot_seconds",
        "histogram",
        ("router_type", "backend_type", "model", "endpoint"),
        NOT_EXPORTED,
        _NO_TOKENS,
    ),
    Family(
        "smg_router_tokens_total",
        "counter",
        ("router_type", "backend_type", "model", "endpoint", "token_type"),
        NOT_EXPORTED,
        _NO_TOKENS,
    ),
    Family(
        "smg_router_generation_duration_seconds",
        "histogram",
        ("router_type", "backend_type", "model", "endpoint"),
        NOT_EXPORTED,
        _NO_TOKENS,
    ),
    # ---- PD ---------------------------------------------------------------------------------
    Family("smg_pd_ttft_seconds", "histogram", ("backend_type", "model", "runtime"), EXPORTED),
    Family(
        "smg_pd_prefill_duration_seconds",
        "histogram",
        ("backend_type", "model", "runtime"),
        NOT_EXPORTED,
        _NO_PD_PHASES,
    ),
    Family(
        "smg_pd_kv_transfer_duration_seconds",
        "histogram",
        ("backend_type", "model", "runtime"),
        NOT_EXPORTED,
        _NO_PD_PHASES,
    ),
    Family(
        "smg_pd_kv_connector_mode_total",
        "counter",
        ("mode",),
        NOT_EXPORTED,
        "fastroute does not look at the KV connector; SGLang's bootstrap fields are injected as is",
    ),
    Family(
        "smg_pd_bootstrap_failures_total",
        "counter",
        (),
        NOT_EXPORTED,
        "fastroute's injection of the bootstrap fields cannot fail on a parsed body (a malformed one is a 400)",
    ),
    Family(
        "smg_pd_kv_transfer_failures_total",
        "counter",
        (),
        NOT_EXPORTED,
        "a failed KV transfer reaches fastroute as a worker error (smg_worker_errors_total)",
    ),
    Family(
        "smg_pd_rendezvous_failures_total",
        "counter",
        ("leg", "phase"),
        NOT_EXPORTED,
        "fastroute does not probe the prefill bootstrap port",
    ),
    # ---- worker layer -----------------------------------------------------------------------
    Family("smg_worker_pool_size", "gauge", ("worker_type", "connection_mode", "model"), EXPORTED),
    Family(
        "smg_worker_connections_active",
        "gauge",
        ("worker_type", "connection_mode"),
        NOT_EXPORTED,
        "fastroute's upstream pools do not count their sockets by worker role",
    ),
    Family("smg_worker_requests_active", "gauge", ("worker",), EXPORTED),
    Family(
        "smg_worker_requests_total",
        "counter",
        ("worker", "model"),
        EXPORTED,
        "every attempt sent to the worker (url@rank under --dp-aware)",
    ),
    Family("smg_worker_health", "gauge", ("worker",), EXPORTED),
    Family("smg_worker_health_checks_total", "counter", ("worker_type", "result"), EXPORTED),
    Family("smg_worker_selection_total", "counter", ("worker_type", "connection_mode", "model", "policy"), EXPORTED),
    Family("smg_worker_errors_total", "counter", ("worker_type", "connection_mode", "error_type"), EXPORTED),
    Family("smg_worker_cb_state", "gauge", ("worker",), EXPORTED),
    Family("smg_worker_cb_transitions_total", "counter", ("worker", "from", "to"), EXPORTED),
    Family("smg_worker_cb_outcomes_total", "counter", ("worker", "outcome"), EXPORTED),
    Family("smg_worker_cb_consecutive_failures", "gauge", ("worker",), EXPORTED),
    Family(
        "smg_worker_cb_consecutive_successes",
        "gauge",
        ("worker",),
        NOT_EXPORTED,
        "fastroute's breaker counts successes only while half-open, not smg's running streak",
    ),
    Family("smg_worker_retries_total", "counter", ("worker_type", "endpoint"), EXPORTED),
    Family("smg_worker_retries_exhausted_total", "counter", ("worker_type", "endpoint"), EXPORTED),
    Family(
        "smg_worker_retry_backoff_seconds",
        "histogram",
        ("attempt",),
        NOT_EXPORTED,
        "the backoff is drawn inside the compiled exchange and not recorded",
    ),
    Family(
        "smg_kv_event_subscription_failures_total",
        "counter",
        ("worker", "reason"),
        EXPORTED,
        "reason: replay_timeout or socket_error (--kv-events; fastroute_kv_* have the rest)",
    ),
    # ---- engine re-export from the load polls -----------------------------------------------
    Family("smg_engine_running_requests", "gauge", _E, EXPORTED),
    Family("smg_engine_waiting_requests", "gauge", _E, EXPORTED),
    Family("smg_engine_token_usage", "gauge", _E, EXPORTED, "from /v1/loads only"),
    Family("smg_engine_gen_throughput", "gauge", _E, EXPORTED, "from /v1/loads only"),
    Family("smg_engine_cache_hit_rate", "gauge", _E, EXPORTED, "from /v1/loads only"),
    Family(
        "smg_engine_load_polls_total", "counter", ("worker", "mode"), EXPORTED, "mode: v1_loads, get_load or failed"
    ),
    Family("smg_engine_pd_kv_transfer_latency_ms", "gauge", _PDG, EXPORTED, _PD_NOTE),
    Family("smg_engine_pd_kv_transfer_speed_gb_s", "gauge", _PDG, EXPORTED, _PD_NOTE),
    Family("smg_engine_pd_prefill_queue_reqs", "gauge", _PDG, EXPORTED, _PD_NOTE),
    Family("smg_engine_pd_decode_queue_reqs", "gauge", _PDG, EXPORTED, _PD_NOTE),
    # ---- policies ---------------------------------------------------------------------------
    Family("smg_manual_policy_cache_entries", "gauge", (), EXPORTED),
    Family(
        "smg_manual_policy_branch_total",
        "counter",
        ("branch",),
        NOT_EXPORTED,
        "the compiled key table counts keys and evictions, not smg's branch names",
    ),
    Family(
        "smg_consistent_hashing_policy_branch_total",
        "counter",
        ("branch",),
        NOT_EXPORTED,
        "the compiled ring lookup does not count its branches",
    ),
    Family(
        "smg_prefix_hash_policy_branch_total",
        "counter",
        ("branch",),
        NOT_EXPORTED,
        "the prefix_hash policy is refused at start-up",
    ),
    Family(
        "smg_worker_routing_keys_active",
        "gauge",
        ("worker",),
        NOT_EXPORTED,
        "the compiled key table does not count keys per worker",
    ),
    # ---- discovery --------------------------------------------------------------------------
    Family(
        "smg_discovery_registrations_total",
        "counter",
        ("source", "result"),
        NOT_EXPORTED,
        "discovery counts its failures (fastroute_discovery_errors_total), not each registration",
    ),
    Family(
        "smg_discovery_deregistrations_total",
        "counter",
        ("source", "reason"),
        NOT_EXPORTED,
        "discovery counts its failures (fastroute_discovery_errors_total), not each removal",
    ),
    Family(
        "smg_discovery_sync_duration_seconds",
        "histogram",
        ("source",),
        NOT_EXPORTED,
        "discovery does not time its syncs",
    ),
    Family(
        "smg_discovery_workers_discovered",
        "gauge",
        ("source",),
        EXPORTED,
        "source: kubernetes or file; only while discovery is on",
    ),
    # ---- features fastroute does not have ---------------------------------------------------
    Family("smg_mcp_tool_calls_total", "counter", ("model", "tool_name", "result"), NOT_EXPORTED, _NO_MCP),
    Family("smg_mcp_tool_duration_seconds", "histogram", ("model", "tool_name"), NOT_EXPORTED, _NO_MCP),
    Family("smg_mcp_servers_active", "gauge", (), NOT_EXPORTED, _NO_MCP),
    Family("smg_mcp_tool_iterations_total", "counter", ("model",), NOT_EXPORTED, _NO_MCP),
    Family("smg_db_operations_total", "counter", ("storage_type", "operation", "result"), NOT_EXPORTED, _NO_DB),
    Family("smg_db_operation_duration_seconds", "histogram", ("storage_type", "operation"), NOT_EXPORTED, _NO_DB),
    Family("smg_db_connections_active", "gauge", ("storage_type",), NOT_EXPORTED, _NO_DB),
    Family("smg_db_items_stored", "counter", ("storage_type",), NOT_EXPORTED, _NO_DB),
    Family("smg_mm_tensors_total", "counter", ("runtime", "path"), NOT_EXPORTED, _NO_MM),
    Family("smg_mm_tensor_bytes_total", "counter", ("runtime", "path"), NOT_EXPORTED, _NO_MM),
    Family("smg_mm_shm_write_failures_total", "counter", ("runtime",), NOT_EXPORTED, _NO_MM),
)

# (peer series, type, label names, fastroute series: the same name when exported, else "").
PEER_SERIES: tuple[tuple[str, str, tuple[str, ...], str], ...] = tuple(
    (f.name, f.kind, f.labels, f.name if f.status == EXPORTED else "") for f in FAMILIES
)


def markdown() -> str:
    """The metrics parity table of docs/metrics.md, generated from ``FAMILIES``."""
    n = sum(f.status == EXPORTED for f in FAMILIES)
    rows = [
        f"{n} of {len(FAMILIES)} smg families exported.",
        "",
        "| smg family | type | labels | fastroute | note / why not |",
        "|---|---|---|---|---|",
    ]
    for f in FAMILIES:
        rows.append(f"| `{f.name}` | {f.kind} | {', '.join(f.labels) or '-'} | {f.status} | {f.why or '-'} |")
    return "\n".join(rows) + "\n"


peer_table_markdown = markdown


if __name__ == "__main__":
    sys.stdout.write(markdown())
