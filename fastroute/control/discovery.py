"""Worker discovery: Kubernetes pods or a JSON manifest file, turned into registry workers.

Owns the set of workers it registered and nothing else. A provider computes the *desired*
set (url -> role, bootstrap port) and :meth:`Discovery.apply` reconciles it with the registry
through its public ``add_worker`` / ``remove_worker``, exactly what ``POST /workers`` and
``DELETE /workers/{id}`` do: handshake, health, load polls, ``--dp-aware`` ranks, breakers and
draining (rows freed once nothing is in flight) work as for URLs from the command line.
Workers from the command line or ``POST /workers`` live beside discovered ones; a URL already
registered by them is left alone. Everything runs on the router's event loop, in the process
that owns the registry (the single-process server, or the supervisor under ``--workers N``).

Kubernetes (``--service-discovery``): one list + watch per selector (two in PD mode), in one
namespace or all, by :func:`fastroute.control.kube_watch.watch` (the loop InferencePool
discovery uses too: resume from the list's resourceVersion, BOOKMARKs, ``410 Gone`` lists again
after a backoff, a watch silent past ``--discovery-check-interval-secs`` plus 5 s is resumed and
counted as ``watch_idle``, API errors keep the current workers, back off 0.5 s doubling to 30 s
and are counted in ``fastroute_discovery_errors_total``, each episode logged once). A list
result replaces that selector's pod set in one step, so a pod that stayed is never removed in
between. An event or listed pod of the wrong shape (``null``, a list, metadata not an object,
labels not a map of strings, a podIP that is no string...) is skipped and counted as
``bad_object``; the watch goes on. Each event costs O(1) (only its pod's worker is recomputed,
registry lookups are dicts) and the reconciling hands the loop back every 10 ms, so a burst of
1,500 pods does not stall requests. Each watch runs supervised (control/background.py):
whatever still escapes is logged once, counted and the watch restarted. A pod is a worker while
it matches the selector, has phase Running, condition Ready=True and a pod IP, and carries no
deletionTimestamp; its URL is ``http://<podIP>:<--service-discovery-port>``; a prefill pod's
bootstrap port comes from the ``--bootstrap-port-annotation`` annotation (absent: null, as the
peers). A pod matching both PD selectors is logged once as an error and not used.

File (``--discovery-provider file --discovery-file PATH``): smg's manifest format could not be
found, so fastroute defines a small one, the ``POST /workers`` body per worker::

    {"workers": [{"url": "http://10.0.0.5:8000", "worker_type": "prefill",
                  "bootstrap_port": 8998, "model_id": "m", "labels": {"zone": "a"}}]}

(a bare list is accepted too; ``worker_type`` defaults to regular, and must be prefill or
decode in PD mode). The file may appear after start-up; it is re-read when its stat changes
(checked every 0.2 s) and every ``--discovery-check-interval-secs``. A malformed manifest keeps
the last good set and logs why once per version of the file.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

from fastroute.control.background import cancel_all
from fastroute.control.kube_watch import BACKOFF_MAX, kube_api, watch
from fastroute.control.worker import ROLES, DuplicateWorker
from fastroute.kube import parse_selector

log = logging.getLogger("fastroute.discovery")

__all__ = ["Discovery", "start_discovery", "pod_worker", "selector_matches", "read_manifest"]

FILE_POLL_SECS = 0.2
SLICE_SECS = 0.01  # longest stretch of reconciling before the loop gets a turn
_LIVE = ("pending", "ready")  # Worker.status of a worker still in the registry
# Reasons the API gives for a status, turned into what the operator has to fix.
_HINTS = {
    401: "the credentials were rejected (expired token or wrong kubeconfig user)",
    403: "RBAC forbids it: the service account needs get, list and watch on pods "
    "(a Role + RoleBinding, see deploy/kubernetes.yaml)",
    404: "the namespace or API path does not exist",
}

# What one URL should be: (role, bootstrap port, source: pod namespace/name or manifest entry).
Found = tuple


class Discovery:
    """Reconciles a provider's desired workers with the registry (see module docstring)."""

    def __init__(self, provider: str, registry: Any, stats: Any) -> None:
        self.provider = provider
        self.registry = registry
        self.stats = stats
        self.owned: dict[str, tuple[Found, Any]] = {}  # url -> (what, Worker)
        self._foreign: set[str] = set()  # URLs registered by someone else, logged once
        self._counts: dict[str, int] = {}  # role -> len(owned) of that role
        self._slice_mark = 0.0  # time.monotonic() of the last pause()
        self._tasks: list[asyncio.Task] = []
        self.api: Any = None  # the Kubernetes CoreV1Api (kube_watch.kube_api), once started
        if stats is not None:
            stats.discovered = {r: 0 for r in self._roles()}

    def _roles(self) -> tuple[str, ...]:
        return ("prefill", "decode") if self.registry.config.pd_disaggregation else ("regular",)

    async def apply(self, desired: Mapping[str, Found]) -> None:
        """Add what is desired and missing, remove what this discovery added and is gone."""
        await self.apply_urls(desired, [*(u for u in self.owned if u not in desired), *desired])

    async def apply_urls(self, desired: Mapping[str, Found], urls: Iterable[str]) -> None:
        """Reconcile only ``urls`` with ``desired`` (a watch event touches one or two). Every
        step is O(1); the loop is handed back every SLICE_SECS, so a burst of thousands of
        pods never stalls the requests being served meanwhile."""
        for url in urls:
            self._reconcile(url, desired.get(url))
            await self.pause()
        if self.stats is not None:
            self.stats.discovered = {r: self._counts.get(r, 0) for r in self._roles()}

    async def pause(self) -> None:
        """Hand the loop back once SLICE_SECS of work went by since it last had a turn here
        (counted across calls: a chunk of 500 watch events is one step otherwise)."""
        now = time.monotonic()
        if now - self._slice_mark >= SLICE_SECS:
            await asyncio.sleep(0)
            self._slice_mark = time.monotonic()

    def _reconcile(self, url: str, what: Found | None) -> None:
        reg = self.registry
        held = self.owned.get(url)
        if held is not None:
            if held[0] == what and held[1].status in _LIVE:
                return
            del self.owned[url]
            self._counts[held[0][0]] -= 1
            w = held[1]
            if w.status in _LIVE:
                log.info("discovery (%s): removing %s worker %s (%s)", self.provider, w.role, url, held[0][2])
                reg.remove_worker(w)
        if what is None:
            return
        role, bport, source = what
        try:
            w = reg.add_worker(url, role, bootstrap_port=bport, labels={"discovery": self.provider, "source": source})
        except DuplicateWorker:
            if url not in self._foreign:
                self._foreign.add(url)
                log.info(
                    "discovery (%s): %s is already registered (command line or /workers); left as it is",
                    self.provider,
                    url,
                )
            return
        except ValueError as exc:
            if url not in self._foreign:
                self._foreign.add(url)
                log.error("discovery (%s): cannot add %s: %s", self.provider, url, exc)
            return
        self._foreign.discard(url)
        self.owned[url] = (what, w)
        self._counts[role] = self._counts.get(role, 0) + 1
        log.info("discovery (%s): adding %s worker %s (%s)", self.provider, role, url, source)

    def error(self, reason: str) -> None:
        if self.stats is not None:
            self.stats.count(self.stats.discovery_errors, (self.provider, reason))

    def spawn(self, body: Any, name: str) -> None:
        """Run ``body(state)`` supervised (fastroute.control.background): never ends silently."""
        self._tasks.append(self.registry.background.spawn(name, body, cap=BACKOFF_MAX))

    async def stop(self) -> None:
        """Stop watching; the workers stay registered (the registry stops them itself)."""
        await cancel_all(self._tasks)
        self._tasks = []
        if self.api is not None:
            await self.api.api_client.close()
            self.api = None


