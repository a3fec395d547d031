"""A Kubernetes API stand-in for discovery tests: pods and InferencePools, real list/watch wire
format.

``GET /api/v1/pods`` and ``GET /api/v1/namespaces/{ns}/pods`` with ``labelSelector``
(equality requirements), ``watch=true``, ``resourceVersion``, ``allowWatchBookmarks`` and
``timeoutSeconds``. A list answers a ``PodList`` whose ``metadata.resourceVersion`` is the
store's current version. A watch replays the changes after the given resourceVersion and then
streams new ones, one JSON event per line over chunked HTTP, filtered like the API server's
watch cache: an object that starts matching the selector arrives as ADDED, one that stops
matching as DELETED. A resourceVersion older than the compaction floor gets ``410 Gone``
(a Status object, or an ERROR event when ``gone_as_event``); ``status`` set to e.g. 403
answers every request with that Status; ``hang`` makes a watch send its head and then nothing,
ignoring timeoutSeconds (a stuck server or proxy); :meth:`inject` streams a raw line as the
next watch event (hostile or broken input). InferencePools (``inference_pool``) are served the
same way at ``/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools``, with a
``fieldSelector`` of ``metadata.name=NAME``. Runs in the test's event loop.
"""

from __future__ import annotations

import asyncio
import copy
import json
from typing import Any
from urllib.parse import parse_qs, urlsplit


def pod(
    name: str,
    ip: str | None,
    *,
    ns: str = "team-a",
    labels: dict | None = None,
    ready: bool = True,
    phase: str = "Running",
    annotations: dict | None = None,
    deleting: bool = False,
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": name,
        "namespace": ns,
        "uid": f"uid-{ns}-{name}",
        "labels": dict(labels if labels is not None else {"app": "sglang"}),
        "annotations": dict(annotations or {}),
    }
    if deleting:
        meta["deletionTimestamp"] = "2026-12-01T00:00:00Z"
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ],
    }
    if ip:
        status["podIP"] = ip
    return {"kind": "Pod", "apiVersion": "v1", "metadata": meta, "spec": {"containers": []}, "status": status}


def inference_pool(name: str, labels: dict, ports: list[int], *, ns: str = "team-a", **spec: Any) -> dict[str, Any]:
    """An inference.networking.k8s.io/v1 InferencePool selecting ``labels`` on ``ports``."""
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": ns, "uid": f"uid-pool-{ns}-{name}", "labels": {}},
        "spec": {
            "selector": {"matchLabels": dict(labels)},
            "targetPorts": [{"number": p} for p in ports],
            "endpointPickerRef": {"name": f"{name}-epp", "port": {"number": 9002}},
            **spec,
        },
    }


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _matches(selector: str, labels: dict, kind: str = "Pod", fields: str = "", obj: dict | None = None) -> bool:
    if obj is not None:
        if obj.get("kind", "Pod") != kind:
            return False
        for req in filter(None, fields.split(",")):
            k, _, v = req.partition("=")
            if k == "metadata.name" and obj["metadata"]["name"] != v:
                return False
    for req in filter(None, selector.split(",")):
        k, _, v = req.partition("=")
        if labels.get(k) != v:
            return False
    return True


