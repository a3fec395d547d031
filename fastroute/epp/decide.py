"""One ext_proc stream's decision and booking, without gRPC: what :mod:`fastroute.epp.service`
asks for each request, and what the lease safety net scans.

A :class:`Booking` is the books of one request routed through the gateway: its admission slot
(``--max-concurrent-requests``) and its lease on a target, taken from the registry's
``regular`` routing group exactly as the proxy's exchange takes it (``Group.acquire`` with the
parsed body's tokens, the routing key and the request meta), so every policy, the load ledger,
KV fit and the circuit breakers' view of eligibility are the proxy's. ``Booking.close()``
gives both back exactly once, whichever ending comes first: the response's end, the stream
cancelled or reset, the ext_proc stream dying, silence (a picked stream that says nothing for
``--silent-stream-timeout-secs`` before its response begins: :meth:`Decider.check_silent`), or
the safety net (a booking older than ``--request-timeout-secs`` plus a slack).

:meth:`Decider.decide` turns the request (method, path, headers, buffered body) into a
:class:`Pick` (the destination ``ip:port``, the body with the DP rank spliced in when the
target is one rank of a single-port DP server, the Authorization the worker wants) or raises
:class:`~fastroute.errors.RouterError` (400 bad body, 401 key, 413 size, 503 no endpoint, or
none among the gateway's subset hint (:class:`Subsets`);
admission's 429 and 408 come from :meth:`Decider.admit`), never leaving a lease behind.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from time import perf_counter
from typing import Any

from fastroute import errors as _errors
from fastroute.auth import authorized, bearer
from fastroute.dataplane import body as _body
from fastroute.dataplane.route import rank_port
from fastroute.dataplane.routes import ROUTES
from fastroute.epp.bootstrap import body_limit
from fastroute.errors import RouterError

log = logging.getLogger("fastroute.epp")

LEAK_SLACK = 5.0  # seconds past --request-timeout-secs before a booking counts as leaked
SUBSET_GROUPS = 64  # routing groups kept for distinct subset hints (least recently used go)
CODE_NO_SUBSET_ENDPOINT = "no_available_subset_endpoint"
# PD: the header naming the pair the picker booked, read by the sidecar's PD relay as its
# routing key (fastroute.epp.sidecar).
PIN_HEADER = "x-smg-routing-key"


class Pick:
    """Where one request goes: ``endpoint`` (``ip:port``), the body to send when it changed
    (None: as it came), and the Authorization value the worker wants (None: the client's)."""

    __slots__ = ("endpoint", "body", "auth", "target", "rank", "headers")

    def __init__(
        self,
        endpoint: str,
        body: bytes | None,
        auth: str | None,
        target: int,
        rank: int | None,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        self.endpoint = endpoint
        self.body = body
        self.auth = auth
        self.target = target
        self.rank = rank
        self.headers = headers  # more request headers to set (PD: the pair picked)


class Booking:
    """The admission slot and lease of one request (see module docstring)."""

    __slots__ = (
        "decider",
        "lease",
        "lease2",
        "slot",
        "waiter",
        "started_at",
        "seen",
        "answered",
        "closed",
        "reason",
        "endpoint",
    )

    def __init__(self, decider: Decider) -> None:
        self.decider = decider
        self.lease: Any = None
        self.lease2: Any = None  # PD: the decode lease (``lease`` is the prefill's)
        self.slot = False
        self.waiter: Any = None
        self.started_at = decider.loop.time()
        self.seen = self.started_at  # the pick or the stream's last message, whichever is later
        self.answered = False  # the response began (Envoy relayed the worker's headers)
        self.closed = False
        self.reason = ""
        self.endpoint = ""  # the picked ip:port (the served report is compared with it)
        decider.bookings.add(self)

    def close(self, reason: str) -> bool:
        """Give everything back (idempotent); True the first time."""
        if self.closed:
            return False
        self.closed = True
        self.reason = reason
        if log.isEnabledFor(logging.DEBUG):
            log.debug("booking closed (%s) after %.3f s", reason, self.decider.loop.time() - self.started_at)
        d = self.decider
        d.bookings.discard(self)
        try:
            lease, self.lease = self.lease, None
            lease2, self.lease2 = self.lease2, None
            try:
                if lease is not None:
                    lease.release()
            finally:
                if lease2 is not None:
                    lease2.release()
        finally:
            if self.waiter is not None:
                d.admission.cancel(self.waiter)
                self.waiter = None
            if self.slot:
                self.slot = False
                d.admission.leave()
        return True


def needs_body(config: Any) -> bool:
    """Whether a pick needs the request body: the DP rank goes into it, or the policy reads its
    text or tokens (cache_aware, power_of_two on tokens, decode demand, KV fit; PD always, its
    legs weigh the input). Otherwise the pick is made on the headers and Envoy is told not to
    send the body at all."""
    return bool(
        config.dp_aware
        or config.pd_disaggregation
        or config.policy == "cache_aware"
        or (config.policy == "power_of_two" and config.p2c_load_metric == "tokens")
        or config.decode_input_demand != "off"
        or config.decode_kv_fit != "off"
    )


def endpoint_of(worker: Any) -> str:
    """``ip:port`` of a worker for Envoy's ORIGINAL_DST cluster: the address the registry
    resolved, since Envoy takes an IP address there, not a host name."""
    host, port = worker.addr if worker.addr is not None else (worker.host, worker.port)
    host = str(host).strip("[]")
    return ("[%s]:%d" if ":" in host else "%s:%d") % (host, int(port))


def target_endpoint(worker: Any, rank: int | None) -> str:
    """``ip:port`` of one target: a per-rank-port server's rank listens on its own port (base
    port + rank: the proxy's route takes the same ``rank_port``), every other target on its
    worker's address."""
    port = rank_port(worker, rank)
    if port is None:
        return endpoint_of(worker)
    return "%s:%d" % (endpoint_of(worker).rpartition(":")[0], port)


def no_subset_endpoint(subset: frozenset[str]) -> RouterError:
    """503 when no available target has an address in the gateway's subset hint."""
    shown = ", ".join(sorted(subset)[:8]) + (", ..." if len(subset) > 8 else "")
    return RouterError(
        503,
        CODE_NO_SUBSET_ENDPOINT,
        "No available worker among the endpoints the gateway allowed "
        f"(x-gateway-destination-endpoint-subset: [{shown}])",
    )


class Subsets:
    """The subset hint of the endpoint picker protocol: the gateway names the ``ip:port``
    endpoints a request may go to, and the pick is made among the available targets of the
    ``regular`` group whose address is one of them (every rank of a single-port DP server
    shares its address; each rank of a per-rank-port server has its own). Each distinct subset
    gets a group configured like the regular one (same policy, metric, demand, KV fit) over the
    same target table, so loads and leases are the shared ledger's; policy state of its own (the
    prefix tree, round robin's turn, manual keys) is the subset group's. The last SUBSET_GROUPS
    subsets are kept."""

    def __init__(self, registry: Any) -> None:
        self.registry = registry
        self.groups: OrderedDict[frozenset[str], Any] = OrderedDict()

    def group(self, subset: frozenset[str]) -> Any:
        """The group over the subset's available targets, or None when there is none."""
        reg = self.registry
        base = reg.group("regular")
        info = reg.target_info
        cands: list[int] = []
        names: list[str] = []
        for t, name in zip(base.targets, base.names):
            entry = info[t] if t < len(info) else None
            if entry is not None and target_endpoint(*entry) in subset:
                cands.append(t)
                names.append(name)
        if not cands:
            return None
        g = self.groups.get(subset)
        if g is None:
            g = reg.router.group(
                [],
                base.policy,
                load_metric=base.load_metric,
                demand=base.demand,
                request_weight=base.request_weight,
                names=[],
                kv_fit=base.kv_fit,
                kv_reserve=base.kv_reserve,
                rank_slack=base.rank_slack,
                tokens_until_answer=base.tokens_until_answer,
            )
            self.groups[subset] = g
            if len(self.groups) > SUBSET_GROUPS:
                self.groups.popitem(last=False)
        else:
            self.groups.move_to_end(subset)
        if g.targets != cands or g.names != names:
            g.set_targets(cands, names)
        return g


class Decider:
    """Picks for the gateway with the registry's routing group (see module docstring)."""

    def __init__(
        self,
        config: Any,
        registry: Any,
        admission: Any,
        stats: Any = None,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.config = config
        self.registry = registry
        self.admission = admission
        self.stats = stats
        self.loop = loop or asyncio.get_event_loop()
        self.bookings: set[Booking] = set()
        self.rank_field = config.rank_field("regular") if config.dp_aware else None
        self.max_payload = body_limit(config)  # the printed Envoy's buffer limit too
        self.timeout = float(config.request_timeout_secs)
        self.api_key = bearer(config.api_key)
        self.key_headers = ("x-smg-routing-key",) + tuple(h.lower() for h in config.routing_key_headers)
        self._rank_bytes: dict[int, bytes] = {}
        self.needs_body = needs_body(config)
        self.subsets = Subsets(registry)
        self.sidecar_port: int | None = None  # PD: the fastroute sidecar on each decode pod
        self.silent_timeout = 0.0  # --silent-stream-timeout-secs (0: off), see check_silent
        self.fallback: Any = None  # --fallback-endpoints: fastroute.epp.fallback.Fallbacks

    @property
    def in_flight(self) -> int:
        """Requests booked through this picker and not yet released."""
        return len(self.bookings)

    # -- admission ---------------------------------------------------------------------
    async def admit(self, booking: Booking) -> None:
        """Take an admission slot, waiting in the FIFO queue when full; raises the proxy's 429
        (queue full) or 408 (queue timeout). A cancelled wait leaves the queue (close())."""
        adm = self.admission
        if adm.try_enter():
            booking.slot = True
            return
        fut = self.loop.create_future()

        def start() -> None:
            booking.waiter = None
            if booking.closed or fut.done():
                adm.leave()  # the stream ended between the dequeue and this callback
                return
            booking.slot = True
            fut.set_result(True)

        def expired() -> None:
            booking.waiter = None
            if not fut.done():
                fut.set_result(False)

        waiter = adm.wait(start, expired, self.loop.time())
        if waiter is None:
            raise _errors.queue_full()
        booking.waiter = waiter
        if not await fut:
            raise _errors.queue_timeout()

    # -- the pick ----------------------------------------------------------------------
    def check(self, method: str, path: str, headers: dict[str, str], body_len: int) -> None:
        """What is refused before any slot or lease: readiness, the key, the size."""
        if not self.registry.ready():
            raise RouterError(
                503, _errors.CODE_NO_AVAILABLE_WORKERS, "No available workers (router is still registering workers)"
            )
        raw = path.partition("?")[0].encode("latin-1", "replace")
        auth = headers.get("authorization")
        if self.api_key is not None and not authorized(
            self.api_key, raw, auth.encode("latin-1", "replace") if auth is not None else None
        ):
            raise _errors.invalid_api_key()
        if body_len > self.max_payload:
            raise _errors.payload_too_large(body_len, self.max_payload)

    def decide(
        self,
        booking: Booking,
        method: str,
        path: str,
        headers: dict[str, str],
        body: bytes | None,
        subset: frozenset[str] | None = None,
    ) -> Pick:
        """Pick and book (the lease is the booking's from here); raises RouterError. ``body``
        None: picked on the headers (no body, or the pick does not need it: nothing parsed).
        ``subset``: the gateway's subset hint (None: any target), see :class:`Subsets`."""
        route = path.partition("?")[0]
        spec = ROUTES.get(route.encode("latin-1", "replace")) if method == "POST" and body is not None else None
        meta = None
        tokens = out_tokens = 0
        if spec is not None:
            meta = _body.parse_request(spec.endpoint, body or b"")
            if spec.tokens is not None:
                meta.input_tokens = spec.tokens(meta.obj)
            tokens = meta.input_tokens
            out_tokens = meta.max_new_tokens or 0
        key = None
        for h in self.key_headers:
            v = headers.get(h)
            if v is not None:
                key = v.encode("latin-1", "replace")
                break
        st = self.stats
        t0 = perf_counter()
        if self.sidecar_port is not None:
            return self._decide_pd(booking, tokens, key, meta, out_tokens, subset)
        if subset is None:
            group = self.registry.group("regular")
        else:
            group = self.subsets.group(subset)
            if group is None:
                raise no_subset_endpoint(subset)
        lease = group.acquire(tokens, key, meta, out_tokens)
        if st is not None:
            st.pick_seconds.observe(perf_counter() - t0)
        if lease is None:
            if subset is not None:
                raise no_subset_endpoint(subset)
            raise _errors.no_available_workers()
        booking.lease = lease
        entry = self.registry.target_info[lease.target]
        worker, rank = entry
        new_body = None
        if rank is not None and self.rank_field is not None and spec is not None and body is not None:
            field = self._rank_bytes.get(rank)
            if field is None:
                field = self._rank_bytes[rank] = _body.rank_field_bytes(self.rank_field, rank)
            new_body = _body.inject(body, field)
        auth = None
        key_ = worker.api_key or self.config.api_key
        if key_:
            auth = "Bearer " + key_
        elif worker.basic_auth:
            auth = worker.basic_auth
        endpoint = booking.endpoint = target_endpoint(worker, rank)
        if self.fallback is not None:
            endpoint = self.fallback.listed(self.registry, group, lease.target, endpoint)
        return Pick(endpoint, new_body, auth, lease.target, rank)

    def _decide_pd(
        self,
        booking: Booking,
        tokens: int,
        key: bytes | None,
        meta: Any,
        out_tokens: int,
        subset: frozenset[str] | None,
    ) -> Pick:
        """PD through the gateway: book a prefill and a decode target with the registry's PD
        groups (the proxy's pick of a pair), send the request to the fastroute sidecar on the
        decode worker's pod (its address, ``--sidecar-port``) and name the pair in
        ``x-smg-routing-key`` (``PREFILL|DECODE`` target names), from which the sidecar's PD
        relay takes its legs. The subset hint, when given, must allow the decode worker."""
        reg = self.registry
        p = reg.group("prefill").acquire(tokens, key, meta, out_tokens)
        if p is None:
            raise _errors.no_available_workers("prefill")
        booking.lease = p
        d = reg.group("decode").acquire(tokens, key, meta, out_tokens)
        if d is None:
            raise _errors.no_available_workers("decode")
        booking.lease2 = d
        worker, rank = reg.target_info[d.target]
        if subset is not None and endpoint_of(worker) not in subset:
            raise no_subset_endpoint(subset)
        host = endpoint_of(worker).rpartition(":")[0]
        pin = f"{reg.target_name(p.target)}|{reg.target_name(d.target)}"
        return Pick(f"{host}:{self.sidecar_port}", None, None, d.target, rank, headers=((PIN_HEADER, pin),))

    # -- the safety net ----------------------------------------------------------------
    def check_silent(self, now: float | None = None) -> int:
        """Release the bookings of picked streams that sent nothing for
        ``--silent-stream-timeout-secs`` before their response began. Envoy relays the worker's
        response headers as soon as the worker answers (from then on the response's end
        releases, or the request timeout's safety net); a client of the gRPC port that sends
        headers and then nothing held a lease until that safety net. Counted in
        ``fastroute_leases_reclaimed_total{reason="silent"}``; returns how many."""
        bound = self.silent_timeout
        if bound <= 0:
            return 0
        if now is None:
            now = self.loop.time()
        n = 0
        for b in [b for b in self.bookings if b.lease is not None and not b.answered and now - b.seen > bound]:
            if b.close("silent"):
                n += 1
                if self.stats is not None:
                    self.stats.reclaim("silent")
        if n:
            log.warning(
                "released the leases of %d picked stream(s) silent for over %g s (--silent-stream-timeout-secs)",
                n,
                bound,
            )
        return n

    def check_leaks(self, now: float | None = None) -> int:
        """Release bookings older than the request timeout plus a slack (their stream should
        have ended); returns how many. Only catches bugs and lost streams."""
        if now is None:
            now = self.loop.time()
        limit = self.timeout + LEAK_SLACK
        n = 0
        for b in [b for b in self.bookings if now - b.started_at > limit]:
            held = b.lease is not None
            if b.close("expired") and held:
                n += 1
                log.warning("reclaimed a leaked EPP lease (stream open %.1f s)", now - b.started_at)
                if self.stats is not None:
                    self.stats.reclaim("expired")
        return n
