"""Flow control: priority classes, fairness between tenants, tenant rate limits, saturation.

Installed only when a flow-control flag is given (``--priority-scheduler-enabled``,
``--tenant-rate-limit-enabled``, ``--tenant-api-key``, ``--worker-overload-shed``):
:func:`install` makes the App's admission a :class:`FlowAdmission` instead of the plain
:class:`~fastroute.dataplane.admission.Admission`. Without those flags nothing here runs on the
request path, and the plain admission's fast path (one comparison) stays what it was.

How a request goes through (:meth:`FlowAdmission.enqueue`, reached from ``Endpoints.wait``: the
flow admission's ``try_enter`` always declines so every parsed request comes here):

1. tenant: ``auth:<id>`` (a ``--tenant-api-key`` bearer key), ``header:<id>``
   (``--trust-tenant-header``), ``ip:<peer>``, else ``anonymous``;
2. class: ``x-smg-priority`` (system, interactive, default, bulk; unknown = default) clamped
   down to the tenant's ``max_class``; without the scheduler every request is one class;
3. saturation (:mod:`fastroute.dataplane.saturation`): when every rank the request could use
   is past a threshold, ``--worker-overload-shed`` answers 503
   ``worker_overload_protection_shed``, else the request waits in its class;
4. admission: strict priority between classes (a class is served only when no higher class
   waits, except a waiter past its class's ``starvation_threshold_secs``), round robin between
   the tenants inside a class (one sub-queue per tenant: a tenant sending ten times more gets
   no more turns), capacity the sum of the ranks' reported ``max_running_requests`` (else
   ``--max-concurrent-requests``) less the slots the higher classes reserve. A full class
   queue answers 429 ``scheduler_queue_full``, a waiter past its class's
   ``queue_timeout_secs`` 503 ``scheduler_queue_timeout``; at ``--flow-max-queued`` waiters in
   all, a newcomer takes the place of the newest waiter of the lowest class below its own (503
   ``scheduler_shed``), the lowest class going first; a client that leaves while queued
   is dropped at once (``cancel``). Every step is O(1) in the number of waiters (four classes,
   ordered dicts); the capacity and saturation reads scan the ranks at most once per 10 ms;
5. tenant rate limits (tokens and requests per minute, model rules), reserved only once the
   request starts or waits: 429 ``tenant_rate_limit_exceeded`` with ``Retry-After``; a waiter
   that times out or whose client leaves gives its reservation back.

Every refusal carries its JSON reason, ``x-smg-error-code`` and ``Retry-After`` and is counted
by (tenant, class, reason) in ``fastroute_flow_refusals_total``.

A tenant is whatever the client makes it (its address; any header value with
``--trust-tenant-header``), so what is kept per tenant is bounded: past ``COUNTED_KEYS`` counter
entries the least counted tenants fold into ``other`` (flowpolicy.fold_tenants; the busiest
``TENANTS_AFTER_FOLD``, and at most half of them, keep their names), and past ``BUCKETS_KEPT``
rate-limit scopes the refilled ones are forgotten (a fresh scope is a full one: nothing changes
for that tenant), then the oldest.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from fastroute import errors as _errors
from fastroute.auth import bearer
from fastroute.dataplane.admission import Admission, Waiter
from fastroute.dataplane.headerflags import _F_FWD
from fastroute.dataplane.saturation import Saturation
from fastroute.errors import RouterError
from fastroute.flowpolicy import (
    CLASSES,
    OTHER_TENANT,
    Bucket,
    ClassSpec,
    RateLimits,
    SchedulerPolicy,
    Tenants,
    class_index,
    flow_enabled,
    fold_tenants,
    load_rate_limits,
    load_scheduler,
    parse_tenant_keys,
)

log = logging.getLogger("fastroute.flow")

PRIORITY_HEADER = b"x-smg-priority"

# smg's reason codes.
QUEUE_FULL = "scheduler_queue_full"
QUEUE_TIMEOUT = "scheduler_queue_timeout"
RATE_LIMITED = "tenant_rate_limit_exceeded"
OVERLOAD_SHED = "worker_overload_protection_shed"
CLIENT_GONE = "scheduler_client_cancelled"
SHED = "scheduler_shed"  # fastroute's: a waiter dropped for a higher class (--flow-max-queued)
COUNTED_KEYS = 8192  # entries of the refusal or admission counters before a fold
TENANTS_AFTER_FOLD = 1024  # tenants that keep their name at a fold (the metrics show the top N of them)
BUCKETS_KEPT = 65536  # rate-limit scopes (tenant, rule) kept


def _no_answer(exc: RouterError) -> None:
    """A waiter's answer before enqueue sets it (never called)."""


