"""Worker registry: registration handshake, target rows, routing groups, row reaper.

Owns the set of known workers (SGLang servers) and their mapping onto rows ("targets") of the
shared :class:`~fastroute.core.table.TargetTable`:

* registration (protocol.md 2): poll ``GET /health`` every ``worker_startup_check_interval``
  until ``worker_startup_timeout_secs``, then ``/server_info`` (fallback ``/get_server_info`` on
  404) and ``/model_info`` (fallback ``/get_model_info``). Runs in background tasks, so the
  listener keeps serving (and answering 503) meanwhile; the handshake itself is a
  :class:`~fastroute.control.handshake.Handshaker` the registry holds (``registry.handshake``),
  and a per-rank-port server's ports are a :class:`~fastroute.control.rankports.RankPorts`
  (``registry.ranks``); each sees the registry through a narrow protocol.
* targets (4.1): one row per worker, or under ``--dp-aware`` one row per DP rank named
  ``url@rank`` (a ``dp_size`` of 1 is not split). ``target_info[row] -> (Worker, rank|None)``.
* one routing :class:`Group` per role, kept equal to the targets of *ready* workers in
  registration order (``group.set_targets`` on every add/remove).
* row lifetime: rows come from ``table.alloc()``; on removal a row goes back with
  ``table.free()`` only once no lease is in flight on it (otherwise it is marked unhealthy and
  freed later by a small reaper), so a late ``Lease.release()`` never lands on a reused row.
* dp_size changes (``--dp-aware``): :meth:`Registry.recheck_dp` re-reads ``/server_info`` when
  the monitor's polls suggest a restart (health recovered, load polls answering again or
  reporting another rank count) and every ``DP_RECHECK_SECS``; :meth:`Registry.resize` keeps
  the rows of ranks that stay, retires the others like a removal (freed once their leases
  are released) and allocates rows for new ranks.
* the admin / info endpoints of protocol.md 6.2-6.6 are a :class:`~fastroute.control.admin.AdminAPI`
  the registry holds (``registry.admin.handle_admin``); the worker model is in
  :mod:`fastroute.control.worker`.

Load polling and periodic health checks live in :mod:`fastroute.control.monitor`; they write the table
and ``Worker.healthy`` and read the worker list from here.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import deque
from collections.abc import Callable, Mapping

from fastroute.auth import AdminAuth, parse_control_plane_keys
from fastroute.config import Config
from fastroute.config.checks import worker_url_problem
from fastroute.control.admin import AdminAPI
from fastroute.control.background import Background
from fastroute.control.handshake import Handshaker, Transient
from fastroute.control.httpclient import HttpClientError
from fastroute.control.models import ModelGroups, group_like, parse_aliases, worker_model_names
from fastroute.control.rankports import RankPorts, aliases
from fastroute.control.selfaddr import OwnAddresses, SelfWorker
from fastroute.control.worker import (
    ROLES,
    BadWorkerURL,
    DuplicateWorker,
    Worker,
    address_key,
    basic_auth,
    check_fields,
    model_id_of,
    normalize_url,
    split_host_port,
    target_label,
)
from fastroute.core.cache_aware import leg_rank_slack
from fastroute.core.routing import Group, Router
from fastroute.core.table import TargetTable

__all__ = ["Registry", "Worker", "DuplicateWorker", "ROLES", "normalize_url", "split_host_port", "model_id_of"]

log = logging.getLogger("fastroute.workers")


DP_RECHECK_MIN_SECS = 5.0
# Activations sync their role's group on the next loop step, each sync O(targets) with its
# listeners: a fleet turning ready one worker per step made that O(workers x targets). After
# STORM_SYNCS syncs within STORM_WINDOW seconds, the next waits STORM_DELAY and covers every
# activation since (a worker is then routable up to STORM_DELAY after /workers lists it ready).
STORM_SYNCS = 4
STORM_WINDOW = 0.1
STORM_DELAY = 0.05


class Registry:
    """All workers, their target rows, the per-role routing groups; ``admin`` answers the admin
    endpoints over them."""

    def __init__(self, config: Config, table: TargetTable, router: Router) -> None:
        self.config = config
        self.table = table
        self.router = router
        self.workers: list[Worker] = []
        # O(1) lookups over ``workers`` (discovery adds and removes thousands in a burst):
        # url -> worker, address -> worker, id -> worker; kept by index / unindex.
        self._by_url: dict[str, Worker] = {}
        self._by_addr: dict[tuple[str, int], Worker] = {}
        self._by_id: dict[str, Worker] = {}
        self._sync_soon: set[str] = set()  # roles whose group sync is scheduled
        # When the last STORM_SYNCS activation syncs ran (a storm defers the next one).
        self._recent_syncs: deque[float] = deque(maxlen=STORM_SYNCS)
        # The supervised background tasks of this process (fastroute.control.background).
        self.background = Background(config.seed)
        # Indexed by table row; None for rows not owned by a worker. Entries of removed workers
        # stay until the row is freed, so in-flight requests can still resolve their target.
        self.target_info: list[tuple[Worker, int | None] | None] = []
        self._deferred: list[int] = []  # rows of removed targets waiting for in_flight == 0
        self._reaper: asyncio.Task | None = None
        self._listeners: list[Callable[[str], None]] = []
        self._ready_cache: bool | None = None
        # The router's own listeners (filled in once bound): a worker there is refused.
        self.own = OwnAddresses()
        # The one admin auth rule, built once (control-plane keys kept as digests only).
        self.admin_auth = AdminAuth(
            config.api_key, parse_control_plane_keys(config.control_plane_api_keys), config.admin_closed
        )
        self.admin = AdminAPI(self)  # the admin / info endpoints over this registry
        self.ranks = RankPorts(self, config, self.own)  # per-rank-port servers
        self.handshake = Handshaker(self, config, self.own, self.ranks)  # registering a worker
        demand = config.decode_input_demand
        weight = config.decode_request_weight
        metric = config.p2c_load_metric
        groups = {
            # A regular worker decodes too: demand and KV fit apply to its group as to PD's
            # decode group.
            "regular": router.group(
                [],
                config.policy,
                load_metric=metric,
                demand=demand,
                request_weight=weight,
                names=[],
                kv_fit=config.decode_kv_fit,
                kv_reserve=config.decode_kv_reserve_tokens,
                rank_slack=leg_rank_slack(config, "regular"),
                kv_index=router.kv_index,
                speed_role="decode",
            ),
            # Prefill demand: the input tokens in flight there, held until the prefill answers.
            "prefill": router.group(
                [],
                config.prefill_policy or config.policy,
                load_metric=metric,
                names=[],
                demand=config.prefill_input_demand,
                tokens_until_answer=config.prefill_input_demand != "off",
                rank_slack=leg_rank_slack(config, "prefill"),
                kv_index=router.kv_index,
                speed_role="prefill",
            ),
            "decode": router.group(
                [],
                config.decode_policy or config.policy,
                load_metric=metric,
                demand=demand,
                request_weight=weight,
                names=[],
                kv_fit=config.decode_kv_fit,
                kv_reserve=config.decode_kv_reserve_tokens,
                rank_slack=leg_rank_slack(config, "decode"),
                speed_role="decode",
            ),
        }
        self._groups: dict[str, Group | ModelGroups] = dict(groups)
        if config.enable_igw:
            # One group per model inside each role (fastroute.control.models).
            aliases = parse_aliases(config.model_alias)
            self._groups = {
                role: ModelGroups(
                    functools.partial(
                        group_like, router, g, config.decode_kv_reserve_tokens if role == "decode" else 0
                    ),
                    self._model_names,
                    aliases,
                    g.policy,
                )
                for role, g in groups.items()
            }

    # ---- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Queue registration of every worker from the command line; returns immediately."""
        cfg = self.config
        if cfg.pd_disaggregation:
            for url, bport in cfg.prefill:
                self._queue_configured(url, "prefill", bport)
            for url in cfg.decode:
                self._queue_configured(url, "decode")
        else:
            for url in cfg.worker_urls:
                self._queue_configured(url, "regular")

    def _queue_configured(self, url: str, role: str, bootstrap_port: int | None = None) -> None:
        try:
            self.add_worker(url, role, bootstrap_port=bootstrap_port)
        except SelfWorker as exc:  # known only once bound (--port 0): skipped, said once
            log.error("not registering %s: %s", url, exc)

    async def stop(self) -> None:
        """Cancel pending registrations and the reaper (rows are left to the table's owner)."""
        tasks = [t for w in self.workers for t in (w.task, w.dp_task) if t is not None and not t.done()]
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
    def group(self, role: str) -> Group | ModelGroups:
        """The role's group; under --enable-igw, its groups by model (ModelGroups)."""
        return self._groups[role]

    def _model_names(self, t: int) -> tuple[str, ...]:
        entry = self.target_info[t]
        return worker_model_names(entry[0]) if entry is not None else ("unknown",)

    def find(self, url: str) -> Worker | None:
        """The worker of ``url``: the same normalised URL, or another spelling of its address."""
        url = normalize_url(url)
        w = self._by_url.get(url)
        if w is not None:
            return w
        host, port = split_host_port(url)
        key = address_key(host, port)
        return self._by_addr.get(key) if key is not None else None

    def get(self, worker_id: str) -> Worker | None:
        return self._by_id.get(worker_id)

    def at_address(self, addr: tuple[str, int]) -> Worker | None:
        """The worker registered at a resolved (host, port) address."""
        return self._by_addr.get(addr)

    def index(self, w: Worker) -> None:
        """Make ``w`` found by its id, URL, address and every rank port's URL and address."""
        self._by_url[w.url] = w
        self._by_id[w.id] = w
        if w.addr is not None:
            self._by_addr.setdefault(w.addr, w)
        for url, addr in aliases(w):  # the other rank ports of a per-rank-port server
            self._by_url.setdefault(url, w)
            if addr is not None:
                self._by_addr.setdefault(addr, w)

    def unindex(self, w: Worker) -> None:
        """Undo :meth:`index` (what another worker holds stays)."""
        if self._by_id.get(w.id) is w:
            del self._by_id[w.id]
        for url, addr in [(w.url, w.addr), *aliases(w)]:
            if self._by_url.get(url) is w:
                del self._by_url[url]
            if addr is not None and self._by_addr.get(addr) is w:
                del self._by_addr[addr]

    def reindex(self) -> None:
        """Rebuild the lookups after ``workers`` was replaced wholesale (the follower's view)."""
        self._by_url, self._by_addr, self._by_id = {}, {}, {}
        for w in self.workers:
            self.index(w)

    def ready_workers(self, role: str | None = None) -> list[Worker]:
        return [w for w in self.workers if w.status == "ready" and (role is None or w.role == role)]

    def healthy_workers(self, role: str) -> list[Worker]:
        return [w for w in self.workers if w.status == "ready" and w.healthy and w.role == role]

    def ready(self) -> bool:
        """Can a request be routed at all: a healthy prefill and decode (PD) or a healthy worker.

        Asked on every request, so the answer is cached and recomputed only after a worker's
        status or health changed (``invalidate_ready``)."""
        r = self._ready_cache
        if r is None:
            if self.config.pd_disaggregation:
                r = bool(self.healthy_workers("prefill")) and bool(self.healthy_workers("decode"))
            else:
                r = bool(self.healthy_workers("regular"))
            self._ready_cache = r
        return r

    def invalidate_ready(self) -> None:
        """A worker's status or health changed: recompute ``ready()`` on its next call."""
        self._ready_cache = None

    def auth_headers(self, w: Worker) -> dict[str, str] | None:
        """Authorization for worker calls other than /health (protocol.md 2): the bearer key,
        else the Basic credentials of the worker's URL."""
        key = w.api_key or self.config.api_key
        if key:
            return {"Authorization": f"Bearer {key}"}
        return self.health_headers(w)

    @staticmethod
    def health_headers(w: Worker) -> dict[str, str] | None:
        """Authorization for /health: none (protocol.md 2), except the Basic credentials of the
        worker's URL, which a proxy in front of the worker asks for on every path."""
        return {"Authorization": w.basic_auth} if w.basic_auth else None

    def target_name(self, t: int) -> str | None:
        info = self.target_info[t] if 0 <= t < len(self.target_info) else None
        if info is None:
            return None
        w, rank = info
        return target_label(w, rank)

    # ---- add / remove -------------------------------------------------------------------------
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
    ) -> Worker:
        """Queue a worker for background registration. Raises DuplicateWorker (a ValueError) on a
        known URL and ValueError on a bad role; the handshake outcome is ``Worker.status``."""
        if role not in ROLES:
            raise ValueError(f"unknown worker_type {role!r} (expected one of {', '.join(ROLES)})")
        check_fields(priority, cost, labels, api_key)
        problem = worker_url_problem(url, self.config.allow_link_local_workers)
        if problem is not None:
            shown = url if len(url) <= 200 else url[:200] + "..."
            raise BadWorkerURL(f"worker URL {shown!r} {problem}")
        # The credentials of a user:password@ URL are kept apart (Basic auth to the worker);
        # from here on the URL has none, so no display can show them.
        basic = basic_auth(url)
        url = normalize_url(url)
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"worker URL {url!r}: only http:// and https:// workers are supported")
        host, port = split_host_port(url)
        if not host:
            raise ValueError(f"no host in worker URL {url!r}")
        self.own.check(url, address_key(host, port))
        same = self.find(url)
        if same is not None:
            raise DuplicateWorker(
                f"worker {url} already exists" if same.url == url else f"worker {url} is {same.url} (same address)"
            )
        w = Worker(
            url=url,
            role=role,
            host=host,
            port=port,
            bootstrap_port=bootstrap_port if role == "prefill" else None,
            requested_model_id=model_id,
            api_key=api_key or None,
            basic_auth=basic,
            addr=address_key(host, port),
        )
        if priority is not None:
            w.priority = priority
        if cost is not None:
            w.cost = float(cost)
        if labels:
            w.labels = {str(k): str(v) for k, v in labels.items()}
        self.workers.append(w)
        self.index(w)
        w.task = asyncio.get_running_loop().create_task(self.handshake.register(w), name=f"register {url}")
        log.info("registering %s worker %s (id %s)", role, url, w.id)
        return w

    async def wait_registered(self, w: Worker, timeout: float | None = None) -> bool:
        """Wait for ``w``'s handshake to finish (at most ``timeout`` seconds, None: no bound;
        the handshake goes on after a timeout); True when it became ready."""
        if w.task is not None and not w.task.done():
            await asyncio.wait([w.task], timeout=timeout)
        return w.status == "ready"

    def remove_worker(self, w: Worker) -> None:
        """Forget ``w``: out of its group now, rows freed once nothing is in flight on them."""
        self.drop(w)
        was_ready = w.status == "ready"
        w.status = "removed"
        w.healthy = False
        self.invalidate_ready()
        for task in (w.task, w.dp_task):
            if task is not None and not task.done():
                task.cancel()
        if was_ready:
            self._sync_group(w.role)
            for t in w.targets:
                self.table.set_healthy(t, False)
                self.table.mark_unpolled(t)
                self._retire(t)
        log.info("removed %s worker %s", w.role, w.url)

    def drop(self, w: Worker) -> None:
        """Take ``w`` out of the worker list and the lookups, if it is still there."""
        if self._by_id.get(w.id) is w:
            self.workers.remove(w)
            self.unindex(w)

    def activate(self, w: Worker) -> None:
        """Give the worker its rows and publish them to its group (synchronous: no await)."""
        # A per-rank-port server is always split: its ports are its ranks.
        n = len(w.rank_urls) if w.rank_ports else (w.dp_size if (self.config.dp_aware and w.dp_size > 1) else 1)
        rows: list[int] = []
        try:
            for _ in range(n):
                rows.append(self.table.alloc())
        except Exception:
            for t in rows:
                self.table.free(t)
            raise
        w.targets = rows
        w.names = [target_label(w, None if n == 1 else r) for r in range(n)]
        w.rank_healthy = [True] * n if w.rank_ports else []
        w.rank_failures = [0] * n if w.rank_ports else []
        w.rank_successes = [0] * n if w.rank_ports else []
        for r, t in enumerate(rows):
            if t >= len(self.target_info):
                self.target_info.extend([None] * (t + 1 - len(self.target_info)))
            self.target_info[t] = (w, r if n > 1 else None)
            self.table.set_healthy(t, True)
        w.healthy = True
        w.health_failures = w.health_successes = 0
        w.dp_checked = asyncio.get_running_loop().time()
        w.status = "ready"
        self.invalidate_ready()
        w.error = None
        self._sync_group(w.role, soon=True)
        log.info(
            "worker %s ready: role=%s model=%s dp_size=%d ranks=%s targets=%s",
            w.url,
            w.role,
            w.model_id,
            w.dp_size,
            ",".join(w.names),
            rows,
        )

    # ---- dp_size changes (a worker restarted with another --dp-size) ------------------------
    def recheck_dp(self, w: Worker, why: str, force: bool = True) -> None:
        """Re-read ``w``'s dp_size in the background (one check at a time per worker); the
        monitor calls it when polls suggest a restart and on a slow schedule. Unless
        ``force``, at most once per DP_RECHECK_MIN_SECS (a hint that keeps holding must not
        turn into a /server_info request per poll)."""
        if not (self.config.dp_aware or w.rank_ports) or w.status != "ready":
            return
        if w.dp_task is not None and not w.dp_task.done():
            return
        now = asyncio.get_running_loop().time()
        if not force and now - w.dp_checked < DP_RECHECK_MIN_SECS:
            return
        w.dp_checked = now
        w.dp_task = asyncio.get_running_loop().create_task(self._recheck_dp(w, why), name=f"dp_size {w.url}")

    async def _recheck_dp(self, w: Worker, why: str) -> None:
        timeout = max(float(self.config.health_check_timeout_secs), 0.001)
        try:
            doc, _ = await self.handshake.get_info(w, w.server_info_path, "/get_server_info", timeout)
        except (HttpClientError, Transient) as exc:
            log.debug("dp_size check of %s failed: %s", w.url, exc)
            return
        if w.rank_ports:
            self.ranks.recheck(w, doc or {}, why)
            return
        dp = (doc or {}).get("dp_size")
        if not isinstance(dp, int) or isinstance(dp, bool) or not 1 <= dp <= 4096:
            return
        if w.status == "ready" and dp != w.dp_size:
            w.server_info = doc or w.server_info
            self.resize(w, dp, why)

    def resize(self, w: Worker, dp: int, why: str = "") -> None:
        """Give a ready worker ``dp`` rank targets instead of its current ones: rows of ranks
        that stay are kept (their leases and counts with them), rows of ranks that are gone
        leave the group and are freed once their last lease is released, new ranks get new
        rows. A full table keeps the old layout (logged)."""
        n_old, n = len(w.targets), (len(w.rank_urls) if w.rank_ports else dp if dp > 1 else 1)
        bound = self.config.max_targets_per_worker
        if n > bound:
            log.error(
                "worker %s now has dp_size %d; keeping its %d ranks: one worker may take at most %d "
                "targets (--max-targets-per-worker)",
                w.url,
                dp,
                n_old,
                bound,
            )
            return
        added: list[int] = []
        try:
            for _ in range(n - n_old):
                added.append(self.table.alloc())
        except Exception as exc:
            for t in added:
                self.table.free(t)
            log.error("worker %s now has dp_size %d but its ranks cannot be added: %s", w.url, dp, exc)
            return
        old_dp, kept, gone = w.dp_size, w.targets[:n], w.targets[n:]
        w.dp_size = dp
        w.targets = kept + added
        w.names = [target_label(w, None if n == 1 else r) for r in range(n)]
        if w.rank_ports:
            del w.rank_healthy[n:], w.rank_failures[n:], w.rank_successes[n:]
            w.rank_healthy.extend([True] * (n - len(w.rank_healthy)))
            w.rank_failures.extend([0] * (n - len(w.rank_failures)))
            w.rank_successes.extend([0] * (n - len(w.rank_successes)))
        for r, t in enumerate(w.targets):
            if t >= len(self.target_info):
                self.target_info.extend([None] * (t + 1 - len(self.target_info)))
            self.target_info[t] = (w, r if n > 1 else None)
            if t in added:
                self.table.set_healthy(t, w.healthy)
        self.table.bump_generation()  # kept rows may have new names (url@0 <-> url): a new set
        self._sync_group(w.role)
        for t in gone:
            self.table.set_healthy(t, False)
            self.table.mark_unpolled(t)
            self._retire(t)
        log.warning(
            "worker %s dp_size changed %d -> %d (%s): ranks=%s", w.url, old_dp, dp, why or "re-read", ",".join(w.names)
        )

    def _sync_group(self, role: str, soon: bool = False) -> None:
        """Publish the role's ready targets to its group and the listeners. ``soon``: once
        for every activation of this loop iteration (hundreds of discovered workers turn
        ready together; each sync is O(workers)), before any I/O of the next iteration is
        handled. A removal syncs at once (its rows may be reused right after)."""
        if soon:
            if not self._sync_soon:
                loop = asyncio.get_running_loop()
                recent = self._recent_syncs
                if len(recent) == STORM_SYNCS and loop.time() - recent[0] < STORM_WINDOW:
                    # A registration storm (a fleet turning ready one worker per loop step):
                    # one sync per STORM_DELAY for all of them instead of one per worker.
                    loop.call_later(STORM_DELAY, self._sync_pending)
                else:
                    loop.call_soon(self._sync_pending)
            self._sync_soon.add(role)
            return
        self._sync_soon.discard(role)
        targets: list[int] = []
        names: list[str] = []
        for w in self.workers:
            if w.role == role and w.status == "ready":
                targets.extend(w.targets)
                names.extend(w.names)
        self._groups[role].set_targets(targets, names)
        for cb in self._listeners:
            cb(role)

    def _sync_pending(self) -> None:
        if self._sync_soon:
            self._recent_syncs.append(asyncio.get_running_loop().time())
        for role in sorted(self._sync_soon):
            self._sync_group(role)

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
