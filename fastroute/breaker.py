"""Circuit breakers, one per target, for this proxy process (protocol.md 7.3).

Owns the consecutive success/failure counters of every target row and the
closed -> open -> half-open -> closed state machine. The state is published to
the shared target table (``table.set_circuit``: 0 closed, 1 open, 2 half-open)
so the compiled picks skip open targets without asking this module anything.

What counts (a deliberate departure from the peers, which count 503/429 too):

* failure: connect error, upstream timeout, status 500 / 502 / 504, a stream
  that broke before its end;
* neutral (counted nowhere): 408 / 429 / 503 -- backpressure from a live
  worker says nothing about it being broken, and must not take a busy fleet
  out of rotation;
* success: any other completed response (a 400 is the client's fault).

Costs: ``success`` on a closed circuit with no failure streak is two list
reads and one dict increment; everything else runs only on failures and at
the sweep (``tick``), which moves open circuits to half-open after the
timeout. Counters are plain lists sized to the table's capacity, indexed by
target row; ``reset`` clears a row when the registry gives it to another
worker.
"""
from __future__ import annotations

import logging
from typing import Any, Callable

log = logging.getLogger("fastroute.breaker")

CLOSED, OPEN, HALF_OPEN = 0, 1, 2
_STATE_NAME = ("closed", "open", "half_open")

# Upstream statuses that are failures / neither failure nor success.
FAILURE_STATUSES = frozenset({500, 502, 504})
NEUTRAL_STATUSES = frozenset({408, 429, 503})


class Breakers:
    """Per-target circuit breakers (see module docstring)."""

    def __init__(self, table: Any, capacity: int, failure_threshold: int = 10,
                 success_threshold: int = 3, timeout_secs: float = 60.0, enabled: bool = True,
                 stats: Any = None, name_of: Callable[[int], str | None] | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        import time

        self.table = table
        self.clock = clock or time.monotonic
        self.enabled = bool(enabled)
        # Disabled: counters still run (for the outcome metric) but never open.
        self.failure_threshold = max(1, int(failure_threshold)) if enabled else 1 << 62
        self.success_threshold = max(1, int(success_threshold))
        self.timeout = float(timeout_secs)
        self.stats = stats
        self.name_of = name_of
        n = int(capacity)
        self.state = [CLOSED] * n
        self.fails = [0] * n            # consecutive failures
        self.oks = [0] * n              # consecutive successes (counted in half-open only)
        self.opened_at = [0.0] * n
        self.open: set[int] = set()     # rows waiting for their half-open time
        # Prebuilt metric keys per row: (name, "success") / (name, "failure"), refreshed by reset().
        self._ok_key: list[tuple[str, str] | None] = [None] * n
        self._fail_key: list[tuple[str, str] | None] = [None] * n

    # -- outcomes (data path) -------------------------------------------------
    def success(self, t: int) -> None:
        st = self.stats
        if st is not None:
            key = self._ok_key[t] or self._keys(t)[0]
            d = st.cb_outcomes
            d[key] = d.get(key, 0) + 1
        if self.state[t] == CLOSED:
            if self.fails[t]:
                self.fails[t] = 0
            return
        if self.state[t] == HALF_OPEN:
            self.oks[t] += 1
            if self.oks[t] >= self.success_threshold:
                self._move(t, CLOSED)
        # OPEN: a response that was already in flight when the circuit opened;
        # it proves nothing about the probe window, so it changes nothing.

    def failure(self, t: int) -> None:
        now = self.clock()
        st = self.stats
        if st is not None:
            key = self._fail_key[t] or self._keys(t)[1]
            d = st.cb_outcomes
            d[key] = d.get(key, 0) + 1
        s = self.state[t]
        if s == HALF_OPEN:
            self.opened_at[t] = now
            self._move(t, OPEN)
            return
        if s == OPEN:
            return
        self.fails[t] += 1
        if self.fails[t] >= self.failure_threshold:
            self.opened_at[t] = now
            self._move(t, OPEN)

    def status(self, t: int, status: int) -> None:
        """Record an upstream response by its status (see module docstring)."""
        if status in FAILURE_STATUSES:
            self.failure(t)
        elif status not in NEUTRAL_STATUSES:
            self.success(t)

    # -- control plane ----------------------------------------------------------
    def tick(self, now: float | None = None) -> None:
        """Open circuits whose timeout passed go half-open (called by the proxy's sweep)."""
        if not self.open:
            return
        if now is None:
            now = self.clock()
        due = [t for t in self.open if now - self.opened_at[t] >= self.timeout]
        for t in due:
            self._move(t, HALF_OPEN)

    def reset(self, t: int) -> None:
        """Row ``t`` now belongs to another worker (or none): forget its history."""
        if t >= len(self.state):
            return
        self.open.discard(t)
        self.state[t] = CLOSED
        self.fails[t] = 0
        self.oks[t] = 0
        self._ok_key[t] = None
        self._fail_key[t] = None
        if self.table is not None:
            self.table.set_circuit(t, CLOSED)

    def _keys(self, t: int) -> tuple[tuple[str, str], tuple[str, str]]:
        name = (self.name_of(t) if self.name_of is not None else None) or str(t)
        ok, bad = (name, "success"), (name, "failure")
        self._ok_key[t] = ok
        self._fail_key[t] = bad
        return ok, bad

    def _move(self, t: int, to: int) -> None:
        frm = self.state[t]
        if frm == to:
            return
        self.state[t] = to
        if to == OPEN:
            self.open.add(t)
        else:
            self.open.discard(t)
        self.oks[t] = 0
        if to == CLOSED:
            self.fails[t] = 0
        if self.table is not None:
            self.table.set_circuit(t, to)
        name = (self.name_of(t) if self.name_of is not None else None) or str(t)
        st = self.stats
        if st is not None:
            key = (name, _STATE_NAME[frm], _STATE_NAME[to])
            st.cb_transitions[key] = st.cb_transitions.get(key, 0) + 1
        if to == OPEN:
            log.warning("circuit of %s opened after %d consecutive failures", name, self.fails[t])
        else:
            log.info("circuit of %s is %s", name, _STATE_NAME[to])
