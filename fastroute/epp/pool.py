"""InferencePool discovery (``fastroute epp --inference-pool NAME``): the picker's targets are
the endpoints of a Gateway API Inference Extension ``InferencePool``.

The pool (``inference.networking.k8s.io/v1``, namespaced) is listed and watched by name in its
namespace with the Kubernetes client pod discovery uses (:mod:`fastroute.control.discovery`:
``kubernetes_asyncio``, kubeconfig or in-cluster credentials, raw JSON lines). Its
``spec.selector.matchLabels`` selects pods in the same namespace; every Running and Ready pod
with an IP becomes one worker per ``spec.targetPorts[].number``: ``http://<podIP>:<port>``.
The pods are listed and watched by that selector exactly as ``--service-discovery`` does
(same list/watch, resume, 410 and backoff rules, same reconciling with the registry), so
health checks, load polls, ``--dp-aware`` ranks and draining apply to them as to any worker.

A change of the pool takes effect at once: new ports re-derive the workers of the pods already
seen; a new selector restarts the pod watch with it (its first list replaces the pod set in one
step, so a pod matched by both selectors stays). A pool that is deleted, not there yet, or that
the picker cannot serve (``appProtocol`` other than ``http``, a spec of the wrong shape) has no
endpoints: its workers are removed and the picker answers 503 until it is usable. The pool's
``endpointPickerRef`` tells the gateway where the picker is; the picker does not read it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Iterable
from typing import Any

from fastroute.control.background import backoff_delay, cancel_all
from fastroute.control.discovery import (
    BACKOFF_INITIAL,
    BACKOFF_MAX,
    WATCH_IDLE_GRACE,
    WATCH_IDLE_MAX,
    Discovery,
    _ApiError,
    _kube_api,
    _PodSets,
    _watch_pods,
    pod_worker,
)

log = logging.getLogger("fastroute.epp.pool")

GROUP = "inference.networking.k8s.io"
VERSION = "v1"
PLURAL = "inferencepools"
PROVIDER = "inferencepool"
SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
_LABEL_KEY_MAX = 317  # prefix (253) + "/" + name (63)

Spec = tuple[
    tuple[tuple[str, str], ...], tuple[int, ...]
]  # (matchLabels as sorted ((key, value), ...), target ports (int, ...))


def default_namespace() -> str:
    """The picker's own namespace in a pod (its service account's), else ``default``."""
    try:
        with open(SA_NAMESPACE_FILE, encoding="utf-8") as f:
            ns = f.read().strip()
    except OSError:
        ns = ""
    return ns or "default"


def pool_spec(obj: Any) -> Spec:
    """(matchLabels, target ports) of an InferencePool object; ValueError says what the picker
    cannot use (the API server validates the schema; this is what the picker relies on)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("spec"), dict):
        raise ValueError("the object has no spec")
    spec = obj["spec"]
    proto = spec.get("appProtocol", "http")
    if proto != "http":
        raise ValueError(f"appProtocol {proto!r}: the picker's workers must speak HTTP/1.1 (appProtocol http)")
    sel = spec.get("selector")
    labels = sel.get("matchLabels") if isinstance(sel, dict) else None
    if (
        not isinstance(labels, dict)
        or not labels
        or not all(
            isinstance(k, str) and k and len(k) <= _LABEL_KEY_MAX and isinstance(v, str) for k, v in labels.items()
        )
    ):
        raise ValueError("spec.selector.matchLabels is not a non-empty map of strings")
    ports = spec.get("targetPorts")
    if not isinstance(ports, list) or not ports:
        raise ValueError("spec.targetPorts is not a non-empty list")
    numbers = []
    for p in ports:
        n = p.get("number") if isinstance(p, dict) else None
        if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 65535:
            raise ValueError("spec.targetPorts[].number is not a port number")
        if n not in numbers:
            numbers.append(n)
    return tuple(sorted(labels.items())), tuple(numbers)


