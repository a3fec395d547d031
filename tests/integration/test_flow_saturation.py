"""Saturation gating over real sockets: the router reads each rank's polled load and holds (or,
with --worker-overload-shed, sheds) requests while every rank a request could use is saturated;
under PD both stages are checked."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastroute.dataplane.flowcontrol import FlowAdmission
from tests.integration.conftest import DataWorker, Router, call, post, run, until


class LoadedWorker(DataWorker):
    """A fake worker whose /v1/loads reports the waiting requests, KV use and uncached prompt
    tokens the test sets."""

    def __init__(self, role: str = "regular") -> None:
        super().__init__(role=role)
        self.waiting = 0
        self.used = 0
        self.uncached = 0
        self.polls = 0

    def control(self, path: str) -> tuple[int, bytes] | None:
        if path.startswith("/v1/loads"):
            self.polls += 1
            load: dict[str, Any] = {
                "dp_rank": 0,
                "num_running_reqs": 0,
                "num_waiting_reqs": self.waiting,
                "num_total_reqs": self.waiting,
                "num_used_tokens": self.used,
                "max_total_num_tokens": 100000,
            }
            if self.role == "prefill":
                load["disagg"] = {"prefill_queue_reqs": 0, "num_waiting_uncached_tokens": self.uncached}
                load["num_waiting_uncached_tokens"] = self.uncached
            return 200, json.dumps({"dp_rank_count": 1, "loads": [load]}).encode()
        return super().control(path)


async def _workers(*roles: str) -> list[LoadedWorker]:
    return [await LoadedWorker(role).start() for role in roles]  # type: ignore[misc]


async def _polled(w: LoadedWorker) -> None:
    n = w.polls
    await until(lambda: w.polls >= n + 2, what="two more load polls")


def _gen(tag: str) -> bytes:
    return post("/generate", {"text": tag})


def test_nothing_is_sent_to_a_saturated_rank_until_it_drains() -> None:
    async def body() -> None:
        (w,) = await _workers("regular")
        w.waiting = 8  # smg's default threshold: at or above it the rank is saturated
        async with Router(worker_urls=[w.url], priority_scheduler_enabled=True, load_monitor_interval=0.1) as r:
            flow = r.server.app.admission
            assert isinstance(flow, FlowAdmission)
            await _polled(w)
            held = asyncio.ensure_future(call(r.port, _gen("held"), timeout=15.0))
            await until(lambda: len(flow.queue) == 1, what="the request held in its class")
            await _polled(w)
            assert not w.inference() and not held.done()
            w.waiting = 2
            res = await held
            assert res.status == 200
            # KV usage: 80% of max tokens saturates too.
            w.waiting, w.used = 0, 80000
            await _polled(w)
            held = asyncio.ensure_future(call(r.port, _gen("kv"), timeout=15.0))
            await until(lambda: len(flow.queue) == 1, what="held for KV usage")
            await _polled(w)
            assert [rec.json["text"] for rec in w.inference()] == ["held"]
            w.used = 1000
            assert (await held).status == 200
            assert [rec.json["text"] for rec in w.inference()] == ["held", "kv"]

    run(body())


def test_overload_shed_answers_503_with_the_poll_interval() -> None:
    async def body() -> None:
        (w,) = await _workers("regular")
        async with Router(
            worker_urls=[w.url],
            worker_overload_shed=True,
            worker_overload_waiting_requests=3,
            load_monitor_interval=2.0,
        ) as r:
            assert (await call(r.port, _gen("ok"))).status == 200
            w.waiting = 3
            await until(lambda: w.polls >= 2, timeout=10.0, what="a poll after the change")
            await _polled_once(w)
            res = await call(r.port, _gen("shed"))
            assert res.status == 503
            assert res.json["error"]["code"] == "worker_overload_protection_shed"
            assert res.headers["x-smg-error-code"] == "worker_overload_protection_shed"
            assert res.headers["retry-after"] == "2"
            assert [rec.json["text"] for rec in w.inference()] == ["ok"]
            flow = r.server.app.admission
            assert flow.refusals[("ip:127.0.0.1", "default", "worker_overload_protection_shed")] == 1

    run(body())


async def _polled_once(w: LoadedWorker) -> None:
    n = w.polls
    await until(lambda: w.polls >= n + 1, timeout=10.0, what="one more load poll")


def test_pd_checks_both_stages() -> None:
    async def body() -> None:
        p, d = await _workers("prefill", "decode")
        async with Router(
            pd_disaggregation=True,
            prefill=[(p.url, 8998)],
            decode=[d.url],
            policy="round_robin",
            worker_overload_shed=True,
            prefill_overload_uncached_tokens=5000,
            load_monitor_interval=0.1,
        ) as r:
            await _polled(p)
            await _polled(d)
            assert (await call(r.port, _gen("both free"))).status == 200
            for saturate, undo in (
                (lambda: setattr(d, "waiting", 9), lambda: setattr(d, "waiting", 0)),
                (lambda: setattr(d, "used", 90000), lambda: setattr(d, "used", 0)),
                (lambda: setattr(p, "waiting", 8), lambda: setattr(p, "waiting", 0)),
                (lambda: setattr(p, "uncached", 6000), lambda: setattr(p, "uncached", 0)),
            ):
                saturate()
                await _polled(p)
                await _polled(d)
                res = await call(r.port, _gen("shed"))
                assert res.status == 503 and res.json["error"]["code"] == "worker_overload_protection_shed"
                undo()
                await _polled(p)
                await _polled(d)
                assert (await call(r.port, _gen("after"))).status == 200
            assert [rec.json["text"] for rec in p.inference()] == ["both free"] + ["after"] * 4
            assert [rec.json["text"] for rec in d.inference()] == ["both free"] + ["after"] * 4

    run(body())


def test_capacity_is_the_ranks_max_running_requests() -> None:
    class Limited(LoadedWorker):
        def control(self, path: str) -> tuple[int, bytes] | None:
            ans = super().control(path)
            if path.startswith("/v1/loads") and ans is not None:
                doc = json.loads(ans[1])
                for e in doc["loads"]:
                    e["max_running_requests"] = 2
                return 200, json.dumps(doc).encode()
            return ans

    async def body() -> None:
        w = await Limited().start()
        async with Router(worker_urls=[w.url], priority_scheduler_enabled=True, load_monitor_interval=0.1) as r:
            flow = r.server.app.admission
            assert isinstance(flow, FlowAdmission)
            await _polled(w)
            assert flow.slots() == 2  # no --max-concurrent-requests: the engine's limit
            w.hold()
            sent = [asyncio.ensure_future(call(r.port, _gen(f"r{i}"), timeout=15.0)) for i in range(2)]
            await until(lambda: len(w.inference()) == 2, what="two requests at the worker")
            third = asyncio.ensure_future(call(r.port, _gen("r2"), timeout=15.0))
            await until(lambda: len(flow.queue) == 1, what="the third held by the capacity")
            await _polled(w)
            assert len(w.inference()) == 2
            w.release()
            assert [x.status for x in await asyncio.gather(*sent, third)] == [200, 200, 200]
            assert [rec.json["text"] for rec in w.inference()] == ["r0", "r1", "r2"]
        # Under --workers 2 each proxy process admits its half of the engines' batch.
        async with Router(
            worker_urls=[w.url], priority_scheduler_enabled=True, load_monitor_interval=0.1, workers=2
        ) as r:
            flow = r.server.app.admission
            assert isinstance(flow, FlowAdmission)
            await _polled(w)
            assert flow.slots() == 1

    run(body())
