"""The simulated engine's DP controller: which rank a request lands on when the router names none.

A model of SGLang 0.5.23's ``DataParallelController`` (``--load-balance-method``), written from
its behaviour, not its code:

* ``routed_dp_rank`` (or ``data_parallel_rank``) in the body always wins, whatever the method,
  and books nothing.
* ``auto`` resolves by role: a PD prefill follows the bootstrap room, everything else is
  ``round_robin`` (SGLang's ``handle_load_balance_method``).
* ``follow_bootstrap_room``: ``room % dp_size`` (a request without a room goes to rank 0, where
  SGLang asserts).
* ``round_robin``: one counter cycling over the ranks.
* ``total_requests`` / ``total_tokens``: argmin over a per-rank budget (requests; tokens, ties
  broken by requests, then the lowest rank), which the dispatch then books: +1 request and
  +``input_tokens`` on the chosen rank. Before a dispatch (once per batch) the budget is
  refreshed from the schedulers' published load snapshots, at most every 20 ms
  (``lb_refresh_ms``, times ``time_scale``); a rank whose snapshot has not changed since the
  last refresh keeps its booked values, so bookings persist until the rank publishes again.

What a scheduler publishes (``running + waiting`` requests, KV used + queued tokens) and when
(a prefill rank at the start and the end of each compute; a decode every
``load_snapshot_interval`` steps and when idle, as SGLang's ``--load-snapshot-publish-interval``)
is the engines' part: they call ``publish``.
"""

from __future__ import annotations

from collections.abc import Callable

LB_METHODS = ("auto", "round_robin", "follow_bootstrap_room", "total_requests", "total_tokens", "cache_oracle")
_LOAD_AWARE = ("total_requests", "total_tokens")


def resolve_method(method: str, role: str) -> str:
    """The method a server of ``role`` (prefill | decode | regular) really runs."""
    if method not in LB_METHODS:
        raise ValueError(f"load_balance_method must be one of {', '.join(LB_METHODS)}, not {method!r}")
    if method == "auto":
        return "follow_bootstrap_room" if role == "prefill" else "round_robin"
    if method == "cache_oracle" and role != "prefill":
        # A benchmark's upper bound, not an SGLang method: the prefill engine places each
        # request knowing every rank's cache and queue (engine.PrefillEngine.place).
        raise ValueError("load_balance_method cache_oracle is for prefill servers only")
    return method


class DpController:
    """Rank choice for one simulated server; ``clock`` gives the (event-loop) time in seconds."""

    def __init__(
        self, method: str, role: str, dp_size: int, clock: Callable[[], float], refresh_s: float = 0.02
    ) -> None:
        self.method = resolve_method(method, role)
        self.n = dp_size
        self.clock = clock
        self.refresh_s = refresh_s
        self._rr = 0
        # The controller's budget (what it dispatches by) ...
        self.requests = [0] * dp_size
        self.tokens = [0] * dp_size
        self._seen = [0] * dp_size  # snapshot sequence number last read per rank
        self._last_refresh: float | None = None
        # ... and what the schedulers last published: (sequence, requests, tokens) per rank.
        self._pub = [(0, 0, 0)] * dp_size
        self.refreshes = 0
        self.placed = [0] * dp_size  # requests this controller placed (no rank in the body)

    @property
    def load_aware(self) -> bool:
        return self.method in _LOAD_AWARE

    def publish(self, rank: int, requests: int, tokens: int) -> None:
        """Scheduler ``rank`` publishes its load snapshot (a new sequence number each time)."""
        seq = self._pub[rank][0] + 1
        self._pub[rank] = (seq, requests, tokens)

    def refresh(self) -> bool:
        """Read the published snapshots into the budget unless the last read is under
        ``refresh_s`` old; unchanged ranks keep their booked values. True if it read."""
        now = self.clock()
        if self._last_refresh is not None and now - self._last_refresh < self.refresh_s:
            return False
        self._last_refresh = now
        self.refreshes += 1
        for r, (seq, reqs, toks) in enumerate(self._pub):
            if seq == self._seen[r]:
                continue
            self._seen[r] = seq
            self.requests[r] = reqs
            self.tokens[r] = toks
        return True

    def pick(self, rank: int | None, room: int | None, input_tokens: int, refresh: bool = True) -> int:
        """The rank of one request; ``refresh=False`` for the items of a batch after the first
        (SGLang refreshes once per batch)."""
        if rank is not None:
            return rank  # the router's choice; range-checked by the engine
        m = self.method
        if m == "round_robin":
            r = self._rr
            self._rr = (r + 1) % self.n
        elif m == "follow_bootstrap_room":
            r = (room or 0) % self.n
        else:
            if refresh:
                self.refresh()
            if m == "total_requests":
                reqs = self.requests
                r = reqs.index(min(reqs))
            else:
                toks, reqs = self.tokens, self.requests
                r = min(range(self.n), key=lambda i: (toks[i], reqs[i]))
            self.requests[r] += 1
            self.tokens[r] += input_tokens
        self.placed[r] += 1
        return r

    def pick_many(self, items: list[tuple[int | None, int | None, int]]) -> list[int]:
        """Ranks of a batch's items ``(rank, room, input_tokens)``: one refresh, then each item."""
        if self.load_aware and any(rank is None for rank, _, _ in items):
            self.refresh()
        return [self.pick(rank, room, n, refresh=False) for rank, room, n in items]
