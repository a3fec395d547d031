"""The Python API of the SGLang router, so launch scripts swap one import line:

    from sglang_router.launch_router import RouterArgs, launch_router   # before
    from fastroute.launch_router import RouterArgs, launch_router       # after

    launch_router(RouterArgs(worker_urls=["http://w1:30000"], policy="power_of_two"))

``RouterArgs`` has the field names and defaults of sglang-router 0.3.2's dataclass; where a
field is also a fastroute setting its default is read from :class:`fastroute.config.Config` (the
values agree; the one source of defaults stays the config). A
``RouterArgs`` (or an ``argparse.Namespace`` carrying those field names, or fastroute's own
namespace) is turned into fastroute's command line and run by the same code as the ``fastroute``
command, so every field goes through the same validation and the same fail-closed rules: a field
fastroute does not implement refuses to start exactly as its flag would. ``launch_router``
blocks until the router stops. ``python -m fastroute.launch_router ARGS`` equals ``fastroute ARGS``.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any, Dict, List, Optional, Sequence

from fastroute import cli
from fastroute.config import default


def _listed(name: str) -> Any:
    """A list field whose default is fastroute's (a fresh list per instance)."""
    return dataclasses.field(default_factory=lambda: list(default(name)))


@dataclasses.dataclass
class RouterArgs:
    # Workers and listener
    worker_urls: List[str] = _listed("worker_urls")
    host: str = default("host")
    port: int = default("port")
    # PD
    mini_lb: bool = False
    pd_disaggregation: bool = default("pd_disaggregation")
    prefill_urls: List[tuple] = dataclasses.field(default_factory=list)   # (url, bootstrap port | None)
    decode_urls: List[str] = dataclasses.field(default_factory=list)
    # Routing policy
    policy: str = default("policy")
    prefill_policy: Optional[str] = default("prefill_policy")
    decode_policy: Optional[str] = default("decode_policy")
    worker_startup_timeout_secs: int = default("worker_startup_timeout_secs")
    worker_startup_check_interval: int = default("worker_startup_check_interval")
    cache_threshold: float = default("cache_threshold")
    balance_abs_threshold: int = default("balance_abs_threshold")
    balance_rel_threshold: float = default("balance_rel_threshold")
    eviction_interval_secs: int = default("eviction_interval_secs")
    max_tree_size: int = default("max_tree_size")
    max_idle_secs: int = default("max_idle_secs")
    assignment_mode: str = default("assignment_mode")
    max_payload_size: int = default("max_payload_size")
    bucket_adjust_interval_secs: int = 5
    dp_aware: bool = default("dp_aware")
    enable_igw: bool = default("enable_igw")
    api_key: Optional[str] = default("api_key")
    log_dir: Optional[str] = default("log_dir")
    log_level: Optional[str] = None
    # Service discovery
    service_discovery: bool = default("service_discovery")
    selector: Dict[str, str] = dataclasses.field(default_factory=dict)
    service_discovery_port: int = default("service_discovery_port")
    service_discovery_namespace: Optional[str] = default("service_discovery_namespace")
    prefill_selector: Dict[str, str] = dataclasses.field(default_factory=dict)
    decode_selector: Dict[str, str] = dataclasses.field(default_factory=dict)
    bootstrap_port_annotation: str = default("bootstrap_port_annotation")
    # Prometheus, request ids, timeouts, admission
    prometheus_port: Optional[int] = None
    prometheus_host: Optional[str] = None
    prometheus_duration_buckets: Optional[List[float]] = None
    request_id_headers: Optional[List[str]] = None
    request_timeout_secs: int = default("request_timeout_secs")
    shutdown_grace_period_secs: int = default("shutdown_grace_period_secs")
    max_concurrent_requests: int = default("max_concurrent_requests")
    queue_size: int = default("queue_size")
    queue_timeout_secs: int = default("queue_timeout_secs")
    rate_limit_tokens_per_second: Optional[int] = default("rate_limit_tokens_per_second")
    cors_allowed_origins: List[str] = _listed("cors_allowed_origins")
    # Retries
    retry_max_retries: int = default("retry_max_retries")
    retry_initial_backoff_ms: int = default("retry_initial_backoff_ms")
    retry_max_backoff_ms: int = default("retry_max_backoff_ms")
    retry_backoff_multiplier: float = default("retry_backoff_multiplier")
    retry_jitter_factor: float = default("retry_jitter_factor")
    disable_retries: bool = default("disable_retries")
    # Health checks
    health_failure_threshold: int = default("health_failure_threshold")
    health_success_threshold: int = default("health_success_threshold")
    health_check_timeout_secs: int = default("health_check_timeout_secs")
    health_check_interval_secs: int = default("health_check_interval_secs")
    health_check_endpoint: str = default("health_check_endpoint")
    disable_health_check: bool = default("disable_health_check")
    # Circuit breaker
    cb_failure_threshold: int = default("cb_failure_threshold")
    cb_success_threshold: int = default("cb_success_threshold")
    cb_timeout_duration_secs: int = default("cb_timeout_duration_secs")
    cb_window_duration_secs: int = default("cb_window_duration_secs")
    disable_circuit_breaker: bool = default("disable_circuit_breaker")
    # Tokenizer, parsers, storage backends (gateway features)
    model_path: Optional[str] = None
    tokenizer_path: Optional[str] = None
    chat_template: Optional[str] = None
    tokenizer_cache_enable_l0: bool = False
    tokenizer_cache_l0_max_entries: int = 10000
    tokenizer_cache_enable_l1: bool = False
    tokenizer_cache_l1_max_memory: int = 50 * 1024 * 1024
    reasoning_parser: Optional[str] = None
    tool_call_parser: Optional[str] = None
    mcp_config_path: Optional[str] = None
    backend: str = "sglang"
    history_backend: str = "memory"
    oracle_wallet_path: Optional[str] = None
    oracle_tns_alias: Optional[str] = None
    oracle_connect_descriptor: Optional[str] = None
    oracle_username: Optional[str] = None
    oracle_password: Optional[str] = None
    oracle_pool_min: int = 1
    oracle_pool_max: int = 16
    oracle_pool_timeout_secs: int = 30
    postgres_db_url: Optional[str] = None
    postgres_pool_max: int = 16
    redis_url: Optional[str] = None
    redis_pool_max: int = 16
    redis_retention_days: int = 30
    # TLS
    client_cert_path: Optional[str] = default("client_cert_path")
    client_key_path: Optional[str] = default("client_key_path")
    ca_cert_paths: List[str] = _listed("ca_cert_paths")
    server_cert_path: Optional[str] = None
    server_key_path: Optional[str] = None
    # Tracing and control-plane auth
    enable_trace: bool = False
    otlp_traces_endpoint: str = "localhost:4317"
    control_plane_api_keys: List[tuple] = _listed("control_plane_api_keys")
    control_plane_audit_enabled: bool = default("control_plane_audit_enabled")
    jwt_issuer: Optional[str] = None
    jwt_audience: Optional[str] = None
    jwt_jwks_uri: Optional[str] = None
    jwt_role_mapping: Dict[str, str] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "RouterArgs":
        """From a namespace whose attributes use the dataclass names (sglang-router's parser
        writes ``prefill``/``decode`` lists and ``tls_cert_path``; those are mapped too)."""
        src = vars(ns)
        kw: dict[str, Any] = {f.name: src[f.name] for f in dataclasses.fields(cls)
                              if f.name in src and src[f.name] is not None}
        for entry in src.get("prefill") or []:
            url = entry[0]
            port = entry[1] if len(entry) > 1 else None
            kw.setdefault("prefill_urls", []).append(
                (url, None if port in (None, "none", "None") else int(port)))
        for entry in src.get("decode") or []:
            kw.setdefault("decode_urls", []).append(entry[0] if isinstance(entry, (list, tuple)) else entry)
        for ours, theirs in (("tls_cert_path", "server_cert_path"), ("tls_key_path", "server_key_path")):
            if src.get(ours):
                kw[theirs] = src[ours]
        return cls(**kw)

    def to_argv(self) -> list[str]:
        """The ``fastroute`` command line equal to these arguments (fields left at their
        default are not written, so fastroute's identical defaults apply)."""
        argv: list[str] = []
        defaults = RouterArgs()
        special = {"prefill_urls", "decode_urls", "selector", "prefill_selector", "decode_selector",
                   "control_plane_api_keys", "jwt_role_mapping", "server_cert_path", "server_key_path"}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in special or value == getattr(defaults, f.name) or value is None:
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                argv.append(flag)
            elif isinstance(value, (list, tuple)):
                argv += [flag, *map(str, value)]
            else:
                argv += [flag, str(value)]
        for url, port in self.prefill_urls:
            argv += ["--prefill", str(url), "none" if port is None else str(port)]
        for url in self.decode_urls:
            argv += ["--decode", str(url)]
        for name in ("selector", "prefill_selector", "decode_selector", "jwt_role_mapping"):
            mapping = getattr(self, name)
            if mapping:
                argv += ["--" + name.replace("_", "-"), *(f"{k}={v}" for k, v in mapping.items())]
        if self.control_plane_api_keys:
            argv.append("--control-plane-api-keys")
            argv += [k if isinstance(k, str) else ":".join(map(str, k)) for k in self.control_plane_api_keys]
        if self.server_cert_path:
            argv += ["--tls-cert-path", self.server_cert_path]
        if self.server_key_path:
            argv += ["--tls-key-path", self.server_key_path]
        return argv


def launch_router(args: RouterArgs | argparse.Namespace) -> None:
    """Run the router until it stops (SIGTERM/SIGINT). Raises SystemExit with the status the
    ``fastroute`` command would exit with when the arguments are refused."""
    router_args = args if isinstance(args, RouterArgs) else RouterArgs.from_cli_args(args)
    status = cli.main(router_args.to_argv())
    if status:
        raise SystemExit(status)


def parse_router_args(argv: Sequence[str]) -> RouterArgs:
    """Parse a command line into RouterArgs (fastroute's flags and sglang-router's)."""
    return RouterArgs.from_cli_args(cli.parse_namespace(list(argv)))


def main(argv: Sequence[str] | None = None) -> int | None:
    return cli.main(list(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    sys.exit(main())
