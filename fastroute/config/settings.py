"""Validated router configuration: the `Config` dataclass and its construction from parsed flags.

This module owns the data (field names are the argparse dest names of the sglang-router flags,
dashes turned into underscores), the defaults (the single source of truth: the CLI reads its
defaults from the dataclass) and the environment fallbacks; the start-up rules a `Config` is held to
are `fastroute.config.checks.validate`'s, and the names the flags accept (policies, modes, environment
variables) are `fastroute.names`', re-exported here. It does no I/O beyond reading the environment
(and, for `--service-discovery`, looking for a Kubernetes credential file, so a router that could
never find a worker refuses to start) and logs nothing except the one-line "ignored by fastroute"
warnings for compatibility flags.

A `Config` is validated on construction (`__post_init__` runs the rules), so a hand-built
`Config(...)` in a test is held to the same rules as one built from a command line. Errors raise
`ConfigError`, which names the offending flag; the CLI turns it into an argparse-style
exit (status 2).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

import fastroute.config.flags as flags
from fastroute.auth import split_env_keys
from fastroute.config.checks import ConfigError, _strip_url, metric_in_use
from fastroute.config.checks import validate as _validate
from fastroute.flowpolicy import flow_enabled
from fastroute.kube import NO_KUBE_CONFIG, kube_config_source
from fastroute.names import (
    ALL_POLICIES,
    DISCOVERY_PROVIDERS,
    DP_RANK_FIELDS,
    ENV_CONTROL_PLANE_API_KEYS,
    ENV_DECODE_REQUEST_WEIGHT,
    ENV_P2C_LOAD_METRIC,
    KV_EVENTS_MODES,
    LOAD_METRIC_ALIASES,
    LOAD_METRICS,
    LOG_LEVELS,
    MODES,
    POLICIES,
    PREFILL_ONLY_POLICIES,
    REFUSED_LOAD_METRICS,
    SPEED_POLICIES,
)

__all__ = [
    "Config",
    "ConfigError",
    "config_from_args",
    "default",
    "ALL_POLICIES",
    "PREFILL_ONLY_POLICIES",
    "SUPPORTED_POLICIES",
    "P2C_LOAD_METRIC_ALIASES",
    "P2C_LOAD_METRICS",
    "DEMAND_MODES",
    "KV_EVENTS_MODES",
    "DP_RANK_FIELDS",
    "LOG_LEVELS",
    "DEFAULT_REQUEST_ID_HEADERS",
    "DEFAULT_DURATION_BUCKETS",
    "ENV_P2C_LOAD_METRIC",
    "ENV_DECODE_REQUEST_WEIGHT",
    "DISCOVERY_PROVIDERS",
    "ENV_CONTROL_PLANE_API_KEYS",
]

logger = logging.getLogger(__name__)

SUPPORTED_POLICIES: tuple[str, ...] = POLICIES

P2C_LOAD_METRICS: tuple[str, ...] = LOAD_METRICS
P2C_LOAD_METRIC_ALIASES: dict[str, str] = LOAD_METRIC_ALIASES
DEMAND_MODES: tuple[str, ...] = MODES
DEFAULT_REQUEST_ID_HEADERS: tuple[str, ...] = (
    "x-request-id",
    "x-correlation-id",
    "x-trace-id",
    "request-id",
)
# Legacy sglang-router duration histogram buckets (protocol.md 8), in seconds.
DEFAULT_DURATION_BUCKETS: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    15.0,
    30.0,
    45.0,
    60.0,
    90.0,
    120.0,
    180.0,
    240.0,
)


def _list(default: Iterable[Any]) -> Any:
    items = list(default)
    return field(default_factory=lambda: list(items))


@dataclass
class Config:
    """Everything the router needs to start. Field names = sglang-router argparse dests."""

    # --- Worker configuration -------------------------------------------------------------
    host: str = "0.0.0.0"
    port: int = 30000
    worker_urls: list[str] = _list(())
    api_key: str | None = None
    dp_aware: bool = False
    worker_startup_timeout_secs: int = 1800
    worker_startup_check_interval: int = 30
    request_timeout_secs: int = 1800
    max_payload_size: int = 536870912

    # --- Security ---------------------------------------------------------------------------
    # PEM files of the HTTPS listener; both or neither (the files are read at start-up, where a
    # bad one stops the router: fastroute.tls).
    tls_cert_path: str | None = None
    tls_key_path: str | None = None
    tls_min_version: str = "1.2"  # oldest TLS the listener negotiates: 1.2 or 1.3
    # smg's 'id:name:role:key' specs (flag + $CONTROL_PLANE_API_KEYS); parsed by fastroute.auth.
    control_plane_api_keys: list[str] = _list(())
    control_plane_audit_enabled: bool = False
    # /health, /liveness, /readiness on a listener of their own (None: no such listener).
    health_check_port: int | None = None
    # Workers at link-local addresses (169.254.0.0/16, fe80::/10: cloud metadata) are refused
    # unless this is set (fastroute only).
    allow_link_local_workers: bool = False
    # An admin API without keys (--api-key, --control-plane-api-keys) on a --host others can
    # reach refuses to start unless this is set (fastroute only).
    allow_open_admin: bool = False
    # Set by ``fastroute sidecar`` (no flag): its worker-management routes answer 403 while no
    # key guards them and --allow-open-admin is not given.
    admin_closed: bool = False
    # Most table rows (DP ranks, rank ports) one worker may take (fastroute only).
    max_targets_per_worker: int = 256
    # Rows of the shared target table: targets (workers, or DP ranks) of all workers together
    # (fastroute only; the default holds 1,000 servers of 8 ranks).
    max_targets: int = 8192

    # --- PD disaggregation ----------------------------------------------------------------
    pd_disaggregation: bool = False
    # (url, bootstrap port); None = the prefill has no bootstrap port (JSON null in bodies).
    prefill: list[tuple[str, int | None]] = _list(())
    decode: list[str] = _list(())

    # --- Routing policy -------------------------------------------------------------------
    policy: str = "cache_aware"
    # None on input means "same as policy"; always a policy name after __post_init__ (so
    # dataclasses.replace(config, policy=...) does not re-derive them).
    prefill_policy: str | None = None
    decode_policy: str | None = None
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_secs: int = 60
    max_tree_size: int = 67108864
    p2c_load_metric: str = "tokens"
    load_monitor_interval: float = 1.0
    disable_load_monitoring: bool = False
    # Lower-cased once here so the request path compares without case folding.
    routing_key_headers: list[str] = _list(())
    # Multi-model gateway: one routing group per model, picked by the request's "model";
    # aliases are "ALIAS=MODEL".
    enable_igw: bool = False
    model_alias: list[str] = _list(())
    # TLS towards https:// workers (fastroute.tls.client_context): extra CAs, mTLS identity.
    ca_cert_paths: list[str] = _list(())
    client_cert_path: str | None = None
    client_key_path: str | None = None
    # manual policy: how a new routing key is placed, and when an idle key is forgotten.
    assignment_mode: str = "random"
    max_idle_secs: int = 4 * 3600
    # manual: routing keys kept per group and process; past it the least recently used are
    # evicted (fastroute only: the peers' map grows until --max-idle-secs).
    max_manual_keys: int = 1_000_000

    # --- Retries --------------------------------------------------------------------------
    retry_max_retries: int = 5
    retry_initial_backoff_ms: int = 50
    retry_max_backoff_ms: int = 30000
    retry_backoff_multiplier: float = 1.5
    retry_jitter_factor: float = 0.2
    disable_retries: bool = False

    # --- Circuit breaker ------------------------------------------------------------------
    cb_failure_threshold: int = 10
    cb_success_threshold: int = 3
    cb_timeout_duration_secs: int = 60
    cb_window_duration_secs: int = 120
    disable_circuit_breaker: bool = False

    # --- Health checks --------------------------------------------------------------------
    health_failure_threshold: int = 3
    health_success_threshold: int = 2
    health_check_timeout_secs: int = 5
    health_check_interval_secs: int = 60
    health_check_endpoint: str = "/health"
    disable_health_check: bool = False

    # --- Admission / rate limiting --------------------------------------------------------
    max_concurrent_requests: int = -1
    queue_size: int = 100
    queue_timeout_secs: int = 60
    rate_limit_tokens_per_second: int | None = None

    # --- Flow control (smg 1.13's scheduler, tenants, overload shed; dataplane/flowcontrol.py) -----
    priority_scheduler_enabled: bool = False
    priority_scheduler_default_max_class: str = "default"
    priority_scheduler_config: str | None = None
    priority_scheduler_tenant_metric_top_n: int = 32
    tenant_rate_limit_enabled: bool = False
    tenant_rate_limit_config: str | None = None
    tenant_api_key: list[str] = _list(())
    trust_tenant_header: bool = False
    tenant_header_name: str = "x-smg-tenant-id"
    worker_overload_shed: bool = False
    worker_overload_waiting_requests: int | None = None  # flow control's saturation (smg: 8)
    worker_overload_token_usage: float | None = None  # (smg: 0.8)
    prefill_overload_uncached_tokens: int = 0
    flow_max_queued: int = 0  # waiters of every class together; 0 = only the per-class bounds

    # --- Prometheus -----------------------------------------------------------------------
    prometheus_host: str = "0.0.0.0"
    prometheus_port: int = 29000
    prometheus_duration_buckets: list[float] = _list(DEFAULT_DURATION_BUCKETS)

    # --- Logging / front door -------------------------------------------------------------
    log_level: str = "info"
    log_dir: str | None = None
    log_json: bool = False
    # Lower-cased once here (HTTP header names are case-insensitive).
    request_id_headers: list[str] = _list(DEFAULT_REQUEST_ID_HEADERS)
    cors_allowed_origins: list[str] = _list(())
    shutdown_grace_period_secs: int = 180
    header_read_timeout_secs: float = 30.0
    idle_connection_timeout_secs: float = 60.0
    # Keep below SGLang's 5 s keep-alive so the router never reuses a socket the worker closed.
    # 0 means what it says: no connection is kept idle (each request opens its own).
    upstream_pool_idle_timeout_secs: float = 3.0
    sse_keepalive_secs: float = 15.0
    # --enable-trace: OpenTelemetry spans exported over OTLP/gRPC (fastroute/dataplane/tracing.py).
    enable_trace: bool = False
    otlp_traces_endpoint: str = "localhost:4317"

    # --- fastroute extensions -------------------------------------------------------------
    decode_input_demand: str = "off"
    decode_request_weight: int = 0
    prefill_input_demand: str = "off"
    # None = by mode: routed_dp_rank on the PD decode leg, data_parallel_rank in regular mode.
    dp_rank_field: str | None = None
    seed: int | None = None
    workers: int = 1
    decode_kv_fit: str = "off"
    decode_kv_reserve_tokens: int = 0
    # placement by each server's measured speed (fastroute.core.speed, core.speedplace)
    speed_aware: str = "off"
    speed_slo_unmet: str = "best_effort"  # a request whose SLO no rank is predicted to meet
    # cache_aware's bound on DP ranks (None = by leg: core.cache_aware.leg_rank_slack)
    cache_aware_rank_slack: int | None = None
    # Exact tokens (fastroute.dataplane.tokenize): smg's tokenizer flags, local paths only
    model_path: str | None = None
    tokenizer_path: tuple[str, ...] = ()
    chat_template: str | None = None
    tokenizer_cache_enable_l0: bool = False
    tokenizer_cache_l0_max_entries: int = 10_000
    tokenizer_cache_l0_max_memory: int = 256 * 1024 * 1024
    tokenizer_cache_enable_l1: bool = False
    tokenizer_cache_l1_max_memory: int = 50 * 1024 * 1024
    tokenize_timeout_ms: float = 50.0
    # The engine's KV events and pushed loads (fastroute.control.kvevents)
    kv_events: str = "auto"
    kv_events_endpoint: str | None = None
    block_size: int = 16  # smg's default: the blocks of --kv-events-endpoint publishers
    kv_events_stale_secs: float = 30.0
    kv_index_max_blocks: int = 1 << 18
    # Where p2c_load_metric came from, for the start-up banner: "flag", the environment
    # variable's name, or "default" (set by config_from_args; not a flag).
    load_metric_source: str = "default"
    # Hostile-client bounds (a slow or endless client must not hold a slot forever): a request body
    # must arrive within this total time (inactivity within it is bounded by
    # header_read_timeout_secs), and a PD batch may hold at most this many items (one bootstrap room
    # each; the peers only bound the body size).
    body_read_timeout_secs: float = 300.0
    pd_max_batch_size: int = 1024

    # --- Worker discovery (fastroute.control.discovery) -----------------------------------
    service_discovery: bool = False
    discovery_provider: str | None = None  # None: kubernetes when --service-discovery is set
    selector: list[str] = _list(())
    prefill_selector: list[str] = _list(())
    decode_selector: list[str] = _list(())
    service_discovery_port: int = 80
    service_discovery_namespace: str | None = None  # None = all namespaces
    bootstrap_port_annotation: str = "sglang.ai/bootstrap-port"
    discovery_file: str | None = None
    discovery_check_interval_secs: int = 60

    # --- Router replicas balancing as one (fastroute.control.replica) ---------------------
    replica_sync: str | None = None  # redis://HOST:PORT[/DB]; None = off
    replica_id: str | None = None  # None: host:port:pid
    replica_sync_interval_ms: int = 10
    replica_ttl_ms: int = 3000

    @property
    def discovery(self) -> str | None:
        """The discovery provider in use ("kubernetes" or "file"), or None when off."""
        if self.discovery_provider is not None:
            return self.discovery_provider
        return "kubernetes" if self.service_discovery else None

    def __post_init__(self) -> None:
        if self.prefill_policy is None:
            self.prefill_policy = self.policy
        # Whether the decode leg took --policy (cache_aware then balances decode ranks).
        self._decode_inherited = self.decode_policy is None
        if self.decode_policy is None:
            self.decode_policy = self.policy
        self.p2c_load_metric = metric_in_use(self)
        if self.log_level == "warn":
            self.log_level = "warning"
        # Normalise containers so callers may pass tuples / generators.
        self.worker_urls = [_strip_url(u) for u in self.worker_urls]
        self.decode = [_strip_url(u) for u in self.decode]
        self.prefill = [(_strip_url(u), p) for u, p in self.prefill]
        self.request_id_headers = [h.strip().lower() for h in self.request_id_headers]
        self.routing_key_headers = [h.strip().lower() for h in self.routing_key_headers]
        self.cors_allowed_origins = [o.strip().rstrip("/") for o in self.cors_allowed_origins]
        self.control_plane_api_keys = list(self.control_plane_api_keys)
        self.prometheus_duration_buckets = sorted({float(b) for b in self.prometheus_duration_buckets})
        self.validate()

    # ------------------------------------------------------------------ derived values
    def rank_field(self, leg: str = "decode") -> str:
        """Body key carrying the DP rank for `leg` ("decode" or "regular")."""
        if self.dp_rank_field is not None:
            return self.dp_rank_field
        return "routed_dp_rank" if leg == "decode" else "data_parallel_rank"

    @property
    def max_attempts(self) -> int:
        """Total upstream attempts per request (retry_max_retries counts attempts, 7.2)."""
        return 1 if self.disable_retries else max(1, self.retry_max_retries)

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ConfigError naming the first offending flag; no side effects. The rules are
        :func:`fastroute.config.checks.validate`'s."""
        _validate(self)


