"""The fields-only decode of request bodies (dataplane/fields.py) against the full json parse.

``parse_request`` reads the three inference endpoints through ``FieldPicker``; with the pickers
switched off it takes the full parse it always had. Every body here must give the same meta (or
the same 400 error) both ways."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastroute.dataplane import body as _body
from fastroute.dataplane import fields as _fields
from fastroute.errors import RouterError

PATHS = ("/generate", "/v1/completions", "/v1/chat/completions")


def _outcome(path: str, raw: bytes) -> tuple:
    try:
        m = _body.parse_request(path, raw)
    except RouterError as e:
        return ("error", e.status, e.code, e.message)
    return (
        "ok",
        m.stream,
        m.batch,
        m.input_tokens,
        m.return_logprob,
        m.max_new_tokens,
        m.model,
        m.routing_text(),
        {k: m.fields[k] for k in ("routed_dp_rank", "data_parallel_rank") if k in m.fields},
    )


def _both(path: str, raw: bytes, monkeypatch: pytest.MonkeyPatch) -> tuple[tuple, tuple]:
    fast = _outcome(path, raw)
    with monkeypatch.context() as mp:
        mp.setattr(_body, "_PICKERS", {})
        full = _outcome(path, raw)
    return fast, full


TRICKY = [
    # unicode escapes, surrogate pairs, escaped keys, raw non-ASCII
    b'{"text":"caf\\u00e9 \\u4f60\\u597d \\ud83d\\ude00","stream":true}',
    '{"text":"café 你好 😀","model":"m\\u00e9"}'.encode(),
    b'{"str\\u0065am":true,"t\\u0065xt":"abc"}',
    b'{"text":"\\ud800 lone"}',
    b'{"messages":[{"role":"user","content":"line\\nnext \\"q\\" \\\\ back"}]}',
    # nested messages, content parts, images
    b'{"messages":[{"role":"system","content":"abcd"},{"role":"user","content":[{"type":"text",'
    b'"text":"abcdefgh"},{"type":"image_url","image_url":{"url":"x"}},"bare",{"text":5}]}],'
    b'"n":3,"max_completion_tokens":7,"max_tokens":9}',
    b'{"messages":[{"role":"user","content":{"nested":1}}]}',
    b'{"messages":["not an object"]}',
    b'{"messages":{"a":1}}',
    b'{"messages":[{"role":"user"}], "n": 2000}',
    # duplicate keys: the last wins, as with json
    b'{"stream":true,"stream":false,"text":"a","text":"abcdefghij"}',
    b'{"messages":[{"content":"a"}],"messages":[{"content":"abcdefgh"},{"content":"x"}]}',
    b'{"sampling_params":{"max_new_tokens":1,"max_new_tokens":99}}',
    b'{"max_tokens":1,"max_tokens":"x"}',
    # invalid JSON and other refusals: the same 400 message
    b"",
    b"{",
    b"[]",
    b"[1]",
    b'"text"',
    b"null",
    b'{"a":1} x',
    b"\xff\xfe{}",
    b"\xef\xbb\xbf{}",
    b'{"a":"\xc3"}',
    b'{"skip":"\xff","text":"a"}',
    b'{"a":"\xed\xa0\x80"}',
    b'{"a":"x\x01y"}',
    b'{"a":"\\q"}',
    b'{"text":"a",}',
    b"[" * 10_000,
    '{"text":"a"}'.encode("utf-16"),
    # numbers json takes and msgspec does not, or the reverse
    b'{"skip":NaN,"text":"abcd"}',
    b'{"skip":[Infinity,-Infinity],"stream":true}',
    b'{"skip":1e400,"text":"abcd"}',
    b'{"max_tokens":1e400}',
    b'{"max_tokens":5.0}',
    b'{"max_tokens":true}',
    b'{"max_tokens":-1}',
    b'{"max_tokens":4611686018427387904}',
    b'{"max_tokens":123456789012345678901234567890}',
    b'{"skip":' + b"9" * 5000 + b',"text":"a"}',
    b'{"max_tokens":' + b"9" * 5000 + b"}",
    b'{"skip":"' + b"9" * 9000 + b'","text":"a"}',
    b'{"input_ids":[' + b"9" * 4400 + b",2]}",
    # shapes, batches, missing fields
    b"{}",
    b" {} ",
    b'\n{"text":"abcdefgh"}\t',
    b'{"input_ids":[1,2,3,4,5]}',
    b'{"input_ids":[[1,2],[3]],"text":["a","b"]}',
    b'{"input_ids":[1.5]}',
    b'{"input_ids":[[1],2]}',
    b'{"input_ids":"x"}',
    b'{"text":["a",1]}',
    b'{"text":5}',
    b'{"prompt":["abcd","ef"],"n":2}',
    b'{"prompt":[1,2,3]}',
    b'{"prompt":[[1,2],[3]]}',
    b'{"prompt":[]}',
    b'{"prompt":[null]}',
    b'{"prompt":{"a":1}}',
    b'{"sampling_params":[{"max_new_tokens":3},{"max_new_tokens":8}],"text":["a","b"]}',
    b'{"sampling_params":[1]}',
    b'{"sampling_params":"x"}',
    b'{"return_logprob":[false,true]}',
    b'{"return_logprob":[1]}',
    b'{"return_logprob":"y"}',
    b'{"stream":"yes"}',
    b'{"stream":null,"model":null}',
    b'{"model":5}',
    # PD rank keys: presence, even as null, is what PD refuses
    b'{"routed_dp_rank":null,"text":"a"}',
    b'{"data_parallel_rank":3,"messages":[]}',
    b'{"rid":"abc","return_text_in_logprobs":true,"extra":{"deep":[[[{"x":[1,{"y":null}]}]]]}}',
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("raw", TRICKY)
def test_tricky_bodies_match_the_full_parse(path: str, raw: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    fast, full = _both(path, raw, monkeypatch)
    assert fast == full


def test_picker_reads_only_the_routing_keys() -> None:
    m = _body.parse_request("/generate", b'{"text":"abcd","rid":"r1","extra":[1,2]}')
    assert m.fields == {"text": "abcd"}
    # The whole object is still there for whoever asks, parsed on first read.
    assert m.obj == {"text": "abcd", "rid": "r1", "extra": [1, 2]}
    assert m.fields == {"text": "abcd"}


def test_dropping_obj_drops_fields_and_body() -> None:
    m = _body.parse_request("/v1/chat/completions", b'{"messages":[{"content":"a"}]}')
    m.obj = None
    assert m.obj is None and m.fields is None and m.body is None


def test_other_paths_keep_the_full_parse() -> None:
    m = _body.parse_request("/v1/responses", b'{"input":"abc","model":"m"}')
    assert m.fields is m.obj and m.obj == {"input": "abc", "model": "m"}


def test_refused_bodies_take_the_full_parse() -> None:
    picker = _fields.PICKERS["/generate"]
    assert picker.pick(b'{"a":NaN}') is None
    assert picker.pick(b'{"a":"\xff"}') is None
    assert picker.pick(b'{"a":' + b"1" * 4301 + b"}") is None
    # (the run check is conservative: runs of half the limit may take the full parse too)
    assert picker.pick(b'{"a":' + b"1" * 2000 + b',"text":"x"}') == {"text": "x"}
    assert picker.pick(b'{"text":"x"}') == {"text": "x"}
    # non-ASCII bytes: decoded whole, every string validated
    assert picker.pick('{"text":"\u00e9","rid":"r"}'.encode()) == {"text": "\u00e9", "rid": "r"}
    for bad in (b'{"a":"\xed\xa0\x80"}', b'{"a":"\xc0\x80"}', b'{"a":"\xf4\x90\x80\x80"}'):
        assert picker.pick(bad) is None


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=12,
)
_keys = st.sampled_from(
    sorted({k for ks in _fields.READ_FIELDS.values() for k in ks} | {"rid", "temperature", "content", "role"})
)
_msgs = st.lists(
    st.dictionaries(
        st.sampled_from(["role", "content", "text", "type"]),
        _json | st.lists(st.dictionaries(st.sampled_from(["type", "text"]), _json, max_size=2), max_size=3),
        max_size=3,
    ),
    max_size=3,
)


@settings(max_examples=300, deadline=None)
@given(obj=st.dictionaries(_keys, _json | _msgs, max_size=6), path=st.sampled_from(PATHS), ascii_only=st.booleans())
def test_random_bodies_match_the_full_parse(obj: dict, path: str, ascii_only: bool) -> None:
    raw = json.dumps(obj, ensure_ascii=ascii_only).encode("utf-8", "surrogatepass")
    fast = _outcome(path, raw)
    saved = _body._PICKERS
    _body._PICKERS = {}
    try:
        full = _outcome(path, raw)
    finally:
        _body._PICKERS = saved
    assert fast == full


# --- ASCII bodies without an escape (what bench/floor.py sends) ---------------------------
# The fields-only decoder's own path (no whole-body decode): prompt strings of every shape, the
# values that are not strings, and the refusals, against the full parse.

PLAIN_BODIES = [
    b'{"text":"abcd"}',
    b'{"text":""}',
    b'{"text":"a"}',
    b'{"text" : "abcde" , "stream" : true }',
    b'{"text":null}',
    b'{"text":5}',
    b'{"text":true}',
    b'{"text":{"a":"b"}}',
    b'{"text":["abc","defgh"]}',
    b'{"text":["abc",5]}',
    b'{"text":[]}',
    b'{"text":"abcdefghi","input_ids":[1,2]}',
    b'{"text":["a","b"],"input_ids":[[1],[2,3]]}',
    b'{"text":"a","text":"abcdefghij"}',
    b'{"text":"abcdefghij","text":null}',
    b'{"text":"x\x01y"}',
    b'{"text":"x\x7fy"}',
    b'{"text":"abc}',
    b'{"prompt":"abcdefgh","n":2}',
    b'{"prompt":["abcd","ef"]}',
    b'{"prompt":[1,2,3]}',
    b'{"prompt":[[1,2],[3]]}',
    b'{"prompt":null}',
    b'{"prompt":1.5}',
    b'{"prompt":""}',
    b'{"messages":[{"role":"system","content":"abcdefg"},{"role":"user","content":"hi"}]}',
    b'{"messages":[{"role":"user","content":""}]}',
    b'{"messages":[{"role":"user","content":null},{"role":"user"}]}',
    b'{"messages":[{"role":"user","content":5}]}',
    b'{"messages":[{"role":"user","content":{"a":"b"}}]}',
    b'{"messages":[{"role":"user","content":[{"type":"text","text":"abcdef"},"bare",{"text":5}]}]}',
    b'{"messages":[{"content":"abc","content":[{"text":"defgh"}]}]}',
    b'{"messages":[{"content":[{"text":"abc"}],"content":"defgh"}]}',
    b'{"messages":[{"content":"abc"},"x"]}',
    b'{"messages":[],"n":3}',
    b'{"messages":null}',
    b'{"messages":"abc"}',
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("raw", PLAIN_BODIES)
def test_plain_bodies_match_the_full_parse(path: str, raw: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    fast, full = _both(path, raw, monkeypatch)
    assert fast == full


# ASCII without the two characters json escapes in every string (a quote, a backslash) and the
# control characters it escapes: what a prompt without escapes is made of.
_plain = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E, blacklist_characters='"\\'), max_size=40)
_plain_json = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**40), max_value=2**40) | _plain,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_plain, inner, max_size=3),
    max_leaves=8,
)
_plain_parts = st.lists(
    st.dictionaries(st.sampled_from(["type", "text"]), _plain | _plain_json, max_size=2) | _plain_json, max_size=3
)
_plain_message = st.fixed_dictionaries(
    {"content": st.one_of(_plain, _plain_parts, _plain_json)}, optional={"role": _plain, "name": _plain_json}
)
_plain_msgs = st.one_of(
    st.lists(_plain_message, min_size=1, max_size=4),
    st.lists(st.one_of(_plain_message, st.fixed_dictionaries({}, optional={"role": _plain}), _plain_json), max_size=4),
    _plain_json,
)
_plain_prompt = st.one_of(_plain, st.lists(_plain, max_size=3), _plain_json)
_plain_others = {
    "text": _plain_prompt,
    "prompt": _plain_prompt,
    "messages": _plain_msgs,
    "input_ids": st.lists(st.integers(0, 9), max_size=3) | _plain_json,
    "model": _plain | _plain_json,
    "stream": st.booleans() | _plain_json,
    "n": st.integers(0, 3) | _plain_json,
    "rid": _plain_json,
}
# Each endpoint's prompt key always there, every other key now and then.
_PLAIN_BODY = {
    path: st.fixed_dictionaries(
        {key: _plain_others[key]}, optional={k: v for k, v in _plain_others.items() if k != key}
    )
    for path, key in (("/generate", "text"), ("/v1/completions", "prompt"), ("/v1/chat/completions", "messages"))
}


@pytest.mark.parametrize("path", PATHS)
@settings(max_examples=300, deadline=None)
@given(data=st.data(), spaced=st.booleans())
def test_random_plain_bodies_match_the_full_parse(path: str, data: st.DataObject, spaced: bool) -> None:
    obj = data.draw(_PLAIN_BODY[path])
    raw = json.dumps(obj, separators=(", ", ": ") if spaced else (",", ":")).encode()
    assert b"\\" not in raw and raw.isascii()
    fast = _outcome(path, raw)
    saved = _body._PICKERS
    _body._PICKERS = {}
    try:
        full = _outcome(path, raw)
    finally:
        _body._PICKERS = saved
    assert fast == full