async def start_discovery(config: Any, registry: Any, stats: Any) -> Discovery | None:
    """Start the configured provider in the background; None when discovery is off. Raises
    ConfigError when the Kubernetes configuration is missing or unusable."""
    provider = config.discovery
    if provider is None:
        return None
    d = Discovery(provider, registry, stats)
    if provider == "file":
        d.spawn(lambda st: _follow_file(d, config, st), "discovery file")
        log.info("discovery: following manifest %s", config.discovery_file)
        return d
    d.api = await kube_api("--service-discovery")
    roles = (
        [("prefill", config.prefill_selector), ("decode", config.decode_selector)]
        if config.pd_disaggregation
        else [("regular", config.selector)]
    )
    sets = PodSets(d, config, [r for r, sel in roles if sel])
    interval = int(config.discovery_check_interval_secs)
    for role, tokens in roles:
        if tokens:
            pods = PodWatch(sets, role, parse_selector(tokens), config.service_discovery_namespace)
            d.spawn(functools.partial(watch, pods, interval=interval, log=log), f"discovery {role} pods")
    log.info(
        "discovery: watching pods in %s: %s",
        config.service_discovery_namespace or "all namespaces",
        "; ".join(f"{r} {','.join(t)}" for r, t in roles if t),
    )
    return d


