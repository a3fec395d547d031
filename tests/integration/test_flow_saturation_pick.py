"""Saturated ranks left out of the pick, over real sockets: while some ranks a request could use
are saturated and others are not, every request goes to one that is not (under PD, on both
legs); once a rank drains it is picked again. The gate (all saturated: hold) is
test_flow_saturation.py."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from typing import Any

import pytest

from fastroute.config.cli import parse_args
from tests.integration.conftest import DataWorker, Router, call, post, run, until
from tests.integration.test_flow_saturation import LoadedWorker


class RankLoads(DataWorker):
    """A DP worker whose /v1/loads reports each rank's waiting requests and used KV tokens as
    the test sets them."""

    def __init__(self, dp_size: int) -> None:
        super().__init__(dp_size=dp_size)
        self.waiting = [0] * dp_size
        self.used = [0] * dp_size
        self.polls = 0

    def control(self, path: str) -> tuple[int, bytes] | None:
        if path.startswith("/v1/loads"):
            self.polls += 1
            loads = [
                {
                    "dp_rank": r,
                    "num_running_reqs": 0,
                    "num_waiting_reqs": self.waiting[r],
                    "num_total_reqs": self.waiting[r],
                    "num_used_tokens": self.used[r],
                    "max_total_num_tokens": 100000,
                }
                for r in range(self.dp_size)
            ]
            return 200, json.dumps({"dp_rank_count": self.dp_size, "loads": loads}).encode()
        return super().control(path)

    def ranks(self) -> Counter[int]:
        return Counter(int(rec.json["routed_dp_rank"]) for rec in self.inference())


async def _polled(*ws: Any) -> None:
    for w in ws:
        n = w.polls
        await until(lambda w=w, n=n: w.polls >= n + 2, what="two more load polls")


def _gen(tag: str) -> bytes:
    # Texts with nothing in common, so cache_aware spreads them as the others do.
    # The tag is also the routing key (consistent_hashing).
    return post("/generate", {"text": uuid.uuid4().hex * 8 + " " + tag}, {"x-smg-routing-key": tag})


async def _send(port: int, tags: list[str]) -> None:
    res = await asyncio.gather(*(call(port, _gen(t), timeout=15.0) for t in tags))
    assert [r.status for r in res] == [200] * len(tags)


@pytest.mark.parametrize("policy", ["round_robin", "power_of_two", "random", "cache_aware", "consistent_hashing"])
@pytest.mark.parametrize("flag", ["priority_scheduler_enabled", "worker_overload_shed"])
def test_dp_requests_land_only_on_free_ranks(policy: str, flag: str) -> None:
    async def body() -> None:
        w = await RankLoads(4).start()
        async with Router(
            worker_urls=[w.url],
            dp_aware=True,
            dp_rank_field="routed_dp_rank",
            policy=policy,
            load_monitor_interval=0.1,
            **{flag: True},
        ) as r:
            # Rank 1 by waiting requests (smg's default 8), rank 3 by KV use (80% of max).
            w.waiting[1] = 8
            w.used[3] = 85000
            await _polled(w)
            await _send(r.port, [f"a{i}" for i in range(24)])
            got = w.ranks()
            assert set(got) == {0, 2}, got  # none on a saturated rank, both free ones used
            # Rank 3 drains: it is picked again; rank 1 is still left out.
            w.used[3] = 0
            await _polled(w)
            await _send(r.port, [f"b{i}" for i in range(48)])
            later = w.ranks() - got
            assert later[1] == 0 and later[3] > 0, later

    run(body())


def test_pd_both_legs_avoid_saturated_ranks() -> None:
    async def body() -> None:
        p = [await LoadedWorker("prefill").start() for _ in range(2)]
        d = [await LoadedWorker("decode").start() for _ in range(2)]
        async with Router(
            pd_disaggregation=True,
            prefill=[(x.url, None) for x in p],
            decode=[x.url for x in d],
            policy="round_robin",
            priority_scheduler_enabled=True,
            prefill_overload_uncached_tokens=5000,
            load_monitor_interval=0.1,
        ) as r:
            p[0].uncached = 6000  # prefill: waiting uncached tokens past the flag
            d[1].waiting = 9  # decode: waiting requests past smg's default 8
            await _polled(*p, *d)
            await _send(r.port, [f"a{i}" for i in range(12)])
            assert len(p[0].inference()) == 0 and len(p[1].inference()) == 12
            assert len(d[0].inference()) == 12 and len(d[1].inference()) == 0
            # Both drain: both are picked again.
            p[0].uncached, d[1].waiting = 0, 0
            await _polled(*p, *d)
            await _send(r.port, [f"b{i}" for i in range(12)])
            assert len(p[0].inference()) > 0 and len(d[1].inference()) > 0

    run(body())


def test_disable_worker_overload_protection_leaves_no_rank_out(capsys: pytest.CaptureFixture[str]) -> None:
    # smg's --disable-worker-overload-protection switches both thresholds off; a threshold given
    # on beside it is refused by name.
    base = ["--worker-urls", "http://127.0.0.1:1", "--worker-overload-shed", "--disable-worker-overload-protection"]
    cfg = parse_args(base)
    assert (cfg.worker_overload_waiting_requests, cfg.worker_overload_token_usage) == (0, 1.0)
    with pytest.raises(SystemExit):
        parse_args([*base, "--worker-overload-waiting-requests", "4"])
    assert "--disable-worker-overload-protection" in capsys.readouterr().err

    async def body() -> None:
        w = await RankLoads(4).start()
        async with Router(
            worker_urls=[w.url],
            dp_aware=True,
            dp_rank_field="routed_dp_rank",
            policy="round_robin",
            load_monitor_interval=0.1,
            worker_overload_shed=True,
            worker_overload_waiting_requests=cfg.worker_overload_waiting_requests,
            worker_overload_token_usage=cfg.worker_overload_token_usage,
        ) as r:
            w.waiting = [8, 8, 8, 8]
            w.used[3] = 85000
            await _polled(w)
            await _send(r.port, [f"a{i}" for i in range(8)])  # none shed
            assert w.ranks() == Counter({0: 2, 1: 2, 2: 2, 3: 2})

    run(body())
