"""Every start-up rule of :class:`fastroute.config.Config` (:func:`validate`), the value checks
behind them, the refusals with their reasons, and the error they raise.

Each check names the flag at fault, so a bad command line fails with one line that says which
option to fix.
"""

from __future__ import annotations

import ipaddress
import logging
import math
import re
import socket
from typing import Any
from urllib.parse import urlsplit

from fastroute import flowpolicy
from fastroute.auth import ControlPlaneKeyError, parse_control_plane_keys
from fastroute.control import otlp
from fastroute.flowpolicy import CLASSES, PolicyError, load_rate_limits, load_scheduler, parse_tenant_keys
from fastroute.kube import parse_selector
from fastroute.names import (
    ALL_POLICIES,
    ASSIGNMENT_MODES,
    DISCOVERY_PROVIDERS,
    DP_RANK_FIELDS,
    ENV_DECODE_REQUEST_WEIGHT,
    KV_EVENTS_MODES,
    LOAD_METRICS,
    LOG_LEVELS,
    MODES,
    POLICIES,
    PREFILL_ONLY_POLICIES,
    REFUSED_LOAD_METRICS,
    SPEED_POLICIES,
)


class ConfigError(ValueError):
    """A start-up configuration error; `flag` names the option (or env var) at fault."""

    def __init__(self, flag: str, message: str) -> None:
        self.flag = flag
        self.message = message
        super().__init__(f"argument {flag}: {message}")


class PolicyFileError(ConfigError):
    """A policy file (the flow-control YAMLs) that cannot be read or used: the CLI exits 1 with
    its path and line, as for a file the router cannot start with."""


# Why smg's default power_of_two metric is refused rather than mapped (no fastroute metric
# means the same, and a silent substitute would route differently from what was asked).
EXPECTED_WAIT_REFUSAL = (
    "smg's expected_wait scores a worker by (queued prompt tokens + 1024 per request sent to it "
    "since the last load poll) / its reported gen_throughput, plus 0.15 s x k/(1-k) of its KV "
    "usage k; fastroute's load polls keep running and waiting requests and used tokens, not "
    "throughput or queued tokens, so it cannot compute that score and does not substitute "
    "another one; choose tokens, requests or least_requests"
)
MANUAL_WORKERS_REFUSAL = (
    "the manual policy's routing-key table is kept per proxy process, so with --workers {n} each "
    "process would place the same key on its own and keys would move between workers; use "
    "--workers 1 with manual, or --policy consistent_hashing (the same key always hashes to the "
    "same worker in every process)"
)


# The most rows --max-targets may ask for (a table of 3 GiB per process): beyond it a typo.
MAX_TARGETS_LIMIT = 1 << 24


def _legs(c: Any) -> list[tuple[str, str]]:
    """(flag that chose it, policy) of every leg that routes."""
    if not c.pd_disaggregation:
        return [("--policy", c.policy)]
    legs = (("--prefill-policy", c.prefill_policy), ("--decode-policy", c.decode_policy))
    return [("--policy" if p == c.policy else flag, p) for flag, p in legs]


def metric_in_use(c: Any) -> str:
    """``c.p2c_load_metric``, or ``tokens`` (one warning) for an expected_wait no power_of_two
    leg reads: it then cannot change where requests go."""
    if c.p2c_load_metric == "expected_wait" and all(p != "power_of_two" for _, p in _legs(c)):
        logging.getLogger("fastroute.config").warning(
            "--power-of-two-load-metric expected_wait is accepted and ignored by fastroute (only "
            "used with --policy power_of_two, which is not in use)"
        )
        return "tokens"
    return c.p2c_load_metric


def check_peer_semantics(c: Any) -> None:
    """Combinations that would quietly route otherwise than the peers: refused by name."""
    used = _legs(c)
    if c.p2c_load_metric == "expected_wait":
        source = c.load_metric_source  # the flag, or the environment variable that gave it
        raise ConfigError(source if source.isupper() else "--power-of-two-load-metric", EXPECTED_WAIT_REFUSAL)
    workers = c.workers
    manual = [flag for flag, p in used if p == "manual"]
    if manual and workers > 1:
        raise ConfigError(manual[0], MANUAL_WORKERS_REFUSAL.format(n=workers))


