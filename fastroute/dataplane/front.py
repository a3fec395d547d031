"""The per-request half of the App: the fields every request reads, and inference dispatch.

:class:`Front` is the base of :class:`~fastroute.dataplane.app.App`. It holds what the
data path reads on every request (the loop, the stats, the registry, admission, the routes,
the live exchanges, timeouts and switches) and the path an inference request takes from the
parsed head to its exchange: ``handle`` (labels, then inference or ``App.handle_other``),
``proxy`` (size, readiness, body parse, admission), ``begin`` and the per-request metric
updates. Everything else an App does (admin calls, health and CORS answers, routes, the sweep,
the lease safety net) stays in app.py.

Why a base class of its own: in the compiled build (``front.pxd``, Cython pure-Python mode)
Front is an extension type with typed fields, and the protocol and the exchanges declare their
``app`` as a Front, so reading ``app.timeout`` or calling ``app.count_response`` is a C field
read or a C call instead of a dictionary lookup and a Python frame. This module imports no other
data-plane module that imports it back (the protocol and the exchanges import it), so that the
compiled modules can name its type without an import cycle at start-up; the exchange class it
starts is handed in (``exchange_cls``).
"""

from __future__ import annotations

import asyncio
import random
from bisect import bisect_left
from collections.abc import Callable
from http import HTTPStatus
from time import perf_counter
from typing import TYPE_CHECKING, Any

from fastroute import errors as _errors
from fastroute.auth import authorized
from fastroute.dataplane import body as _body
from fastroute.dataplane.routes import ENDPOINT_LABEL, INFERENCE, ROUTES, pd_unsupported
from fastroute.errors import RouterError
from fastroute.names import label_value

if TYPE_CHECKING:
    from fastroute.config import Config
    from fastroute.control.metrics import Stats
    from fastroute.control.models import ModelGroups
    from fastroute.control.registry import Registry
    from fastroute.core.breaker import Breakers
    from fastroute.dataplane.admission import Admission
    from fastroute.dataplane.cors import Cors

# Bounded label values for metrics (unknown paths/methods collapse to one value).
_PATH_LABEL = {
    p: p.decode()
    for p in (
        *ROUTES,
        b"/health",
        b"/liveness",
        b"/readiness",
        b"/workers",
        b"/add_worker",
        b"/remove_worker",
        b"/list_workers",
        b"/get_loads",
        b"/flush_cache",
        b"/get_server_info",
        b"/server_info",
        b"/get_model_info",
        b"/model_info",
        b"/v1/models",
        b"/health_generate",
        b"/engine_metrics",
    )
}
_METHOD_LABEL = {m: m.decode() for m in (b"GET", b"POST", b"PUT", b"DELETE", b"HEAD", b"PATCH", b"OPTIONS")}
_STATUS_LABEL = {s.value: str(s.value) for s in HTTPStatus}
# Label tuples built once (a request looks them up, never builds one).
_HTTP_KEY = {p: {m: (ml, pl) for m, ml in _METHOD_LABEL.items()} for p, pl in _PATH_LABEL.items()}
_HTTP_KEY_OTHER = {m: (ml, "other") for m, ml in _METHOD_LABEL.items()}
# /workers/<id>: one label, smg's route template (a raw id would make labels unbounded).
WORKER_PATH_LABEL = "/workers/{worker_id}"
_HTTP_KEY_WORKER = {m: (ml, WORKER_PATH_LABEL) for m, ml in _METHOD_LABEL.items()}


def path_label(path: bytes | None) -> str:
    """The bounded ``path`` label of a request path (None: unknown, "other")."""
    if path is None:
        return "other"
    label = _PATH_LABEL.get(path)
    if label is None:
        label = WORKER_PATH_LABEL if path.startswith(b"/workers/") else "other"
    return label


# Distinct request models that get a label of their own; later ones count as "other" (the
# model comes from clients, and labels must stay bounded).
MAX_MODEL_LABELS = 64


