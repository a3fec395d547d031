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
namespace or all. The watch resumes from the list's resourceVersion, so no event between list
and watch is lost; BOOKMARK events advance it; ``410 Gone`` (HTTP status or an ERROR event)
re-lists, and the list result replaces that selector's pod set in one step, so a pod that
stayed is never removed in between. A pod is a worker while it matches the selector, has
phase Running, condition Ready=True and a pod IP, and carries no deletionTimestamp; its URL is
``http://<podIP>:<--service-discovery-port>``; a prefill pod's bootstrap port comes from the
``--bootstrap-port-annotation`` annotation (absent: null, as the peers). A pod matching both
PD selectors is logged once as an error and not used. API errors (unreachable, 401, 403, 5xx)
keep the current workers, back off (0.5 s doubling to 30 s) and are counted in
``fastroute_discovery_errors_total``.

Client library: ``kubernetes_asyncio``, the official client's generated API and config loaders
(kubeconfig with exec/OIDC plugins, in-cluster token refresh) on aiohttp, so the watch stays a
coroutine on the router's loop instead of a thread per stream as the official ``kubernetes``
client (urllib3, blocking) would need. Responses are read raw (``_preload_content=False``) and
parsed as JSON lines: no V1Pod model objects are built per event.

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
import json
import logging
import os
from typing import Any, Iterable, Mapping

from fastroute.config import ConfigError
from fastroute.kube import NO_KUBE_CONFIG, kube_config_source, parse_selector
from fastroute.control.worker import ROLES, DuplicateWorker

log = logging.getLogger("fastroute.discovery")

__all__ = ["Discovery", "start_discovery", "pod_worker", "selector_matches", "read_manifest"]

BACKOFF_INITIAL = 0.5
BACKOFF_MAX = 30.0
FILE_POLL_SECS = 0.2
# Reasons the API gives for a status, turned into what the operator has to fix.
_HINTS = {401: "the credentials were rejected (expired token or wrong kubeconfig user)",
          403: "RBAC forbids it: the service account needs get, list and watch on pods "
               "(a Role + RoleBinding, see deploy/kubernetes.yaml)",
          404: "the namespace or API path does not exist"}

# What one URL should be: (role, bootstrap port, source: pod namespace/name or manifest entry).
Found = tuple


class Discovery:
    """Reconciles a provider's desired workers with the registry (see module docstring)."""

    def __init__(self, provider: str, registry: Any, stats: Any) -> None:
        self.provider = provider
        self.registry = registry
        self.stats = stats
        self.owned: dict[str, tuple[Found, Any]] = {}     # url -> (what, Worker)
        self._foreign: set[str] = set()     # URLs registered by someone else, logged once
        self._tasks: list[asyncio.Task] = []
        self._api: Any = None
        if stats is not None:
            stats.discovered = {r: 0 for r in self._roles()}

    def _roles(self) -> tuple[str, ...]:
        return ("prefill", "decode") if self.registry.config.pd_disaggregation else ("regular",)

    def apply(self, desired: Mapping[str, Found]) -> None:
        """Add what is desired and missing, remove what this discovery added and is gone."""
        reg = self.registry
        for url, (what, w) in list(self.owned.items()):
            if desired.get(url) != what:
                del self.owned[url]
                if w in reg.workers:
                    log.info("discovery (%s): removing %s worker %s (%s)", self.provider, w.role,
                             url, what[2])
                    reg.remove_worker(w)
        for url, what in desired.items():
            held = self.owned.get(url)
            if held is not None and held[1] in reg.workers:
                continue
            role, bport, source = what
            try:
                w = reg.add_worker(url, role, bootstrap_port=bport,
                                   labels={"discovery": self.provider, "source": source})
            except DuplicateWorker:
                if url not in self._foreign:
                    self._foreign.add(url)
                    log.info("discovery (%s): %s is already registered (command line or "
                             "/workers); left as it is", self.provider, url)
                continue
            except ValueError as exc:
                if url not in self._foreign:
                    self._foreign.add(url)
                    log.error("discovery (%s): cannot add %s: %s", self.provider, url, exc)
                continue
            self._foreign.discard(url)
            self.owned[url] = (what, w)
            log.info("discovery (%s): adding %s worker %s (%s)", self.provider, role, url, source)
        if self.stats is not None:
            counts = {r: 0 for r in self._roles()}
            for what, _ in self.owned.values():
                counts[what[0]] = counts.get(what[0], 0) + 1
            self.stats.discovered = counts

    def error(self, reason: str) -> None:
        if self.stats is not None:
            self.stats.count(self.stats.discovery_errors, (self.provider, reason))

    def spawn(self, coro: Any, name: str) -> None:
        self._tasks.append(asyncio.get_running_loop().create_task(coro, name=name))

    async def stop(self) -> None:
        """Stop watching; the workers stay registered (the registry stops them itself)."""
        for t in self._tasks:
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._api is not None:
            await self._api.api_client.close()
            self._api = None


