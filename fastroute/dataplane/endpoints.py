"""What a path means: the inference path from a parsed request to its exchange, and the answers
to everything else (health, readiness, CORS preflights, admin calls, unknown paths).

One :class:`Endpoints` per proxy process; every client connection hands it each request in order
(``handle``). An inference request (a POST to a path of the route table, routes.py) is checked
(API key, size, readiness, PD support, ``--enable-igw`` models), parsed (body.py; tokenized first
under ``--tokenizer-path``, tokenize.py), counted, and admitted (admission.py): it starts its
exchange (:class:`~fastroute.dataplane.exchange.Relay`, or
:class:`~fastroute.dataplane.pd.PDRelay` under PD) at once, waits in the admission queue, or is
refused. The admin rule (``--api-key``, control-plane keys with roles) is applied here, at a
call's head when it carries a body (``refuse_at_head``, asked by the protocol before it reads
the body), else when it is complete; admin calls run as tasks on the registry's admin API.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import TYPE_CHECKING, Any

from fastroute import errors as _errors
from fastroute.auth import FORBIDDEN, OK, audit, authorized, bearer, is_admin_path, is_management
from fastroute.dataplane._splice import target_path
from fastroute.dataplane.body import parse_request
from fastroute.dataplane.exchange import Relay
from fastroute.dataplane.pd import PDRelay
from fastroute.dataplane.routes import INFERENCE, ROUTES, pd_unsupported
from fastroute.errors import RouterError

if TYPE_CHECKING:
    from fastroute.auth import AdminAuth
    from fastroute.config import Config
    from fastroute.control.models import ModelGroups
    from fastroute.dataplane.admission import Admission, Waiter
    from fastroute.dataplane.body import RequestMeta
    from fastroute.dataplane.limits import Limits
    from fastroute.dataplane.live import Live
    from fastroute.dataplane.protocol import ClientProtocol
    from fastroute.dataplane.request import Request
    from fastroute.dataplane.telemetry import Telemetry
    from fastroute.dataplane.tokenize import Tokens
    from fastroute.dataplane.upstreams import Upstreams

log = logging.getLogger("fastroute.proxy")

_HEALTH_KA = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: 2\r\n\r\nOK"
_HEALTH_KA10 = (  # an HTTP/1.0 request kept alive: the answer says so
    b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: 2\r\n"
    b"connection: keep-alive\r\n\r\nOK"
)
_HEALTH_CLOSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: 2\r\nconnection: close\r\n\r\nOK"
)
_DRAINING = b'{"status": "not ready", "reason": "draining: the router is shutting down"}'


class Endpoints:
    """The meaning of each path (module docstring).

    ``tel`` is the metrics' events (telemetry.py; the App swaps in the counting one when
    metrics run); ``tokens`` the tokenizer of ``--tokenizer-path`` (None without one);
    ``draining`` is set when the shutdown drain starts (``/readiness`` then answers 503).
    """

    __slots__ = (
        "tel",
        "tokens",
        "draining",
        "admin_tasks",
        "_limits",
        "_upstreams",
        "_live",
        "_admission",
        "_registry",
        "_admin_auth",
        "_loop",
        "_api_key",
        "_pd",
        "_igw",
        "_model_role",
        "_audit",
        "exchange",
    )

    def __init__(
        self,
        config: Config,
        limits: Limits,
        upstreams: Upstreams,
        live: Live,
        admission: Admission,
        registry: Any,
        admin_auth: AdminAuth,
        tel: Telemetry,
        loop: asyncio.AbstractEventLoop,
        tokens: Tokens | None = None,
        exchange: type[Relay] | type[PDRelay] | None = None,
    ) -> None:
        self._limits = limits
        self._upstreams = upstreams
        self._live = live
        self._admission = admission
        self._registry = registry
        self._admin_auth = admin_auth
        self._loop = loop
        self.tel = tel
        self.tokens = tokens
        self.draining = False
        self.admin_tasks: set[asyncio.Task] = set()
        self._api_key = bearer(config.api_key)
        self._pd = bool(config.pd_disaggregation)
        self._igw = bool(config.enable_igw)
        self._model_role = "decode" if self._pd else "regular"  # whose groups know the models
        self._audit = bool(config.control_plane_audit_enabled)
        # The exchange class it starts: Relay, or PDRelay under PD; a subclass that adds to it
        # when one is handed in (--enable-trace, --speed-aware).
        self.exchange: type[Relay] | type[PDRelay] = (
            exchange if exchange is not None else PDRelay if self._pd else Relay
        )

    # -- the inference path -------------------------------------------------------
    def handle(self, proto: ClientProtocol, req: Request) -> None:
        """Answer one parsed request; ends with proto.response_done() (maybe later)."""
        path = target_path(req.url)
        self.tel.request(proto, req.method, path)
        if req.method == b"POST" and path in INFERENCE:
            if (
                self._api_key is not None
                and not authorized(self._api_key, path, req.auth)
                and not self._admission.tenant_key(req.auth)
            ):
                proto.send_error(_errors.invalid_api_key(), req)
            else:
                self.proxy(proto, req, path)
        else:
            self.handle_other(proto, req, path, req.url.partition(b"?")[2])

    def proxy(self, proto: ClientProtocol, req: Request, path: bytes) -> None:
        """An inference request: refuse it, or parse its body and start (or queue) its exchange."""
        if req.too_large:
            proto.send_error(_errors.payload_too_large(req.body_len, self._limits.max_payload), req)
            return
        if not self._registry.ready():
            proto.send_error(
                RouterError(
                    503, _errors.CODE_NO_AVAILABLE_WORKERS, "No available workers (router is still registering workers)"
                ),
                req,
            )
            return
        spec = ROUTES[path]
        if self._pd and not spec.pd:
            proto.send_error(pd_unsupported(spec.path), req)
            return
        try:
            meta = parse_request(spec.endpoint, req.body)
        except RouterError as exc:
            proto.send_error(exc, req)
            return
        if spec.tokens is not None:  # routes body.py has no batch rules for
            meta.input_tokens = spec.tokens(meta.obj)
        if self._igw:  # --enable-igw: the request's model must be one the router serves
            groups: ModelGroups = self._upstreams.group(self._model_role)  # --enable-igw groups by model
            refusal = groups.refusal(meta.model)
            if refusal is not None:
                proto.send_error(refusal, req)
                return
        tokens = self.tokens
        if tokens is not None and not tokens.start(
            meta, spec.endpoint, self._loop, partial(self.admit, proto, req, path, meta)
        ):
            return  # tokenized in the pool: admit() follows on the loop
        self.admit(proto, req, path, meta)

    def admit(self, proto: ClientProtocol, req: Request, path: bytes, meta: RequestMeta) -> None:
        """Count a parsed inference request and start (or queue) its exchange."""
        if proto.closed:  # the client left while its prompt was tokenized: nothing was booked
            return
        # Every parsed inference request counts once here (whatever answers it:
        # relay, 429/408 admission, 503 no target, retries); malformed ones
        # count only in smg_http_responses_total.
        tel = self.tel
        meta.labels = tel.routed(path, meta)
        if self._admission.try_enter():
            self.begin(proto, req, path, meta)
            # fastroute_router_overhead_seconds: the router's own time from the complete
            # request to the first attempt written upstream (parse, admission, pick,
            # framing); a queued request's wait is admission, not overhead, so not here.
            tel.overhead(proto)
        else:
            self.wait(proto, req, path, meta)

    def begin(self, proto: ClientProtocol, req: Request, path: bytes, meta: RequestMeta) -> None:
        """Start the exchange of an admitted request (it owns the admission slot from here)."""
        self.exchange(
            proto, req, path, meta, self._upstreams, self._limits, self._live, self.tel, self._admission
        ).attempt()

    def wait(self, proto: ClientProtocol, req: Request, path: bytes, meta: RequestMeta) -> None:
        """Over --max-concurrent-requests: queue (FIFO) or refuse with 429 (with flow control,
        its classes take every request: admission.enqueue)."""
        if self._admission.enqueue(proto, req, path, meta):
            return

        def start() -> None:
            proto.waiter = None
            if proto.closed:  # client left between the dequeue and this callback
                self._admission.leave()
                return
            try:
                self.begin(proto, req, path, meta)
            except Exception:
                log.exception("request handling failed")

        def expired() -> None:
            proto.waiter = None
            if not proto.closed:
                proto.send_error(_errors.queue_timeout(), req)

        waiter = self._admission.wait(start, expired, self._loop.time())
        if waiter is None:
            proto.send_error(_errors.queue_full(), req)
            return
        proto.waiter = waiter

    def unqueue(self, waiter: Waiter, key: Any) -> None:
        """The client of a queued request left: drop it from the queue (counted as a 499 with
        the request's path labels ``key``, when it was still queued)."""
        if self._admission.cancel(waiter):
            self.tel.response(499, "client_closed", None, None, key[1] if key is not None else "other")

    # -- everything else ----------------------------------------------------------
    def handle_other(self, proto: ClientProtocol, req: Request, path: bytes, query: bytes) -> None:
        """Everything but a POST to an inference path: CORS preflight, a wrong method on an
        inference path, health, admin calls, unknown paths."""
        live = self._live
        if req.origin is not None and req.method == b"OPTIONS":
            # A CORS preflight (req.origin is only ever set with --cors-allowed-origins);
            # browsers send no credentials with it, so it is answered before any auth rule.
            ka = req.keep_alive and live.accepting
            self.tel.response(204, "", path)
            proto.reply(self._limits.cors.preflight(req.origin, req.acrh, ka, req.http11), ka)
        elif path in INFERENCE:  # any method but POST (handle proxies those)
            proto.send_error(
                RouterError(
                    405,
                    "method_not_allowed",
                    "Method Not Allowed (%s %s)" % (req.method.decode("latin-1"), path.decode("latin-1")),
                ),
                req,
            )
        elif path == b"/health" or path == b"/liveness":
            ka = req.keep_alive and live.accepting
            self.tel.response(200, "", path)
            data = (_HEALTH_KA if req.http11 else _HEALTH_KA10) if ka else _HEALTH_CLOSE
            if req.origin is not None:
                cors = self._limits.cors.headers_for(req.origin)
                if cors:
                    head, sep, rest = data.partition(b"\r\n")
                    data = head + sep + cors + rest
            proto.reply(data, ka)
        elif path == b"/readiness" and self.draining and req.method == b"GET":
            proto.reply_simple(503, b"application/json", _DRAINING, req)
        elif is_admin_path(path):
            who = None
            if self._limits.guarded:
                verdict, who = self._admin_auth.check(req.method, path, req.auth)
                if verdict != OK:
                    proto.send_error(self._refusal(req.method, path, verdict, who), req)
                    return
            if req.too_large:  # a chunked body past --max-payload-size (no length at the head)
                proto.send_error(_errors.payload_too_large(req.body_len, self._limits.max_payload), req)
                return
            task = self._loop.create_task(self._admin(proto, req, path, query, who))
            self.admin_tasks.add(task)
            task.add_done_callback(self.admin_tasks.discard)
        else:
            proto.send_error(_errors.unknown_url(req.method.decode("latin-1"), path.decode("latin-1")), req)

    def refuse_at_head(self, method: bytes, url: bytes, auth: bytes | None) -> RouterError | None:
        """The error for an admin call refused by the auth rule, decided from its head alone
        (the protocol asks before it reads the body); None when it may proceed, or when the
        path is not an admin path (answered as usual once the request is complete)."""
        path = url.partition(b"?")[0]
        if not is_admin_path(path):
            return None
        verdict, who = self._admin_auth.check(method, path, auth)
        if verdict == OK:
            return None
        return self._refusal(method, path, verdict, who)

    def _refusal(self, method: bytes, path: bytes, verdict: int, who: Any) -> RouterError:
        """The answer to an admin call the auth rule refused; a refused management change is
        audited like an applied one (its body was never read, so its target is unknown)."""
        if verdict == FORBIDDEN:
            exc = _errors.insufficient_role(who.role) if who is not None else _errors.admin_closed()
        else:
            exc = _errors.invalid_api_key()
        if self._audit and method not in (b"GET", b"HEAD") and is_management(path):
            audit(who, method.decode("latin-1"), path.decode("latin-1"), "-", "denied", exc.status)
        return exc

    async def _admin(self, proto: ClientProtocol, req: Request, path: bytes, query: bytes, who: Any = None) -> None:
        try:
            args = (
                req.method.decode("latin-1"),
                path.decode("latin-1"),
                query.decode("latin-1"),
                req.body,
                ((b"authorization", req.auth),) if req.auth is not None else (),
            )
            # The control-plane key that passed the check goes on to the handler's audit log.
            admin = self._registry.admin
            status, body, ctype = await (
                admin.handle_admin(*args) if who is None else admin.handle_admin(*args, principal=who)
            )
        except asyncio.CancelledError:
            raise
        except RouterError as exc:
            proto.send_error(exc, req)
            return
        except Exception:
            log.exception("admin handler failed for %s", path)
            proto.send_error(_errors.internal_error(), req)
            return
        if isinstance(ctype, str):
            ctype = ctype.encode("latin-1")
        proto.reply_simple(status, ctype, body, req)