class FlowWaiter(Waiter):
    """One queued request: the plain waiter, its class and tenant, and when it is promoted."""

    __slots__ = ("cls", "tenant", "promote_at", "held", "refuse")

    def __init__(
        self,
        start: Callable[[], None],
        expired: Callable[[], None],
        deadline: float,
        cls: int,
        tenant: str,
        promote_at: float,
    ) -> None:
        super().__init__(start, expired, deadline)
        self.cls = cls
        self.tenant = tenant
        self.promote_at = promote_at
        self.held: Any = None  # the tenant budget it reserved (given back if it never starts)
        self.refuse: Callable[[RouterError], None] = _no_answer  # answer it with this error


class _ClassQueue:
    """One class: its waiters in arrival order (expiry, starvation) and one FIFO per tenant
    (served round robin)."""

    __slots__ = ("spec", "order", "tenants")

    def __init__(self, spec: ClassSpec) -> None:
        self.spec = spec
        self.order: OrderedDict[FlowWaiter, None] = OrderedDict()
        self.tenants: OrderedDict[str, OrderedDict[FlowWaiter, None]] = OrderedDict()

    def push(self, w: FlowWaiter) -> None:
        self.order[w] = None
        q = self.tenants.get(w.tenant)
        if q is None:
            q = self.tenants[w.tenant] = OrderedDict()
        q[w] = None

    def remove(self, w: FlowWaiter) -> bool:
        if self.order.pop(w, 0) is not None:  # 0: absent
            return False
        q = self.tenants[w.tenant]
        del q[w]
        if not q:
            del self.tenants[w.tenant]
        return True

    def next_fair(self) -> FlowWaiter:
        """The head of the tenant whose turn it is; that tenant goes to the back."""
        tenant, q = next(iter(self.tenants.items()))
        w = next(iter(q))
        self.tenants.move_to_end(tenant)
        return w

    def oldest(self) -> FlowWaiter:
        return next(iter(self.order))


