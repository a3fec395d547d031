"""The worker model: one SGLang server as the router knows it, the URL helpers that give one
server one spelling, and the checks of the fields a caller may set on a worker.

Pure data and pure functions (no I/O, no table), shared by the registry that owns the workers,
the admin API that shows them and the follower registry that mirrors them.

A worker URL is stored without its userinfo (``user:password@``): ``Worker.url`` is what every
display shows (``GET /workers``, metric labels, target names, logs), so credentials given in a
URL are kept only as ``Worker.basic_auth``, sent as HTTP Basic auth to that worker when no
bearer key (``api_key`` / ``--api-key``) applies. One backend is one worker: URLs are compared
normalised (scheme and host lower-case, default port and trailing slashes dropped) and by
address (``address_key``: every spelling of an IP literal, and ``localhost``; other host names
are resolved by the registry's handshake).
"""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import math
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

ROLES = ("regular", "prefill", "decode")


@dataclass(eq=False)
class Worker:
    """One SGLang server known to the router (identity is by object, not by value)."""

    url: str
    role: str
    id: str = field(default_factory=lambda: str(uuid.uuid4()))
    host: str = ""  # hostname of the URL verbatim (IPv6 bracketed): bootstrap_host
    port: int = 0
    bootstrap_port: int | None = None
    dp_size: int = 1
    targets: list[int] = field(default_factory=list)  # table rows, index = rank when split
    names: list[str] = field(default_factory=list)  # url or url@rank, parallel to targets
    model_id: str = "unknown"
    server_info: dict[str, Any] = field(default_factory=dict)
    model_info: dict[str, Any] = field(default_factory=dict)
    healthy: bool = False
    # pending (handshake running) -> ready (targets in the group) -> removed; or pending -> failed
    status: str = "pending"
    priority: int = 50
    cost: float = 1.0
    labels: dict[str, str] = field(default_factory=dict)
    api_key: str | None = field(default=None, repr=False)  # per-worker key, overrides --api-key
    # "Basic <b64>" from the URL's userinfo (never shown: Worker.url has it stripped).
    basic_auth: str | None = field(default=None, repr=False)
    addr: tuple[str, int] | None = None  # resolved (address, port): one backend, one worker
    requested_model_id: str | None = None
    error: str | None = None  # why registration failed
    # Which info paths answered (the /get_* fallbacks are remembered per worker).
    server_info_path: str = "/server_info"
    model_info_path: str = "/model_info"
    # Monitor bookkeeping: which load endpoint works (None = try /v1/loads first), and
    # consecutive health probe outcomes.
    load_path: str | None = None
    health_failures: int = 0
    health_successes: int = 0
    task: asyncio.Task | None = field(default=None, repr=False)
    dp_task: asyncio.Task | None = field(default=None, repr=False)  # a dp_size re-read
    dp_checked: float = 0.0  # loop time of the last scheduled dp_size re-read
    # Per-rank ports (fastroute.control.rankports): the URL and DP rank of each target, by
    # target index; empty for a server on one port. Health is then kept per rank port.
    rank_urls: list[str] = field(default_factory=list)
    rank_ids: list[int] = field(default_factory=list)
    rank_healthy: list[bool] = field(default_factory=list)
    rank_failures: list[int] = field(default_factory=list)
    rank_successes: list[int] = field(default_factory=list)

    @property
    def split(self) -> bool:
        """True when the worker is represented by one target per DP rank."""
        return len(self.targets) > 1

    @property
    def rank_ports(self) -> bool:
        """True when every DP rank of the server listens on a port of its own."""
        return bool(self.rank_urls)

    def target_healthy(self, i: int) -> bool:
        """The health of target index ``i`` (per rank port, else the worker's)."""
        if self.rank_healthy and i < len(self.rank_healthy):
            return self.healthy and self.rank_healthy[i]
        return self.healthy


