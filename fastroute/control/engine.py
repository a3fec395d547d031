"""smg's engine re-export: per-rank gauges built from the load polls, and the poll counter.

smg sets ``smg_engine_running_requests``, ``smg_engine_waiting_requests``,
``smg_engine_token_usage``, ``smg_engine_gen_throughput`` and ``smg_engine_cache_hit_rate``
``{worker, model, dp_rank}`` from every worker's load report, where ``worker`` is the physical
server URL (never ``url@rank``) and ``dp_rank`` the rank the engine reported. fastroute's
:class:`~fastroute.control.monitor.Monitor` already polls every physical server once per
interval; it hands each usable answer to :meth:`EngineLoads.update`, and
:class:`EngineCollector` renders the last one at scrape time.

A failed poll drops the worker's rows (absent while unknown, like ``fastroute_target_polled_*``)
where smg keeps the last values until the worker is removed. The legacy ``/get_load`` answer has
no ``token_usage``, ``gen_throughput`` or ``cache_hit_rate``: only the two request gauges then.
"""

from __future__ import annotations

import math
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from fastroute.control import loadwire
from fastroute.names import label_value

# (metric family, /v1/loads field) of the per-rank gauges, in smg's order.
GAUGES: tuple[tuple[str, str, str], ...] = (
    ("smg_engine_running_requests", "num_running_reqs", "Engine-reported running requests"),
    ("smg_engine_waiting_requests", "num_waiting_reqs", "Engine-reported waiting requests"),
    ("smg_engine_token_usage", "token_usage", "Engine-reported KV token usage ratio (0.0-1.0)"),
    ("smg_engine_gen_throughput", "gen_throughput", "Engine-reported generation throughput"),
    ("smg_engine_cache_hit_rate", "cache_hit_rate", "Engine-reported prefix cache hit rate"),
)
# smg's PD gauges {worker, role, dp_rank} from the ``disaggregation`` section of /v1/loads
# (include=disagg): (metric family, the section's fields summed, help).
PD_GAUGES: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("smg_engine_pd_kv_transfer_latency_ms", ("kv_transfer_latency_ms",), "Engine-reported KV transfer latency (ms)"),
    ("smg_engine_pd_kv_transfer_speed_gb_s", ("kv_transfer_speed_gb_s",), "Engine-reported KV transfer speed (GB/s)"),
    (
        "smg_engine_pd_prefill_queue_reqs",
        ("prefill_prealloc_queue_reqs", "prefill_inflight_queue_reqs"),
        "Engine-reported requests in the prefill's disaggregation queues (bootstrap + in flight)",
    ),
    (
        "smg_engine_pd_decode_queue_reqs",
        ("decode_prealloc_queue_reqs", "decode_transfer_queue_reqs"),
        "Engine-reported requests in the decode's disaggregation queues (prealloc + transfer)",
    ),
)
_LIMIT = float(1 << 62)


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if math.isfinite(f) and 0.0 <= f < _LIMIT else None


def engine_rows(doc: Any, mode: str) -> list[tuple[str, dict[str, float]]]:
    """(dp_rank label, {field: value}) per rank entry of a load answer; fields the answer does
    not carry (or carries as garbage) are left out."""
    if isinstance(doc, loadwire.V1Loads):  # the typed reading of a well-formed answer
        return loadwire.engine_rows(doc)
    if mode == "v1_loads":
        entries = doc.get("loads") if isinstance(doc, dict) else None
    else:  # /get_load: an array per rank (num_reqs = running + waiting)
        entries = doc.get("loads", [doc]) if isinstance(doc, dict) else doc
    out: list[tuple[str, dict[str, float]]] = []
    if not isinstance(entries, list):
        return out
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            continue
        rank = _number(e.get("dp_rank"))
        values: dict[str, float] = {}
        if mode == "v1_loads":
            for _, key, _ in GAUGES:
                v = _number(e.get(key))
                if v is not None:
                    values[key] = v
            section = e.get("disaggregation")
            if isinstance(section, dict):
                for name, fields, _ in PD_GAUGES:
                    parts = [_number(section.get(f)) for f in fields]
                    known = [x for x in parts if x is not None]
                    if known:
                        values[name] = sum(known)
        else:
            total, waiting = _number(e.get("num_reqs")), _number(e.get("num_waiting_reqs")) or 0.0
            if total is not None:
                values["num_running_reqs"] = max(total - waiting, 0.0)
                values["num_waiting_reqs"] = waiting
        if values:
            out.append((str(int(rank)) if rank is not None else str(i), values))
    return out


