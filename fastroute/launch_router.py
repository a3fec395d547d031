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
from collections.abc import Sequence
from typing import Any

from fastroute.config import ALL_POLICIES, PREFILL_ONLY_POLICIES, cli, default
from fastroute.names import ASSIGNMENT_MODES


def _listed(name: str) -> Any:
    """A list field whose default is fastroute's (a fresh list per instance)."""
    return dataclasses.field(default_factory=lambda: list(default(name)))


@dataclasses.dataclass
class RouterArgs:
    # Workers and listener
    worker_urls: list[str] = _listed("worker_urls")
    host: str = default("host")
    port: int = default("port")
    # PD
    mini_lb: bool = False
    pd_disaggregation: bool = default("pd_disaggregation")
    prefill_urls: list[tuple] = dataclasses.field(default_factory=list)  # (url, bootstrap port | None)
    decode_urls: list[str] = dataclasses.field(default_factory=list)
    # Routing policy
    policy: str = default("policy")
    prefill_policy: str | None = default("prefill_policy")
    decode_policy: str | None = default("decode_policy")
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
    api_key: str | None = default("api_key")
    log_dir: str | None = default("log_dir")
    log_level: str | None = None
    # Service discovery
    service_discovery: bool = default("service_discovery")
    selector: dict[str, str] = dataclasses.field(default_factory=dict)
    service_discovery_port: int = default("service_discovery_port")
    service_discovery_namespace: str | None = default("service_discovery_namespace")
    prefill_selector: dict[str, str] = dataclasses.field(default_factory=dict)
    decode_selector: dict[str, str] = dataclasses.field(default_factory=dict)
    bootstrap_port_annotation: str = default("bootstrap_port_annotation")
    # Prometheus, request ids, timeouts, admission
    prometheus_port: int | None = None
    prometheus_host: str | None = None
    prometheus_duration_buckets: list[float] | None = None
    request_id_headers: list[str] | None = None
    request_timeout_secs: int = default("request_timeout_secs")
    shutdown_grace_period_secs: int = default("shutdown_grace_period_secs")
    max_concurrent_requests: int = default("max_concurrent_requests")
    queue_size: int = default("queue_size")
    queue_timeout_secs: int = default("queue_timeout_secs")
    rate_limit_tokens_per_second: int | None = default("rate_limit_tokens_per_second")
    cors_allowed_origins: list[str] = _listed("cors_allowed_origins")
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
    model_path: str | None = None
    tokenizer_path: str | None = None
    chat_template: str | None = None
    tokenizer_cache_enable_l0: bool = False
    tokenizer_cache_l0_max_entries: int = 10000
    tokenizer_cache_enable_l1: bool = False
    tokenizer_cache_l1_max_memory: int = 50 * 1024 * 1024
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    mcp_config_path: str | None = None
    backend: str = "sglang"
    history_backend: str = "memory"
    oracle_wallet_path: str | None = None
    oracle_tns_alias: str | None = None
    oracle_connect_descriptor: str | None = None
    oracle_username: str | None = None
    oracle_password: str | None = None
    oracle_pool_min: int = 1
    oracle_pool_max: int = 16
    oracle_pool_timeout_secs: int = 30
    postgres_db_url: str | None = None
    postgres_pool_max: int = 16
    redis_url: str | None = None
    redis_pool_max: int = 16
    redis_retention_days: int = 30
    # TLS
    client_cert_path: str | None = default("client_cert_path")
    client_key_path: str | None = default("client_key_path")
    ca_cert_paths: list[str] = _listed("ca_cert_paths")
    server_cert_path: str | None = None
    server_key_path: str | None = None
    # Tracing and control-plane auth
    enable_trace: bool = False
    otlp_traces_endpoint: str = "localhost:4317"
    control_plane_api_keys: list[tuple] = _listed("control_plane_api_keys")
    control_plane_audit_enabled: bool = default("control_plane_audit_enabled")
    jwt_issuer: str | None = None
    jwt_audience: str | None = None
    jwt_jwks_uri: str | None = None
    jwt_role_mapping: dict[str, str] = dataclasses.field(default_factory=dict)

    @staticmethod
    def add_cli_args(
        parser: argparse.ArgumentParser, use_router_prefix: bool = False, exclude_host_port: bool = False
    ) -> None:
        """Add sglang-router 0.3.2's router flags to a launcher's ``parser``: the same option
        names and dests (``--router-policy`` -> ``router_policy`` with the prefix; ``--host``,
        ``--port`` and ``--worker-urls`` never take it), the same defaults, so
        :meth:`from_cli_args` reads back what sglang-router's would. ``exclude_host_port``
        leaves ``--host``/``--port`` to the launcher. Values are only parsed here; they are
        judged when :func:`launch_router` runs them (fastroute's flags, fail closed)."""
        prefix = "router-" if use_router_prefix else ""
        group = parser.add_argument_group("Router (fastroute, sglang-router 0.3.2 flags)")
        for f in dataclasses.fields(RouterArgs):
            name = f.name
            if name in _NO_FLAG or (exclude_host_port and name in ("host", "port")):
                continue
            flag = "--" + _FLAG_NAME.get(name, name.replace("_", "-"))
            if name not in ("host", "port", "worker_urls"):
                flag = "--" + prefix + flag[2:]
            kind = _KIND.get(name) or _kind_of(_field_default(f))
            kwargs: dict[str, Any] = dict(kind)
            if "action" not in kwargs or kwargs["action"] == "store_true":
                kwargs["default"] = _CLI_DEFAULT.get(name, _field_default(f))
            if name in _CHOICES:
                kwargs["choices"] = _CHOICES[name]
            group.add_argument(flag, **kwargs)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, use_router_prefix: bool = False) -> RouterArgs:
        """From a namespace parsed with :meth:`add_cli_args` (``use_router_prefix`` as given
        there), or from one whose attributes use the dataclass names (sglang-router's parser,
        fastroute's own). ``--prefill``/``--decode`` lists become ``prefill_urls`` /
        ``decode_urls``, ``--tls-*-path`` the ``server_*_path`` fields, selectors dicts and
        ``control_plane_api_keys`` sglang-router's ``(id, name, key, role)`` tuples."""
        src = vars(args)
        pre = "router_" if use_router_prefix else ""

        def given(name: str) -> Any:
            for key in (pre + name, name):
                if key in src:
                    return src[key]
            return None

        kw: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            value = given(f.name)
            if value is not None and f.name not in _SPECIAL:
                kw[f.name] = value
        kw["prefill_urls"] = [_prefill_entry(e) for e in given("prefill") or given("prefill_urls") or []]
        kw["decode_urls"] = [
            e[0] if isinstance(e, (list, tuple)) else e for e in given("decode") or given("decode_urls") or []
        ]
        for ours, theirs in (("tls_cert_path", "server_cert_path"), ("tls_key_path", "server_key_path")):
            value = given(ours) or given(theirs)
            if value:
                kw[theirs] = value
        for name in ("selector", "prefill_selector", "decode_selector"):
            kw[name] = _selector(given(name))
        kw["jwt_role_mapping"] = _selector(given("jwt_role_mapping"))
        kw["control_plane_api_keys"] = [
            _key_tuple(e, n) for n, e in enumerate(given("control_plane_api_keys") or [], 1)
        ]
        return cls(**kw)

    def check_fields(self) -> None:
        """Raise TypeError for an attribute that is not a field (``router_args.router_policy =
        ...`` is a typo that sglang-router refuses too, when it starts); never shows a value."""
        names = {f.name for f in dataclasses.fields(self)}
        extra = sorted(k for k in vars(self) if k not in names)
        if extra:
            hints = [
                f"{k!r} (the field is {k[7:]!r}: the router- prefix is for command lines)"
                if k.startswith("router_") and k[7:] in names
                else repr(k)
                for k in extra
            ]
            raise TypeError("RouterArgs has no field " + ", ".join(hints))

    def to_argv(self) -> list[str]:
        """The ``fastroute`` command line equal to these arguments (fields left at their
        default are not written, so fastroute's identical defaults apply)."""
        self.check_fields()
        argv: list[str] = []
        defaults = RouterArgs()
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _SPECIAL or value == getattr(defaults, f.name) or value is None:
                continue
            flag = "--" + f.name.replace("_", "-")
            if isinstance(value, bool):
                if value:
                    argv.append(flag)
            elif isinstance(value, (list, tuple)):
                argv += [flag, *map(str, value)]
            else:
                argv.append(f"{flag}={value}")  # one token: a value starting with '-' stays a value
        for url, port in (_prefill_entry(e) for e in self.prefill_urls):
            argv += ["--prefill", str(url), "none" if port is None else str(port)]
        for url in self.decode_urls:
            argv += ["--decode", str(url)]
        for name in ("selector", "prefill_selector", "decode_selector", "jwt_role_mapping"):
            mapping = getattr(self, name)
            if mapping:
                values = (
                    [f"{k}={v}" for k, v in mapping.items()] if isinstance(mapping, dict) else [str(v) for v in mapping]
                )
                argv += ["--" + name.replace("_", "-"), *values]
        if self.control_plane_api_keys:
            argv.append("--control-plane-api-keys")
            argv += [_key_spec(k, n) for n, k in enumerate(self.control_plane_api_keys, 1)]
        if self.server_cert_path:
            argv.append(f"--tls-cert-path={self.server_cert_path}")
        if self.server_key_path:
            argv.append(f"--tls-key-path={self.server_key_path}")
        return argv


