"""control.background: the one supervision rule of every background task (log, back off, keep running)."""

from __future__ import annotations

import asyncio
import logging

from fastroute.control import background
from fastroute.control.background import Background, BackgroundCollector


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_a_crashing_body_restarts_with_growing_backoff_logged_once(caplog, monkeypatch):
    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(d, *a):
        slept.append(d)
        await real_sleep(0)

    monkeypatch.setattr(background.asyncio, "sleep", sleep)

    async def body():
        bg = Background(seed=1)
        runs = []

        async def task(st):
            runs.append(1)
            if len(runs) <= 6:
                raise ValueError(f"bad input {len(runs)}")
            st.ok()
            await asyncio.Event().wait()

        t = bg.spawn("t", task, initial=0.1, cap=0.5)
        while len(runs) < 7:
            await real_sleep(0)
        st = bg.tasks["t"]
        assert st.restarts == 6 and st.errors == 6 and st.up is True
        assert bg.stale() == []
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)
        return slept

    with caplog.at_level(logging.DEBUG, logger="fastroute.background"):
        delays = run(body())
    assert len(delays) == 6
    assert all(0.08 <= d <= 0.12 for d in delays[:1]) and delays[1] > delays[0] * 1.5
    assert all(d <= 0.5 * 1.2 for d in delays)  # capped (+ jitter)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "ValueError: bad input 1" in errors[0].getMessage()
    assert "Traceback" not in "".join(r.getMessage() for r in errors)


def test_a_body_that_returns_is_restarted_and_counted():
    async def body():
        bg = Background()
        runs = []

        async def task(st):
            runs.append(1)
            if len(runs) > 2:
                st.ok()
                await asyncio.Event().wait()

        t = bg.spawn("quits", task, initial=0.001, cap=0.002)
        while len(runs) < 3:
            await asyncio.sleep(0.001)
        st = bg.tasks["quits"]
        t.cancel()
        await asyncio.gather(t, return_exceptions=True)
        return st

    st = run(body())
    assert st.restarts == 2 and st.up is True and "returned" in st.cause


def test_handled_failures_mark_stale_and_the_metrics_say_so(caplog):
    bg = Background()
    st = bg.state("sync")
    with caplog.at_level(logging.INFO, logger="fastroute.background"):
        assert st.fail(OSError("down")) is True
        assert st.fail(OSError("down")) is False
        assert bg.stale() == ["sync"]
        fams = {f.name: f for f in BackgroundCollector(bg).collect()}
        assert fams["fastroute_background_errors"].samples[0].value == 2
        assert fams["fastroute_background_task_up"].samples[0].value == 0
        st.ok()
    assert bg.stale() == []
    fams = {f.name: f for f in BackgroundCollector(bg).collect()}
    assert fams["fastroute_background_task_up"].samples[0].value == 1
    assert fams["fastroute_background_task_age_seconds"].samples[0].value >= 0
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2 and "OSError: down" in msgs[0] and "working again" in msgs[1]


def test_cancel_all_cancels_again_a_task_that_swallowed_the_cancel():
    """The Python 3.11 wait_for race eats a cancel; stopping must still end the task."""

    async def body():
        swallowed = []

        async def stubborn():
            while len(swallowed) < 2:
                try:
                    await asyncio.sleep(10)
                except asyncio.CancelledError:
                    swallowed.append(1)
            await asyncio.sleep(10)

        t = asyncio.get_running_loop().create_task(stubborn())
        await asyncio.sleep(0)
        await background.cancel_all([t], retry=0.01)
        return t, swallowed

    t, swallowed = run(body())
    assert t.cancelled() and len(swallowed) == 2