# Flags that only mean something with discovery on; given without it they are ignored (one warning).
DISCOVERY_FLAGS: tuple[str, ...] = (
    "--selector",
    "--service-discovery-port",
    "--service-discovery-namespace",
    "--prefill-selector",
    "--decode-selector",
    "--bootstrap-port-annotation",
    "--discovery-file",
    "--discovery-check-interval-secs",
)


def _field_names() -> frozenset[str]:
    return frozenset(f.name for f in fields(Config))


def default(name: str) -> Any:
    """Default value of Config field `name` (a fresh copy for list fields)."""
    for f in fields(Config):
        if f.name == name:
            if f.default_factory is not MISSING:
                return f.default_factory()
            return f.default
    raise KeyError(name)


def _p2c_metric_from_env(environ: dict[str, str] | os._Environ[str]) -> str | None:
    """The metric $SGLANG_ROUTER_P2C_LOAD_METRIC names, or None (unset, or not a metric: then
    the default, said in one warning)."""
    raw = environ.get(ENV_P2C_LOAD_METRIC, "").strip().lower()
    if not raw:
        return None
    value = P2C_LOAD_METRIC_ALIASES.get(raw, raw)
    if value not in P2C_LOAD_METRICS + REFUSED_LOAD_METRICS:  # expected_wait: as the flag's
        # The patched power_of_two this mirrors treats any other value as `tokens`; keep that
        # so an existing environment still starts, but say so once.
        logger.warning(
            "%s=%r is not one of %s; ignored (power_of_two uses the default, tokens)",
            ENV_P2C_LOAD_METRIC,
            raw,
            ", ".join(P2C_LOAD_METRICS),
        )
        return None
    return value


