"""The compiled splice helpers (dataplane/_splice.pyx) against the Python they replace."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from fastroute.dataplane import _splice
from fastroute.dataplane.body import inject, splice_point
from fastroute.errors import RouterError

_WS = st.text(alphabet=" \t\n\r", max_size=4)


def _reference_bounds(body: bytes) -> tuple[int, bool]:
    """The byte loop body.py used before: strip JSON whitespace, expect {...}."""
    ws = b" \t\n\r"
    end = len(body) - 1
    while end >= 0 and body[end] in ws:
        end -= 1
    start = 0
    while start < end and body[start] in ws:
        start += 1
    if end <= start or body[end] != 0x7D or body[start] != 0x7B:
        raise ValueError
    j = end - 1
    while j > start and body[j] in ws:
        j -= 1
    return end, j == start


@given(_WS, st.dictionaries(st.text(max_size=5), st.integers(), max_size=4), _WS, _WS)
def test_bounds_match_the_byte_loop_for_objects(lead: str, obj: dict, inner: str, trail: str) -> None:
    text = json.dumps(obj)
    body = (lead + text[:-1] + inner + text[-1] + trail).encode()
    want = _reference_bounds(body)
    assert _splice.object_bounds(body) == want
    assert _splice.object_bounds(bytearray(body)) == want and _splice.object_bounds(memoryview(body)) == want


@pytest.mark.parametrize("body", [b"", b" ", b"{", b"}", b"[]", b"1", b' "{}" ', b"{}x", b"x{}"])
def test_anything_but_an_object_is_refused(body: bytes) -> None:
    with pytest.raises(ValueError):
        _splice.object_bounds(body)
    with pytest.raises(RouterError) as e:
        splice_point(body)
    assert e.value.status == 400


@given(st.binary(max_size=64), st.binary(max_size=300), st.binary(max_size=64), st.data())
def test_framed_is_the_concatenation(head: bytes, body: bytes, mid: bytes, data: st.DataObject) -> None:
    end = data.draw(st.integers(0, len(body)))
    assert _splice.framed(head, body, end, mid) == head + body[:end] + mid + body[end:]


def test_framed_refuses_a_point_outside_the_body() -> None:
    for end in (-1, 4):
        with pytest.raises(ValueError):
            _splice.framed(b"h", b"abc", end, b"")


@given(st.binary(max_size=40), st.integers(-(2**63), 2**63 - 1))
def test_with_int_writes_the_decimal_digits(prefix: bytes, value: int) -> None:
    assert _splice.with_int(prefix, value) == prefix + b"%d" % value


@given(_WS, st.dictionaries(st.text(max_size=5), st.integers(), max_size=4), _WS)
def test_a_splice_point_gives_what_inject_gives(lead: str, obj: dict, trail: str) -> None:
    body = (lead + json.dumps(obj) + trail).encode()
    end, sep = splice_point(body)
    fields = b'"bootstrap_room":7'
    assert body[:end] + sep + fields + body[end:] == inject(body, fields)
    assert json.loads(inject(body, fields)) == {**obj, "bootstrap_room": 7}


@given(
    st.binary(min_size=1, max_size=80),
    st.binary(max_size=40),
    st.integers(0, 2**40),
    st.binary(max_size=80),
    st.binary(max_size=60),
)
def test_post_head_is_the_formatted_head(url: bytes, host: bytes, length: int, fwd: bytes, auth: bytes) -> None:
    host_part = b" HTTP/1.1\r\nHost: %b\r\nContent-Type: application/json\r\nContent-Length: " % host
    want = b"POST %b HTTP/1.1\r\nHost: %b\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%b%b\r\n" % (
        url,
        host,
        length,
        fwd,
        auth,
    )
    assert _splice.post_head(url, host_part, length, fwd, auth) == want
