"""Each server's measured speed (issue 47): online fits of a decode server's step time against
its batch, and of a prefill rank's compute rate, fed by what the router relays.

Decode step (``StepFit``, one per decode or regular server): under DP attention one step serves
every rank of the server and the busiest rank sets its length, so the fit is
``step(n) = a + b * n`` with ``n`` the in-flight requests of the server's busiest rank (the
router's own count: the x the placement predicts at). The samples are inter-token gaps of the
streams the router relays, measured where the worker's bytes arrive (``StreamMeter``): per
upstream read, the time since the stream's previous read over the SSE events the read holds (a
read that carries several events after a hold counts each once, so buffering and coalescing do
not bias it), and per window of ``WINDOW`` reads the median of those samples (a stalled read,
e.g. a slow client holding the relay, is an outlier the median drops). A non-streaming answer
gives one sample: its decode time over its output tokens.

Fit: weighted least squares over exponentially decayed sufficient statistics (half-life
``half_life`` seconds of wall time), so an old regime fades; a run of ``SHIFT_RUN`` samples all
more than ``SHIFT_RATIO`` off the prediction on the same side is a change of regime (a server
that slowed down) and forgets the history at once, so the fit follows within a few windows.
When the batch has not varied enough to separate ``a`` from ``b``, the slope is taken from the
other servers' fits as a ratio ``b / a`` (``DEFAULT_SLOPE_RATIO`` when none has one) and only the
level is fitted.

Prefill (``RateFit``, one per prefill target): uncached tokens per busy second, from the
LoadStat counters a rank pushes (``total_prefill_uncached_tokens``, ``total_prefill_busy_us``)
where it pushes them, else from the time to the prefill's answer over its input tokens for the
requests that found the rank idle (a queued one's wait is not compute).

``SpeedBook`` holds them for one router process, maps targets to their servers, and answers the
placement (``core/speedplace.py``), the metrics and ``/get_loads``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from fastroute.core import reference

HALF_LIFE_S = 20.0
WINDOW = 8  # reads per step sample of a stream
MIN_SAMPLES = 3  # samples before a fit predicts (a change of regime keeps it predicting)
MIN_VARIANCE = 0.25  # batch variance (requests^2) below which the slope is borrowed
SHIFT_RATIO = 1.15
SHIFT_RUN = 4
FORGET = 0.02  # what is left of the history after a change of regime
HOLD_MARGIN = 0.9  # the share of a TPOT target a server's predicted step must stay within
# The simulator's seed calibration (27.3 ms base, 2.0 ms per request): the slope a server with
# too little batch variety borrows when no server has a slope of its own yet.
DEFAULT_SLOPE_RATIO = 2.0 / 27.3


class StepFit:
    """``step(n) = a + b n`` over decayed (n, seconds) samples (module docstring)."""

    __slots__ = ("w", "sn", "snn", "sy", "sny", "t", "run", "samples", "shifts", "half_life")

    def __init__(self, half_life: float = HALF_LIFE_S) -> None:
        self.half_life = half_life
        self.w = self.sn = self.snn = self.sy = self.sny = 0.0
        self.t = 0.0
        self.run = 0  # consecutive samples off the prediction on one side (+ above, - below)
        self.samples = 0
        self.shifts = 0

    def _scale(self, f: float) -> None:
        self.w *= f
        self.sn *= f
        self.snn *= f
        self.sy *= f
        self.sny *= f

    def observe(self, n: float, y: float, now: float, ratio: float = DEFAULT_SLOPE_RATIO) -> None:
        if y <= 0 or n < 0:
            return
        if self.w > 0 and now > self.t:
            self._scale(0.5 ** ((now - self.t) / self.half_life))
        self.t = max(self.t, now)
        p = self.predict(n, ratio)
        if p is not None:
            side = 1 if y > p * SHIFT_RATIO else -1 if y * SHIFT_RATIO < p else 0
            if side == 0 or (self.run and (self.run > 0) != (side > 0)):
                self.run = side
            else:
                self.run += side
            if abs(self.run) >= SHIFT_RUN:
                self._scale(FORGET)
                self.run = 0
                self.shifts += 1
        self.w += 1.0
        self.sn += n
        self.snn += n * n
        self.sy += y
        self.sny += n * y
        self.samples += 1

    def own_line(self) -> tuple[float, float] | None:
        """(a, b) from this server's samples alone, when the batch varied enough."""
        if self.samples < MIN_SAMPLES or self.w <= 0:
            return None
        mn, my = self.sn / self.w, self.sy / self.w
        var = self.snn / self.w - mn * mn
        if var < MIN_VARIANCE:
            return None
        b = (self.sny / self.w - mn * my) / var
        if b < 0:  # a step does not shrink with its batch: noise around a flat line
            b = 0.0
        a = my - b * mn
        if a <= 0:
            return None
        return a, b

    def line(self, ratio: float = DEFAULT_SLOPE_RATIO) -> tuple[float, float] | None:
        """(a, b), the slope borrowed as ``ratio * a`` when this server's own is not known."""
        own = self.own_line()
        if own is not None:
            return own
        if self.samples < MIN_SAMPLES or self.w <= 0:
            return None
        mn, my = self.sn / self.w, self.sy / self.w
        a = my / (1.0 + ratio * mn)
        return a, ratio * a

    def predict(self, n: float, ratio: float = DEFAULT_SLOPE_RATIO) -> float | None:
        ln = self.line(ratio)
        return None if ln is None else ln[0] + ln[1] * n


