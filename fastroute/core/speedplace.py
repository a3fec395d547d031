"""Speed-aware placement (``--speed-aware``, issue 47) over the fits of ``core/speed.py``.

A decode (or regular) pick goes to the rank whose server would give this request the lowest
predicted time per output token once it is added: the server's fitted step at its busiest rank's
new count (``max(busiest, requests(rank) + 1)``; DP attention steps every rank of a server at
the pace of its busiest), fewer in-flight requests then fewer polled tokens breaking ties, then
the kernel's RNG. KV fit and decode input demand narrow the candidates first, as they do for
cache_aware (``_policy.narrow``). When the candidates' servers run at the same speed (their
fitted steps at a common batch within ``EQUAL_WITHIN`` of each other), or a server has no fit
yet, the group's own policy decides: on equal hardware the placement is exactly the policy's,
e.g. least_requests'.

Prefill ranks (``SpeedPrefill``) are picked by predicted queueing time: the input tokens booked
or polled as waiting there, plus this request's, over the rank's measured rate; ranks without a
rate yet leave the pick to the group's policy.

``shadow`` dispatches the group's own pick and counts whether the speed-aware one agreed
(``SpeedBook.placements``); ``on`` dispatches the speed-aware pick.

SLO targets (headers ``x-slo-ttft-ms`` / ``x-slo-tpot-ms``, llm-d's spelling; read by the relay and
handed over as ``SpeedBook.next_slo``): under ``on``, among the ranks predicted to meet a TPOT
target the decode pick is the one of the highest predicted time per token (the tightest fit,
leaving the faster ranks' headroom to stricter requests), and among the prefill ranks predicted
to meet a TTFT target the one of the longest predicted queueing; when none is, the usual pick
(best effort) or, with ``--speed-slo-unmet refuse``, the relay refuses the request before any
pick (``SpeedBook.slo_feasible``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from fastroute.core import _ledger, _policy, reference
from fastroute.core.speed import SpeedBook
from fastroute.core.table import COL_POLLED_AT, COL_POLLED_TOKENS
from fastroute.names import MODE_CODE

SLO_MARGIN = 0.9  # a rank meets a target when predicted within this share of it (fit error, jitter)
RESERVE = 0.9  # requests without a target stop this much below a target held on the server
EQUAL_WITHIN = 0.08  # servers whose steps differ less than this are the same hardware
REF_BATCH = 8  # the batch at which servers' speeds are compared


class SpeedDecode:
    """The speed-aware policy of a decode or regular group (module docstring)."""

    __slots__ = ("kernel", "inner", "book", "tab", "on", "rows", "kv_fit", "demand", "weight", "kv_reserve", "rng")

    def __init__(
        self,
        kernel: _ledger.Picker,
        inner: Any,
        book: SpeedBook,
        tab: np.ndarray,
        mode: str,
        kv_fit: str,
        demand: str,
        weight: int,
        kv_reserve: int,
        seed: int,
    ) -> None:
        self.kernel = kernel
        self.inner = inner  # the group's own policy (the kernel, or the demand shadow)
        self.book = book
        self.tab = tab
        self.on = mode == "on"
        self.rows = np.zeros(0, dtype=np.int64)
        self.kv_fit = MODE_CODE[kv_fit]
        self.demand = MODE_CODE[demand]
        self.weight = int(weight)
        self.kv_reserve = int(kv_reserve)
        self.rng = reference.Rng(seed)
        book.decoders.append(self)

    def set_targets(self, targets: Sequence[int], names: Sequence[str], rows: np.ndarray) -> None:
        self.rows = rows
        self.book.set_decoders(id(self), targets, names)
        on_targets = getattr(self.inner, "set_targets", None)
        if on_targets is not None:
            on_targets(targets, names, rows)

    def acquire(
        self, tokens: int = 0, key: bytes | None = None, meta: Any = None, out_tokens: int = 0
    ) -> _ledger.Lease | None:
        t = self.pick(tokens, out_tokens)
        counts = self.book.placements
        if t is None:
            counts["fallback"] += 1
            return self.inner.acquire(tokens, key, meta, out_tokens)
        if self.on:
            return self.kernel.book_target(t, tokens)
        lease = self.inner.acquire(tokens, key, meta, out_tokens)
        if lease is not None:
            counts["agree" if lease.target == t else "disagree"] += 1
        return lease

    def candidates(self, tokens: int, out_tokens: int) -> list[int]:
        cands: Any = self.rows
        if self.kv_fit == 2 or self.demand == 2:
            need = tokens + out_tokens + self.kv_reserve
            kv = 2 if self.kv_fit == 2 else 0
            dm = 2 if self.demand == 2 else 0
            choose = _policy.narrow(self.tab, self.rows, tokens, need, kv, dm, self.weight)[0]
            if choose is not None:
                cands = choose
        return [int(t) for t in cands if reference._row_eligible(self.tab, t)]

    def _lines(self, live: list[int]) -> tuple[dict[str, tuple[float, float]], dict[str, int]] | None:
        """Each candidate server's fitted line and busiest rank's count (None: one not measured)."""
        book = self.book
        ratio = book.slope_ratio()
        lines: dict[str, tuple[float, float]] = {}
        busiest: dict[str, int] = {}
        for t in live:
            s = book.server(t)
            if s is None:
                return None
            if s not in lines:
                f = book.steps.get(s)
                ln = f.line(ratio) if f is not None else None
                if ln is None:
                    return None
                lines[s] = ln
                busiest[s] = book.busiest(s)
        return lines, busiest

    def _tpots(self, live: list[int]) -> list[tuple[float, int]] | None:
        """(predicted seconds per output token once added, target) of each candidate."""
        got = self._lines(live)
        if got is None:
            return None
        lines, busiest = got
        out = []
        for t in live:
            s = self.book.server(t)
            assert s is not None
            a, b = lines[s]
            out.append((a + b * max(busiest[s], reference.requests(self.tab, t) + 1), t))
        return out

    def meets_tpot(self, target: float) -> bool | None:
        """Whether some rank is predicted to meet a TPOT target (None: not known yet)."""
        live = self.candidates(0, 0)
        tp = self._tpots(live) if live else None
        if tp is None:
            return None
        return any(p <= target * SLO_MARGIN for p, _ in tp)

    def _slo_pick(self, tokens: int, out_tokens: int, target: float) -> int | None:
        live = self.candidates(tokens, out_tokens)
        tp = self._tpots(live) if live else None
        if tp is None:
            return None
        book = self.book
        fit = [
            (p, -reference.requests(self.tab, t), t)
            for p, t in tp
            if p <= target * SLO_MARGIN and p <= book.tightest(book.server(t) or "")
        ]
        if not fit:
            self.book.count_slo("tpot", "best_effort")
            return None
        self.book.count_slo("tpot", "placed")
        return max(fit)[2]  # the tightest fit (then the fewest requests)

    def pick(self, tokens: int = 0, out_tokens: int = 0) -> int | None:
        """The speed-aware target, or None when the group's own policy decides."""
        book, tab = self.book, self.tab
        tpot = book.next_slo[1]
        if tpot > 0 and self.on:
            t = self._slo_pick(tokens, out_tokens, tpot)
            if t is not None:
                return t
        live = self.candidates(tokens, out_tokens)
        got = self._lines(live) if live else None
        if got is None:
            return None  # no candidate, or a server not measured yet
        lines, busiest = got
        at_ref = [a + b * REF_BATCH for a, b in lines.values()]
        if max(at_ref) <= min(at_ref) * (1.0 + EQUAL_WITHIN):
            return None  # the same hardware: the group's policy, exactly
        best, best_key, ties = -1, (0, 0.0, 0, 0), 0
        for t in live:
            s = book.server(t)
            assert s is not None
            a, b = lines[s]
            n = reference.requests(tab, t)
            step = a + b * max(busiest[s], n + 1)
            # a rank whose step would break a target held there comes after every other; a
            # request without a target also leaves headroom for the next one with a target
            breaks = 1 if step > book.tightest(s) * (1.0 if tpot > 0 else RESERVE) else 0
            key = (breaks, round(step, 9), n, int(tab[t, COL_POLLED_TOKENS]) if tab[t, COL_POLLED_AT] >= 0 else 0)
            if best < 0 or key < best_key:
                best, best_key, ties = t, key, 1
            elif key == best_key:
                ties += 1
                if self.rng.below(ties) == 0:
                    best = t
        return best

    def predicted_tpot(self, t: int) -> float | None:
        """Seconds per output token a request placed on ``t`` now would see."""
        s = self.book.server(t)
        if s is None:
            return None
        n = reference.requests(self.tab, t)
        return self.book.predict(s, max(self.book.busiest(s), n + 1))


