"""The admin and info HTTP API (protocol.md 6.2-6.6) over the worker registry.

:class:`AdminAPI` is the half of :class:`~fastroute.control.registry.Registry` that answers HTTP:
``handle_admin`` routes one request to its handler, which reads the registry's workers and the
shared table and answers ``(status, body, content-type)``. The registry holds one as
``registry.admin``, the object the data plane and the supervisor's control listener call.
Authentication is :mod:`fastroute.auth`'s one rule; error bodies come from :mod:`fastroute.errors`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import uuid
from collections.abc import Iterable, Mapping
from datetime import datetime, timezone
from typing import Any, Protocol
from urllib.parse import parse_qs

from fastroute import __version__
from fastroute.auth import ADMIN_METHODS, FORBIDDEN, OK, AdminAuth, ControlPlaneKey, audit, is_management
from fastroute.config import Config
from fastroute.control import httpclient
from fastroute.control.background import Background
from fastroute.control.dashboard import PAGE_POLLED, Dashboard
from fastroute.control.httpclient import HttpClientError
from fastroute.control.selfaddr import SelfWorker
from fastroute.control.worker import BadWorkerURL, DuplicateWorker, Worker, check_fields, normalize_url
from fastroute.control.workerjson import polled, worker_json
from fastroute.core.table import TargetTable
from fastroute.errors import (
    CODE_BAD_REQUEST,
    CODE_NO_AVAILABLE_WORKERS,
    RouterError,
    admin_closed,
    bad_gateway,
    insufficient_role,
    internal_error,
    invalid_api_key,
    unknown_url,
)

# "fastroute.workers": the name operators filter worker changes on.
log = logging.getLogger("fastroute.workers")

_JSON = b"application/json"
_TEXT = b"text/plain; charset=utf-8"
_PROM = b"text/plain; version=0.0.4; charset=utf-8"

# Longest time legacy POST /add_worker waits for the handshake before answering 202.
LEGACY_ADD_WAIT_SECS = 2.0

# Management-route changes are what --control-plane-audit-enabled records.
_READS = frozenset({"GET", "HEAD"})


def request_header(headers: Any, name: str) -> str | None:
    """Case-insensitive header lookup over a mapping or a list of (name, value) pairs (str/bytes)."""
    if headers is None:
        return None
    items = headers.items() if hasattr(headers, "items") else headers
    for k, v in items:
        if isinstance(k, bytes):
            k = k.decode("latin-1")
        if k.lower() == name:
            return v.decode("latin-1") if isinstance(v, bytes) else v
    return None


def _text(body: bytes | str) -> str:
    return body.decode("utf-8", "replace") if isinstance(body, bytes) else body


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


# Handlers raise RouterError; handle_admin turns it into (status, JSON body, content-type).
def _bad_request(message: str) -> RouterError:
    return RouterError(400, CODE_BAD_REQUEST, message)


def _invalid(message: str) -> RouterError:
    return RouterError(422, "invalid_request", message)


def _no_workers() -> RouterError:
    return RouterError(503, CODE_NO_AVAILABLE_WORKERS, "No workers registered")


def _refused(exc: ValueError) -> RouterError:
    """Why a worker was not added: 409 for one that exists or is the router, else 400."""
    if isinstance(exc, DuplicateWorker):
        return RouterError(409, "worker_already_exists", str(exc))
    if isinstance(exc, SelfWorker):
        return RouterError(409, "worker_is_router", str(exc))
    return RouterError(400, CODE_BAD_REQUEST, str(exc))


def _accepted(w: Worker, change: str, **extra: str) -> tuple[int, bytes, bytes]:
    """The 202 of a worker change that goes on in the background (``change``: addition,
    update, removal); ``extra`` fields go before the message, where the bodies had them."""
    doc = {"status": "accepted", "worker_id": w.id, "url": w.url, **extra}
    doc["message"] = f"Worker {change} queued for background processing"
    return 202, _json(doc), _JSON


def _method_not_allowed(method: str, path: str) -> RouterError:
    return RouterError(405, "method_not_allowed", f"Method {method} not allowed on {path}")


class Workers(Protocol):
    """What the admin API reads and calls on its registry (control/registry.py's Registry)."""

    config: Config
    table: TargetTable
    workers: list[Worker]
    admin_auth: AdminAuth
    background: Background

    def ready(self) -> bool: ...
    def ready_workers(self, role: str | None = None) -> list[Worker]: ...
    def healthy_workers(self, role: str) -> list[Worker]: ...
    def auth_headers(self, w: Worker) -> dict[str, str] | None: ...
    def find(self, url: str) -> Worker | None: ...
    def get(self, worker_id: str) -> Worker | None: ...
    def add_worker(
        self,
        url: str,
        role: str,
        *,
        bootstrap_port: int | None = None,
        model_id: str | None = None,
        priority: int | None = None,
        cost: float | None = None,
        labels: Mapping[str, str] | None = None,
        api_key: str | None = None,
    ) -> Worker: ...
    async def wait_registered(self, w: Worker, timeout: float | None = None) -> bool: ...
    def remove_worker(self, w: Worker) -> None: ...


class Forwarder(Protocol):
    """Who answers some admin calls in another process (AdminAPI.forwarder)."""

    def forwards(self, method: str, path: str) -> bool: ...

    async def forward(
        self, method: str, path: str, query: str, body: bytes, headers: Any
    ) -> tuple[int, bytes, bytes]: ...


class AdminAPI:
    """The admin endpoints over one :class:`~fastroute.control.registry.Registry`, which holds
    it as ``registry.admin``.

    Reads the registry's workers, table and config and calls its public operations (add,
    remove, find, wait for registration); keeps no state but the random source that picks
    the worker ``/health_generate`` probes. ``forwarder``, when set, answers the calls it
    ``forwards`` itself (a proxy child hands worker changes to its supervisor,
    :class:`~fastroute.control.follower.FollowerRegistry`)."""

    def __init__(self, registry: Workers, forwarder: Forwarder | None = None) -> None:
        self.registry = registry
        self.forwarder = forwarder
        self._rng = random.Random(registry.config.seed)
        # The live view on the main port (GET /dashboard/snapshot), from this process's registry
        # and the shared table; its ``monitor`` is set where this process polls the engines.
        self.dashboard = Dashboard(registry.table, registry)

    # ---- admin endpoints ----------------------------------------------------------------------
    async def handle_admin(
        self, method: str, path: str, query: str, body: bytes, headers: Any, principal: ControlPlaneKey | None = None
    ) -> tuple[int, bytes, bytes]:
        """Serve one admin/info request -> (status, body, content-type).

        Authentication is the one rule of :class:`fastroute.auth.AdminAuth`, decided on the
        head alone: by the proxy, which passes the control-plane key that passed as
        ``principal``, or here for callers that did not decide (the supervisor's control
        listener). A management change is audited here unless :meth:`forwards` hands it to
        the process that applies it (which audits it then)."""
        key: ControlPlaneKey | None
        if principal is not None:
            verdict, key = OK, principal
        else:
            got = request_header(headers, "authorization")
            verdict, key = self.registry.admin_auth.check(
                method.encode("latin-1"), path.encode("latin-1"), None if got is None else got.encode("latin-1")
            )
        audited = (
            self.registry.config.control_plane_audit_enabled
            and method not in _READS
            and is_management(path.encode("latin-1"))
        )
        if verdict != OK:
            if audited:
                self._audit(key, method, path, query, body, "denied", verdict)
            if verdict == FORBIDDEN:
                return _error(insufficient_role(key.role) if key is not None else admin_closed())
            return _error(invalid_api_key())
        fwd = self.forwarder
        if fwd is not None and fwd.forwards(method, path):
            # Applied (and audited) by the process the forwarder hands the call to.
            return await fwd.forward(method, path, query, body, headers)
        # The target is read before the change: a DELETE /workers/{id} removes what names it.
        target = _audit_target(self.registry, method, path, query, body) if audited else "-"
        result = await self._dispatch(method, path, query, body, headers)
        if audited:
            audit(key, method, path, target, "success" if result[0] < 400 else "error", result[0])
        return result

    def _audit(
        self, key: ControlPlaneKey | None, method: str, path: str, query: str, body: bytes, outcome: str, status: int
    ) -> None:
        """One control_plane_audit line: who, what, on which worker, how it ended (never the
        secret: only the key's id and role)."""
        audit(key, method, path, _audit_target(self.registry, method, path, query, body), outcome, status)

    async def _dispatch(
        self, method: str, path: str, query: str, body: bytes, headers: Any
    ) -> tuple[int, bytes, bytes]:
        """Route an authenticated admin request to its handler."""
        try:
            if path == "/workers":  # ADMIN_METHODS: GET lists, POST adds
                if method == "GET":
                    return self._list_workers()
                if method == "POST":
                    return self._post_worker(body)
                raise _method_not_allowed(method, path)
            if path.startswith("/workers/"):
                return self._worker_item(method, path[len("/workers/") :], body)
            handler = self._ROUTES.get(path)
            if handler is None:
                raise unknown_url(method, path)
            allowed, fn = handler
            if method not in allowed:
                raise _method_not_allowed(method, path)
            return await fn(self, method, query, body)
        except RouterError as exc:
            return _error(exc)
        except Exception as exc:  # an admin bug must answer 500, not drop the connection
            log.exception("admin %s %s failed", method, path)
            return _error(internal_error(str(exc)))

    def _list_workers(self) -> tuple[int, bytes, bytes]:
        ws = [worker_json(w, self.registry.table) for w in self.registry.workers]
        stats = {
            f"{r}_count": sum(1 for w in self.registry.workers if w.role == r) for r in ("prefill", "decode", "regular")
        }
        return 200, _json({"workers": ws, "total": len(ws), "stats": stats}), _JSON

    def _post_worker(self, body: bytes) -> tuple[int, bytes, bytes]:
        try:
            req = json.loads(body) if body else None
        except ValueError:
            raise _bad_request("Request body is not valid JSON") from None
        if not isinstance(req, dict) or not isinstance(req.get("url"), str) or not req["url"]:
            raise _invalid("Field `url` (string) is required")
        role = req.get("worker_type") or "regular"
        bport = req.get("bootstrap_port")
        if bport is not None and (not isinstance(bport, int) or isinstance(bport, bool)):
            raise _invalid("bootstrap_port must be an integer or null")
        labels = req.get("labels")
        if labels is not None and not isinstance(labels, dict):
            raise _invalid("labels must be an object")
        try:
            w = self.registry.add_worker(
                req["url"],
                role,
                bootstrap_port=bport,
                model_id=req.get("model_id"),
                priority=req.get("priority"),
                cost=req.get("cost"),
                labels=labels,
                api_key=req.get("api_key"),
            )
        except ValueError as exc:
            raise _refused(exc) from None
        return _accepted(w, "addition", location=f"/workers/{w.id}")

    def _worker_item(self, method: str, wid: str, body: bytes) -> tuple[int, bytes, bytes]:
        try:
            uuid.UUID(wid)
        except ValueError:
            raise _bad_request(f"Invalid worker id {wid!r} (expected a UUID)") from None
        w = self.registry.get(wid)
        if w is None:
            raise RouterError(404, "worker_not_found", f"Worker {wid} not found")
        if method == "GET":
            return 200, _json(worker_json(w, self.registry.table)), _JSON
        if method == "PUT":
            try:
                upd = json.loads(body) if body else {}
            except ValueError:
                raise _bad_request("Request body is not valid JSON") from None
            if not isinstance(upd, dict):
                raise _invalid("Expected a JSON object")
            try:
                # The same rules as POST /workers (worker.check_fields), all checked first so a
                # refused update changes nothing.
                check_fields(upd.get("priority"), upd.get("cost"))
                if "priority" in upd:
                    w.priority = int(upd["priority"])
                if "cost" in upd:
                    w.cost = float(upd["cost"])
                if isinstance(upd.get("labels"), dict):
                    w.labels = {str(k): str(v) for k, v in upd["labels"].items()}
            except (TypeError, ValueError) as exc:
                raise _invalid(str(exc)) from None
            return _accepted(w, "update")
        if method == "DELETE":
            self.registry.remove_worker(w)
            return _accepted(w, "removal")
        raise _method_not_allowed(method, f"/workers/{wid}")

    # Legacy API (sglang-router <= 0.2.x): plain-text answers, synchronous registration.
    async def _add_worker_legacy(self, method: str, query: str, body: bytes) -> tuple[int, bytes, bytes]:
        q = parse_qs(query)
        url = (q.get("url") or [""])[0]
        if not url:
            return 400, b"Missing url query parameter", _TEXT
        role = (q.get("worker_type") or ["regular"])[0]
        bport = None
        if q.get("bootstrap_port"):
            raw = q["bootstrap_port"][0]
            if raw.lower() != "none":
                try:
                    bport = int(raw)
                except ValueError:
                    return 400, f"Invalid bootstrap_port: {raw}".encode(), _TEXT
        try:
            w = self.registry.add_worker(url, role, bootstrap_port=bport)
        except (SelfWorker, BadWorkerURL) as exc:
            return _error(_refused(exc))  # JSON, like POST /workers
        except ValueError as exc:
            return 400, str(exc).encode(), _TEXT
        # sglang-router answered once the worker was up, which for one that is down took the
        # whole --worker-startup-timeout-secs (clients gave up first). A worker that answers
        # registers within the bound; past it the answer is 202 and registration goes on in
        # the background, as with POST /workers.
        if await self.registry.wait_registered(w, LEGACY_ADD_WAIT_SECS):
            return 200, f"Successfully added worker: {w.url}".encode(), _TEXT
        if w.status == "pending":
            return (
                202,
                (
                    f"Worker addition accepted, registration continues in the background: {w.url} (see /workers/{w.id})"
                ).encode(),
                _TEXT,
            )
        return 400, f"Failed to add worker {w.url}: {w.error}".encode(), _TEXT

    async def _remove_worker_legacy(self, method: str, query: str, body: bytes) -> tuple[int, bytes, bytes]:
        url = (parse_qs(query).get("url") or [""])[0]
        if not url:
            return 400, b"Missing url query parameter", _TEXT
        w = self.registry.find(url)
        if w is None:
            return 404, f"Worker {normalize_url(url)} not found".encode(), _TEXT
        self.registry.remove_worker(w)
        return 200, f"Successfully removed worker: {w.url}".encode(), _TEXT

    async def _list_workers_legacy(self, method: str, query: str, body: bytes) -> tuple[int, bytes, bytes]:
        return 200, _json({"urls": [w.url for w in self.registry.workers if w.status == "ready"]}), _JSON

    async def _get_loads(self, method: str, query: str, body: bytes) -> tuple[int, bytes, bytes]:
        tab = self.registry.table
        loads = []
        legacy = []
        agg = {
            "total_in_flight_requests": 0,
            "total_in_flight_tokens": 0,
            "total_running_reqs": 0,
            "total_waiting_reqs": 0,
            "total_used_tokens": 0,
        }
        for w in self.registry.ready_workers():
            tokens_sum = 0
            complete = True
            for i, (t, name) in enumerate(zip(w.targets, w.names)):
                p = polled(self.registry.table, t)
                inf, inf_tok = tab.in_flight(t), tab.in_flight_tokens(t)
                loads.append(
                    {
                        "name": name,
                        "worker": w.url,
                        "worker_id": w.id,
                        "worker_type": w.role,
                        "dp_rank": (w.rank_ids[i] if w.rank_ids else i) if w.split else None,
                        "is_healthy": w.target_healthy(i),
                        "in_flight_requests": inf,
                        "in_flight_tokens": inf_tok,
                        **p,
                    }
                )
                agg["total_in_flight_requests"] += inf
                agg["total_in_flight_tokens"] += inf_tok
                if p["polled_at_ms"] is None:
                    complete = False
                else:
                    agg["total_running_reqs"] += p["num_running_reqs"]
                    agg["total_waiting_reqs"] += p["num_waiting_reqs"]
                    agg["total_used_tokens"] += p["num_used_tokens"]
                    tokens_sum += p["num_used_tokens"]
            # sglang-router shape: Σ tokens per worker, -1 when unknown.
            legacy.append({"worker": w.url, "load": tokens_sum if complete else -1})
        doc = {
            "timestamp": datetime.now(timezone.utc).isoformat(),
            "version": f"fastroute-{__version__}",
            "dp_rank_count": len(loads),
            "loads": loads,
            "aggregate": agg,
            "workers": legacy,
        }
        speed = getattr(getattr(self.registry, "router", None), "speed", None)
        if speed is not None:  # --speed-aware: each server's fitted speed
            doc["speed"] = speed.report()
        return 200, _json(doc), _JSON

    async def _fan_out(
        self, workers: Iterable[Worker], method: str, path: str, timeout: float
    ) -> list[tuple[Worker, int | None, bytes | str]]:
        """Same request to many workers concurrently -> (worker, status or None, body or error)."""

        async def one(w: Worker) -> tuple[Worker, int | None, bytes | str]:
            try:
                status, _, body = await httpclient.request(
                    method, w.url + path, headers=self.registry.auth_headers(w), timeout=timeout
                )
                return w, status, body
            except HttpClientError as exc:
                return w, None, str(exc)

        return list(await asyncio.gather(*(one(w) for w in workers)))

    def _admin_timeout(self) -> float:
        return max(float(self.registry.config.health_check_timeout_secs), 5.0)

    async def _flush_cache(self, method: str, query: str, body: bytes) -> tuple[int, bytes, bytes]:
        ws = self.registry.ready_workers()
        results = await self._fan_out(ws, "POST", "/flush_cache", self._admin_timeout())
        failed = []
        for w, status, rbody in results:
            if status is None:
                failed.append({"worker": w.url, "error": rbody})
            elif not 200 <= status < 300:
                text = rbody.decode("utf-8", "replace")[:200] if isinstance(rbody, bytes) else rbody
                failed.append({"worker": w.url, "error": f"HTTP {status}: {text}"})
        n, ok = len(ws), len(ws) - len(failed)
        doc: dict[str, Any] = {"workers_flushed": ok, "total_http_workers": n, "total_workers": n}
        if not failed:
            doc = {"status": "success", "message": f"Successfully flushed cache on all {n} HTTP workers", **doc}
            return 200, _json(doc), _JSON
        # Some flushed -> 206 partial; none flushed -> 502 (no worker honoured the request).
        doc = {
            "status": "partial_success" if ok else "failed",
            "message": f"Flushed cache on {ok} of {n} HTTP workers",
            **doc,
            "failed": failed,
        }
        return (206 if ok else 502), _json(doc), _JSON

    async def _engine_metrics(self, method: str, query: str, body: bytes) -> tuple[int, bytes, bytes]:
        ws = self.registry.ready_workers()
        if not ws:
            raise _no_workers()
        results = await self._fan_out(ws, "GET", "/metrics", self._admin_timeout())
        out: list[str] = []
        seen_meta: set[str] = set()
        got = 0
        for w, status, rbody in results:
            if status != 200 or not isinstance(rbody, bytes):
                continue
            got += 1
            label = 'worker="' + w.url.replace("\\", "\\\\").replace('"', '\\"') + '"'
            for line in rbody.decode("utf-8", "replace").splitlines():
                if not line.strip():
                    continue
                if line.startswith("#"):
                    # HELP/TYPE once per metric across workers; other comments dropped.
                    parts = line.split(None, 3)
                    if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                        k = f"{parts[1]} {parts[2]}"
                        if k not in seen_meta:
                            seen_meta.add(k)
                            out.append(line)
                    continue
                out.append(_add_label(line, label))
        if not got:
            raise bad_gateway("No worker answered /metrics")
        return 200, ("\n".join(out) + "\n").encode(), _PROM

    async def _server_info(self, method: str, query: str, body: bytes) -> tuple[int, bytes, bytes]:
        async def fresh(w: Worker) -> dict[str, Any]:
            try:
                status, _, rbody = await httpclient.request(
                    "GET",
                    w.url + w.server_info_path,
                    headers=self.registry.auth_headers(w),
                    timeout=self._admin_timeout(),
                )
                if status == 200:
                    doc = json.loads(rbody)
                    if isinstance(doc, dict):
                        w.server_info = doc
                        return doc
            except (HttpClientError, ValueError):
                pass  # fall back to the registration-time copy
            return w.server_info

        if self.registry.config.pd_disaggregation:
            pre, dec = self.registry.ready_workers("prefill"), self.registry.ready_workers("decode")
            if not pre and not dec:
                raise _no_workers()
            infos = await asyncio.gather(*(fresh(w) for w in pre + dec))
            p_infos, d_infos = list(infos[: len(pre)]), list(infos[len(pre) :])
            states = [s for i in d_infos for s in (i.get("internal_states") or [])]
            # mini_lb shape (what sglang.bench_one_batch_server reads).
            return 200, _json({"internal_states": states, "prefill": p_infos, "decode": d_infos}), _JSON
        ws = self.registry.ready_workers("regular")
        if not ws:
            raise _no_workers()
        infos = await asyncio.gather(*(fresh(w) for w in ws))
        doc = dict(infos[0])
        doc["internal_states"] = [s for i in infos for s in (i.get("internal_states") or [])]
        return 200, _json(doc), _JSON

    async def _model_info(self, method: str, query: str, body: bytes) -> tuple[int, bytes, bytes]:
        ws = self.registry.ready_workers("prefill" if self.registry.config.pd_disaggregation else "regular")
        healthy = [w for w in ws if w.healthy] or ws
        if not healthy:
            raise _no_workers()
        w = healthy[0]
        try:
            status, hdrs, rbody = await httpclient.request(
                "GET", w.url + w.model_info_path, headers=self.registry.auth_headers(w), timeout=self._admin_timeout()
            )
        except HttpClientError as exc:
            raise RouterError(503, "worker_unreachable", str(exc)) from None
        if status != 200:
            raise bad_gateway(f"{w.url}{w.model_info_path} answered {status}")
        ctype = httpclient.header(hdrs, "content-type") or "application/json"
        return 200, rbody, ctype.encode("latin-1")

    async def _models(self, method: str, query: str, body: bytes) -> tuple[int, bytes, bytes]:
        ids: list[str] = []
        for w in self.registry.ready_workers():
            if w.model_id not in ids:
                ids.append(w.model_id)
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "local"} for m in ids]
        return 200, _json({"object": "list", "data": data}), _JSON

    async def _readiness(self, method: str, query: str, body: bytes) -> tuple[int, bytes, bytes]:
        total = len(self.registry.workers)
        healthy = sum(1 for w in self.registry.workers if w.status == "ready" and w.healthy)
        doc: dict[str, Any] = {"healthy_workers": healthy, "total_workers": total}
        # Background views (discovery, replica sync, health, loads) whose last iteration
        # failed: the router still routes on what it has, so the status stays the workers' call.
        stale = self.registry.background.stale()
        if stale:
            doc["stale"] = stale
        if self.registry.ready():
            return 200, _json({"status": "ready", **doc}), _JSON
        return 503, _json({"status": "not ready", "reason": "insufficient healthy workers", **doc}), _JSON

    async def _health_generate(self, method: str, query: str, body: bytes) -> tuple[int, bytes, bytes]:
        """smg style: a real /health_generate on one healthy pair (PD) or one healthy worker."""
        if self.registry.config.pd_disaggregation:
            pre, dec = self.registry.healthy_workers("prefill"), self.registry.healthy_workers("decode")
            if not pre or not dec:
                raise RouterError(503, "no_healthy_worker_pair", "No healthy prefill/decode worker pair available")
            chosen = [self._rng.choice(pre), self._rng.choice(dec)]
        else:
            reg = self.registry.healthy_workers("regular")
            if not reg:
                raise RouterError(503, "no_healthy_worker", "No healthy worker available")
            chosen = [self._rng.choice(reg)]
        timeout = min(float(self.registry.config.request_timeout_secs), 60.0)
        results = await self._fan_out(chosen, "GET", "/health_generate", timeout)
        bad = [
            f"{w.url}: {status if status is not None else _text(rbody)}"
            for w, status, rbody in results
            if status is None or not 200 <= status < 300
        ]
        if bad:
            raise RouterError(503, "health_generate_failed", "Health generate failed on " + "; ".join(bad))
        if len(chosen) == 2:
            msg = f"Health generate passed on selected pair: prefill={chosen[0].url}, decode={chosen[1].url}"
        else:
            msg = f"Health generate passed on selected worker: {chosen[0].url}"
        return 200, msg.encode(), _TEXT

    async def _dashboard_page(self, method: str, query: str, body: bytes) -> tuple[int, bytes, bytes]:
        return 200, PAGE_POLLED, b"text/html; charset=utf-8"

    async def _dashboard_snapshot(self, method: str, query: str, body: bytes) -> tuple[int, bytes, bytes]:
        return 200, self.dashboard.body("history" in parse_qs(query)), _JSON

    # The handler of each path of auth.ADMIN_METHODS but /workers (answered above with
    # /workers/<id>); the table says which methods each takes.
    _HANDLERS: dict[str, Any] = {
        "/add_worker": _add_worker_legacy,
        "/remove_worker": _remove_worker_legacy,
        "/list_workers": _list_workers_legacy,
        "/get_loads": _get_loads,
        "/flush_cache": _flush_cache,
        "/engine_metrics": _engine_metrics,
        "/get_server_info": _server_info,
        "/server_info": _server_info,
        "/get_model_info": _model_info,
        "/model_info": _model_info,
        "/v1/models": _models,
        "/readiness": _readiness,
        "/health_generate": _health_generate,
        "/dashboard": _dashboard_page,
        "/dashboard/snapshot": _dashboard_snapshot,
    }
    _ROUTES: dict[str, tuple[tuple[str, ...], Any]] = {
        p: (ADMIN_METHODS[p.encode()], fn) for p, fn in _HANDLERS.items()
    }


