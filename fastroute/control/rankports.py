"""Per-rank-port servers: SGLang's Rust HTTP server under attention DP, one port per DP rank.

Such a server (SGLang 0.5.23 with ``SGLANG_RUST_SERVER=1``) has no DP controller in front of
its ranks: rank r of a server started with ``--port P`` listens on P + r (its node-local index)
and runs every request sent there on itself, whatever rank the body names. Each rank port's
``/server_info`` says so in ``deployment_info`` (``dp_size``, ``dp_rank``, ``nnodes``,
``node_rank``, ``disaggregation_bootstrap_port``). docs/protocol.md 4.5 has the sources.

The router keeps such a server as one worker with one target per rank port, whatever
``--dp-aware`` says (sending everything to the base port would run it all on rank 0):

* :func:`layout_of` reads the layout from one port's ``/server_info`` (None: a classic server
  on one port, handled exactly as before);
* :func:`find_rank_ports` works out the host's other rank ports from the one given (any rank's
  URL will do) and checks each port's own ``/server_info`` reports the rank expected there;
* the registry then names each target by its rank URL, the monitor polls and health-checks
  each rank port on its own, and the data plane sends each request to its rank's port.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from fastroute.config import Config
from fastroute.config.checks import worker_url_problem
from fastroute.control.selfaddr import OwnAddresses, SelfWorker
from fastroute.control.worker import Worker, address_key

log = logging.getLogger("fastroute.workers")


class RankLayoutError(ValueError):
    """A ``deployment_info`` that names a rank but cannot be a real layout."""


@dataclass(frozen=True)
class RankLayout:
    """What one rank port says about its server."""

    dp_size: int  # DP ranks of the whole deployment (all nodes)
    dp_rank: int  # the rank served on this port
    count: int  # rank ports on this host (dp_size / nnodes)
    first: int  # the DP rank on this host's base port
    bootstrap_port: int | None  # disaggregation_bootstrap_port (a prefill's)

    @property
    def local(self) -> int:
        """This port's offset from the host's base port."""
        return self.dp_rank - self.first


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def layout_of(server_info: Mapping[str, Any]) -> RankLayout | None:
    """The per-rank-port layout ``server_info`` reports, or None for a server on one port.

    A server is per-rank-port when ``deployment_info`` (an object, or a JSON string of one) has
    an integer ``dp_rank``. Raises :class:`RankLayoutError` when it has one but the numbers
    cannot describe a deployment (a rank outside dp_size, nodes that do not divide it)."""
    di = server_info.get("deployment_info")
    if isinstance(di, str):
        try:
            di = json.loads(di)
        except ValueError:
            return None
    if not isinstance(di, Mapping) or "dp_rank" not in di:
        return None
    rank, size = _int(di.get("dp_rank")), _int(di.get("dp_size"))
    if rank is None or size is None or size < 1 or not 0 <= rank < size or size > 4096:
        raise RankLayoutError(
            f"deployment_info has dp_rank {di.get('dp_rank')!r} and dp_size "
            f"{di.get('dp_size')!r}: not a rank of a deployment"
        )
    nnodes = 1 if di.get("nnodes") is None else _int(di["nnodes"])
    node = 0 if di.get("node_rank") is None else _int(di["node_rank"])
    if nnodes is None or nnodes < 1:
        raise RankLayoutError(f"deployment_info has nnodes {di.get('nnodes')!r}: not a number of nodes (1 or more)")
    if node is None or not 0 <= node < nnodes:
        raise RankLayoutError(
            f"deployment_info has node_rank {di.get('node_rank')!r}: not a node of nnodes {nnodes} (0..{nnodes - 1})"
        )
    if size % nnodes:
        raise RankLayoutError(
            f"deployment_info has dp_size {size} over nnodes {nnodes}: the ranks do not split evenly over the nodes"
        )
    count = size // nnodes
    first = node * count
    if not first <= rank < first + count:
        raise RankLayoutError(
            f"deployment_info puts dp_rank {rank} on node {node} of {nnodes}, "
            f"which holds ranks {first}..{first + count - 1}"
        )
    boot = _int(di.get("disaggregation_bootstrap_port"))
    return RankLayout(size, rank, count, first, boot if boot and 0 < boot < 65536 else None)


def with_port(url: str, port: int) -> str:
    """``url`` with its port replaced (scheme, host, path kept)."""
    sp = urlsplit(url)
    host = sp.netloc.rpartition("@")[2]
    if host.startswith("["):
        host = host[: host.index("]") + 1]
    else:
        host = host.rpartition(":")[0] or host
    return urlunsplit((sp.scheme, f"{host}:{port}", sp.path, sp.query, ""))


async def find_rank_ports(
    url: str,
    port: int,
    layout: RankLayout,
    get_info: Callable[[str], Awaitable[Mapping[str, Any] | None]],
    check: Callable[[list[str]], None] | None = None,
) -> tuple[list[str], list[int]]:
    """-> (URL, DP rank) of every rank port on this host, by offset from the base port.

    ``url`` is the port that answered with ``layout``; ``get_info(rank_url)`` returns another
    port's ``/server_info``. ``check(rank_urls)`` vets the addresses before any is asked (it
    raises RankLayoutError for one the router must not call). Raises RankLayoutError when the
    ports cannot be there (outside 1..65535) and LookupError naming the port when one reports
    another layout (the caller retries until its start-up deadline: a server's ranks come up
    one by one)."""
    base = port - layout.local
    if base < 1 or base + layout.count - 1 > 65535:
        raise RankLayoutError(
            f"rank {layout.dp_rank} on port {port} puts the base port at "
            f"{base}: the {layout.count} rank ports do not fit in 1..65535"
        )
    urls = [with_port(url, base + i) for i in range(layout.count)]
    ids = [layout.first + i for i in range(layout.count)]
    if check is not None:
        check(urls)
    for i, rank_url in enumerate(urls):
        if i == layout.local:
            continue
        try:
            info = await get_info(rank_url)
            other = layout_of(info or {})
        except RankLayoutError as exc:
            raise LookupError(f"{rank_url}/server_info: {exc}") from None
        if other is None or other.dp_size != layout.dp_size or other.dp_rank != ids[i]:
            got = (
                "no per-rank deployment_info"
                if other is None
                else f"dp_rank {other.dp_rank} of dp_size {other.dp_size}"
            )
            raise LookupError(
                f"{rank_url}/server_info reports {got}; expected dp_rank {ids[i]} "
                f"of dp_size {layout.dp_size} (the port of rank {layout.dp_rank} "
                f"is {url})"
            )
    return urls, ids


def describe(url: str, rank_urls: list[str], rank_ids: list[int], dp_size: int) -> str:
    """The start-up log line of a per-rank-port server."""
    first, last = urlsplit(rank_urls[0]).port, urlsplit(rank_urls[-1]).port
    ranks = f"ranks {rank_ids[0]}..{rank_ids[-1]} of {dp_size}" if len(rank_ids) != dp_size else f"{dp_size} ranks"
    return f"worker {url} serves {ranks} on ports {first}..{last}, one port per rank"


class RankRoster(Protocol):
    """What :class:`RankPorts` reads and calls on its registry (control/registry.py's Registry)."""

    def find(self, url: str) -> Worker | None: ...
    def get(self, worker_id: str) -> Worker | None: ...
    def at_address(self, addr: tuple[str, int]) -> Worker | None: ...
    def index(self, w: Worker) -> None: ...
    def unindex(self, w: Worker) -> None: ...
    def resize(self, w: Worker, dp: int, why: str = "") -> None: ...


def aliases(w: Worker) -> list[tuple[str, tuple[str, int] | None]]:
    """(URL, address key) of every rank port of ``w``: each finds the server's worker."""
    out = []
    for url in w.rank_urls:
        port = urlsplit(url).port or 0
        out.append((url, (w.addr[0], port) if w.addr is not None else None))
    return out


class RankPorts:
    """The registry's side of per-rank-port servers: held by the
    :class:`~fastroute.control.registry.Registry` as ``registry.ranks``, which it sees through
    :class:`RankRoster`."""

    def __init__(self, workers: RankRoster, config: Config, own: OwnAddresses) -> None:
        self._workers = workers
        self._config = config
        self._own = own

    async def discover(self, w: Worker, get_info: Callable[[str], Awaitable[Mapping[str, Any] | None]]) -> None:
        """After ``w``'s ``/server_info`` was read: when it is a rank port, find the server's
        other rank ports (``get_info(url)`` reads one's ``/server_info``), check each reports
        its rank, and make ``w`` the server at its base port (its URL becomes the base port's,
        every rank URL finds it). Raises RankLayoutError when that cannot work and LookupError
        while a port is not there yet."""
        layout = layout_of(w.server_info)
        w.rank_urls, w.rank_ids = [], []
        if layout is None or layout.count < 2:
            return  # one port for the whole server (or a single rank): as before
        bound = self._config.max_targets_per_worker
        if layout.count > bound:
            raise RankLayoutError(
                f"the server reports {layout.count} rank ports on this host: one worker may take "
                f"at most {bound} targets (--max-targets-per-worker)"
            )
        urls, ids = await find_rank_ports(w.url, w.port, layout, get_info, lambda urls: self._vet(w, urls))
        given, indexed = w.url, self._workers.get(w.id) is w
        self._workers.unindex(w)
        w.url, w.port = urls[0], urlsplit(urls[0]).port or 0
        if w.addr is not None:
            w.addr = (w.addr[0], w.port)
        w.rank_urls, w.rank_ids, w.dp_size = urls, ids, layout.dp_size
        if indexed:
            self._workers.index(w)
        if w.role == "prefill" and layout.bootstrap_port is not None:
            if w.bootstrap_port not in (None, layout.bootstrap_port):
                log.warning(
                    "prefill %s reports disaggregation_bootstrap_port %d; using it, not the configured %d",
                    w.url,
                    layout.bootstrap_port,
                    w.bootstrap_port,
                )
            w.bootstrap_port = layout.bootstrap_port
        if given != w.url:
            log.info("worker %s is the port of DP rank %d; registering its server at %s", given, layout.dp_rank, w.url)
        log.info("%s", describe(w.url, urls, ids, layout.dp_size))

    def _vet(self, w: Worker, urls: list[str]) -> None:
        """Raise RankLayoutError naming the first rank URL of ``w`` that ``POST /workers`` would
        refuse: a bad URL, one of the router's own listeners, another worker's port."""
        for url in urls:
            problem = worker_url_problem(url, self._config.allow_link_local_workers)
            if problem is not None:
                raise RankLayoutError(f"rank port URL {url!r} {problem}")
            port = urlsplit(url).port or 0
            addr = (w.addr[0], port) if w.addr is not None else address_key(w.host, port)
            try:
                self._own.check(url, addr)
            except SelfWorker as exc:
                raise RankLayoutError(f"rank port: {exc}") from None
            other = self._workers.find(url)
            if other is None and addr is not None:
                other = self._workers.at_address(addr)
            if other is not None and other is not w:
                raise RankLayoutError(f"rank port {url} is already worker {other.url}")

    def recheck(self, w: Worker, doc: Mapping[str, Any], why: str) -> None:
        """A re-read of a per-rank-port server's base port: its rank ports follow a new
        dp_size (a restart with another one), kept rows and all (``resize``)."""
        try:
            layout = layout_of(doc)
        except RankLayoutError:
            layout = None
        if layout is None or w.status != "ready" or layout.first != w.rank_ids[0]:
            return
        if layout.count < 2 or (layout.count == len(w.targets) and layout.dp_size == w.dp_size):
            return
        urls = [with_port(w.url, w.port + i) for i in range(layout.count)]
        try:
            bound = self._config.max_targets_per_worker
            if layout.count > bound:
                raise RankLayoutError(f"one worker may take at most {bound} targets (--max-targets-per-worker)")
            if w.port + layout.count - 1 > 65535:
                raise RankLayoutError(f"the {layout.count} rank ports from {w.port} do not fit in 1..65535")
            self._vet(w, urls[len(w.rank_urls) :])
        except RankLayoutError as exc:
            log.error(
                "worker %s now reports dp_size %d (%s); keeping its %d ranks: %s",
                w.url,
                layout.dp_size,
                why or "re-read",
                len(w.targets),
                exc,
            )
            return
        self._workers.unindex(w)
        w.rank_urls = urls
        w.rank_ids = [layout.first + i for i in range(layout.count)]
        self._workers.index(w)
        w.server_info = dict(doc)
        self._workers.resize(w, layout.dp_size, why)
