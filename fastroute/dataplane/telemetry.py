"""What a request tells the metrics: one object with a named method per event.

The data plane holds one :class:`Telemetry` per App (``app.tel``) and calls it at each event of a
request: ``request`` (a head arrived), ``routed`` (an inference request was parsed; its labels
are kept on the request), ``pick``, ``overhead``, ``response``, ``done`` (a relayed response and
its duration), ``ttft``, ``worker_error``, ``retry``, ``exhausted``, ``http_done``. With metrics
off the App holds the base class, whose methods do nothing, so the request path never asks whether
metrics run; with metrics on it holds :class:`RequestTelemetry`, which bumps the plain dicts and
histograms of a :class:`~fastroute.control.metrics.Stats` (turned into series at scrape time).
Label values come from tables built once (paths, methods, status codes) and per model
(:class:`PathLabels`): a request builds no label tuple.

Compiled (``telemetry.pxd``), each call is a C method call through the object's vtable.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from fastroute.auth import ADMIN_METHODS, WORKER_ITEM_PREFIX
from fastroute.dataplane._clock import monotonic
from fastroute.dataplane.routes import ENDPOINT_LABEL, INFERENCE, ROUTES
from fastroute.dataplane.upstream import TIMEOUT, ConnectError
from fastroute.names import label_value

if TYPE_CHECKING:
    from fastroute.control.metrics import Stats
    from fastroute.dataplane import _hist
    from fastroute.dataplane.body import RequestMeta

# Bounded label values (unknown paths and methods collapse to one value).
_PATH_LABEL = {p: p.decode() for p in (*ROUTES, b"/health", b"/liveness", *ADMIN_METHODS)}
_METHOD_LABEL = {m: m.decode() for m in (b"GET", b"POST", b"PUT", b"DELETE", b"HEAD", b"PATCH", b"OPTIONS")}
_STATUS_LABEL = {s.value: str(s.value) for s in HTTPStatus}
# (method, path) label pairs, built once.
_HTTP_KEY = {p: {m: (ml, pl) for m, ml in _METHOD_LABEL.items()} for p, pl in _PATH_LABEL.items()}
_HTTP_KEY_OTHER = {m: (ml, "other") for m, ml in _METHOD_LABEL.items()}
# /workers/<id>: one label, smg's route template (a raw id would make labels unbounded).
WORKER_PATH_LABEL = "/workers/{worker_id}"
_HTTP_KEY_WORKER = {m: (ml, WORKER_PATH_LABEL) for m, ml in _METHOD_LABEL.items()}

# Distinct request models that get a label of their own; later ones count as "other" (the
# model comes from clients, and labels must stay bounded).
MAX_MODEL_LABELS = 64
_OTHER_MODEL = "\0other"  # the label row's key for models past the limit (no client sends NUL)


def path_label(path: bytes | None) -> str:
    """The bounded ``path`` label of a request path (None: unknown, "other")."""
    if path is None:
        return "other"
    label = _PATH_LABEL.get(path)
    if label is None:
        label = WORKER_PATH_LABEL if path.startswith(WORKER_ITEM_PREFIX) else "other"
    return label


def http_key(method: bytes, path: bytes) -> tuple[str, str]:
    """The (method, path) labels of smg_http_requests_total and its duration histogram."""
    keys = _HTTP_KEY.get(path)
    if keys is None:
        keys = _HTTP_KEY_WORKER if path.startswith(WORKER_ITEM_PREFIX) else _HTTP_KEY_OTHER
    key = keys.get(method)
    return key if key is not None else ("OTHER", path_label(path))


class PathLabels:
    """The label tuples of one model's requests on one inference path."""

    __slots__ = ("routed", "routed_stream", "endpoint", "model", "ok")

    def __init__(self, backend: str, endpoint: str, model: str, path: str) -> None:
        # smg_router_requests_total (backend, endpoint, model, "false"), and with stream "true"
        self.routed = (backend, endpoint, model, "false")
        self.routed_stream = (backend, endpoint, model, "true")
        self.endpoint = (backend, endpoint, model)  # duration and request errors
        self.model = model  # the model label alone (smg_pd_ttft_seconds)
        self.ok = (_STATUS_LABEL[200], "", path)  # smg_http_responses_total of a 200 on the path


