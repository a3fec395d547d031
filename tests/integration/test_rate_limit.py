"""--rate-limit-tokens-per-second over real sockets, and the PD prefill gates refused by name."""

from __future__ import annotations

import asyncio
import time

import pytest

from fastroute.config.cli import parse_args
from tests.integration.conftest import Router, call, post, run, workers


def test_token_bucket_feeds_the_queue_429_when_full() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with Router(
            worker_urls=[w.url], rate_limit_tokens_per_second=2, max_concurrent_requests=1, queue_size=1
        ) as r:
            t0 = time.monotonic()
            first = await call(r.port, post("/generate", {"text": "x"}))  # the burst token
            assert first.status == 200
            results = await asyncio.gather(*(call(r.port, post("/generate", {"text": "x"})) for _ in range(2)))
            statuses = sorted(res.status for res in results)
            assert statuses == [200, 429]  # one waits for the next token, one finds the queue full
            assert time.monotonic() - t0 >= 0.3  # the waiter waited for the refill (0.5 s)
            m = r.server.app.stats.rate_limit if r.server.app.stats is not None else None
            if m is not None:
                assert m.get("rejected") == 1 and m.get("dequeued") == 1

    run(body())


def test_prefill_admission_gate_refuses_by_name(capsys) -> None:
    flag = "--prefill-max-inflight-requests-per-worker"
    with pytest.raises(SystemExit):
        parse_args(["--pd-disaggregation", flag, "4"])
    assert flag in capsys.readouterr().err
    # 0 (the gate off) asks for what fastroute does, and the queue flags only mean something
    # with the gate on: both start (the inventory in fastroute.config.flags says so).
    parse_args(["--pd-disaggregation", flag, "0", "--prefill-queue-size", "4", "--prefill-queue-timeout-secs", "4"])
