"""A proxy process's registry under ``--workers N``: a mirror of the supervisor's worker set.

The supervisor registers and monitors workers; it writes a JSON snapshot of them
(:func:`snapshot_doc`, ``workers.json`` in its private state directory) and bumps the shared
table's generation header. Each proxy process's :class:`FollowerRegistry` checks the generation
every ``SYNC_INTERVAL`` seconds (one atomic load, off the request path) and re-reads the snapshot
when it moved. Requests that change the worker set are forwarded to the supervisor's loopback
control listener (guarded by a per-run secret, ``CONTROL_HEADER``); the answer carries the
snapshot version (``VERSION_HEADER``) the follower applies before it replies.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from fastroute.config import Config
from fastroute.control import httpclient
from fastroute.control.admin import request_header
from fastroute.control.httpclient import HttpClientError
from fastroute.control.registry import Registry, Worker
from fastroute.core.routing import Router
from fastroute.core.table import COL_ALLOCATED, TargetTable
from fastroute.errors import error_response

# "fastroute.supervisor": the name operators filter process events on.
log = logging.getLogger("fastroute.supervisor")

SYNC_INTERVAL = 0.1  # seconds between a proxy process's generation checks

CONTROL_HEADER = "x-fastroute-control"
VERSION_HEADER = "x-fastroute-snapshot"
# Admin requests that change the worker set: served by the supervisor, wherever they arrive.
FORWARD_PATHS = ("/add_worker", "/remove_worker")
WORKER_FIELDS = (
    "url",
    "role",
    "id",
    "host",
    "port",
    "bootstrap_port",
    "dp_size",
    "targets",
    "names",
    "model_id",
    "server_info",
    "model_info",
    "healthy",
    "status",
    "priority",
    "cost",
    "labels",
    "api_key",
    "requested_model_id",
    "error",
    "server_info_path",
    "model_info_path",
)
# A per-rank-port server's rank URLs, DP ranks and per-rank health (fastroute.control.rankports).
RANK_FIELDS = ("rank_urls", "rank_ids", "rank_healthy")


def snapshot_doc(registry: Registry, version: int) -> dict[str, Any]:
    """The worker set as the proxy processes need it (every worker, any status)."""
    return {
        "version": version,
        "workers": [{f: getattr(w, f) for f in WORKER_FIELDS + RANK_FIELDS} for w in registry.workers],
    }


class FollowerRegistry(Registry):
    """A proxy process's view of the supervisor's registry (see the module docstring).

    Reads (``/workers`` GET, ``/get_loads``, ``/readiness``, info endpoints) are answered from
    the mirrored workers and the shared table; changes are forwarded to the supervisor."""

    def __init__(
        self,
        config: Config,
        table: TargetTable,
        router: Router,
        ledger: TargetTable,
        state_dir: str,
        control_url: str,
        secret: str,
    ) -> None:
        super().__init__(config, table, router)
        self.ledger = ledger
        self.state_dir = state_dir
        self.control_url = control_url
        self._secret = secret
        self.version = -1
        self._seen_generation = -1
        self.admin.forwarder = self  # worker changes go to the supervisor (forwards, forward)
        for g in self._groups.values():
            g.track_in(ledger)

    async def start(self) -> None:
        """Nothing to register: the supervisor does that."""

    async def stop(self) -> None:
        """No tasks of its own."""

    def poll(self) -> bool:
        """Re-read the snapshot if the table's generation moved; True when it was applied."""
        gen = self.table.generation
        if gen == self._seen_generation:
            return False
        self._seen_generation = gen
        return self.sync()

    def sync(self) -> bool:
        """Read the current snapshot file and apply it if it is newer than the view."""
        try:
            with open(os.path.join(self.state_dir, "workers.json"), "rb") as f:
                doc = json.loads(f.read())
        except (OSError, ValueError) as exc:
            log.warning("cannot read the worker snapshot: %s", exc)
            return False
        if int(doc.get("version", -1)) <= self.version:
            return False
        self.apply(doc)
        return True

    def apply(self, doc: dict[str, Any]) -> None:
        """Replace the view with ``doc``; groups change only for roles whose targets changed."""
        before = {r: (list(g.targets), list(g.names)) for r, g in self._groups.items()}
        by_id = {w.id: w for w in self.workers}
        workers: list[Worker] = []
        for d in doc["workers"]:
            w = by_id.get(d["id"])
            if w is None or w.url != d["url"]:
                w = Worker(url=d["url"], role=d["role"], id=d["id"])
            for f in WORKER_FIELDS:
                setattr(w, f, d[f])
            for f in RANK_FIELDS:  # (a snapshot without them: a server on one port)
                setattr(w, f, list(d.get(f) or ()))
            workers.append(w)
        info: list[tuple[Worker, int | None] | None] = [None] * self.table.capacity
        for w in workers:
            if w.status == "ready":
                split = len(w.targets) > 1
                for r, t in enumerate(w.targets):
                    info[t] = (w, r if split else None)
        # Like the supervisor's registry, keep a removed worker's rows resolvable while the row
        # is still allocated (requests in flight on it), so a late lookup finds its worker.
        for t, old in enumerate(self.target_info):
            if old is not None and info[t] is None and self.table.get(t, COL_ALLOCATED):
                info[t] = old
        # Swap in one synchronous step: a request sees the old view or the new one, not a mix.
        self.workers = workers
        self.reindex()
        self.target_info = info
        for role, _g in self._groups.items():
            targets: list[int] = []
            names: list[str] = []
            for w in workers:
                if w.role == role and w.status == "ready":
                    targets.extend(w.targets)
                    names.extend(w.names)
            if (targets, names) != before[role]:
                self._sync_group(role)
        self.version = int(doc["version"])
        self.invalidate_ready()  # Registry.ready() recomputes once, on the next request

    def forwards(self, method: str, path: str) -> bool:
        """Whether the supervisor applies this admin call (it changes the worker set)."""
        return path in FORWARD_PATHS or (
            method in ("POST", "PUT", "DELETE") and (path == "/workers" or path.startswith("/workers/"))
        )

    async def forward(self, method: str, path: str, query: str, body: bytes, headers: Any) -> tuple[int, bytes, bytes]:
        """Hand an admin call (authenticated here already) to the supervisor, which checks it
        again, applies it and audits it."""
        fwd = {CONTROL_HEADER: self._secret}
        auth = request_header(headers, "authorization")
        if auth is not None:
            fwd["authorization"] = auth
        url = self.control_url + path + ("?" + query if query else "")
        # /add_worker waits for registration: allow the whole startup timeout.
        timeout = float(self.config.worker_startup_timeout_secs) + 10.0
        try:
            status, rhdrs, rbody = await httpclient.request(method, url, body, fwd, timeout=timeout)
        except HttpClientError as exc:
            return 503, error_response(503, "supervisor_unreachable", str(exc)), b"application/json"
        version = httpclient.header(rhdrs, VERSION_HEADER)
        if version is not None and int(version) > self.version:
            self.sync()  # written before the supervisor answered
        ctype = httpclient.header(rhdrs, "content-type") or "application/json"
        return status, rbody, ctype.encode("latin-1")