class EngineLoads:
    """The last usable load answer of every physical worker (written by the Monitor).

    A poll only keeps the answer; its rows are built when read (a scrape), not on every poll of
    every worker on the loop that serves requests."""

    def __init__(self) -> None:
        # url -> (the answer, its mode, its rows once built)
        self._answers: dict[str, tuple[Any, str, list[tuple[str, dict[str, float]]] | None]] = {}

    def update(self, url: str, doc: Any, mode: str) -> None:
        if doc is None:
            self._answers.pop(url, None)
        else:
            self._answers[url] = (doc, mode, None)

    def __len__(self) -> int:
        return len(self._answers)

    def forget(self, known: set[str]) -> None:
        """Drop the answers of workers not in ``known``."""
        for url in [u for u in self._answers if u not in known]:
            del self._answers[url]

    @property
    def rows(self) -> dict[str, list[tuple[str, dict[str, float]]]]:
        """url -> (dp_rank label, {field: value}) per rank of its last usable answer (a worker
        whose answer has no usable field is absent)."""
        out: dict[str, list[tuple[str, dict[str, float]]]] = {}
        for url, (doc, mode, rows) in list(self._answers.items()):
            if rows is None:
                rows = engine_rows(doc, mode)
                self._answers[url] = (doc, mode, rows)
            if rows:
                out[url] = rows
        return out


class EngineCollector:
    """Prometheus families of :class:`EngineLoads` and the Monitor's poll counter."""

    def __init__(self, monitor: Any, registry: Any) -> None:
        self.monitor = monitor
        self.registry = registry

    def _models(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for entry in getattr(self.registry, "target_info", None) or []:
            if entry is not None:
                w = entry[0]
                out[w.url] = label_value(getattr(w, "model_id", "unknown") or "unknown")
        return out

    def _roles(self) -> dict[str, str]:
        return {
            e[0].url: getattr(e[0], "role", "regular") for e in getattr(self.registry, "target_info", None) or [] if e
        }

    def collect(self):
        models = self._models()
        rows = getattr(self.monitor, "engine", None)
        rows = rows.rows if rows is not None else {}
        for name, key, doc in GAUGES:
            g = GaugeMetricFamily(name, doc + " by worker, model, dp_rank", labels=["worker", "model", "dp_rank"])
            for url, ranks in rows.items():
                model = models.get(url)
                if model is None:  # removed since its last poll
                    continue
                for rank, values in ranks:
                    if key in values:
                        g.add_metric([url, model, rank], values[key])
            yield g
        roles = self._roles()
        for name, _, doc in PD_GAUGES:
            g = GaugeMetricFamily(name, doc + " by worker, role, dp_rank", labels=["worker", "role", "dp_rank"])
            for url, ranks in rows.items():
                role = roles.get(url)
                if role is None:
                    continue
                for rank, values in ranks:
                    if name in values:
                        g.add_metric([url, role, rank], values[name])
            yield g
        c = CounterMetricFamily(
            "smg_engine_load_polls",
            "Load polls by worker and the endpoint that answered (v1_loads, get_load) or failed",
            labels=["worker", "mode"],
        )
        for (url, mode), n in sorted(getattr(self.monitor, "polls", {}).items()):
            if url in models:
                c.add_metric([url, mode], float(n))
        yield c
