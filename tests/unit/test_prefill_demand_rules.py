"""Prefill input demand, below the sockets: the lease that gives its input tokens back at the
prefill's answer, the flag's rules, and the /v1/loads fields the monitor reads."""

from __future__ import annotations

import numpy as np
import pytest

from fastroute.config.cli import parse_args
from fastroute.control.monitor import parse_v1_loads
from fastroute.core import _policy
from fastroute.core import reference as R
from fastroute.core.routing import Router
from fastroute.core.table import COL_IN_FLIGHT, COL_IN_FLIGHT_TOKENS, COL_POLLED_UNCACHED, TargetTable

PD = ["--pd-disaggregation", "--prefill", "http://p:8000", "--decode", "http://d:8000"]


@pytest.fixture
def table():
    tt = TargetTable(8)
    for _ in range(4):
        tt.set_healthy(tt.alloc(), True)
    yield tt
    tt.close()
    tt.unlink()


def test_answered_gives_the_tokens_back_and_keeps_the_request(table):
    own = TargetTable(8)
    try:
        g = Router(table, seed=3).group(
            [0, 1, 2, 3], "power_of_two", load_metric="least_requests", demand="on", tokens_until_answer=True
        )
        g.track_in(own)
        lease = g.acquire(700)
        t = lease.target
        for tab in (table.array, own.array):
            assert (tab[t, COL_IN_FLIGHT], tab[t, COL_IN_FLIGHT_TOKENS]) == (1, 700)
        assert lease.answered() is True and lease.tokens == 0
        assert lease.answered() is False  # once
        for tab in (table.array, own.array):
            assert (tab[t, COL_IN_FLIGHT], tab[t, COL_IN_FLIGHT_TOKENS]) == (1, 0)
        assert lease.release() is True
        for tab in (table.array, own.array):
            assert (tab[t, COL_IN_FLIGHT], tab[t, COL_IN_FLIGHT_TOKENS]) == (0, 0)
        assert lease.answered() is False and table.underflows == 0
    finally:
        own.close()
        own.unlink()


def test_without_the_flag_answered_changes_nothing(table):
    g = Router(table, seed=3).group([0, 1, 2, 3], "power_of_two", load_metric="least_requests")
    lease = g.acquire(700)
    assert lease.answered() is False
    assert table.array[lease.target, COL_IN_FLIGHT_TOKENS] == 700
    lease.release()
    # cache_aware books through book_target: the flag reaches its leases too
    g = Router(table, seed=3).group([0, 1, 2, 3], "cache_aware", tokens_until_answer=True)
    assert g.tokens_until_answer
    lease = g.acquire(50)
    assert lease.answered() is True
    lease.release()


def test_polled_uncached_tokens_correct_the_demand_cost(table):
    tab = table.array
    cands = np.arange(4, dtype=np.int64)
    tab[:4, COL_IN_FLIGHT_TOKENS] = [1_000, 1_000, 1_000, 9_000]
    table.set_polled(0, 1, 3, 0, -1, uncached=50_000)  # much more waiting than we sent
    table.set_polled(1, 1, 0, 0, -1, uncached=0)  # all of ours were cache hits
    st = np.array([1], dtype=np.uint64)
    # rank 1: 0 polled + 0 booked since; rank 2: its 1,000 in flight (never polled)
    assert [R.pending(tab, t) for t in range(4)] == [50_000, 0, 1_000, 9_000]
    assert _policy.demand(tab, cands, 10, 0, st) == 1
    tab[1, COL_IN_FLIGHT_TOKENS] += 4_000  # booked since the poll
    assert R.pending(tab, 1) == 4_000
    assert _policy.demand(tab, cands, 10, 0, st) == 2
    table.mark_unpolled(0)  # unknown again: in flight only
    assert R.pending(tab, 0) == 1_000
    assert tab[0, COL_POLLED_UNCACHED] == 50_000  # kept, but not used while unpolled


def test_flag_rules(capsys):
    assert parse_args(PD + ["--prefill-input-demand", "on"]).prefill_input_demand == "on"
    assert parse_args(PD).prefill_input_demand == "off"
    for argv in (
        ["--worker-urls", "http://w:8000", "--prefill-input-demand", "on"],
        PD + ["--prefill-policy", "manual", "--prefill-input-demand", "shadow"],
    ):
        with pytest.raises(SystemExit):
            parse_args(argv)
        err = capsys.readouterr().err
        assert "--prefill-input-demand" in err and "--pd-disaggregation" in err
    with pytest.raises(SystemExit):
        parse_args(PD + ["--prefill-input-demand", "maybe"])


def test_v1_loads_0_5_23_fields_are_read():
    doc = {
        "loads": [
            {
                "dp_rank": 0,
                "num_running_reqs": 1,
                "num_waiting_reqs": 2,
                "num_used_tokens": 10,
                "max_total_num_tokens": 1000,
                "num_waiting_uncached_tokens": 777,
                "token_usage": 0.5,
                "disaggregation": {
                    "mode": "decode",
                    "decode_prealloc_queue_reqs": 2,
                    "decode_transfer_queue_reqs": 5,
                    "decode_retracted_queue_reqs": 1,
                },
            },
            # an older server: none of them; token_usage garbage is ignored
            {
                "dp_rank": 1,
                "num_running_reqs": 0,
                "num_used_tokens": 3,
                "max_total_num_tokens": 1000,
                "token_usage": "x",
                "disaggregation": "nope",
            },
            # no num_used_tokens, but token_usage and capacity say it
            {"dp_rank": 2, "num_running_reqs": 0, "max_total_num_tokens": 1000, "token_usage": 0.25},
        ]
    }
    assert parse_v1_loads(doc) == [
        (0, (1, 2, 500, 1000, 777, 3)),
        (1, (0, 0, 3, 1000, -1, 0)),
        (2, (0, 0, 250, 1000, -1, 0)),
    ]