class RateFit:
    """Tokens per second of one prefill rank over decayed (tokens, seconds) samples."""

    __slots__ = ("tokens", "secs", "t", "half_life", "samples", "last")

    def __init__(self, half_life: float = HALF_LIFE_S) -> None:
        self.half_life = half_life
        self.tokens = self.secs = 0.0
        self.t = 0.0
        self.samples = 0
        self.last: tuple[int, int] | None = None  # the last pushed (uncached, busy_us) counters

    def observe(self, tokens: float, secs: float, now: float) -> None:
        if tokens <= 0 or secs <= 0:
            return
        if now > self.t and self.secs > 0:
            f = 0.5 ** ((now - self.t) / self.half_life)
            self.tokens *= f
            self.secs *= f
        self.t = max(self.t, now)
        self.tokens += tokens
        self.secs += secs
        self.samples += 1

    def counters(self, uncached: int, busy_us: int, now: float) -> None:
        """A pushed LoadStat's cumulative counters: the delta since the last one is a sample."""
        last = self.last
        self.last = (uncached, busy_us)
        if last is not None and uncached >= last[0] and busy_us > last[1]:
            self.observe(uncached - last[0], (busy_us - last[1]) / 1e6, now)

    @property
    def rate(self) -> float | None:
        return self.tokens / self.secs if self.samples and self.secs > 0 else None


def server_of(name: str) -> str:
    """The server of a target name (``url@rank`` under --dp-aware, else the url)."""
    head, sep, tail = name.rpartition("@")
    return head if sep and tail.isdigit() else name


