"""The --otlp-traces-endpoint rule (smg's forms), with no OpenTelemetry import: the start-up
checks apply it before anything of tracing is loaded (fastroute/dataplane/tracing.py exports)."""

from __future__ import annotations

import importlib.util
from urllib.parse import urlsplit

FLAG = "--otlp-traces-endpoint"
# What --enable-trace needs installed (the 'trace' extra).
EXPORTER_MODULE = "opentelemetry.exporter.otlp.proto.grpc"


def exporter_missing() -> bool:
    """Whether the OpenTelemetry SDK or its OTLP/gRPC exporter is not installed."""
    try:
        return (
            importlib.util.find_spec(EXPORTER_MODULE) is None or importlib.util.find_spec("opentelemetry.sdk") is None
        )
    except ModuleNotFoundError:
        return True


def endpoint_problem(value: str) -> str | None:
    """What is wrong with an --otlp-traces-endpoint value (None: usable): smg's forms,
    ``host:port`` or ``http(s)://host:port`` (an IPv6 literal in brackets)."""
    v = value.strip()
    if not v:
        return "must not be empty"
    parts = urlsplit(v if "://" in v else "http://" + v)
    if parts.scheme not in ("http", "https"):
        return f"{value!r}: the scheme must be http or https"
    try:
        port = parts.port
    except ValueError:
        return f"{value!r}: the port is not a number from 0 to 65535"
    if not parts.hostname or port is None:
        return f"{value!r}: expected <host>:<port> or http(s)://<host>:<port>, e.g. 127.0.0.1:4317"
    if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username is not None:
        return f"{value!r}: only a host and a port (no path, query or credentials)"
    return None
