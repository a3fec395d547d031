"""Request parsing, byte-splice injection, PD fields and logprob merges (protocol.md 3.3, 3.5, 4.3).

The PD bootstrap fields are read from what each leg of a PD request really gets
(``tests/pdwire.py``: the App and ``PDRelay.attempt`` with a recording pool)."""

from __future__ import annotations

import json
import random

import pytest

from fastroute.dataplane.body import (
    ROOM_LIMIT,
    RequestMeta,
    draw_room,
    estimate_tokens,
    inject,
    parse_request,
    rank_field_bytes,
)
from fastroute.dataplane.logprobs import SSELogprobMerger, merge_logprobs_json
from fastroute.errors import RouterError
from tests.pdwire import pd_legs, send_pd, wire_body

PD_KEYS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")


def forwarded(
    path: str,
    body: dict | bytes,
    *,
    host: str = "127.0.0.1",
    port: int | None = 8998,
) -> tuple[RequestMeta, dict]:
    """The parse of ``body`` and what the prefill leg of a PD request with it gets."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    meta = parse_request(path, raw)
    prefill, _ = pd_legs(path, raw, host=host, bootstrap_port=port)
    return meta, prefill


def assert_scalar(out: dict, host: str = "127.0.0.1", port: int | None = 8998) -> None:
    assert out["bootstrap_host"] == host
    assert out["bootstrap_port"] == port
    assert type(out["bootstrap_room"]) is int
    assert 0 <= out["bootstrap_room"] < ROOM_LIMIT


def assert_lists(out: dict, b: int, host: str = "127.0.0.1", port: int | None = 8998) -> None:
    assert out["bootstrap_host"] == [host] * b
    assert out["bootstrap_port"] == [port] * b
    rooms = out["bootstrap_room"]
    assert len(rooms) == b and len(set(rooms)) == b
    assert all(type(r) is int and 0 <= r < ROOM_LIMIT for r in rooms)


# --- protocol.md 3.3 table, row by row ---------------------------------------


def test_generate_input_ids_batch_gives_lists() -> None:
    body = {"input_ids": [[1, 2], [3, 4], [5]], "sampling_params": {"max_new_tokens": 7}}
    meta, out = forwarded("/generate", body, port=8999)
    assert meta.batch == 3 and meta.input_tokens == 5 and meta.max_new_tokens == 7
    assert_lists(out, 3, port=8999)
    assert out["input_ids"] == body["input_ids"]


def test_generate_text_list_accepted_like_mini_lb() -> None:
    meta, out = forwarded("/generate", {"text": ["hello world", "abcd", "x"]})
    assert meta.batch == 3
    assert meta.input_tokens == estimate_tokens("hello world") + 1 + 1
    assert_lists(out, 3)


@pytest.mark.parametrize(
    "body",
    [
        {"text": "hello world", "sampling_params": {"max_new_tokens": 2}},
        {"text": "hello world", "sampling_params": {"n": 4}},
        {"input_ids": [1, 2, 3], "sampling_params": {"n": 3}},
        {"input_ids": []},
    ],
)
def test_generate_single_gives_scalars_whatever_n(body: dict) -> None:
    meta, out = forwarded("/generate", body)
    assert meta.batch is None
    assert_scalar(out)
    for k, v in body.items():
        assert out[k] == v


def test_completions_prompt_array_gives_lists_regardless_of_n() -> None:
    meta, out = forwarded("/v1/completions", {"model": "m", "prompt": ["a b", "c d"], "n": 3})
    assert meta.batch == 2 and meta.model == "m"
    assert_lists(out, 2)


def test_completions_prompt_token_lists_batch() -> None:
    meta, out = forwarded("/v1/completions", {"prompt": [[1, 2, 3], [4]]})
    assert meta.batch == 2 and meta.input_tokens == 4
    assert_lists(out, 2)


def test_completions_flat_token_prompt_is_one_request() -> None:
    meta, out = forwarded("/v1/completions", {"prompt": [11, 12, 13]})
    assert meta.batch is None and meta.input_tokens == 3
    assert_scalar(out)


def test_completions_string_prompt_scalars_even_with_n() -> None:
    meta, out = forwarded("/v1/completions", {"prompt": "once upon a time", "n": 4, "max_tokens": 9})
    assert meta.batch is None and meta.max_new_tokens == 9
    assert_scalar(out)


def test_chat_n_gives_lists_of_n() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "n": 2, "max_completion_tokens": 5, "max_tokens": 50}
    meta, out = forwarded("/v1/chat/completions", body)
    assert meta.batch == 2 and meta.max_new_tokens == 5
    assert_lists(out, 2)


@pytest.mark.parametrize("extra", [{}, {"n": 1}])
def test_chat_otherwise_scalars(extra: dict) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, **extra}
    meta, out = forwarded("/v1/chat/completions", body)
    assert meta.batch is None and meta.max_new_tokens == 3 and meta.model == "m"
    assert_scalar(out)


def test_null_port_and_ipv6_host() -> None:
    _, out = forwarded("/generate", {"text": "x"}, host="::1", port=None)
    assert out["bootstrap_host"] == "[::1]" and out["bootstrap_port"] is None
    _, out = forwarded("/generate", {"text": "x"}, host="localhost", port=None)
    assert out["bootstrap_host"] == "localhost"


def test_batch_rooms_distinct_even_with_colliding_rng() -> None:
    class Repeating:
        """Returns every value twice in a row: forces the distinctness check to work."""

        def __init__(self) -> None:
            self.r = random.Random(3)
            self.last: int | None = None

        def getrandbits(self, k: int) -> int:
            if self.last is None:
                self.last = self.r.getrandbits(k)
                return self.last
            v, self.last = self.last, None
            return v

    p, d = pd_legs("/generate", b'{"input_ids": [[1],[2],[3],[4],[5]]}', room_rng=Repeating())
    assert len(set(p["bootstrap_room"])) == 5
    assert d["bootstrap_room"] == p["bootstrap_room"]


def test_decode_rank_key_scalar_even_for_batch() -> None:
    p, d = pd_legs("/generate", {"input_ids": [[1], [2]]}, decode_rank=5)
    assert d["routed_dp_rank"] == 5 and "routed_dp_rank" not in p
    assert_lists(d, 2)
    assert_lists(p, 2)


def test_legs_share_room_and_only_decode_has_rank() -> None:
    p, d = pd_legs("/generate", b'{"text":"a"}', host="10.0.0.5", decode_rank=2)
    assert p["bootstrap_room"] == d["bootstrap_room"]
    assert "routed_dp_rank" not in p and d["routed_dp_rank"] == 2
    assert p["bootstrap_host"] == d["bootstrap_host"] == "10.0.0.5"


def test_new_room_per_request() -> None:
    rng = random.Random(1)
    rooms = {pd_legs("/generate", b'{"text":"a"}', room_rng=rng)[0]["bootstrap_room"] for _ in range(200)}
    assert len(rooms) == 200


def test_rank_field_bytes() -> None:
    assert rank_field_bytes("data_parallel_rank", 3) == b'"data_parallel_rank":3'
    assert json.loads(inject(b'{"text":"q"}', rank_field_bytes("data_parallel_rank", 0))) == {
        "text": "q",
        "data_parallel_rank": 0,
    }


# --- rooms and prefill-rank arithmetic (protocol.md 3.3, 4.3) ----------------


def test_room_range_many_draws() -> None:
    rng = random.Random(42)
    rooms = [draw_room(rng) for _ in range(20_000)]
    assert all(0 <= r < ROOM_LIMIT for r in rooms)
    assert len(set(rooms)) == len(rooms)
    # Uniform over 63 bits: the top bit of the 63 is set about half the time.
    high = sum(r >> 62 for r in rooms)
    assert 9_000 < high < 11_000


class Fixed:
    def __init__(self, *values: int) -> None:
        self.values = list(values)

    def getrandbits(self, k: int) -> int:
        return self.values.pop(0) if len(self.values) > 1 else self.values[0]


def test_room_rejects_values_above_limit() -> None:
    assert draw_room(Fixed(ROOM_LIMIT, ROOM_LIMIT + 5, 17)) == 17
    # A broken RNG that never yields an acceptable value still terminates in range.
    assert 0 <= draw_room(Fixed((1 << 63) - 1)) < ROOM_LIMIT


@pytest.mark.parametrize("n", [2, 3, 7, 8, 16])
def test_prefill_rank_arithmetic_many_draws(n: int) -> None:
    rng = random.Random(n)
    for _ in range(2_000):
        p = rng.randrange(n)
        room = draw_room(rng, n, p)
        assert room % n == p
        assert 0 <= room < ROOM_LIMIT


@pytest.mark.parametrize("n", [3, 7, 16, 1000])
def test_prefill_rank_arithmetic_at_the_top_of_the_range(n: int) -> None:
    for raw in (ROOM_LIMIT - 1, ROOM_LIMIT - 2, ROOM_LIMIT - n, 0, n - 1):
        for p in range(min(n, 20)):
            room = draw_room(Fixed(raw), n, p)
            assert room % n == p
            assert 0 <= room < ROOM_LIMIT


def test_prefill_rank_out_of_range() -> None:
    with pytest.raises(ValueError):
        draw_room(random.Random(0), 4, 4)


def test_prefill_rank_applies_to_every_batch_room() -> None:
    p, d = pd_legs("/generate", b'{"input_ids": [[1],[2],[3]]}', prefill_dp_size=8, prefill_rank=5)
    assert [r % 8 for r in p["bootstrap_room"]] == [5, 5, 5]
    assert d["bootstrap_room"] == p["bootstrap_room"]


# --- inject edge cases -------------------------------------------------------

F = b'"k":1'


@pytest.mark.parametrize(
    "raw,expected",
    [
        (b"{}", b'{"k":1}'),
        (b"{ }", b'{ "k":1}'),
        (b" \r\n\t{ \n } \n", b' \r\n\t{ \n "k":1} \n'),
        (b'{"a":1}', b'{"a":1,"k":1}'),
        (b'{"a":1}\n\n', b'{"a":1,"k":1}\n\n'),
        (b'{"a":1 \n}', b'{"a":1 \n,"k":1}'),
        (b'{"a":{}}', b'{"a":{},"k":1}'),
        (b'{"a":"}"}', b'{"a":"}","k":1}'),
        (b'{"a":"{ \\" }"}', b'{"a":"{ \\" }","k":1}'),
        (b'{"a":[{}]}', b'{"a":[{}],"k":1}'),
    ],
)
def test_inject_bytes(raw: bytes, expected: bytes) -> None:
    assert inject(raw, F) == expected
    assert json.loads(inject(raw, F)) == {**json.loads(raw), "k": 1}


@pytest.mark.parametrize("raw", [b"{}", b"{ }", b" \r\n\t{ \n } \n", b'{"a":1 \n}', b'{"a":"}"}', b'{"a":[{}]}'])
def test_each_pd_leg_gets_the_client_bytes_around_its_fields(raw: bytes) -> None:
    sent, _ = send_pd("/generate", raw, decode_rank=None)
    end = raw.rindex(b"}")
    bodies = [wire_body(*leg)[1] for leg in sent]
    assert len(bodies) == 2 and bodies[0] == bodies[1]  # no rank key: the same bytes for both
    for body in bodies:
        assert body.startswith(raw[:end])  # the client's bytes verbatim up to the splice
        assert body.endswith(raw[end:])
        assert json.loads(body).keys() == {*json.loads(raw), "bootstrap_host", "bootstrap_port", "bootstrap_room"}


def test_inject_preserves_unicode_and_escapes_verbatim() -> None:
    raw = '{"text": "h\\u00e9llo \u4e16\u754c \U0001f600", "x": 1.50}'.encode()
    out = inject(raw, b'"bootstrap_room":5')
    assert out.startswith(raw[:-1])
    assert b"\\u00e9" in out and b"1.50" in out
    assert json.loads(out)["text"] == "h\u00e9llo \u4e16\u754c \U0001f600"


def test_bytearray_and_memoryview_bodies() -> None:
    raw = b'{"text":"a"}'
    for body in (bytearray(raw), memoryview(raw)):
        assert parse_request("/generate", body).input_tokens == 1
        assert inject(body, F) == b'{"text":"a","k":1}'


def test_inject_empty_fields_is_identity() -> None:
    assert inject(b' {"a":1} ', b"") == b' {"a":1} '


@pytest.mark.parametrize("raw", [b"[1,2]", b'"s"', b"", b"   ", b"}", b"{", b"1"])
def test_inject_rejects_non_object(raw: bytes) -> None:
    with pytest.raises(RouterError) as info:
        inject(raw, F)
    assert info.value.status == 400


def test_inject_client_duplicate_key_is_overridden() -> None:
    out = inject(b'{"bootstrap_room": 1}', b'"bootstrap_room":2')
    assert json.loads(out)["bootstrap_room"] == 2


# --- parse_request: generic fields and bad types -----------------------------


def test_parse_generic_fields() -> None:
    meta = parse_request("/generate", b'{"text":"a b","stream":true,"return_logprob":true,"model":"m"}')
    assert meta.stream is True and meta.return_logprob is True and meta.model == "m"
    assert meta.obj["text"] == "a b"
    assert parse_request("/generate", b'{"text":"a"}').stream is False
    assert parse_request("/generate", b'{"text":"a","stream":null}').stream is False
    assert parse_request("/generate?x=1", b'{"text":["a","b"]}').batch == 2


def test_return_logprob_list_form() -> None:
    assert parse_request("/generate", b'{"text":["a","b"],"return_logprob":[false,true]}').return_logprob is True
    assert parse_request("/generate", b'{"text":["a","b"],"return_logprob":[false,false]}').return_logprob is False


def test_sampling_params_list_for_batches() -> None:
    meta = parse_request(
        "/generate",
        b'{"text":["a","b"],"sampling_params":[{"max_new_tokens":3},{"max_new_tokens":9}]}',
    )
    assert meta.max_new_tokens == 9


def test_unknown_path_only_generic() -> None:
    meta = parse_request("/v1/responses", b'{"input":"x","stream":true,"n":"weird"}')
    assert meta.stream is True and meta.batch is None and meta.input_tokens == 0


@pytest.mark.parametrize(
    "path,body,field",
    [
        ("/generate", b'{"stream":"yes"}', "stream"),
        ("/v1/chat/completions", b'{"stream":1,"messages":[]}', "stream"),
        ("/generate", b'{"input_ids":"1 2 3"}', "input_ids"),
        ("/generate", b'{"input_ids":[[1],2]}', "input_ids"),
        ("/generate", b'{"input_ids":["a"]}', "input_ids"),
        ("/generate", b'{"text":5}', "text"),
        ("/generate", b'{"text":["a",5]}', "text"),
        ("/generate", b'{"text":{"a":1}}', "text"),
        ("/v1/chat/completions", b'{"messages":"hi"}', "messages"),
        ("/v1/chat/completions", b'{"messages":["hi"]}', "messages"),
        ("/v1/chat/completions", b'{"messages":[{"role":"user","content":5}]}', "content"),
        ("/v1/chat/completions", b'{"messages":[],"n":"2"}', "n"),
        ("/v1/chat/completions", b'{"messages":[],"n":2.0}', "n"),
        ("/v1/chat/completions", b'{"messages":[],"n":1099511627776}', "n"),
        ("/v1/completions", b'{"prompt":"x","n":true}', "n"),
        ("/generate", b'{"text":"a","sampling_params":[1]}', "sampling_params"),
        ("/generate", b'{"text":"a","sampling_params":"greedy"}', "sampling_params"),
        ("/generate", b'{"text":"a","sampling_params":{"max_new_tokens":"8"}}', "max_new_tokens"),
        ("/generate", b'{"text":"a","sampling_params":{"max_new_tokens":true}}', "max_new_tokens"),
        ("/generate", b'{"text":"a","sampling_params":{"n":"2"}}', "n"),
        ("/v1/completions", b'{"prompt":"a","max_tokens":"8"}', "max_tokens"),
        ("/v1/chat/completions", b'{"messages":[],"max_completion_tokens":1.5}', "max_completion_tokens"),
        ("/v1/completions", b'{"prompt":7}', "prompt"),
        ("/v1/completions", b'{"prompt":[{"a":1}]}', "prompt"),
        ("/v1/completions", b'{"prompt":["a",[1]]}', "prompt"),
        ("/v1/chat/completions", b'{"messages":[],"model":5}', "model"),
        ("/generate", b'{"text":"a","return_logprob":"true"}', "return_logprob"),
        ("/generate", b'{"text":"a","return_logprob":[1]}', "return_logprob"),
    ],
)
def test_bad_types_are_400_naming_the_field(path: str, body: bytes, field: str) -> None:
    with pytest.raises(RouterError) as info:
        parse_request(path, body)
    assert info.value.status == 400 and info.value.code == "bad_request"
    assert field in info.value.message


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"{",
        b"[]",
        b"[1]",
        b'"text"',
        b"null",
        b"1",
        b'{"a":1} x',
        b"\xff\xfe{}",
        b"\xef\xbb\xbf{}",
        b'{"a":"\xc3"}',
        b"[" * 100_000,
        b'{"a":' + b"9" * 5000 + b"}",
        '{"a":1}'.encode("utf-16"),
    ],
)
def test_malformed_bodies_are_400(body: bytes) -> None:
    with pytest.raises(RouterError) as info:
        parse_request("/generate", body)
    assert info.value.status == 400


# --- input token counts ------------------------------------------------------


def test_input_tokens() -> None:
    assert parse_request("/generate", b'{"input_ids":[1,2,3,4,5]}').input_tokens == 5
    assert parse_request("/generate", b'{"input_ids":[[1,2],[3]]}').input_tokens == 3
    assert parse_request("/generate", b'{"text":"abcdefgh"}').input_tokens == 2
    assert parse_request("/generate", b'{"text":"abcdefghi"}').input_tokens == 3
    chat = parse_request(
        "/v1/chat/completions",
        b'{"messages":[{"role":"system","content":"abcd"},'
        b'{"role":"user","content":[{"type":"text","text":"abcdefgh"},{"type":"image_url","image_url":{}}]}]}',
    )
    assert chat.input_tokens == 2 * 4 + 1 + 2
    assert parse_request("/v1/completions", b'{"prompt":["abcd","abcdefgh"]}').input_tokens == 3


def test_estimate_tokens_non_ascii_counts_bytes() -> None:
    assert estimate_tokens("") == 0
    assert estimate_tokens("\u4e16\u754c\u4e16\u754c") == 3  # 12 UTF-8 bytes
    assert estimate_tokens("\ud800") == 1  # lone surrogate from JSON "\ud800" must not raise
    assert parse_request("/generate", b'{"text":"\\ud800"}').input_tokens == 1


def test_routing_text() -> None:
    assert parse_request("/generate", b'{"text":"abc"}').routing_text() == "abc"
    assert parse_request("/generate", b'{"text":["p","q"]}').routing_text() == "p"
    # token ids are rendered as text so cache_aware can still match prefixes
    assert parse_request("/generate", b'{"input_ids":[1]}').routing_text() == "1"
    assert parse_request("/generate", b'{"input_ids":[[7,8],[9]]}').routing_text() == "7 8"
    assert parse_request("/v1/completions", b'{"prompt":[5,6]}').routing_text() == "5 6"
    assert parse_request("/generate", b'{"input_ids":[]}').routing_text() is None
    long_ids = parse_request("/generate", json.dumps({"input_ids": list(range(20000))}).encode())
    assert long_ids.routing_text().split() == [str(i) for i in range(8192)]
    assert parse_request("/v1/completions", b'{"prompt":"zz"}').routing_text() == "zz"
    chat = parse_request(
        "/v1/chat/completions", b'{"messages":[{"role":"system","content":"s"},{"role":"user","content":"u"}]}'
    )
    assert chat.routing_text() == "s\nu"


@pytest.mark.parametrize(
    "path, raw",
    [
        ("/generate", b'{"text":"abc","stream":true,"sampling_params":{"max_new_tokens":4}}'),
        ("/generate", b'{"input_ids":[[7,8],[9]]}'),
        ("/generate", '{"text":"\u4e16\u754c"}'.encode()),  # non-ASCII: the whole object decoded
        ("/v1/completions", b'{"prompt":"zz"}'),
        ("/v1/chat/completions", b'{"messages":[{"role":"system","content":"s"},{"role":"user","content":"u"}]}'),
    ],
)
def test_shed_lets_the_decoded_prompt_go_and_a_later_pick_decodes_it_again(path: str, raw: bytes) -> None:
    """A request waiting for its worker holds no decoded prompt; a retry's pick still reads it."""
    text = parse_request(path, raw).routing_text()
    meta = parse_request(path, raw)
    meta.shed()
    assert meta.fields is None and meta.body is raw
    assert meta.routing_text() == text and meta.fields is not None  # (a pick reads them back)
    meta.shed()
    assert meta.obj == json.loads(raw) and meta.fields is not None  # the whole object stands in
    assert meta.routing_text() == text


