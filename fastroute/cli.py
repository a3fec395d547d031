"""The `fastroute` command: sglang-router compatible flags, logging set-up, dispatch.

Owns the argparse surface only. An operator replaces `python -m sglang_router.launch_router
ARGS` with `fastroute ARGS`: every sglang-router 0.3.2 flag keeps its meaning and default (the
defaults are read from `fastroute.config.Config`, the single source of truth), smg additions are
accepted, each routing flag also answers to its `--router-` spelling (as passed by
`sglang.launch_server`), and flags with no meaning for fastroute are accepted with one warning
each. Turning the namespace into a validated `Config` is `fastroute.config`'s job; running it is
`fastroute.runtime.server.run`'s (a `Server`, or a `Supervisor` under `--workers N`).
`fastroute demo ...` hands over to `fastroute.sim.demo`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from fastroute import __version__, flags
from fastroute.config import (
    ALL_POLICIES,
    DEMAND_MODES,
    DISCOVERY_PROVIDERS,
    DP_RANK_FIELDS,
    ENV_CONTROL_PLANE_API_KEYS,
    ENV_DECODE_REQUEST_WEIGHT,
    ENV_P2C_LOAD_METRIC,
    P2C_LOAD_METRICS,
    PREFILL_ONLY_POLICIES,
    SUPPORTED_POLICIES,
    Config,
    ConfigError,
    config_from_args,
    default,
)
from fastroute.log import configure_logging, startup_error
from fastroute.names import ASSIGNMENT_MODES, REFUSED_LOAD_METRICS
from fastroute.runtime.server import Server, run
from fastroute.runtime.startup import StartupError
from fastroute.runtime.supervisor import Supervisor, resolve_processes

__all__ = ["build_parser", "parse_namespace", "parse_args", "configure_logging", "main"]

ROUTER_PREFIX = "--router-"
# Flags that sglang.launch_server never prefixes with --router- (protocol.md 9).
_NEVER_PREFIXED = frozenset({"--host", "--port", "--worker-urls"})
# Peer flags that start with --router- and are flags of their own, not a prefixed spelling
# (smg's --router-selector picks its mesh's router pods): the inventory judges them by name.
_OWN_PREFIXED = frozenset(f.name for f in flags.TABLE if f.name.startswith(ROUTER_PREFIX))

# Every peer flag fastroute accepts without a field of its own comes from the one inventory,
# fastroute.flags.TABLE (implemented / inert / refused, with the reason).
BY_STATUS: dict[str, tuple[str, ...]] = {
    status: tuple(n for n in flags.COMPAT_NAMES if flags.lookup(n).status == status) for status in flags.STATUSES
}
# Inert flags: accepted with one warning each.
IGNORED_FLAGS: tuple[str, ...] = BY_STATUS[flags.INERT]
# Whole flag families of the peers (`--redis-url`, `--jwt-issuer`, ...): matched by prefix
# before argparse sees the command line, because their members are not enumerable here.
IGNORED_FAMILIES: tuple[str, ...] = flags.FAMILY_PREFIXES

_LOG_LEVEL_CHOICES = ("debug", "info", "warn", "warning", "error", "critical")


class _Parser(argparse.ArgumentParser):
    """Argument errors are start-up refusals: one line (no usage block), JSON with --log-json."""

    json_errors = False

    def error(self, message: str) -> Any:  # type: ignore[override]
        startup_error(message, self.json_errors)
        self.exit(2)


def _wants_json(argv: Sequence[str]) -> bool:
    for token in argv:
        if token == "--":
            return False
        if token in ("--log-json", "--router-log-json"):
            return True
    return False


class _IgnoredFlag(argparse.Action):
    """Swallow a compatibility flag and its values; remember both for fastroute.flags.apply."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        kwargs.setdefault("nargs", "*")
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        flag = _canonical(option_string or self.option_strings[0])
        if isinstance(values, str):
            values = [values]
        namespace.ignored_flags.append((flag, list(values or ())))


