"""The flags of the peers' command lines (sglang-router 0.3.2, smg 1.13) that fastroute implements,
in their --help groups, and the inventory groups: peer flags accepted as inert, accepted because
fastroute already does what they ask, or refused (:mod:`fastroute.config.flags` has the reasons).
Defaults come from :class:`fastroute.config.Config`; :func:`fastroute.config.cli.build_parser` calls
these on its parser.
"""

from __future__ import annotations

import fastroute.config.flags as flags
from fastroute.config.flagparse import BY_STATUS, LOG_LEVEL_CHOICES, Adder, IgnoredFlag, p2c_metric
from fastroute.config.settings import (
    ALL_POLICIES,
    ENV_CONTROL_PLANE_API_KEYS,
    ENV_P2C_LOAD_METRIC,
    PREFILL_ONLY_POLICIES,
    SUPPORTED_POLICIES,
    default,
)
from fastroute.names import ASSIGNMENT_MODES


def add_peer_groups(add: Adder) -> None:
    """Worker configuration through Logging: the groups of sglang-router's --help."""
    d = default

    add.section("Worker configuration", "Listener, worker list and worker start-up.")
    add("--host", default=d("host"), help="Bind address, IPv4 or IPv6 (default: %(default)s).")
    add("--port", type=int, default=d("port"), help="Bind port (default: %(default)s).")
    add(
        "--worker-urls",
        nargs="*",
        default=d("worker_urls"),
        metavar="URL",
        help="Regular-mode (non-PD) worker URLs, http:// or https:// (default: none; workers "
        "can also be added at run time through /workers).",
    )
    add(
        "--api-key",
        default=None,
        help="Require 'Authorization: Bearer KEY' on inference and worker-management "
        "endpoints and send it to workers (default: none, client header forwarded).",
    )
    add(
        "--dp-aware",
        action="store_true",
        help="Treat each DP rank of a worker as its own target and send the chosen rank in "
        "the request body (default: off).",
    )
    add(
        "--worker-startup-timeout-secs",
        type=int,
        default=d("worker_startup_timeout_secs"),
        help="How long to wait for a worker to become healthy at registration (default: %(default)s s).",
    )
    add(
        "--worker-startup-check-interval",
        type=int,
        default=d("worker_startup_check_interval"),
        help="Seconds between registration health probes (default: %(default)s s).",
    )
    add(
        "--request-timeout-secs",
        type=int,
        default=d("request_timeout_secs"),
        help="Upper bound for one whole upstream request (default: %(default)s s).",
    )
    add(
        "--max-payload-size",
        type=int,
        default=d("max_payload_size"),
        help="Largest accepted request body in bytes; larger bodies get 413 (default: %(default)s).",
    )
    add(
        "--cors-allowed-origins",
        nargs="*",
        default=d("cors_allowed_origins"),
        metavar="ORIGIN",
        help="Origins allowed by CORS: '*' or https://host[:port]. Their preflights are answered "
        "and their responses carry Access-Control-Allow-Origin; other origins get no CORS "
        "headers, so browsers block them (default: none).",
    )
    add(
        "--shutdown-grace-period-secs",
        type=int,
        default=d("shutdown_grace_period_secs"),
        help="Time to drain in-flight requests after SIGTERM (default: %(default)s s).",
    )
    add(
        "--header-read-timeout-secs",
        type=float,
        default=d("header_read_timeout_secs"),
        help="Close a client connection whose request head does not arrive within this time (default: %(default)s s).",
    )
    add(
        "--idle-connection-timeout-secs",
        type=float,
        default=d("idle_connection_timeout_secs"),
        help="Close an idle keep-alive client connection after this time (default: %(default)s s).",
    )
    add(
        "--upstream-pool-idle-timeout-secs",
        type=float,
        default=d("upstream_pool_idle_timeout_secs"),
        help="Drop pooled worker connections idle this long; keep below SGLang's 5 s "
        "keep-alive; 0 = keep no idle connection (a new one per request) "
        "(default: %(default)s s).",
    )
    add(
        "--sse-keepalive-secs",
        type=float,
        default=d("sse_keepalive_secs"),
        help="Interval of SSE keep-alive comments on quiet streams; not sent yet (see "
        "docs/flags.md) (default: %(default)s s).",
    )

    add.section("Security", "TLS on the listener, admin authentication, probe port.")
    add(
        "--tls-cert-path",
        default=None,
        metavar="PEM",
        help="Serve HTTPS on --port with this certificate chain (needs --tls-key-path; default: plain HTTP).",
    )
    add("--tls-key-path", default=None, metavar="PEM", help="Private key of --tls-cert-path (default: none).")
    add(
        "--tls-min-version",
        choices=("1.2", "1.3"),
        default=d("tls_min_version"),
        help="Oldest TLS version the HTTPS listener negotiates; TLS 1.0/1.1 are never offered (default: %(default)s).",
    )
    add(
        "--control-plane-api-keys",
        nargs="*",
        action="extend",
        default=None,
        metavar="ID:NAME:ROLE:KEY",
        help="Keys of the worker-management routes (role admin: every route; role user: "
        "GET only, 403 on changes); when given, --api-key no longer opens those routes. "
        "Also $" + ENV_CONTROL_PLANE_API_KEYS + " (comma or space separated) "
        "(default: none).",
    )
    add(
        "--control-plane-audit-enabled",
        action="store_true",
        help="Log one control_plane_audit line per worker-management change "
        "(key id, role, route, target, outcome; never the key) (default: off).",
    )
    add(
        "--allow-link-local-workers",
        action="store_true",
        help="Accept workers at link-local addresses (169.254.0.0/16, fe80::/10, where cloud "
        "metadata services answer); refused by default (fastroute only; default: off).",
    )
    add(
        "--allow-open-admin",
        action="store_true",
        help="Start with the worker admin API open (no --api-key or --control-plane-api-keys) "
        "on a --host other machines can reach, as sglang-router does; without it such a start "
        "is refused. fastroute sidecar keeps its admin routes closed unless this or a key is "
        "given (fastroute only; default: off).",
    )
    add(
        "--max-targets-per-worker",
        type=int,
        default=d("max_targets_per_worker"),
        metavar="N",
        help="Most DP-rank targets one worker may take (under --dp-aware, or its rank ports); "
        "a worker reporting more is refused with the reason, a restart that grows past it "
        "keeps its ranks (fastroute only; default: %(default)s).",
    )
    add(
        "--health-check-port",
        type=int,
        default=None,
        metavar="PORT",
        help="Also answer /health, /liveness and /readiness on this port, from a thread of "
        "their own that keeps answering while the proxy is busy (default: none).",
    )

    add.section(
        "Routing policy",
        f"Implemented policies: {', '.join(SUPPORTED_POLICIES)}. The peers' other "
        "names ("
        + ", ".join(p for p in ALL_POLICIES if p not in SUPPORTED_POLICIES)
        + "; bucket for prefill) parse but fail at start-up with an error.",
    )
    add(
        "--policy",
        choices=ALL_POLICIES,
        default=d("policy"),
        metavar="POLICY",
        help="Policy of regular mode and default of both PD roles (default: %(default)s).",
    )
    add(
        "--prefill-policy",
        choices=ALL_POLICIES + PREFILL_ONLY_POLICIES,
        default=None,
        metavar="POLICY",
        help="PD prefill policy (default: same as --policy).",
    )
    add(
        "--decode-policy",
        choices=ALL_POLICIES,
        default=None,
        metavar="POLICY",
        help="PD decode policy (default: same as --policy).",
    )
    add(
        "--power-of-two-load-metric",
        "--p2c-load-metric",
        dest="p2c_load_metric",
        type=p2c_metric,
        default=None,
        metavar="{tokens,requests,least_requests}",
        help="What power_of_two compares: polled tokens (tie: in-flight requests), "
        "in-flight requests (tie: polled tokens), or least_requests over all targets; "
        "smg's expected_wait is refused with its reason (default: $" + ENV_P2C_LOAD_METRIC + " if set, else tokens).",
    )
    add(
        "--load-monitor-interval",
        type=float,
        default=d("load_monitor_interval"),
        help="Seconds between /v1/loads polls of each worker, minimum 0.1 (default: %(default)s s).",
    )
    add(
        "--disable-load-monitoring",
        action="store_true",
        help="Poll worker loads only when a policy needs them (default: off).",
    )
    add(
        "--routing-key-headers",
        nargs="*",
        default=d("routing_key_headers"),
        metavar="HEADER",
        help="Extra headers used as consistent_hashing key after X-SMG-Routing-Key (default: none).",
    )
    add(
        "--enable-igw",
        action="store_true",
        help="Multi-model gateway: workers are grouped by the model they serve and a request's "
        '"model" picks the group its policy balances in (default: off).',
    )
    add(
        "--model-alias",
        nargs="*",
        default=d("model_alias"),
        metavar="ALIAS=MODEL",
        help="With --enable-igw: requests for ALIAS go to MODEL's workers (default: none).",
    )
    add(
        "--ca-cert-paths",
        nargs="*",
        default=d("ca_cert_paths"),
        metavar="PEM",
        help="CA certificates trusted for https:// workers, besides the system CAs (default: none).",
    )
    add(
        "--client-cert-path",
        default=None,
        metavar="PEM",
        help="Client certificate presented to https:// workers (mTLS; with --client-key-path).",
    )
    add("--client-key-path", default=None, metavar="PEM", help="Private key of --client-cert-path.")
    add(
        "--assignment-mode",
        choices=ASSIGNMENT_MODES,
        default=d("assignment_mode"),
        help="manual: how a new routing key is placed: random, min_load (fewest in-flight "
        "requests) or min_group (fewest keys) (default: %(default)s).",
    )
    add(
        "--max-idle-secs",
        "--sticky-key-idle-secs",
        type=int,
        default=d("max_idle_secs"),
        help="manual: forget a routing key idle this long (default: %(default)s s).",
    )
    add(
        "--max-manual-keys",
        type=int,
        default=d("max_manual_keys"),
        metavar="N",
        help="manual: keep at most N routing keys per group and process; a new key past it "
        "evicts the least recently used eighth, counted in "
        "fastroute_manual_keys_evicted_total (fastroute only; default: %(default)s).",
    )
    add(
        "--cache-threshold",
        "--cache-match-threshold",
        type=float,
        default=d("cache_threshold"),
        help="cache_aware: minimum prefix match ratio to follow the cache (default: %(default)s).",
    )
    add(
        "--balance-abs-threshold",
        "--spill-abs-threshold",
        type=int,
        default=d("balance_abs_threshold"),
        help="cache_aware: balance instead when max-min load > this AND max > min x "
        "--balance-rel-threshold (default: %(default)s).",
    )
    add(
        "--balance-rel-threshold",
        "--spill-rel-threshold",
        type=float,
        default=d("balance_rel_threshold"),
        help="cache_aware: relative part of the balance rule (default: %(default)s).",
    )
    add(
        "--eviction-interval-secs",
        type=int,
        default=d("eviction_interval_secs"),
        help="cache_aware: seconds between prefix tree evictions (default: %(default)s).",
    )
    add(
        "--max-tree-size",
        type=int,
        default=d("max_tree_size"),
        help="cache_aware: prefix tree size bound (default: %(default)s).",
    )

    add.section("PD disaggregation", "Prefill/decode disaggregated serving.")
    add(
        "--pd-disaggregation",
        action="store_true",
        help="Run in PD mode: each request goes to one prefill and one decode worker "
        "(default: off; cannot be combined with --worker-urls).",
    )
    add(
        "--prefill",
        nargs="+",
        action="append",
        metavar=("URL", "BOOTSTRAP_PORT"),
        help="A prefill worker and its KV bootstrap port; the port is an integer, 'none' or "
        "absent (= null). Repeat for several workers (default: none).",
    )
    add("--decode", action="append", metavar="URL", help="A decode worker; repeat for several (default: none).")

    add.section("Retries")
    add(
        "--retry-max-retries",
        type=int,
        default=d("retry_max_retries"),
        help="Total attempts per request on 408/429/500/502/503/504 (default: %(default)s).",
    )
    add(
        "--retry-initial-backoff-ms",
        type=int,
        default=d("retry_initial_backoff_ms"),
        help="Delay before the second attempt (default: %(default)s ms).",
    )
    add(
        "--retry-max-backoff-ms",
        type=int,
        default=d("retry_max_backoff_ms"),
        help="Cap of the retry delay (default: %(default)s ms).",
    )
    add(
        "--retry-backoff-multiplier",
        type=float,
        default=d("retry_backoff_multiplier"),
        help="Growth factor of the retry delay (default: %(default)s).",
    )
    add(
        "--retry-jitter-factor",
        type=float,
        default=d("retry_jitter_factor"),
        help="Random +/- fraction applied to each delay (default: %(default)s).",
    )
    add("--disable-retries", action="store_true", help="One attempt only (default: off).")

    add.section("Circuit breaker", "Per worker (per rank with --dp-aware).")
    add(
        "--cb-failure-threshold",
        type=int,
        default=d("cb_failure_threshold"),
        help="Consecutive failures that open the circuit (default: %(default)s).",
    )
    add(
        "--cb-success-threshold",
        type=int,
        default=d("cb_success_threshold"),
        help="Consecutive half-open successes that close it (default: %(default)s).",
    )
    add(
        "--cb-timeout-duration-secs",
        type=int,
        default=d("cb_timeout_duration_secs"),
        help="Time open before a half-open trial (default: %(default)s s).",
    )
    add(
        "--cb-window-duration-secs",
        type=int,
        default=d("cb_window_duration_secs"),
        help="Accepted with a warning: like smg's, the circuit breaker counts consecutive "
        "failures and never reads it; must be at least 1 (default: %(default)s s).",
    )
    add("--disable-circuit-breaker", action="store_true", help="Never open circuits (default: off).")

    add.section("Health checks")
    add(
        "--health-failure-threshold",
        type=int,
        default=d("health_failure_threshold"),
        help="Consecutive failed probes that mark a worker unhealthy (default: %(default)s).",
    )
    add(
        "--health-success-threshold",
        type=int,
        default=d("health_success_threshold"),
        help="Consecutive good probes that mark it healthy again (default: %(default)s).",
    )
    add(
        "--health-check-timeout-secs",
        type=int,
        default=d("health_check_timeout_secs"),
        help="Timeout of one probe (default: %(default)s s).",
    )
    add(
        "--health-check-interval-secs",
        type=int,
        default=d("health_check_interval_secs"),
        help="Seconds between probes of each worker (default: %(default)s s).",
    )
    add(
        "--health-check-endpoint",
        default=d("health_check_endpoint"),
        help="Path probed on each worker (default: %(default)s).",
    )
    add("--disable-health-check", action="store_true", help="Do not probe workers at run time (default: off).")

    add.section("Admission/Rate limiting")
    add(
        "--max-concurrent-requests",
        type=int,
        default=d("max_concurrent_requests"),
        help="Requests in flight before queueing; -1 = unlimited (default: %(default)s).",
    )
    add(
        "--queue-size",
        type=int,
        default=d("queue_size"),
        help="Requests that may wait for a slot; 0 = reject at once with 429 (default: %(default)s).",
    )
    add(
        "--queue-timeout-secs",
        type=int,
        default=d("queue_timeout_secs"),
        help="Longest wait in the queue before 408 (default: %(default)s s).",
    )
    add(
        "--rate-limit-tokens-per-second",
        type=int,
        default=None,
        help="Admitted requests per second: a token bucket (burst --max-concurrent-requests) "
        "in front of the admission queue (default: none, only the concurrency limit).",
    )

    add.section("Flow control (priority classes, tenants, overload shedding)")
    add(
        "--priority-scheduler-enabled",
        action="store_true",
        help="Admit by priority class (x-smg-priority: system, interactive, default, bulk; unknown "
        "= default), clamped to the tenant's max_class; strict priority between classes, round "
        "robin between tenants inside one; replaces the --queue-size FIFO (default: off).",
    )
    add(
        "--priority-scheduler-default-max-class",
        default=d("priority_scheduler_default_max_class"),
        help="Highest class of a tenant the scheduler YAML does not list (default: %(default)s).",
    )
    add(
        "--priority-scheduler-config",
        default=None,
        help="smg's priority-scheduler YAML (classes: queue_size, queue_timeout_secs, reserved, "
        "starvation_threshold_secs; tenant_policies: max_class); an invalid file stops start-up "
        "naming its line (default: the built-in classes).",
    )
    add(
        "--priority-scheduler-tenant-metric-top-n",
        type=int,
        default=d("priority_scheduler_tenant_metric_top_n"),
        help="Tenants named in the flow metrics' tenant label; the rest count as 'other' (default: %(default)s).",
    )
    add(
        "--tenant-rate-limit-enabled",
        action="store_true",
        help="Limit each tenant's prompt tokens and requests per minute (429 "
        "tenant_rate_limit_exceeded with Retry-After); needs --tenant-rate-limit-config (default: off).",
    )
    add(
        "--tenant-rate-limit-config",
        default=None,
        help="smg's tenant rate-limit YAML (default_policy, tenants[] with tenant_key, "
        "tokens_per_minute, requests_per_minute, model_rules).",
    )
    add(
        "--tenant-api-key",
        action="append",
        default=[],
        metavar="TENANT_ID:KEY",
        help="A data-plane key that names its tenant (auth:TENANT_ID), repeatable; accepted "
        "beside --api-key (default: none).",
    )
    add(
        "--trust-tenant-header",
        action="store_true",
        help="Take the tenant of a request without a tenant key from --tenant-header-name "
        "(header:<id>) (default: off: ip:<address>).",
    )
    add(
        "--tenant-header-name",
        default=d("tenant_header_name"),
        help="The tenant header trusted with --trust-tenant-header (default: %(default)s).",
    )
    add(
        "--worker-overload-waiting-requests",
        type=int,
        default=None,
        help="Waiting requests at or above which a rank is saturated: with "
        "--priority-scheduler-enabled or --worker-overload-shed a saturated rank is left out of "
        "routing while another is not, and a request is held (or shed) while every rank it could "
        "use is saturated (default: 8 there; 0 = not used; without those flags only 0 is "
        "accepted).",
    )
    add(
        "--worker-overload-token-usage",
        type=float,
        default=None,
        help="KV usage (used / max tokens) at or above which a rank is saturated, as "
        "--worker-overload-waiting-requests (default: 0.8 there; >= 1.0 = not used, the only "
        "values accepted without those flags).",
    )
    add(
        "--prefill-overload-uncached-tokens",
        type=int,
        default=d("prefill_overload_uncached_tokens"),
        help="Waiting uncached prompt tokens at or above which a PD prefill rank is saturated "
        "(fastroute's; default: 0 = not used).",
    )
    add(
        "--flow-max-queued",
        type=int,
        default=d("flow_max_queued"),
        help="With --priority-scheduler-enabled, the most requests waiting in all classes "
        "together: at the bound, a newcomer takes the place of the newest waiter of the lowest "
        "class below its own (that one is answered 503 scheduler_shed), else it is refused 429 "
        "scheduler_queue_full (fastroute's; default: 0 = only the per-class queue sizes).",
    )
    add(
        "--worker-overload-shed",
        action="store_true",
        help="Answer 503 worker_overload_protection_shed (Retry-After: the load poll interval) "
        "when every worker a request could use is saturated, instead of queueing it (default: off).",
    )

    add.section("Prometheus")
    add(
        "--prometheus-host",
        default=d("prometheus_host"),
        help="Bind address of the /metrics listener (default: %(default)s).",
    )
    add(
        "--prometheus-port",
        type=int,
        default=d("prometheus_port"),
        help="Port of the /metrics listener (default: %(default)s).",
    )
    add(
        "--prometheus-duration-buckets",
        nargs="+",
        type=float,
        default=d("prometheus_duration_buckets"),
        metavar="SECS",
        help="Request duration histogram buckets (default: the sglang-router legacy list, 0.001 ... 240 s).",
    )

    add.section("Tracing", "OpenTelemetry spans of each request, exported over OTLP/gRPC (the 'trace' extra).")
    add(
        "--enable-trace",
        action="store_true",
        help="Export a trace of each request (request, pick, each upstream leg, first token) and "
        "send each worker the W3C traceparent of its leg (default: off; the client's "
        "traceparent and tracestate are forwarded as they came).",
    )
    add(
        "--otlp-traces-endpoint",
        default=d("otlp_traces_endpoint"),
        metavar="HOST:PORT",
        help="OTLP/gRPC collector of --enable-trace: host:port or http(s)://host:port (default: %(default)s).",
    )

    add.section("Logging")
    add(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVEL_CHOICES,
        default=d("log_level"),
        help="Log verbosity (default: %(default)s).",
    )
    add(
        "--log-json",
        action="store_true",
        help="Write each log line as one JSON object (time, level, logger, message, pid and "
        "the line's fields) (default: off).",
    )
    add("--log-dir", default=None, help="Also write logs to DIR/fastroute.log (default: console only).")
    add(
        "--request-id-headers",
        nargs="*",
        default=d("request_id_headers"),
        metavar="HEADER",
        help="Request headers whose first present value becomes x-request-id "
        "(default: " + " ".join(d("request_id_headers")) + ").",
    )


