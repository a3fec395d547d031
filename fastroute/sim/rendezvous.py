"""The bootstrap-room rendezvous between simulated prefills and decodes (see ``engine``)."""

from __future__ import annotations

import asyncio
import time

ORIGIN_KEEP = 65536


class Rendezvous:
    """Bootstrap rooms a prefill has finished, and decodes waiting for them.

    A room marked ready before its decode arrives is kept for ``ttl_s`` (then forgotten, so an
    aborted decode never leaks it); a waiter is removed when it is satisfied or cancelled."""

    def __init__(self, ttl_s: float = 300.0) -> None:
        self._ready: dict[int, float] = {}
        self._waiters: dict[int, list[asyncio.Future]] = {}
        self._ttl = ttl_s
        self._last_prune = time.monotonic()
        # room -> the prefill DP rank that computed it (newest ORIGIN_KEEP rooms), so a decode
        # told the prefill rank (disagg_prefill_dp_rank) can check it was told the truth.
        self.origin: dict[int, int] = {}

    def mark_ready(self, room: int, rank: int | None = None) -> None:
        if rank is not None:
            self.origin[room] = rank
            if len(self.origin) > ORIGIN_KEEP:
                del self.origin[next(iter(self.origin))]
        waiters = self._waiters.pop(room, None)
        if waiters:
            for fut in waiters:
                if not fut.done():
                    fut.set_result(True)
            return
        now = time.monotonic()
        self._ready[room] = now
        if now - self._last_prune > self._ttl:
            self._last_prune = now
            cutoff = now - self._ttl
            for r in [r for r, t in self._ready.items() if t < cutoff]:
                del self._ready[r]

    def is_ready(self, room: int) -> bool:
        return room in self._ready

    async def wait(self, room: int, timeout: float) -> bool:
        """True once the room is ready (consuming it), False on timeout."""
        if self._ready.pop(room, None) is not None:
            return True
        fut = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(room, []).append(fut)
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            return False
        finally:
            lst = self._waiters.get(room)
            if lst is not None and fut in lst:
                lst.remove(fut)
                if not lst:
                    del self._waiters[room]

    def pending(self) -> int:
        return len(self._ready) + len(self._waiters)
