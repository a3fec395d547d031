"""Mixed hardware in the simulator: a server's speed factor, a slowdown part-way through a run,
and per-rank prefill rates, observed on the running engines (real event loop, real timers)."""

from __future__ import annotations

import argparse
import asyncio
import time

import pytest

from fastroute.sim.engine import DecodeEngine, DecodeReq, PrefillEngine, Rendezvous, SimParams
from fastroute.sim.params import ParsedGen
from fastroute.sim.worker import add_param_flags, params_from_args


def _steps(p: SimParams, n_out: int) -> list[float]:
    async def scenario() -> list[float]:
        eng = DecodeEngine(p)
        eng.start()
        loop = asyncio.get_running_loop()
        r = DecodeReq("r", 0, 1, n_out, None, loop.create_future())
        eng.submit(r)
        eng.kv_arrived(r)
        await r.done
        await eng.stop()
        return [s[1] for s in eng.samples if s[1] > 0]

    return asyncio.run(scenario())


def test_speed_factor_multiplies_every_step() -> None:
    base = SimParams(dp_size=2, time_scale=0.001, sample_interval_s=0.0)
    slow = SimParams(dp_size=2, time_scale=0.001, sample_interval_s=0.0, speed_factor=1.6)
    a, b = _steps(base, 5), _steps(slow, 5)
    assert a and b
    assert max(b) == pytest.approx(1.6 * max(a), rel=1e-6)


def test_slowdown_starts_at_its_time() -> None:
    # Steps of ~30 ms for 0.4 s; from 0.2 s on they are 2.5 times longer.
    p = SimParams(dp_size=1, sample_interval_s=0.0, slowdown_at=0.2, slowdown_factor=2.5)
    steps = _steps(p, 10)
    nominal = p.step_base_ms + p.step_request_ms * 1
    assert steps[0] == pytest.approx(nominal, rel=0.01)
    assert steps[-1] == pytest.approx(2.5 * nominal, rel=0.01)


def test_prefill_rank_rates_set_each_ranks_compute() -> None:
    p = SimParams(dp_size=2, prefill_base_ms=0.0, prefill_rank_rates="100000,25000")

    async def timed(rank: int) -> float:
        eng = PrefillEngine(p, Rendezvous())
        g = ParsedGen("generate", False, 5000, 1, None, None, None, rank, False, False, "m")
        t0 = time.monotonic()
        await eng.run(g, rank)
        return time.monotonic() - t0

    fast, slow = asyncio.run(timed(0)), asyncio.run(timed(1))
    assert fast >= 0.05 and slow >= 0.2  # 5000 tokens at 100k/s and at 25k/s
    assert slow > 3 * fast


def test_worker_flags_and_their_refusals() -> None:
    ap = argparse.ArgumentParser()
    add_param_flags(ap)
    ns = ap.parse_args(["--speed-factor", "2.5", "--slowdown-at", "30", "--slowdown-factor", "1.5"])
    p = params_from_args(ns)
    assert p.slowness(29.0) == 2.5 and p.slowness(31.0) == pytest.approx(3.75)
    with pytest.raises(ValueError, match="prefill_rank_rates"):
        SimParams(dp_size=2, prefill_rank_rates="1000")
    with pytest.raises(ValueError, match="speed_factor"):
        SimParams(speed_factor=0.0)
    assert "--speed-factor" in ap.format_help() and "--slowdown-at" in ap.format_help()