class Telemetry:
    """Metrics off: every event is dropped. :class:`RequestTelemetry` counts them."""

    __slots__ = ()

    def clock(self) -> float:
        """A start time for ``pick`` (0.0 here: nothing is timed)."""
        return 0.0

    def request(self, proto: Any, method: bytes, path: bytes) -> None:
        """A request head arrived: count it and start its smg_http duration (on ``proto``)."""

    def http_done(self, key: Any, t0: float) -> None:
        """A response is done: its smg_http duration since ``t0``."""

    def routed(self, path: bytes, meta: RequestMeta) -> PathLabels | None:
        """An inference request was parsed (every one counts once, whatever answers it). Answers
        its labels (None: none kept), for ``meta.labels``."""
        return None

    def overhead(self, proto: Any) -> None:
        """The router's own time from ``proto``'s complete request (``request`` stamped it) to the
        first attempt."""

    def pick(self, t0: float) -> None:
        """A policy decision that started at ``t0`` (a ``clock()`` value) is made."""

    def response(
        self, status: int, code: str, path: bytes | None = None, model: str | None = None, label: str | None = None
    ) -> None:
        """A response by status and error code, on ``path`` (or the path label ``label``)."""

    def reply(self, status: int, code: str, url: bytes, model: str | None = None) -> None:
        """``response`` for a request target ``url`` (its query, if any, is not part of the path)."""

    def done(self, status: int, path: bytes, meta: RequestMeta, started_at: float) -> None:
        """An inference response relayed to its end: ``response(status, "", path)``, and for a
        2xx the request's duration (``started_at``: a _clock.monotonic time)."""

    def ttft(self, path: bytes, meta: RequestMeta, started_at: float) -> None:
        """A PD request's decode answered its head (``started_at``: a _clock.monotonic time)."""

    def worker_error(self, registry: Any, target: int, result: Any) -> None:
        """``target``'s worker failed an attempt: a 5xx status, ``TIMEOUT`` or an exception."""

    def retry(self, role: str, path: bytes) -> None:
        """An attempt is dropped for another one."""

    def exhausted(self, role: str, path: bytes) -> None:
        """The last allowed attempt failed retryably."""

    def connections(self, delta: int) -> None:
        """Client connections opened (+1) or closed (-1)."""

    def rate_limit(self, result: str) -> None:
        """The token bucket's verdict on a request."""

    def reclaim(self, reason: str) -> None:
        """The leak net took back a lease its owner should have released."""