def test_shed_keeps_fields_it_could_not_decode_again() -> None:
    # Taken by the full parse (a body the field decoder refuses): no bytes to decode again from.
    meta = parse_request("/generate", b'{"text":"abc","sampling_params":{"temperature":NaN}}')
    assert meta.body is None
    meta.shed()
    assert meta.fields is not None and meta.routing_text() == "abc"


# --- logprob merges (protocol.md 3.5) ----------------------------------------

PREFILL_LP = [[-1.0, 11, None], [-2.0, 12, None]]
DECODE_LP = [[-9.0, 99, None]]


def test_merge_json_observed_example() -> None:
    prefill = json.dumps({"text": "", "meta_info": {"input_token_logprobs": PREFILL_LP}}).encode()
    decode = json.dumps(
        {"text": "out", "meta_info": {"input_token_logprobs": DECODE_LP, "output_token_logprobs": [[-0.5, 7, None]]}}
    ).encode()
    merged = json.loads(merge_logprobs_json(prefill, decode))
    assert merged["meta_info"]["input_token_logprobs"] == PREFILL_LP + DECODE_LP
    assert merged["meta_info"]["output_token_logprobs"] == [[-0.5, 7, None]]
    assert merged["text"] == "out"


def test_merge_json_batch_item_by_item() -> None:
    prefill = json.dumps(
        [
            {"meta_info": {"input_token_logprobs": [[-1.0, 1, None]]}},
            {"meta_info": {"input_token_logprobs": [[-2.0, 2, None]]}},
        ]
    ).encode()
    decode = json.dumps(
        [
            {"meta_info": {"input_token_logprobs": [[-3.0, 3, None]]}},
            {"meta_info": {"input_token_logprobs": None}},
        ]
    ).encode()
    merged = json.loads(merge_logprobs_json(prefill, decode))
    assert merged[0]["meta_info"]["input_token_logprobs"] == [[-1.0, 1, None], [-3.0, 3, None]]
    assert merged[1]["meta_info"]["input_token_logprobs"] == [[-2.0, 2, None]]


