"""Prometheus metrics: the ``smg_*`` series dashboards use, and fastroute's per-target series.

Nothing here runs per request.  The proxy bumps plain ints and fixed-bucket histograms in a
``Stats`` object it owns (a dict increment or a compiled histogram observe, no locks); the
collector turns those, the shared target table and the registry into metric families at scrape
time.  Per-target values (in-flight requests and tokens, polled load, picks, health, circuit)
are read from the table with atomic loads, so they are exactly what the policies see.

Labels stay bounded: target names (``url`` or ``url@rank``), roles, known paths, status codes.

Under ``--workers N`` the supervisor merges the proxy processes' reported ``Stats``
(:func:`merge_stats`, the one merge rule) and adds :class:`ProcessCollector`'s per-process series.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from fastroute.config import DEFAULT_DURATION_BUCKETS, Config

# The smg families and fastroute's status for each (docs/metrics.md's table is generated there).
from fastroute.control import reasons
from fastroute.control.dashboard import PAGE as DASHBOARD_PAGE
from fastroute.control.dashboard import Dashboard
from fastroute.control.flowmetrics import flow_families
from fastroute.control.parity import PEER_SERIES, peer_table_markdown  # noqa: F401
from fastroute.control.speedmetrics import speed_families
from fastroute.control.worker import target_label
from fastroute.core import _policy
from fastroute.core import table as T
from fastroute.dataplane._hist import Hist
from fastroute.names import label_value

log = logging.getLogger("fastroute.metrics")

DEFAULT_BUCKETS = DEFAULT_DURATION_BUCKETS  # one definition, in the Config module
# Router-side work is measured in microseconds: its own buckets.
FAST_BUCKETS = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)


# Stats.reclaim reason under which the reconciler's callback counts a flagged target; exported
# as fastroute_reconcile_mismatches_total, not as a reclaim.
RECONCILE_MISMATCH = "reconcile_mismatch"


class Stats:
    """Per-process request statistics, bumped by the proxy and read by the collector."""

    def __init__(self, duration_buckets: Iterable[float] = DEFAULT_BUCKETS) -> None:
        self.http_requests: dict[tuple[str, str], int] = {}
        self.http_responses: dict[tuple[str, str, str], int] = {}  # (status, code, path)
        self.router_requests: dict[tuple[str, str, str, str], int] = {}  # + streaming
        self.router_errors: dict[tuple[str, str, str, str], int] = {}  # + error code
        self.router_duration: dict[tuple[str, ...], Hist] = {}
        self.retries: dict[tuple[str, str], int] = {}
        self.reclaimed: dict[str, int] = {}
        # (role, family, result) -> count of policy decisions made in another process (the
        # proxy processes of --workers N); single-process groups are read directly.
        self.decisions: dict[tuple[str, str, str], int] = {}
        # Resilience (fastroute.core.breaker / admission / proxy retries).
        self.retries_exhausted: dict[tuple[str, str], int] = {}
        self.cb_outcomes: dict[tuple[str, str], int] = {}  # (worker, outcome)
        self.cb_transitions: dict[tuple[str, str, str], int] = {}  # (worker, from, to)
        self.rate_limit: dict[str, int] = {}  # result
        # --tokenizer-path (dataplane/tokenize.py): prompts tokenized (inline, pool) or left at
        # the estimate, by reason (timeout, template, tokenizer)
        self.tokenized: dict[str, int] = {}
        # Flow control's counters (control/flowmetrics.py); the FlowAdmission's own dicts.
        self.flow_refusals: dict[tuple[str, str, str], int] = {}
        self.flow_admitted: dict[tuple[str, str], int] = {}
        self.flow_top_n = 32  # tenants named in those series (--priority-scheduler-tenant-metric-top-n)
        self.connections_active = 0
        # Worker discovery (fastroute.control.discovery), in the process that owns the registry.
        self.discovery_errors: dict[tuple[str, str], int] = {}  # (provider, reason)
        self.discovered: dict[str, int] = {}  # role -> discovered workers
        self.pick_seconds = Hist(FAST_BUCKETS)
        self.overhead_seconds = Hist(FAST_BUCKETS)
        self._duration_buckets = tuple(duration_buckets)
        # Peer parity: the series smg exports, under its names, so its dashboards work.
        self.http_duration: dict[tuple[str, str], Hist] = {}  # (method, path)
        self.pd_ttft: dict[str, Hist] = {}  # model
        self.worker_errors: dict[tuple[str, str], int] = {}  # (worker_type, error_type)
        # (worker_type, "success" | "failure"): the Monitor's probe counter (assembly shares it).
        self.health_checks: dict[tuple[str, str], int] = {}

    def count(self, d: dict, key: Any, n: int = 1) -> None:
        d[key] = d.get(key, 0) + n

    def duration(self, backend: str, endpoint: str, seconds: float) -> None:
        self.observe(self.router_duration, (backend, endpoint), seconds)

    def observe(self, d: dict, key: Any, seconds: float) -> None:
        """Observe ``seconds`` in the duration histogram ``d[key]`` (made on first use); the
        data plane passes prebuilt keys, so nothing is built per request."""
        h = d.get(key)
        if h is None:
            h = d[key] = Hist(self._duration_buckets)
        h.observe(seconds)

    def reclaim(self, reason: str) -> None:
        self.reclaimed[reason] = self.reclaimed.get(reason, 0) + 1

    def forget_workers(self, live: set[str]) -> None:
        """Drop the per-worker breaker series of every target name not in ``live`` (a removed
        worker's series end with it, and a router that saw 10,000 workers come and go does
        not keep 10,000 of them)."""
        for d in (self.cb_outcomes, self.cb_transitions):
            _forget(d, live)


def _forget(d: dict[Any, int], live: set[str]) -> None:
    """Delete the keys of ``d`` whose first item (a target name) is not in ``live``."""
    for k in [k for k in d if k[0] not in live]:
        del d[k]


def group_decisions(groups: dict) -> dict[tuple[str, str, str], int]:
    """Shadow-demand and KV-fit decision totals of a process's groups."""
    out: dict[tuple[str, str, str], int] = {}
    for role, g in groups.items():
        if getattr(g, "demand", "off") != "off":
            out[(role, "demand", "agree")] = g.shadow_agree
            out[(role, "demand", "disagree")] = g.shadow_disagree
        if getattr(g, "kv_fit", "off") != "off":
            for result, n in g.kv_counts.items():
                out[(role, "kv_fit", result)] = n
        keys = getattr(g, "key_table", None)
        if keys is not None:
            out[(role, "manual", "evicted")] = int(keys.evicted)
    out.update(reasons.tree_decisions(groups))
    return out