def _p2c_warnings(config: Config, environ: dict[str, str] | os._Environ[str], flag_given: bool) -> list[str]:
    """What the start says about power_of_two's load metric: the default differs from smg's
    (one warning), and $SGLANG_ROUTER_P2C_LOAD_METRIC does nothing when no leg uses it."""
    p2c = "power_of_two" in (config.policy, config.prefill_policy, config.decode_policy)
    if not config.pd_disaggregation:
        p2c = config.policy == "power_of_two"
    env = environ.get(ENV_P2C_LOAD_METRIC, "").strip()
    out = []
    if p2c and config.load_metric_source == "default":
        out.append(
            "power_of_two uses the load metric tokens (fastroute's default; smg's is "
            "expected_wait, which fastroute refuses): give --p2c-load-metric to choose"
        )
    if env and not p2c and not flag_given and config.p2c_load_metric != "expected_wait":
        out.append(f"{ENV_P2C_LOAD_METRIC} is set and ignored (only power_of_two reads it, and no leg uses it)")
    return out


def _weight_from_env(environ: dict[str, str] | os._Environ[str]) -> int:
    raw = environ.get(ENV_DECODE_REQUEST_WEIGHT, "").strip()
    if not raw:
        return 0
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(ENV_DECODE_REQUEST_WEIGHT, f"{raw!r} is not an integer") from None


