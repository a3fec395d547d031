"""The dispatcher: the fields every request reads, and the path of an inference request.

:class:`Dispatcher` holds what the data path reads on every request (the loop, the telemetry, the
registry, admission, the routes, the live exchanges, timeouts and switches, the retry backoff) and
takes an inference request from the parsed head to its exchange: ``handle`` (labels, then
inference or the owner's ``handle_other``), ``proxy`` (size, readiness, body parse, admission) and
``begin``; the metrics' events go to ``tel`` (telemetry.py). The client protocol and the exchanges
hold it as ``dispatch``.

Its ``owner`` (:class:`~fastroute.dataplane.app.App`, which builds it and holds it as
``app.dispatch``) answers what is not an inference request (admin calls, health, CORS
preflights, unknown paths), queues what admission holds back, applies the admin rule at a call's
head and builds a route the targets listener has not built.

Why a class of its own: in the compiled build (``dispatch.pxd``, Cython pure-Python mode) it is
an extension type with typed fields, and the protocol and the exchanges declare their
``dispatch`` as a Dispatcher, so reading ``dispatch.timeout`` or calling ``dispatch.tel.response``
is a C field read or a C call instead of a dictionary lookup and a Python frame. This module
imports no other data-plane module that imports it back (the protocol and the exchanges import
it), so that the compiled modules can name its type without an import cycle at start-up; the
exchange class it starts is handed in (``exchange_cls``).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from fastroute import errors as _errors
from fastroute.auth import authorized, bearer
from fastroute.dataplane._splice import target_path
from fastroute.dataplane.admission import Admission
from fastroute.dataplane.body import parse_request
from fastroute.dataplane.cors import Cors
from fastroute.dataplane.headerflags import header_flags
from fastroute.dataplane.routes import INFERENCE, ROUTES, pd_unsupported
from fastroute.dataplane.telemetry import NULL_TELEMETRY, Telemetry
from fastroute.errors import RouterError

if TYPE_CHECKING:
    from fastroute.config import Config
    from fastroute.control.models import ModelGroups
    from fastroute.control.registry import Registry
    from fastroute.core.breaker import Breakers


class Owner(Protocol):
    """What the dispatcher hands to the object that holds it (App)."""

    def handle_other(self, proto: Any, req: Any, path: bytes, query: bytes) -> None:
        """Answer everything but a POST to an inference path."""

    def wait(self, proto: Any, req: Any, path: bytes, meta: Any) -> None:
        """Queue an inference request behind --max-concurrent-requests, or refuse it."""

    def tenant_key(self, auth: bytes | None) -> bool:
        """Whether ``auth`` is a --tenant-api-key (asked only when --api-key did not match)."""

    def refuse_at_head(self, method: bytes, url: bytes, auth: bytes | None) -> RouterError | None:
        """The admin rule applied to a call's head (None: it may go on)."""

    def route(self, t: int) -> Any:
        """The route of target ``t`` when the targets listener has not built it."""