class _DiscoveryOption(argparse.Action):
    """Store a discovery sub-flag and note its name: config drops the note when discovery is on
    and otherwise reports the flag as ignored (it means nothing without discovery)."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Any = None) -> None:
        setattr(namespace, self.dest, values)
        namespace.ignored_flags.append((_canonical(option_string or self.option_strings[0]), []))


def _canonical(flag: str) -> str:
    flag = flag.split("=", 1)[0]
    if flag.startswith(ROUTER_PREFIX) and flag not in _OWN_PREFIXED:
        return "--" + flag[len(ROUTER_PREFIX) :]
    return flag


def _workers_value(text: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither an integer nor 'auto'") from None


def _p2c_metric(text: str) -> str:
    value = text.strip().lower()
    if value in P2C_LOAD_METRICS or value in REFUSED_LOAD_METRICS:
        return value  # expected_wait parses and is refused with its reason (fastroute.checks)
    raise argparse.ArgumentTypeError(f"invalid choice {text!r} (choose from " + ", ".join(P2C_LOAD_METRICS) + ")")


class _Adder:
    """Adds a flag to a help group plus its hidden `--router-` alias on the parser."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser
        self.group: Any = parser

    def section(self, title: str, description: str | None = None) -> _Adder:
        self.group = self.parser.add_argument_group(title, description)
        return self

    def __call__(self, *names: str, **kwargs: Any) -> None:
        action = self.group.add_argument(*names, **kwargs)
        if names[0] in _NEVER_PREFIXED:
            return
        alias_kwargs = dict(kwargs)
        alias_kwargs["help"] = argparse.SUPPRESS
        if not isinstance(action, _IgnoredFlag):
            # Share the dest; the visible flag alone supplies the default.
            alias_kwargs["dest"] = action.dest
            if "default" in alias_kwargs or action.default is not None:
                alias_kwargs["default"] = argparse.SUPPRESS
        aliases = [
            ROUTER_PREFIX + n[2:] for n in names if n.startswith("--") and ROUTER_PREFIX + n[2:] not in _OWN_PREFIXED
        ]
        if aliases:
            self.parser.add_argument(*aliases, **alias_kwargs)