def _overload_protection_off(kwargs: dict[str, Any]) -> None:
    """--disable-worker-overload-protection: as smg, both overload thresholds off, so flow
    control's saturation never holds, sheds or leaves out a rank for them. A threshold given on
    beside it asks for the opposite: refused."""
    w = kwargs.get("worker_overload_waiting_requests")
    u = kwargs.get("worker_overload_token_usage")
    if w or (u is not None and u < 1.0):
        raise ConfigError(
            "--disable-worker-overload-protection",
            "switches the overload thresholds off; --worker-overload-waiting-requests or "
            "--worker-overload-token-usage gives one on",
        )
    kwargs["worker_overload_waiting_requests"] = 0
    kwargs["worker_overload_token_usage"] = 1.0


def config_from_args(ns: Any, environ: dict[str, str] | None = None, said_elsewhere: Iterable[str] = ()) -> Config:
    """Build and validate a Config from an argparse namespace produced by `fastroute.config.cli`.

    Namespace attributes that are Config fields are copied; `prefill`/`decode` arrive raw
    (lists of tokens) and are parsed here; flags left at None fall back to the environment
    (`environ`, default os.environ). Logs one warning per distinct ignored flag recorded in
    `ns.ignored_flags` and refuses (ConfigError naming it) a flag `fastroute.config.flags` refuses;
    no warning for the flags in `said_elsewhere` (their caller explains them itself).
    Raises ConfigError.
    """
    env = os.environ if environ is None else environ
    raw = vars(ns)
    names = _field_names()
    kwargs: dict[str, Any] = {k: v for k, v in raw.items() if k in names and v is not None}

    kwargs["prefill"] = [_parse_prefill(tokens) for tokens in raw.get("prefill") or ()]
    kwargs["decode"] = [tokens[0] if isinstance(tokens, list) else tokens for tokens in raw.get("decode") or ()]
    # Explicit None means "not given": the policy sub-flags then resolve to --policy.
    kwargs["prefill_policy"] = raw.get("prefill_policy")
    kwargs["decode_policy"] = raw.get("decode_policy")
    kwargs["dp_rank_field"] = raw.get("dp_rank_field")
    kwargs["seed"] = raw.get("seed")
    kwargs["tokenizer_path"] = tuple(raw.get("tokenizer_path") or ())
    if raw.get("p2c_load_metric") is None:
        from_env = _p2c_metric_from_env(env)
        kwargs["p2c_load_metric"] = from_env or "tokens"
        if from_env is not None:
            kwargs["load_metric_source"] = ENV_P2C_LOAD_METRIC
    else:
        kwargs["load_metric_source"] = "flag"
    if raw.get("decode_request_weight") is None:
        kwargs["decode_request_weight"] = _weight_from_env(env)
    workers = raw.get("workers")
    if workers == "auto":
        kwargs["workers"] = os.cpu_count() or 1
    if not raw.get("control_plane_api_keys"):
        kwargs["control_plane_api_keys"] = split_env_keys(env.get(ENV_CONTROL_PLANE_API_KEYS))

    # Refused flags stop the start before anything else is judged (fastroute.config.flags: the rule).
    try:
        warnings = flags.apply(raw.get("ignored_flags") or ())
    except flags.RefusedFlag as exc:
        raise ConfigError(exc.flag, str(exc).split(": ", 1)[1]) from None
    if any(flag == "--disable-worker-overload-protection" for flag, _ in raw.get("ignored_flags") or ()):
        _overload_protection_off(kwargs)
    config = Config(**kwargs)
    if config.discovery == "kubernetes" and kube_config_source(env) is None:
        raise ConfigError("--service-discovery", NO_KUBE_CONFIG)
    # Discovery sub-flags mean nothing without discovery (and --selector nothing in PD mode,
    # where the peers also ignore it): one warning each, as for the table's inert flags.
    given = [flag for flag, _ in (raw.get("ignored_flags") or ())]
    noted = [f for f in given if f in DISCOVERY_FLAGS]
    if config.discovery is not None:
        noted = [f for f in noted if f == "--selector" and config.pd_disaggregation]
    for flag in dict.fromkeys(noted):
        warnings.append(
            f"{flag} is accepted for compatibility and ignored by fastroute "
            f"(only used by worker discovery{' outside PD mode' if config.discovery else ''})"
        )
    # Settings that only mean something beside another one: set without it, one warning each.
    for field_name, flag, needs, used in _COMPANIONS:
        if getattr(config, field_name) != default(field_name) and not used(config):
            warnings.append(f"{flag} is accepted and ignored by fastroute (only used with {needs})")
    warnings += _p2c_warnings(config, env, raw.get("p2c_load_metric") is not None)
    prefill = config.prefill_policy or config.policy
    if config.speed_aware != "off" and config.pd_disaggregation and prefill not in SPEED_POLICIES:
        warnings.append(
            f"--speed-aware places PD prefills only under --prefill-policy power_of_two, random or "
            f"round_robin: the {prefill} prefill policy places them as before and x-slo-ttft-ms targets "
            "are neither placed nor refused"
        )
    # One warning per flag, in the order the flags were given; none for a flag the caller
    # (fastroute epp) warns about itself.
    first = {flag: i for i, flag in reversed(list(enumerate(given)))}
    for line in sorted(warnings, key=lambda w: first.get(w.split(" ", 1)[0], len(given))):
        if line.split(" ", 1)[0] not in said_elsewhere:
            logger.warning("%s", line)
    return config


