"""The typed /v1/loads reading (control/loadwire.py) gives the rows of the defensive JSON reading.

The Monitor reads a poll's answer as ``loadwire.decode(body) or json.loads(body)``; whichever
path an answer takes, the table rows (``parse_v1_loads``), flow control's capacities
(``max_running_of``) and smg's engine gauges (``engine_rows``) must be those of ``json.loads``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from fastroute.control import loadwire
from fastroute.control.engine import engine_rows
from fastroute.control.monitor import max_running_of, parse_v1_loads
from fastroute.sim.engine import SimParams
from fastroute.sim.http import HttpConnection
from fastroute.sim.server import SimWorker

# Answers recorded in the other monitor tests, well-formed and malformed.
RECORDED: list[Any] = [
    {
        "loads": [
            {"num_running_reqs": r, "num_waiting_reqs": r % 2, "num_used_tokens": 1000 * (r + 1)} for r in range(4)
        ]
    },
    {"loads": "x"},
    [1, 2],
    {"loads": [{"dp_rank": 0, "num_running_reqs": 1}]},
    {
        "loads": [
            {
                "dp_rank": 1,
                "num_total_reqs": 4,
                "num_waiting_reqs": 1,
                "num_used_tokens": 9.0,
                "max_total_num_tokens": None,
            }
        ]
    },
    {"loads": [{"dp_rank": True, "num_running_reqs": -1, "num_used_tokens": 3}]},
    {
        "loads": [
            {
                "dp_rank": 1,
                "num_running_reqs": 0,
                "num_used_tokens": 3,
                "max_total_num_tokens": 1000,
                "token_usage": "x",
                "disaggregation": "nope",
            }
        ]
    },
    {"loads": [{"dp_rank": 2, "num_running_reqs": 0, "max_total_num_tokens": 1000, "token_usage": 0.25}]},
    {
        "loads": [
            {
                "dp_rank": 0,
                "num_running_reqs": 1,
                "num_waiting_reqs": 2,
                "num_used_tokens": 500,
                "max_total_num_tokens": 1000,
                "num_waiting_uncached_tokens": 777,
                "max_running_requests": 48,
                "gen_throughput": 12.5,
                "cache_hit_rate": 0.5,
                "disaggregation": {
                    "decode_prealloc_queue_reqs": 1,
                    "decode_retracted_queue_reqs": 2,
                    "kv_transfer_speed_gb_s": 3.5,
                },
            }
        ]
    },
    {"loads": None},
    {"loads": [None, 3, {"dp_rank": 0, "num_running_reqs": 1, "num_used_tokens": 2}]},
    {
        "loads": [
            {"dp_rank": 0, "num_running_reqs": 1, "num_used_tokens": 2, "token_usage": 7.0, "max_total_num_tokens": 10}
        ]
    },
    {"loads": [{"dp_rank": 0, "num_running_reqs": 1 << 62, "num_used_tokens": 2}]},
    {"loads": [{"dp_rank": 0, "num_running_reqs": 1, "num_used_tokens": 2, "gen_throughput": float("inf")}]},
    {"loads": [{"dp_rank": 0, "num_running_reqs": 1, "num_used_tokens": 2, "disaggregation": None}]},
]


def read(body: bytes) -> Any:
    """What the Monitor does with a 200 answer of /v1/loads."""
    return loadwire.decode(body) or json.loads(body)


def assert_same(body: bytes) -> bool:
    """Both readings of ``body`` give the same rows; True when the typed one was taken."""
    old, new = json.loads(body), read(body)
    assert parse_v1_loads(new) == parse_v1_loads(old)
    assert max_running_of(new) == max_running_of(old)
    assert engine_rows(new, "v1_loads") == engine_rows(old, "v1_loads")
    return isinstance(new, loadwire.V1Loads)


def test_recorded_answers_give_the_same_rows_either_way():
    typed = [assert_same(json.dumps(doc).encode()) for doc in RECORDED]
    # the well-formed ones take the typed path, the malformed ones the defensive one
    assert typed == [True, False, False, True, False, False, False, True, True, True, False, True, False, False, True]


def test_a_simulated_servers_answer_takes_the_typed_path():
    async def body() -> list[bytes]:
        w = SimWorker("prefill", SimParams(dp_size=8, time_scale=0.001), "127.0.0.1")
        await w.start()
        try:
            conn = HttpConnection("127.0.0.1", w.port)
            out = []
            for q in ("include=core,disagg", "include=core", "include=all"):
                status, _, got = await conn.request("GET", "/v1/loads?" + q)
                assert status == 200
                out.append(got)
            return out
        finally:
            await w.stop()

    for got in asyncio.run(body()):
        assert assert_same(got)
        rows = parse_v1_loads(read(got))
        assert [r for r, _ in rows] == list(range(8)) and all(load is not None for _, load in rows)


_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-5, max_value=1 << 63),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, 1, 2, 7, 1000, 0.25, 1.0, "3", [], {}]),
)
_ENTRY_KEYS = [
    "dp_rank",
    "num_running_reqs",
    "num_waiting_reqs",
    "num_total_reqs",
    "num_used_tokens",
    "max_total_num_tokens",
    "token_usage",
    "num_waiting_uncached_tokens",
    "max_running_requests",
    "gen_throughput",
    "cache_hit_rate",
    "utilization",
]
_DISAGG_KEYS = [
    "prefill_prealloc_queue_reqs",
    "prefill_inflight_queue_reqs",
    "decode_prealloc_queue_reqs",
    "decode_transfer_queue_reqs",
    "decode_retracted_queue_reqs",
    "kv_transfer_speed_gb_s",
    "kv_transfer_latency_ms",
]
_DISAGG = st.one_of(st.none(), st.integers(), st.dictionaries(st.sampled_from(_DISAGG_KEYS), _VALUES))
_ENTRY = st.one_of(
    st.integers(),
    st.fixed_dictionaries({}, optional={**{k: _VALUES for k in _ENTRY_KEYS}, "disaggregation": _DISAGG}),
)
# Mostly well-formed entries (so that the typed path is exercised), some with garbage.
_GOOD = st.integers(min_value=0, max_value=5000)
_GOOD_ENTRY = st.fixed_dictionaries(
    {"dp_rank": st.integers(min_value=0, max_value=8), "num_running_reqs": _GOOD, "num_used_tokens": _GOOD},
    optional={
        "num_waiting_reqs": _GOOD,
        "num_total_reqs": _GOOD,
        "max_total_num_tokens": _GOOD,
        "token_usage": st.floats(min_value=0, max_value=2),
        "num_waiting_uncached_tokens": _GOOD,
        "max_running_requests": _GOOD,
        "gen_throughput": st.floats(min_value=0, max_value=1e6),
        "disaggregation": st.dictionaries(st.sampled_from(_DISAGG_KEYS), _GOOD),
    },
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(_GOOD_ENTRY, _ENTRY), max_size=6), st.booleans())
def test_any_answer_gives_the_same_rows_either_way(entries, wrapped):
    doc: Any = {"loads": entries, "version": "x"} if wrapped else entries
    assert_same(json.dumps(doc).encode())