class Dispatcher:
    """What every request reads, and the inference path (see module docstring).

    ``__init__`` sets every field from the config and the parts the runtime hands in; the
    exchange class (``Relay`` or ``PDRelay``) comes from the owner, since the exchanges import
    this module.
    """

    __slots__ = (
        "loop",
        "tel",
        "registry",
        "admission",
        "routes",
        "exchanges",
        "connections",
        "breakers",
        "cors",
        "api_key",
        "config",
        "room_rng",
        "backend",
        "model_role",
        "exchange_cls",
        "max_attempts",
        "header_flags",
        "rid_headers",
        "key_headers",
        "max_payload",
        "timeout",
        "header_timeout",
        "idle_timeout",
        "sse_keepalive",
        "accepting",
        "pd",
        "igw",
        "guarded",
        "handshaking",
        "owner",
        "backoff_initial",
        "backoff_max",
        "backoff_mult",
        "backoff_jitter",
        "retry_rng",
        "tokens",
        "_groups",
    )
    # The fields' types (dispatch.pxd gives the compiled build's C types). The protocol, routes and
    # exchanges import this module, so their objects are Any here: naming them would be a cycle.
    loop: asyncio.AbstractEventLoop
    tel: Telemetry  # the metrics' events (telemetry.py; a null object while metrics are off)
    registry: Registry
    admission: Admission
    routes: dict[int, Any]
    exchanges: set[Any]
    connections: set[Any]
    breakers: Breakers | None
    cors: Cors
    api_key: bytes | None
    config: Config
    room_rng: random.Random
    backend: str
    model_role: str
    exchange_cls: Callable[..., Any]
    max_attempts: int
    header_flags: dict[bytes, int]
    rid_headers: tuple[bytes, ...]
    key_headers: tuple[bytes, ...]
    max_payload: int
    timeout: float
    header_timeout: float
    idle_timeout: float
    sse_keepalive: float
    accepting: bool
    pd: bool
    igw: bool
    guarded: bool
    handshaking: dict[Any, float]
    owner: Owner
    backoff_initial: float
    backoff_max: float
    backoff_mult: float
    backoff_jitter: float
    retry_rng: random.Random
    tokens: Any

    def __init__(
        self,
        owner: Owner,
        config: Config,
        registry: Registry,
        loop: asyncio.AbstractEventLoop,
        exchange_cls: Callable[..., Any],
        guarded: bool,
        room_rng: random.Random | None = None,
        breakers: Breakers | None = None,
    ) -> None:
        self.owner = owner
        self.config = config
        self.registry = registry
        self.loop = loop
        self.exchange_cls = exchange_cls
        self.pd = bool(config.pd_disaggregation)
        self.backend = "pd" if self.pd else "regular"
        self.model_role = "decode" if self.pd else "regular"  # whose groups know the models
        self.igw = bool(config.enable_igw)
        self.tel = NULL_TELEMETRY  # App.stats swaps in the counting one when metrics run
        self.routes = {}  # target row -> Route (App._targets_changed)
        self.exchanges = set()
        self.connections = set()
        # TLS connections accepted whose handshake has not finished -> when it must have
        # (accept + --header-read-timeout-secs, the listener's handshake timeout). Counted in
        # smg_http_connections_active from the accept, like any other open connection.
        self.handshaking = {}
        self.accepting = True
        self.max_payload = int(config.max_payload_size)
        self.timeout = float(config.request_timeout_secs)
        self.header_timeout = float(config.header_read_timeout_secs)
        self.idle_timeout = float(config.idle_connection_timeout_secs)
        # SSE keep-alive comments while a stream waits for its first upstream byte (0: off).
        self.sse_keepalive = float(config.sse_keepalive_secs)
        self.max_attempts = config.max_attempts
        self.breakers = breakers
        self.room_rng = room_rng if room_rng is not None else random.Random(config.seed)
        self.admission = Admission(
            int(config.max_concurrent_requests),
            int(config.queue_size),
            float(config.queue_timeout_secs),
            loop,
            rate=config.rate_limit_tokens_per_second,
        )
        self.api_key = bearer(config.api_key)
        self.guarded = guarded  # an admin rule is configured: admin calls are checked at the head
        self.cors = Cors(config.cors_allowed_origins)
        self.header_flags, self.rid_headers, self.key_headers = header_flags(
            config.request_id_headers, config.routing_key_headers, self.cors.enabled
        )
        # Retries (protocol.md 7.2): exponential backoff with jitter between attempts.
        self.backoff_initial = float(config.retry_initial_backoff_ms) / 1000.0
        self.backoff_max = float(config.retry_max_backoff_ms) / 1000.0
        self.backoff_mult = float(config.retry_backoff_multiplier)
        self.backoff_jitter = float(config.retry_jitter_factor)
        self.retry_rng = random.Random(config.seed)
        # Exact tokens (dataplane/tokenize.py), set by the App when --tokenizer-path is given.
        self.tokens = None
        # role -> the registry's group, asked once: a Registry makes its groups when it is built
        # and never replaces them, so a pick costs a dict lookup, not a Python call.
        self._groups: dict[str, Any] = {}

    def handle(self, proto: Any, req: Any) -> None:
        """Answer one parsed request; ends with proto.response_done() (maybe later)."""
        path = target_path(req.url)
        self.tel.request(proto, req.method, path)
        if req.method == b"POST" and path in INFERENCE:
            if (
                self.api_key is not None
                and not authorized(self.api_key, path, req.auth)
                and not self.owner.tenant_key(req.auth)
            ):
                proto.send_error(_errors.invalid_api_key(), req)
            else:
                self.proxy(proto, req, path)
        else:
            self.owner.handle_other(proto, req, path, req.url.partition(b"?")[2])

    def proxy(self, proto: Any, req: Any, path: bytes) -> None:
        """An inference request: refuse it, or parse its body and start (or queue) its exchange."""
        if req.too_large:
            proto.send_error(_errors.payload_too_large(req.body_len, self.max_payload), req)
            return
        if not self.registry.ready():
            proto.send_error(
                RouterError(
                    503, _errors.CODE_NO_AVAILABLE_WORKERS, "No available workers (router is still registering workers)"
                ),
                req,
            )
            return
        spec = ROUTES[path]
        if self.pd and not spec.pd:
            proto.send_error(pd_unsupported(spec.path), req)
            return
        try:
            meta = parse_request(spec.endpoint, req.body)
        except RouterError as exc:
            proto.send_error(exc, req)
            return
        if spec.tokens is not None:  # routes body.py has no batch rules for
            meta.input_tokens = spec.tokens(meta.obj)
        if self.igw:  # --enable-igw: the request's model must be one the router serves
            groups: ModelGroups = self.group(self.model_role)  # --enable-igw groups by model
            refusal = groups.refusal(meta.model)
            if refusal is not None:
                proto.send_error(refusal, req)
                return
        tokens = self.tokens
        if tokens is not None and not tokens.start(
            meta, spec.endpoint, self.loop, partial(self.admit, proto, req, path, meta)
        ):
            return  # tokenized in the pool: admit() follows on the loop
        self.admit(proto, req, path, meta)

    def admit(self, proto: Any, req: Any, path: bytes, meta: Any) -> None:
        """Count a parsed inference request and start (or queue) its exchange."""
        if proto.closed:  # the client left while its prompt was tokenized: nothing was booked
            return
        # Every parsed inference request counts once here (whatever answers it:
        # relay, 429/408 admission, 503 no target, retries); malformed ones
        # count only in smg_http_responses_total.
        tel = self.tel
        meta.labels = tel.routed(path, meta)
        if self.admission.try_enter():
            self.begin(proto, req, path, meta)
            # fastroute_router_overhead_seconds: the router's own time from the complete
            # request to the first attempt written upstream (parse, admission, pick,
            # framing); a queued request's wait is admission, not overhead, so not here.
            tel.overhead(proto)
        else:
            self.owner.wait(proto, req, path, meta)

    def group(self, role: str) -> Any:
        """The registry's group of ``role`` (``registry.group``, remembered)."""
        g = self._groups.get(role)
        if g is None:
            g = self._groups[role] = self.registry.group(role)
        return g

    def begin(self, proto: Any, req: Any, path: bytes, meta: Any) -> None:
        """Start the exchange of an admitted request (it owns the admission slot from here)."""
        self.exchange_cls(self, proto, req, path, meta).attempt()

    def backoff(self, retry: int) -> float:
        """Delay in seconds before retry number ``retry`` (0-based), with jitter (7.2)."""
        d = min(self.backoff_initial * self.backoff_mult**retry, self.backoff_max)
        j = self.backoff_jitter
        return d * self.retry_rng.uniform(1.0 - j, 1.0 + j) if j else d
