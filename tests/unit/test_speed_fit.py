"""The online fits of fastroute.core.speed: known step curves are recovered, a slowdown is
followed, a prefill rank's rate comes from its pushed counters."""

from __future__ import annotations

import random

import pytest

from fastroute.core.speed import HALF_LIFE_S, RateFit, StepFit


def _feed(fit: StepFit, a: float, b: float, t0: float, secs: float, rng: random.Random, every: float = 0.25) -> float:
    t = t0
    while t < t0 + secs:
        n = rng.randint(1, 12)
        fit.observe(n, (a + b * n) * rng.uniform(0.97, 1.03), t)
        t += every
    return t


@pytest.mark.parametrize("a,b", [(0.0273, 0.002), (0.0437, 0.0032), (0.068, 0.005), (0.030, 0.0)])
def test_known_step_curves_are_recovered_within_5_percent(a: float, b: float) -> None:
    fit = StepFit()
    _feed(fit, a, b, 0.0, 30.0, random.Random(47))
    for n in (1, 4, 8, 12):
        p = fit.predict(n)
        assert p == pytest.approx(a + b * n, rel=0.05)
    assert fit.shifts == 0  # noise of +-3% is not a change of speed


def test_a_slowdown_is_followed_within_five_seconds() -> None:
    rng = random.Random(7)
    fit = StepFit()
    t = _feed(fit, 0.0273, 0.002, 0.0, 60.0, rng)
    # From t on the server is 1.6 times slower; samples keep coming 4 a second.
    t_slow = t
    followed = None
    while t < t_slow + 30:
        n = rng.randint(1, 12)
        fit.observe(n, 1.6 * (0.0273 + 0.002 * n) * rng.uniform(0.97, 1.03), t)
        t += 0.25
        if followed is None and all(
            fit.predict(m) == pytest.approx(1.6 * (0.0273 + 0.002 * m), rel=0.05) for m in (1, 6, 12)
        ):
            followed = t - t_slow
    assert followed is not None and followed <= 5.0
    assert fit.shifts >= 1
    # ... and still holds after the half-life has passed (the old regime does not come back)
    assert fit.predict(6) == pytest.approx(1.6 * (0.0273 + 0.002 * 6), rel=0.05)


def test_a_constant_batch_borrows_the_slope_and_fits_the_level() -> None:
    fit = StepFit()
    for i in range(20):
        fit.observe(4, 0.0437 + 0.0032 * 4, i * 0.1)
    assert fit.own_line() is None  # no batch variety: the slope cannot be separated
    ratio = 0.0032 / 0.0437
    a, b = fit.line(ratio)  # type: ignore[misc]
    assert a == pytest.approx(0.0437, rel=1e-6) and b == pytest.approx(0.0032, rel=1e-6)
    assert StepFit().predict(4) is None  # nothing seen: no prediction


def test_old_samples_decay_by_the_half_life() -> None:
    fit = StepFit()
    fit.observe(2, 0.03, 0.0)
    w0 = fit.w
    fit.observe(2, 0.03, HALF_LIFE_S)
    assert fit.w == pytest.approx(w0 * 0.5 + 1.0)


def test_prefill_rate_from_pushed_counters() -> None:
    r = RateFit()
    r.counters(0, 0, 0.0)
    assert r.rate is None
    r.counters(120_000, 1_000_000, 1.0)  # 120k uncached tokens in 1 s busy
    r.counters(180_000, 1_500_000, 2.0)
    assert r.rate == pytest.approx(120_000, rel=0.01)
    r.counters(180_000, 1_500_000, 3.0)  # idle: no sample
    assert r.samples == 2
