"""Load polls of a fleet are spread over the interval instead of arriving together."""

from __future__ import annotations

import time

from tests.integration.conftest import DataWorker, Router, run, until


class _Timed(DataWorker):
    """A fake worker that records when its /v1/loads is polled."""

    def __init__(self) -> None:
        super().__init__(dp_size=1)
        self.polled: list[float] = []

    def control(self, path: str) -> tuple[int, bytes] | None:
        if path.startswith("/v1/loads"):
            self.polled.append(time.monotonic())
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