@pytest.mark.parametrize(
    "prefill,decode",
    [
        (b"not json", b'{"meta_info":{"input_token_logprobs":[]}}'),
        (b'{"meta_info":{}}', b'{"meta_info":{"input_token_logprobs":[1]}}'),
        (b'{"meta_info":{"input_token_logprobs":[1]}}', b'{"text":"no meta"}'),
        (b'{"meta_info":{"input_token_logprobs":[1]}}', b"oops"),
    ],
)
def test_merge_json_unexpected_shapes_return_decode_unchanged(prefill: bytes, decode: bytes) -> None:
    assert merge_logprobs_json(prefill, decode) is decode


def sse(*objs: object) -> bytes:
    return b"".join(b"data: " + json.dumps(o).encode() + b"\n\n" for o in objs) + b"data: [DONE]\n\n"


def decode_stream() -> bytes:
    return sse(
        {"text": "a", "meta_info": {"input_token_logprobs": DECODE_LP}, "index": 0},
        {"text": "ab", "meta_info": {"input_token_logprobs": []}, "index": 0},
        {"text": "abc", "meta_info": {"id": "x"}, "index": 0},
    )


def events(raw: bytes) -> list[bytes]:
    assert raw.endswith(b"\n\n")
    return raw[:-2].split(b"\n\n")


