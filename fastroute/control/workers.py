"""Worker registry: registration handshake, target rows, routing groups and admin endpoints.

Owns the set of known workers (SGLang servers) and their mapping onto rows ("targets") of the
shared :class:`~fastroute.core.table.TargetTable`:

* registration (protocol.md 2): poll ``GET /health`` every ``worker_startup_check_interval``
  until ``worker_startup_timeout_secs``, then ``/server_info`` (fallback ``/get_server_info`` on
  404) and ``/model_info`` (fallback ``/get_model_info``). Runs in background tasks, so the
  listener keeps serving (and answering 503) meanwhile.
* targets (4.1): one row per worker, or under ``--dp-aware`` one row per DP rank named
  ``url@rank`` (a ``dp_size`` of 1 is not split). ``target_info[row] -> (Worker, rank|None)``.
* one routing :class:`Group` per role, kept equal to the targets of *ready* workers in
  registration order (``group.set_targets`` on every add/remove).
* row lifetime: rows come from ``table.alloc()``; on removal a row goes back with
  ``table.free()`` only once no lease is in flight on it (otherwise it is marked unhealthy and
  freed later by a small reaper), so a late ``Lease.release()`` never lands on a reused row.
* the admin / info endpoints of protocol.md 6.2-6.6 (:meth:`Registry.handle_admin`).

Load polling and periodic health checks live in :mod:`fastroute.control.monitor`; they write the table
and ``Worker.healthy`` and read the worker list from here.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Iterable, Mapping
from urllib.parse import parse_qs, urlsplit

from fastroute import __version__

from fastroute.control import httpclient
from fastroute.errors import error_response
from fastroute.control.httpclient import HttpClientError
from fastroute.core.table import (COL_POLLED_AT, COL_POLLED_MAX_TOKENS, COL_POLLED_RUNNING, COL_POLLED_TOKENS,
                             COL_POLLED_WAITING)

log = logging.getLogger("fastroute.workers")

ROLES = ("regular", "prefill", "decode")

_JSON = b"application/json"
_TEXT = b"text/plain; charset=utf-8"
_PROM = b"text/plain; version=0.0.4; charset=utf-8"

# server_info keys copied (as strings) into the /workers "metadata" object.
_META_KEYS = ("model_path", "served_model_name", "tokenizer_path", "tp_size", "dp_size",
              "load_balance_method", "disaggregation_mode", "disaggregation_bootstrap_port",
              "enable_dp_attention", "max_running_requests", "max_total_num_tokens", "version")

# Admin paths that require the router API key when one is configured (protocol.md 6.7: worker
# management is verified protected; loads/flush/metrics are treated as protected by choice).
_PROTECTED = ("/workers", "/add_worker", "/remove_worker", "/list_workers", "/get_loads",
              "/flush_cache", "/engine_metrics")


@dataclass(eq=False)
class Worker:
    """One SGLang server known to the router (identity is by object, not by value)."""

    url: str
    role: str
    id: str = field(default_factory=lambda: str(uuid.uuid4()))
    host: str = ""              # hostname of the URL verbatim (IPv6 bracketed): bootstrap_host
    port: int = 0
    bootstrap_port: int | None = None
    dp_size: int = 1
    targets: list[int] = field(default_factory=list)   # table rows, index = rank when split
    names: list[str] = field(default_factory=list)     # url or url@rank, parallel to targets
    model_id: str = "unknown"
    server_info: dict[str, Any] = field(default_factory=dict)
    model_info: dict[str, Any] = field(default_factory=dict)
    healthy: bool = False
    # pending (handshake running) -> ready (targets in the group) -> removed; or pending -> failed
    status: str = "pending"
    priority: int = 50
    cost: float = 1.0
    labels: dict[str, str] = field(default_factory=dict)
    api_key: str | None = None           # per-worker key (POST /workers), overrides --api-key
    requested_model_id: str | None = None
    error: str | None = None             # why registration failed
    # Which info paths answered (the /get_* fallbacks are remembered per worker).
    server_info_path: str = "/server_info"
    model_info_path: str = "/model_info"
    # Monitor bookkeeping: which load endpoint works (None = try /v1/loads first), and
    # consecutive health probe outcomes.
    load_path: str | None = None
    health_failures: int = 0
    health_successes: int = 0
    task: asyncio.Task | None = field(default=None, repr=False)

    @property
    def split(self) -> bool:
        """True when the worker is represented by one target per DP rank."""
        return len(self.targets) > 1


def normalize_url(url: str) -> str:
    """Add a missing ``http://`` and drop trailing slashes, so one server has one spelling."""
    url = url.strip()
    if "://" not in url:
        url = "http://" + url
    return url.rstrip("/")


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


