"""The compiled histogram (dataplane/_hist.pyx): the bucket an observation lands in is
bisect_left's over the bounds, and a Hist pickles (``--workers N`` ships them) with its counts."""

from __future__ import annotations

import pickle
import random
from bisect import bisect_left

from fastroute.config import DEFAULT_DURATION_BUCKETS
from fastroute.control.metrics import FAST_BUCKETS, Stats, merge_stats
from fastroute.dataplane._hist import Hist


def test_observations_land_where_bisect_left_puts_them() -> None:
    rng = random.Random(3)
    for bounds in (FAST_BUCKETS, DEFAULT_DURATION_BUCKETS, (), (1.0,), (0.5, 0.5, 2.0)):
        h = Hist(bounds)
        want = [0] * (len(h.bounds) + 1)
        total = 0.0
        values = [rng.choice((0.0, 1e-7, 1.0, 2.5e-5, 1e9)) for _ in range(20)] + [rng.random() for _ in range(200)]
        values += list(h.bounds)  # exactly on a bound: that bucket (le)
        for v in values:
            h.observe(v)
            want[bisect_left(h.bounds, v)] += 1
            total += v
        assert h.counts == want and h.count == len(values) and abs(h.sum - total) < 1e-6
        assert h.buckets()[-1] == ("+Inf", len(values))


def test_default_bounds_and_pickling_keep_counts() -> None:
    h = Hist()
    assert h.bounds == tuple(sorted(DEFAULT_DURATION_BUCKETS))
    h.observe(0.3)
    h.observe(1e6)
    back = pickle.loads(pickle.dumps(h))
    assert (back.bounds, back.counts, back.sum) == (h.bounds, h.counts, h.sum)
    back.observe(0.3)  # a rebuilt one observes like the original
    h.observe(0.3)
    assert back.counts == h.counts


def test_merged_stats_add_histograms() -> None:
    a, b = Stats(), Stats()
    a.pick_seconds.observe(1e-5)
    b.pick_seconds.observe(1e-5)
    b.pick_seconds.observe(2.0)
    merge_stats(a, pickle.loads(pickle.dumps(b)))
    assert a.pick_seconds.count == 3 and a.pick_seconds.counts[-1] == 1