def _strip_url(url: str) -> str:
    # A trailing slash would turn `url + "/generate"` into `//generate`.
    return url.strip().rstrip("/")


def _check_url(flag: str, url: str) -> None:
    if not url.startswith(("http://", "https://")):
        raise ConfigError(flag, f"{url!r} must start with http:// or https://")
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError as exc:
        raise ConfigError(flag, f"{url!r} is not a valid URL: {exc}") from None
    if not parts.hostname:
        raise ConfigError(flag, f"{url!r} has no host")


def _check_port(flag: str, port: int) -> None:
    # 0 asks the OS for an ephemeral port (tests use it).
    if not 0 <= port <= 65535:
        raise ConfigError(flag, f"port {port} is not in 0..65535")


def _check_origin(origin: str) -> None:
    """'*' or scheme://host[:port], the form browsers send in Origin."""
    if origin == "*":
        return
    try:
        parts = urlsplit(origin)
        parts.port  # noqa: B018 - raises ValueError on a malformed port
    except ValueError:
        parts = None
    if (
        parts is None
        or parts.scheme not in ("http", "https")
        or not parts.hostname
        or parts.path
        or parts.query
        or parts.fragment
        or parts.username
    ):
        raise ConfigError("--cors-allowed-origins", f"{origin!r} is not '*' or an origin like https://host[:port]")


def _check_header(flag: str, name: str) -> None:
    if not name or any(c in name for c in " \t\r\n:"):
        raise ConfigError(flag, f"{name!r} is not a valid header name")


def _at_least(flag: str, value: int, lo: int) -> None:
    if value < lo:
        raise ConfigError(flag, f"must be >= {lo} (got {value})")


def _finite_at_least(flag: str, value: float, lo: float) -> None:
    if not math.isfinite(value) or value < lo:
        raise ConfigError(flag, f"must be a finite number >= {lo} (got {value})")