# Fields written by to_argv / read by from_cli_args in a form of their own.
_SPECIAL = frozenset(
    {
        "prefill_urls",
        "decode_urls",
        "selector",
        "prefill_selector",
        "decode_selector",
        "control_plane_api_keys",
        "jwt_role_mapping",
        "server_cert_path",
        "server_key_path",
    }
)
# sglang-router 0.3.2's add_cli_args: flag names that are not the field's, fields without a flag.
_FLAG_NAME = {
    "prefill_urls": "prefill",
    "decode_urls": "decode",
    "server_cert_path": "tls-cert-path",
    "server_key_path": "tls-key-path",
}
_NO_FLAG = frozenset({"bootstrap_port_annotation"})
# Its parser defaults where they differ from the dataclass's (None there: "not given").
_CLI_DEFAULT: dict[str, Any] = {
    "prometheus_port": 29000,
    "prometheus_host": "0.0.0.0",
    "log_level": "info",
    "selector": {},
    "prefill_selector": {},
    "decode_selector": {},
    "jwt_role_mapping": [],
    "control_plane_api_keys": [],
}
_KIND: dict[str, dict[str, Any]] = {
    "prefill_urls": {"nargs": "+", "action": "append", "metavar": ("URL", "BOOTSTRAP_PORT")},
    "decode_urls": {"nargs": 1, "action": "append", "metavar": "URL"},
    "selector": {"nargs": "+", "type": str},
    "prefill_selector": {"nargs": "+", "type": str},
    "decode_selector": {"nargs": "+", "type": str},
    "jwt_role_mapping": {"nargs": "*", "type": str},
    "prometheus_port": {"type": int},
    "prometheus_host": {"type": str},
    "prometheus_duration_buckets": {"nargs": "+", "type": float},
    "request_id_headers": {"nargs": "*", "type": str},
    "rate_limit_tokens_per_second": {"type": int},
    "control_plane_api_keys": {"nargs": "*", "type": str},
}
_CHOICES: dict[str, Sequence[str]] = {
    "policy": ALL_POLICIES,
    "decode_policy": ALL_POLICIES,
    "prefill_policy": ALL_POLICIES + PREFILL_ONLY_POLICIES,
    "assignment_mode": ASSIGNMENT_MODES,
    "log_level": ("debug", "info", "warn", "error"),
    "backend": ("sglang", "openai"),
    "history_backend": ("memory", "none", "oracle", "postgres", "redis"),
}