# ---------------------------------------------------------------------------------- pods


def selector_matches(reqs: Iterable[tuple[str, str, tuple[str, ...]]], labels: Mapping[str, str]) -> bool:
    """Kubernetes label-selector semantics over parsed requirements (config.parse_selector)."""
    for key, op, values in reqs:
        v = labels.get(key)
        if op == "exists":
            ok = v is not None
        elif op == "!exists":
            ok = v is None
        elif op in ("=", "in"):
            ok = v is not None and v in values
        else:  # != and notin also match a missing label, as in Kubernetes
            ok = v is None or v not in values
        if not ok:
            return False
    return True


def _string_map(v: Any) -> bool:
    return v is None or (isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items()))


def pod_problem(pod: Any) -> str | None:
    """Why ``pod`` (a list item or watch object) is not shaped like a Pod, or None. Only the
    fields discovery reads are checked; a bad one makes the object skipped (and counted)."""
    if not isinstance(pod, dict):
        return f"the object is a JSON {type(pod).__name__}"
    meta = pod.get("metadata")
    if not isinstance(meta, dict):
        return "metadata is not an object"
    for f in ("name", "namespace", "resourceVersion"):
        if meta.get(f) is not None and not isinstance(meta[f], str):
            return f"metadata.{f} is not a string"
    if not isinstance(meta.get("name"), str) or not meta["name"]:
        return "metadata.name is missing"
    for f in ("labels", "annotations"):
        if not _string_map(meta.get(f)):
            return f"metadata.{f} is not a map of strings"
    status = pod.get("status")
    if status is None:
        return None
    if not isinstance(status, dict):
        return "status is not an object"
    for f in ("podIP", "phase"):
        if status.get(f) is not None and not isinstance(status[f], str):
            return f"status.{f} is not a string"
    conds = status.get("conditions")
    if conds is not None and (not isinstance(conds, list) or not all(isinstance(c, dict) for c in conds)):
        return "status.conditions is not a list of objects"
    return None