def run_merger(prefill: bytes, decode: bytes, chunk: int) -> bytes:
    m = SSELogprobMerger()
    for i in range(0, len(prefill), max(chunk, 1)):
        m.feed_prefill(prefill[i : i + chunk])
    out = [m.transform(decode[i : i + chunk]) for i in range(0, len(decode), chunk)]
    out.append(m.flush())
    return b"".join(out)


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64, 10_000])
def test_sse_merge_split_chunks(chunk: int) -> None:
    prefill = sse(
        {"meta_info": {"input_token_logprobs": PREFILL_LP}, "index": 0},
        {"meta_info": {"input_token_logprobs": [[-7.0, 1, None]]}, "index": 0},
    )
    out = run_merger(prefill, decode_stream(), chunk)
    evs = events(out)
    assert len(evs) == 4 and evs[-1] == b"data: [DONE]"
    first = json.loads(evs[0][len(b"data: ") :])
    second = json.loads(evs[1][len(b"data: ") :])
    assert first["meta_info"]["input_token_logprobs"] == PREFILL_LP + DECODE_LP
    assert second["meta_info"]["input_token_logprobs"] == PREFILL_LP
    # Events without the key are relayed byte for byte.
    assert evs[2] == events(decode_stream())[2]


def test_sse_merge_per_index_with_first_event_fallback() -> None:
    prefill = sse(
        {"meta_info": {"input_token_logprobs": [[-1.0, 1, None]]}, "index": 0},
        {"meta_info": {"input_token_logprobs": [[-2.0, 2, None]]}, "index": 1},
    )
    decode = sse(
        {"meta_info": {"input_token_logprobs": []}, "index": 1},
        {"meta_info": {"input_token_logprobs": []}, "index": 0},
        {"meta_info": {"input_token_logprobs": []}, "index": 5},
    )
    evs = events(run_merger(prefill, decode, 5))
    got = [json.loads(e[6:])["meta_info"]["input_token_logprobs"] for e in evs[:3]]
    assert got == [[[-2.0, 2, None]], [[-1.0, 1, None]], [[-1.0, 1, None]]]