async def start_discovery(config: Any, registry: Any, stats: Any) -> Discovery | None:
    """Start the configured provider in the background; None when discovery is off. Raises
    ConfigError when the Kubernetes configuration is missing or unusable."""
    provider = config.discovery
    if provider is None:
        return None
    d = Discovery(provider, registry, stats)
    if provider == "file":
        d.spawn(_follow_file(d, config), "discovery file")
        log.info("discovery: following manifest %s", config.discovery_file)
        return d
    d._api = await _kube_api()
    roles = ([("prefill", config.prefill_selector), ("decode", config.decode_selector)]
             if config.pd_disaggregation else [("regular", config.selector)])
    sets = _PodSets(d, config, [r for r, sel in roles if sel])
    for role, tokens in roles:
        if tokens:
            d.spawn(_watch_pods(d, sets, role, parse_selector(tokens)), f"discovery {role} pods")
    log.info("discovery: watching pods in %s: %s", config.service_discovery_namespace or
             "all namespaces", "; ".join(f"{r} {','.join(t)}" for r, t in roles if t))
    return d


# ---------------------------------------------------------------------------------- pods


def selector_matches(reqs: Iterable[tuple[str, str, tuple[str, ...]]],
                     labels: Mapping[str, str]) -> bool:
    """Kubernetes label-selector semantics over parsed requirements (config.parse_selector)."""
    for key, op, values in reqs:
        v = labels.get(key)
        if op == "exists":
            ok = v is not None
        elif op == "!exists":
            ok = v is None
        elif op in ("=", "in"):
            ok = v is not None and v in values
        else:   # != and notin also match a missing label, as in Kubernetes
            ok = v is None or v not in values
        if not ok:
            return False
    return True


