"""Value checks behind :class:`fastroute.config.Config`'s validation, and the error they raise.

Each check names the flag at fault, so a bad command line fails with one line that says which
option to fix.
"""
from __future__ import annotations

import math
from urllib.parse import urlsplit


class ConfigError(ValueError):
    """A start-up configuration error; `flag` names the option (or env var) at fault."""

    def __init__(self, flag: str, message: str) -> None:
        self.flag = flag
        self.message = message
        super().__init__(f"argument {flag}: {message}")



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
    if (parts is None or parts.scheme not in ("http", "https") or not parts.hostname
            or parts.path or parts.query or parts.fragment or parts.username):
        raise ConfigError("--cors-allowed-origins",
                          f"{origin!r} is not '*' or an origin like https://host[:port]")


def _check_header(flag: str, name: str) -> None:
    if not name or any(c in name for c in " \t\r\n:"):
        raise ConfigError(flag, f"{name!r} is not a valid header name")


def _at_least(flag: str, value: int, lo: int) -> None:
    if value < lo:
        raise ConfigError(flag, f"must be >= {lo} (got {value})")


def _finite_at_least(flag: str, value: float, lo: float) -> None:
    if not math.isfinite(value) or value < lo:
        raise ConfigError(flag, f"must be a finite number >= {lo} (got {value})")