def _hist_family(name: str, doc: str, labels: list[str]) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, labels=labels)


def _model_label(w: Any) -> str:
    return label_value(getattr(w, "model_id", "unknown") or "unknown")


class Collector:
    """Builds every family from the table, the registry and the Stats objects at scrape time."""

    def __init__(self, table: T.TargetTable, registry: Any, stats: list[Stats], config: Config | None = None) -> None:
        self.table = table
        self.registry = registry
        self.stats = stats
        self.config = config

    def _targets(self) -> list[tuple[int, str, str, str]]:
        """(row, target name, role, model) of every registered target."""
        out = []
        info = getattr(self.registry, "target_info", None) or []
        for t, entry in enumerate(info):
            if entry is None:
                continue
            w, rank = entry
            name = target_label(w, rank)
            out.append((t, name, w.role, _model_label(w)))
        return out

    def collect(self):
        targets = self._targets()
        # Rows in use only (up to the last registered one), not the whole --max-targets table.
        snap = self.table.snapshot(min(len(info_rows(self.registry)), self.table.capacity)) if targets else None
        yield from self._per_target(targets, snap)
        yield from self._groups(targets, snap)
        yield from self._requests()
        yield from speed_families(getattr(getattr(self.registry, "router", None), "speed", None))

    def _per_target(self, targets, snap):
        def gauge(name, doc, col, labels=("target",)):
            g = GaugeMetricFamily(name, doc, labels=list(labels))
            for t, name_, _role, _ in targets:
                g.add_metric([name_], float(snap[t, col]))
            return g

        active = GaugeMetricFamily("smg_worker_requests_active", "Requests in flight per worker", labels=["worker"])
        health = GaugeMetricFamily("smg_worker_health", "Worker health (1 healthy, 0 not)", labels=["worker"])
        cb = GaugeMetricFamily(
            "smg_worker_cb_state", "Circuit state (0 closed, 1 open, 2 half-open)", labels=["worker"]
        )
        picks = CounterMetricFamily("fastroute_target_picks", "Picks of each target", labels=["target", "role"])
        sent = CounterMetricFamily(
            "smg_worker_requests",
            "Requests sent to each worker (every attempt, both PD legs)",
            labels=["worker", "model"],
        )
        fails = GaugeMetricFamily(
            "smg_worker_cb_consecutive_failures",
            "Consecutive failures counted by the circuit breaker",
            labels=["worker"],
        )
        for t, name, role, model in targets:
            active.add_metric([name], float(snap[t, T.COL_IN_FLIGHT]))
            health.add_metric([name], float(snap[t, T.COL_HEALTHY]))
            cb.add_metric([name], float(snap[t, T.COL_CIRCUIT]))
            picks.add_metric([name, role], float(snap[t, T.COL_PICKS]))
            sent.add_metric([name, model], float(snap[t, T.COL_PICKS]))
            fails.add_metric([name], float(snap[t, T.COL_CB_FAILS]))
        yield from (active, health, cb, picks, sent, fails)
        yield gauge(
            "fastroute_target_in_flight_requests", "Requests booked on the target and not yet released", T.COL_IN_FLIGHT
        )
        yield gauge(
            "fastroute_target_in_flight_tokens",
            "Input tokens of the requests in flight on the target",
            T.COL_IN_FLIGHT_TOKENS,
        )
        yield gauge("fastroute_target_healthy", "1 healthy, 0 not", T.COL_HEALTHY)
        yield gauge("fastroute_target_circuit_state", "0 closed, 1 open, 2 half-open", T.COL_CIRCUIT)
        polled = [(t, n, r, m) for t, n, r, m in targets if snap[t, T.COL_POLLED_AT] >= 0]
        for col, name, doc in (
            (T.COL_POLLED_RUNNING, "running", "num_running_reqs"),
            (T.COL_POLLED_WAITING, "waiting", "num_waiting_reqs"),
            (T.COL_POLLED_TOKENS, "tokens", "num_used_tokens"),
        ):
            g = GaugeMetricFamily(
                f"fastroute_target_polled_{name}",
                f"Last polled {doc} of the target (absent while unknown)",
                labels=["target"],
            )
            for t, n, _, _ in polled:
                g.add_metric([n], float(snap[t, col]))
            yield g
        age = GaugeMetricFamily(
            "fastroute_target_poll_age_seconds",
            "Seconds since the target's load was last polled successfully",
            labels=["target"],
        )
        now_ms = time.time() * 1000
        for t, n, _, _ in polled:
            age.add_metric([n], max(0.0, (now_ms - snap[t, T.COL_POLLED_AT]) / 1000))
        yield age
        under = CounterMetricFamily(
            "fastroute_lease_underflows", "Releases that found a counter at zero (a bug signal)"
        )
        under.add_metric([], float(self.table.underflows))
        yield under

    def _groups(self, targets, snap):
        groups = getattr(self.registry, "_groups", None) or {}
        sel = CounterMetricFamily(
            "smg_worker_selection",
            "Worker selections by role and policy",
            labels=["worker_type", "connection_mode", "model", "policy"],
        )
        pool = GaugeMetricFamily(
            "smg_worker_pool_size", "Registered workers by role", labels=["worker_type", "connection_mode", "model"]
        )
        dreq = GaugeMetricFamily(
            "fastroute_decode_demand_requests",
            "Requests held by each target, as the demand cost counts them",
            labels=["target"],
        )
        dtok = GaugeMetricFamily(
            "fastroute_decode_demand_tokens",
            "In-flight input tokens of each target, as the demand cost counts them",
            labels=["target"],
        )
        shadow = CounterMetricFamily(
            "fastroute_decode_demand_shadow_decisions",
            "Shadow demand picks that agreed / disagreed with the dispatched pick",
            labels=["role", "result"],
        )
        by_role: dict[tuple[str, str], list[int]] = {}
        for t, _name, role, model in targets:
            by_role.setdefault((role, model), []).append(t)
        workers: dict[tuple[str, str], set] = {}
        for entry in getattr(self.registry, "target_info", None) or []:
            if entry is not None:
                w = entry[0]
                workers.setdefault((w.role, _model_label(w)), set()).add(w.url)
        for (role, model), urls in workers.items():
            pool.add_metric([role, "http", model], float(len(urls)))
        for (role, model), rows in by_role.items():
            g = groups.get(role)
            policy = getattr(g, "policy", "unknown")
            sel.add_metric([role, "http", model, policy], float(sum(int(snap[t, T.COL_PICKS]) for t in rows)))
        kv = CounterMetricFamily(
            "fastroute_decode_kv_fit_decisions",
            "KV-fit placement: shadow agreement with the dispatched pick, and picks "
            "where no rank had a known KV capacity (usual policy used)",
            labels=["role", "result"],
        )
        decisions = group_decisions(groups)
        for s in self.stats:
            for k, v in getattr(s, "decisions", {}).items():
                decisions[k] = decisions.get(k, 0) + v
        evicted = CounterMetricFamily(
            "fastroute_manual_keys_evicted",
            "manual: routing keys evicted by --max-manual-keys (least recently used first)",
            labels=["role"],
        )
        why = CounterMetricFamily(
            "fastroute_pick_reasons",
            "Picks by the rule that decided them (control/reasons.py)",
            labels=["role", "reason"],
        )
        for (role, reason), n in sorted(reasons.reason_totals(decisions, groups, targets, snap).items()):
            why.add_metric([role, reason], float(n))
        for (role, family, result), n in sorted(decisions.items()):
            if family == reasons.FAMILY:
                continue
            if family == "manual":
                evicted.add_metric([role], float(n))
            else:
                (shadow if family == "demand" else kv).add_metric([role, result], float(n))
        for role, g in groups.items():
            if getattr(g, "demand", "off") == "off":
                continue
            for t, name, r, _ in targets:
                if r == role:
                    dreq.add_metric([name], float(snap[t, T.COL_IN_FLIGHT]))
                    dtok.add_metric([name], float(snap[t, T.COL_IN_FLIGHT_TOKENS]))
        free = GaugeMetricFamily(
            "fastroute_target_kv_free_tokens",
            "Estimated free KV tokens of the target (poll + live bookings since)",
            labels=["target"],
        )
        for role, g in groups.items():
            if getattr(g, "kv_fit", "off") == "off":
                continue
            for t, name, r, _ in targets:
                if r == role:
                    f = _policy.free_kv(self.table.array, t)
                    if f is not None:
                        free.add_metric([name], float(f))
        keys = GaugeMetricFamily("smg_manual_policy_cache_entries", "Routing keys held by the manual policy")
        tables = [k for k in (getattr(g, "key_table", None) for g in groups.values()) if k is not None]
        if tables:
            keys.add_metric([], float(sum(int(k.count) for k in tables)))
        yield from (sel, pool, dreq, dtok, shadow, kv, evicted, free, keys, why)

    def _requests(self):
        def merged(attr):
            out: dict = {}
            for s in self.stats:
                for k, v in getattr(s, attr).items():
                    out[k] = out.get(k, 0) + v
            return out

        c = CounterMetricFamily("smg_http_requests", "HTTP requests by method and path", labels=["method", "path"])
        for (m, p), v in merged("http_requests").items():
            c.add_metric([m, p], float(v))
        yield c
        c = CounterMetricFamily(
            "smg_http_responses",
            "HTTP responses by path, status and error code",
            labels=["path", "status_code", "error_code"],
        )
        for (s, e, p), v in merged("http_responses").items():
            c.add_metric([p, s, e], float(v))
        yield c
        g = GaugeMetricFamily("smg_http_connections_active", "Open client connections")
        g.add_metric([], float(sum(s.connections_active for s in self.stats)))
        yield g
        labels = ["router_type", "backend_type", "connection_mode", "model", "endpoint"]
        c = CounterMetricFamily("smg_router_requests", "Routed inference requests", labels=labels + ["streaming"])
        for key, v in merged("router_requests").items():
            b, e, m, st = key if len(key) == 4 else (key[0], key[1], "unknown", key[2])
            c.add_metric(["http", b, "http", m, e, st], float(v))
        yield c
        c = CounterMetricFamily(
            "smg_router_request_errors", "Routed requests that failed", labels=labels + ["error_type"]
        )
        for key, v in merged("router_errors").items():
            b, e, m, et = key if len(key) == 4 else (key[0], key[1], "unknown", key[2])
            c.add_metric(["http", b, "http", m, e, et], float(v))
        yield c
        c = CounterMetricFamily(
            "smg_worker_errors",
            "Upstream failures by worker role (connect errors, broken streams, timeouts, 5xx answers)",
            labels=["worker_type", "connection_mode", "error_type"],
        )
        for (r, et), v in merged("worker_errors").items():
            c.add_metric([r, "http", et], float(v))
        yield c
        c = CounterMetricFamily(
            "smg_worker_health_checks", "Health probes by worker role and result", labels=["worker_type", "result"]
        )
        for (r, res), v in merged("health_checks").items():
            c.add_metric([r, res], float(v))
        yield c
        c = CounterMetricFamily("smg_worker_retries", "Retried attempts", labels=["worker_type", "endpoint"])
        for (r, e), v in merged("retries").items():
            c.add_metric([r, e], float(v))
        yield c
        reclaimed = merged("reclaimed")
        # The reconciler releases nothing (another process may own the leases), so its flags
        # are a counter of their own, not a reclaim reason (that would count releases that never happened).
        mismatches = reclaimed.pop(RECONCILE_MISMATCH, 0)
        c = CounterMetricFamily(
            "fastroute_leases_reclaimed",
            "Leases reclaimed by the safety net rather than released by their owner",
            labels=["reason"],
        )
        for r, v in reclaimed.items():
            c.add_metric([r], float(v))
        yield c
        c = CounterMetricFamily(
            "fastroute_reconcile_mismatches",
            "Targets the reconciler flagged: the router held more requests than the "
            "engine reported, poll after poll (logged, nothing released)",
        )
        c.add_metric([], float(mismatches))
        yield c
        c = CounterMetricFamily(
            "smg_worker_retries_exhausted",
            "Requests that failed after using every attempt",
            labels=["worker_type", "endpoint"],
        )
        for (r, e), v in merged("retries_exhausted").items():
            c.add_metric([r, e], float(v))
        yield c
        # Only the series of targets still registered (a process's Stats may lag a removal).
        live = {name for _, name, _, _ in self._targets()}
        c = CounterMetricFamily(
            "smg_worker_cb_outcomes", "Circuit breaker outcomes per worker", labels=["worker", "outcome"]
        )
        for (w, o), v in merged("cb_outcomes").items():
            if w in live:
                c.add_metric([w, o], float(v))
        yield c
        c = CounterMetricFamily(
            "smg_worker_cb_transitions", "Circuit state transitions per worker", labels=["worker", "from", "to"]
        )
        for (w, f, t), v in merged("cb_transitions").items():
            if w in live:
                c.add_metric([w, f, t], float(v))
        yield c
        c = CounterMetricFamily("smg_http_rate_limit", "Admission decisions", labels=["result"])
        for r, v in merged("rate_limit").items():
            c.add_metric([r], float(v))
        yield c
        tokenized = merged("tokenized")
        if tokenized:
            c = CounterMetricFamily(
                "fastroute_tokenized_requests",
                "Prompts the router tokenized (outcome inline or pool) or left at the estimate "
                "(timeout, template, tokenizer)",
                labels=["outcome"],
            )
            for r, v in sorted(tokenized.items()):
                c.add_metric([r], float(v))
            yield c
        yield from flow_families(merged("flow_refusals"), merged("flow_admitted"), self.stats[0].flow_top_n)
        if any(s.discovered or s.discovery_errors for s in self.stats):
            c = CounterMetricFamily(
                "fastroute_discovery_errors",
                "Failed discovery attempts (API status code, unreachable, "
                "malformed manifest); workers are kept meanwhile",
                labels=["provider", "reason"],
            )
            for (p, r), v in merged("discovery_errors").items():
                c.add_metric([p, r], float(v))
            yield c
            g = GaugeMetricFamily(
                "fastroute_discovery_workers", "Workers currently registered by discovery", labels=["role"]
            )
            for r, v in merged("discovered").items():
                g.add_metric([r], float(v))
            yield g
        g = GaugeMetricFamily(
            "smg_discovery_workers_discovered", "Workers currently registered by discovery", labels=["source"]
        )
        source = getattr(self.config, "discovery", None)
        if source is not None:
            g.add_metric([source], float(sum(merged("discovered").values())))
        yield g
        h = _hist_family("smg_router_request_duration_seconds", "Routed request duration (success)", labels)
        keys: set[tuple[str, ...]] = set()
        for s in self.stats:
            keys.update(s.router_duration)
        for key in sorted(keys):
            hs = [s.router_duration[key] for s in self.stats if key in s.router_duration]
            yield_h = _merge_hists(hs)
            model = key[2] if len(key) > 2 else "unknown"
            h.add_metric(["http", key[0], "http", model, key[1]], yield_h.buckets(), yield_h.sum)
        yield h
        for attr, name, doc, names, values in (
            (
                "http_duration",
                "smg_http_request_duration_seconds",
                "HTTP request duration, from the complete request to the end of its response",
                ["method", "path"],
                lambda k: list(k),
            ),
            (
                "pd_ttft",
                "smg_pd_ttft_seconds",
                "PD time to first token: request start to the decode's response head",
                ["backend_type", "model", "runtime"],
                lambda k: ["pd", k, "sglang"],
            ),
        ):
            f = _hist_family(name, doc, names)
            keys = set()
            for s in self.stats:
                keys.update(getattr(s, attr))
            for key in sorted(keys):
                m = _merge_hists([getattr(s, attr)[key] for s in self.stats if key in getattr(s, attr)])
                f.add_metric(values(key), m.buckets(), m.sum)
            yield f
        for attr, name, doc in (
            ("pick_seconds", "fastroute_pick_seconds", "Time spent choosing and booking a target"),
            (
                "overhead_seconds",
                "fastroute_router_overhead_seconds",
                "Router-added latency to the first response byte (time not spent waiting on a worker)",
            ),
        ):
            m = _merge_hists([getattr(s, attr) for s in self.stats])
            f = _hist_family(name, doc, [])
            f.add_metric([], m.buckets(), m.sum)
            yield f