_COMPANIONS: tuple[tuple[str, str, str, Any], ...] = (
    (
        "assignment_mode",
        "--assignment-mode",
        "--policy manual",
        lambda c: "manual" in (c.policy, c.prefill_policy, c.decode_policy),
    ),
    (
        "max_idle_secs",
        "--max-idle-secs",
        "--policy manual",
        lambda c: "manual" in (c.policy, c.prefill_policy, c.decode_policy),
    ),
    (
        "max_manual_keys",
        "--max-manual-keys",
        "--policy manual",
        lambda c: "manual" in (c.policy, c.prefill_policy, c.decode_policy),
    ),
    ("replica_id", "--replica-id", "--replica-sync", lambda c: c.replica_sync is not None),
    ("replica_sync_interval_ms", "--replica-sync-interval-ms", "--replica-sync", lambda c: c.replica_sync is not None),
    ("replica_ttl_ms", "--replica-ttl-ms", "--replica-sync", lambda c: c.replica_sync is not None),
    *(
        (field_name, flag, "--tokenizer-path or --model-path", lambda c: bool(c.tokenizer_path or c.model_path))
        for field_name, flag in (
            ("chat_template", "--chat-template"),
            ("tokenize_timeout_ms", "--tokenize-timeout-ms"),
            ("tokenizer_cache_enable_l0", "--tokenizer-cache-enable-l0"),
            ("tokenizer_cache_enable_l1", "--tokenizer-cache-enable-l1"),
        )
    ),
    (
        "tokenizer_cache_l0_max_entries",
        "--tokenizer-cache-l0-max-entries",
        "--tokenizer-cache-enable-l0",
        lambda c: c.tokenizer_cache_enable_l0,
    ),
    (
        "tokenizer_cache_l0_max_memory",
        "--tokenizer-cache-l0-max-memory",
        "--tokenizer-cache-enable-l0",
        lambda c: c.tokenizer_cache_enable_l0,
    ),
    (
        "tokenizer_cache_l1_max_memory",
        "--tokenizer-cache-l1-max-memory",
        "--tokenizer-cache-enable-l1",
        lambda c: c.tokenizer_cache_enable_l1,
    ),
    ("block_size", "--block-size", "--kv-events-endpoint", lambda c: c.kv_events_endpoint is not None),
    ("kv_events_stale_secs", "--kv-events-stale-secs", "--kv-events auto", lambda c: c.kv_events != "off"),
    ("kv_index_max_blocks", "--kv-index-max-blocks", "--kv-events auto", lambda c: c.kv_events != "off"),
    (
        "priority_scheduler_config",
        "--priority-scheduler-config",
        "--priority-scheduler-enabled",
        lambda c: c.priority_scheduler_enabled,
    ),
    (
        "priority_scheduler_default_max_class",
        "--priority-scheduler-default-max-class",
        "--priority-scheduler-enabled",
        lambda c: c.priority_scheduler_enabled,
    ),
    (
        "tenant_rate_limit_config",
        "--tenant-rate-limit-config",
        "--tenant-rate-limit-enabled",
        lambda c: c.tenant_rate_limit_enabled,
    ),
    ("trust_tenant_header", "--trust-tenant-header", "a flow-control flag", flow_enabled),
    ("tenant_header_name", "--tenant-header-name", "a flow-control flag", flow_enabled),
)


def _parse_prefill(tokens: list[str]) -> tuple[str, int | None]:
    if not 1 <= len(tokens) <= 2:
        raise ConfigError("--prefill", f"takes URL [BOOTSTRAP_PORT], got {len(tokens)} values: {tokens}")
    url = tokens[0]
    if len(tokens) == 1 or tokens[1].strip().lower() == "none":
        return url, None
    try:
        return url, int(tokens[1])
    except ValueError:
        raise ConfigError(
            "--prefill",
            f"bootstrap port {tokens[1]!r} of {url} must be an integer or 'none'",
        ) from None