def _field_default(f: Any) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory()


def _kind_of(value: Any) -> dict[str, Any]:
    """argparse kind of a field from its default: a flag, a list, or one typed value."""
    if isinstance(value, bool):
        return {"action": "store_true"}
    if isinstance(value, list):
        return {"nargs": "*", "type": str}
    return {"type": type(value) if isinstance(value, (int, float)) else str}


def _prefill_entry(entry: Any) -> tuple[str, int | None]:
    """``[URL]``, ``[URL, PORT|none]`` or ``(URL, port)`` -> ``(URL, port or None)``."""
    if isinstance(entry, str):
        return entry, None
    url = entry[0]
    port = entry[1] if len(entry) > 1 else None
    if port is None or (isinstance(port, str) and port.strip().lower() == "none"):
        return url, None
    try:
        return url, int(port)
    except (TypeError, ValueError):
        raise ValueError(f"--prefill {url}: bootstrap port {port!r} is neither a number nor 'none'") from None


def _selector(value: Any) -> Any:
    """A selector (or role mapping) as given: a dict stays one; ``["k=v", ...]`` (or one
    space-separated string) becomes a dict when every item is ``k=v``, else stays the list,
    so set-based forms (``k!=v``, ``k in (a,b)``) reach fastroute's parser unchanged."""
    if not value:
        return {}
    if isinstance(value, dict):
        return dict(value)
    items = list(value)
    if len(items) == 1 and " " in items[0]:
        items = items[0].split()
    pairs = [i.split("=", 1) for i in items]
    if all(len(p) == 2 and p[0] and not p[0].endswith("!") for p in pairs):
        return {k: v for k, v in pairs}
    return items


def _key_tuple(entry: Any, n: int) -> Any:
    """A control-plane key as sglang-router keeps it: ``(id, name, key, role)``, from the
    command line's ``id:name:role:key``. A malformed entry is left for fastroute's parser,
    whose message never contains the key."""
    if isinstance(entry, str):
        parts = entry.split(":", 3)
        if len(parts) == 4:
            key_id, name, role, key = parts
            return (key_id, name, key, role.lower())
    return entry


def _key_spec(entry: Any, n: int) -> str:
    """``(id, name, key, role)`` (sglang-router's tuple) -> fastroute's ``id:name:role:key``."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, (tuple, list)) and len(entry) == 4 and all(isinstance(x, str) for x in entry):
        key_id, name, key, role = entry
        return f"{key_id}:{name}:{role}:{key}"
    raise TypeError(
        f"control_plane_api_keys entry {n}: expected an (id, name, key, role) tuple "
        f"of strings, got a {type(entry).__name__}"
    )


def launch_router(args: RouterArgs | argparse.Namespace) -> None:
    """Run the router until it stops (SIGTERM/SIGINT drain it). Raises TypeError for an
    attribute that is not a field, SystemExit with the status the ``fastroute`` command would
    exit with when the arguments are refused."""
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