def _audit_target(registry: Workers, method: str, path: str, query: str, body: bytes) -> str:
    """The worker a management change is about: its URL when known, else its id, else '-'."""
    url = (parse_qs(query).get("url") or [""])[0]
    if not url and path == "/workers" and body:
        try:
            doc = json.loads(body)
        except ValueError:
            doc = None
        if isinstance(doc, dict) and isinstance(doc.get("url"), str):
            url = doc["url"]
    if not url and path.startswith("/workers/"):
        wid = path[len("/workers/") :]
        try:
            w = registry.get(wid)
        except (TypeError, ValueError):
            w = None
        url = w.url if w is not None else wid
    return "".join(c if c.isprintable() and not c.isspace() else "?" for c in url[:200]) or "-"


def _error(exc: RouterError) -> tuple[int, bytes, bytes]:
    return exc.status, exc.body(), _JSON


def _add_label(line: str, label: str) -> str:
    """Insert ``label`` (``k="v"``) into one Prometheus sample line."""
    i = 0
    n = len(line)
    while i < n and line[i] not in "{ \t":
        i += 1
    if i < n and line[i] == "{":
        sep = "" if line[i + 1 : i + 2] == "}" else ","
        return f"{line[: i + 1]}{label}{sep}{line[i + 1 :]}"
    return f"{line[:i]}{{{label}}}{line[i:]}"