def _merge_hists(hs: list[Hist]) -> Hist:
    out = Hist(hs[0].bounds)
    for h in hs:
        _add_hist(out, h)
    return out


def _add_hist(dst: Hist, src: Hist) -> None:
    """Add ``src``'s observations into ``dst`` (histograms with other buckets are skipped)."""
    if dst.bounds != src.bounds:
        return
    for i, c in enumerate(src.counts):
        dst.counts[i] += c
    dst.sum += src.sum


def merge_stats(dst: Stats, src: Stats) -> None:
    """Add ``src``'s counters and histograms into ``dst``.

    Generic over the attributes, so counters the proxy adds later are merged too: a dict of
    ints is a labelled counter, a dict of ``Hist`` a labelled histogram, a ``Hist`` a histogram.
    Plain ints (``connections_active``) are gauges of a live process and are not carried over."""
    for attr, val in vars(src).items():
        if isinstance(val, Hist):
            mine = getattr(dst, attr, None)
            if isinstance(mine, Hist):
                _add_hist(mine, val)
        elif isinstance(val, dict):
            d = getattr(dst, attr, None)
            if not isinstance(d, dict):
                continue
            for k, v in val.items():
                if isinstance(v, Hist):
                    h = d.get(k)
                    if h is None:
                        h = d[k] = Hist(v.bounds)
                    _add_hist(h, v)
                elif isinstance(v, (int, float)):
                    d[k] = d.get(k, 0) + v


