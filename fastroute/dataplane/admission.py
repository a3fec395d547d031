"""Admission control: the concurrency limit and its FIFO wait queue (protocol.md 7.4).

Owns how many inference requests this process lets through at once
(``--max-concurrent-requests``, -1 or 0 = unlimited) and the requests waiting
for a slot (``--queue-size``, ``--queue-timeout-secs``).

Invariants:

* ``active`` counts admitted requests; each admitted request calls ``leave()``
  exactly once (the proxy ties it to the same once-only ending that releases
  its leases).
* Under the limit, ``try_enter()`` is one comparison and one increment: no queue
  entry, no task, no timer.
* Over the limit a waiter is an entry in an ordered dict (FIFO, O(1) removal
  when its client goes away). A freed slot is handed to the oldest waiter
  directly, so ``active`` never dips below the limit while someone waits and a
  newcomer cannot overtake the queue.
* Expiry is checked by the proxy's periodic sweep (``expire``); every waiter
  has the same timeout, so only the head of the queue needs looking at.

Rate (``--rate-limit-tokens-per-second R``, smg's token bucket): a request also
needs a bucket token to be admitted. The bucket holds at most
``--max-concurrent-requests`` tokens (R when that is unlimited), refills at R
per second and is never refunded, so R is admitted requests per second with that
burst. A request without a token waits in the same FIFO queue (429 when full,
408 past ``--queue-timeout-secs``); one timer, not one per waiter, wakes the
queue when the next token is due. Without the flag none of this code runs:
``try_enter`` is the plain slot check.
"""

from __future__ import annotations

import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from fastroute.dataplane.telemetry import NULL_TELEMETRY, Telemetry


class Waiter:
    """One queued request: ``start()`` when admitted, ``expired()`` past the queue timeout."""

    __slots__ = ("start", "expired", "deadline")

    def __init__(self, start: Callable[[], None], expired: Callable[[], None], deadline: float) -> None:
        self.start = start
        self.expired = expired
        self.deadline = deadline


class Admission:
    """Concurrency limit + FIFO queue (see module docstring)."""

    __slots__ = (
        "enabled",
        "limit",
        "queue_size",
        "active",
        "rate",
        "capacity",
        "tokens",
        "_at",
        "queue_timeout",
        "_wake",
        "loop",
        "tel",
        "queue",
    )

    def __init__(
        self,
        limit: int = -1,
        queue_size: int = 100,
        queue_timeout: float = 60.0,
        loop: Any = None,
        tel: Telemetry = NULL_TELEMETRY,
        rate: float | None = None,
    ) -> None:
        self.enabled = limit > 0 or bool(rate)
        self.limit = int(limit) if limit > 0 else sys.maxsize
        self.rate = float(rate) if rate else 0.0
        if self.rate:
            if loop is None:
                raise ValueError("a rate limit needs the event loop (its clock and wake-up timer)")
            self.capacity = float(limit) if limit > 0 else max(1.0, self.rate)
            self.tokens = self.capacity
            self._at = loop.time()
            self._wake: Any = None
        self.queue_size = max(0, int(queue_size))
        self.queue_timeout = float(queue_timeout)
        self.loop = loop
        self.tel = tel  # counts the rate limit's verdicts
        self.active = 0
        self.queue: OrderedDict[Waiter, None] = OrderedDict()

    def _count(self, result: str) -> None:
        self.tel.rate_limit(result)

    def try_enter(self) -> bool:
        """Take a slot now if one is free and nobody waits (the per-request fast path); under a
        rate limit, also a bucket token."""
        if self.active < self.limit and not self.queue:
            if self.rate:
                self._refill()
                if self.tokens < 1.0:
                    return False
                self.tokens -= 1.0
            self.active += 1
            if self.enabled:
                self._count("allowed")
            return True
        return False

    def _refill(self) -> None:
        now = self.loop.time()
        t = self.tokens + (now - self._at) * self.rate
        self.tokens = t if t < self.capacity else self.capacity
        self._at = now

    def _admit(self) -> None:
        """Hand free slots (and tokens, when rated) to the oldest waiters."""
        q = self.queue
        while q and self.active < self.limit:
            if self.rate:
                self._refill()
                if self.tokens < 1.0:
                    if self._wake is None:
                        self._wake = self.loop.call_later((1.0 - self.tokens) / self.rate, self._on_wake)
                    return
                self.tokens -= 1.0
            w, _ = q.popitem(last=False)
            self.active += 1
            self._count("dequeued")
            # Not inline: leave() runs inside another request's ending, and the
            # next request must not start (and maybe end) inside that call stack.
            if self.loop is not None:
                self.loop.call_soon(w.start)
            else:
                w.start()

    def _on_wake(self) -> None:
        self._wake = None
        self._admit()

    def wait(self, start: Callable[[], None], expired: Callable[[], None], now: float) -> Waiter | None:
        """Queue a request that found no slot; None when the queue is full (reject it).

        The waiter is later either ``start``-ed (its slot already taken) or
        ``expired``-ed; the caller drops it with ``cancel(waiter)``.
        """
        if len(self.queue) >= self.queue_size:
            self._count("rejected")
            return None
        w = Waiter(start, expired, now + self.queue_timeout)
        self.queue[w] = None
        self._count("queued")
        if self.rate and self.active < self.limit:
            self._admit()  # waiting for a token, not a slot: arm the wake-up timer
        return w

    def enqueue(self, proto: Any, req: Any, path: bytes, meta: Any) -> bool:
        """Flow control's entry for a request ``try_enter`` declined (dataplane/flowcontrol.py);
        the plain queue takes none: False, and the caller queues it here with ``wait``."""
        return False

    def tenant_key(self, auth: bytes | None) -> bool:
        """Whether ``auth`` is a --tenant-api-key (asked only when --api-key did not match;
        flow control's, the plain admission knows none)."""
        return False

    def leave(self) -> None:
        """An admitted request ended: its slot goes to the oldest waiter, if any."""
        self.active -= 1
        if self.queue and self.active < self.limit:
            self._admit()

    def cancel(self, w: Waiter) -> bool:
        """Drop a waiter (its client went away); False if it already left the queue."""
        try:
            del self.queue[w]
        except KeyError:
            return False
        return True

    def expire(self, now: float) -> int:
        """Time out waiters past their deadline (FIFO + one timeout: only the head can be due)."""
        n = 0
        q = self.queue
        while q:
            w = next(iter(q))
            if w.deadline > now:
                break
            del q[w]
            n += 1
            self._count("timeout")
            w.expired()
        return n
