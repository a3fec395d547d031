"""The collector after the worker set changes.

``freeze_heap`` (assemble.py) moves what start-up made out of the collector's sight, but a
fleet's workers register after that, and each one brings a few dozen tracked objects (worker,
routes, rank names, pools). With a thousand servers those objects made every full collection
(each few seconds: poll tasks that outlive two young collections accumulate) walk ~20,000
objects, 15-25 ms of CPU during which no request moves.

A :class:`Refreezer` listens to the registry. At every change it freezes what exists now (a
constant-time move of the collector's lists), so the full collections the registrations would
otherwise bring (40 ms of CPU each at a thousand servers, one or two before the set settles)
walk none of the new workers' objects. Once the worker set has been quiet for ``QUIET_SECS``
(at most once per ``MIN_GAP_SECS``, and no later than ``MAX_WAIT_SECS`` after the first change
still unsettled, so a set that never settles is still cleaned up once a minute or so), it
unfreezes, collects everything once (so cyclic garbage frozen meanwhile, e.g. of removed
workers, is not kept for ever) and freezes again.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import time

log = logging.getLogger("fastroute.runtime")

QUIET_SECS = 5.0
MIN_GAP_SECS = 60.0
MAX_WAIT_SECS = 60.0


class Refreezer:
    """Refreeze the heap once the registry has settled (see the module docstring)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._timer: asyncio.TimerHandle | None = None
        self._last = float("-inf")  # the first refreeze waits only for quiet
        self._since = float("inf")  # the first change not followed by a refreeze yet

    def changed(self, role: str) -> None:
        """Registry listener: a group's targets changed; freeze now, (re)arm the quiet timer."""
        gc.freeze()
        now = self._loop.time()
        if self._timer is not None:
            self._timer.cancel()
        self._since = min(self._since, now)
        at = max(min(now + QUIET_SECS, self._since + MAX_WAIT_SECS), self._last + MIN_GAP_SECS)
        self._timer = self._loop.call_at(at, self._refreeze)

    def _refreeze(self) -> None:
        self._timer = None
        self._last = self._loop.time()
        self._since = float("inf")
        started = time.perf_counter()
        gc.unfreeze()
        found = gc.collect()
        gc.freeze()
        log.debug(
            "heap refrozen after worker changes: %d objects frozen, %d unreachable, %.1f ms",
            gc.get_freeze_count(),
            found,
            (time.perf_counter() - started) * 1000,
        )

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