def test_sse_merge_without_prefill_logprobs_is_passthrough() -> None:
    m = SSELogprobMerger()
    m.feed_prefill(b"data: [DONE]\n\n")
    assert not m.ready
    raw = decode_stream()
    assert m.transform(raw[:10]) + m.transform(raw[10:]) + m.flush() == raw


def test_sse_merge_passes_error_and_comment_events_verbatim() -> None:
    m = SSELogprobMerger()
    m.feed_prefill(sse({"meta_info": {"input_token_logprobs": PREFILL_LP}}))
    raw = b': keep-alive\n\ndata: {"error": {"message": "x", "status": 500}}\n\ndata: [DONE]\n\n'
    assert m.transform(raw) == raw


def test_sse_merge_non_streaming_prefill_body() -> None:
    m = SSELogprobMerger()
    m.feed_prefill(json.dumps({"meta_info": {"input_token_logprobs": PREFILL_LP}}).encode())
    assert m.ready
    out = m.transform(decode_stream())
    assert json.loads(events(out)[0][6:])["meta_info"]["input_token_logprobs"] == PREFILL_LP + DECODE_LP


def test_sse_merge_unterminated_last_event_flushed() -> None:
    m = SSELogprobMerger()
    m.feed_prefill(sse({"meta_info": {"input_token_logprobs": PREFILL_LP}}))
    assert m.transform(b'data: {"meta_info": {"input_token_logprobs": []}}') == b""
    tail = m.flush()
    assert json.loads(tail[6:])["meta_info"]["input_token_logprobs"] == PREFILL_LP
    assert m.flush() == b""
