"""What a router says and refuses at start-up: the one-line errors that stop it (a port in use, a
TLS file that cannot be used), the start-up banner and the security posture warning.

Shared by the single-process server, the ``--workers N`` supervisor and its proxy processes, so
all three fail and speak the same way. The CLI prints a :class:`StartupError` as one line and
exits with status 1 (no traceback).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import ssl
from collections.abc import Callable
from typing import Any

from fastroute import __version__
from fastroute.config import Config
from fastroute.config.checks import reachable_host
from fastroute.core.table import SHM_DIR, TableMemoryError, TargetTable, shm_available, table_bytes
from fastroute.runtime.probe import ProbeServer
from fastroute.tls import TLSConfigError, server_context

log = logging.getLogger("fastroute.server")


class StartupError(RuntimeError):
    """The router cannot start; the message is one line that names the flag at fault."""


def bind_error(flag: str, host: str, port: int, exc: OSError) -> StartupError:
    """The one line for a listener that cannot bind (the usual case: the port is taken)."""
    if exc.errno == errno.EADDRINUSE:
        return StartupError(
            f"port {port} is already in use ({flag}, host {host}): another "
            "process listens there; stop it or choose another port"
        )
    if exc.errno == errno.EADDRNOTAVAIL:
        return StartupError(f"cannot listen on {host}:{port} ({flag}): the address is not one of this machine's")
    return StartupError(f"cannot listen on {host}:{port} ({flag}): {exc.strerror or exc}")


def new_table(config: Config, copies: int = 1) -> TargetTable:
    """The shared target table of --max-targets rows, after checking that ``copies`` tables of
    that size (the table and, under --workers N, one ledger per proxy process) fit in the
    shared memory free now: a tmpfs segment is not backed until written, so a table that does
    not fit would otherwise kill the router with SIGBUS on first use, not refuse to start."""
    n = int(config.max_targets)
    need = copies * table_bytes(n)
    free = shm_available()
    mib = 1 << 20
    if free is not None and need > free:
        raise StartupError(
            f"--max-targets {n} needs {need / mib:.1f} MiB of shared memory ({copies} table(s) of "
            f"{table_bytes(n)} bytes) but {SHM_DIR} has {free / mib:.1f} MiB free: lower --max-targets "
            f"or enlarge {SHM_DIR}"
        )
    try:
        return TargetTable(capacity=n)
    except TableMemoryError as exc:
        raise StartupError(f"--max-targets {n}: {exc}") from None


def tls_context(config: Config) -> ssl.SSLContext | None:
    """The listener's TLS context (None: plain HTTP); a file that cannot be used stops the start."""
    try:
        return server_context(config.tls_cert_path, config.tls_key_path, config.tls_min_version)
    except TLSConfigError as exc:
        raise StartupError(str(exc)) from None


def start_probe(config: Config, ready: Callable[[], bool]) -> ProbeServer | None:
    """The ``--health-check-port`` listener, bound and serving (None without the flag)."""
    if config.health_check_port is None:
        return None
    probe = ProbeServer(config.host, int(config.health_check_port), ready)
    try:
        probe.bind()
    except OSError as exc:
        raise bind_error("--health-check-port", config.host, int(config.health_check_port), exc) from None
    probe.start()
    return probe


# Signals that drain the router like SIGTERM: the default action of each would kill it at
# once, cutting the requests in flight and leaving its shared table behind (a terminal's
# hangup, a SIGQUIT from a supervisor's stop script). SIGUSR1/2 are logged and ignored.
DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
IGNORED_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2)


def stop_on_signals(loop: asyncio.AbstractEventLoop, stop: Callable[[], None]) -> None:
    """Call ``stop`` on any of DRAIN_SIGNALS; log IGNORED_SIGNALS (main thread only)."""

    def drain(sig: signal.Signals) -> None:
        log.info("%s received: draining", sig.name)
        stop()

    def ignore(sig: signal.Signals) -> None:
        log.info("%s received: ignored (SIGTERM, SIGINT, SIGHUP or SIGQUIT drain the router)", sig.name)

    for sig in DRAIN_SIGNALS + IGNORED_SIGNALS:
        try:
            loop.add_signal_handler(sig, drain if sig in DRAIN_SIGNALS else ignore, sig)
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
            pass