class KubeApi:
    def __init__(self) -> None:
        self.pods: dict[tuple[str, str], dict] = {}
        self.rv = 100
        self.floor = 0  # watches from a resourceVersion below this get 410
        # (rv, old, new, raw line or None)
        self.events: list[tuple[int, dict | None, dict | None, bytes | None]] = []
        self.status: int | None = None
        self.hang = False
        self.gone_as_event = False
        self.requests: list[tuple[float, str, dict]] = []  # (time, path, query)
        self.port = 0
        self._changed = asyncio.Condition()
        self._kick = 0
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> KubeApi:
        self._server = await asyncio.start_server(self._conn, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        await self.kick()

    def kubeconfig(self) -> str:
        return json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "test",
                "clusters": [{"name": "c", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
                "users": [{"name": "u", "user": {"token": "test-token"}}],
                "contexts": [{"name": "test", "context": {"cluster": "c", "user": "u"}}],
            }
        )

    # ---- store changes ----------------------------------------------------------------------
    async def put(self, obj: dict) -> None:
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        if obj.get("kind") == "InferencePool":
            key = ("InferencePool", *key)  # stored beside the pods, listed apart
        self.rv += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.rv)
        old = self.pods.get(key)
        self.pods[key] = obj
        await self._record(old, obj)

    async def delete(self, ns: str, name: str, kind: str = "Pod") -> None:
        gone = self.pods.pop((ns, name) if kind == "Pod" else (kind, ns, name))
        self.rv += 1
        gone = copy.deepcopy(gone)
        gone["metadata"]["resourceVersion"] = str(self.rv)
        await self._record(gone, None)

    async def inject(self, line: bytes) -> None:
        """Send ``line`` (no newline) to every watch as if it were the next event."""
        self.rv += 1
        await self._record(None, None, line)

    async def _record(self, old: dict | None, new: dict | None, raw: bytes | None = None) -> None:
        self.events.append((self.rv, old, new, raw))
        async with self._changed:
            self._changed.notify_all()

    def compact(self) -> None:
        """Forget history: every watch resuming from an older resourceVersion gets 410."""
        self.floor = self.rv + 1

    async def kick(self) -> None:
        """End every open watch (as an API server restart or load balancer would)."""
        self._kick += 1
        async with self._changed:
            self._changed.notify_all()

    def watch_count(self) -> int:
        return sum(1 for _, _, q in self.requests if q.get("watch") == "true")

    def list_count(self) -> int:
        return sum(1 for _, _, q in self.requests if q.get("watch") != "true")

    # ---- HTTP -------------------------------------------------------------------------------
    async def _conn(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            target = head.split(b"\r\n", 1)[0].split()[1].decode()
            parts = urlsplit(target)
            query = {k: v[0] for k, v in parse_qs(parts.query).items()}
            for k in ("watch", "allowWatchBookmarks"):  # Go's ParseBool: True, true, 1, ...
                if k in query:
                    query[k] = "true" if query[k].lower() in ("true", "t", "1") else "false"
            self.requests.append((asyncio.get_running_loop().time(), parts.path, query))
            path = parts.path.split("/")
            kind = "Pod"
            if parts.path == "/api/v1/pods":
                ns = None
            elif len(path) == 6 and path[1:4] == ["api", "v1", "namespaces"] and path[5] == "pods":
                ns = path[4]
            elif (
                len(path) == 7
                and path[1:5] == ["apis", "inference.networking.k8s.io", "v1", "namespaces"]
                and path[6] == "inferencepools"
            ):
                ns, kind = path[5], "InferencePool"
            else:
                return self._send(writer, 404, _status(404, "NotFound", "not found"))
            if self.status is not None:
                return self._send(
                    writer,
                    self.status,
                    _status(
                        self.status,
                        "Forbidden",
                        'pods is forbidden: User "system:serviceaccount:'
                        'team-a:fastroute" cannot list resource "pods" in API group "" in the '
                        'namespace "team-a"',
                    ),
                )
            selector = query.get("labelSelector", "")
            fields = query.get("fieldSelector", "")
            if query.get("watch") != "true":
                items = [
                    p
                    for p in self.pods.values()
                    if (ns is None or p["metadata"]["namespace"] == ns)
                    and _matches(selector, p["metadata"]["labels"], kind, fields, p)
                ]
                return self._send(
                    writer,
                    200,
                    {
                        "kind": kind + "List",
                        "apiVersion": "v1",
                        "metadata": {"resourceVersion": str(self.rv)},
                        "items": items,
                    },
                )
            await self._watch(
                writer,
                ns,
                selector,
                int(query.get("resourceVersion") or 0),
                float(query.get("timeoutSeconds") or 60),
                query.get("allowWatchBookmarks") == "true",
                kind,
                fields,
            )
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    def _send(self, writer: asyncio.StreamWriter, status: int, doc: dict) -> None:
        body = json.dumps(doc).encode()
        writer.write(
            b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
            b"Connection: close\r\n\r\n%b" % (status, len(body), body)
        )

    async def _watch(
        self,
        writer: asyncio.StreamWriter,
        ns: str | None,
        selector: str,
        since: int,
        timeout: float,
        bookmarks: bool,
        kind: str = "Pod",
        fields: str = "",
    ) -> None:
        if since < self.floor:
            gone = _status(410, "Expired", f"too old resource version: {since} ({self.floor})")
            if not self.gone_as_event:
                return self._send(writer, 410, gone)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        )
        if since < self.floor:
            self._chunk(writer, {"type": "ERROR", "object": gone})
            writer.write(b"0\r\n\r\n")
            return
        kick = self._kick
        if self.hang:
            await writer.drain()
            while kick == self._kick:  # hung for good, whatever happens next
                async with self._changed:
                    await self._changed.wait()
            return  # the connection closes without a last chunk
        deadline = asyncio.get_running_loop().time() + timeout
        sent = since
        while kick == self._kick:
            for rv, old, new, raw in self.events:
                if rv <= sent:
                    continue
                sent = rv
                if raw is not None:
                    writer.write(b"%x\r\n%b\n\r\n" % (len(raw) + 1, raw))
                    continue
                ev = self._event(ns, selector, old, new, kind, fields)
                if ev is not None:
                    self._chunk(writer, ev)
            await writer.drain()
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            async with self._changed:
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except asyncio.TimeoutError:
                    pass
        if bookmarks:
            self._chunk(
                writer,
                {
                    "type": "BOOKMARK",
                    "object": {"kind": kind, "apiVersion": "v1", "metadata": {"resourceVersion": str(sent)}},
                },
            )
        writer.write(b"0\r\n\r\n")

    @staticmethod
    def _event(
        ns: str | None, selector: str, old: dict | None, new: dict | None, kind: str = "Pod", fields: str = ""
    ) -> dict | None:
        def visible(p: dict | None) -> bool:
            return (
                p is not None
                and (ns is None or p["metadata"]["namespace"] == ns)
                and _matches(selector, p["metadata"]["labels"], kind, fields, p)
            )

        was, now = visible(old), visible(new)
        if was and now:
            return {"type": "MODIFIED", "object": new}
        if now:
            return {"type": "ADDED", "object": new}
        if was:
            return {"type": "DELETED", "object": new if new is not None else old}
        return None

    @staticmethod
    def _chunk(writer: asyncio.StreamWriter, doc: dict) -> None:
        line = json.dumps(doc).encode() + b"\n"
        writer.write(b"%x\r\n%b\r\n" % (len(line), line))