_DEFAULT_PORT = {"http": "80", "https": "443"}
PRIORITY_MAX = (1 << 31) - 1


def _parts(url: str) -> tuple[str, str, str, str, str, str]:
    """-> (scheme, userinfo, host, port, path, query) of a URL, ``http://`` added if missing."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    sp = urlsplit(url)
    userinfo, _, hostport = sp.netloc.rpartition("@")
    if hostport.startswith("["):
        end = hostport.find("]") + 1
        host, port = hostport[:end], hostport[end + 1 :] if end > 0 else ""
    else:
        host, _, port = hostport.partition(":")
    return sp.scheme.lower(), userinfo, host.lower(), port, sp.path, sp.query


def normalize_url(url: str) -> str:
    """One spelling per server: ``http://`` added if missing, scheme and host lower-cased, the
    scheme's default port, trailing slashes and any userinfo dropped."""
    scheme, _, host, port, path, query = _parts(url)
    if port == _DEFAULT_PORT.get(scheme):
        port = ""
    return urlunsplit((scheme, host + (":" + port if port else ""), path.rstrip("/"), query, ""))


def basic_auth(url: str) -> str | None:
    """``Basic <b64>`` for a URL's ``user:password@`` (percent-decoded), or None."""
    userinfo = _parts(url)[1]
    if not userinfo:
        return None
    user, _, password = userinfo.partition(":")
    token = ("%s:%s" % (unquote(user), unquote(password))).encode("utf-8")
    return "Basic " + base64.b64encode(token).decode("ascii")


def address_key(host: str, port: int) -> tuple[str, int] | None:
    """(canonical address, port) when ``host`` names an address without DNS: an IP literal in
    any spelling the resolver accepts (``127.1``, ``0x7f000001``, ``2130706433``, ``[::1]``),
    or ``localhost`` (RFC 6761: loopback). None for a name that needs resolving."""
    h = host[1:-1] if host.startswith("[") else host
    if h == "localhost" or h.endswith(".localhost"):
        return "127.0.0.1", port
    try:
        return str(ipaddress.ip_address(h)), port
    except ValueError:
        pass
    try:
        return socket.inet_ntoa(socket.inet_aton(h)), port  # the legacy IPv4 spellings
    except OSError:
        return None


def check_fields(priority: Any = None, cost: Any = None, labels: Any = None, api_key: Any = None) -> None:
    """Raise ValueError naming the first field a caller set to something unusable (None: unset).

    ``api_key`` goes into a header line of every request to the worker, so it must be a string
    of visible ASCII; ``priority`` an int in [0, 2^31); ``cost`` a finite number >= 0 (it is
    shown in ``GET /workers``, which must stay strict JSON); ``labels`` an object."""
    if api_key is not None and (type(api_key) is not str or not all(0x21 <= ord(c) <= 0x7E for c in api_key)):
        raise ValueError("api_key must be a string of visible ASCII characters")
    if priority is not None and (type(priority) is not int or not 0 <= priority <= PRIORITY_MAX):
        raise ValueError(f"priority must be an integer in [0, {PRIORITY_MAX}]")
    if cost is not None and (type(cost) not in (int, float) or not math.isfinite(cost) or cost < 0):
        raise ValueError("cost must be a finite number >= 0")
    if labels is not None and not isinstance(labels, Mapping):
        raise ValueError("labels must be an object")


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


def target_label(w: Any, rank: int | None) -> str:
    """A target's name for any worker-like object (a follower's mirror, a test's stand-in)."""
    urls = getattr(w, "rank_urls", None)
    if rank is not None and urls and rank < len(urls):
        return urls[rank]
    return w.url if rank is None else f"{w.url}@{rank}"


class DuplicateWorker(ValueError):
    """A worker with that URL is already registered (or registering)."""


class BadWorkerURL(ValueError):
    """A worker URL that is malformed or not allowed (fastroute.config.checks.worker_url_problem)."""