class ProcessCollector:
    """Prometheus families about the proxy processes of ``--workers N``, read at scrape time from
    the supervisor (duck-typed: ``children``, ``ledgers``, ``version``), which owns the processes."""

    def __init__(self, sup: Any) -> None:
        self.sup = sup

    def collect(self):
        sup = self.sup
        # The ledgers' rows in use only (up to the last registered one), not --max-targets rows.
        rows = min(len(info_rows(sup.registry)), sup.table.capacity) if sup.table is not None else 0
        up = GaugeMetricFamily(
            "fastroute_proxy_process_up",
            "1 when the proxy process runs and reported a ready worker view",
            labels=["process"],
        )
        restarts = CounterMetricFamily(
            "fastroute_proxy_process_restarts", "Proxy processes started again after they exited", labels=["process"]
        )
        inflight = GaugeMetricFamily(
            "fastroute_proxy_process_in_flight_requests", "Leases the proxy process holds", labels=["process"]
        )
        picks = CounterMetricFamily(
            "fastroute_proxy_process_picks", "Targets picked by the proxy process slot", labels=["process"]
        )
        version = GaugeMetricFamily(
            "fastroute_proxy_process_snapshot_version",
            'Worker snapshot version the proxy process last reported (the supervisor\'s own is process="supervisor")',
            labels=["process"],
        )
        version.add_metric(["supervisor"], float(sup.version))
        pid = GaugeMetricFamily(
            "fastroute_proxy_process_pid", "Operating-system pid of the running proxy process", labels=["process"]
        )
        for slot, child in enumerate(sup.children):
            label = [str(slot)]
            up.add_metric(label, 1.0 if child.alive and child.reported_ready else 0.0)
            restarts.add_metric(label, float(child.restarts))
            snap = sup.ledgers[slot].snapshot(rows)
            inflight.add_metric(label, float(snap[:, T.COL_IN_FLIGHT].sum()))
            picks.add_metric(label, float(snap[:, T.COL_PICKS].sum()))
            if child.alive and child.proc is not None:
                pid.add_metric(label, float(child.proc.pid))
                version.add_metric(label, float(child.version))
        yield from (up, restarts, inflight, picks, version, pid)


