"""Speed-aware placement over the real shared target table and compiled kernels: equal
hardware picks exactly what least_requests picks; unequal hardware moves requests to the fast
server; shadow dispatches the policy's pick and counts agreement; prefill by queueing time."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from fastroute.core.routing import Router
from fastroute.core.speedplace import SpeedDecode
from fastroute.core.table import TargetTable

DP = 4


def _servers(tab: TargetTable) -> tuple[list[int], list[str]]:
    ids = [tab.alloc() for _ in range(2 * DP)]
    names = [f"http://d{k}:8000@{r}" for k in range(2) for r in range(DP)]
    for t in ids:
        tab.set_healthy(t, True)
    return ids, names


def _teach(router: Router, speeds: tuple[float, float], rng: random.Random) -> None:
    book = router.speed
    assert book is not None
    for _ in range(40):
        for k, f in enumerate(speeds):
            n = rng.randint(1, 10)
            book.observe_step(f"http://d{k}:8000", n, f * (0.0273 + 0.002 * n) * rng.uniform(0.98, 1.02))


def _run(mode: str, speeds: tuple[float, float] | None, steps: int = 400) -> tuple[list[int], Router]:
    """Picks of a decode group under a random arrival/departure sequence (same seed each run)."""
    tab = TargetTable(32)
    try:
        cfg = SimpleNamespace(speed_aware=mode, kv_events="off") if speeds is not None else None
        router = Router(tab, seed=4747, config=cfg)
        ids, names = _servers(tab)
        g = router.group(
            ids, "power_of_two", load_metric="least_requests", names=names, speed_role="decode" if cfg else None
        )
        if speeds is not None:
            _teach(router, speeds, random.Random(1))
        rng = random.Random(99)
        held, picks = [], []
        for _ in range(steps):
            if held and rng.random() < 0.45:
                held.pop(rng.randrange(len(held))).release()
                continue
            lease = g.acquire(100, None, None, 10)
            assert lease is not None
            held.append(lease)
            picks.append(lease.target)
        for lease in held:
            lease.release()
        assert all(tab.in_flight(t) == 0 for t in ids)  # every booking given back
        return picks, router
    finally:
        tab.unlink()


def test_equal_hardware_picks_exactly_what_least_requests_picks() -> None:
    plain, _ = _run("off", None)
    equal, router = _run("on", (1.0, 1.0))
    assert equal == plain
    assert router.speed is not None and router.speed.placements["fallback"] == len(plain)
    # fits a few percent apart are still the same hardware
    near, _ = _run("on", (1.0, 1.04))
    assert near == plain


def test_a_slower_server_gets_fewer_requests() -> None:
    plain, _ = _run("off", None)
    fast_slow, router = _run("on", (1.0, 1.6))
    assert fast_slow != plain
    on_slow = sum(1 for t in fast_slow if t >= DP)
    assert on_slow < 0.4 * len(fast_slow)
    assert sum(1 for t in plain if t >= DP) > 0.4 * len(plain)
    assert router.speed is not None and router.speed.placements["fallback"] == 0


def test_shadow_dispatches_the_policys_pick_and_counts_agreement() -> None:
    plain, _ = _run("off", None)
    shadow, router = _run("shadow", (1.0, 1.6))
    assert shadow == plain
    c = router.speed.placements  # type: ignore[union-attr]
    assert c["agree"] + c["disagree"] == len(plain) and c["disagree"] > 0


def test_the_pick_minimises_the_predicted_step_at_the_busiest_rank() -> None:
    tab = TargetTable(32)
    try:
        router = Router(tab, seed=1, config=SimpleNamespace(speed_aware="on", kv_events="off"))
        ids, names = _servers(tab)
        g = router.group(ids, "power_of_two", load_metric="least_requests", names=names, speed_role="decode")
        _teach(router, (1.0, 1.6), random.Random(2))
        pol = g.policy_impl
        assert isinstance(pol, SpeedDecode)
        # The fast server's rank 0 holds 9 requests: its step is paced by them, so a request on
        # its idle ranks sees ~45 ms; the slow server's idle ranks predict 1.6 x 29.3 = ~47 ms.
        leases = [g.book_target(ids[0]) for _ in range(9)]
        t = g.acquire(0, None, None, 0).target  # type: ignore[union-attr]
        assert t in ids[1:DP]
        assert pol.predicted_tpot(t) == pytest.approx(0.0273 + 0.002 * 9, rel=0.05)
        leases += [g.book_target(ids[0]) for _ in range(3)]  # now 12 there: ~51 ms
        t2 = g.acquire(0, None, None, 0).target  # type: ignore[union-attr]
        assert t2 >= DP
        for lease in leases:
            lease.release()
    finally:
        tab.unlink()


def test_prefill_ranks_by_predicted_queueing_time() -> None:
    tab = TargetTable(32)
    try:
        router = Router(tab, seed=1, config=SimpleNamespace(speed_aware="on", kv_events="off"))
        ids = [tab.alloc() for _ in range(2)]
        for t in ids:
            tab.set_healthy(t, True)
        g = router.group(
            ids,
            "power_of_two",
            load_metric="least_requests",
            names=["http://p0:8000", "http://p1:8000"],
            speed_role="prefill",
            tokens_until_answer=True,
        )
        book = router.speed
        assert book is not None
        book.observe_prefill(ids[0], 120_000, 1.0)
        book.observe_prefill(ids[1], 40_000, 1.0)  # three times slower
        # Predicted queueing: (tokens waiting + this request's) / the rank's rate.
        picks, leases = [], []
        for tokens in (60_000, 10_000, 10_000, 10_000):
            lease = g.acquire(tokens, None, None, 0)
            assert lease is not None
            leases.append(lease)
            picks.append(lease.target)
        # 60k: 0.5 s fast vs 1.5 s slow; 10k: 0.58 vs 0.25; 10k: 0.58 vs 0.5; 10k: 0.58 vs 0.75
        assert picks == [ids[0], ids[1], ids[1], ids[0]]
        for lease in leases:
            lease.release()
    finally:
        tab.unlink()


@pytest.mark.parametrize(
    "cfg,why",
    [
        ({"policy": "cache_aware"}, "cache_aware"),
        ({"pd_disaggregation": True, "policy": "power_of_two", "decode_policy": "manual"}, "manual"),
        ({"policy": "consistent_hashing"}, "consistent_hashing"),
        ({"policy": "power_of_two", "workers": 2}, "--workers 1"),
        ({"policy": "power_of_two", "enable_igw": True}, "--enable-igw"),
        ({"policy": "power_of_two", "speed_aware": "fast"}, "choose from off, shadow, on"),
    ],
)
def test_speed_aware_refuses_what_it_cannot_do_by_name(cfg: dict, why: str) -> None:
    from fastroute.config import Config, ConfigError

    cfg = {"speed_aware": "on", **cfg}
    with pytest.raises(ConfigError) as exc:
        Config(**cfg)
    assert exc.value.flag == "--speed-aware" and why in str(exc.value)
    Config(policy="power_of_two", speed_aware="shadow")  # what it can do starts
    Config(policy="cache_aware")  # off: nothing is checked


def test_help_names_the_flag() -> None:
    from fastroute.config.cli import build_parser

    text = build_parser().format_help()
    assert "--speed-aware" in text and "time per output token" in " ".join(text.split())


def test_refusing_unmet_slos_needs_the_mode_on() -> None:
    from fastroute.config import Config, ConfigError

    for mode in ("off", "shadow"):
        with pytest.raises(ConfigError) as exc:
            Config(policy="power_of_two", speed_aware=mode, speed_slo_unmet="refuse")
        assert exc.value.flag == "--speed-slo-unmet"
    with pytest.raises(ConfigError):
        Config(policy="power_of_two", speed_aware="on", speed_slo_unmet="maybe")
    Config(policy="power_of_two", speed_aware="on", speed_slo_unmet="refuse")


def test_a_held_target_keeps_later_picks_off_its_server() -> None:
    tab = TargetTable(32)
    try:
        router = Router(tab, seed=3, config=SimpleNamespace(speed_aware="on", kv_events="off"))
        ids, names = _servers(tab)
        g = router.group(ids, "power_of_two", load_metric="least_requests", names=names, speed_role="decode")
        book = router.speed
        assert book is not None
        _teach(router, (1.0, 1.6), random.Random(4))
        fast = "http://d0:8000"
        lease = g.book_target(ids[0])
        assert book.hold_slo(ids[0], 0.040) == fast  # ~29 ms predicted now: met, held
        assert book.hold_slo(ids[DP], 0.040) is None  # the slow server (~47 ms) does not meet it
        # Fill the fast server: without the hold it takes requests until its step passes the slow
        # one's (~44 ms at 8 on a rank); with it, a request without a target stops below
        # 0.9 x 0.9 x 40 ms = 32.4 ms, so at 2 on the busiest rank.
        picks = []
        leases = [lease]
        for _ in range(10):
            lease = g.acquire(0, None, None, 0)
            assert lease is not None
            leases.append(lease)
            picks.append(lease.target)
        assert max(tab.in_flight(t) for t in ids[:DP]) == 2  # 2 x 4 ranks, then the slow server
        assert sum(1 for t in picks if t >= DP) == 3
        book.drop_slo(fast, 0.040)
        assert book.tightest(fast) == float("inf")
        for lease in leases:
            lease.release()
    finally:
        tab.unlink()