def pod_worker(pod: Mapping[str, Any], port: int, annotation: str) -> tuple[str, int | None] | None:
    """-> (worker URL, bootstrap port or None) of a usable pod, or None: a pod counts while it
    is Running and Ready with a pod IP and is not being deleted. ``pod`` passed pod_problem."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    ip = status.get("podIP")
    if not ip or meta.get("deletionTimestamp") or status.get("phase") != "Running":
        return None
    if not any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ()):
        return None
    host = f"[{ip}]" if ":" in ip else ip
    raw = (meta.get("annotations") or {}).get(annotation)
    try:
        bport = int(raw) if raw is not None else None
    except (TypeError, ValueError):
        bport = None
    if bport is not None and not 1 <= bport <= 65535:
        bport = None
    return f"http://{host}:{port}", bport


class PodSets:
    """Pods seen per role and the workers they make; an event updates only its pod's entry.
    Only what a pod makes is kept (its URL and bootstrap port, or None when unusable), not
    the pod object: thousands of pods stay a small heap for the garbage collector to walk."""

    def __init__(self, d: Discovery, config: Any, roles: list[str]) -> None:
        self.d = d
        self.port = int(config.service_discovery_port)
        self.annotation = config.bootstrap_port_annotation
        self.pods: dict[str, dict[str, tuple[str, int | None] | None]] = {r: {} for r in roles}
        self.desired: dict[str, Found] = {}  # url -> (role, bootstrap port, pod key)
        self._url_of: dict[str, str] = {}  # pod key -> its url in desired
        self._both: set[str] = set()
        self.bad_logged = False

    def _update(self, key: str) -> list[str]:
        """Recompute the worker of pod ``key`` -> the URLs whose desired entry changed."""
        touched = []
        old = self._url_of.pop(key, None)
        if old is not None and self.desired.get(old, (None, None, None))[2] == key:
            del self.desired[old]
            touched.append(old)
        roles = [r for r, pods in self.pods.items() if key in pods]
        if len(roles) > 1:
            if key not in self._both:
                self._both.add(key)
                log.error("discovery: pod %s matches both the prefill and the decode selector; not used", key)
            return touched
        self._both.discard(key)
        if roles:
            role = roles[0]
            got = self.pods[role][key]
            if got is not None:
                url, bport = got
                self.desired[url] = (role, bport if role == "prefill" else None, key)
                self._url_of[key] = url
                touched.append(url)
        return touched

    async def event(self, keys: Iterable[str]) -> None:
        urls: list[str] = []
        for key in keys:
            urls.extend(self._update(key))
        await self.d.apply_urls(self.desired, urls)

    def worker_of(self, pod: Mapping[str, Any]) -> tuple[str, int | None] | None:
        return pod_worker(pod, self.port, self.annotation)

    async def replace(self, role: str, pods: dict[str, tuple[str, int | None] | None]) -> None:
        """A list result replaces the role's pods in one step (a pod that stayed stays)."""
        keys = [*self.pods[role], *(k for k in pods if k not in self.pods[role])]
        self.pods[role] = pods
        await self.event(keys)

    def bad(self, role: str, what: str, problem: str) -> None:
        """Skip and count an object of the wrong shape (logged once until a watch ends well)."""
        self.d.error("bad_object")
        if not self.bad_logged:
            self.bad_logged = True
            log.warning(
                "discovery: skipped a %s from the Kubernetes API for %s pods: %s "
                '(counted in fastroute_discovery_errors_total{reason="bad_object"}; '
                "logged once until the watch works again)",
                what,
                role,
                problem,
            )


def _key(pod: Mapping[str, Any]) -> str:
    meta = pod["metadata"]
    return f"{meta.get('namespace') or ''}/{meta['name']}"


def _labels(pod: Mapping[str, Any]) -> Mapping[str, str]:
    return pod["metadata"].get("labels") or {}


class PodWatch:
    """The pods of one role's selector in one namespace (None: all), as
    :func:`~fastroute.control.kube_watch.watch` follows them into a :class:`PodSets`."""

    hints = _HINTS

    def __init__(
        self, sets: PodSets, role: str, reqs: list[tuple[str, str, tuple[str, ...]]], namespace: str | None
    ) -> None:
        self._sets = sets
        self._d = sets.d
        self._role = role
        self._reqs = reqs
        self._ns = namespace
        self._selector = ",".join(_requirement_text(r) for r in reqs)
        self.what = f"{role} pods in {namespace or 'all namespaces'}"

    async def request(self, **kw: Any) -> Any:
        api = self._d.api
        if self._ns:
            return await api.list_namespaced_pod(self._ns, label_selector=self._selector, **kw)
        return await api.list_pod_for_all_namespaces(label_selector=self._selector, **kw)

    async def listed(self, items: list[Any]) -> None:
        pods: dict[str, tuple[str, int | None] | None] = {}
        for p in items:
            await self._d.pause()
            problem = pod_problem(p)
            if problem is not None:
                self._sets.bad(self._role, "listed pod", problem)
            elif selector_matches(self._reqs, _labels(p)):
                pods[_key(p)] = self._sets.worker_of(p)
        await self._sets.replace(self._role, pods)

    async def changed(self, kind: str, obj: Any) -> None:
        problem = pod_problem(obj)
        if problem is not None:
            self._sets.bad(self._role, f"{kind} event", problem)
            return
        pods = self._sets.pods[self._role]
        key = _key(obj)
        if kind == "DELETED" or not selector_matches(self._reqs, _labels(obj)):
            if pods.pop(key, None) is None:
                return
        else:
            got = self._sets.worker_of(obj)
            if key in pods and pods[key] == got:
                return  # nothing discovery uses changed (status churn)
            pods[key] = got
        await self._sets.event((key,))

    def bad(self, what: str, problem: str) -> None:
        self._sets.bad(self._role, what, problem)

    def error(self, reason: str) -> None:
        self._d.error(reason)

    async def pause(self) -> None:
        await self._d.pause()

    async def watched(self) -> None:
        # Also re-adds a worker whose registration gave up meanwhile.
        await self._d.apply(self._sets.desired)
        self._sets.bad_logged = False


