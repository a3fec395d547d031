"""The worker model: one SGLang server as the router knows it, and the URL helpers that give one
server one spelling.

Pure data and pure functions (no I/O, no table), shared by the registry that owns the workers,
the admin API that shows them and the follower registry that mirrors them.
"""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any, Mapping
from urllib.parse import urlsplit

ROLES = ("regular", "prefill", "decode")


@dataclass(eq=False)
class Worker:
    """One SGLang server known to the router (identity is by object, not by value)."""

    url: str
    role: str
    id: str = field(default_factory=lambda: str(uuid.uuid4()))
    host: str = ""              # hostname of the URL verbatim (IPv6 bracketed): bootstrap_host
    port: int = 0
    bootstrap_port: int | None = None
    dp_size: int = 1
    targets: list[int] = field(default_factory=list)   # table rows, index = rank when split
    names: list[str] = field(default_factory=list)     # url or url@rank, parallel to targets
    model_id: str = "unknown"
    server_info: dict[str, Any] = field(default_factory=dict)
    model_info: dict[str, Any] = field(default_factory=dict)
    healthy: bool = False
    # pending (handshake running) -> ready (targets in the group) -> removed; or pending -> failed
    status: str = "pending"
    priority: int = 50
    cost: float = 1.0
    labels: dict[str, str] = field(default_factory=dict)
    api_key: str | None = None           # per-worker key (POST /workers), overrides --api-key
    requested_model_id: str | None = None
    error: str | None = None             # why registration failed
    # Which info paths answered (the /get_* fallbacks are remembered per worker).
    server_info_path: str = "/server_info"
    model_info_path: str = "/model_info"
    # Monitor bookkeeping: which load endpoint works (None = try /v1/loads first), and
    # consecutive health probe outcomes.
    load_path: str | None = None
    health_failures: int = 0
    health_successes: int = 0
    task: asyncio.Task | None = field(default=None, repr=False)

    @property
    def split(self) -> bool:
        """True when the worker is represented by one target per DP rank."""
        return len(self.targets) > 1


def normalize_url(url: str) -> str:
    """Add a missing ``http://`` and drop trailing slashes, so one server has one spelling."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    return url.rstrip("/")


def split_host_port(url: str) -> tuple[str, int]:
    """-> (hostname verbatim, IPv6 literal kept in brackets; port, scheme default if absent)."""
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    if netloc.startswith("["):
        host = netloc[: netloc.index("]") + 1]
    else:
        host = netloc.rpartition(":")[0] if ":" in netloc else netloc
    try:
        port = parts.port
    except ValueError:
        port = None
    if port is None:
        port = 443 if parts.scheme == "https" else 80
    return host, port


def model_id_of(requested: str | None, server_info: Mapping[str, Any], model_info: Mapping[str, Any]) -> str:
    """protocol.md 2: first non-empty of model_id, served_model_name, last segment of model_path."""
    for cand in (requested, server_info.get("model_id"), server_info.get("served_model_name")):
        if isinstance(cand, str) and cand:
            return cand
    for info in (server_info, model_info):
        path = info.get("model_path")
        if isinstance(path, str) and path.strip("/"):
            return path.rstrip("/").rsplit("/", 1)[-1]
    return "unknown"


class DuplicateWorker(ValueError):
    """A worker with that URL is already registered (or registering)."""