class FlowAdmission(Admission):
    """The admission of a process with flow control (see module docstring)."""

    def __init__(
        self,
        loop: Any,
        config: Any,
        policy: SchedulerPolicy | None,
        tenants: Tenants,
        limits: RateLimits | None,
        saturation: Any = None,
    ) -> None:
        if policy is None:  # one class: the legacy queue's size and timeout, FIFO over tenants
            specs = [ClassSpec(0, int(config.queue_size), float(config.queue_timeout_secs), math.inf)]
            policy = SchedulerPolicy(specs, {}, 0)
        ttls = [s.queue_timeout_secs for s in policy.classes]
        # The base's fields this class keeps (readonly in the compiled build, so given to its
        # constructor): enabled (limit 1 > 0), the sweep's period (a quarter of queue_timeout:
        # the sweep also re-checks saturation while requests wait) and ``queue``, every waiter
        # in arrival order (App.active, the sweep). Its limit and token bucket are never used.
        super().__init__(1, 0, max(0.2, min(ttls + [4.0 * float(config.load_monitor_interval)])), loop)
        self.running = 0  # admitted requests not yet ended (the base's ``active`` is its own)
        # Starts an admitted request's exchange (Endpoints.begin, set by the App once built).
        self.begin: Callable[[Any, Any, bytes, Any], None] = _unwired
        self.scheduler = len(policy.classes) > 1
        self.policy = policy
        self.classes = [_ClassQueue(s) for s in policy.classes]
        # Capacity (the scheduler's, as smg's): the ranks' reported max_running_requests, else
        # --max-concurrent-requests (-1: unlimited). A class may use it less the slots the
        # classes above it reserve.
        cap = int(config.max_concurrent_requests)
        self.capacity_fallback = cap if cap > 0 else math.inf
        # A class's reservation is held back whole from the classes below it (the start-up check
        # keeps their sum under the capacity; flowpolicy.BUILTIN_CLASSES reserve nothing).
        self._held_for = -1.0  # the capacity self._held was computed for
        self._held: list[float] = []
        self.tenants = tenants
        self.limits = limits
        self._buckets: dict[tuple[str, str], tuple[Any, Any]] = {}
        self.saturation = saturation
        self.shed = bool(config.worker_overload_shed)
        self.max_queued = int(config.flow_max_queued)
        self.retry_after_shed = str(max(1, math.ceil(float(config.load_monitor_interval)))).encode()
        self.refusals: dict[tuple[str, str, str], int] = {}
        self.admitted: dict[tuple[str, str], int] = {}
        self._api_key = bearer(config.api_key)

    # ---- the Admission interface ------------------------------------------------------------
    def try_enter(self) -> bool:
        return False  # every request goes through enqueue (Endpoints.wait)

    def leave(self) -> None:
        self.running -= 1
        if self.queue:
            self._drain()

    def cancel(self, w: Any) -> bool:
        if not isinstance(w, FlowWaiter) or not self.classes[w.cls].remove(w):
            return False
        del self.queue[w]
        self._give_back(w.held)
        self._refused(w.tenant, w.cls, CLIENT_GONE)
        return True

    def expire(self, now: float) -> int:
        n = 0
        for cq in self.classes:
            while cq.order:
                w = cq.oldest()
                if w.deadline > now:
                    break
                cq.remove(w)
                del self.queue[w]
                self._give_back(w.held)
                n += 1
                self._refused(w.tenant, w.cls, QUEUE_TIMEOUT)
                w.expired()
        if self.queue:
            if self.saturation is not None:
                self.saturation.forget()
            self._drain()  # loads may have changed since the last pass
        return n

    # ---- per request ------------------------------------------------------------------------
    def class_name(self, cls: int) -> str:
        return CLASSES[cls] if self.scheduler else "default"

    def _refused(self, tenant: str, cls: int, reason: str) -> None:
        k = (tenant, self.class_name(cls), reason)
        d = self.refusals
        d[k] = d.get(k, 0) + 1
        if len(d) > COUNTED_KEYS:
            _fold(d)

    def _refuse(self, proto: Any, req: Any, tenant: str, cls: int, exc: RouterError) -> None:
        self._refused(tenant, cls, exc.code)
        proto.send_error(exc, req)

    def enqueue(self, proto: Any, req: Any, path: bytes, meta: Any) -> bool:
        """Classify, limit, then admit now or queue (the flow path of every inference request)."""
        tenants = self.tenants
        tenant = None
        if tenants.has_keys:
            tid = tenants.by_key(req.auth)
            if tid is not None:
                tenant = "auth:" + tid
            elif self._api_key is None:
                # Tenant keys without --api-key: a data-plane key is still required (with
                # --api-key, Endpoints.handle let through only it or a tenant key).
                proto.send_error(_errors.invalid_api_key(), req)
                return True
        headers = _flow_headers(req.fwd) if req.fwd else {}
        if tenant is None:
            peer = None
            if tenants.header is None or tenants.header not in headers:
                t = getattr(proto, "transport", None)
                info = t.get_extra_info("peername") if t is not None else None
                peer = str(info[0]) if info else None
            tenant = tenants.resolve(None, headers.get(tenants.header) if tenants.header else None, peer)
        if self.scheduler:
            cls = max(class_index(headers.get(PRIORITY_HEADER)), self.policy.ceiling(tenant))
        else:
            cls = 0
        sat = self.saturation
        if sat is not None and self.shed and sat.saturated():
            self._refuse(proto, req, tenant, cls, self._shed_error())
            return True
        now = self.loop.time()
        now_ok = self._may_start(cls, now) and (sat is None or not sat.saturated())
        cq = self.classes[cls]
        spec = cq.spec
        if not now_ok and len(cq.order) >= spec.queue_size:
            self._refuse(proto, req, tenant, cls, self._full_error())
            return True
        if not now_ok and self.max_queued and len(self.queue) >= self.max_queued and not self._shed_below(cls):
            self._refuse(proto, req, tenant, cls, self._full_error())
            return True
        # The tenant's budget last: a request refused by the checks above never spent any, and
        # one that times out or whose client leaves while queued gets it back.
        held: Any = None
        if self.limits is not None:
            exc, held = self._rate_limit(tenant, meta)
            if exc is not None:
                self._refuse(proto, req, tenant, cls, exc)
                return True
        if now_ok:
            self.running += 1
            self._note_admitted(tenant, cls)
            self.begin(proto, req, path, meta)
            return True

        def start() -> None:
            proto.waiter = None
            if proto.closed:  # client left between the dequeue and this callback
                self.leave()
                return
            try:
                self.begin(proto, req, path, meta)
            except Exception:
                log.exception("request handling failed")

        def refuse(exc: RouterError) -> None:
            proto.waiter = None
            if not proto.closed:
                proto.send_error(exc, req)

        def expired() -> None:
            refuse(self._timeout_error())

        w = FlowWaiter(start, expired, now + spec.queue_timeout_secs, cls, tenant, now + spec.starvation_threshold_secs)
        w.held = held
        w.refuse = refuse
        cq.push(w)
        self.queue[w] = None
        proto.waiter = w
        return True

    def tenant_key(self, auth: bytes | None) -> bool:
        return self.tenants.by_key(auth) is not None

    def _shed_below(self, cls: int) -> bool:
        """Make room under --flow-max-queued: drop the newest waiter of the lowest class below
        ``cls`` (503 scheduler_shed); False when no class below it waits."""
        for c in range(len(self.classes) - 1, cls, -1):
            cq = self.classes[c]
            if cq.order:
                w = next(reversed(cq.order))
                cq.remove(w)
                del self.queue[w]
                self._give_back(w.held)
                self._refused(w.tenant, w.cls, SHED)
                w.refuse(
                    RouterError(
                        503,
                        SHED,
                        "Shed from the queue to make room for a request of a higher priority class",
                        ((b"Retry-After", b"2"),),
                    )
                )
                return True
        return False

    def _note_admitted(self, tenant: str, cls: int) -> None:
        k = (tenant, self.class_name(cls))
        d = self.admitted
        d[k] = d.get(k, 0) + 1
        if len(d) > COUNTED_KEYS:
            _fold(d)

    def slots(self) -> float:
        """Requests that may run at once (module docstring, step 5)."""
        sat = self.saturation
        if self.scheduler and sat is not None:
            c = sat.capacity()
            if c is not None:
                return c
        return self.capacity_fallback

    def room(self, cls: int, cap: float) -> float:
        """Slots class ``cls`` may fill: the capacity less the reservations of the classes above
        it; when the reservations do not fit under the capacity (an engine reports a smaller
        batch than the file assumed), they shrink in proportion and leave the lowest class one."""
        if cap != self._held_for:
            self._held_for = cap
            res = [spec.reserved(cap) for spec in self.policy.classes]
            total = sum(res)
            scale = max(0.0, cap - 1.0) / total if total >= cap else 1.0
            above = 0.0
            self._held = []
            for r in res:
                self._held.append(above)
                above += r * scale
        return cap - self._held[cls]

    def _may_start(self, cls: int, now: float) -> bool:
        """A class-``cls`` newcomer may start now: a slot is free for its class and no waiter of
        its class or a higher one is ahead of it."""
        if self.running >= self.room(cls, self.slots()):
            return False
        return all(not self.classes[c].order for c in range(cls + 1))

    def _pick(self, now: float) -> FlowWaiter | None:
        """The next waiter to start, or None (no slot it may use)."""
        active = self.running
        cap = self.slots()
        # Starvation: a waiter past its class's threshold goes first, with the whole capacity.
        for cq in self.classes:
            if cq.order and cq.oldest().promote_at <= now and active < cap:
                return cq.next_fair()
        for cls, cq in enumerate(self.classes):
            if cq.order:
                return cq.next_fair() if active < self.room(cls, cap) else None
        return None

    def _drain(self) -> None:
        sat = self.saturation
        now = self.loop.time()
        while self.queue:
            if sat is not None and sat.saturated():
                return
            w = self._pick(now)
            if w is None:
                return
            self.classes[w.cls].remove(w)
            del self.queue[w]
            self.running += 1
            self._note_admitted(w.tenant, w.cls)
            # Not inline: leave() runs inside another request's ending.
            self.loop.call_soon(w.start)

    # ---- refusals ---------------------------------------------------------------------------
    def _full_error(self) -> RouterError:
        if not self.scheduler:
            return _errors.queue_full()
        return RouterError(
            429, QUEUE_FULL, "Too many requests: the priority class queue is full", ((b"Retry-After", b"2"),)
        )

    def _timeout_error(self) -> RouterError:
        if not self.scheduler:
            return _errors.queue_timeout()
        return RouterError(
            503,
            QUEUE_TIMEOUT,
            "Request waited longer than its priority class's queue timeout",
            ((b"Retry-After", b"2"),),
        )

    def _shed_error(self) -> RouterError:
        return RouterError(
            503,
            OVERLOAD_SHED,
            "Every worker this request could use is overloaded",
            ((b"Retry-After", self.retry_after_shed),),
        )

    def _rate_limit(self, tenant: str, meta: Any) -> tuple[RouterError | None, Any]:
        """Reserve one request and the prompt's tokens in the tenant's scope (and its model
        rule's): (None, the reservation) when both afford it, else (the refusal, None)."""
        limits = self.limits
        assert limits is not None
        lim = limits.limits(tenant)
        model = getattr(meta, "model", None)
        rule = lim.rule_for(model if isinstance(model, str) else None)
        tokens = float(max(0, int(getattr(meta, "input_tokens", 0) or 0)))
        now = self.loop.time()
        scopes = [self._bucket(tenant, lim.scope)]
        if rule is not None:
            scopes.append(self._bucket(tenant, rule))
        wait = 0.0
        never = False
        for tb, rb in scopes:
            tb.fill(now)
            rb.fill(now)
            if tokens > tb.per_minute:
                never = True
            wait = max(wait, tb.wait(tokens), rb.wait(1.0))
        if never or wait > 0.0:
            headers: tuple[tuple[bytes, bytes], ...] = ()
            if not never:
                headers = ((b"Retry-After", str(max(1, math.ceil(wait))).encode()),)
            return RouterError(429, RATE_LIMITED, "Tenant rate limit exceeded for this request", headers), None
        for tb, rb in scopes:
            tb.level -= tokens
            rb.level -= 1.0
        return None, (scopes, tokens)

    @staticmethod
    def _give_back(held: Any) -> None:
        """Return a reservation of a request that never started (bounded by the buckets' size)."""
        if held is None:
            return
        scopes, tokens = held
        for tb, rb in scopes:
            tb.level = min(tb.per_minute, tb.level + tokens)
            rb.level = min(rb.per_minute, rb.level + 1.0)

    def _bucket(self, tenant: str, rule: Any) -> tuple[Any, Any]:
        key = (tenant, rule.rule_id)
        b = self._buckets.get(key)
        if b is None:
            if len(self._buckets) >= BUCKETS_KEPT:
                self._forget_buckets()
            b = self._buckets[key] = (Bucket(float(rule.tokens_per_minute)), Bucket(float(rule.requests_per_minute)))
        return b

    def _forget_buckets(self) -> None:
        """Make room among the rate-limit scopes: drop those refilled by now (a new one starts
        full, so nothing changes for them), then, if that freed less than a quarter, the oldest
        (their tenant may get up to a minute's allowance again)."""
        now = self.loop.time()
        kept = self._buckets
        full = [k for k, (tb, rb) in kept.items() if tb.fill(now) >= tb.per_minute and rb.fill(now) >= rb.per_minute]
        for k in full:
            del kept[k]
        excess = len(kept) - BUCKETS_KEPT * 3 // 4
        if excess > 0:
            for k in list(itertools.islice(kept, excess)):
                del kept[k]
        log.info(
            "flow control: forgot %d tenant rate-limit scopes (%d refilled), %d kept",
            len(full) + max(0, excess),
            len(full),
            len(kept),
        )


