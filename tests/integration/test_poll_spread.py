"""Load polls of a fleet are spread over the interval instead of arriving together."""

from __future__ import annotations

import asyncio
import time

from tests.integration.conftest import DataWorker, Router, run, until


class _Timed(DataWorker):
    """A fake worker that records when its /v1/loads is polled."""

    def __init__(self) -> None:
        super().__init__(dp_size=1)
        self.polled: list[float] = []
        self.probed: list[float] = []

    def control(self, path: str) -> tuple[int, bytes] | None:
        if path.startswith("/v1/loads"):
            self.polled.append(time.monotonic())
        elif path == "/health":
            self.probed.append(time.monotonic())
        return super().control(path)


def test_forty_workers_are_polled_over_the_interval() -> None:
    async def go() -> None:
        ws = [await _Timed().start() for _ in range(40)]
        try:
            async with Router(worker_urls=[w.url for w in ws], load_monitor_interval=1.0):
                await until(lambda: all(len(w.polled) >= 2 for w in ws), 10.0, "two rounds")
                # One round: each worker's second poll (the first may be registration's).
                second = sorted(w.polled[1] for w in ws)
                assert second[-1] - second[0] >= 0.5  # spread over most of the 1 s interval
                gaps = [b - a for a, b in zip(second, second[1:])]
                assert max(gaps) < 0.2  # and evenly, not in two bursts
        finally:
            for w in ws:
                await w.stop()

    run(go(), timeout=60)


def test_a_tick_makes_no_task_per_worker_ahead_of_its_turn() -> None:
    """A poll's task is made when its turn comes, not all at the start of the tick: forty
    workers add a handful of tasks to the loop at any moment, not forty sleeping ones (which
    lived long enough to be promoted to the collector's oldest generation every tick)."""

    async def go() -> None:
        ws = [await _Timed().start() for _ in range(40)]
        try:
            async with Router(worker_urls=[w.url for w in ws], load_monitor_interval=1.0):
                await until(lambda: all(len(w.polled) >= 2 for w in ws), 10.0, "first rounds")
                base = len(asyncio.all_tasks())
                peak, rounds = base, min(len(w.polled) for w in ws)
                while min(len(w.polled) for w in ws) < rounds + 2:  # two whole ticks sampled
                    peak = max(peak, len(asyncio.all_tasks()))
                    await asyncio.sleep(0.002)
                # before: 40 tasks sleeping towards their turn at every tick start
                assert peak - base <= 8, (base, peak)
        finally:
            for w in ws:
                await w.stop()

    run(go(), timeout=60)


def test_forty_workers_are_probed_over_the_health_interval() -> None:
    async def go() -> None:
        ws = [await _Timed().start() for _ in range(40)]
        try:
            async with Router(
                worker_urls=[w.url for w in ws],
                disable_health_check=False,
                health_check_interval_secs=1,
                disable_load_monitoring=True,
            ):
                await until(lambda: all(len(w.probed) >= 3 for w in ws), 15.0, "three probes each")
                # The third: registration probed each once, and the first tick may cut short.
                third = sorted(w.probed[2] for w in ws)
                assert third[-1] - third[0] >= 0.5  # spread over most of the 1 s interval
                gaps = [b - a for a, b in zip(third, third[1:])]
                assert max(gaps) < 0.2
        finally:
            for w in ws:
                await w.stop()

    run(go(), timeout=60)


def test_a_registration_storm_syncs_the_group_once_per_batch_not_per_worker() -> None:
    """Each activation used to sync its role's group (O(targets), with every listener) on the
    next loop step: a fleet turning ready one worker per step cost O(workers x targets). Past
    a burst of syncs, the next one waits a little and covers every activation since."""

    async def go() -> None:
        ws = [await DataWorker(dp_size=1).start() for _ in range(97)]
        try:
            async with Router(worker_urls=[ws[0].url]) as r:
                reg = r.server.registry
                syncs: list[str] = []
                reg.add_listener(syncs.append)
                loop = asyncio.get_running_loop()
                for w in ws[1:]:  # one activation per loop step, as a fleet's handshakes end
                    reg.add_worker(w.url, "regular")
                until_all = loop.time() + 30
                while len(reg.group("regular").targets) < len(ws) and loop.time() < until_all:
                    await asyncio.sleep(0)
                assert len(reg.group("regular").targets) == len(ws)  # everyone routable
                assert len(syncs) <= 48, len(syncs)  # before: one sync per worker (96)
        finally:
            for w in ws:
                await w.stop()

    run(go(), timeout=120)
