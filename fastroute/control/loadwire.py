"""The typed reading of a ``/v1/loads`` answer: one msgspec decode of only the fields the router reads.

A fleet's polls land on the event loop that also serves requests (issue 52): ``json.loads`` of
the whole answer followed by ``dict.get`` walks over every rank (once for the table, once for the
engine gauges, once for ``max_running_requests``) held the loop ~0.3 ms per 8-rank poll. Here the
answer is decoded straight into :class:`V1Loads` (unknown fields skipped in C, every count
range-checked by the decoder), so what the Monitor does per rank is reading attributes.

The typed reading covers well-formed answers only: any value the old defensive reading would
have treated specially (a bool, a float count, a negative or huge number, a string, NaN, an entry
that is not an object) makes :func:`decode` return None, and the Monitor reads that answer with
``json.loads`` and the defensive parsers, so both paths give the same rows
(``tests/unit/test_loadwire.py`` holds them to it).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

# Polled counts are written to int64 table cells and summed over ranks: the same bound as
# monitor._COUNT_LIMIT and engine._LIMIT.
_LIMIT = 1 << 62
Count = Annotated[int, msgspec.Meta(ge=0, lt=_LIMIT)]
Number = Annotated[float, msgspec.Meta(ge=0, lt=float(_LIMIT))]


class Disagg(msgspec.Struct, gc=False):
    """The ``disaggregation`` section (include=disagg): the queue and transfer fields read."""

    prefill_prealloc_queue_reqs: Count | None = None
    prefill_inflight_queue_reqs: Count | None = None
    decode_prealloc_queue_reqs: Count | None = None
    decode_transfer_queue_reqs: Count | None = None
    decode_retracted_queue_reqs: Count | None = None
    kv_transfer_speed_gb_s: Number | None = None
    kv_transfer_latency_ms: Number | None = None


class RankEntry(msgspec.Struct, gc=False):
    """One rank's entry of ``loads``: only what the table, flow control and smg's gauges read."""

    dp_rank: Count | None = None
    num_running_reqs: Count | None = None
    num_waiting_reqs: Count | None = None
    num_total_reqs: Count | None = None
    num_used_tokens: Count | None = None
    max_total_num_tokens: Count | None = None
    token_usage: Number | None = None
    num_waiting_uncached_tokens: Count | None = None
    max_running_requests: Count | None = None
    gen_throughput: Number | None = None
    cache_hit_rate: Number | None = None
    disaggregation: Disagg | None = None


class V1Loads(msgspec.Struct, gc=False):
    """A whole ``/v1/loads`` answer as the router reads it."""

    loads: list[RankEntry] | None = None


_DECODER = msgspec.json.Decoder(V1Loads)


def decode(body: bytes) -> V1Loads | None:
    """``/v1/loads`` body -> its typed reading, or None when it needs the defensive reading
    (not JSON msgspec accepts, another shape, or any value out of the ranges above)."""
    try:
        return _DECODER.decode(body)
    except msgspec.MsgspecError:
        return None


# One parsed rank entry, as monitor.RankLoad: (running, waiting, used tokens, max tokens or -1,
# uncached tokens or -1, decode prealloc + retracted queue requests).
RankLoad = tuple[int, int, int, int, int, int]


def rank_loads(doc: V1Loads) -> list[tuple[int | None, RankLoad | None]]:
    """What ``monitor.parse_v1_loads`` gives for the same answer read as JSON."""
    out: list[tuple[int | None, RankLoad | None]] = []
    for e in doc.loads or ():
        waiting = e.num_waiting_reqs
        running = e.num_running_reqs
        if running is None and e.num_total_reqs is not None:
            running = max(e.num_total_reqs - (waiting or 0), 0)
        tokens = e.num_used_tokens
        mx = e.max_total_num_tokens
        usage = e.token_usage
        if mx and usage is not None and usage <= 1:
            tokens = max(tokens or 0, int(usage * mx))
        d = e.disaggregation
        queued = 0 if d is None else (d.decode_prealloc_queue_reqs or 0) + (d.decode_retracted_queue_reqs or 0)
        uncached = e.num_waiting_uncached_tokens
        load = None
        if running is not None and tokens is not None:
            load = (
                running,
                waiting or 0,
                tokens,
                -1 if mx is None else mx,
                -1 if uncached is None else uncached,
                queued,
            )
        out.append((e.dp_rank, load))
    return out


def max_running(doc: V1Loads) -> dict[int | None, int]:
    """Each rank's ``max_running_requests`` (0 when not reported); a later entry of a rank wins."""
    return {e.dp_rank: e.max_running_requests or 0 for e in doc.loads or ()}


def _sum(*parts: float | None) -> float | None:
    known = [x for x in parts if x is not None]
    return float(sum(known)) if known else None


def engine_rows(doc: V1Loads) -> list[tuple[str, dict[str, float]]]:
    """What ``engine.engine_rows(doc, "v1_loads")`` gives for the same answer read as JSON."""
    out: list[tuple[str, dict[str, float]]] = []
    for i, e in enumerate(doc.loads or ()):
        values: dict[str, float] = {}
        for key, v in (
            ("num_running_reqs", e.num_running_reqs),
            ("num_waiting_reqs", e.num_waiting_reqs),
            ("token_usage", e.token_usage),
            ("gen_throughput", e.gen_throughput),
            ("cache_hit_rate", e.cache_hit_rate),
        ):
            if v is not None:
                values[key] = float(v)
        d = e.disaggregation
        if d is not None:
            for name, v in (
                ("smg_engine_pd_kv_transfer_latency_ms", _sum(d.kv_transfer_latency_ms)),
                ("smg_engine_pd_kv_transfer_speed_gb_s", _sum(d.kv_transfer_speed_gb_s)),
                (
                    "smg_engine_pd_prefill_queue_reqs",
                    _sum(d.prefill_prealloc_queue_reqs, d.prefill_inflight_queue_reqs),
                ),
                ("smg_engine_pd_decode_queue_reqs", _sum(d.decode_prealloc_queue_reqs, d.decode_transfer_queue_reqs)),
            ):
                if v is not None:
                    values[name] = v
        if values:
            out.append((str(e.dp_rank) if e.dp_rank is not None else str(i), values))
    return out
