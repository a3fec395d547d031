"""The live view: one self-contained HTML page (no script, style or font from anywhere else)
fed about once a second from the router's own state. Two ways in:

* the metrics listener: ``GET /dashboard``, its snapshots over SSE (``GET /dashboard/events``);
* the main port (an admin path, auth.py): ``GET /dashboard`` (``PAGE_POLLED``, served without a
  key: it holds no data) polls ``GET /dashboard/snapshot`` with fetch() and the admin key the
  page asks for once (a browser's EventSource cannot send an Authorization header). Each proxy
  process answers from its own registry and the shared table (:meth:`Dashboard.body`).

Each snapshot is read from the shared target table, so every ``--workers N`` process and a
synced replica's others (their in-flight counts are in the same rows) show the same numbers:
per worker and DP rank, requests and input tokens in flight (this router and its synced
replicas), KV use, prefill waiting tokens and the engine's prefix-cache hit rate from the last
load poll, picks, health, and the blocks the engines' KV events say the rank holds
(``--kv-events``); per role and reason, the
decisions per second (control/reasons.py). The page keeps the last minute and draws it.

Nothing runs while nobody watches: a snapshot is computed when a connected page is due one,
and at most once per ``_PERIOD`` whatever the number of pages.
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from fastroute.control import reasons
from fastroute.core import table as T

_PERIOD = 1.0  # seconds between snapshots
_HISTORY = 60  # snapshots kept for a page that connects (the last minute)
_MAX_CLIENTS = 16  # open event streams; more get 503


def _engine_value(rows: Any, rank: int | None, key: str) -> float | None:
    """``key`` of the engine's last load report for ``rank`` (None: not reported)."""
    for label, values in rows or ():
        if label == str(rank if rank is not None else 0):
            return values.get(key)
    return None


