"""The engine-balance benchmark's plumbing: the rows (SGLang's methods without a router rank, fastroute's
policies), the router command for several decodes, samples of two decodes merged into one set
of 16 ranks, and the prefill-rank queue CV."""

from __future__ import annotations

import pytest

from fastroute.sim.balance import Cell, balance_stats, merge_samples, prefill_stats, router_command
from fastroute.sim.engine import SimParams
from fastroute.sim.enginebench import engine_cells, table


def test_rows_leave_the_rank_to_the_engine_or_send_it() -> None:
    cells = engine_cells(prefill_demand=True)
    engine = [c for c in cells if not c.dp_aware]
    assert [c.sim["load_balance_method"] for c in engine] == ["auto", "round_robin", "total_requests", "total_tokens"]
    assert all(c.sim == {} for c in cells if c.dp_aware)
    assert any("--prefill-input-demand" in c.args for c in cells)
    assert not any("--prefill-input-demand" in c.args for c in engine_cells(prefill_demand=False))
    cmd = router_command(engine[2], "http://p", 9, ["http://d1", "http://d2"], 1, 2)
    assert "--dp-aware" not in cmd and cmd.count("--decode") == 2
    cmd = router_command(Cell("x", "fastroute", []), "http://p", 9, "http://d1", 1, 2)
    assert "--dp-aware" in cmd and cmd[cmd.index("--decode") + 1] == "http://d1"


def test_two_decodes_merge_into_one_sample_of_all_ranks() -> None:
    a = [(1.0, 50.0, (3, 1), (3, 1), (10, 10), (0, 0)), (1.1, 52.0, (4, 1), (4, 1), (10, 10), (0, 0))]
    b = [(0.95, 60.0, (9, 9), (9, 9), (5, 5), (1, 0)), (1.12, 61.0, (0, 0), (0, 0), (0, 0), (0, 0))]
    m = merge_samples([a, b])
    # each sample of a joins b's latest sample at or before it; the step is the slower server's
    assert m == [
        (1.0, 60.0, (3, 1, 9, 9), (3, 1, 9, 9), (10, 10, 5, 5), (0, 0, 1, 0)),
        (1.1, 60.0, (4, 1, 9, 9), (4, 1, 9, 9), (10, 10, 5, 5), (0, 0, 1, 0)),
    ]
    assert balance_stats(m)["busiest_batch"] == 9
    assert merge_samples([a, [(2.0,) + b[0][1:]]]) == []  # nothing of b yet: no joined sample


def test_prefill_queue_cv() -> None:
    even = [(t, (2,) * 8, (100,) * 8) for t in range(5)]
    assert prefill_stats(even)["queue_cv"] == 0.0
    skew = [(0, (8, 0, 0, 0, 0, 0, 0, 0), (800, 0, 0, 0, 0, 0, 0, 0)), (1, (0,) * 8, (0,) * 8)]
    st = prefill_stats(skew)
    assert st["samples"] == 1 and st["queue_cv"] == pytest.approx(7**0.5) and st["busiest_queue"] == 8
    assert prefill_stats([(0, (0,) * 8, (0,) * 8)]) == {"samples": 0}
    res = [
        {
            "label": "x",
            "n_decode": 2,
            "concurrency": 192,
            "balance": balance_stats([]),
            "prefill": st,
            "load": {
                "ttft_p50_ms": 1,
                "ttft_p90_ms": 2,
                "tpot_p50_ms": 3,
                "tpot_p90_ms": 4,
                "output_tok_s": 5,
                "completed": 6,
                "errors": 0,
            },
        }
    ]
    out = table(res, 0.25, SimParams(), SimParams(prefill_tokens_per_s=60_000))
    assert "1P2D (16 decode ranks" in out and "| x | 1 / 2 | 3.0 / 4.0 |" in out and "2.65 /" in out
