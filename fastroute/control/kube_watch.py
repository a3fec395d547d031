"""One Kubernetes list + watch loop, shared by pod discovery and InferencePool discovery.

:func:`watch` follows one collection (pods by a selector, an InferencePool by name) forever:
it lists it, then watches from the list's resourceVersion, so no change between the two is
lost; BOOKMARK events advance the resourceVersion; ``410 Gone`` (an HTTP status or an ERROR
event) lists again after its own backoff (0.5 s doubling to 30 s with jitter, reset by a watch
that ends normally; logged once per episode). The server is asked to end each watch after
``interval`` seconds; a watch silent for that plus 5 s (30 s at most) is given up and resumed
(counted as ``watch_idle``). API errors (a status, or the API unreachable) keep what the caller
has, back off (0.5 s doubling to 30 s) and are counted and logged once per episode. A watch line
of the wrong shape is skipped and reported to the caller (:meth:`Resource.bad`), never the end
of the watch. What a listed item or an event means is the caller's (:class:`Resource`).

Client library: ``kubernetes_asyncio`` on aiohttp (:func:`kube_api`), responses read raw
(``_preload_content=False``) and parsed as JSON lines: no model objects are built per event.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Mapping
from typing import Any, Protocol

from fastroute.config import ConfigError
from fastroute.control.background import TaskState, backoff_delay
from fastroute.kube import NO_KUBE_CONFIG, kube_config_source

__all__ = ["ApiError", "Resource", "kube_api", "watch", "BACKOFF_INITIAL", "BACKOFF_MAX"]

BACKOFF_INITIAL = 0.5
BACKOFF_MAX = 30.0
# A watch silent for this long past the server's timeoutSeconds (or longer than this in all) is
# given up and resumed from its resourceVersion: a hung API server or proxy is noticed.
WATCH_IDLE_GRACE = 5.0
WATCH_IDLE_MAX = 30.0
EVENTS = ("ADDED", "MODIFIED", "DELETED")


class ApiError(Exception):
    """The Kubernetes API answered a status other than 200 (or a watch's ERROR event)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status} {message}")
        self.status = status
        self.message = message


async def kube_api(flag: str) -> Any:
    """A ``CoreV1Api`` from the kubeconfig or in-cluster credentials; ConfigError naming
    ``flag`` when there are none or they cannot be used."""
    # Deferred: kubernetes_asyncio + aiohttp take ~0.3 s to import and only discovery uses them.
    from kubernetes_asyncio import client
    from kubernetes_asyncio import config as kconfig
    from kubernetes_asyncio.config.config_exception import ConfigException

    source = kube_config_source()
    if source is None:
        raise ConfigError(flag, NO_KUBE_CONFIG)
    conf = client.Configuration()
    try:
        if source[0] == "incluster":
            kconfig.load_incluster_config(client_configuration=conf)
        else:
            await kconfig.load_kube_config(config_file=source[1], client_configuration=conf, persist_config=False)
    except (ConfigException, OSError, ValueError) as exc:
        raise ConfigError(flag, f"unusable Kubernetes configuration ({source[1] or 'in-cluster'}): {exc}") from None
    return client.CoreV1Api(client.ApiClient(configuration=conf))


class Resource(Protocol):
    """One collection :func:`watch` follows, and what its items mean to the caller."""

    @property
    def what(self) -> str:
        """For messages: "prefill pods in all namespaces", "InferencePool ns/name"."""

    @property
    def hints(self) -> Mapping[int, str]:
        """What an API status means for the operator, by status."""

    async def request(self, **kw: Any) -> Any:
        """One list call of the collection (raw: ``_preload_content=False``); ``watch=True``
        among ``kw`` makes it the watch."""

    async def listed(self, items: list[Any]) -> None:
        """The items of a list: they replace what the caller had."""

    async def changed(self, kind: str, obj: Any) -> None:
        """One ADDED, MODIFIED or DELETED event's object (any JSON value: the caller checks it)."""

    def bad(self, what: str, problem: str) -> None:
        """A watch line of the wrong shape was skipped (``what`` it was, ``problem`` with it)."""

    def error(self, reason: str) -> None:
        """Count one error (``fastroute_discovery_errors_total{reason}``)."""

    async def pause(self) -> None:
        """Between two lines or items: give the loop a turn when it is due."""

    async def watched(self) -> None:
        """A watch ended as the server meant it to (the next one resumes where it ended)."""


async def _open(resource: Resource, **kw: Any) -> Any:
    """The response of one list or watch call; ApiError for a status other than 200."""
    resp = await resource.request(_preload_content=False, **kw)
    if resp.status != 200:
        body = await resp.read()
        resp.release()
        try:
            message = json.loads(body).get("message") or ""
        except (ValueError, AttributeError, RecursionError):
            message = body[:200].decode("utf-8", "replace")
        raise ApiError(resp.status, message)
    return resp


async def _list(resource: Resource) -> str:
    """List the collection, hand its items over -> the list's resourceVersion."""
    resp = await _open(resource, _request_timeout=30)
    try:
        doc = json.loads(await resp.read())
    except RecursionError:
        raise ValueError(f"the list of {resource.what} is nested too deeply") from None
    finally:
        resp.release()
    if not isinstance(doc, dict) or not isinstance(doc.get("items") or [], list):
        raise ApiError(502, f"the list of {resource.what} is not a list object")
    await resource.listed(list(doc.get("items") or ()))
    meta = doc.get("metadata")
    rv = meta.get("resourceVersion") if isinstance(meta, dict) else None
    return rv if isinstance(rv, str) else ""


async def _consume(resource: Resource, resp: Any, rv: str, st: TaskState) -> str:
    """Hand watch events (one JSON object per line) over until the server ends the watch
    -> the last resourceVersion seen."""
    buf = b""
    async for chunk in resp.content.iter_any():
        buf += chunk
        lines = buf.split(b"\n")
        buf = lines.pop()
        for line in lines:
            await resource.pause()
            if not line.strip():
                continue
            try:
                event = json.loads(line)
            except (ValueError, RecursionError):
                resource.bad("watch line", "not JSON")
                continue
            if not isinstance(event, dict):
                resource.bad("watch event", f"the event is a JSON {type(event).__name__}")
                continue
            obj, kind = event.get("object"), event.get("type")
            meta = obj.get("metadata") if isinstance(obj, dict) else None
            got = meta.get("resourceVersion") if isinstance(meta, dict) else None
            if kind == "ERROR":
                code = obj.get("code") if isinstance(obj, dict) else None
                msg = obj.get("message") if isinstance(obj, dict) else None
                raise ApiError(
                    code if isinstance(code, int) and not isinstance(code, bool) else 500,
                    msg if isinstance(msg, str) else "watch error",
                )
            if kind == "BOOKMARK":
                if isinstance(got, str) and got:
                    rv = got
                else:
                    resource.bad("bookmark", "no resourceVersion")
                continue
            if kind not in EVENTS:
                resource.bad("watch event", f"type {kind!r}")
                continue
            if isinstance(got, str) and got:
                rv = got
            await resource.changed(kind, obj)
            st.ok()
    return rv


async def watch(resource: Resource, st: TaskState, interval: int, log: logging.Logger) -> None:
    """List, then watch from the list's resourceVersion, forever (see the module docstring);
    ``st`` is the supervised task's state (control/background.py), ``log`` the caller's."""
    import aiohttp  # already loaded by kube_api; named here only for its exception types

    idle = min(interval + WATCH_IDLE_GRACE, WATCH_IDLE_MAX)
    rv: str | None = None
    backoff = BACKOFF_INITIAL
    gone = BACKOFF_INITIAL  # the wait before listing again after a 410, reset by a good watch
    gone_logged = False
    while True:
        try:
            if rv is None:
                rv = await _list(resource)
                st.ok()
            resp = await _open(
                resource,
                watch=True,
                resource_version=rv,
                allow_watch_bookmarks=True,
                timeout_seconds=interval,
                _request_timeout=aiohttp.ClientTimeout(sock_connect=10, sock_read=idle),
            )
            started = asyncio.get_running_loop().time()
            try:
                rv = await _consume(resource, resp, rv, st)
            except asyncio.TimeoutError:
                # Silent past the server's own timeout: a hung server or proxy. Resume from rv
                # (nothing is lost); not an error of the API as long as the next one answers.
                log.debug("discovery: watch of %s silent for %.0fs; watching again", resource.what, idle)
                resource.error("watch_idle")
            finally:
                resp.release()
            await resource.watched()
            st.ok()
            gone_logged = False
            gone = BACKOFF_INITIAL
            if asyncio.get_running_loop().time() - started < 1.0:
                # A watch that ends at once (a proxy in between, a broken server) must not turn
                # into a request loop; nothing is lost meanwhile, the next one resumes from rv.
                await asyncio.sleep(backoff_delay(backoff))
                backoff = min(backoff * 2, BACKOFF_MAX)
            else:
                backoff = BACKOFF_INITIAL
        except asyncio.CancelledError:
            raise
        except ApiError as exc:
            if exc.status == 410:
                rv = None
                if not gone_logged:
                    gone_logged = True
                    log.info(
                        "discovery: watch of %s expired (410 Gone); listing again "
                        "(logged once until a watch works again)",
                        resource.what,
                    )
                # Backed off too: an API server (or proxy) that answers 410 to every watch
                # must not be listed and watched hundreds of times a second.
                await asyncio.sleep(backoff_delay(gone))
                gone = min(gone * 2, BACKOFF_MAX)
                continue
            resource.error(str(exc.status))
            hint = resource.hints.get(exc.status)
            msg = f"Kubernetes API answered {exc.status} for {resource.what}: {exc.message}" + (
                f" ({hint})" if hint else ""
            )
            backoff = await _failed(st, msg, backoff, log)
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError) as exc:
            resource.error("unreachable")
            msg = f"Kubernetes API unreachable for {resource.what} ({type(exc).__name__}: {exc})"
            backoff = await _failed(st, msg, backoff, log)


async def _failed(st: TaskState, msg: str, backoff: float, log: logging.Logger) -> float:
    """Log a failed call once per episode and wait -> the next backoff."""
    if st.fail(msg, logged=True):
        log.warning(
            "discovery: %s; keeping the current workers, retrying with backoff from %.1fs "
            "(logged once until it works again)",
            msg,
            backoff,
        )
    await asyncio.sleep(backoff_delay(backoff))
    return min(backoff * 2, BACKOFF_MAX)
