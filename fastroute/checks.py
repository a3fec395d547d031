"""Value checks behind :class:`fastroute.config.Config`'s validation, and the error they raise.

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


class ConfigError(ValueError):
    """A start-up configuration error; `flag` names the option (or env var) at fault."""

    def __init__(self, flag: str, message: str) -> None:
        self.flag = flag
        self.message = message
        super().__init__(f"argument {flag}: {message}")


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
    scheme is given; only http and https, a valid host of at most 253 characters, a port in
    1..65535, no whitespace, control or non-ASCII character anywhere, and no link-local
    address unless ``allow_link_local`` (--allow-link-local-workers)."""
    if not isinstance(url, str):
        return "must be a string"
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
