"""The replica benchmark's sync interval in simulated time: the simulator runs 1/time-scale
times faster than real time, so a real deployment's interval is scaled to wall ms."""

import argparse

from fastroute.sim.convbench import wall_sync_ms


def ns(sim_ms, scale):
    return argparse.Namespace(sync_interval_sim_ms=sim_ms, time_scale=scale)


def test_simulated_ms_become_wall_ms_rounded_up():
    assert wall_sync_ms(ns(10, 0.25)) == 3  # 2.5 wall ms: never faster than asked
    assert wall_sync_ms(ns(10, 1.0)) == 10
    assert wall_sync_ms(ns(40, 0.25)) == 10


def test_at_least_one_ms_and_none_keeps_the_routers_default():
    assert wall_sync_ms(ns(0.5, 0.25)) == 1  # the router's minimum
    assert wall_sync_ms(ns(None, 0.25)) is None
    assert wall_sync_ms(argparse.Namespace(time_scale=0.25)) is None  # the policies benchmark
