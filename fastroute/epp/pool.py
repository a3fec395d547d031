"""InferencePool discovery (``fastroute epp --inference-pool NAME``): the picker's targets are
the endpoints of a Gateway API Inference Extension ``InferencePool``.

The pool (``inference.networking.k8s.io/v1``, namespaced) is listed and watched by name in its
namespace with the Kubernetes client pod discovery uses (:mod:`fastroute.control.discovery`:
``kubernetes_asyncio``, kubeconfig or in-cluster credentials, raw JSON lines). Its
``spec.selector.matchLabels`` selects pods in the same namespace; every Running and Ready pod
with an IP becomes one worker per ``spec.targetPorts[].number``: ``http://<podIP>:<port>``.
The pool and its pods are listed and watched by :func:`fastroute.control.kube_watch.watch`,
the loop ``--service-discovery`` uses (same list/watch, resume, 410 and backoff rules), and the
pods are reconciled with the registry as there (:class:`~fastroute.control.discovery.PodWatch`), so
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
import logging
import os
from typing import Any

from fastroute.control.background import TaskState, cancel_all
from fastroute.control.discovery import Discovery, PodSets, PodWatch, pod_worker
from fastroute.control.kube_watch import BACKOFF_MAX, kube_api, watch

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


class _PoolPods(PodSets):
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

        self.d.api = await kube_api("--inference-pool")
        self._custom = client.CustomObjectsApi(self.d.api.api_client)
        interval = int(self.config.discovery_check_interval_secs)

        async def follow(st: TaskState) -> None:
            await watch(self, st, interval, log)

        self.d.spawn(follow, f"discovery inferencepool {self.namespace}/{self.name}")
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
        watched = PodWatch(self.sets, "regular", reqs, self.namespace)
        interval = int(self.config.discovery_check_interval_secs)

        async def pods(st: TaskState) -> None:
            await watch(watched, st, interval, log)

        self._pods = self.d.registry.background.spawn(
            f"discovery inferencepool pods {self.namespace}/{self.name}", pods, cap=BACKOFF_MAX
        )

    # -- kube_watch.Resource: the pool, by name -------------------------------------------------
    @property
    def what(self) -> str:
        return f"InferencePool {self.namespace}/{self.name}"

    hints = {403: "RBAC: the service account needs get, list and watch on inferencepools.inference.networking.k8s.io"}

    async def request(self, **kw: Any) -> Any:
        return await self._custom.list_namespaced_custom_object(
            GROUP, VERSION, self.namespace, PLURAL, field_selector=f"metadata.name={self.name}", **kw
        )

    def _mine(self, obj: Any) -> bool:
        meta = obj.get("metadata") if isinstance(obj, dict) else None
        return isinstance(meta, dict) and meta.get("name") == self.name

    async def listed(self, items: list[Any]) -> None:
        found = [o for o in items if self._mine(o)]
        await self.apply(found[0] if found else None)

    async def changed(self, kind: str, obj: Any) -> None:
        if self._mine(obj):
            await self.apply(None if kind == "DELETED" else obj)

    def bad(self, what: str, problem: str) -> None:
        self.d.error("bad_object")

    def error(self, reason: str) -> None:
        self.d.error(reason)

    async def pause(self) -> None:
        await self.d.pause()

    async def watched(self) -> None:
        pass


def namespace_or_default(namespace: str | None) -> str:
    return namespace if namespace else (os.environ.get("POD_NAMESPACE") or default_namespace())
