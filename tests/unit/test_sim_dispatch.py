"""The simulated engine's DP controller (fastroute.sim.dispatch) against a fake clock: each
--load-balance-method's choice, dispatch-time booking, the 20 ms refresh and its stale-snapshot
rule, the routed rank override, and the worker CLI flag."""

from __future__ import annotations

import pytest

from fastroute.sim.dispatch import DpController, resolve_method
from fastroute.sim.engine import SimParams
from fastroute.sim.worker import main as worker_main


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def ctl(method: str, role: str = "decode", n: int = 8) -> tuple[DpController, Clock]:
    clock = Clock()
    return DpController(method, role, n, clock, refresh_s=0.02), clock


def test_auto_resolves_by_role_and_bad_methods_are_refused() -> None:
    assert resolve_method("auto", "prefill") == "follow_bootstrap_room"
    assert resolve_method("auto", "decode") == "round_robin"
    assert resolve_method("auto", "regular") == "round_robin"
    assert resolve_method("total_tokens", "prefill") == "total_tokens"
    with pytest.raises(ValueError):
        resolve_method("least_load", "decode")
    with pytest.raises(ValueError):
        SimParams(load_balance_method="shortest_queue")


def test_round_robin_cycles_and_follow_room_follows_the_room() -> None:
    rr, _ = ctl("round_robin", n=4)
    assert [rr.pick(None, 7, 10) for _ in range(9)] == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    room, _ = ctl("auto", role="prefill", n=4)
    assert [room.pick(None, r, 10) for r in (5, 9, 6, 7, 8)] == [1, 1, 2, 3, 0]
    assert room.pick(None, None, 10) == 0  # no room: rank 0 (SGLang asserts)


def test_routed_rank_overrides_every_method_and_books_nothing() -> None:
    for method in ("round_robin", "follow_bootstrap_room", "total_requests", "total_tokens"):
        c, _ = ctl(method)
        assert [c.pick(5, 3, 1000) for _ in range(3)] == [5, 5, 5]
        assert c.requests == [0] * 8 and c.tokens == [0] * 8
    rr, _ = ctl("round_robin", n=4)
    rr.pick(2, None, 1)
    assert rr.pick(None, None, 1) == 0  # the override did not move the round-robin counter


def test_total_requests_books_each_dispatch_so_a_burst_spreads() -> None:
    c, clock = ctl("total_requests")
    # A burst inside one refresh window: the bookings alone spread it, one per rank.
    assert [c.pick(None, 0, 100) for _ in range(8)] == list(range(8))
    assert c.requests == [1] * 8 and c.tokens == [100] * 8
    assert c.pick(None, 0, 100) == 0  # ties go to the lowest rank
    assert c.refreshes == 1


def test_total_tokens_weighs_input_and_breaks_ties_by_requests() -> None:
    c, _ = ctl("total_tokens", n=4)
    assert c.pick(None, None, 50_000) == 0
    assert [c.pick(None, None, 1_000) for _ in range(3)] == [1, 2, 3]
    assert c.pick(None, None, 1_000) == 1  # rank 0 holds one request too, but 50k tokens
    t, _ = ctl("total_tokens", n=3)
    t.requests[:] = [2, 1, 3]  # equal tokens: fewer requests wins
    t._last_refresh = t.clock()
    assert t.pick(None, None, 0) == 1


def test_refresh_at_most_every_20ms_and_unchanged_ranks_keep_their_bookings() -> None:
    c, clock = ctl("total_requests", n=4)
    assert c.pick(None, None, 1) == 0  # first dispatch reads the (empty) snapshots
    c.publish(1, 5, 0)  # rank 1 reports 5 requests ...
    clock.t += 0.019
    assert c.pick(None, None, 1) == 1  # ... but inside 20 ms the budget is not re-read
    clock.t += 0.002  # 21 ms after the first read
    assert c.pick(None, None, 1) == 2  # read: rank 1 is 5 now; rank 0 keeps its booking (1)
    assert c.requests == [1, 5, 1, 0]
    assert c.refreshes == 2
    c.publish(0, 0, 0)  # rank 0 drained and published; rank 2 did not publish
    clock.t += 0.05
    c.refresh()
    assert c.requests == [0, 5, 1, 0]  # rank 2's booking survives the refresh (stale read skipped)


def test_a_batch_refreshes_once_then_books_each_item() -> None:
    c, clock = ctl("total_requests", n=4)
    c.refresh()
    c.publish(0, 9, 0)
    clock.t += 1.0
    ranks = c.pick_many([(None, None, 1), (None, None, 1), (3, None, 1), (None, None, 1)])
    assert ranks == [1, 2, 3, 3]  # rank 0 (9 requests after the one refresh) is avoided
    assert c.refreshes == 2


def test_refresh_window_scales_with_time_scale_and_the_worker_flag() -> None:
    assert SimParams(time_scale=0.25).controller("decode").refresh_s == pytest.approx(0.005)
    assert SimParams(load_balance_method="total_tokens").controller("prefill").method == "total_tokens"
    with pytest.raises(SystemExit):
        worker_main(["--role", "decode", "--port", "1", "--load-balance-method", "fastest"])
