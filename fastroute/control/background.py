"""One rule for every background task (discovery, replica sync, health checks, load monitor).

A task is a coroutine function ``body(state)`` that runs forever and reports through its
:class:`TaskState`: ``state.ok()`` after every good iteration (a list, a watch event, a sync
tick, a poll round), ``state.fail(exc)`` after a failed one it handled itself. :meth:`Background.spawn`
runs it under supervision: an exception that escapes the body (a bug, input of a shape nobody
expected) or a body that returns is logged once per episode with its cause (no traceback per
iteration; the traceback only at DEBUG), counted in ``fastroute_background_errors_total{task}``,
and the body is started again after a capped exponential backoff with jitter, reset once the
task reports success again. So no task can end silently.

An episode is the run of failures between two successes: its first failure logs one ERROR (or
the body's own WARNING for a failure it handled), later ones log at DEBUG, and the first success
after it one INFO. ``fastroute_background_task_up{task}`` is 1 while the last iteration succeeded,
``fastroute_background_task_age_seconds{task}`` the time since the last success; ``/readiness``
lists the tasks whose view is stale (last iteration failed, or no success yet after a crash).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("fastroute.background")

__all__ = ["Background", "TaskState", "backoff_delay"]

RESTART_INITIAL = 0.1
RESTART_MAX = 30.0
# A restarted body must work this long before its crash episode ends (one INFO line, backoff
# reset): a body that crashes on every pass after one good step is still one episode.
STABLE_SECS = 10.0


def backoff_delay(base: float, rng: random.Random | None = None) -> float:
    """``base`` with +-20 % jitter, so replicas that failed together do not retry together."""
    return base * (0.8 + 0.4 * (rng or random).random())


class TaskState:
    """What one background task last reported (see module docstring)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.up: bool | None = None  # None until the first report
        self.errors = 0  # failures, handled or not (the counter)
        self.restarts = 0  # bodies that raised or returned
        self.last_ok: float | None = None  # time.monotonic() of the last success
        self.cause: str | None = None  # the current episode's first failure
        self.crashed_at: float | None = None
        self._failing = False

    def ok(self) -> None:
        """One good iteration: ends a failure episode (one INFO line)."""
        now = time.monotonic()
        if self._failing and (self.crashed_at is None or now - self.crashed_at >= STABLE_SECS):
            self._failing = False
            log.info("background task %s: working again (after %s)", self.name, self.cause)
        self.up = True
        self.last_ok = now

    def fail(self, exc: BaseException | str, logged: bool = False) -> bool:
        """One failed iteration: counted; the first of an episode is logged with its cause
        (unless the body already did, ``logged``). Returns True for the first of an episode."""
        self.errors += 1
        self.up = False
        cause = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        if self._failing:
            log.debug("background task %s: still failing: %s", self.name, cause)
            return False
        self._failing = True
        self.cause = cause
        if not logged:
            log.error("background task %s failed: %s; it goes on (logged once until it works again)", self.name, cause)
        return True

    def age(self) -> float | None:
        return None if self.last_ok is None else time.monotonic() - self.last_ok


class Background:
    """The supervised background tasks of one process (held by the registry that owns workers)."""

    def __init__(self, seed: int | None = None) -> None:
        self.tasks: dict[str, TaskState] = {}
        self._rng = random.Random(seed)

    def state(self, name: str) -> TaskState:
        st = self.tasks.get(name)
        if st is None:
            st = self.tasks[name] = TaskState(name)
        return st

    def spawn(
        self,
        name: str,
        body: Callable[[TaskState], Awaitable[Any]],
        *,
        initial: float = RESTART_INITIAL,
        cap: float = RESTART_MAX,
    ) -> asyncio.Task:
        """Run ``body(state)`` under supervision on the running loop (see module docstring)."""
        st = self.state(name)
        return asyncio.get_running_loop().create_task(self._run(st, body, initial, cap), name=name)

    async def _run(
        self, st: TaskState, body: Callable[[TaskState], Awaitable[Any]], initial: float, cap: float
    ) -> None:
        delay = initial
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await body(st)
                cause = "the task returned"
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the rule: nothing ends a background task
                cause = f"crashed: {type(exc).__name__}: {exc}"
                log.debug("background task %s raised", st.name, exc_info=True)
            st.restarts += 1
            st.fail(f"{cause}; restarting")
            st.crashed_at = time.monotonic()
            if loop.time() - started >= STABLE_SECS:
                delay = initial  # it worked for a while before failing: a new episode
            await asyncio.sleep(backoff_delay(delay, self._rng))
            delay = min(delay * 2, cap)

    def stale(self) -> list[str]:
        """Tasks whose view is stale: the last iteration failed (or the body crashed)."""
        return sorted(n for n, st in self.tasks.items() if st.up is False)


class BackgroundCollector:
    """Prometheus families of the supervised tasks, read at scrape time."""

    def __init__(self, background: Background) -> None:
        self.background = background

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        tasks = sorted(self.background.tasks.items())
        errors = CounterMetricFamily(
            "fastroute_background_errors",
            "Failed iterations and crashes of a background task (each crash restarts it after a backoff)",
            labels=["task"],
        )
        up = GaugeMetricFamily(
            "fastroute_background_task_up",
            "1 while the task's last iteration succeeded (0: its view is stale)",
            labels=["task"],
        )
        age = GaugeMetricFamily(
            "fastroute_background_task_age_seconds",
            "Seconds since the task's last successful iteration (absent before the first)",
            labels=["task"],
        )
        for name, st in tasks:
            errors.add_metric([name], float(st.errors))
            up.add_metric([name], 1.0 if st.up else 0.0)
            a = st.age()
            if a is not None:
                age.add_metric([name], a)
        yield from (errors, up, age)


async def cancel_all(tasks: list[asyncio.Task], retry: float = 0.5) -> None:
    """Cancel ``tasks`` and wait until every one has ended. Cancelled again every ``retry``
    seconds while one is still running: on Python 3.11 a ``wait_for`` whose inner call
    finishes just as the cancel arrives swallows it, and a supervised loop would go on."""
    pending = [t for t in tasks if not t.done()]
    while pending:
        for t in pending:
            t.cancel()
        await asyncio.wait(pending, timeout=retry)
        pending = [t for t in pending if not t.done()]