class Front:
    """What every request reads from its App, and the inference path (see module docstring).

    The fields are set by ``App.__init__``; ``handle_other`` and ``wait`` are App's.
    """

    __slots__ = (
        "loop",
        "_stats",
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
        "_model_keys",
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
    )
    # The fields' types (front.pxd gives the compiled build's C types). The protocol, routes and
    # exchanges import this module, so their objects are Any here: naming them would be a cycle.
    loop: asyncio.AbstractEventLoop
    _stats: Stats | None
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
    _model_keys: dict[Any, dict[bytes, tuple[Any, ...]]]
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

    def handle(self, proto: Any, req: Any) -> None:
        """Answer one parsed request; ends with proto.response_done() (maybe later)."""
        path, _, query = req.url.partition(b"?")
        st = self._stats
        if st is not None:
            keys = _HTTP_KEY.get(path)
            if keys is None:
                keys = _HTTP_KEY_WORKER if path.startswith(b"/workers/") else _HTTP_KEY_OTHER
            key = keys.get(req.method)
            if key is None:
                key = ("OTHER", path_label(path))
            st.http_requests[key] = st.http_requests.get(key, 0) + 1
            # smg_http_request_duration_seconds: observed when the response is done
            proto.http_key = key
            proto.http_t0 = perf_counter()
        if req.method == b"POST" and path in INFERENCE:
            if self.api_key is not None and not authorized(self.api_key, path, req.auth):
                proto.send_error(_errors.invalid_api_key(), req)
            else:
                self.proxy(proto, req, path)
        else:
            self.handle_other(proto, req, path, query)

    def handle_other(self, proto: Any, req: Any, path: bytes, query: bytes) -> None:
        raise NotImplementedError  # App's: everything but a POST to an inference path

    def refuse_at_head(self, method: bytes, url: bytes, auth: bytes | None) -> RouterError | None:
        raise NotImplementedError  # App's: the admin auth rule, applied to a call's head

    def proxy(self, proto: Any, req: Any, path: bytes) -> None:
        """An inference request: refuse it, or parse its body and start (or queue) its exchange."""
        st = self._stats
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
            meta = _body.parse_request(spec.endpoint, req.body)
        except RouterError as exc:
            proto.send_error(exc, req)
            return
        if spec.tokens is not None:  # routes body.py has no batch rules for
            meta.input_tokens = spec.tokens(meta.obj)
        if self.igw:  # --enable-igw: the request's model must be one the router serves
            groups: ModelGroups = self.registry.group(self.model_role)  # type: ignore[assignment]  # --enable-igw groups by model
            refusal = groups.refusal(meta.model)
            if refusal is not None:
                proto.send_error(refusal, req)
                return
        # Every parsed inference request counts once here (whatever answers it:
        # relay, 429/408 admission, 503 no target, retries); malformed ones
        # count only in smg_http_responses_total.
        if st is not None:
            self._count_routed(path, meta)
        if self.admission.try_enter():
            self.begin(proto, req, path, meta)
            if st is not None:
                # fastroute_router_overhead_seconds: the router's own time from the complete
                # request to the first attempt written upstream (parse, admission, pick,
                # framing); a queued request's wait is admission, not overhead, so not here.
                self.observe(st.overhead_seconds, perf_counter() - proto.http_t0)
        else:
            self.wait(proto, req, path, meta)

    def wait(self, proto: Any, req: Any, path: bytes, meta: Any) -> None:
        raise NotImplementedError  # App's: queue behind --max-concurrent-requests, or refuse

    def begin(self, proto: Any, req: Any, path: bytes, meta: Any) -> None:
        """Start the exchange of an admitted request (it owns the admission slot from here)."""
        self.exchange_cls(self, proto, req, path, meta).attempt()

    def model_keys(self, model: str | None) -> dict[bytes, tuple]:
        """The prebuilt label keys of requests for ``model``, per inference path."""
        row = self._model_keys.get(model)
        if row is None:
            if len(self._model_keys) >= MAX_MODEL_LABELS:
                row = self._model_keys.get("\0other")
                if row is not None:
                    return row
                model, label = "\0other", "other"
            else:
                label = label_value(model) if model is not None else "unknown"
            b = self.backend
            row = self._model_keys[model] = {
                p: ((b, e, label, "false"), (b, e, label, "true"), (b, e, label), label)
                for p, e in ENDPOINT_LABEL.items()
            }
        return row

    def _count_routed(self, path: bytes, meta: Any) -> None:
        st: Stats = self._stats  # type: ignore[assignment]  # called only while metrics run
        d = st.router_requests
        key = self.model_keys(meta.model)[path][1 if meta.stream else 0]
        d[key] = d.get(key, 0) + 1

    def observe(self, h: Any, v: float) -> None:
        """``Hist.observe`` (control/metrics.py) for the data plane: called on a typed Front,
        it is a C call where the Hist method would be a Python frame per request."""
        h.counts[bisect_left(h.bounds, v)] += 1
        h.sum += v

    def observe_keyed(self, d: dict, key: Any, v: float) -> None:
        """``Stats.observe`` (the histogram ``d[key]``, made on first use) the same way."""
        h = d.get(key)
        if h is None:
            st: Stats = self._stats  # type: ignore[assignment]  # called only while metrics run
            st.observe(d, key, v)
        else:
            self.observe(h, v)

    def observe_http(self, key: tuple, t0: float) -> None:
        """A response is done (ClientProtocol.response_done): its smg_http duration."""
        st = self._stats
        if st is not None:
            self.observe_keyed(st.http_duration, key, perf_counter() - t0)

    def count_response(
        self, status: int, code: str, path: bytes | None = None, model: str | None = None, label: str | None = None
    ) -> None:
        """smg_http_responses (by status, error code and path: ``label``, else ``path``'s), and
        smg_router_request_errors for failed inference requests (called only while metrics
        run)."""
        st: Stats = self._stats  # type: ignore[assignment]  # see the docstring
        d = st.http_responses
        key = (_STATUS_LABEL.get(status) or str(status), code, label if label is not None else path_label(path))
        d[key] = d.get(key, 0) + 1
        if code and path is not None:
            keys = self.model_keys(model).get(path)
            if keys is not None:
                e = st.router_errors
                key2 = keys[2] + (code,)
                e[key2] = e.get(key2, 0) + 1
