"""The ``fastroute epp`` command line: its own flags, taken out before the router's parser runs,
and the refusals of what the endpoint picker does not do (yet).

``fastroute epp`` accepts the usual worker, policy, discovery and metrics flags of the router
(parsed by :mod:`fastroute.config.cli` into the same :class:`~fastroute.config.Config`) plus:

* ``--grpc-port G`` (required): the ext_proc and gRPC health listener, on ``--host``;
* ``--print-envoy-config``: print an Envoy bootstrap for this picker and exit, with
  ``--envoy-listen-port L`` (required then) and ``--envoy-admin-port A`` (optional);
* ``--inference-pool NAME`` [``--inference-pool-namespace NS``]: the workers are the endpoints
  of that InferencePool (:mod:`fastroute.epp.pool`; namespace default: the picker's own);
* ``--sidecar-port P`` (with ``--pd-disaggregation``): PD picks, relayed by the ``fastroute
  sidecar`` listening on P on each decode pod (:mod:`fastroute.epp.sidecar`);
* ``--silent-stream-timeout-secs S``: a picked stream silent for S seconds loses its lease;
* ``--max-grpc-streams N``: ext_proc streams served at once (more are refused, counted);
* ``--epp-mode grpc|http``: ext_proc over gRPC streams (default) or, for picks made on the
  headers, over Envoy's ``http_service`` (:mod:`fastroute.epp.httpmode`); picker and printer;
* ``--fallback-endpoints N``: name up to N next-best endpoints after the pick, for Envoy to
  retry on (:mod:`fastroute.epp.fallback`); given to both the picker and the printer;
* ``--grpc-tls-cert-path``/``--grpc-tls-key-path`` [``--grpc-tls-client-ca-path``]: TLS
  (mutual with the CA) on the gRPC listener; ``--envoy-grpc-ca-path`` [``--envoy-grpc-cert-path``
  ``--envoy-grpc-key-path``]: Envoy's side of it in the printed bootstrap.

Refused with one line naming the flag (never silently ignored): the gateway features of the
design that are not built here (Envoy failure-mode options), and router features that mean
nothing, or something unsafe, for a picker that relays no bytes (:func:`refusal`). Router
flags that do nothing here and cannot change who gets in, where requests go or readiness are
accepted with one warning each (:func:`inert_flags`). :data:`AUDIT` says, for every router flag, which of these it is.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fastroute.config import Config

__all__ = [
    "EppOptions",
    "GrpcTls",
    "EppError",
    "HELP",
    "split",
    "refusal",
    "option_warnings",
    "inert_flags",
    "flags_named",
]

# Flags of the gateway design that this picker does not implement: refused by name.
NOT_BUILT = {
    "--sidecar": "the PD sidecar of a decode pod is a command of its own: fastroute sidecar",
    "--failure-mode-allow": "give --failure-mode FailOpen or FailClose (the InferencePool's values)",
}
# The InferencePool's endpointPickerRef.failureMode values (--failure-mode).
FAIL_CLOSE, FAIL_OPEN = "FailClose", "FailOpen"
FAILURE_MODES = (FAIL_CLOSE, FAIL_OPEN)
# --silent-stream-timeout-secs default: a picked stream that says nothing for this long (no
# response headers, no end) loses its lease.
SILENT_TIMEOUT = 30.0
# --max-grpc-streams default: ext_proc streams (one per request in flight through Envoy) served
# at once.
MAX_STREAMS = 10000
MAX_FALLBACKS = 16  # --fallback-endpoints: at most this many (one Envoy retry each)
_PATH_FLAGS = {
    "--grpc-tls-cert-path",
    "--grpc-tls-key-path",
    "--grpc-tls-client-ca-path",
    "--envoy-grpc-ca-path",
    "--envoy-grpc-cert-path",
    "--envoy-grpc-key-path",
}
# One ext_proc message carries the whole buffered body plus the request's headers and metadata:
# the picker's gRPC receive limit is the body limit plus this much (Envoy's headers are at most
# 96 KiB; the rest is for the subset hint and the protobuf framing). A protobuf message (and
# grpc's receive limit) is at most 2 GiB - 1 bytes, which bounds --max-payload-size.
MESSAGE_HEADROOM = 1024 * 1024
BODY_LIMIT_MAX = 2**31 - 1 - MESSAGE_HEADROOM


# `fastroute epp --help`: the picker's own options, printed before the router flags it takes.
HELP = """usage: fastroute epp --grpc-port G [picker options] [router flags]

