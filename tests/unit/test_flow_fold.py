"""Flow control's per-tenant counters are bounded by folding tenants into ``other``
(dataplane/flowcontrol.py ``_fold``, flowpolicy.fold_tenants, the metrics' top N)."""

from __future__ import annotations

from fastroute.control.flowmetrics import flow_families
from fastroute.dataplane import flowcontrol
from fastroute.flowpolicy import OTHER_TENANT


def test_a_fold_frees_entries_even_when_few_tenants_have_many_each() -> None:
    # 40 tenants x 4 classes x 7 reasons: far fewer tenants than TENANTS_AFTER_FOLD, yet the
    # counters are over their bound; a fold that kept every tenant would run on every refusal.
    d = {(f"ip:10.0.0.{t}", c, r): t + 1 for t in range(40) for c in "abcd" for r in range(7)}
    total = sum(d.values())
    flowcontrol._fold(d)
    tenants = {k[0] for k in d}
    assert len(tenants) == 20 + 1 and OTHER_TENANT in tenants  # the busiest half, and "other"
    assert "ip:10.0.0.39" in tenants and "ip:10.0.0.0" not in tenants
    assert len(d) == 21 * 28 and sum(d.values()) == total  # nothing counted is lost


def test_the_metrics_top_n_folds_the_same_way() -> None:
    refusals = {("ip:a", "default", "x"): 5, ("ip:b", "default", "x"): 1}
    admitted = {("ip:b", "default"): 1, ("ip:c", "default"): 9}
    fams = {
        f.name: {tuple(s.labels.values()): s.value for s in f.samples} for f in flow_families(refusals, admitted, 2)
    }
    assert fams["fastroute_flow_refusals"] == {("ip:a", "default", "x"): 5.0, (OTHER_TENANT, "default", "x"): 1.0}
    assert fams["fastroute_flow_admitted"] == {("other", "default"): 1.0, ("ip:c", "default"): 9.0}