class SpeedPrefill:
    """The speed-aware policy of a prefill group: least predicted queueing time."""

    __slots__ = ("kernel", "inner", "book", "tab", "on", "rows")

    def __init__(self, kernel: _ledger.Picker, inner: Any, book: SpeedBook, tab: np.ndarray, mode: str) -> None:
        self.kernel = kernel
        self.inner = inner
        self.book = book
        self.tab = tab
        self.on = mode == "on"
        self.rows = np.zeros(0, dtype=np.int64)
        book.prefiller = self

    def set_targets(self, targets: Sequence[int], names: Sequence[str], rows: np.ndarray) -> None:
        self.rows = rows
        self.book.set_prefills(targets, names)
        on_targets = getattr(self.inner, "set_targets", None)
        if on_targets is not None:
            on_targets(targets, names, rows)

    def _waits(self, tokens: int) -> list[tuple[float, int]] | None:
        """(predicted queueing + compute seconds, target) of each eligible rank (None: one has
        no rate yet)."""
        tab, book = self.tab, self.book
        out = []
        for row in self.rows:
            t = int(row)
            if not reference._row_eligible(tab, t):
                continue
            r = book.rate(t)
            if r is None:
                return None
            out.append(((reference.pending(tab, t) + tokens) / r, t))
        return out

    def meets_ttft(self, tokens: int, target: float) -> bool | None:
        w = self._waits(tokens)
        if not w:
            return None
        return any(p <= target for p, _ in w)

    def pick(self, tokens: int) -> int | None:
        tab, book = self.tab, self.book
        ttft = book.next_slo[0]
        if ttft > 0 and self.on:
            w = self._waits(tokens)
            if w:
                fit = [(p, -reference.requests(tab, t), t) for p, t in w if p <= ttft]
                book.count_slo("ttft", "placed" if fit else "best_effort")
                if fit:
                    return max(fit)[2]
        rates: list[tuple[int, float]] = []
        for row in self.rows:
            t = int(row)
            if not reference._row_eligible(tab, t):
                continue
            r = book.rate(t)
            if r is None:
                return None
            rates.append((t, r))
        if not rates:
            return None
        lo, hi = min(r for _, r in rates), max(r for _, r in rates)
        if hi <= lo * (1.0 + EQUAL_WITHIN):
            return None
        best, best_key = -1, (0.0, 0)
        for t, r in rates:
            key = ((reference.pending(tab, t) + tokens) / r, reference.requests(tab, t))
            if best < 0 or key < best_key:
                best, best_key = t, key
        return best

    def acquire(
        self, tokens: int = 0, key: bytes | None = None, meta: Any = None, out_tokens: int = 0
    ) -> _ledger.Lease | None:
        t = self.pick(tokens)
        counts = self.book.placements
        if t is None:
            counts["prefill_fallback"] += 1
            return self.inner.acquire(tokens, key, meta, out_tokens)
        if self.on:
            return self.kernel.book_target(t, tokens)
        lease = self.inner.acquire(tokens, key, meta, out_tokens)
        if lease is not None:
            counts["prefill_agree" if lease.target == t else "prefill_disagree"] += 1
        return lease
