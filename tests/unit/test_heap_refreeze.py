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
        r.changed("regular")  # a burst: one refreeze after it
        await asyncio.sleep(0.01)
        assert _tracked(kept)  # not before the quiet period ends
        await asyncio.sleep(0.2)
        assert not _tracked(kept)  # frozen: full collections no longer walk it
        assert gone() is None  # unfrozen and collected, not kept frozen for ever
        later = _Node()
        r.changed("regular")
        await asyncio.sleep(0.1)
        assert _tracked(later)  # at most one refreeze per MIN_GAP_SECS
        await asyncio.sleep(0.4)
        assert not _tracked(later)
        r.close()

    asyncio.run(go())


def test_closing_cancels_a_pending_refreeze(quick: None) -> None:
    async def go() -> None:
        r = heap.Refreezer(asyncio.get_running_loop())
        obj = _Node()
        r.changed("regular")
        r.close()
        await asyncio.sleep(0.2)
        assert _tracked(obj)

    asyncio.run(go())
