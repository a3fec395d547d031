"""The request path's clock (dataplane/_clock.pyx) reads CLOCK_MONOTONIC, as perf_counter does."""

from __future__ import annotations

import time

from fastroute.dataplane._clock import monotonic


def test_monotonic_reads_clock_monotonic() -> None:
    for _ in range(1000):
        before = time.clock_gettime(time.CLOCK_MONOTONIC)
        now = monotonic()
        after = time.clock_gettime(time.CLOCK_MONOTONIC)
        assert before - 1e-6 <= now <= after + 1e-6


def test_monotonic_never_goes_back() -> None:
    last = monotonic()
    for _ in range(10000):
        now = monotonic()
        assert now >= last
        last = now