def info_rows(registry: Any) -> list:
    """The registry's rows (``target_info``; empty without a registry)."""
    return getattr(registry, "target_info", None) or []


class MetricsServer:
    """``GET /metrics`` on ``--prometheus-host:--prometheus-port``, served by the event loop."""

    def __init__(self, collector: Collector) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self.collector = collector
        self.server: asyncio.AbstractServer | None = None
        self.port = 0
        self.dashboard = Dashboard(collector.table, collector.registry, lambda: collector.stats)  # GET /dashboard
        self._stopping: asyncio.Event | None = None

    def render(self) -> bytes:
        return generate_latest(self.registry)

    async def start(self, host: str, port: int) -> None:
        self._stopping = asyncio.Event()
        self.server = await asyncio.start_server(self._handle, host, port, reuse_address=True)
        self.port = self.server.sockets[0].getsockname()[1]
        log.info("metrics on http://%s:%d/metrics", host, self.port)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            line = head.split(b"\r\n", 1)[0].split()
            path = line[1].split(b"?")[0] if len(line) >= 2 and line[0] == b"GET" else b""
            if path == b"/metrics":
                body = self.render()
                status = b"200 OK"
                ctype = b"text/plain; version=0.0.4; charset=utf-8"
            elif path == b"/dashboard/events" and self._stopping is not None:
                await self.dashboard.stream(writer, self._stopping)
                return
            elif path == b"/dashboard":
                body, status, ctype = DASHBOARD_PAGE, b"200 OK", b"text/html; charset=utf-8"
            else:
                body, status, ctype = b"not found\n", b"404 Not Found", b"text/plain"
            writer.write(
                b"HTTP/1.1 "
                + status
                + b"\r\nContent-Type: "
                + ctype
                + b"\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\nConnection: close\r\n\r\n"
                + body
            )
            await writer.drain()
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        if self._stopping is not None:
            self._stopping.set()  # the dashboard's event streams end
        for w in list(self.dashboard.clients):
            w.close()
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()
            self.server = None


def new_stats(config: Config) -> Stats:
    """A process's Stats with the configured duration buckets."""
    return Stats(config.prometheus_duration_buckets or DEFAULT_BUCKETS)


async def start_metrics(
    config: Config, table: T.TargetTable, registry: Any, stats: Stats | None = None
) -> MetricsServer:
    """Start the metrics listener (called by the runtime's assembly)."""
    stats = stats if stats is not None else new_stats(config)
    m = MetricsServer(Collector(table, registry, [stats], config))
    if getattr(registry, "background", None) is not None:
        from fastroute.control.background import BackgroundCollector

        m.registry.register(BackgroundCollector(registry.background))
    await m.start(config.prometheus_host, int(config.prometheus_port))
    return m
