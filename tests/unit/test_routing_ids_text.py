"""cache_aware's text of a /generate request with input_ids (the Mooncake trace's ~12k-token
prompts): the same space-separated ids as before, built without an object per id, so its cost
is a pass over the bytes (measured by what it allocates, not by time). The parse itself counts
a flat ``input_ids`` without a list of ints (``_jsonscan.Ids``): the list is built only for what
reads it (the KV-event index's ``routing_ids``)."""

from __future__ import annotations

import json
import random
import re
import tracemalloc

from hypothesis import given, settings
from hypothesis import strategies as st

from fastroute.dataplane._jsonscan import Ids
from fastroute.dataplane.body import ROUTING_IDS_MAX, parse_request
from fastroute.dataplane.fields import PICKERS


def _body(ids: list[int]) -> bytes:
    return json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": 8}}).encode()


def test_long_input_ids_text_is_the_first_ids_separated_by_spaces():
    rs = random.Random(52)
    ids = [rs.randrange(200_000) for _ in range(12_000)]
    text = parse_request("/generate", _body(ids)).routing_text()
    assert text == " ".join(str(i) for i in ids[:ROUTING_IDS_MAX])
    batch = parse_request("/generate", _body([ids[:3], ids[3:5]])).routing_text()  # type: ignore[list-item]
    assert batch == " ".join(str(i) for i in ids[:3])
    assert parse_request("/generate", _body([])).routing_text() is None


def test_rendering_12k_ids_allocates_no_object_per_id():
    rs = random.Random(7)
    ids = [rs.randrange(200_000) for _ in range(12_000)]
    meta = parse_request("/generate", _body(ids))
    size = len(meta.routing_text() or "")
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        meta.routing_text()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # a few copies of the text at most; a str per id (8,192 of ~55 bytes) would be ~9x the text
    assert peak < 4 * size, (peak, size)


def test_parsing_12k_ids_builds_no_list_of_ints():
    rs = random.Random(11)
    body = _body([rs.randrange(200_000) for _ in range(12_000)])
    parse_request("/generate", body)  # warm: the first call's imports and caches
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        meta = parse_request("/generate", body)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert meta.input_tokens == 12_000
    # a list of 12,000 ints is ~430 KB (8 bytes a slot, 28 an int above 256): 5x this body
    assert peak < len(body) // 8, (peak, len(body))


@settings(max_examples=200, deadline=None)
@given(
    ids=st.lists(st.integers(0, 10**18 - 1) | st.integers(0, 300), max_size=40),
    spaces=st.lists(st.sampled_from(("", " ", "\n ", "\t", "\r\n")), min_size=3, max_size=3),
    limit_cut=st.booleans(),
)
def test_flat_ids_spelled_any_way_read_as_json_reads_them(ids: list[int], spaces: list[str], limit_cut: bool) -> None:
    a, b, c = spaces
    inner = ("," + b).join(str(i) for i in ids)
    body = ('{"input_ids":%s[%s%s%s]%s,"sampling_params":{}}' % (a, b, inner, c, a)).encode()
    assert json.loads(body)["input_ids"] == ids
    scanned = PICKERS["/generate"].pick(body)
    assert scanned is not None and type(scanned["input_ids"]) is Ids  # the fast path is on
    assert scanned["input_ids"].tolist() == ids
    limit = 3 if limit_cut else ROUTING_IDS_MAX
    assert scanned["input_ids"].text(limit) == (" ".join(map(str, ids[:limit])) or None)
    meta = parse_request("/generate", body)
    assert meta.input_tokens == len(ids)
    assert meta.routing_text() == (" ".join(map(str, ids[:ROUTING_IDS_MAX])) or None)
    assert meta.routing_ids() == (ids or None)


def test_ids_of_other_shapes_stay_json_values():
    for spelled, value in (
        ("[-1, 2]", [-1, 2]),
        ("[1.5]", [1.5]),
        ("[1e3]", [1000.0]),
        ("[[1, 2], [3]]", [[1, 2], [3]]),
        ("[1234567890123456789]", [1234567890123456789]),  # 19 digits
        ('["1"]', ["1"]),
        ("7", 7),
    ):
        got = PICKERS["/generate"].pick(('{"input_ids":%s}' % spelled).encode())
        assert got is not None and got["input_ids"] == value and type(got["input_ids"]) is type(value), spelled
    for bad in ("[01]", "[1,]", "[1 2]", "[1"):
        body = ('{"input_ids":%s}' % bad).encode()
        assert PICKERS["/generate"].pick(body) is None, bad  # the full parse answers its 400
        assert re.search("valid JSON|token ids", _error(body)), bad


def _error(body: bytes) -> str:
    try:
        parse_request("/generate", body)
    except Exception as exc:  # RouterError: the 400 the client gets
        return str(exc)
    raise AssertionError(f"accepted {body!r}")