class Dashboard:
    """Snapshots of one router's state for the page: the target ``table``, the ``registry``
    (its rows and policy groups) and ``stats``, which returns the Stats objects whose pick
    decisions count (the metrics Collector's, which the supervisor replaces with its children's
    views; none for a proxy process's own view, whose decisions its groups hold)."""

    def __init__(self, table: Any, registry: Any, stats: Callable[[], Iterable[Any]] = tuple) -> None:
        self._table = table
        self._registry = registry
        self._stats = stats
        self.history: collections.deque = collections.deque(maxlen=_HISTORY)
        self.clients: set[asyncio.StreamWriter] = set()
        # The load monitor (set by the runtime where this process polls): the engines' own
        # per-rank prefix-cache hit rate from /v1/loads.
        self.monitor: Any = None
        self._last: dict | None = None
        self._totals: dict[tuple[str, str], int] | None = None
        self._at = 0.0
        self._seq = 0

    def snapshot(self) -> dict:
        """The current snapshot (computed at most once per period)."""
        now = time.monotonic()
        if self._last is not None and now - self._at < _PERIOD * 0.5:
            return self._last
        snap = self._table.snapshot()
        registry = self._registry
        groups = getattr(registry, "_groups", None) or {}
        index = next((g.kv_index for g in groups.values() if getattr(g, "kv_index", None) is not None), None)
        workers: dict[str, dict] = {}
        targets = []
        engine = getattr(getattr(self.monitor, "engine", None), "rows", None) or {}
        for t, entry in enumerate(getattr(registry, "target_info", None) or []):
            if entry is None:
                continue
            w, rank = entry
            role = getattr(w, "role", "regular")
            targets.append((t, "", role, ""))
            row = snap[t]
            top = int(row[T.COL_POLLED_MAX_TOKENS])
            uncached = int(row[T.COL_POLLED_UNCACHED])
            r = {
                "target": t,
                "rank": rank,
                "in_flight": int(row[T.COL_IN_FLIGHT]) + int(row[T.COL_OTHERS_IN_FLIGHT]),
                "tokens": int(row[T.COL_IN_FLIGHT_TOKENS]) + int(row[T.COL_OTHERS_TOKENS]),
                "kv_use": round(int(row[T.COL_POLLED_TOKENS]) / top, 4) if top > 0 else None,
                "waiting_tokens": uncached if uncached >= 0 else None,
                "picks": int(row[T.COL_PICKS]),
                "healthy": bool(row[T.COL_HEALTHY]),
                "blocks": index.blocks(t) if index is not None and t in index.ranks else None,
                "hit_rate": _engine_value(engine.get(w.url), rank, "cache_hit_rate"),
            }
            wd = workers.setdefault(w.url, {"url": w.url, "role": role, "ranks": []})
            wd["ranks"].append(r)
        decisions = reasons.tree_decisions(groups)
        for s in self._stats() or ():
            for k, v in getattr(s, "decisions", {}).items():
                if k[1] == reasons.FAMILY:
                    decisions[k] = decisions.get(k, 0) + v
        totals = reasons.reason_totals(decisions, groups, targets, snap)
        rates: dict[str, float] = {}
        if self._totals is not None and now > self._at:
            dt = now - self._at
            for key, n in totals.items():
                d = n - self._totals.get(key, 0)
                if d > 0:
                    rates["%s/%s" % key] = round(d / dt, 2)
        hit_rate = None
        if index is not None and index.picks:
            hit_rate = round(1.0 - index.hit_counts[0] / index.picks, 4)
        self._seq += 1
        out: dict[str, Any] = {
            "seq": self._seq,
            "time": time.time(),
            "workers": sorted(workers.values(), key=lambda w: (w["role"], w["url"])),
            "decisions_per_s": rates,
            "prefix_hit_rate": hit_rate,
        }
        self._totals, self._at, self._last = totals, now, out
        in_flight: dict[str, int] = {}
        for w in out["workers"]:
            in_flight[w["role"]] = in_flight.get(w["role"], 0) + sum(r["in_flight"] for r in w["ranks"])
        self.history.append({"time": out["time"], "in_flight": in_flight, "decisions": sum(rates.values())})
        return out

    def body(self, history: bool) -> bytes:
        """One snapshot as JSON (``GET /dashboard/snapshot``; ``history``: with the last minute,
        for a page's first poll)."""
        snap = self.snapshot()
        return json.dumps(dict(snap, history=list(self.history)) if history else snap, separators=(",", ":")).encode()

    async def stream(self, writer: asyncio.StreamWriter, stopping: asyncio.Event) -> None:
        """Serve one page's event stream until it leaves or the listener stops."""
        if len(self.clients) >= _MAX_CLIENTS:
            body = b'{"error":"too many dashboard streams"}'
            writer.write(
                b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                b"Connection: close\r\n\r\n%b" % (len(body), body)
            )
            await writer.drain()
            return
        self.clients.add(writer)
        try:
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nCache-Control: no-cache\r\n"
                b"Connection: close\r\n\r\n"
            )
            first = True
            while not stopping.is_set() and not writer.is_closing():
                snap = self.snapshot()
                data = dict(snap, history=list(self.history)) if first else snap
                first = False
                writer.write(b"data: %b\n\n" % json.dumps(data, separators=(",", ":")).encode())
                await writer.drain()
                try:
                    await asyncio.wait_for(stopping.wait(), _PERIOD)
                except asyncio.TimeoutError:
                    pass
        finally:
            self.clients.discard(writer)


# The page (a file of this package: 'fastroute.control' package data in pyproject.toml): as the
# metrics listener serves it (SSE), and as the main port serves it (polling with the admin key).
PAGE = (Path(__file__).with_name("dashboard.html")).read_bytes()
_FEED = b'<body data-feed="events">'
assert PAGE.count(_FEED) == 1, "dashboard.html: the body names its feed"
PAGE_POLLED = PAGE.replace(_FEED, b'<body data-feed="poll">')