class RequestTelemetry(Telemetry):
    """Metrics on: each event bumps this process's :class:`~fastroute.control.metrics.Stats`."""

    __slots__ = (
        "stats",
        "backend",
        "_models",
        "_http_requests",
        "_http_responses",
        "_router_requests",
        "_router_errors",
        "_router_duration",
        "_http_duration",
        "_pd_ttft",
        "_worker_errors",
        "_retries",
        "_retries_exhausted",
        "_rate_limit",
        "_pick_seconds",
        "_overhead_seconds",
    )

    def __init__(self, stats: Stats, backend: str) -> None:
        self.stats = stats
        self.backend = backend  # "regular" or "pd": the backend label
        self._models: dict[Any, dict[bytes, PathLabels]] = {}
        # Stats makes its dicts and histograms once and only ever updates them in place: the
        # events hold them directly (in the compiled build, typed: see telemetry.pxd).
        self._http_requests = stats.http_requests
        self._http_responses = stats.http_responses
        self._router_requests = stats.router_requests
        self._router_errors = stats.router_errors
        self._router_duration = stats.router_duration
        self._http_duration = stats.http_duration
        self._pd_ttft = stats.pd_ttft
        self._worker_errors = stats.worker_errors
        self._retries = stats.retries
        self._retries_exhausted = stats.retries_exhausted
        self._rate_limit = stats.rate_limit
        self._pick_seconds = stats.pick_seconds
        self._overhead_seconds = stats.overhead_seconds

    def labels(self, model: str | None, path: bytes) -> PathLabels | None:
        """The label tuples of ``model``'s requests on inference path ``path``."""
        models = self._models
        row = models.get(model)
        if row is None:
            if len(models) >= MAX_MODEL_LABELS:  # past the bound: one shared "other" row
                model, label = _OTHER_MODEL, "other"
                row = models.get(model)
            else:
                label = label_value(model) if model is not None else "unknown"
            if row is None:
                b = self.backend
                row = models[model] = {p: PathLabels(b, e, label, path_label(p)) for p, e in ENDPOINT_LABEL.items()}
        return row.get(path)

    def _labels_of(self, meta: RequestMeta, path: bytes) -> PathLabels | None:
        """The labels ``routed`` kept on ``meta``, or (an exchange that did not come through
        ``routed``) the same looked up."""
        pl = meta.labels
        return pl if pl is not None else self.labels(meta.model, path)

    def _observe(self, h: _hist.Hist, v: float) -> None:
        h.observe(v)  # compiled: a C call through Hist's vtable (dataplane/_hist.pyx)

    def _observe_in(self, d: dict, key: Any, v: float) -> None:
        h = d.get(key)
        if h is None:
            self.stats.observe(d, key, v)  # makes the histogram with the configured buckets
        else:
            self._observe(h, v)

    def clock(self) -> float:
        return monotonic()

    def request(self, proto: Any, method: bytes, path: bytes) -> None:
        key = http_key(method, path)
        d = self._http_requests
        d[key] = d.get(key, 0) + 1
        proto.http_key = key  # the response's labels (ClientProtocol.response_done)
        proto.http_t0 = monotonic()

    def http_done(self, key: Any, t0: float) -> None:
        self._observe_in(self._http_duration, key, monotonic() - t0)

    def routed(self, path: bytes, meta: RequestMeta) -> PathLabels | None:
        pl = self.labels(meta.model, path)
        if pl is not None:
            d = self._router_requests
            key = pl.routed_stream if meta.stream else pl.routed
            d[key] = d.get(key, 0) + 1
        return pl

    def overhead(self, proto: Any) -> None:
        self._observe(self._overhead_seconds, monotonic() - proto.http_t0)

    def pick(self, t0: float) -> None:
        self._observe(self._pick_seconds, monotonic() - t0)

    def response(
        self, status: int, code: str, path: bytes | None = None, model: str | None = None, label: str | None = None
    ) -> None:
        d = self._http_responses
        key = (_STATUS_LABEL.get(status) or str(status), code, label if label is not None else path_label(path))
        d[key] = d.get(key, 0) + 1
        if code and path is not None:
            pl = self.labels(model, path)
            if pl is not None:  # an inference request failed: smg_router_request_errors
                e = self._router_errors
                key2 = pl.endpoint + (code,)
                e[key2] = e.get(key2, 0) + 1

    def reply(self, status: int, code: str, url: bytes, model: str | None = None) -> None:
        self.response(status, code, url.partition(b"?")[0], model)

    def done(self, status: int, path: bytes, meta: RequestMeta, started_at: float) -> None:
        pl = self._labels_of(meta, path)
        if status == 200 and pl is not None:
            d = self._http_responses  # response(200, "", path), its key built once per path
            d[pl.ok] = d.get(pl.ok, 0) + 1
        else:
            self.response(status, "", path)
        if pl is not None and 200 <= status < 300:
            self._observe_in(self._router_duration, pl.endpoint, monotonic() - started_at)

    def ttft(self, path: bytes, meta: RequestMeta, started_at: float) -> None:
        pl = self._labels_of(meta, path)
        if pl is not None:
            self._observe_in(self._pd_ttft, pl.model, monotonic() - started_at)

    def worker_error(self, registry: Any, target: int, result: Any) -> None:
        info = registry.target_info
        entry = info[target] if 0 <= target < len(info) else None
        role = entry[0].role if entry is not None else "unknown"
        if type(result) is int:
            kind = "status_%d" % result
        elif result is TIMEOUT:
            kind = "timeout"
        elif isinstance(result, ConnectError):
            kind = "connect_error"
        else:
            kind = "connection_error"
        d = self._worker_errors
        key = (role, kind)
        d[key] = d.get(key, 0) + 1

    def retry(self, role: str, path: bytes) -> None:
        d = self._retries
        key = (role, INFERENCE[path])
        d[key] = d.get(key, 0) + 1

    def exhausted(self, role: str, path: bytes) -> None:
        d = self._retries_exhausted
        key = (role, INFERENCE[path])
        d[key] = d.get(key, 0) + 1

    def connections(self, delta: int) -> None:
        self.stats.connections_active += delta

    def rate_limit(self, result: str) -> None:
        d = self._rate_limit
        d[result] = d.get(result, 0) + 1

    def reclaim(self, reason: str) -> None:
        self.stats.reclaim(reason)


NULL_TELEMETRY = Telemetry()  # the App's until metrics start
