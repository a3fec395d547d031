"""Property tests: inject() on any JSON object, parse_request() on any bytes, the PD legs of
any request (what ``PDRelay.attempt`` sends, tests/pdwire.py)."""

from __future__ import annotations

import json
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastroute.dataplane.body import ROOM_LIMIT, inject, parse_request
from fastroute.errors import RouterError
from tests.pdwire import send_pd, wire_body

PATHS = ["/generate", "/v1/completions", "/v1/chat/completions", "/other"]

json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text()
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
json_objects = st.dictionaries(st.text(max_size=10), json_values, max_size=6)

# Ways a client may lay out the same object: compact, pretty, ASCII-escaped,
# with surrounding whitespace.
layouts = st.sampled_from(
    [
        lambda o: json.dumps(o),
        lambda o: json.dumps(o, separators=(",", ":")),
        lambda o: json.dumps(o, indent=2, ensure_ascii=False),
        lambda o: " \n\t" + json.dumps(o, ensure_ascii=False) + "\r\n  ",
    ]
)

# Field values the router injects: keys disjoint from the object's so the
# expected result is a plain dict union.
extra_fields = st.dictionaries(
    st.text(max_size=8).map(lambda s: "__fr_" + s),
    json_values,
    min_size=1,
    max_size=3,
)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(obj=json_objects, layout=layouts, fields=extra_fields)
def test_inject_yields_original_plus_fields(obj: dict, layout, fields: dict) -> None:
    raw = layout(obj).encode("utf-8", "surrogatepass")
    encoded = ",".join(json.dumps(k) + ":" + json.dumps(v) for k, v in fields.items()).encode()
    out = inject(raw, encoded)
    assert json.loads(out) == {**obj, **fields}
    # The client's bytes survive verbatim up to the splice point.
    assert out.startswith(raw[: raw.rindex(b"}")].rstrip())


@SETTINGS
@given(obj=json_objects, layout=layouts, path=st.sampled_from(PATHS[:3]), seed=st.integers(0, 2**32))
def test_parse_then_pd_legs_are_valid(obj: dict, layout, path: str, seed: int) -> None:
    raw = layout(obj).encode("utf-8", "surrogatepass")
    try:
        meta = parse_request(path, raw)
    except RouterError as exc:
        assert exc.status == 400
        return
    sent, answer = send_pd(path, raw, room_rng=random.Random(seed), decode_rank=1)
    if len(sent) != 2:  # refused before the pick: a PD batch too large, a DP rank key sent
        assert answer.startswith((b"HTTP/1.1 400 ", b"HTTP/1.1 413 ")), answer[:200]
        return
    p, d = (json.loads(wire_body(*leg)[1]) for leg in sent)
    rooms = d["bootstrap_room"]
    if meta.batch is None:
        assert type(rooms) is int and 0 <= rooms < ROOM_LIMIT
    else:
        assert len(rooms) == meta.batch == len(d["bootstrap_host"]) == len(d["bootstrap_port"])
        assert len(set(rooms)) == len(rooms)
    assert d["routed_dp_rank"] == 1 and "routed_dp_rank" not in p
    assert {k: v for k, v in d.items() if k != "routed_dp_rank"} == p  # one room, same fields


# Bodies that look like requests, with arbitrary types in the fields the router
# reads: the parser must answer 400 or succeed, never crash.
request_like = st.fixed_dictionaries(
    {},
    optional={
        "text": json_values,
        "input_ids": json_values | st.lists(st.lists(st.integers(), max_size=3), max_size=3),
        "prompt": json_values,
        "messages": json_values | st.lists(st.dictionaries(st.sampled_from(["role", "content"]), json_values)),
        "n": json_values,
        "stream": json_values,
        "model": json_values,
        "return_logprob": json_values,
        "sampling_params": json_values | st.dictionaries(st.sampled_from(["max_new_tokens", "n"]), json_values),
        "max_tokens": json_values,
        "max_completion_tokens": json_values,
    },
)


@SETTINGS
@given(obj=request_like, path=st.sampled_from(PATHS))
def test_parse_request_only_raises_router_error_on_request_like(obj: dict, path: str) -> None:
    raw = json.dumps(obj).encode()
    try:
        meta = parse_request(path, raw)
    except RouterError as exc:
        assert exc.status == 400
        return
    assert type(meta.stream) is bool and type(meta.input_tokens) is int and meta.input_tokens >= 0
    assert meta.batch is None or (type(meta.batch) is int)
    meta.routing_text()


@SETTINGS
@given(
    raw=st.binary(max_size=200) | st.text(max_size=200).map(lambda s: s.encode("utf-8", "surrogatepass")),
    path=st.sampled_from(PATHS),
)
def test_parse_request_only_raises_router_error_on_bytes(raw: bytes, path: str) -> None:
    try:
        parse_request(path, raw)
    except RouterError as exc:
        assert exc.status == 400
