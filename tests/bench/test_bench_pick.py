"""Pick + book + release from Python, compiled vs the NumPy reference twin.

Run: python -m pytest tests/bench/test_bench_pick.py --benchmark-only
(opt-in: tests/bench is outside the default testpaths).  Compare the compiled and reference
rows of the same run; absolute times move with the machine's load.
"""

from __future__ import annotations

import numpy as np
import pytest

from fastroute.core import reference as R
from fastroute.core.routing import Router
from fastroute.core.table import COL_IN_FLIGHT, COL_IN_FLIGHT_TOKENS, COL_POLLED_AT, NCOLS, TargetTable

SIZES = [8, 64, 1024]
CASES = [
    ("power_of_two", "tokens", "off"),
    ("power_of_two", "least_requests", "off"),
    ("power_of_two", "requests", "on"),
]


@pytest.fixture(scope="module")
def tab():
    t = TargetTable(1024)
    for _ in range(1024):
        t.set_polled(t.alloc(), 1, 0, 100)
    yield t
    t.unlink()


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("policy,metric,demand", CASES, ids=["p2c_tokens", "least_requests", "demand"])
def test_compiled(benchmark, tab, n, policy, metric, demand):
    benchmark.group = f"{metric if demand == 'off' else 'demand'}-{n}"
    g = Router(tab, seed=1).group(
        list(range(n)), policy, load_metric=metric, demand=demand, request_weight=1_000_000 if demand == "on" else 0
    )
    acquire = g.acquire

    def once():
        acquire(100).release()

    benchmark(once)
    assert sum(tab.in_flight(t) for t in range(n)) == 0


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("policy,metric,demand", CASES, ids=["p2c_tokens", "least_requests", "demand"])
def test_reference(benchmark, n, policy, metric, demand):
    benchmark.group = f"{metric if demand == 'off' else 'demand'}-{n}"
    arr = np.zeros((n, NCOLS), dtype=np.int64)
    arr[:, 6] = 1
    arr[:, COL_POLLED_AT] = 1
    cands = np.arange(n)
    rng = R.Rng(1)

    def once():
        if demand == "on":
            t = R.demand(arr, cands, 100, 1_000_000, rng)
        else:
            t = R.power_of_two(arr, cands, metric, rng)
        arr[t, COL_IN_FLIGHT] += 1
        arr[t, COL_IN_FLIGHT_TOKENS] += 100
        arr[t, COL_IN_FLIGHT] -= 1
        arr[t, COL_IN_FLIGHT_TOKENS] -= 100

    benchmark(once)