# ---- worker URLs ----------------------------------------------------------------------------
# A worker URL ends up in request lines, Host headers, metric labels and log lines: it must be
# one plain token. RFC 1123 host labels (underscores tolerated, as resolvers do).
_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)\Z")
HOST_MAX = 253
# Longest worker URL accepted (it is a label of every per-worker metric series and is shown in
# logs and /workers; browsers and proxies commonly stop near 2,000 characters too).
URL_MAX = 2048


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address a host literal spells (any spelling the resolver accepts), else None."""
    h = host[1:-1] if host.startswith("[") else host
    try:
        a = ipaddress.ip_address(h)
    except ValueError:
        try:
            a = ipaddress.ip_address(socket.inet_aton(h))  # 127.1, 0x7f000001, 2130706433
        except OSError:
            return None
    if isinstance(a, ipaddress.IPv6Address) and a.ipv4_mapped is not None:
        return a.ipv4_mapped
    return a


def link_local(address: str) -> bool:
    """169.254.0.0/16 or fe80::/10 (cloud metadata lives there), in any spelling."""
    a = _ip(address)
    return a is not None and a.is_link_local


def worker_url_problem(url: str, allow_link_local: bool = False) -> str | None:
    """What makes ``url`` unusable as a worker URL, or None. ``http://`` is implied when no
    scheme is given; at most ``URL_MAX`` characters; only http and https, a valid host of at
    most 253 characters, a port in 1..65535, no whitespace, control or non-ASCII character
    anywhere, and no link-local
    address unless ``allow_link_local`` (--allow-link-local-workers)."""
    if not isinstance(url, str):
        return "must be a string"
    if len(url) > URL_MAX:
        return f"is {len(url)} characters long, longer than {URL_MAX}"
    if any(c.isspace() or ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F for c in url):
        return "contains whitespace or control characters"
    if not url.isascii():
        # It is shown in metric labels, logs and request lines: a lone surrogate there would
        # break every scrape. An IDN host is given in its xn-- form.
        return "contains non-ASCII characters (give an IDN host in its xn-- form)"
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "http", url
    if scheme.lower() not in ("http", "https"):
        return f"scheme {scheme!r} is not supported (only http:// and https://)"
    netloc = rest.split("/", 1)[0].split("?", 1)[0].split("#", 1)[0]
    hostport = netloc.rpartition("@")[2]
    port: str | None
    if hostport.startswith("["):
        end = hostport.find("]")
        if end < 0:
            return "has an unterminated [IPv6] host"
        host, port = hostport[: end + 1], hostport[end + 1 :]
        if port and not port.startswith(":"):
            return "has text after the [IPv6] host"
        port = port[1:] if port else None
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return f"host {host!r} is not a valid IPv6 address"
    else:
        host, colon, port = hostport.partition(":")
        port = port if colon else None
        if not host:
            return "has no host"
        if len(host) > HOST_MAX:
            return f"host is longer than {HOST_MAX} characters"
        labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
        if not all(_LABEL.match(label) for label in labels):
            return f"host {host!r} is not a valid host name or address"
    if port is not None and not (port.isdigit() and port.isascii() and 1 <= int(port) <= 65535):
        return f"port {port!r} is not in 1..65535"
    if not allow_link_local and link_local(host):
        return (
            f"host {host} is a link-local address (169.254.0.0/16, fe80::/10); "
            "pass --allow-link-local-workers to allow it"
        )
    return None


# Why --prefill-policy bucket is refused rather than approximated.
BUCKET_REFUSAL = (
    "policy 'bucket' is not implemented by fastroute: it gives each prefill worker a range of "
    "request lengths whose boundaries move with observed load every "
    "--bucket-adjust-interval-secs, and what it does rests on that tuning loop, which the peers "
    "do not specify; an imitation would balance differently under the same flags. Use "
    "--prefill-policy cache_aware or power_of_two (both balance prefill by load)"
)
MIN_LOAD_MONITOR_INTERVAL = 0.1  # seconds, the shortest --load-monitor-interval


# ---------------------------------------------------------------------------------------------
# The rules of a Config, run by Config.__post_init__ (so a hand-built Config is held to them).


def validate(c: Any) -> None:
    """The start-up rules of a :class:`fastroute.config.Config` (``c``): raise ConfigError
    naming the first offending flag; no side effects."""
    _validate_workers(c)
    _validate_policies(c)
    _validate_numbers(c)
    _validate_extensions(c)
    _validate_discovery(c)
    _validate_security(c)
    _validate_replica(c)
    _validate_trace(c)
    _validate_flow(c)


def _validate_flow(c: Any) -> None:
    """The flow-control flags: smg's file formats, read now so a bad file stops start-up
    naming its line (fastroute.flowpolicy)."""
    try:
        parse_tenant_keys(list(c.tenant_api_key))
    except ValueError as exc:
        raise ConfigError("--tenant-api-key", str(exc)) from None
    if c.priority_scheduler_default_max_class.strip().lower() not in CLASSES:
        raise ConfigError("--priority-scheduler-default-max-class", f"must be one of {', '.join(CLASSES)}")
    _at_least("--priority-scheduler-tenant-metric-top-n", c.priority_scheduler_tenant_metric_top_n, 0)
    if not c.tenant_header_name.strip():
        raise ConfigError("--tenant-header-name", "must not be empty")
    if c.priority_scheduler_enabled:
        try:
            policy = load_scheduler(c.priority_scheduler_config, c.priority_scheduler_default_max_class)
        except PolicyError as exc:
            raise PolicyFileError("--priority-scheduler-config", str(exc)) from None
        cap = c.max_concurrent_requests
        reserved = sum(s.reserved(cap) for s in policy.classes) if cap > 0 else 0
        if reserved and reserved >= cap:
            raise PolicyFileError(
                "--priority-scheduler-config",
                f"{c.priority_scheduler_config}: the classes reserve {reserved} slots, which must stay under "
                f"--max-concurrent-requests ({c.max_concurrent_requests}, the scheduler's fallback capacity)",
            )
    if c.tenant_rate_limit_enabled:
        if not c.tenant_rate_limit_config:
            raise ConfigError("--tenant-rate-limit-enabled", "needs --tenant-rate-limit-config")
        try:
            load_rate_limits(c.tenant_rate_limit_config, bool(c.trust_tenant_header))
        except PolicyError as exc:
            raise PolicyFileError("--tenant-rate-limit-config", str(exc)) from None
    gate = c.priority_scheduler_enabled or c.worker_overload_shed  # the saturation gate runs
    w, u = c.worker_overload_waiting_requests, c.worker_overload_token_usage
    if w is not None:
        _at_least("--worker-overload-waiting-requests", w, 0)
        if w and not gate:
            raise ConfigError(
                "--worker-overload-waiting-requests",
                "leaving overloaded workers out of routing is not implemented; the threshold is used by "
                "--priority-scheduler-enabled or --worker-overload-shed (0 is accepted)",
            )
    if u is not None:
        if not math.isfinite(u) or u <= 0.0:
            raise ConfigError("--worker-overload-token-usage", "must be a finite number > 0")
        if u < 1.0 and not gate:
            raise ConfigError(
                "--worker-overload-token-usage",
                "leaving overloaded workers out of routing is not implemented; the threshold is used by "
                "--priority-scheduler-enabled or --worker-overload-shed (a value >= 1.0, off, is accepted)",
            )
    _at_least("--prefill-overload-uncached-tokens", c.prefill_overload_uncached_tokens, 0)
    _at_least("--flow-max-queued", c.flow_max_queued, 0)
    if c.flow_max_queued and not c.priority_scheduler_enabled:
        raise ConfigError("--flow-max-queued", "only used with --priority-scheduler-enabled")
    if c.prefill_overload_uncached_tokens and not (gate and c.pd_disaggregation):
        raise ConfigError(
            "--prefill-overload-uncached-tokens",
            "only used with --pd-disaggregation and --priority-scheduler-enabled or --worker-overload-shed",
        )
    if gate and c.enable_igw:
        raise ConfigError(
            "--priority-scheduler-enabled" if c.priority_scheduler_enabled else "--worker-overload-shed",
            "the saturation gate does not read --enable-igw's per-model groups",
        )
    if flowpolicy.flow_enabled(c) and c.rate_limit_tokens_per_second is not None:
        raise ConfigError(
            "--rate-limit-tokens-per-second",
            "the legacy token bucket does not combine with the flow-control flags "
            "(--priority-scheduler-enabled, --tenant-rate-limit-enabled, --tenant-api-key, --worker-overload-shed)",
        )


def _validate_replica(c: Any) -> None:
    if c.replica_sync is None:
        return
    parsed = urlsplit(c.replica_sync)
    db = parsed.path.strip("/")
    if parsed.scheme not in ("redis", "rediss") or not parsed.hostname or not (db == "" or db.isdigit()):
        raise ConfigError("--replica-sync", f"{c.replica_sync!r} is not redis://HOST:PORT[/DB] (or rediss:// for TLS)")
    _at_least("--replica-sync-interval-ms", c.replica_sync_interval_ms, 1)
    if c.replica_ttl_ms < 2 * c.replica_sync_interval_ms:
        raise ConfigError(
            "--replica-ttl-ms",
            f"{c.replica_ttl_ms} ms must be at least two "
            "sync intervals, or a live replica drops out between its heartbeats",
        )
    if c.replica_id is not None and not c.replica_id.strip():
        raise ConfigError("--replica-id", "must not be empty")


def _validate_workers(c: Any) -> None:
    if c.pd_disaggregation and c.worker_urls:
        raise ConfigError(
            "--worker-urls",
            "cannot be combined with --pd-disaggregation; use --prefill and --decode",
        )
    if not c.pd_disaggregation and (c.prefill or c.decode):
        flag = "--prefill" if c.prefill else "--decode"
        raise ConfigError(flag, "requires --pd-disaggregation")
    seen: dict[str, str] = {}
    for flag, urls in (
        ("--worker-urls", c.worker_urls),
        ("--prefill", [u for u, _ in c.prefill]),
        ("--decode", c.decode),
    ):
        for url in urls:
            _check_url(flag, url)
            problem = worker_url_problem(url, c.allow_link_local_workers)
            if problem is not None:
                raise ConfigError(flag, f"{url!r} {problem}")
            if url in seen:
                raise ConfigError(flag, f"{url} is already given by {seen[url]}")
            seen[url] = flag
    for url, port in c.prefill:
        if port is not None and not 1 <= port <= 65535:
            raise ConfigError("--prefill", f"bootstrap port {port} of {url} is not in 1..65535")
    if not c.host:
        raise ConfigError("--host", "must not be empty")
    _check_port("--port", c.port)


def _validate_policies(c: Any) -> None:
    for flag, value, extra in (
        ("--policy", c.policy, ()),
        ("--prefill-policy", c.prefill_policy, PREFILL_ONLY_POLICIES),
        ("--decode-policy", c.decode_policy, ()),
    ):
        if value in POLICIES:
            continue
        supported = ", ".join(POLICIES)
        if value == "bucket" and flag == "--prefill-policy":
            raise ConfigError(flag, f"{BUCKET_REFUSAL}; supported: {supported}")
        if value in ALL_POLICIES or value in extra:
            raise ConfigError(
                flag,
                f"policy {value!r} is not implemented by fastroute; supported: {supported}",
            )
        raise ConfigError(flag, f"unknown policy {value!r}; supported: {supported}")
    if c.p2c_load_metric not in LOAD_METRICS + REFUSED_LOAD_METRICS:
        raise ConfigError(
            "--power-of-two-load-metric",
            f"invalid value {c.p2c_load_metric!r}; choose from " + ", ".join(LOAD_METRICS),
        )
    check_peer_semantics(c)
    if not 0.0 <= c.cache_threshold <= 1.0:
        raise ConfigError("--cache-threshold", "must be within 0.0..1.0")
    _at_least("--balance-abs-threshold", c.balance_abs_threshold, 0)
    _finite_at_least("--balance-rel-threshold", c.balance_rel_threshold, 0.0)
    _at_least("--eviction-interval-secs", c.eviction_interval_secs, 1)
    _at_least("--max-tree-size", c.max_tree_size, 1)
    if not math.isfinite(c.load_monitor_interval) or (c.load_monitor_interval < MIN_LOAD_MONITOR_INTERVAL):
        raise ConfigError(
            "--load-monitor-interval",
            f"must be at least {MIN_LOAD_MONITOR_INTERVAL} seconds (got {c.load_monitor_interval})",
        )
    for name in c.routing_key_headers:
        _check_header("--routing-key-headers", name)
    if c.assignment_mode not in ASSIGNMENT_MODES:
        raise ConfigError(
            "--assignment-mode",
            f"invalid value {c.assignment_mode!r}; choose from {', '.join(ASSIGNMENT_MODES)}",
        )
    _at_least("--max-idle-secs", c.max_idle_secs, 1)
    _at_least("--max-manual-keys", c.max_manual_keys, 1)
    for item in c.model_alias:
        alias, sep, model = item.partition("=")
        if not sep or not alias.strip() or not model.strip():
            raise ConfigError("--model-alias", f"{item!r} is not ALIAS=MODEL")
    if c.model_alias and not c.enable_igw:
        raise ConfigError("--model-alias", "requires --enable-igw")


def _validate_numbers(c: Any) -> None:
    _at_least("--worker-startup-timeout-secs", c.worker_startup_timeout_secs, 1)
    _at_least("--worker-startup-check-interval", c.worker_startup_check_interval, 1)
    _at_least("--request-timeout-secs", c.request_timeout_secs, 1)
    _at_least("--max-payload-size", c.max_payload_size, 1)
    _at_least("--retry-max-retries", c.retry_max_retries, 0)
    _at_least("--retry-initial-backoff-ms", c.retry_initial_backoff_ms, 0)
    _at_least("--retry-max-backoff-ms", c.retry_max_backoff_ms, 0)
    _finite_at_least("--retry-backoff-multiplier", c.retry_backoff_multiplier, 1.0)
    if not 0.0 <= c.retry_jitter_factor <= 1.0:
        raise ConfigError("--retry-jitter-factor", "must be within 0.0..1.0")
    _at_least("--cb-failure-threshold", c.cb_failure_threshold, 1)
    _at_least("--cb-success-threshold", c.cb_success_threshold, 1)
    _at_least("--cb-timeout-duration-secs", c.cb_timeout_duration_secs, 0)
    _at_least("--cb-window-duration-secs", c.cb_window_duration_secs, 1)
    _at_least("--health-failure-threshold", c.health_failure_threshold, 1)
    _at_least("--health-success-threshold", c.health_success_threshold, 1)
    _at_least("--health-check-timeout-secs", c.health_check_timeout_secs, 1)
    _at_least("--health-check-interval-secs", c.health_check_interval_secs, 1)
    if not c.health_check_endpoint.startswith("/"):
        raise ConfigError("--health-check-endpoint", "must be a path starting with '/'")
    # -1 = unlimited (sglang-router's default); 0 is left to mean the same.
    _at_least("--max-concurrent-requests", c.max_concurrent_requests, -1)
    _at_least("--queue-size", c.queue_size, 0)
    _at_least("--queue-timeout-secs", c.queue_timeout_secs, 0)
    if c.rate_limit_tokens_per_second is not None:
        _at_least("--rate-limit-tokens-per-second", c.rate_limit_tokens_per_second, 1)
    if not c.prometheus_host:
        raise ConfigError("--prometheus-host", "must not be empty")
    _check_port("--prometheus-port", c.prometheus_port)
    if not c.prometheus_duration_buckets:
        raise ConfigError("--prometheus-duration-buckets", "needs at least one bucket")
    for b in c.prometheus_duration_buckets:
        if not math.isfinite(b) or b <= 0:
            raise ConfigError("--prometheus-duration-buckets", f"bucket {b} is not > 0")
    if c.log_level not in LOG_LEVELS:
        raise ConfigError("--log-level", f"invalid level {c.log_level!r}")
    for name in c.request_id_headers:
        _check_header("--request-id-headers", name)
    _at_least("--shutdown-grace-period-secs", c.shutdown_grace_period_secs, 0)
    _finite_at_least("--header-read-timeout-secs", c.header_read_timeout_secs, 0.001)
    _finite_at_least("--idle-connection-timeout-secs", c.idle_connection_timeout_secs, 0.001)
    _finite_at_least("--upstream-pool-idle-timeout-secs", c.upstream_pool_idle_timeout_secs, 0.0)
    _finite_at_least("--sse-keepalive-secs", c.sse_keepalive_secs, 0.0)
    _finite_at_least("--body-read-timeout-secs", c.body_read_timeout_secs, 0.001)
    _at_least("--pd-max-batch-size", c.pd_max_batch_size, 1)


def reachable_host(host: str) -> bool:
    """Whether a listener bound to ``host`` can be reached from other machines: anything but
    a loopback address or ``localhost`` (a host name is assumed to resolve to a reachable one)."""
    if host in ("localhost", "localhost.localdomain") or host.endswith(".localhost"):
        return False
    try:
        return not ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return True


def open_admin_problem(c: Any) -> str | None:
    """Why the router must not start with this admin API posture, or None: worker management
    without any key, on a --host others can reach, and no --allow-open-admin. Anyone reaching
    the port could add a worker (and receive users' prompts) or remove them."""
    if c.api_key or c.control_plane_api_keys or c.allow_open_admin or c.admin_closed:
        return None
    if not reachable_host(c.host):
        return None
    return (
        f"the worker admin API on {c.host}:{c.port} would be open to anyone who reaches it "
        "(no --api-key or --control-plane-api-keys): give a key, bind --host 127.0.0.1, or pass "
        "--allow-open-admin to run it open as sglang-router does"
    )


def _validate_security(c: Any) -> None:
    if bool(c.tls_cert_path) != bool(c.tls_key_path):
        flag, other = (
            ("--tls-key-path", "--tls-cert-path") if c.tls_cert_path else ("--tls-cert-path", "--tls-key-path")
        )
        raise ConfigError(flag, f"is required with {other}")
    if c.tls_min_version not in ("1.2", "1.3"):
        raise ConfigError("--tls-min-version", f"{c.tls_min_version!r}: choose from 1.2, 1.3")
    try:
        parse_control_plane_keys(c.control_plane_api_keys)
    except ControlPlaneKeyError as exc:
        raise ConfigError("--control-plane-api-keys", str(exc)) from None
    if c.health_check_port is not None:
        _check_port("--health-check-port", c.health_check_port)
        if c.health_check_port and c.health_check_port in (c.port, c.prometheus_port):
            raise ConfigError("--health-check-port", f"{c.health_check_port} is already --port or --prometheus-port")
    for origin in c.cors_allowed_origins:
        _check_origin(origin)
    _at_least("--max-targets-per-worker", c.max_targets_per_worker, 1)


def _validate_trace(c: Any) -> None:
    """--enable-trace needs the OpenTelemetry packages (the 'trace' extra) and an endpoint in
    one of smg's forms."""
    if not getattr(c, "enable_trace", False):
        return
    if otlp.exporter_missing():
        raise ConfigError(
            "--enable-trace", "needs the OpenTelemetry SDK and OTLP/gRPC exporter: pip install 'fastroute[trace]'"
        )
    problem = otlp.endpoint_problem(c.otlp_traces_endpoint)
    if problem is not None:
        raise ConfigError(otlp.FLAG, problem)


def _validate_extensions(c: Any) -> None:
    for flag, mode in (
        ("--decode-input-demand", c.decode_input_demand),
        ("--prefill-input-demand", c.prefill_input_demand),
        ("--decode-kv-fit", c.decode_kv_fit),
        ("--speed-aware", c.speed_aware),
    ):
        if mode not in MODES:
            raise ConfigError(flag, f"invalid value {mode!r}; choose from off, shadow, on")
    if c.prefill_input_demand != "off" and (not c.pd_disaggregation or c.prefill_policy == "manual"):
        raise ConfigError(
            "--prefill-input-demand",
            "places the prefill leg of PD requests: needs --pd-disaggregation and a prefill policy other than manual",
        )
    _at_least("--decode-request-weight", c.decode_request_weight, 0)
    if c.decode_request_weight and c.decode_input_demand == "off":
        # The weight only enters the demand cost; with demand off it would do nothing,
        # which an operator setting it surely did not intend (seed PR semantics).
        raise ConfigError(
            "--decode-request-weight",
            f"{c.decode_request_weight} (or {ENV_DECODE_REQUEST_WEIGHT}) requires "
            "--decode-input-demand shadow or on (it is off)",
        )
    if c.dp_rank_field is not None and c.dp_rank_field not in DP_RANK_FIELDS:
        raise ConfigError(
            "--dp-rank-field",
            f"invalid value {c.dp_rank_field!r}; choose from " + ", ".join(DP_RANK_FIELDS),
        )
    if c.seed is not None and not 0 <= c.seed < 2**64:
        raise ConfigError("--seed", "must be within 0..2**64-1")
    _at_least("--workers", c.workers, 1)
    _at_least("--max-targets", c.max_targets, 1)
    if c.max_targets > MAX_TARGETS_LIMIT:
        raise ConfigError("--max-targets", f"must be at most {MAX_TARGETS_LIMIT}")
    _at_least("--decode-kv-reserve-tokens", c.decode_kv_reserve_tokens, 0)
    if c.cache_aware_rank_slack is not None:
        _at_least("--cache-aware-rank-slack", c.cache_aware_rank_slack, 0)
    _validate_kv_events(c)
    _validate_speed(c)
    _finite_at_least("--tokenize-timeout-ms", c.tokenize_timeout_ms, 0.0)
    _at_least("--tokenizer-cache-l0-max-entries", c.tokenizer_cache_l0_max_entries, 1)
    _at_least("--tokenizer-cache-l0-max-memory", c.tokenizer_cache_l0_max_memory, 1)
    _at_least("--tokenizer-cache-l1-max-memory", c.tokenizer_cache_l1_max_memory, 1)
    decoding = c.decode_policy if c.pd_disaggregation else c.policy
    if decoding == "manual":
        # manual pins each routing key to a worker; a cost or a KV filter would move keys.
        for flag, mode in (
            ("--decode-input-demand", c.decode_input_demand),
            ("--decode-kv-fit", c.decode_kv_fit),
        ):
            if mode != "off":
                raise ConfigError(
                    flag,
                    "does not combine with the manual policy (it pins each "
                    "routing key to one worker); use --decode-policy power_of_two",
                )


def _validate_speed(c: Any) -> None:
    if c.speed_slo_unmet not in ("best_effort", "refuse"):
        raise ConfigError("--speed-slo-unmet", f"invalid value {c.speed_slo_unmet!r}; choose from best_effort, refuse")
    if c.speed_slo_unmet == "refuse" and c.speed_aware != "on":
        raise ConfigError("--speed-slo-unmet", "refuse needs --speed-aware on (the fits predict who meets a target)")
    if c.speed_aware == "off":
        return
    decoding = c.decode_policy if c.pd_disaggregation else c.policy
    if decoding not in SPEED_POLICIES:
        raise ConfigError(
            "--speed-aware",
            f"places decode targets itself; the {decoding} policy keeps state of its own picks "
            "(use --decode-policy power_of_two, or --policy in regular mode)",
        )
    if c.workers != 1:
        raise ConfigError("--speed-aware", "fits speeds in one router process; needs --workers 1")
    if c.enable_igw:
        raise ConfigError("--speed-aware", "does not combine with --enable-igw (per-model groups)")
    if c.enable_trace:
        raise ConfigError(
            "--speed-aware", "does not combine with --enable-trace yet (each replaces the exchange with its own)"
        )


def _validate_kv_events(c: Any) -> None:
    if c.kv_events not in KV_EVENTS_MODES:
        raise ConfigError("--kv-events", f"invalid value {c.kv_events!r}; choose from " + ", ".join(KV_EVENTS_MODES))
    _at_least("--block-size", c.block_size, 1)
    _at_least("--kv-index-max-blocks", c.kv_index_max_blocks, 1)
    _finite_at_least("--kv-events-stale-secs", c.kv_events_stale_secs, 0.1)
    if c.kv_events_endpoint is not None:
        if c.kv_events == "off":
            raise ConfigError("--kv-events-endpoint", "names publishers to subscribe to, but --kv-events is off")
        from fastroute.control.kvevents import parse_endpoint

        try:
            parse_endpoint(c.kv_events_endpoint, c.block_size)
        except ValueError as exc:
            raise ConfigError("--kv-events-endpoint", str(exc).split(": ", 1)[-1]) from None


def _validate_discovery(c: Any) -> None:
    if c.discovery_provider not in (None,) + DISCOVERY_PROVIDERS:
        raise ConfigError(
            "--discovery-provider",
            f"invalid value {c.discovery_provider!r}; choose from " + ", ".join(DISCOVERY_PROVIDERS),
        )
    for flag, tokens in (
        ("--selector", c.selector),
        ("--prefill-selector", c.prefill_selector),
        ("--decode-selector", c.decode_selector),
    ):
        try:
            parse_selector(tokens)
        except ValueError as exc:
            raise ConfigError(flag, str(exc)) from None
    if c.discovery is None:
        return
    _at_least("--discovery-check-interval-secs", c.discovery_check_interval_secs, 1)
    if c.discovery == "file":
        if not c.discovery_file:
            raise ConfigError("--discovery-file", "is required by --discovery-provider file")
        return
    if not 1 <= c.service_discovery_port <= 65535:
        raise ConfigError("--service-discovery-port", f"port {c.service_discovery_port} is not in 1..65535")
    if c.pd_disaggregation and not (c.prefill_selector or c.decode_selector):
        raise ConfigError("--service-discovery", "PD mode needs --prefill-selector and/or --decode-selector")
    if not c.pd_disaggregation and not c.selector:
        raise ConfigError("--selector", "is required by --service-discovery (e.g. app=sglang)")
    if not c.pd_disaggregation and (c.prefill_selector or c.decode_selector):
        raise ConfigError(
            "--prefill-selector" if c.prefill_selector else "--decode-selector", "requires --pd-disaggregation"
        )


# ---------------------------------------------------------------------- helpers
