"""Lease audits: exact crash reclaim of a dead proxy process's bookings, and the reconciler.

Both compare bookings with another account of the same work and neither polls anything itself:

* :func:`reclaim` (``--workers N``): a proxy process books each lease twice, in the shared table
  and in its own ledger; when it dies the supervisor subtracts exactly its ledger from the table.
* :class:`Reconciler`: the router's in-flight count of a target against the engine's polled
  load, to flag leaks the proxy's own safety net cannot see. It only flags, never releases.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastroute.control.worker import target_label
from fastroute.core.table import (
    COL_IN_FLIGHT,
    COL_IN_FLIGHT_TOKENS,
    COL_POLLED_AT,
    COL_POLLED_RUNNING,
    COL_POLLED_WAITING,
    TargetTable,
)

# "fastroute.monitor": the name operators filter health and load events on.
log = logging.getLogger("fastroute.monitor")


def reclaim(table: TargetTable, ledger: TargetTable) -> tuple[int, int]:
    """Subtract everything ``ledger`` (a dead process's bookings) holds from ``table`` and zero
    the ledger -> (requests, tokens) reclaimed.  Only call once the ledger's owner is gone.
    The feed uses its pickers' load indexes held (the ledger header's count) are given back
    too, so writers stop publishing once no live process keeps an index."""
    uses = ledger.feed_uses
    if uses:
        table.give_back_feed_uses(uses)
        ledger.give_back_feed_uses(uses)
    reqs = toks = 0
    # One snapshot, walked as plain ints: runs once per process exit, not per request.
    for t, row in enumerate(ledger.snapshot().tolist()):
        r = row[COL_IN_FLIGHT]
        k = row[COL_IN_FLIGHT_TOKENS]
        if not r and not k:
            continue
        # The table holds at least these bookings (booked there first, released there last).
        table.cells.add(t, COL_IN_FLIGHT, -r)
        table.cells.add(t, COL_IN_FLIGHT_TOKENS, -k)
        ledger.cells.store(t, COL_IN_FLIGHT, 0)
        ledger.cells.store(t, COL_IN_FLIGHT_TOKENS, 0)
        reqs += r
        toks += k
    return reqs, toks


class Reconciler:
    """Compares the router's in-flight count of each target with the engine's polled load.

    A leak the proxy's own safety net cannot see (e.g. a lease lost by another process sharing
    the table) shows up as the router holding N requests on a rank while the engine keeps
    reporting fewer (running + waiting) poll after poll. ``check`` is called periodically; a
    target is flagged once it has stayed short on at least ``min_polls`` consecutive *new* polls
    for longer than ``timeout`` seconds. Flagging only logs and calls ``on_mismatch(name)``:
    the leases may belong to other processes, so nothing is released here.

    Prefill targets are skipped: their leases rightly outlive the engine's work (they are held
    until the decode stream ends, protocol.md 3.8).
    """

    def __init__(
        self, table: TargetTable, timeout: float, on_mismatch: Callable[[str], None] | None = None, min_polls: int = 3
    ) -> None:
        self.table = table
        self.timeout = float(timeout)
        self.on_mismatch = on_mismatch
        self.min_polls = int(min_polls)
        # row -> [owner worker, last polled_at seen, short since (loop time), short polls, flagged]
        self._state: dict[int, list[Any]] = {}

    def check(self, target_info: Any, now: float) -> int:
        """One pass over the registered targets; returns how many were newly flagged."""
        tab = self.table
        flagged = 0
        seen = set()
        for t, entry in enumerate(target_info):
            if entry is None:
                continue
            w, rank = entry
            if w.role == "prefill" or w.status != "ready":
                continue
            seen.add(t)
            st = self._state.get(t)
            if st is None or st[0] is not w:
                st = self._state[t] = [w, -1, 0.0, 0, False]
            polled_at = tab.get(t, COL_POLLED_AT)
            if polled_at < 0:
                st[2:] = [0.0, 0, False]  # load unknown: no evidence either way
                continue
            if polled_at == st[1]:
                continue  # no new poll since the last pass
            st[1] = polled_at
            reported = tab.get(t, COL_POLLED_RUNNING) + tab.get(t, COL_POLLED_WAITING)
            held = tab.in_flight(t)
            if held <= reported:
                st[2:] = [0.0, 0, False]
                continue
            if st[3] == 0:
                st[2] = now
            st[3] += 1
            if not st[4] and st[3] >= self.min_polls and now - st[2] >= self.timeout:
                st[4] = True
                flagged += 1
                name = target_label(w, rank)
                log.warning(
                    "reconcile: router holds %d requests on %s but the engine has reported "
                    "fewer (last: %d) for %.0f s over %d polls",
                    held,
                    name,
                    reported,
                    now - st[2],
                    st[3],
                )
                if self.on_mismatch is not None:
                    self.on_mismatch(name)
        for t in [t for t in self._state if t not in seen]:
            del self._state[t]
        return flagged
