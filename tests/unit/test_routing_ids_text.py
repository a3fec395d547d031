"""cache_aware's text of a /generate request with input_ids (the Mooncake trace's ~12k-token
prompts): the same space-separated ids as before, built without an object per id, so its cost
is a pass over the bytes (measured by what it allocates, not by time)."""

from __future__ import annotations

import json
import random
import tracemalloc

from fastroute.dataplane.body import ROUTING_IDS_MAX, parse_request


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
