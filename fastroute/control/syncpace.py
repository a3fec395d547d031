"""A replica-sync tick rate that follows the change rate (``--replica-sync``; see control/replica.py).

The sync loop wakes every ``--replica-sync-interval-ms`` as before, but runs the Redis script
only when something may have changed: this replica's own counts (found without Redis: the
compiled pass over its rows that builds the delta), a peer's (a changing tick publishes its id
on ``fastroute:{replicas}:wake``, which every replica listens to on a second connection), a
reset, or an estimate of the others' placements still to age. Otherwise the tick is a
heartbeat only, and heartbeats space out while nothing changes: the interval doubled at each
quiet tick, up to a third of ``--replica-ttl-ms``, so a quiet replica is still beating twice or
more within the TTL its peers drop it after. Any change (here or at a peer) returns to the
configured interval at once. While the wake channel is not subscribed (connecting, Redis
gone) every tick runs the script: without wakes, slowing down would delay what peers publish.

A subscribed connection only reads, so one the network drops without a reset (a NAT or load
balancer forgetting an idle flow, a partition) would never fail: wakes would stop and a quiet
replica would see its peers' changes only at its heartbeats. The listener therefore sends a
PING on it whenever it has read nothing for a liveness period (the sync interval, at least,
and at most a second or a sixth of the TTL); a PING unanswered for another period ends the
connection: ticks run every interval again until the channel is subscribed anew (the first such
loss is a WARNING, later ones INFO).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger("fastroute.replica")

WAKE_CHANNEL = "fastroute:{replicas}:wake"
LISTEN_BACKOFF = (0.1, 5.0)  # first and last wait before subscribing again after a failure


class WakeSilent(Exception):
    """The wake connection answered no PING within the liveness period."""


class Pace:
    """When the next Redis tick is due, and the wake channel's listener."""

    def __init__(self, client: Any, own_id: str, interval: float, ttl: float) -> None:
        self._client = client
        self._own = own_id.encode()
        self._interval = interval
        self._cap = max(interval, ttl / 3)
        self._quiet = 0.0  # the spacing of heartbeats while nothing changes (0: not quiet)
        self._next = 0.0  # loop time the next heartbeat is due
        self._woken = True
        self.listening = False  # the wake channel is subscribed
        self._task: asyncio.Task | None = None
        # read nothing this long: PING; that long again without an answer: the link is dead
        self._alive_every = max(interval, min(1.0, ttl / 6))
        self._silent_logged = False

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._listen(), name="replica sync wakes")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        self.listening = False

    def due(self, now: float) -> bool:
        """A Redis tick is needed now although this replica's counts did not change."""
        return self._woken or not self.listening or now >= self._next

    def ticked(self, now: float, changed: bool) -> None:
        """A Redis tick ran; ``changed``: it sent or applied something."""
        self._woken = False
        if changed:
            self._quiet = 0.0
        else:
            self._quiet = min(self._cap, max(self._interval, 2 * self._quiet))
        self._next = now + self._quiet

    async def _listen(self) -> None:
        """Set the wake flag on every other replica's changing tick; resubscribe on failure."""
        wait = LISTEN_BACKOFF[0]
        while True:
            pubsub = self._client.pubsub()
            try:
                await pubsub.subscribe(WAKE_CHANNEL)
                pinged = False  # a PING is unanswered
                while True:
                    msg = await pubsub.get_message(timeout=self._alive_every)
                    if msg is None:
                        if pinged:
                            raise WakeSilent(f"no answer to a PING within {self._alive_every:.2f} s")
                        await asyncio.wait_for(pubsub.ping(), self._alive_every)  # (at most once a period)
                        pinged = True
                        continue
                    pinged = False  # whatever came, the link carries it
                    if msg["type"] == "subscribe":
                        self.listening = True
                        self._woken = True  # changes made while not listening
                        wait = LISTEN_BACKOFF[0]
                    elif msg["type"] == "message" and msg["data"] != self._own:
                        self._woken = True
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis gone: tick at the interval until subscribed again
                if self.listening:
                    if isinstance(exc, (WakeSilent, asyncio.TimeoutError)) and not self._silent_logged:
                        self._silent_logged = True
                        log.warning(
                            "replica sync: the wake channel's connection went silent (%s); ticking every "
                            "interval until it is subscribed again (later losses are logged at INFO)",
                            exc,
                        )
                    else:
                        log.info("replica sync: wake channel lost (%s); ticking every interval", exc)
                self.listening = False
                self._woken = True
                await asyncio.sleep(wait)
                wait = min(2 * wait, LISTEN_BACKOFF[1])
            finally:
                self.listening = False
                await pubsub.aclose()