def _fold(d: dict) -> None:
    """Fold the counters of all but the busiest tenants into OTHER_TENANT, in place (the Stats
    hold this dict): at most TENANTS_AFTER_FOLD keep their names, and never more than half of
    them, so a fold always frees entries and the next one is as far away (a tenant may have many
    class and reason entries)."""
    tenants = len({k[0] for k in d})
    keep = min(TENANTS_AFTER_FOLD, tenants // 2)
    (folded,) = fold_tenants([d], keep)
    d.clear()
    d.update(folded)
    log.info("flow control: counters of %d tenants folded into %r", tenants - keep, OTHER_TENANT)


def _flow_headers(fwd: bytes) -> dict[bytes, bytes]:
    """The forwarded header lines, by lower-case name (read only on the flow path)."""
    out: dict[bytes, bytes] = {}
    for line in fwd.split(b"\r\n"):
        name, sep, value = line.partition(b":")
        if sep:
            out.setdefault(name.strip().lower(), value.strip())
    return out


def install(config: Any, loop: Any, limits: Any, upstreams: Any, registry: Any) -> FlowAdmission | None:
    """The App's admission when a flow flag is given (its ``begin`` is wired by the App), else
    None (the plain Admission stays)."""
    if not flow_enabled(config):
        return None
    policy = (
        load_scheduler(config.priority_scheduler_config, config.priority_scheduler_default_max_class)
        if config.priority_scheduler_enabled
        else None
    )
    tenants = Tenants(
        parse_tenant_keys(list(config.tenant_api_key)), bool(config.trust_tenant_header), config.tenant_header_name
    )
    rates = (
        load_rate_limits(config.tenant_rate_limit_config, bool(config.trust_tenant_header))
        if config.tenant_rate_limit_enabled
        else None
    )
    gate = config.priority_scheduler_enabled or config.worker_overload_shed
    saturation = Saturation(loop, registry, upstreams, config) if gate else None
    flow = FlowAdmission(loop, config, policy, tenants, rates, saturation)
    # The headers the flow reads arrive in req.fwd: the priority header, and the tenant header
    # when it is trusted (both are forwarded to the worker, which ignores them).
    flags = limits.header_flags
    flags[PRIORITY_HEADER] = flags.get(PRIORITY_HEADER, 0) | _F_FWD
    if tenants.header is not None:
        flags[tenants.header] = flags.get(tenants.header, 0) | _F_FWD
    return flow


def _unwired(proto: Any, req: Any, path: bytes, meta: Any) -> None:
    raise RuntimeError("FlowAdmission.begin was not wired to the endpoints")
