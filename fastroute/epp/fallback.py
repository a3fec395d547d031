"""Fallback endpoints and the served report of the endpoint picker protocol
(``--fallback-endpoints N``).

With N > 0 the picker names, after the endpoint it picked, up to N next-best endpoints of other
workers, comma-separated, in ``x-gateway-destination-endpoint`` and under dynamic metadata
``envoy.lb`` (:func:`next_best`), so that Envoy can retry a refused connection on the next one
without asking again. The printed bootstrap (:func:`fastroute.epp.bootstrap.overriding_cluster`)
then routes with Envoy's ``override_host`` load balancing policy over a cluster of the
``--worker-urls`` (ORIGINAL_DST takes one address only): it reads the list from the picker's
metadata (never from a client's header), tries it in order, and writes the endpoint that served
into ``envoy.lb`` / ``x-gateway-destination-endpoint-served``, which ext_proc forwards to the
picker with the response headers (:func:`served_of`). When that is not the picked endpoint, the
lease moves to the worker that served (:func:`move`), so in-flight counts follow the request.

The retry is on ``connect-failure``, ``refused-stream`` and ``reset-before-request`` only: the
worker did not get the request, so a POST is never sent twice to workers that both ran it.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from fastroute.core.table import COL_HEALTHY
from fastroute.epp.bootstrap import METADATA_NAMESPACE, SERVED_KEY, fallback_endpoints
from fastroute.epp.decide import Booking, target_endpoint
from fastroute.errors import RouterError

log = logging.getLogger("fastroute.epp")

CODE_UNLISTED = "endpoint_not_in_cluster"  # a picked rank port the printed cluster lacks


class Fallbacks:
    """``--fallback-endpoints N`` on the picker: the list after the pick and the served report
    (see module docstring). ``moved``: requests Envoy served elsewhere than the pick, whose
    lease followed them (``fastroute_epp_fallback_served_total``)."""

    def __init__(self, n: int, printed: frozenset[str]) -> None:
        self.n = int(n)
        self.printed = printed  # ip:port of the printed cluster's endpoints (cluster_endpoints)
        self.moved = 0

    def listed(self, registry: Any, group: Any, picked: int, endpoint: str) -> str:
        """The header value: the picked ``endpoint``, then the next-best ones, all in the
        printed cluster. A pick outside it (a rank port whose URL was not given), which Envoy's
        policy would silently send round robin instead, is refused with 503."""
        if endpoint not in self.printed:
            raise RouterError(
                503,
                CODE_UNLISTED,
                f"--fallback-endpoints: the picked endpoint {endpoint} is not in the printed Envoy "
                "cluster (it lists the --worker-urls only; give each rank port's URL)",
            )
        more = next_best(registry, group, picked, self.n, self.printed)
        return ",".join([endpoint, *more]) if more else endpoint

    def served(self, decider: Any, booking: Booking, msg: Any) -> None:
        """Read the served report of a response message; move the lease when it differs."""
        served = served_of(msg)
        if served is not None and booking.endpoint and move(decider, booking, booking.endpoint, served):
            self.moved += 1
            booking.endpoint = served


def next_best(registry: Any, group: Any, picked: int, n: int, printed: frozenset[str]) -> list[str]:
    """Up to ``n`` endpoints of ``printed`` for other targets of ``group`` than the picked one,
    least in flight first (an endpoint several ranks share counts by its least loaded rank);
    the picked endpoint and unhealthy targets are left out."""
    table = registry.table
    info = registry.target_info
    entry = info[picked] if picked < len(info) else None
    first = target_endpoint(*entry) if entry is not None else ""
    best: dict[str, tuple[int, int]] = {}
    for order, t in enumerate(group.targets):
        if t == picked or t >= len(info) or info[t] is None or not table.get(t, COL_HEALTHY):
            continue
        ep = target_endpoint(*info[t])
        if ep == first or ep not in printed:
            continue
        load = table.in_flight(t)
        seen = best.get(ep)
        if seen is None or load < seen[0]:
            best[ep] = (load, order if seen is None else seen[1])
    return [ep for ep, _ in sorted(best.items(), key=lambda kv: kv[1])[:n]]


def served_of(msg: Any) -> str | None:
    """The endpoint that served, from a ProcessingRequest's metadata context (``envoy.lb`` /
    ``x-gateway-destination-endpoint-served``), or None when the message carries none."""
    if not msg.HasField("metadata_context"):
        return None
    ns = msg.metadata_context.filter_metadata.get(METADATA_NAMESPACE)
    if ns is None or SERVED_KEY not in ns.fields:
        return None
    value = ns.fields[SERVED_KEY]
    return value.string_value.strip() if value.WhichOneof("kind") == "string_value" else None


def move(decider: Any, booking: Booking, picked: str, served: str) -> bool:
    """Move ``booking``'s lease to the target at ``served`` when Envoy served the request
    elsewhere than ``picked``: the same rank on the served worker when it has one, else its
    first target. True when the lease moved; an address the picker does not know leaves the
    lease where it is (logged)."""
    lease = booking.lease
    if served == picked or lease is None or booking.closed:
        return False
    reg = decider.registry
    info = reg.target_info
    old = info[lease.target] if lease.target < len(info) else None
    rank = old[1] if old is not None else None
    group = reg.group("regular")
    found = None
    for t in group.targets:
        entry = info[t] if t < len(info) else None
        if entry is None or target_endpoint(*entry) != served:  # a rank port is its own endpoint
            continue
        if found is None or entry[1] == rank:
            found = t
        if entry[1] == rank:
            break
    if found is None:
        log.warning("ext_proc: Envoy served a request at %s, which is not a known worker endpoint", served[:100])
        return False
    booking.lease = group.book_target(found, lease.tokens)
    lease.release()
    return True


def cluster_endpoints(worker_urls: list[str]) -> frozenset[str]:
    """``ip:port`` of the printed cluster's endpoints: each worker URL's address, its host
    resolved as Envoy's STRICT_DNS cluster resolves it (every address of a name)."""
    out: set[str] = set()
    for host, port in fallback_endpoints(worker_urls):
        try:
            infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except OSError:  # not resolvable now: the registry cannot reach it either
            continue
        for info in infos:
            ip = str(info[4][0])
            out.add(("[%s]:%d" if ":" in ip else "%s:%d") % (ip, port))
    return frozenset(out)
