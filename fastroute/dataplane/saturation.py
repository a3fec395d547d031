"""Saturation from what the engines report: whether every rank a request could use is full.

Read by :class:`~fastroute.dataplane.flowcontrol.FlowAdmission` (with
``--priority-scheduler-enabled`` or ``--worker-overload-shed``) from the shared target table,
which holds each rank's last load: pushed by the engine's KV-event stream where it publishes
loads (control/kvevents.py), polled otherwise (control/monitor.py). A rank is saturated when

* a regular or decode rank: its waiting requests are at or above
  ``--worker-overload-waiting-requests`` (smg's default 8), or its KV usage (used / max tokens)
  at or above ``--worker-overload-token-usage`` (0.8);
* a prefill rank: its waiting requests are at or above the same count, or its waiting uncached
  prompt tokens at or above ``--prefill-overload-uncached-tokens`` (0: not used).

:meth:`capacity` is the scheduler's capacity as smg takes it: the sum of the ranks' reported
``max_running_requests``, divided among the ``--workers N`` proxy processes (each admits on
its own).

A rank without a load (never polled, poll failed) or unhealthy is not counted either way: an
unknown load never holds traffic back, an unhealthy rank is not one a request could use. A
stage is saturated when it has usable ranks and all of them are saturated; under
PD the request needs both stages, so either being saturated holds it. When only some of a
stage's usable ranks are saturated, its group picks among the others (``Group.restrict`` swaps
the candidate rows the policy scans): nothing is admitted to a saturated rank while another
could take it, on either leg under PD. The verdict (and the groups' candidates) are kept for
``_FRESH`` seconds of loop time: loads change at most once per poll or push, and a burst of
admissions then reads the table once. Every start of a request asks for the verdict first
(FlowAdmission), so its first pick never uses candidates older than that.
"""

from __future__ import annotations

from typing import Any

_FRESH = 0.01  # seconds a verdict is reused


class Saturation:
    """Whether the ranks a request could use are all past a threshold (module docstring)."""

    def __init__(self, loop: Any, registry: Any, upstreams: Any, config: Any) -> None:
        self._loop = loop
        self._processes = max(1, int(config.workers))
        self._registry = registry  # its table: the ranks' loads
        self._upstreams = upstreams  # its groups: the ranks a request could use
        self._roles = ("prefill", "decode") if config.pd_disaggregation else ("regular",)
        waiting = config.worker_overload_waiting_requests
        usage = config.worker_overload_token_usage
        self.waiting = int(waiting) if waiting is not None else 8
        self.usage = float(usage) if usage is not None else 0.8
        self.uncached = int(config.prefill_overload_uncached_tokens)
        self._at = -1.0
        self._verdict = False
        self._cap_at = -1.0
        self._cap: int | None = None

    def saturated(self) -> bool:
        now = self._loop.time()
        if now - self._at < _FRESH:
            return self._verdict
        self._at = now
        verdict = False
        for role in self._roles:
            if self.stage_saturated(role):
                verdict = True
        self._verdict = verdict
        return verdict

    def capacity(self) -> int | None:
        """The running-batch limits (max_running_requests) of the usable ranks of the stage that
        runs a request to its end (decode under PD), summed; None unless every one reports one
        (the scheduler then falls back to --max-concurrent-requests)."""
        now = self._loop.time()
        if now - self._cap_at < _FRESH:
            return self._cap
        self._cap_at = now
        table = self._registry.table
        total = 0
        for t in self._upstreams.group(self._roles[-1]).targets:
            healthy, polled_at, _, _, _, _, max_running = table.rank_load(t)
            if healthy != 1:
                continue
            if max_running <= 0 or polled_at < 0:
                total = 0
                break
            total += max_running
        # Each of --workers N proxy processes admits on its own: its share of the engines' batch.
        self._cap = max(1, total // self._processes) if total else None
        return self._cap

    def forget(self) -> None:
        """Read the table again at the next question (the sweep's pass)."""
        self._at = -1.0
        self._cap_at = -1.0

    def stage_saturated(self, role: str) -> bool:
        """Whether every usable rank of ``role`` is saturated; when only some are, the role's
        group picks among the others until the next look (``Group.restrict``)."""
        table = self._registry.table
        group = self._upstreams.group(role)
        prefill = role == "prefill"
        usable = 0
        full: set[int] = set()
        for t in group.targets:
            load = table.rank_load(t)
            if load[0] != 1:
                continue
            usable += 1
            if self.rank_saturated(load, prefill):
                full.add(t)
        if full and len(full) < usable:
            group.restrict([t for t in group.targets if t not in full])
        else:
            group.restrict(None)  # none saturated, or all: then the request waits (the gate)
        return usable > 0 and len(full) == usable

    def rank_saturated(self, load: tuple[int, ...], prefill: bool) -> bool:
        _, polled_at, waiting, tokens, max_tokens, uncached, _ = load
        if polled_at < 0:
            return False  # unknown load: never held back for it
        if self.waiting > 0 and waiting >= self.waiting:
            return True
        if prefill:
            return self.uncached > 0 and uncached >= self.uncached
        return 0.0 < self.usage < 1.0 and max_tokens > 0 and tokens >= self.usage * max_tokens