def add_inventory_groups(add: Adder) -> None:
    """The peer flags fastroute accepts without a field of its own, by status."""
    families = [f.name + "*" for f in flags.FAMILIES]
    add.section(
        "Ignored for compatibility",
        "Peer flags that cannot change who gets in, where requests go or readiness: accepted "
        "(with any values) so existing launch scripts keep working, with one warning each "
        "saying why. The full inventory is docs/flags.md (python -m fastroute.config.flags).",
    )
    for flag in BY_STATUS[flags.INERT]:
        add(flag, action=IgnoredFlag, metavar="VALUE", help="inert: " + flags.row_of(flag).reason)
    add.section(
        "Accepted: fastroute already does this", "Peer flags asking for what fastroute does anyway; accepted silently."
    )
    for flag in BY_STATUS[flags.IMPLEMENTED]:
        add(flag, action=IgnoredFlag, metavar="VALUE", help=flags.row_of(flag).reason)
    add.section(
        "Refused (not implemented)",
        "Peer flags that would change who gets in, where requests go or readiness: start-up "
        "fails naming the flag, except for the values noted (which ask for what fastroute "
        "does). Families: " + ", ".join(families) + " (see docs/flags.md).",
    )
    for flag in BY_STATUS[flags.REFUSED]:
        add(flag, action=IgnoredFlag, metavar="VALUE", help="refused: " + flags.row_of(flag).reason)