def build_parser(prog: str = "fastroute") -> argparse.ArgumentParser:
    """The full flag surface, grouped like sglang-router's --help."""
    parser = _Parser(
        prog=prog,
        usage="%(prog)s [OPTIONS]  |  %(prog)s demo [DEMO-OPTIONS]",
        description=(
            "fastroute: drop-in replacement for the SGLang router (sglang-router / smg) that "
            "balances prefill/decode disaggregated serving down to decode DP ranks. Every "
            "routing flag also accepts the --router- prefixed spelling (e.g. --router-policy)."
        ),
        epilog="Subcommand: 'fastroute demo ...' runs the built-in simulation demo.",
    )
    parser.add_argument("--version", action="version", version=f"fastroute {__version__}")
    add = _Adder(parser)
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
        help="Origins allowed by CORS: '*' or https://host[:port] (default: none). Not "
        "answered yet (see docs/flags.md): other origins stay refused.",
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
        type=_p2c_metric,
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

    add.section("Logging")
    add(
        "--log-level",
        type=str.lower,
        choices=_LOG_LEVEL_CHOICES,
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

    add.section("fastroute extensions", "Not in sglang-router; defaults keep peer behaviour.")
    add(
        "--decode-input-demand",
        choices=DEMAND_MODES,
        default=d("decode_input_demand"),
        help="Pick decode targets by in-flight input tokens + request tokens (+ W x held "
        "requests): off, shadow (count agreement, dispatch legacy pick) or on "
        "(default: %(default)s).",
    )
    add(
        "--decode-request-weight",
        type=int,
        default=None,
        metavar="W",
        help="Token charge per request a decode target already holds in the demand cost; "
        "nonzero needs --decode-input-demand shadow or on (default: $"
        + ENV_DECODE_REQUEST_WEIGHT
        + " if set, else 0).",
    )
    add(
        "--prefill-input-demand",
        choices=DEMAND_MODES,
        default=d("prefill_input_demand"),
        help="PD: pick prefill targets (ranks under --dp-aware) by the input tokens waiting "
        "there + this request's: booked at the pick, given back when the prefill answers, "
        "corrected by /v1/loads num_waiting_uncached_tokens where reported; off, shadow "
        "(count agreement, dispatch the prefill policy's pick) or on (default: %(default)s).",
    )
    add(
        "--dp-rank-field",
        choices=DP_RANK_FIELDS,
        default=None,
        help="Body key carrying the chosen DP rank (default: routed_dp_rank on the PD decode "
        "leg, data_parallel_rank in regular mode).",
    )
    add("--seed", type=int, default=None, help="Seed of the tie-break RNG, for reproducible runs (default: random).")
    add(
        "--body-read-timeout-secs",
        type=float,
        default=d("body_read_timeout_secs"),
        help="Answer 408 and close when a request body has not fully arrived within this time; "
        "a body stalled for --header-read-timeout-secs is cut sooner (default: %(default)s s).",
    )
    add(
        "--pd-max-batch-size",
        type=int,
        default=d("pd_max_batch_size"),
        help="Largest PD batch (items, one bootstrap room each); larger ones get 413 (default: %(default)s).",
    )
    add(
        "--workers",
        type=_workers_value,
        default=d("workers"),
        metavar="N|auto",
        help="Proxy processes sharing the port and one in-flight ledger; auto = one per CPU (default: %(default)s).",
    )
    add(
        "--decode-kv-fit",
        choices=DEMAND_MODES,
        default=d("decode_kv_fit"),
        help="KV-fit decode placement: narrow the decode candidates to the ranks whose "
        "estimated free KV (last /v1/loads poll + the router's bookings since) holds this "
        "request's input + max_new_tokens + the reserve, then apply the decode policy (or the "
        "demand cost); no rank fits: the one with the most free KV. 'shadow' dispatches the "
        "usual pick and counts agreement (default: %(default)s).",
    )
    add(
        "--cache-aware-rank-slack",
        type=int,
        default=d("cache_aware_rank_slack"),
        metavar="N",
        help="cache_aware on a leg that decodes (PD decode, regular): pick only among targets "
        "holding at most the least-loaded one's in-flight requests + N; a prefix hit goes to "
        "the least-loaded holder, a miss to the least-loaded target. Default: 0 on the PD "
        "decode leg under --dp-aware when it inherits --policy cache_aware (every decode "
        "step waits for the busiest rank), unbounded elsewhere and with an explicit "
        "--decode-policy cache_aware.",
    )
    add(
        "--decode-kv-reserve-tokens",
        type=int,
        default=d("decode_kv_reserve_tokens"),
        metavar="TOKENS",
        help="Extra KV tokens a request must leave free on its rank under --decode-kv-fit, "
        "on top of its input and max_new_tokens (default: %(default)s).",
    )

    add.section(
        "Service discovery",
        "Workers from Kubernetes pods or a JSON manifest file, beside "
        "--worker-urls / --prefill / --decode and POST /workers (fastroute.control.discovery).",
    )
    opt = _DiscoveryOption
    add(
        "--service-discovery",
        action="store_true",
        help="Watch Kubernetes pods (in-cluster service account or kubeconfig; refuses to start "
        "without either): a Running and Ready pod matching the selector becomes worker "
        "http://<podIP>:<--service-discovery-port> (default: off).",
    )
    add(
        "--selector",
        action=opt,
        nargs="*",
        default=d("selector"),
        metavar="KEY=VALUE",
        help="Label selector of regular-mode worker pods, space- or comma-separated, "
        "set-based forms allowed (default: none).",
    )
    add(
        "--prefill-selector",
        action=opt,
        nargs="*",
        default=d("prefill_selector"),
        metavar="KEY=VALUE",
        help="PD mode: label selector of prefill pods (default: none).",
    )
    add(
        "--decode-selector",
        action=opt,
        nargs="*",
        default=d("decode_selector"),
        metavar="KEY=VALUE",
        help="PD mode: label selector of decode pods (default: none).",
    )
    add(
        "--service-discovery-port",
        action=opt,
        type=int,
        default=d("service_discovery_port"),
        metavar="PORT",
        help="Worker HTTP port on each pod (default: %(default)s).",
    )
    add(
        "--service-discovery-namespace",
        action=opt,
        default=None,
        metavar="NAMESPACE",
        help="Namespace to watch (default: all namespaces).",
    )
    add(
        "--bootstrap-port-annotation",
        action=opt,
        default=d("bootstrap_port_annotation"),
        metavar="KEY",
        help="Pod annotation holding a prefill pod's KV bootstrap port; absent = null (default: %(default)s).",
    )
    add(
        "--discovery-provider",
        choices=DISCOVERY_PROVIDERS,
        default=None,
        help="Where workers come from: kubernetes pods or a JSON manifest file; giving it turns "
        "discovery on (default: kubernetes with --service-discovery).",
    )
    add(
        "--discovery-file",
        action=opt,
        default=None,
        metavar="PATH",
        help='--discovery-provider file: the manifest {"workers": [{"url": ..., '
        '"worker_type": ..., "bootstrap_port": ...}]}; may appear after start-up, '
        "re-read on change; a malformed file keeps the last good set (default: none).",
    )
    add(
        "--discovery-check-interval-secs",
        action=opt,
        type=int,
        metavar="SECS",
        default=d("discovery_check_interval_secs"),
        help="Full re-read of the manifest, and the length of one Kubernetes watch before it is "
        "resumed (default: %(default)s s).",
    )

    add.section(
        "Router replicas",
        "Several routers balancing as one: each publishes its per-target "
        "in-flight counts to Redis and adds the other live replicas' to its own, off the "
        "request path (fastroute.control.replica).",
    )
    add(
        "--replica-sync",
        default=None,
        metavar="redis://HOST:PORT[/DB]",
        help="Share in-flight load and circuit opens with the other replicas through this Redis; "
        "Redis gone: routing goes on with local counts (default: off).",
    )
    add(
        "--replica-id",
        default=None,
        metavar="ID",
        help="This replica's name in Redis (default: host:port:pid, so a restart starts clean).",
    )
    add(
        "--replica-sync-interval-ms",
        type=int,
        default=d("replica_sync_interval_ms"),
        metavar="MS",
        help="Publish and refresh the other replicas' counts every MS (default: %(default)s).",
    )
    add(
        "--replica-ttl-ms",
        type=int,
        default=d("replica_ttl_ms"),
        metavar="MS",
        help="A replica that has not published for MS drops out of the others' view (default: %(default)s).",
    )

    families = [f.name + "*" for f in flags.FAMILIES]
    add.section(
        "Ignored for compatibility",
        "Peer flags that cannot change who gets in, where requests go or readiness: accepted "
        "(with any values) so existing launch scripts keep working, with one warning each "
        "saying why. The full inventory is docs/flags.md (python -m fastroute.flags).",
    )
    for flag in BY_STATUS[flags.INERT]:
        add(flag, action=_IgnoredFlag, metavar="VALUE", help="inert: " + flags.lookup(flag).reason)
    add.section(
        "Accepted: fastroute already does this", "Peer flags asking for what fastroute does anyway; accepted silently."
    )
    for flag in BY_STATUS[flags.IMPLEMENTED]:
        add(flag, action=_IgnoredFlag, metavar="VALUE", help=flags.lookup(flag).reason)
    add.section(
        "Refused (not implemented)",
        "Peer flags that would change who gets in, where requests go or readiness: start-up "
        "fails naming the flag, except for the values noted (which ask for what fastroute "
        "does). Families: " + ", ".join(families) + " (see docs/flags.md).",
    )
    for flag in BY_STATUS[flags.REFUSED]:
        add(flag, action=_IgnoredFlag, metavar="VALUE", help="refused: " + flags.lookup(flag).reason)
    return parser


def _values(argv: Sequence[str], i: int) -> tuple[list[str], int]:
    """The values of the option at ``argv[i]`` and the index after them (values never start
    with "--"; a lone "-1" still counts as a value)."""
    token = argv[i]
    if "=" in token:
        return [token.split("=", 1)[1]], i + 1
    j = i + 1
    while j < len(argv) and not argv[j].startswith("--"):
        j += 1
    return list(argv[i + 1 : j]), j


def _strip_ignored_families(
    argv: Sequence[str],
) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """Remove flag-family options (and their values) argparse cannot know by name."""
    kept: list[str] = []
    dropped: list[tuple[str, list[str]]] = []
    i = 0
    n = len(argv)
    while i < n:
        token = argv[i]
        if token == "--":
            kept.extend(argv[i:])
            break
        name = _canonical(token)
        if token.startswith("--") and name.startswith(IGNORED_FAMILIES):
            row = flags.lookup(name)
            if row is not None and row.family:
                values, i = _values(argv, i)
                dropped.append((name, values))
                continue
        kept.append(token)
        i += 1
    return kept, dropped


def _pending_flags(argv: Sequence[str]) -> list[tuple[str, list[str]]]:
    """Real fastroute flags the inventory lists as not yet effective, as given on the line."""
    found: list[tuple[str, list[str]]] = []
    for i, token in enumerate(argv):
        if token == "--":
            break
        name = _canonical(token)
        if token.startswith("--") and name in flags.PARSED_NAMES:
            found.append((name, _values(argv, i)[0]))
    return found


def parse_namespace(
    argv: Sequence[str] | None = None, parser: argparse.ArgumentParser | None = None
) -> argparse.Namespace:
    """Parse flags into a raw namespace (argparse exits with status 2 on a bad flag).

    ``ns.ignored_flags`` holds ``(flag, values)`` of every inventory flag given (see
    :mod:`fastroute.flags`); :func:`fastroute.config.config_from_args` judges them."""
    parser = parser or build_parser()
    args = list(sys.argv[1:] if argv is None else argv)
    if isinstance(parser, _Parser):
        parser.json_errors = _wants_json(args)
    kept, families = _strip_ignored_families(args)
    ns = argparse.Namespace(ignored_flags=[])
    parser.parse_args(kept, namespace=ns)
    ns.ignored_flags.extend(families)
    ns.ignored_flags.extend(_pending_flags(args))
    return ns


def parse_args(argv: Sequence[str] | None = None) -> Config:
    """Parse and validate a command line; exits with status 2 and a message naming the flag."""
    parser = build_parser()
    ns = parse_namespace(argv, parser)
    try:
        return config_from_args(ns)
    except ConfigError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def _epp(args: list[str]) -> int:
    """``fastroute epp``: the router's flags plus the picker's (fastroute.epp.options)."""
    from fastroute.epp.options import EppError, refusal, split

    json_errors = _wants_json(args)
    try:
        opts, rest = split(args)
    except EppError as exc:
        startup_error(str(exc), json_errors)
        return 2
    parser = build_parser("fastroute epp")
    ns = parse_namespace(rest, parser)
    try:
        configure_logging(ns.log_level, ns.log_dir, json_lines=ns.log_json)
        config = config_from_args(ns)
    except OSError as exc:
        parser.error(f"argument --log-dir: {exc}")
    except ConfigError as exc:
        parser.error(str(exc))
    why = refusal(config, resolve_processes(config))
    if why is not None:
        startup_error(why, json_errors)
        return 2
    if opts.print_config:
        from fastroute.epp.bootstrap import envoy_bootstrap

        queued = config.max_concurrent_requests > 0 or bool(config.rate_limit_tokens_per_second)
        sys.stdout.write(
            envoy_bootstrap(
                opts.grpc_port,
                opts.listen_port,
                opts.admin_port,
                message_timeout=config.queue_timeout_secs + 5.0 if queued else 10.0,
                idle_timeout=float(config.request_timeout_secs),
            )
        )
        return 0
    try:
        from fastroute.epp.server import serve as serve_epp
    except ImportError as exc:
        startup_error(
            f"fastroute epp needs grpcio, grpcio-health-checking and xds-protos (pip install 'fastroute[epp]'): {exc}",
            json_errors,
        )
        return 2
    import uvloop

    try:
        return uvloop.run(serve_epp(config, opts.grpc_port))
    except (StartupError, ConfigError) as exc:
        startup_error(str(exc), json_errors)
        return 1
    except KeyboardInterrupt:
        return 130


def main(argv: Sequence[str] | None = None) -> int | None:
    """Entry point of the `fastroute` console script and `python -m fastroute`."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "demo":
        # Deferred: the simulator (and its load generator) loads only for `fastroute demo`.
        from fastroute.sim.demo import main as demo_main

        return demo_main(args[1:])
    if args and args[0] == "epp":
        return _epp(args[1:])
    if args and args[0] == "sidecar":
        startup_error(
            "fastroute sidecar: not built (the PD relay of the decode pod taking its "
            "picks from the endpoint picker's headers)",
            _wants_json(args),
        )
        return 2
    if args and args[0] == "launch":
        # `smg launch ARGS` / `sglang-router launch ARGS` spelling.
        args = args[1:]
    parser = build_parser()
    ns = parse_namespace(args, parser)
    try:
        configure_logging(ns.log_level, ns.log_dir, json_lines=ns.log_json)
    except OSError as exc:
        parser.error(f"argument --log-dir: {exc}")
    try:
        config = config_from_args(ns)
    except ConfigError as exc:
        parser.error(str(exc))
    # One process serves, or (--workers N, N > 1) a supervisor runs N proxy processes.
    factory = Supervisor if resolve_processes(config) > 1 else Server
    try:
        return run(config, factory)
    except StartupError as exc:
        # One line, no traceback: a port in use or a TLS file that cannot be used.
        startup_error(str(exc), ns.log_json)
        return 1
    except ConfigError as exc:
        # Found while starting (an unusable Kubernetes configuration): refused like a flag.
        startup_error(str(exc), ns.log_json)
        return 2
    except KeyboardInterrupt:
        return 130
