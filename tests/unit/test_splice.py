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


# The old rule of the client head, by lower-cased name: these never go to the client.
_HOP = {
    b"connection",
    b"keep-alive",
    b"proxy-connection",
    b"proxy-authenticate",
    b"proxy-authorization",
    b"te",
    b"trailer",
    b"trailers",
    b"transfer-encoding",
    b"upgrade",
    b"content-encoding",
    b"host",
    b"content-length",
    b"x-request-id",
}
_NAMES = st.sampled_from(sorted(_HOP) + [b"content-type", b"date", b"server", b"x-trace", b"tex", b"hosts", b"t"])


def _reference_copy(headers: list[tuple[bytes, bytes]], drop_ctype: bool) -> tuple[bytes, bytes | None]:
    out, length = [], None
    for name, value in headers:
        n = name.lower()
        if n == b"content-length" and length is None:
            length = value
        if n in _HOP or (drop_ctype and n == b"content-type"):
            continue
        out.append(name + b": " + value + b"\r\n")
    return b"".join(out), length


@given(
    st.lists(
        st.tuples(
            st.one_of(
                _NAMES.map(lambda n: n.upper()),
                _NAMES,
                _NAMES.map(lambda n: n.title()),
                _NAMES.map(lambda n: n.replace(b"-", b"\r")),  # '-' | 0x20 is '-' too: no match
                st.binary(max_size=20),
            ),
            st.binary(max_size=30),
        ),
        max_size=40,
    ),
    st.booleans(),
)
def test_copied_headers_follow_the_hop_by_hop_rule(headers: list[tuple[bytes, bytes]], drop_ctype: bool) -> None:
    assert _splice.copied_headers(headers, drop_ctype) == _reference_copy(headers, drop_ctype)


def test_copied_headers_refuse_what_is_not_pairs_of_bytes() -> None:
    for bad in ([(b"a",)], [(b"a", "b")], [("a", b"b")], [[b"a", b"b"]]):
        with pytest.raises(TypeError):
            _splice.copied_headers(bad, False)  # type: ignore[arg-type]


@given(st.none() | st.binary(max_size=64), st.binary(min_size=1, max_size=70000))
def test_chunk_is_the_formatted_chunk_behind_the_head(head: bytes | None, data: bytes) -> None:
    want = (head or b"") + b"%x\r\n%b\r\n" % (len(data), data)
    assert _splice.chunk(head, data) == want


def test_chunk_refuses_an_empty_piece() -> None:
    with pytest.raises(ValueError, match="empty chunk"):
        _splice.chunk(b"HTTP/1.1 200 OK\r\n\r\n", b"")


@given(st.lists(st.binary(max_size=300), max_size=8))
def test_joined_is_bytes_join(parts: list[bytes]) -> None:
    assert _splice.joined(parts) == b"".join(parts)


def test_joined_refuses_what_is_not_bytes() -> None:
    with pytest.raises(TypeError, match="item 1 is bytearray"):
        _splice.joined([b"a", bytearray(b"b")])


@given(st.binary(max_size=40), st.none() | st.binary(max_size=20))
def test_target_path_is_the_part_before_the_query(path: bytes, query: bytes | None) -> None:
    url = path if query is None else path + b"?" + query
    got = _splice.target_path(url)
    assert got == url.partition(b"?")[0]
    if b"?" not in url:
        assert got is url  # no copy