class DuplicateWorker(ValueError):
    """A worker with that URL is already registered (or registering)."""


class _Transient(Exception):
    """A handshake step failed in a way worth retrying until the startup deadline."""


class _Fatal(Exception):
    """A handshake step failed in a way retrying cannot fix (e.g. no dp_size under --dp-aware)."""


def _header(headers: Any, name: str) -> str | None:
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


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


class Registry:
    """All workers, their target rows, the per-role routing groups and the admin endpoints."""

    def __init__(self, config: Any, table: Any, router: Any) -> None:
        self.config = config
        self.table = table
        self.router = router
        self.workers: list[Worker] = []
        # Indexed by table row; None for rows not owned by a worker. Entries of removed workers
        # stay until the row is freed, so in-flight requests can still resolve their target.
        self.target_info: list[tuple[Worker, int | None] | None] = []
        self._rng = random.Random(getattr(config, "seed", None))
        self._deferred: list[int] = []          # rows of removed targets waiting for in_flight == 0
        self._reaper: asyncio.Task | None = None
        self._listeners: list[Callable[[str], None]] = []
        self.generation = 0                     # bumped whenever a group's target set changes
        self._ready_cache: bool | None = None
        demand = config.decode_input_demand
        weight = config.decode_request_weight
        metric = config.p2c_load_metric
        self._groups = {
            "regular": router.group([], config.policy, load_metric=metric, demand=demand,
                                    request_weight=weight, names=[]),
            "prefill": router.group([], config.prefill_policy, load_metric=metric, names=[]),
            "decode": router.group([], config.decode_policy, load_metric=metric, demand=demand,
                                   request_weight=weight, names=[],
                                   kv_fit=getattr(config, "decode_kv_fit", "off"),
                                   kv_reserve=getattr(config, "decode_kv_reserve_tokens", 0)),
        }

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Queue registration of every worker from the command line; returns immediately."""
        cfg = self.config
        if cfg.pd_disaggregation:
            for url, bport in cfg.prefill:
                self._queue(url, "prefill", bootstrap_port=bport)
            for url in cfg.decode:
                self._queue(url, "decode")
        else:
            for url in cfg.worker_urls:
                self._queue(url, "regular")

    async def stop(self) -> None:
        """Cancel pending registrations and the reaper (rows are left to the table's owner)."""
        tasks = [w.task for w in self.workers if w.task is not None and not w.task.done()]
        if self._reaper is not None:
            tasks.append(self._reaper)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)

    def add_listener(self, callback: Callable[[str], None]) -> None:
        """``callback(role)`` runs after every change of that role's group targets."""
        self._listeners.append(callback)

    # ---- queries ------------------------------------------------------------------------------
    def group(self, role: str) -> Any:
        return self._groups[role]

    def find(self, url: str) -> Worker | None:
        url = normalize_url(url)
        for w in self.workers:
            if w.url == url:
                return w
        return None

    def get(self, worker_id: str) -> Worker | None:
        for w in self.workers:
            if w.id == worker_id:
                return w
        return None

    def ready_workers(self, role: str | None = None) -> list[Worker]:
        return [w for w in self.workers if w.status == "ready" and (role is None or w.role == role)]

    def _healthy(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.status == "ready" and w.healthy and w.role == role]

    def ready(self) -> bool:
        """Can a request be routed at all: a healthy prefill and decode (PD) or a healthy worker.

        Asked on every request, so the answer is cached and recomputed only after a worker's
        status or health changed (``invalidate_ready``)."""
        r = self._ready_cache
        if r is None:
            if self.config.pd_disaggregation:
                r = bool(self._healthy("prefill")) and bool(self._healthy("decode"))
            else:
                r = bool(self._healthy("regular"))
            self._ready_cache = r
        return r

    def invalidate_ready(self) -> None:
        """A worker's status or health changed: recompute ``ready()`` on its next call."""
        self._ready_cache = None

    def auth_headers(self, w: Worker) -> dict[str, str]:
        """Authorization for worker calls other than /health (protocol.md 2)."""
        key = w.api_key or self.config.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def target_name(self, t: int) -> str | None:
        info = self.target_info[t] if 0 <= t < len(self.target_info) else None
        if info is None:
            return None
        w, rank = info
        return w.url if rank is None else f"{w.url}@{rank}"

    # ---- add / remove -------------------------------------------------------------------------
    def add_worker(self, url: str, role: str, *, bootstrap_port: int | None = None,
                   model_id: str | None = None, priority: int | None = None, cost: float | None = None,
                   labels: Mapping[str, str] | None = None, api_key: str | None = None) -> Worker:
        """Queue a worker for background registration. Raises DuplicateWorker (a ValueError) on a
        known URL and ValueError on a bad role; the handshake outcome is ``Worker.status``."""
        return self._queue(url, role, bootstrap_port=bootstrap_port, model_id=model_id,
                           priority=priority, cost=cost, labels=labels, api_key=api_key)

    def _queue(self, url: str, role: str, *, bootstrap_port: int | None = None,
               model_id: str | None = None, priority: int | None = None, cost: float | None = None,
               labels: Mapping[str, str] | None = None, api_key: str | None = None) -> Worker:
        if role not in ROLES:
            raise ValueError(f"unknown worker_type {role!r} (expected one of {', '.join(ROLES)})")
        url = normalize_url(url)
        if not url.startswith("http://"):
            # The control client speaks TLS but the data path does not: refuse rather than
            # register a worker whose inference traffic would go out as plain HTTP.
            raise ValueError(f"worker URL {url!r}: only http:// workers are supported")
        if self.find(url) is not None:
            raise DuplicateWorker(f"worker {url} already exists")
        host, port = split_host_port(url)
        if not host:
            raise ValueError(f"no host in worker URL {url!r}")
        w = Worker(url=url, role=role, host=host, port=port,
                   bootstrap_port=bootstrap_port if role == "prefill" else None,
                   requested_model_id=model_id, api_key=api_key)
        if priority is not None:
            w.priority = int(priority)
        if cost is not None:
            w.cost = float(cost)
        if labels:
            w.labels = {str(k): str(v) for k, v in labels.items()}
        self.workers.append(w)
        w.task = asyncio.get_running_loop().create_task(self._register(w), name=f"register {url}")
        log.info("registering %s worker %s (id %s)", role, url, w.id)
        return w

    async def wait_registered(self, w: Worker) -> bool:
        """Wait for ``w``'s handshake to finish; True when it became ready."""
        if w.task is not None:
            await asyncio.gather(w.task, return_exceptions=True)
        return w.status == "ready"

    def remove_worker(self, w: Worker) -> None:
        """Forget ``w``: out of its group now, rows freed once nothing is in flight on them."""
        if w in self.workers:
            self.workers.remove(w)
        was_ready = w.status == "ready"
        w.status = "removed"
        w.healthy = False
        self.invalidate_ready()
        if w.task is not None and not w.task.done():
            w.task.cancel()
        if was_ready:
            self._sync_group(w.role)
            for t in w.targets:
                self.table.set_healthy(t, False)
                self.table.mark_unpolled(t)
                self._retire(t)
        log.info("removed %s worker %s", w.role, w.url)

    # ---- registration handshake ---------------------------------------------------------------
    async def _register(self, w: Worker) -> None:
        try:
            ok = await self._handshake(w)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not kill the task silently
            log.exception("registration of %s crashed", w.url)
            ok, w.error = False, f"internal error: {exc}"
        if w.status != "pending":       # removed while the handshake ran
            return
        if ok:
            try:
                self._activate(w)
                return
            except Exception as exc:    # e.g. the table is full
                log.error("cannot add worker %s: %s", w.url, exc)
                w.error = str(exc)
        w.status = "failed"
        self.invalidate_ready()
        if w in self.workers:
            self.workers.remove(w)

    async def _handshake(self, w: Worker) -> bool:
        cfg = self.config
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(cfg.worker_startup_timeout_secs)
        interval = max(float(cfg.worker_startup_check_interval), 0.001)
        probe_timeout = max(float(cfg.health_check_timeout_secs), 0.001)
        attempts = 0
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                w.error = f"not ready after {cfg.worker_startup_timeout_secs}s ({attempts} attempts): {w.error}"
                log.error("worker %s failed to register: %s", w.url, w.error)
                return False
            attempts += 1
            timeout = min(probe_timeout, remaining)
            try:
                # No Authorization on /health (protocol.md 2).
                status, _, _ = await httpclient.request("GET", w.url + "/health", timeout=timeout)
                if 200 <= status < 300:
                    await self._discover(w, timeout)
                    return True
                w.error = f"/health answered {status}"
            except (HttpClientError, _Transient) as exc:
                w.error = str(exc)
            except _Fatal as exc:
                w.error = str(exc)
                log.error("worker %s failed to register: %s", w.url, exc)
                return False
            log.debug("worker %s not ready yet: %s", w.url, w.error)
            await asyncio.sleep(min(interval, max(deadline - loop.time(), 0.0)))

    async def _get_info(self, w: Worker, primary: str, fallback: str,
                        timeout: float) -> tuple[dict[str, Any] | None, str]:
        """GET primary, on 404 GET fallback. -> (JSON object or None if both 404, path used)."""
        headers = self.auth_headers(w)
        for path in (primary, fallback):
            status, _, body = await httpclient.request("GET", w.url + path, headers=headers, timeout=timeout)
            if status == 404:
                continue
            if status != 200:
                raise _Transient(f"{path} answered {status}")
            try:
                doc = json.loads(body)
            except ValueError:
                raise _Transient(f"{path} returned invalid JSON") from None
            if not isinstance(doc, dict):
                raise _Transient(f"{path} returned a JSON {type(doc).__name__}, expected an object")
            return doc, path
        return None, primary

    async def _discover(self, w: Worker, timeout: float) -> None:
        si, w.server_info_path = await self._get_info(w, "/server_info", "/get_server_info", timeout)
        mi, w.model_info_path = await self._get_info(w, "/model_info", "/get_model_info", timeout)
        w.server_info = si or {}
        w.model_info = mi or {}
        w.model_id = model_id_of(w.requested_model_id, w.server_info, w.model_info)
        dp = w.server_info.get("dp_size")
        valid = isinstance(dp, int) and not isinstance(dp, bool) and dp >= 1
        if self.config.dp_aware and not valid:
            raise _Fatal(f"No dp_size in response from {w.server_info_path} (got {dp!r}); "
                         "--dp-aware needs it")
        w.dp_size = dp if valid else 1

    def _activate(self, w: Worker) -> None:
        """Give the worker its rows and publish them to its group (synchronous: no await)."""
        n = w.dp_size if (self.config.dp_aware and w.dp_size > 1) else 1
        rows: list[int] = []
        try:
            for _ in range(n):
                rows.append(self.table.alloc())
        except Exception:
            for t in rows:
                self.table.free(t)
            raise
        w.targets = rows
        w.names = [w.url] if n == 1 else [f"{w.url}@{r}" for r in range(n)]
        for r, t in enumerate(rows):
            if t >= len(self.target_info):
                self.target_info.extend([None] * (t + 1 - len(self.target_info)))
            self.target_info[t] = (w, r if n > 1 else None)
            self.table.set_healthy(t, True)
        w.healthy = True
        w.health_failures = w.health_successes = 0
        w.status = "ready"
        self.invalidate_ready()
        w.error = None
        self._sync_group(w.role)
        log.info("worker %s ready: role=%s model=%s dp_size=%d targets=%s",
                 w.url, w.role, w.model_id, w.dp_size, rows)

    def _sync_group(self, role: str) -> None:
        targets: list[int] = []
        names: list[str] = []
        for w in self.workers:
            if w.role == role and w.status == "ready":
                targets.extend(w.targets)
                names.extend(w.names)
        self._groups[role].set_targets(targets, names)
        self.generation += 1
        for cb in self._listeners:
            cb(role)

    # ---- row retirement -----------------------------------------------------------------------
    def _retire(self, t: int) -> None:
        if self.table.in_flight(t) == 0:
            self._free(t)
            return
        self._deferred.append(t)
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap_loop(), name="row reaper")

    def _free(self, t: int) -> None:
        self.table.free(t)
        if t < len(self.target_info):
            self.target_info[t] = None

    def reap(self) -> int:
        """Free deferred rows whose last lease has been released; returns how many remain."""
        keep = []
        for t in self._deferred:
            if self.table.in_flight(t) == 0:
                self._free(t)
            else:
                keep.append(t)
        self._deferred = keep
        return len(keep)

    async def _reap_loop(self) -> None:
        # Leases end at response EOF; streams can be long, so poll gently until all are gone.
        while self.reap():
            await asyncio.sleep(0.05)

    # ---- worker JSON --------------------------------------------------------------------------
    def _polled(self, t: int) -> dict[str, Any]:
        """Polled engine values of a target; all None when never polled / unknown."""
        tab = self.table
        if tab.get(t, COL_POLLED_AT) < 0:
            return {"num_running_reqs": None, "num_waiting_reqs": None, "num_total_reqs": None,
                    "num_used_tokens": None, "max_total_num_tokens": None, "polled_at_ms": None}
        running = tab.get(t, COL_POLLED_RUNNING)
        waiting = tab.get(t, COL_POLLED_WAITING)
        mx = tab.get(t, COL_POLLED_MAX_TOKENS)
        return {"num_running_reqs": running, "num_waiting_reqs": waiting,
                "num_total_reqs": running + waiting,
                "num_used_tokens": tab.get(t, COL_POLLED_TOKENS),
                "max_total_num_tokens": mx if mx >= 0 else None,
                "polled_at_ms": tab.get(t, COL_POLLED_AT)}

    def worker_json(self, w: Worker) -> dict[str, Any]:
        """One entry of GET /workers (smg field names, plus per-rank detail when split)."""
        tab = self.table
        live = w.status == "ready"
        d: dict[str, Any] = {
            "id": w.id, "url": w.url, "model_id": w.model_id, "worker_type": w.role,
            "is_healthy": w.healthy and live, "status": w.status,
            "load": sum(tab.in_flight(t) for t in w.targets) if live else 0,
            "connection_mode": "http", "priority": w.priority, "cost": w.cost,
            "labels": dict(w.labels),
            "metadata": {k: str(w.server_info[k]) for k in _META_KEYS if k in w.server_info},
            "dp_size": w.dp_size,
        }
        if w.role == "prefill":
            d["bootstrap_port"] = w.bootstrap_port
        if w.error and not live:
            d["error"] = w.error
        if live:
            if w.split:
                d["dp_ranks"] = [{"url": name, "dp_rank": r, "load": tab.in_flight(t),
                                  "is_healthy": w.healthy, **self._polled(t)}
                                 for r, (t, name) in enumerate(zip(w.targets, w.names))]
            else:
                d["engine_load"] = self._polled(w.targets[0])
        return d

    # ---- admin endpoints ----------------------------------------------------------------------
    async def handle_admin(self, method: str, path: str, query: str, body: bytes,
                           headers: Any) -> tuple[int, bytes, bytes]:
        """Serve one admin/info request -> (status, body, content-type)."""
        key = self.config.api_key
        if key and path.startswith(_PROTECTED) and _header(headers, "authorization") != f"Bearer {key}":
            return 401, error_response(401, "invalid_api_key", "Invalid or missing API key"), _JSON
        try:
            if path == "/workers":
                if method == "GET":
                    return self._list_workers()
                if method == "POST":
                    return self._post_worker(body)
                return self._method_not_allowed(method, path)
            if path.startswith("/workers/"):
                return self._worker_item(method, path[len("/workers/"):], body)
            handler = self._ROUTES.get(path)
            if handler is None:
                return 404, error_response(404, "unknown_url", f"Invalid URL ({method} {path})"), _JSON
            allowed, fn = handler
            if method not in allowed:
                return self._method_not_allowed(method, path)
            return await fn(self, method, query, body)
        except Exception as exc:  # an admin bug must answer 500, not drop the connection
            log.exception("admin %s %s failed", method, path)
            return 500, error_response(500, "internal_error", str(exc)), _JSON

    @staticmethod
    def _method_not_allowed(method: str, path: str) -> tuple[int, bytes, bytes]:
        return 405, error_response(405, "method_not_allowed", f"Method {method} not allowed on {path}"), _JSON

    def _list_workers(self) -> tuple[int, bytes, bytes]:
        ws = [self.worker_json(w) for w in self.workers]
        stats = {f"{r}_count": sum(1 for w in self.workers if w.role == r) for r in ("prefill", "decode", "regular")}
        return 200, _json({"workers": ws, "total": len(ws), "stats": stats}), _JSON

    def _post_worker(self, body: bytes) -> tuple[int, bytes, bytes]:
        try:
            req = json.loads(body) if body else None
        except ValueError:
            return 400, error_response(400, "bad_request", "Request body is not valid JSON"), _JSON
        if not isinstance(req, dict) or not isinstance(req.get("url"), str) or not req["url"]:
            return 422, error_response(422, "invalid_request", "Field `url` (string) is required"), _JSON
        role = req.get("worker_type") or "regular"
        bport = req.get("bootstrap_port")
        if bport is not None and (not isinstance(bport, int) or isinstance(bport, bool)):
            return 422, error_response(422, "invalid_request", "bootstrap_port must be an integer or null"), _JSON
        labels = req.get("labels")
        if labels is not None and not isinstance(labels, dict):
            return 422, error_response(422, "invalid_request", "labels must be an object"), _JSON
        try:
            w = self.add_worker(req["url"], role, bootstrap_port=bport, model_id=req.get("model_id"),
                                priority=req.get("priority"), cost=req.get("cost"), labels=labels,
                                api_key=req.get("api_key"))
        except ValueError as exc:
            status, code = (409, "worker_already_exists") if isinstance(exc, DuplicateWorker) else (400, "bad_request")
            return status, error_response(status, code, str(exc)), _JSON
        return 202, _json({"status": "accepted", "worker_id": w.id, "url": w.url,
                           "location": f"/workers/{w.id}",
                           "message": "Worker addition queued for background processing"}), _JSON

    def _worker_item(self, method: str, wid: str, body: bytes) -> tuple[int, bytes, bytes]:
        try:
            uuid.UUID(wid)
        except ValueError:
            return 400, error_response(400, "bad_request", f"Invalid worker id {wid!r} (expected a UUID)"), _JSON
        w = self.get(wid)
        if w is None:
            return 404, error_response(404, "worker_not_found", f"Worker {wid} not found"), _JSON
        if method == "GET":
            return 200, _json(self.worker_json(w)), _JSON
        if method == "PUT":
            try:
                upd = json.loads(body) if body else {}
            except ValueError:
                return 400, error_response(400, "bad_request", "Request body is not valid JSON"), _JSON
            if not isinstance(upd, dict):
                return 422, error_response(422, "invalid_request", "Expected a JSON object"), _JSON
            try:
                if "priority" in upd:
                    w.priority = int(upd["priority"])
                if "cost" in upd:
                    w.cost = float(upd["cost"])
                if isinstance(upd.get("labels"), dict):
                    w.labels = {str(k): str(v) for k, v in upd["labels"].items()}
            except (TypeError, ValueError) as exc:
                return 422, error_response(422, "invalid_request", str(exc)), _JSON
            return 202, _json({"status": "accepted", "worker_id": w.id, "url": w.url,
                               "message": "Worker update queued for background processing"}), _JSON
        if method == "DELETE":
            self.remove_worker(w)
            return 202, _json({"status": "accepted", "worker_id": w.id, "url": w.url,
                               "message": "Worker removal queued for background processing"}), _JSON
        return self._method_not_allowed(method, f"/workers/{wid}")

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
            w = self.add_worker(url, role, bootstrap_port=bport)
        except ValueError as exc:
            return 400, str(exc).encode(), _TEXT
        if await self.wait_registered(w):
            return 200, f"Successfully added worker: {w.url}".encode(), _TEXT
        return 400, f"Failed to add worker {w.url}: {w.error}".encode(), _TEXT

    async def _remove_worker_legacy(self, method: str, query: str, body: bytes) -> tuple[int, bytes, bytes]:
        url = (parse_qs(query).get("url") or [""])[0]
        if not url:
            return 400, b"Missing url query parameter", _TEXT
        w = self.find(url)
        if w is None:
            return 404, f"Worker {normalize_url(url)} not found".encode(), _TEXT
        self.remove_worker(w)
        return 200, f"Successfully removed worker: {w.url}".encode(), _TEXT

    async def _list_workers_legacy(self, method: str, query: str, body: bytes) -> tuple[int, bytes, bytes]:
        return 200, _json({"urls": [w.url for w in self.workers if w.status == "ready"]}), _JSON

    async def _get_loads(self, method: str, query: str, body: bytes) -> tuple[int, bytes, bytes]:
        tab = self.table
        loads = []
        legacy = []
        agg = {"total_in_flight_requests": 0, "total_in_flight_tokens": 0, "total_running_reqs": 0,
               "total_waiting_reqs": 0, "total_used_tokens": 0}
        for w in self.ready_workers():
            tokens_sum = 0
            complete = True
            for i, (t, name) in enumerate(zip(w.targets, w.names)):
                p = self._polled(t)
                inf, inf_tok = tab.in_flight(t), tab.in_flight_tokens(t)
                loads.append({"name": name, "worker": w.url, "worker_id": w.id, "worker_type": w.role,
                              "dp_rank": i if w.split else None, "is_healthy": w.healthy,
                              "in_flight_requests": inf, "in_flight_tokens": inf_tok, **p})
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
        doc = {"timestamp": datetime.now(timezone.utc).isoformat(), "version": f"fastroute-{__version__}",
               "dp_rank_count": len(loads), "loads": loads, "aggregate": agg, "workers": legacy}
        return 200, _json(doc), _JSON

    async def _fan_out(self, workers: Iterable[Worker], method: str, path: str,
                       timeout: float) -> list[tuple[Worker, int | None, bytes | str]]:
        """Same request to many workers concurrently -> (worker, status or None, body or error)."""
        async def one(w: Worker) -> tuple[Worker, int | None, bytes | str]:
            try:
                status, _, body = await httpclient.request(method, w.url + path, headers=self.auth_headers(w),
                                                           timeout=timeout)
                return w, status, body
            except HttpClientError as exc:
                return w, None, str(exc)
        return list(await asyncio.gather(*(one(w) for w in workers)))

    def _admin_timeout(self) -> float:
        return max(float(self.config.health_check_timeout_secs), 5.0)

    async def _flush_cache(self, method: str, query: str, body: bytes) -> tuple[int, bytes, bytes]:
        ws = self.ready_workers()
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
        doc = {"status": "partial_success" if ok else "failed",
               "message": f"Flushed cache on {ok} of {n} HTTP workers", **doc, "failed": failed}
        return (206 if ok else 502), _json(doc), _JSON

    async def _engine_metrics(self, method: str, query: str, body: bytes) -> tuple[int, bytes, bytes]:
        ws = self.ready_workers()
        if not ws:
            return 503, error_response(503, "no_available_workers", "No workers registered"), _JSON
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
            return 502, error_response(502, "bad_gateway", "No worker answered /metrics"), _JSON
        return 200, ("\n".join(out) + "\n").encode(), _PROM

    async def _server_info(self, method: str, query: str, body: bytes) -> tuple[int, bytes, bytes]:
        async def fresh(w: Worker) -> dict[str, Any]:
            try:
                status, _, rbody = await httpclient.request("GET", w.url + w.server_info_path,
                                                            headers=self.auth_headers(w),
                                                            timeout=self._admin_timeout())
                if status == 200:
                    doc = json.loads(rbody)
                    if isinstance(doc, dict):
                        w.server_info = doc
                        return doc
            except (HttpClientError, ValueError):
                pass  # fall back to the registration-time copy
            return w.server_info
        if self.config.pd_disaggregation:
            pre, dec = self.ready_workers("prefill"), self.ready_workers("decode")
            if not pre and not dec:
                return 503, error_response(503, "no_available_workers", "No workers registered"), _JSON
            infos = await asyncio.gather(*(fresh(w) for w in pre + dec))
            p_infos, d_infos = list(infos[: len(pre)]), list(infos[len(pre):])
            states = [s for i in d_infos for s in (i.get("internal_states") or [])]
            # mini_lb shape (what sglang.bench_one_batch_server reads).
            return 200, _json({"internal_states": states, "prefill": p_infos, "decode": d_infos}), _JSON
        ws = self.ready_workers("regular")
        if not ws:
            return 503, error_response(503, "no_available_workers", "No workers registered"), _JSON
        infos = await asyncio.gather(*(fresh(w) for w in ws))
        doc = dict(infos[0])
        doc["internal_states"] = [s for i in infos for s in (i.get("internal_states") or [])]
        return 200, _json(doc), _JSON

    async def _model_info(self, method: str, query: str, body: bytes) -> tuple[int, bytes, bytes]:
        ws = self.ready_workers("prefill" if self.config.pd_disaggregation else "regular")
        healthy = [w for w in ws if w.healthy] or ws
        if not healthy:
            return 503, error_response(503, "no_available_workers", "No workers registered"), _JSON
        w = healthy[0]
        try:
            status, hdrs, rbody = await httpclient.request("GET", w.url + w.model_info_path,
                                                           headers=self.auth_headers(w),
                                                           timeout=self._admin_timeout())
        except HttpClientError as exc:
            return 503, error_response(503, "worker_unreachable", str(exc)), _JSON
        if status != 200:
            return 502, error_response(502, "bad_gateway", f"{w.url}{w.model_info_path} answered {status}"), _JSON
        ctype = httpclient.header(hdrs, "content-type") or "application/json"
        return 200, rbody, ctype.encode("latin-1")

    async def _models(self, method: str, query: str, body: bytes) -> tuple[int, bytes, bytes]:
        ids: list[str] = []
        for w in self.ready_workers():
            if w.model_id not in ids:
                ids.append(w.model_id)
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "local"} for m in ids]
        return 200, _json({"object": "list", "data": data}), _JSON

    async def _readiness(self, method: str, query: str, body: bytes) -> tuple[int, bytes, bytes]:
        total = len(self.workers)
        healthy = sum(1 for w in self.workers if w.status == "ready" and w.healthy)
        if self.ready():
            return 200, _json({"status": "ready", "healthy_workers": healthy, "total_workers": total}), _JSON
        return 503, _json({"status": "not ready", "reason": "insufficient healthy workers",
                           "healthy_workers": healthy, "total_workers": total}), _JSON

    async def _health_generate(self, method: str, query: str, body: bytes) -> tuple[int, bytes, bytes]:
        """smg style: a real /health_generate on one healthy pair (PD) or one healthy worker."""
        if self.config.pd_disaggregation:
            pre, dec = self._healthy("prefill"), self._healthy("decode")
            if not pre or not dec:
                return 503, error_response(503, "no_healthy_worker_pair",
                                           "No healthy prefill/decode worker pair available"), _JSON
            chosen = [self._rng.choice(pre), self._rng.choice(dec)]
        else:
            reg = self._healthy("regular")
            if not reg:
                return 503, error_response(503, "no_healthy_worker", "No healthy worker available"), _JSON
            chosen = [self._rng.choice(reg)]
        timeout = min(float(self.config.request_timeout_secs), 60.0)
        results = await self._fan_out(chosen, "GET", "/health_generate", timeout)
        bad = [f"{w.url}: {status if status is not None else rbody}"
               for w, status, rbody in results if status is None or not 200 <= status < 300]
        if bad:
            return 503, error_response(503, "health_generate_failed",
                                       "Health generate failed on " + "; ".join(bad)), _JSON
        if len(chosen) == 2:
            msg = f"Health generate passed on selected pair: prefill={chosen[0].url}, decode={chosen[1].url}"
        else:
            msg = f"Health generate passed on selected worker: {chosen[0].url}"
        return 200, msg.encode(), _TEXT

    _ROUTES: dict[str, tuple[tuple[str, ...], Any]] = {
        "/add_worker": (("POST",), _add_worker_legacy),
        "/remove_worker": (("POST", "DELETE"), _remove_worker_legacy),
        "/list_workers": (("GET",), _list_workers_legacy),
        "/get_loads": (("GET",), _get_loads),
        "/flush_cache": (("POST",), _flush_cache),
        "/engine_metrics": (("GET",), _engine_metrics),
        "/get_server_info": (("GET",), _server_info),
        "/server_info": (("GET",), _server_info),
        "/get_model_info": (("GET",), _model_info),
        "/model_info": (("GET",), _model_info),
        "/v1/models": (("GET",), _models),
        "/readiness": (("GET",), _readiness),
        "/health_generate": (("GET",), _health_generate),
    }


def _add_label(line: str, label: str) -> str:
    """Insert ``label`` (``k="v"``) into one Prometheus sample line."""
    i = 0
    n = len(line)
    while i < n and line[i] not in "{ \t":
        i += 1
    if i < n and line[i] == "{":
        sep = "" if line[i + 1: i + 2] == "}" else ","
        return f"{line[: i + 1]}{label}{sep}{line[i + 1:]}"
    return f"{line[:i]}{{{label}}}{line[i:]}"