class SpeedBook:
    """The fits of one router process over the target table ``tab`` (module docstring)."""

    def __init__(self, tab: np.ndarray, half_life: float = HALF_LIFE_S, clock: Callable[[], float] = time.monotonic):
        self.tab = tab
        self.half_life = half_life
        self.clock = clock
        self.steps: dict[str, StepFit] = {}
        self.rates: dict[int, RateFit] = {}
        self._server: dict[int, str] = {}  # decode/regular target -> its server
        self._ranks: dict[str, list[int]] = {}  # server -> its targets
        self._groups: dict[int, tuple[Sequence[int], Sequence[str]]] = {}  # each decoding group's
        self._names: dict[int, str] = {}  # prefill target -> its name
        # SLO targets (seconds; 0 = none) of the request being placed now, set by the relay just
        # before its picks (one event loop: nothing runs between), and the policies that answer
        # whether any rank is predicted to meet them
        self.next_slo: tuple[float, float] = (0.0, 0.0)
        self.refuse_unmet = False  # --speed-slo-unmet refuse
        self.decoders: list[Any] = []
        self.prefiller: Any = None
        # per class (ttft, tpot): met, missed (measured), refused, best_effort (no rank predicted
        # to meet it), placed (a rank predicted to meet it chosen)
        self.slo_counts: dict[tuple[str, str], int] = {}
        # TPOT targets of the requests in flight on each server that were placed where they were
        # predicted to be met: a later pick does not push the server's step past the tightest
        self._held: dict[str, list[float]] = {}
        # speed-aware picks: agree/disagree with the policy's (shadow), fallback (left to it)
        self.placements = dict.fromkeys(
            ("agree", "disagree", "fallback", "prefill_agree", "prefill_disagree", "prefill_fallback"), 0
        )

    # -- targets -----------------------------------------------------------------
    def set_decoders(self, group: int, targets: Sequence[int], names: Sequence[str]) -> None:
        """The targets of decoding group ``group`` (the PD decode group and the regular one
        both call this; a server's ranks are the union)."""
        self._groups[group] = (list(targets), list(names))
        ranks: dict[str, list[int]] = {}
        server: dict[int, str] = {}
        for ts, ns in self._groups.values():
            for t, name in zip(ts, ns):
                s = server_of(name)
                ranks.setdefault(s, []).append(int(t))
                server[int(t)] = s
        self._ranks, self._server = ranks, server
        for s in list(self.steps):
            if s not in ranks:
                del self.steps[s]

    def set_prefills(self, targets: Sequence[int], names: Sequence[str]) -> None:
        self._names = {int(t): n for t, n in zip(targets, names)}
        for t in list(self.rates):
            if t not in self._names:
                del self.rates[t]

    def pushes(self, t: int) -> bool:
        """Whether prefill target ``t`` pushes LoadStat counters (then TTFB is not sampled)."""
        f = self.rates.get(t)
        return f is not None and f.last is not None

    def server(self, t: int) -> str | None:
        return self._server.get(t)

    def busiest(self, server: str) -> int:
        """In-flight requests of the server's busiest rank (the batch the fit's x counts)."""
        tab = self.tab
        return max((reference.requests(tab, t) for t in self._ranks.get(server, ())), default=0)

    # -- samples -----------------------------------------------------------------
    def slope_ratio(self) -> float:
        """b / a pooled over the servers with a slope of their own (the default else)."""
        num = den = 0.0
        for f in self.steps.values():
            own = f.own_line()
            if own is not None:
                num += own[1] * f.w
                den += own[0] * f.w
        return num / den if den > 0 else DEFAULT_SLOPE_RATIO

    def observe_step(self, server: str, n: float, secs: float) -> None:
        f = self.steps.get(server)
        if f is None:
            if server not in self._ranks:
                return  # a server that left
            f = self.steps[server] = StepFit(self.half_life)
        f.observe(n, secs, self.clock(), self.slope_ratio())

    def observe_prefill(self, t: int, tokens: float, secs: float) -> None:
        if t in self._names:
            self.rates.setdefault(t, RateFit(self.half_life)).observe(tokens, secs, self.clock())

    def prefill_counters(self, t: int, uncached: int, busy_us: int) -> None:
        if t in self._names:
            self.rates.setdefault(t, RateFit(self.half_life)).counters(uncached, busy_us, self.clock())

    def meter(self, target: int, slo: tuple[float, float] = (0.0, 0.0), t0: float = 0.0) -> StreamMeter:
        """The step meter of one stream relayed from decode target ``target`` (``slo``: its
        targets, checked when it ends)."""
        return StreamMeter(self, target, slo, t0)

    def observe_whole(self, target: int, output_tokens: int, secs: float) -> None:
        """A non-streaming answer: its decode time over its output tokens, at the load now."""
        s = self._server.get(target)
        if output_tokens > 1 and s is not None and secs > 0:
            self.observe_step(s, self.busiest(s), secs / output_tokens)

    def idle_prefill(self, t: int) -> bool:
        """Prefill target ``t`` holds only the request just booked and pushes no counters: the
        time to its answer is compute (a TTFB sample)."""
        return t >= 0 and reference.requests(self.tab, t) == 1 and not self.pushes(t)

    def count_slo(self, cls: str, result: str) -> None:
        key = (cls, result)
        self.slo_counts[key] = self.slo_counts.get(key, 0) + 1

    def hold_slo(self, target: int, tpot: float) -> str | None:
        """Protect a TPOT target just placed on decode target ``target`` if the server is
        predicted to meet it now; the server to hand back to ``drop_slo`` (None: not held)."""
        s = self._server.get(target)
        if s is None or tpot <= 0:
            return None
        p = self.predict(s, self.busiest(s))
        if p is None or p > tpot * HOLD_MARGIN:
            return None
        self._held.setdefault(s, []).append(tpot)
        return s

    def drop_slo(self, server: str, tpot: float) -> None:
        held = self._held.get(server)
        if held:
            try:
                held.remove(tpot)
            except ValueError:
                pass
            if not held:
                del self._held[server]

    def tightest(self, server: str) -> float:
        """The tightest TPOT target held on ``server`` (inf: none)."""
        held = self._held.get(server)
        return min(held) * HOLD_MARGIN if held else float("inf")

    def slo_feasible(self, tokens: int, ttft: float, tpot: float) -> bool:
        """False when the fits predict that no rank meets a target (unknown counts as met)."""
        if tpot > 0:
            for d in self.decoders:
                if d.meets_tpot(tpot) is False:
                    return False
        prefill = self.prefiller
        return not (ttft > 0 and prefill is not None and prefill.meets_ttft(tokens, ttft) is False)

    # -- answers -----------------------------------------------------------------
    def predict(self, server: str, n: float, ratio: float | None = None) -> float | None:
        f = self.steps.get(server)
        if f is None:
            return None
        return f.predict(n, self.slope_ratio() if ratio is None else ratio)

    def rate(self, t: int) -> float | None:
        f = self.rates.get(t)
        return None if f is None else f.rate

    def report(self) -> dict[str, Any]:
        """What /get_loads shows: per decode server its fitted line and the step predicted at its
        busiest rank's load now, per prefill target its measured tokens/s."""
        ratio = self.slope_ratio()
        servers = {}
        for s in sorted(self._ranks):
            f = self.steps.get(s)
            ln = f.line(ratio) if f is not None else None
            n = self.busiest(s)
            servers[s] = {
                "busiest_rank_requests": n,
                "step_seconds": None if ln is None else ln[0] + ln[1] * n,
                "base_seconds": None if ln is None else ln[0],
                "per_request_seconds": None if ln is None else ln[1],
                "own_slope": f is not None and f.own_line() is not None,
                "samples": 0 if f is None else f.samples,
                "regime_changes": 0 if f is None else f.shifts,
            }
        prefill = {}
        for t, name in sorted(self._names.items()):
            prefill[name] = {"tokens_per_second": self.rate(t)}
        slo: dict[str, dict[str, int]] = {}
        for (cls, result), n in sorted(self.slo_counts.items()):
            slo.setdefault(cls, {})[result] = n
        return {
            "decode_servers": servers,
            "prefill_ranks": prefill,
            "placements": dict(self.placements),
            "slo": slo,
        }