def own_listeners(registry: Any, config: Config, port: int, metrics: Any, probe: Any) -> None:
    """Tell the registry which addresses are the router's own (bound ports), so a worker URL
    naming one is refused (fastroute.control.selfaddr)."""
    registry.own.add(config.host, port, f"--port {port}")
    if metrics is not None and getattr(metrics, "port", None):
        registry.own.add(config.prometheus_host, metrics.port, f"--prometheus-port {metrics.port}")
    if probe is not None:
        registry.own.add(config.host, probe.port, f"--health-check-port {probe.port}")


def _url(scheme: str, host: str, port: int) -> str:
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


def banner(config: Config, port: int, processes: int) -> str:
    """One block saying what runs: version, URLs, mode, per-leg policy, modes, processes."""
    scheme = "https" if config.tls_cert_path else "http"
    lines = [
        f"fastroute {__version__} listening on {_url(scheme, config.host, port)}"
        + (f" ({processes} proxy processes)" if processes > 1 else "")
    ]
    legs: tuple[tuple[str, str | None], ...]
    if config.pd_disaggregation:
        legs = (("prefill", config.prefill_policy), ("decode", config.decode_policy))
        lines.append("  mode: PD disaggregation")
    else:
        legs = (("regular", config.policy),)
        lines.append("  mode: regular")
    for leg, policy in legs:
        text = f"  {leg} policy: {policy}"
        if policy == "power_of_two":
            text += f", load metric {config.p2c_load_metric} (from {config.load_metric_source})"
        lines.append(text)
    if config.pd_disaggregation or config.decode_input_demand != "off":
        lines.append(f"  decode input demand: {config.decode_input_demand}, W={config.decode_request_weight}")
        lines.append(f"  decode KV fit: {config.decode_kv_fit}, reserve {config.decode_kv_reserve_tokens} tokens")
    if config.pd_disaggregation:
        lines.append(f"  prefill input demand: {config.prefill_input_demand}")
    lines.append(
        f"  dp-aware: {'on' if config.dp_aware else 'off'}"
        + (f", rank field {config.dp_rank_field}" if config.dp_rank_field else "")
    )
    extras = []
    if config.health_check_port is not None:
        extras.append(f"probes on {_url('http', config.host, config.health_check_port)}")
    extras.append(f"metrics on {_url('http', config.prometheus_host, config.prometheus_port)}/metrics")
    lines.append("  " + ", ".join(extras))
    return "\n".join(lines)


_reachable = reachable_host


def posture_warnings(config: Config) -> list[str]:
    """Who can do what without a credential, when others can reach the port: warned at start-up,
    because a listener on a public address with no keys is open to anyone who finds it."""
    out = []
    if not config.api_key and not config.control_plane_api_keys and _reachable(config.host):
        out.append(
            f"the worker admin API on {config.host}:{config.port} is unauthenticated: anyone "
            "who reaches the port can register a worker and receive users' prompts, or "
            "remove workers (give --api-key or --control-plane-api-keys)"
        )
    if _reachable(config.prometheus_host):
        out.append(
            f"/metrics on {config.prometheus_host}:{config.prometheus_port} is "
            "unauthenticated: anyone who reaches the port can read worker URLs and traffic "
            "figures (use --prometheus-host 127.0.0.1 or a firewall)"
        )
    return out


def announce(config: Config, port: int, processes: int) -> None:
    """Log the banner (INFO, one block) and the posture warnings (WARNING, one line each)."""
    log.info("%s", banner(config, port, processes))
    for line in posture_warnings(config):
        log.warning("%s", line)
