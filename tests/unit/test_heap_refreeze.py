"""The heap is refrozen once the worker set has settled (fastroute/runtime/heap.py)."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest

from fastroute.runtime import heap


class _Node:
    def __init__(self) -> None:
        self.other: _Node | None = None


def _tracked(obj: object) -> bool:
    """Whether ``obj`` is in one of the collector's generations (not frozen)."""
    return any(o is obj for g in range(3) for o in gc.get_objects(g))


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(heap, "QUIET_SECS", 0.05)
    monkeypatch.setattr(heap, "MIN_GAP_SECS", 0.3)
    try:
        yield
    finally:
        gc.unfreeze()  # give the test process its collector back


def test_objects_of_a_settled_worker_set_are_frozen_and_cyclic_garbage_collected(quick: None) -> None:
    async def go() -> None:
        loop = asyncio.get_running_loop()
        r = heap.Refreezer(loop)
        cycle = _Node()  # a worker's objects in a cycle, frozen while it was registered
        cycle.other = cycle
        gone = weakref.ref(cycle)
        gc.freeze()
        del cycle  # then it is removed: garbage, but frozen
        kept = _Node()  # stands for a registered worker's objects
        assert _tracked(kept)
        r.changed("regular")
        assert not _tracked(kept)  # frozen at the change: collections until the refreeze skip it
        r.changed("regular")  # a burst: one refreeze after it
        await asyncio.sleep(0.01)
        assert gone() is not None  # frozen garbage waits for the quiet period's collection
        await asyncio.sleep(0.2)
        assert not _tracked(kept)  # still frozen after the refreeze
        assert gone() is None  # unfrozen and collected, not kept frozen for ever
        again = _Node()
        again.other = again
        gone_again = weakref.ref(again)
        del again
        r.changed("regular")  # frozen with the change, though garbage
        await asyncio.sleep(0.1)
        assert gone_again() is not None  # at most one refreeze per MIN_GAP_SECS
        await asyncio.sleep(0.4)
        assert gone_again() is None
        r.close()

    asyncio.run(go())


def test_a_set_that_never_settles_is_still_collected(quick: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Changes closer together than QUIET_SECS freeze whatever exists, garbage too: the
    refreeze comes MAX_WAIT_SECS after the first of them at the latest."""
    monkeypatch.setattr(heap, "MAX_WAIT_SECS", 0.4)

    async def go() -> None:
        r = heap.Refreezer(asyncio.get_running_loop())
        await asyncio.sleep(0.35)  # past the first MIN_GAP_SECS
        junk = _Node()
        junk.other = junk
        gone = weakref.ref(junk)
        del junk
        for _ in range(40):  # a change every 30 ms for 1.2 s: never 50 ms quiet
            r.changed("regular")
            await asyncio.sleep(0.03)
            if gone() is None:
                break
        assert gone() is None  # collected while the changes went on
        r.close()

    asyncio.run(go())


def test_closing_cancels_a_pending_refreeze(quick: None) -> None:
    async def go() -> None:
        r = heap.Refreezer(asyncio.get_running_loop())
        junk = _Node()
        junk.other = junk
        gone = weakref.ref(junk)
        del junk
        r.changed("regular")
        r.close()
        await asyncio.sleep(0.2)
        assert gone() is not None  # no refreeze came to collect it

    asyncio.run(go())
