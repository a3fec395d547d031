"""Circuit breakers, one per target, shared by every proxy process (protocol.md 7.3).

Owns the closed -> open -> half-open -> closed state machine of every target
row. Its state lives in the shared target table, not in this process, so
``--workers N`` proxy processes run ONE breaker per target:

* ``COL_CIRCUIT``      state (0 closed, 1 open, 2 half-open); the compiled
  picks read it and skip open targets;
* ``COL_CB_FAILS``     consecutive failures, added to atomically by all processes;
* ``COL_CB_OKS``       successes since the circuit went half-open;
* ``COL_CB_OPENED_AT`` when it last opened (monotonic clock, microseconds;
  CLOCK_MONOTONIC is system-wide, so every process compares the same clock).

Every transition is a compare-and-swap on ``COL_CIRCUIT``: of all processes
that see a threshold crossed (or a timeout pass, in ``tick``, which runs in
every process), exactly one wins the swap, and only the winner clears the
counters, logs and counts the transition. Outcome and transition metrics stay
per process (``Stats``); the exporter sums processes.

What counts (a deliberate departure from the peers, which count 503/429 too):

* failure: connect error, upstream timeout, status 500 / 502 / 504, a stream
  that broke before its end;
* neutral (counted nowhere): 408 / 429 / 503 -- backpressure from a live
  worker says nothing about it being broken, and must not take a busy fleet
  out of rotation;
* success: any other completed response (a 400 is the client's fault).

Costs: ``success`` on a closed circuit with no failure streak is one compiled
call doing two atomic loads and no write, plus one dict increment; everything
else runs only on failures, in half-open, and at the sweep (``tick``), whose
scan for open rows is one compiled call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from fastroute.core import _ledger
from fastroute.core.table import COL_CB_FAILS, COL_CB_OKS, COL_CB_OPENED_AT, COL_CIRCUIT, NCOLS
from fastroute.names import CIRCUIT_CLOSED as CLOSED
from fastroute.names import CIRCUIT_HALF_OPEN as HALF_OPEN
from fastroute.names import CIRCUIT_OPEN as OPEN
from fastroute.names import CIRCUIT_STATE_NAMES as _STATE_NAME

log = logging.getLogger("fastroute.breaker")

# Upstream statuses that are failures / neither failure nor success.
FAILURE_STATUSES = frozenset({500, 502, 504})
NEUTRAL_STATUSES = frozenset({408, 429, 503})

_US = 1_000_000  # clock seconds -> the integer microseconds kept in COL_CB_OPENED_AT


class Breakers:
    """Per-target circuit breakers over the shared table (see module docstring).

    ``table`` is a :class:`fastroute.core.table.TargetTable` (or anything with an
    ``array`` of shape (rows, NCOLS) int64); ``None`` keeps the state in a
    private array, for a single process without a table.
    """

    __slots__ = (
        "table",
        "clock",
        "stats",
        "name_of",
        "cells",
        "_ok_key",
        "_fail_key",
        "enabled",
        "failure_threshold",
        "success_threshold",
        "_timeout_us",
        "capacity",
        "timeout",
    )

    def __init__(
        self,
        table: Any,
        capacity: int,
        failure_threshold: int = 10,
        success_threshold: int = 3,
        timeout_secs: float = 60.0,
        enabled: bool = True,
        stats: Any = None,
        name_of: Callable[[int], str | None] | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.table = table
        self.clock = clock or time.monotonic
        self.enabled = bool(enabled)
        # Disabled: counters still run (for the outcome metric) but never open.
        self.failure_threshold = max(1, int(failure_threshold)) if enabled else 1 << 62
        self.success_threshold = max(1, int(success_threshold))
        self.timeout = float(timeout_secs)
        self._timeout_us = int(self.timeout * _US)
        self.stats = stats
        self.name_of = name_of
        self.cells = table.cells if table is not None else _ledger.Cells(np.zeros((int(capacity), NCOLS), np.int64))
        n = min(int(capacity), int(self.cells.rows))
        self.capacity = n
        # Prebuilt metric keys per row: (name, "success") / (name, "failure"), dropped by
        # forget_names() (and reset()) when the row may belong to another worker.
        self._ok_key: list[tuple[str, str] | None] = [None] * n
        self._fail_key: list[tuple[str, str] | None] = [None] * n

    # -- outcomes (data path) -------------------------------------------------
    def success(self, t: int) -> None:
        st = self.stats
        if st is not None:
            key = self._ok_key[t] or self._keys(t)[0]
            d = st.cb_outcomes
            d[key] = d.get(key, 0) + 1
        # Closed (the common case): the compiled call also ends a failure streak.
        s = self.cells.ok_closed(t)
        if s == HALF_OPEN and self.cells.add(t, COL_CB_OKS, 1) >= self.success_threshold:
            # Several processes may cross the threshold; the swap picks one.
            self._move(t, HALF_OPEN, CLOSED)
        # OPEN: a response that was already in flight when the circuit opened;
        # it proves nothing about the probe window, so it changes nothing.

    def failure(self, t: int) -> None:
        st = self.stats
        if st is not None:
            key = self._fail_key[t] or self._keys(t)[1]
            d = st.cb_outcomes
            d[key] = d.get(key, 0) + 1
        cells = self.cells
        s = cells.load(t, COL_CIRCUIT)
        if s == CLOSED:
            n = cells.add(t, COL_CB_FAILS, 1)
            if n < self.failure_threshold:
                return
        elif s == OPEN:
            return
        # Opening (from closed past the threshold, or any failure in half-open).
        # The time goes in before the swap: a tick in another process that sees
        # OPEN must see this opening's time, not the previous one. A loser's
        # store is harmless: the winner stored (about) the same time.
        cells.store(t, COL_CB_OPENED_AT, int(self.clock() * _US))
        self._move(t, s, OPEN)

    def status(self, t: int, status: int) -> None:
        """Record an upstream response by its status (see module docstring).  Called for every
        response: the common case (< 500, not backpressure) is tested first."""
        if status < 500 and status not in NEUTRAL_STATUSES:
            self.success(t)
        elif status in FAILURE_STATUSES:
            self.failure(t)

    # -- control plane ----------------------------------------------------------
    def tick(self, now: float | None = None) -> None:
        """Open circuits whose timeout passed go half-open (called by every process's sweep;
        the swap makes each move happen once)."""
        cells = self.cells
        rows = cells.rows_where(COL_CIRCUIT, OPEN)
        if not rows:
            return
        now_us = int((self.clock() if now is None else now) * _US)
        for t in rows:
            if t < self.capacity and now_us - cells.load(t, COL_CB_OPENED_AT) >= self._timeout_us:
                self._move(t, OPEN, HALF_OPEN)

    def reset(self, t: int) -> None:
        """Row ``t`` now belongs to another worker (or none): forget its history."""
        if t >= self.capacity:
            return
        cells = self.cells
        # State first: a failure racing with the reset then counts against the new worker.
        cells.store(t, COL_CIRCUIT, CLOSED)
        cells.store(t, COL_CB_FAILS, 0)
        cells.store(t, COL_CB_OKS, 0)
        cells.store(t, COL_CB_OPENED_AT, 0)
        self._ok_key[t] = None
        self._fail_key[t] = None

    # -- reading (metrics, tests) ------------------------------------------------
    def forget_names(self, t: int) -> None:
        """Row ``t`` may now belong to another worker: drop this process's cached metric labels.
        The shared breaker cells need no reset here: ``TargetTable.alloc`` zeroes them when it
        hands the row out, and a process (re)starting must not wipe circuits other processes
        opened."""
        if t < len(self._ok_key):
            self._ok_key[t] = None
            self._fail_key[t] = None

    def state_of(self, t: int) -> int:
        """The shared circuit state of row ``t`` (CLOSED / OPEN / HALF_OPEN)."""
        return self.cells.load(t, COL_CIRCUIT)

    def failures(self, t: int) -> int:
        """The shared consecutive-failure count of row ``t``."""
        return self.cells.load(t, COL_CB_FAILS)

    def _keys(self, t: int) -> tuple[tuple[str, str], tuple[str, str]]:
        name = (self.name_of(t) if self.name_of is not None else None) or str(t)
        ok, bad = (name, "success"), (name, "failure")
        self._ok_key[t] = ok
        self._fail_key[t] = bad
        return ok, bad

    def _move(self, t: int, frm: int, to: int) -> bool:
        """Swap the state of ``t`` from ``frm`` to ``to``; True if this process made the move.

        Only the winner touches the counters, so each is cleared once per transition:
        the half-open success count on entering or leaving half-open, the failure
        streak on closing (it stays while open so the log line can report it).
        """
        cells = self.cells
        if not cells.cas(t, COL_CIRCUIT, frm, to):
            return False
        if to == HALF_OPEN or frm == HALF_OPEN:
            # Entering half-open: a probe another process counts between the swap
            # and this clear is lost (closing waits one probe longer, never
            # shorter). Leaving it: a straggler counted after the clear is wiped
            # by the next entry, so a new probe window always starts from zero.
            cells.store(t, COL_CB_OKS, 0)
        if to == CLOSED:
            cells.store(t, COL_CB_FAILS, 0)
        name = (self.name_of(t) if self.name_of is not None else None) or str(t)
        st = self.stats
        if st is not None:
            key = (name, _STATE_NAME[frm], _STATE_NAME[to])
            st.cb_transitions[key] = st.cb_transitions.get(key, 0) + 1
        if to == OPEN:
            if frm == CLOSED:
                log.warning("circuit of %s opened after %d consecutive failures", name, cells.load(t, COL_CB_FAILS))
            else:
                log.warning("circuit of %s reopened: a half-open probe failed", name)
        else:
            log.info("circuit of %s is %s", name, _STATE_NAME[to])
        return True