class StreamMeter:
    """The step samples of one relayed stream (module docstring): ``read(data, now)`` per
    upstream read of the decode answer, ``end(now)`` when it ends."""

    __slots__ = ("book", "target", "server", "last", "gaps", "loads", "first", "events", "slo", "t0")

    def __init__(self, book: SpeedBook, target: int, slo: tuple[float, float] = (0.0, 0.0), t0: float = 0.0) -> None:
        self.book = book
        self.target = target
        self.slo = slo  # (ttft, tpot) targets in seconds, 0 = none
        self.t0 = t0  # when the request arrived (TTFT counts from here)
        self.first = -1.0  # when the first token event arrived
        self.events = 0
        self.server = book.server(target)
        self.last = -1.0
        self.gaps: list[float] = []
        self.loads: list[int] = []

    def read(self, data: bytes, now: float) -> None:
        if self.server is None:
            return
        k = data.count(b"data:")
        if k <= 0:
            return
        self.events += k
        last = self.last
        self.last = now
        if last < 0:
            self.first = now
            return  # the first token's wait is the prefill's and the transfer's, not a step
        self.gaps.append((now - last) / k)
        self.loads.append(self.book.busiest(self.server))
        if len(self.gaps) >= WINDOW:
            self._emit()

    def _emit(self) -> None:
        gaps, loads = self.gaps, self.loads
        if len(gaps) >= 3:
            assert self.server is not None
            self.book.observe_step(self.server, sum(loads) / len(loads), float(np.median(gaps)))
        self.gaps, self.loads = [], []

    def end(self) -> None:
        if self.server is not None:
            self._emit()
        ttft, tpot = self.slo
        book = self.book
        if ttft > 0 and self.first >= 0:
            book.count_slo("ttft", "met" if self.first - self.t0 <= ttft else "missed")
        if tpot > 0 and self.events > 2:
            # the last event is [DONE] on SGLang's streams: the tokens' gaps span events - 2
            per = (self.last - self.first) / (self.events - 2)
            book.count_slo("tpot", "met" if per <= tpot else "missed")
