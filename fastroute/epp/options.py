"""The ``fastroute epp`` command line: its own flags, taken out before the router's parser runs,
and the refusals of what the endpoint picker does not do (yet).

``fastroute epp`` accepts the usual worker, policy, discovery and metrics flags of the router
(parsed by :mod:`fastroute.cli` into the same :class:`~fastroute.config.Config`) plus:

* ``--grpc-port G`` (required): the ext_proc and gRPC health listener, on ``--host``;
* ``--print-envoy-config``: print an Envoy bootstrap for this picker and exit, with
  ``--envoy-listen-port L`` (required then) and ``--envoy-admin-port A`` (optional).

Refused with one line naming the flag (never silently ignored): the gateway features of the
design that are not built here (PD picks and the decode-pod sidecar, InferencePool discovery,
Envoy failure-mode options), and router features that mean nothing, or something unsafe, for a
picker that relays no bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["EppOptions", "EppError", "split", "refusal"]

# Flags of the gateway design that this picker does not implement: refused by name.
NOT_BUILT = {
    "--sidecar": "the PD sidecar mode of the decode pod is not built",
    "--inference-pool": "InferencePool discovery is not built; give --worker-urls or --service-discovery",
    "--inference-pool-namespace": "InferencePool discovery is not built",
    "--inference-pool-name": "InferencePool discovery is not built",
    "--failure-mode": "failure-mode options are not built: Envoy's ext_proc filter fails closed "
    "(failure_mode_allow: false in the printed bootstrap)",
    "--failure-mode-allow": "failure-mode options are not built: Envoy's ext_proc filter fails closed",
    "--subset-hint": "the endpoint subset hint is not built",
}


class EppError(Exception):
    """A refused ``fastroute epp`` command line (the message names the flag)."""


@dataclass(frozen=True)
class EppOptions:
    grpc_port: int
    print_config: bool = False
    listen_port: int | None = None
    admin_port: int | None = None


def _port(flag: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise EppError(f"argument {flag}: {text!r} is not a port number") from None
    if not 0 < value < 65536:
        raise EppError(f"argument {flag}: {value} is not a port number (1-65535)")
    return value


def split(argv: Sequence[str]) -> tuple[EppOptions, list[str]]:
    """(the picker's own options, the router flags left for :mod:`fastroute.cli`)."""
    rest: list[str] = []
    found: dict[str, Any] = {}
    args = list(argv)
    i = 0
    while i < len(args):
        token = args[i]
        name, eq, inline = token.partition("=")
        if token == "--":
            rest.extend(args[i:])
            break
        if name in NOT_BUILT:
            raise EppError(f"argument {name}: not supported by fastroute epp ({NOT_BUILT[name]})")
        if name in ("--grpc-port", "--envoy-listen-port", "--envoy-admin-port"):
            if eq:
                value = inline
            elif i + 1 < len(args):
                i += 1
                value = args[i]
            else:
                raise EppError(f"argument {name}: expected one port number")
            found[name] = _port(name, value)
        elif name == "--print-envoy-config":
            if eq:
                raise EppError("argument --print-envoy-config: takes no value")
            found[name] = True
        else:
            rest.append(token)
        i += 1
    if "--grpc-port" not in found:
        raise EppError("argument --grpc-port: required (the ext_proc listener of the picker)")
    printing = bool(found.get("--print-envoy-config"))
    if printing and "--envoy-listen-port" not in found:
        raise EppError("argument --envoy-listen-port: required with --print-envoy-config")
    if not printing:
        for flag in ("--envoy-listen-port", "--envoy-admin-port"):
            if flag in found:
                raise EppError(f"argument {flag}: only means something with --print-envoy-config")
    return EppOptions(
        found["--grpc-port"], printing, found.get("--envoy-listen-port"), found.get("--envoy-admin-port")
    ), rest


def refusal(config: Any, processes: int) -> str | None:
    """Why this router configuration cannot run as an endpoint picker, or None."""
    if config.pd_disaggregation:
        return (
            "argument --pd-disaggregation: not supported by fastroute epp (PD picks through "
            "the gateway and the decode-pod sidecar are not built)"
        )
    if config.replica_sync is not None:
        return (
            "argument --replica-sync: not supported by fastroute epp (EPP replicas sharing "
            "in-flight state is not built); run one picker"
        )
    if processes > 1:
        return "argument --workers: fastroute epp runs as one process (give --workers 1)"
    for url in config.worker_urls:
        if url.strip().lower().startswith("https://"):
            return (
                f"argument --worker-urls: {url} is https://; the printed Envoy cluster "
                "connects to workers in plain HTTP, TLS to workers is not built for the EPP"
            )
    if config.enable_igw:
        return "argument --enable-igw: not supported by fastroute epp (model-keyed groups)"
    # Retries and circuit breakers act on upstream outcomes, which a picker never sees (Envoy
    # relays the bytes): tuning them here would be accepted and do nothing.
    defaults = type(config)()
    for field, flag in _UPSTREAM_OUTCOME_FLAGS:
        if getattr(config, field) != getattr(defaults, field):
            return (
                f"argument {flag}: not supported by fastroute epp (the picker sees no upstream "
                "response, so it cannot retry or open a circuit; configure Envoy's retry "
                "and outlier detection instead)"
            )
    return None


# Config fields that only act on upstream outcomes, and the flag that sets each.
_UPSTREAM_OUTCOME_FLAGS = (
    ("retry_max_retries", "--retry-max-retries"),
    ("retry_initial_backoff_ms", "--retry-initial-backoff-ms"),
    ("retry_max_backoff_ms", "--retry-max-backoff-ms"),
    ("retry_backoff_multiplier", "--retry-backoff-multiplier"),
    ("retry_jitter_factor", "--retry-jitter-factor"),
    ("cb_failure_threshold", "--cb-failure-threshold"),
    ("cb_success_threshold", "--cb-success-threshold"),
    ("cb_timeout_duration_secs", "--cb-timeout-duration-secs"),
)
