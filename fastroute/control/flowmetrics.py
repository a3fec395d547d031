"""The flow-control series (dataplane/flowcontrol.py): refusals by tenant, class and reason and
admissions by tenant and class, with the tenant label capped at the busiest
``--priority-scheduler-tenant-metric-top-n`` (the rest fold into ``other``). Built by
:class:`fastroute.control.metrics.Collector` from the Stats' ``flow_refusals`` and
``flow_admitted``."""

from __future__ import annotations

from typing import Any

from prometheus_client.core import CounterMetricFamily

from fastroute.flowpolicy import fold_tenants


def flow_families(refusals: dict, admitted: dict, top_n: int) -> Any:
    """The flow-control series (none before flow control counted anything); tenants past the
    ``top_n`` busiest are labelled ``other``."""
    if not refusals and not admitted:
        return
    refusals, admitted = fold_tenants([refusals, admitted], top_n)
    c = CounterMetricFamily(
        "fastroute_flow_refusals",
        "Requests flow control refused before any byte reached a worker, by tenant, class and "
        "reason (smg's error code; scheduler_client_cancelled: the client left while queued)",
        labels=["tenant", "class", "reason"],
    )
    for k, v in sorted(refusals.items()):
        c.add_metric(list(k), float(v))
    yield c
    c = CounterMetricFamily(
        "fastroute_flow_admitted", "Requests flow control admitted, by tenant and class", labels=["tenant", "class"]
    )
    for k, v in sorted(admitted.items()):
        c.add_metric(list(k), float(v))
    yield c