def _requirement_text(req: tuple[str, str, tuple[str, ...]]) -> str:
    key, op, values = req
    if op == "exists":
        return key
    if op == "!exists":
        return "!" + key
    if op in ("in", "notin"):
        return f"{key} {op} ({','.join(values)})"
    return f"{key}{op}{values[0]}"


# ---------------------------------------------------------------------------------- file


def read_manifest(text: str, pd: bool) -> dict[str, Found]:
    """Parse a manifest (see module docstring) -> desired workers; ValueError says what is wrong."""
    doc = json.loads(text)
    entries = doc.get("workers") if isinstance(doc, dict) else doc
    if not isinstance(entries, list):
        raise ValueError('expected {"workers": [...]} or a list of workers')
    allowed = ("prefill", "decode") if pd else ("regular",)
    out: dict[str, Found] = {}
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not isinstance(e.get("url"), str) or not e["url"]:
            raise ValueError(f"workers[{i}]: an object with a string `url` is required")
        role = e.get("worker_type") or "regular"
        if role not in ROLES or role not in allowed:
            raise ValueError(
                f"workers[{i}]: worker_type {role!r} is not one of "
                + ", ".join(allowed)
                + (" (PD mode)" if pd else " (regular mode)")
            )
        bport = e.get("bootstrap_port")
        if bport is not None and (not isinstance(bport, int) or isinstance(bport, bool) or not 1 <= bport <= 65535):
            raise ValueError(f"workers[{i}]: bootstrap_port must be an integer in 1..65535 or null")
        url = e["url"].strip().rstrip("/")
        if url in out:
            raise ValueError(f"workers[{i}]: {url} is listed twice")
        out[url] = (role, bport if role == "prefill" else None, f"workers[{i}]")
    return out


async def _follow_file(d: Discovery, config: Any, task: Any) -> None:
    path = config.discovery_file
    pd = bool(config.pd_disaggregation)
    interval = float(config.discovery_check_interval_secs)
    loop = asyncio.get_running_loop()
    seen: tuple[int, int, int] | None = None
    due = 0.0
    while True:
        try:
            st = os.stat(path)
            sig: tuple[int, int, int] | None = (st.st_mtime_ns, st.st_size, st.st_ino)
        except FileNotFoundError:
            sig = None
        except OSError as exc:
            sig = None
            if task.fail(f"cannot stat {path}: {exc}", logged=True):
                log.warning("discovery: cannot stat %s: %s", path, exc)
        now = loop.time()
        if sig is not None and (sig != seen or now >= due):
            changed, seen, due = sig != seen, sig, now + interval
            try:
                with open(path, encoding="utf-8") as f:
                    desired = read_manifest(f.read(), pd)
            except (OSError, ValueError, RecursionError) as exc:
                task.fail(f"manifest {path} rejected: {exc}", logged=True)
                if changed:
                    d.error("malformed")
                    log.error(
                        "discovery: manifest %s rejected, keeping the last good set of %d workers: %s",
                        path,
                        len(d.owned),
                        exc,
                    )
            else:
                await d.apply(desired)
                task.ok()
        await asyncio.sleep(FILE_POLL_SECS)
