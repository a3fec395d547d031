"""The registration handshake of one worker: a :class:`Handshaker` the
:class:`~fastroute.control.registry.Registry` holds as ``registry.handshake``.

Registration (protocol.md 2) polls ``GET /health`` every ``worker_startup_check_interval``
until ``worker_startup_timeout_secs``, resolving the worker's host first (a second name for an
address already registered, the router itself, or a link-local address fails for good), then
reads ``/server_info`` (fallback ``/get_server_info`` on 404) and ``/model_info`` (fallback
``/get_model_info``) and the rank-port layout (:class:`~fastroute.control.rankports.RankPorts`).
A failure worth retrying (:class:`Transient`) waits for the next attempt; one retrying cannot
fix (``_Fatal``) ends the registration at once. The handshaker sees the registry through
:class:`Roster` and keeps one piece of state of its own: when the next attempt may start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from typing import Any, Protocol

from fastroute.config import Config
from fastroute.config.checks import link_local
from fastroute.control import httpclient
from fastroute.control.httpclient import HttpClientError, HttpTLSClosed, HttpTLSError
from fastroute.control.rankports import RankLayoutError, RankPorts
from fastroute.control.selfaddr import OwnAddresses, SelfWorker
from fastroute.control.worker import Worker, model_id_of

log = logging.getLogger("fastroute.workers")


class Transient(Exception):
    """A handshake step failed in a way worth retrying until the startup deadline."""


class _Fatal(Exception):
    """A handshake step failed in a way retrying cannot fix (e.g. no dp_size under --dp-aware)."""


# Handshake attempts start at most this often (seconds apart; 500 a second): a thousand
# workers discovered at once would otherwise all answer in the same loop iterations and stall
# it for ~100 ms at a time. A queue, not a concurrency limit: a hanging worker holds no slot,
# but with many workers pending their retries are spaced by at least this much each.
ATTEMPT_SPACING = 0.002
ATTEMPT_BURST = 8  # attempts that start at once after a quiet spell (a token bucket)


def _mtls_hint(cfg: Config) -> str:
    if cfg.client_cert_path:
        return " (it may not trust the client certificate of --client-cert-path)"
    return " (a worker that requires a client certificate does this: give --client-cert-path and --client-key-path)"


class Roster(Protocol):
    """What the :class:`Handshaker` reads and calls on its registry (control/registry.py's Registry)."""

    def get(self, worker_id: str) -> Worker | None: ...
    def at_address(self, addr: tuple[str, int]) -> Worker | None: ...
    def index(self, w: Worker) -> None: ...
    def drop(self, w: Worker) -> None: ...
    def activate(self, w: Worker) -> None: ...
    def invalidate_ready(self) -> None: ...
    def auth_headers(self, w: Worker) -> dict[str, str] | None: ...
    def health_headers(self, w: Worker) -> dict[str, str] | None: ...


class Handshaker:
    """Registering one worker: :meth:`register` is the task the registry starts for each new
    worker; :meth:`get_info` reads one of its info documents (the registry's dp_size re-reads
    use it too)."""

    def __init__(self, workers: Roster, config: Config, own: OwnAddresses, ranks: RankPorts) -> None:
        self._workers = workers
        self._config = config
        self._own = own
        self._ranks = ranks
        self._next_attempt = 0.0  # loop time of the next free handshake slot

    async def register(self, w: Worker) -> None:
        try:
            ok = await self._handshake(w)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug here must not kill the task silently
            log.exception("registration of %s crashed", w.url)
            ok, w.error = False, f"internal error: {exc}"
        if w.status != "pending":  # removed while the handshake ran
            return
        if ok:
            try:
                self._workers.activate(w)
                return
            except Exception as exc:  # e.g. the table is full
                log.error("cannot add worker %s: %s", w.url, exc)
                w.error = str(exc)
        w.status = "failed"
        self._workers.invalidate_ready()
        self._workers.drop(w)

    async def _resolve(self, w: Worker) -> None:
        """Resolve a host name to its address; a second worker on an address already
        registered is the same backend under another name: it fails (_Fatal)."""
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(w.host.strip("[]"), w.port, type=socket.SOCK_STREAM)
        except OSError:
            return  # unresolvable for now: the health probe reports it, and retries
        if not infos or w.addr is not None:
            return
        key = (str(infos[0][4][0]), w.port)
        try:
            self._own.check(w.url, key)
        except SelfWorker as exc:
            raise _Fatal(str(exc)) from None
        if not self._config.allow_link_local_workers and link_local(key[0]):
            raise _Fatal(
                f"{w.host} resolves to the link-local address {key[0]}; pass --allow-link-local-workers to allow it"
            )
        other = self._workers.at_address(key)
        if other is not None and other is not w:
            raise _Fatal(f"same backend as worker {other.url} ({key[0]}:{key[1]})")
        w.addr = key
        if self._workers.get(w.id) is w:
            self._workers.index(w)

    async def _handshake(self, w: Worker) -> bool:
        cfg = self._config
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(cfg.worker_startup_timeout_secs)
        interval = max(float(cfg.worker_startup_check_interval), 0.001)
        probe_timeout = max(float(cfg.health_check_timeout_secs), 0.001)
        attempts = 0
        tls_warned = False
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                w.error = f"not ready after {cfg.worker_startup_timeout_secs}s ({attempts} attempts): {w.error}"
                log.error("worker %s failed to register: %s", w.url, w.error)
                return False
            attempts += 1
            now = loop.time()
            slot = max(self._next_attempt, now - ATTEMPT_BURST * ATTEMPT_SPACING)
            self._next_attempt = slot + ATTEMPT_SPACING
            if slot > now:
                await asyncio.sleep(slot - now)
            timeout = min(probe_timeout, max(deadline - loop.time(), 0.001))
            try:
                if w.addr is None:
                    await self._resolve(w)
                # No bearer key on /health (protocol.md 2).
                status, _, _ = await httpclient.request(
                    "GET", w.url + "/health", headers=self._workers.health_headers(w), timeout=timeout
                )
                if 200 <= status < 300:
                    await self._discover(w, timeout)
                    return True
                w.error = f"/health answered {status}"
            except HttpTLSError as exc:  # a bad certificate does not fix itself
                w.error = str(exc)
                log.error("worker %s failed to register: %s", w.url, exc)
                return False
            except HttpTLSClosed as exc:  # TLS 1.3: a refused client certificate looks like this
                w.error = str(exc) + _mtls_hint(cfg)
                if not tls_warned:
                    tls_warned = True
                    log.warning(
                        "worker %s refuses the router: %s; retrying until --worker-startup-timeout-secs", w.url, w.error
                    )
            except (HttpClientError, Transient) as exc:
                w.error = str(exc)
            except _Fatal as exc:
                w.error = str(exc)
                log.error("worker %s failed to register: %s", w.url, exc)
                return False
            log.debug("worker %s not ready yet: %s", w.url, w.error)
            await asyncio.sleep(min(interval, max(deadline - loop.time(), 0.0)))

    async def get_info(
        self, w: Worker, primary: str, fallback: str, timeout: float, url: str | None = None
    ) -> tuple[dict[str, Any] | None, str]:
        """GET primary, on 404 GET fallback (of ``url``, default the worker's).
        -> (JSON object or None if both 404, path used)."""
        headers = self._workers.auth_headers(w)
        for path in (primary, fallback):
            status, _, body = await httpclient.request("GET", (url or w.url) + path, headers=headers, timeout=timeout)
            if status == 404:
                continue
            if status != 200:
                raise Transient(f"{path} answered {status}")
            try:
                doc = json.loads(body)
            except ValueError:
                raise Transient(f"{path} returned invalid JSON") from None
            if not isinstance(doc, dict):
                raise Transient(f"{path} returned a JSON {type(doc).__name__}, expected an object")
            return doc, path
        return None, primary

    async def _discover(self, w: Worker, timeout: float) -> None:
        si, w.server_info_path = await self.get_info(w, "/server_info", "/get_server_info", timeout)
        mi, w.model_info_path = await self.get_info(w, "/model_info", "/get_model_info", timeout)
        w.server_info = si or {}
        w.model_info = mi or {}
        w.model_id = model_id_of(w.requested_model_id, w.server_info, w.model_info)

        async def rank_info(url: str) -> dict[str, Any] | None:
            doc, _ = await self.get_info(w, w.server_info_path, "/get_server_info", timeout, url=url)
            return doc

        try:  # a per-rank-port server takes its dp_size from its deployment_info
            await self._ranks.discover(w, rank_info)
        except RankLayoutError as exc:  # cannot be a layout: retrying will not help
            raise _Fatal(f"{w.server_info_path}: {exc}") from None
        except LookupError as exc:  # a rank port not up yet, or not that rank yet
            raise Transient(str(exc)) from None
        if w.rank_ports:
            return
        dp = w.server_info.get("dp_size")
        valid = isinstance(dp, int) and not isinstance(dp, bool) and dp >= 1
        if self._config.dp_aware and not valid:
            raise _Fatal(f"No dp_size in response from {w.server_info_path} (got {dp!r}); --dp-aware needs it")
        bound = self._config.max_targets_per_worker
        if self._config.dp_aware and valid and isinstance(dp, int) and dp > bound:
            raise _Fatal(
                f"{w.server_info_path} reports dp_size {dp}: one worker may take at most {bound} "
                "targets (--max-targets-per-worker)"
            )
        w.dp_size = dp if valid and isinstance(dp, int) else 1