def pod_worker(pod: Mapping[str, Any], port: int, annotation: str) -> tuple[str, int | None] | None:
    """-> (worker URL, bootstrap port or None) of a usable pod, or None: a pod counts while it
    is Running and Ready with a pod IP and is not being deleted."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    ip = status.get("podIP")
    if not ip or meta.get("deletionTimestamp") or status.get("phase") != "Running":
        return None
    if not any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in status.get("conditions") or ()):
        return None
    host = f"[{ip}]" if ":" in ip else ip
    raw = (meta.get("annotations") or {}).get(annotation)
    try:
        bport = int(raw) if raw is not None else None
    except ValueError:
        bport = None
    if bport is not None and not 1 <= bport <= 65535:
        bport = None
    return f"http://{host}:{port}", bport


class _PodSets:
    """Pods seen per role; recomputes the desired workers whenever one changes."""

    def __init__(self, d: Discovery, config: Any, roles: list[str]) -> None:
        self.d = d
        self.port = int(config.service_discovery_port)
        self.annotation = config.bootstrap_port_annotation
        self.pods: dict[str, dict[str, Mapping[str, Any]]] = {r: {} for r in roles}
        self._both: set[str] = set()

    def changed(self) -> None:
        desired: dict[str, Found] = {}
        seen: dict[str, str] = {}
        for role, pods in self.pods.items():
            for key, pod in pods.items():
                if key in seen:
                    if key not in self._both:
                        self._both.add(key)
                        log.error("discovery: pod %s matches both the prefill and the decode "
                                  "selector; not used", key)
                    desired = {u: f for u, f in desired.items() if f[2] != key}
                    continue
                seen[key] = role
                got = pod_worker(pod, self.port, self.annotation)
                if got is not None:
                    url, bport = got
                    desired[url] = (role, bport if role == "prefill" else None, key)
        self.d.apply(desired)


class _ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status} {message}")
        self.status = status
        self.message = message


async def _kube_api() -> Any:
    # Deferred: kubernetes_asyncio + aiohttp take ~0.3 s to import and only discovery uses them.
    from kubernetes_asyncio import client, config as kconfig
    from kubernetes_asyncio.config.config_exception import ConfigException

    source = kube_config_source()
    if source is None:
        raise ConfigError("--service-discovery", NO_KUBE_CONFIG)
    conf = client.Configuration()
    try:
        if source[0] == "incluster":
            kconfig.load_incluster_config(client_configuration=conf)
        else:
            await kconfig.load_kube_config(config_file=source[1], client_configuration=conf,
                                           persist_config=False)
    except (ConfigException, OSError, ValueError) as exc:
        raise ConfigError("--service-discovery", f"unusable Kubernetes configuration "
                          f"({source[1] or 'in-cluster'}): {exc}") from None
    return client.CoreV1Api(client.ApiClient(configuration=conf))


async def _request(d: Discovery, ns: str | None, selector: str, **kw: Any) -> Any:
    api = d._api
    if ns:
        resp = await api.list_namespaced_pod(ns, label_selector=selector, _preload_content=False,
                                             **kw)
    else:
        resp = await api.list_pod_for_all_namespaces(label_selector=selector,
                                                     _preload_content=False, **kw)
    if resp.status != 200:
        body = await resp.read()
        resp.release()
        try:
            message = json.loads(body).get("message") or ""
        except (ValueError, AttributeError):
            message = body[:200].decode("utf-8", "replace")
        raise _ApiError(resp.status, message)
    return resp


def _key(pod: Mapping[str, Any]) -> str:
    meta = pod.get("metadata") or {}
    return f"{meta.get('namespace', '')}/{meta.get('name', '')}"


async def _watch_pods(d: Discovery, sets: _PodSets, role: str,
                      reqs: list[tuple[str, str, tuple[str, ...]]]) -> None:
    """List, then watch from the list's resourceVersion, forever (see module docstring)."""
    import aiohttp  # already loaded by _kube_api; named here only for its exception types

    cfg = d.registry.config
    ns = cfg.service_discovery_namespace
    selector = ",".join(_requirement_text(r) for r in reqs)
    interval = int(cfg.discovery_check_interval_secs)
    rv: str | None = None
    backoff = BACKOFF_INITIAL
    while True:
        try:
            if rv is None:
                resp = await _request(d, ns, selector, _request_timeout=30)
                doc = json.loads(await resp.read())
                resp.release()
                rv = (doc.get("metadata") or {}).get("resourceVersion") or ""
                sets.pods[role] = {_key(p): p for p in doc.get("items") or ()
                                   if selector_matches(reqs, (p.get("metadata") or {}).get("labels") or {})}
                sets.changed()
            resp = await _request(d, ns, selector, watch=True, resource_version=rv,
                                  allow_watch_bookmarks=True, timeout_seconds=interval,
                                  _request_timeout=aiohttp.ClientTimeout(sock_connect=10,
                                                                         sock_read=interval + 30))
            started = asyncio.get_running_loop().time()
            try:
                rv = await _consume(resp, sets, role, reqs, rv)
            finally:
                resp.release()
            sets.changed()      # also re-adds a worker whose registration gave up meanwhile
            if asyncio.get_running_loop().time() - started < 1.0:
                # A watch that ends at once (a proxy in between, a broken server) must not turn
                # into a request loop; nothing is lost meanwhile, the next one resumes from rv.
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX)
            else:
                backoff = BACKOFF_INITIAL
        except asyncio.CancelledError:
            raise
        except _ApiError as exc:
            if exc.status == 410:
                log.info("discovery: watch of %s pods expired (410 Gone); listing again", role)
                rv = None
                continue
            d.error(str(exc.status))
            log.warning("discovery: Kubernetes API answered %d for %s pods in %s: %s%s; keeping "
                        "the current workers, retrying in %.1fs", exc.status, role,
                        ns or "all namespaces", exc.message,
                        f" ({_HINTS[exc.status]})" if exc.status in _HINTS else "", backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as exc:
            d.error("unreachable")
            log.warning("discovery: Kubernetes API unreachable for %s pods (%s: %s); keeping the "
                        "current workers, retrying in %.1fs", role, type(exc).__name__, exc,
                        backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, BACKOFF_MAX)


async def _consume(resp: Any, sets: _PodSets, role: str,
                   reqs: list[tuple[str, str, tuple[str, ...]]], rv: str) -> str:
    """Apply watch events (one JSON object per line) until the server ends the watch."""
    pods = sets.pods[role]
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                break
            line, buf = buf[:nl], buf[nl + 1:]
            if not line.strip():
                continue
            event = json.loads(line)
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                raise _ApiError(int(obj.get("code") or 500), obj.get("message") or "watch error")
            rv = (obj.get("metadata") or {}).get("resourceVersion") or rv
            if kind == "BOOKMARK":
                continue
            key = _key(obj)
            labels = (obj.get("metadata") or {}).get("labels") or {}
            if kind == "DELETED" or not selector_matches(reqs, labels):
                if pods.pop(key, None) is None:
                    continue
            elif kind in ("ADDED", "MODIFIED"):
                pods[key] = obj
            else:
                continue
            sets.changed()
    return rv


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
            raise ValueError(f"workers[{i}]: worker_type {role!r} is not one of "
                             + ", ".join(allowed) + (" (PD mode)" if pd else " (regular mode)"))
        bport = e.get("bootstrap_port")
        if bport is not None and (not isinstance(bport, int) or isinstance(bport, bool)
                                  or not 1 <= bport <= 65535):
            raise ValueError(f"workers[{i}]: bootstrap_port must be an integer in 1..65535 or null")
        url = e["url"].strip().rstrip("/")
        if url in out:
            raise ValueError(f"workers[{i}]: {url} is listed twice")
        out[url] = (role, bport if role == "prefill" else None, f"workers[{i}]")
    return out


async def _follow_file(d: Discovery, config: Any) -> None:
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
            log.warning("discovery: cannot stat %s: %s", path, exc)
        now = loop.time()
        if sig is not None and (sig != seen or now >= due):
            changed, seen, due = sig != seen, sig, now + interval
            try:
                with open(path, encoding="utf-8") as f:
                    desired = read_manifest(f.read(), pd)
            except (OSError, ValueError) as exc:
                if changed:
                    d.error("malformed")
                    log.error("discovery: manifest %s rejected, keeping the last good set of %d "
                              "workers: %s", path, len(d.owned), exc)
            else:
                d.apply(desired)
        await asyncio.sleep(FILE_POLL_SECS)