fastroute as the endpoint picker (EPP) of an Envoy-based gateway (Gateway API Inference
Extension): Envoy asks over ext_proc which endpoint each request goes to; the picker answers
with the router's placement (policies, DP ranks, KV fit, in-flight leases). docs/epp.md.

picker options:
  --grpc-port G                 the ext_proc gRPC listener (required)
  --print-envoy-config          print an Envoy bootstrap for this picker and exit
  --envoy-listen-port L         with --print-envoy-config: the listener clients call (required)
  --envoy-admin-port A          with --print-envoy-config: Envoy's admin listener
  --failure-mode M              FailClose (default: a request fails when the picker cannot
                                answer) or FailOpen (round robin over --worker-urls instead);
                                shapes the printed bootstrap
  --inference-pool NAME         take the endpoints from this InferencePool (Kubernetes)
  --inference-pool-namespace NS the pool's namespace (default: $POD_NAMESPACE, the pod's own)
  --sidecar-port P              PD through the decode pods' `fastroute sidecar` on port P
  --silent-stream-timeout-secs S
                                release the lease of a picked stream silent for S seconds
                                before its response begins (default 30; 0: off)
  --max-grpc-streams N          ext_proc streams served at once; more are refused with
                                RESOURCE_EXHAUSTED, logged and counted (default 10000)
  --epp-mode M                  grpc (default: ext_proc gRPC streams) or http (the picker
                                serves Envoy's ext_proc http_service on --grpc-port over
                                HTTP/1.1: picks on the headers only, a lease ends at the
                                response headers, in whichever process of --workers N
                                gets them; give it to the picker and to
                                --print-envoy-config)
  --fallback-endpoints N        name up to N next-best endpoints after the picked one (the
                                protocol's fallback list); the printed Envoy retries a refused
                                connection on them in order (default 0: the pick alone; give
                                it to the picker and to --print-envoy-config; needs
                                --worker-urls, not with --sidecar-port)
  --grpc-tls-cert-path PATH     serve the gRPC listener over TLS with this certificate (PEM)
  --grpc-tls-key-path PATH      and this private key (PEM); both or neither
  --grpc-tls-client-ca-path PATH
                                mutual TLS: only clients with a certificate signed by this CA
  --envoy-grpc-ca-path PATH     with --print-envoy-config: Envoy reaches the picker over TLS and
                                trusts this CA for the picker's certificate
  --envoy-grpc-cert-path PATH   with --print-envoy-config: the client certificate Envoy
  --envoy-grpc-key-path PATH    presents to the picker (and its key), for mutual TLS

router flags (as for the proxy; docs/epp.md says what each does under epp):
"""


class EppError(Exception):
    """A refused ``fastroute epp`` command line (the message names the flag)."""


@dataclass(frozen=True)
class EppOptions:
    grpc_port: int
    print_config: bool = False
    listen_port: int | None = None
    admin_port: int | None = None
    pool: str | None = None  # --inference-pool NAME
    pool_namespace: str | None = None  # --inference-pool-namespace NS
    sidecar_port: int | None = None  # --sidecar-port P: PD through the decode pods' sidecar
    failure_mode: str = FAIL_CLOSE  # --failure-mode: what the printed Envoy does when the picker fails
    silent_timeout: float = SILENT_TIMEOUT  # --silent-stream-timeout-secs (0: off)
    max_streams: int = MAX_STREAMS  # --max-grpc-streams
    tls: GrpcTls | None = None  # --grpc-tls-*: the gRPC listener's TLS
    envoy_tls: GrpcTls | None = None  # --envoy-grpc-*: Envoy's side of it, in the printed bootstrap
    fallbacks: int = 0  # --fallback-endpoints N: next-best endpoints named after the pick
    mode: str = "grpc"  # --epp-mode: grpc or http


@dataclass(frozen=True)
class GrpcTls:
    """TLS of the picker's gRPC listener, one side of it: the picker's (``cert``/``key`` its
    certificate, ``ca`` the CA of the client certificates it requires) or, in the printed
    bootstrap, Envoy's (``ca`` the CA it trusts for the picker, ``cert``/``key`` the client
    certificate it presents). Paths of PEM files."""

    cert: str | None = None
    key: str | None = None
    ca: str | None = None


# A Kubernetes object name or namespace (DNS subdomain / label).
_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?\Z")


def _port(flag: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise EppError(f"argument {flag}: {text!r} is not a port number") from None
    if not 0 < value < 65536:
        raise EppError(f"argument {flag}: {value} is not a port number (1-65535)")
    return value


def _value(
    args: list[str], i: int, name: str, eq: str, inline: str, what: str, dash_ends: bool = False
) -> tuple[str, int]:
    """The value of option ``args[i]`` (``--x=v`` or ``--x v``) and the index of its last token;
    ``dash_ends``: a following ``--flag`` is not taken as the value."""
    if eq:
        return inline, i
    if i + 1 < len(args) and not (dash_ends and args[i + 1].startswith("--")):
        return args[i + 1], i + 1
    raise EppError(f"argument {name}: expected {what}")


def split(argv: Sequence[str]) -> tuple[EppOptions, list[str]]:
    """(the picker's own options, the router flags left for :mod:`fastroute.config.cli`)."""
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
        if name in ("--grpc-port", "--envoy-listen-port", "--envoy-admin-port", "--sidecar-port"):
            value, i = _value(args, i, name, eq, inline, "one port number")
            found[name] = _port(name, value)
        elif name in ("--inference-pool", "--inference-pool-namespace"):
            value, i = _value(args, i, name, eq, inline, "one name", dash_ends=True)
            if not _NAME.match(value):
                raise EppError(f"argument {name}: {value!r} is not a Kubernetes object name")
            found[name] = value
        elif name == "--failure-mode":
            value, i = _value(args, i, name, eq, inline, "FailClose or FailOpen")
            if value not in FAILURE_MODES:
                raise EppError(f"argument --failure-mode: {value!r} is not FailClose or FailOpen")
            found[name] = value
        elif name == "--epp-mode":
            value, i = _value(args, i, name, eq, inline, "grpc or http")
            if value not in ("grpc", "http"):
                raise EppError(f"argument --epp-mode: {value!r} is not grpc or http")
            found[name] = value
        elif name in _PATH_FLAGS:
            value, i = _value(args, i, name, eq, inline, "one file path", dash_ends=True)
            if not value:
                raise EppError(f"argument {name}: expected one file path")
            found[name] = value
        elif name in ("--max-grpc-streams", "--fallback-endpoints"):
            value, i = _value(args, i, name, eq, inline, "a number")
            try:
                n = int(value)
            except ValueError:
                raise EppError(f"argument {name}: {value!r} is not a whole number") from None
            low, high = (1, None) if name == "--max-grpc-streams" else (0, MAX_FALLBACKS)
            if n < low or (high is not None and n > high):
                raise EppError(f"argument {name}: {n} must be from {low}" + (f" to {high}" if high else " up"))
            found[name] = n
        elif name == "--silent-stream-timeout-secs":
            value, i = _value(args, i, name, eq, inline, "a number of seconds")
            try:
                secs = float(value)
            except ValueError:
                raise EppError(f"argument {name}: {value!r} is not a number of seconds") from None
            if not 0 <= secs < float("inf"):
                raise EppError(f"argument {name}: {value} must be 0 (off) or a positive number of seconds")
            found[name] = secs
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
        for flag in ("--envoy-listen-port", "--envoy-admin-port", *sorted(f for f in _PATH_FLAGS if "envoy" in f)):
            if flag in found:
                raise EppError(f"argument {flag}: only means something with --print-envoy-config")
    tls = _tls_pair(found, "--grpc-tls-cert-path", "--grpc-tls-key-path", "--grpc-tls-client-ca-path")
    envoy_tls = _tls_pair(found, "--envoy-grpc-cert-path", "--envoy-grpc-key-path", "--envoy-grpc-ca-path")
    if tls is not None and tls.cert is None:
        raise EppError("argument --grpc-tls-client-ca-path: needs --grpc-tls-cert-path and --grpc-tls-key-path")
    if envoy_tls is not None and envoy_tls.ca is None:
        raise EppError(
            "argument --envoy-grpc-cert-path: needs --envoy-grpc-ca-path (Envoy speaks TLS to the "
            "picker only when it can check the picker's certificate)"
        )
    if printing and tls is not None:
        # The same command line prints the bootstrap: Envoy must be able to reach this listener.
        if envoy_tls is None:
            raise EppError(
                "argument --grpc-tls-cert-path: the picker serves TLS; give --envoy-grpc-ca-path "
                "(the CA of its certificate) so that the printed Envoy speaks TLS to it"
            )
        if tls.ca is not None and envoy_tls.cert is None:
            raise EppError(
                "argument --grpc-tls-client-ca-path: the picker asks for a client certificate; "
                "give --envoy-grpc-cert-path and --envoy-grpc-key-path for Envoy to present"
            )
    if found.get("--epp-mode") == "http" and (tls is not None or envoy_tls is not None):
        raise EppError("argument --epp-mode: http is not built with the --grpc-tls-*/--envoy-grpc-* flags")
    if "--inference-pool-namespace" in found and "--inference-pool" not in found:
        raise EppError("argument --inference-pool-namespace: only means something with --inference-pool")
    return EppOptions(
        found["--grpc-port"],
        printing,
        found.get("--envoy-listen-port"),
        found.get("--envoy-admin-port"),
        found.get("--inference-pool"),
        found.get("--inference-pool-namespace"),
        found.get("--sidecar-port"),
        found.get("--failure-mode", FAIL_CLOSE),
        found.get("--silent-stream-timeout-secs", SILENT_TIMEOUT),
        found.get("--max-grpc-streams", MAX_STREAMS),
        tls,
        envoy_tls,
        found.get("--fallback-endpoints", 0),
        found.get("--epp-mode", "grpc"),
    ), rest


def _tls_pair(found: dict[str, Any], cert: str, key: str, ca: str) -> GrpcTls | None:
    """The certificate, key and CA given under these three flags (None: none of them); a
    certificate needs its key and a key its certificate."""
    if cert in found and key not in found:
        raise EppError(f"argument {cert}: needs {key}")
    if key in found and cert not in found:
        raise EppError(f"argument {key}: needs {cert}")
    if not any(f in found for f in (cert, key, ca)):
        return None
    return GrpcTls(found.get(cert), found.get(key), found.get(ca))


def option_warnings(opts: EppOptions, argv: Sequence[str]) -> list[str]:
    """One line per picker option given that does nothing in this run: --failure-mode shapes the
    printed bootstrap only, so a running picker accepts it with one warning; the running
    picker's own bounds mean nothing to the printed bootstrap, which says so."""
    named = flags_named(argv)
    if not opts.print_config:
        if "--failure-mode" in named:
            return [
                "--failure-mode is accepted and ignored by the running picker (it shapes the Envoy "
                "bootstrap: give it to --print-envoy-config)"
            ]
        return []
    return [
        f"{flag} is accepted and ignored by --print-envoy-config (it bounds the running picker; "
        "the bootstrap does not depend on it)"
        for flag in ("--silent-stream-timeout-secs", "--max-grpc-streams")
        if flag in named
    ]


_TOKENIZER_FLAGS = (  # the settings before the flags they go with, so a refusal names the setting
    ("chat_template", "--chat-template"),
    ("tokenize_timeout_ms", "--tokenize-timeout-ms"),
    ("tokenizer_cache_l0_max_entries", "--tokenizer-cache-l0-max-entries"),
    ("tokenizer_cache_l0_max_memory", "--tokenizer-cache-l0-max-memory"),
    ("tokenizer_cache_l1_max_memory", "--tokenizer-cache-l1-max-memory"),
    ("tokenizer_cache_enable_l0", "--tokenizer-cache-enable-l0"),
    ("tokenizer_cache_enable_l1", "--tokenizer-cache-enable-l1"),
    ("model_path", "--model-path"),
    ("tokenizer_path", "--tokenizer-path"),
)


# Flow control's settings (dataplane/flowcontrol.py): refused under the picker when set.
FLOW_FLAGS = (
    ("priority_scheduler_enabled", "--priority-scheduler-enabled"),
    ("priority_scheduler_default_max_class", "--priority-scheduler-default-max-class"),
    ("priority_scheduler_config", "--priority-scheduler-config"),
    ("priority_scheduler_tenant_metric_top_n", "--priority-scheduler-tenant-metric-top-n"),
    ("tenant_rate_limit_enabled", "--tenant-rate-limit-enabled"),
    ("tenant_rate_limit_config", "--tenant-rate-limit-config"),
    ("tenant_api_key", "--tenant-api-key"),
    ("trust_tenant_header", "--trust-tenant-header"),
    ("tenant_header_name", "--tenant-header-name"),
    ("worker_overload_shed", "--worker-overload-shed"),
    ("worker_overload_waiting_requests", "--worker-overload-waiting-requests"),
    ("worker_overload_token_usage", "--worker-overload-token-usage"),
    ("prefill_overload_uncached_tokens", "--prefill-overload-uncached-tokens"),
    ("flow_max_queued", "--flow-max-queued"),
)
_DEFAULTS = Config()


def refusal(
    config: Any,
    processes: int,
    pool: str | None = None,
    sidecar_port: int | None = None,
    failure_mode: str = FAIL_CLOSE,
    fallbacks: int = 0,
    http_mode: str | None = None,
) -> str | None:
    """Why this router configuration cannot run as an endpoint picker, or None (``pool``: the
    --inference-pool given; ``sidecar_port``: the --sidecar-port given; ``failure_mode``: the
    --failure-mode given; ``fallbacks``: the --fallback-endpoints given; ``http_mode``: with
    --epp-mode http, why a pick would need the body, or "" when it needs none)."""
    if http_mode:
        return f"argument --epp-mode: http serves picks made on the request headers; {http_mode} (use --epp-mode grpc)"
    if http_mode is not None and fallbacks > 0:
        return "argument --epp-mode: http is not built with --fallback-endpoints (use --epp-mode grpc)"
    if fallbacks > 0:
        if sidecar_port is not None or config.pd_disaggregation:
            return (
                "argument --fallback-endpoints: not built for PD (the pick names a decode pod's "
                "sidecar and the pair it relays; another endpoint would not match it)"
            )
        if pool is not None or config.discovery is not None or not config.worker_urls:
            return (
                "argument --fallback-endpoints: needs --worker-urls (the printed Envoy's cluster "
                "lists the endpoints it may retry on; discovered ones are not known at print time)"
            )
    if failure_mode == FAIL_OPEN:
        if config.pd_disaggregation:
            return (
                "argument --failure-mode: FailOpen is not built for PD (a request that bypassed "
                "the picker would reach a decode worker with no prefill); use FailClose"
            )
        if pool is not None or config.discovery is not None or not config.worker_urls:
            return (
                "argument --failure-mode: FailOpen needs --worker-urls (the printed Envoy's "
                "fallback cluster lists them; discovered endpoints are not known at print time)"
            )
    if pool is not None and config.discovery is not None:
        return (
            "argument --inference-pool: the pool's selector picks the worker pods; give it "
            "instead of --service-discovery / --discovery-provider, not with them"
        )
    if config.pd_disaggregation and sidecar_port is None:
        return (
            "argument --pd-disaggregation: needs --sidecar-port, the port of the "
            "`fastroute sidecar` on each decode pod, which relays the two legs"
        )
    if sidecar_port is not None and not config.pd_disaggregation:
        return "argument --sidecar-port: only means something with --pd-disaggregation"
    if config.pd_disaggregation and config.prefill_input_demand != "off":
        return (
            "argument --prefill-input-demand: not supported by fastroute epp (the picker "
            "never sees the prefill answer that gives the tokens back)"
        )
    if config.speed_aware != "off":
        return (
            "argument --speed-aware: not supported by fastroute epp (the picker never sees "
            "the streamed tokens whose gaps measure each server's speed)"
        )
    for field, flag in FLOW_FLAGS:
        if getattr(config, field) != getattr(_DEFAULTS, field):
            return (
                f"argument {flag}: not supported by fastroute epp (flow control runs in the proxy: "
                "the picker places requests but does not queue, rate or shed them)"
            )
    if config.pd_disaggregation and pool is not None:
        return (
            "argument --inference-pool: an InferencePool has one role of pods; PD through "
            "the gateway takes --prefill/--decode or --service-discovery selectors"
        )
    if processes > 1 and (pool is not None or sidecar_port is not None):
        return (
            "argument --workers: several picker processes are not built with "
            + ("--inference-pool" if pool is not None else "--sidecar-port")
            + " (give --workers 1)"
        )
    if int(config.max_payload_size) > BODY_LIMIT_MAX:
        return (
            f"argument --max-payload-size: at most {BODY_LIMIT_MAX} bytes under fastroute epp "
            "(Envoy sends the buffered body to the picker in one gRPC message)"
        )
    for url in config.worker_urls:
        if url.strip().lower().startswith("https://"):
            return (
                f"argument --worker-urls: {url} is https://; the printed Envoy cluster "
                "connects to workers in plain HTTP, TLS to workers is not built for the EPP"
            )
    if config.enable_igw:
        return "argument --enable-igw: not supported by fastroute epp (model-keyed groups)"
    defaults = type(config)()
    for field, flag in _TOKENIZER_FLAGS:
        if getattr(config, field) != getattr(defaults, field):
            return f"argument {flag}: not supported by fastroute epp yet (the picker does not tokenize prompts)"
    # The client side belongs to Envoy: the picker cannot serve HTTPS or answer CORS, and
    # accepting them would leave clients on plain HTTP or browsers' origins unchecked.
    for field, flag in (("tls_cert_path", "--tls-cert-path"), ("tls_key_path", "--tls-key-path")):
        if getattr(config, field) is not None:
            return (
                f"argument {flag}: not supported by fastroute epp (TLS to clients is the "
                "gateway's: configure it on the Envoy listener)"
            )
    if config.tls_min_version != type(config)().tls_min_version:
        return (
            "argument --tls-min-version: not supported by fastroute epp (TLS to clients is "
            "the gateway's: configure it on the Envoy listener)"
        )
    if config.cors_allowed_origins:
        return (
            "argument --cors-allowed-origins: not supported by fastroute epp (the picker "
            "never sees the responses; configure Envoy's CORS filter instead)"
        )
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


# Router flags accepted under fastroute epp that act on nothing the picker does and cannot change
# who gets in, where requests go or readiness: one warning each when given. (field, flag, why);
# field None: judged by the flag's presence on the command line alone.
INERT_FLAGS = (
    ("port", "--port", "the picker listens on --grpc-port; clients call Envoy's listener (--envoy-listen-port)"),
    (
        "control_plane_api_keys",
        "--control-plane-api-keys",
        "the picker serves no worker-management routes (also $CONTROL_PLANE_API_KEYS)",
    ),
    ("control_plane_audit_enabled", "--control-plane-audit-enabled", "the picker serves no worker-management routes"),
    ("allow_open_admin", "--allow-open-admin", "the picker serves no worker-management routes"),
    ("ca_cert_paths", "--ca-cert-paths", "only used for https:// workers, which fastroute epp refuses"),
    ("client_cert_path", "--client-cert-path", "only used for https:// workers, which fastroute epp refuses"),
    ("client_key_path", "--client-key-path", "only used for https:// workers, which fastroute epp refuses"),
    (
        "prometheus_duration_buckets",
        "--prometheus-duration-buckets",
        "the picker measures no request durations (Envoy relays the requests)",
    ),
    (
        "request_id_headers",
        "--request-id-headers",
        "the picker does not rewrite x-request-id; Envoy forwards the client's headers and makes its own x-request-id",
    ),
    ("sse_keepalive_secs", "--sse-keepalive-secs", "the picker relays no stream, so it sends no keep-alive comments"),
    ("enable_trace", "--enable-trace", "the picker relays no request; Envoy's own tracing covers the path"),
    ("otlp_traces_endpoint", "--otlp-traces-endpoint", "only used with --enable-trace, which the picker does not do"),
    (
        "bootstrap_port_annotation",
        "--bootstrap-port-annotation",
        "only used for PD prefill pods, and fastroute epp refuses PD mode",
    ),
    (None, "--prefill-policy", "only used in PD mode, which fastroute epp refuses"),
    (None, "--decode-policy", "only used in PD mode, which fastroute epp refuses"),
    (
        "pd_max_batch_size",
        "--pd-max-batch-size",
        "the picker does not read PD batches; the PD relay of fastroute sidecar enforces it (give it there)",
    ),
    (
        None,
        "--dp-rank-field",
        "with --pd-disaggregation the ranks travel in the pair the picker "
        "names; the rank field is the fastroute sidecar's",
    ),
)
# PD-only flags: they work (or are the sidecar's) once --pd-disaggregation is given.
_PD_ONLY = frozenset({"--prefill-policy", "--decode-policy", "--bootstrap-port-annotation"})


def flags_named(argv: Sequence[str]) -> set[str]:
    """The flags given on a router command line, by their canonical name (no --router-)."""
    out = set()
    for token in argv:
        if token == "--":
            break
        if token.startswith("--"):
            name = token.partition("=")[0]
            if name.startswith("--router-"):
                name = "--" + name[len("--router-") :]
            out.add(name)
    return out


def inert_flags(config: Any, argv: Sequence[str]) -> list[str]:
    """One warning line per router flag given that does nothing under fastroute epp (given: on
    the command line, or a value other than the default, e.g. from the environment)."""
    defaults = type(config)()
    named = flags_named(argv)
    out = []
    for field, flag, why in INERT_FLAGS:
        given = flag in named or (field is not None and getattr(config, field) != getattr(defaults, field))
        if given and flag == "--bootstrap-port-annotation" and config.discovery is None:
            given = False  # the router's own warning says it (discovery sub-flag)
        if flag in _PD_ONLY and config.pd_disaggregation:
            given = False  # PD through the sidecar: they act
        if flag == "--dp-rank-field" and not config.pd_disaggregation:
            given = False  # regular mode: the picker splices the rank with it
        if given:
            out.append(f"{flag} is accepted and ignored by fastroute epp ({why})")
    return out