class _PoolPods(_PodSets):
    """The pool's pods and the workers they make: one per target port (a pod key maps to
    several URLs, recomputed when the ports change)."""

    def __init__(self, d: Discovery, config: Any) -> None:
        super().__init__(d, config, ["regular"])
        self.ports: tuple[int, ...] = ()
        self._urls: dict[str, list[str]] = {}  # pod key -> its URLs in desired

    def worker_of(self, pod: Any) -> Any:
        got = pod_worker(pod, 1, self.annotation)  # "http://<ip>:1": the base is kept
        return None if got is None else (got[0][: -len(":1")], None)

    def _update(self, key: str) -> list[str]:
        touched = []
        for url in self._urls.pop(key, ()):
            if self.desired.get(url, (None, None, None))[2] == key:
                del self.desired[url]
                touched.append(url)
        got = self.pods["regular"].get(key)
        if got is not None:
            urls = [f"{got[0]}:{port}" for port in self.ports]
            for url in urls:
                self.desired[url] = ("regular", None, key)
            self._urls[key] = urls
            touched.extend(urls)
        return touched

    async def set_ports(self, ports: tuple[int, ...]) -> None:
        self.ports = ports
        await self.event(list(self.pods["regular"]))


class PoolDiscovery:
    """Follows one InferencePool and its pods (see module docstring)."""

    def __init__(self, config: Any, registry: Any, stats: Any, name: str, namespace: str) -> None:
        self.config = config
        self.name = name
        self.namespace = namespace
        self.d = Discovery(PROVIDER, registry, stats)
        self.sets = _PoolPods(self.d, config)
        self.spec: Spec | None = None
        self.problem: str | None = None  # why the pool has no endpoints (None: it has)
        self._pods: asyncio.Task | None = None
        self._custom: Any = None

    async def start(self) -> None:
        from kubernetes_asyncio import client

        self.d._api = await _kube_api("--inference-pool")
        self._custom = client.CustomObjectsApi(self.d._api.api_client)
        self.d.spawn(self._watch_pool, f"discovery inferencepool {self.namespace}/{self.name}")
        log.info("discovery: following InferencePool %s/%s", self.namespace, self.name)

    async def stop(self) -> None:
        if self._pods is not None:
            await cancel_all([self._pods])
        await self.d.stop()

    # -- the pool ----------------------------------------------------------------------------
    async def apply(self, obj: Any) -> None:
        """The pool as it is now (None: absent): its selector and ports take effect."""
        spec: Spec | None = None
        problem = None
        if obj is None:
            problem = "not found"
        else:
            try:
                spec = pool_spec(obj)
            except ValueError as exc:
                problem = str(exc)
                self.d.error("bad_object")
        if problem != self.problem:
            if problem is None:
                log.info(
                    "discovery: InferencePool %s/%s: pods %s, ports %s",
                    self.namespace,
                    self.name,
                    ",".join(f"{k}={v}" for k, v in spec[0]) if spec else "",
                    ",".join(map(str, spec[1])) if spec else "",
                )
            else:
                log.error("discovery: InferencePool %s/%s has no endpoints: %s", self.namespace, self.name, problem)
        self.problem = problem
        if spec is not None and self.spec is not None and spec[0] == self.spec[0]:
            if spec[1] != self.sets.ports:
                log.info(
                    "discovery: InferencePool %s/%s ports now %s",
                    self.namespace,
                    self.name,
                    ",".join(map(str, spec[1])),
                )
                await self.sets.set_ports(spec[1])
            self.spec = spec
            return
        # A new selector (or none): the pod watch starts again with it.
        if self._pods is not None:
            await cancel_all([self._pods])
            self._pods = None
        self.spec = spec
        if spec is None:
            await self.sets.replace("regular", {})
            return
        self.sets.ports = spec[1]
        reqs: list[tuple[str, str, tuple[str, ...]]] = [(k, "=", (v,)) for k, v in spec[0]]

        async def pods(st: Any) -> None:
            await _watch_pods(self.d, self.sets, "regular", reqs, st, namespace=self.namespace)

        self._pods = self.d.registry.background.spawn(
            f"discovery inferencepool pods {self.namespace}/{self.name}", pods, cap=BACKOFF_MAX
        )

    async def _request(self, **kw: Any) -> Any:
        resp = await self._custom.list_namespaced_custom_object(
            GROUP,
            VERSION,
            self.namespace,
            PLURAL,
            field_selector=f"metadata.name={self.name}",
            _preload_content=False,
            **kw,
        )
        if resp.status != 200:
            body = await resp.read()
            resp.release()
            try:
                message = json.loads(body).get("message") or ""
            except (ValueError, AttributeError, RecursionError):
                message = body[:200].decode("utf-8", "replace")
            raise _ApiError(resp.status, message)
        return resp

    def _mine(self, obj: Any) -> bool:
        meta = obj.get("metadata") if isinstance(obj, dict) else None
        return isinstance(meta, dict) and meta.get("name") == self.name

    async def _list(self) -> str:
        resp = await self._request(_request_timeout=30)
        try:
            doc = json.loads(await resp.read())
        finally:
            resp.release()
        if not isinstance(doc, dict) or not isinstance(doc.get("items") or [], list):
            raise _ApiError(502, "the InferencePool list is not a list object")
        found = [o for o in doc.get("items") or () if self._mine(o)]
        await self.apply(found[0] if found else None)
        meta = doc.get("metadata")
        rv = meta.get("resourceVersion") if isinstance(meta, dict) else None
        return rv if isinstance(rv, str) else ""

    async def _watch_pool(self, st: Any) -> None:
        """List, then watch from the list's resourceVersion, forever; 410 lists again, API
        errors keep the current workers and back off (as the pod watch)."""
        import aiohttp

        interval = int(self.config.discovery_check_interval_secs)
        idle = min(interval + WATCH_IDLE_GRACE, WATCH_IDLE_MAX)
        rv: str | None = None
        backoff = BACKOFF_INITIAL
        logged = False
        while True:
            try:
                if rv is None:
                    rv = await self._list()
                    st.ok()
                resp = await self._request(
                    watch=True,
                    resource_version=rv,
                    allow_watch_bookmarks=True,
                    timeout_seconds=interval,
                    _request_timeout=aiohttp.ClientTimeout(sock_connect=10, sock_read=idle),
                )
                started = asyncio.get_running_loop().time()
                try:
                    rv = await self._consume(resp, rv)
                except asyncio.TimeoutError:
                    self.d.error("watch_idle")
                finally:
                    resp.release()
                st.ok()
                logged = False
                if asyncio.get_running_loop().time() - started < 1.0:
                    await asyncio.sleep(backoff_delay(backoff))
                    backoff = min(backoff * 2, BACKOFF_MAX)
                else:
                    backoff = BACKOFF_INITIAL
            except asyncio.CancelledError:
                raise
            except _ApiError as exc:
                if exc.status == 410:
                    rv = None
                    await asyncio.sleep(backoff_delay(backoff))
                    backoff = min(backoff * 2, BACKOFF_MAX)
                    continue
                self.d.error(str(exc.status))
                msg = (
                    f"Kubernetes API answered {exc.status} for InferencePool "
                    f"{self.namespace}/{self.name}: {exc.message}"
                    + (
                        " (RBAC: the service account needs get, list and watch on "
                        "inferencepools.inference.networking.k8s.io)"
                        if exc.status == 403
                        else ""
                    )
                )
                if st.fail(msg, logged=True) or not logged:
                    logged = True
                    log.warning("discovery: %s; keeping the current workers, retrying", msg)
                await asyncio.sleep(backoff_delay(backoff))
                backoff = min(backoff * 2, BACKOFF_MAX)
            except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as exc:
                self.d.error("unreachable")
                msg = f"Kubernetes API unreachable for InferencePool ({type(exc).__name__}: {exc})"
                if st.fail(msg, logged=True) or not logged:
                    logged = True
                    log.warning("discovery: %s; keeping the current workers, retrying", msg)
                await asyncio.sleep(backoff_delay(backoff))
                backoff = min(backoff * 2, BACKOFF_MAX)

    async def _consume(self, resp: Any, rv: str) -> str:
        buf = b""
        async for chunk in resp.content.iter_any():
            buf += chunk
            lines = buf.split(b"\n")
            buf = lines.pop()
            for line in _nonblank(lines):
                try:
                    event = json.loads(line)
                except (ValueError, RecursionError):
                    self.d.error("bad_object")
                    continue
                if not isinstance(event, dict):
                    self.d.error("bad_object")
                    continue
                obj, kind = event.get("object"), event.get("type")
                if kind == "ERROR":
                    code = obj.get("code") if isinstance(obj, dict) else None
                    raise _ApiError(code if isinstance(code, int) else 500, "watch error")
                meta = obj.get("metadata") if isinstance(obj, dict) else None
                got = meta.get("resourceVersion") if isinstance(meta, dict) else None
                if isinstance(got, str) and got:
                    rv = got
                if kind == "BOOKMARK" or not self._mine(obj):
                    continue
                if kind == "DELETED":
                    await self.apply(None)
                elif kind in ("ADDED", "MODIFIED"):
                    await self.apply(obj)
        return rv


def _nonblank(lines: Iterable[bytes]) -> Iterable[bytes]:
    return (ln for ln in lines if ln.strip())


def namespace_or_default(namespace: str | None) -> str:
    return namespace if namespace else (os.environ.get("POD_NAMESPACE") or default_namespace())
