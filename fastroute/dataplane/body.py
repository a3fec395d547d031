"""Request bodies on the per-request path: parse once, inject without re-serialising.

Owns:
* ``parse_request(path, body) -> RequestMeta``: one decode of the client body
  (of only the keys the router reads, :mod:`fastroute.dataplane.fields`), type checks of
  the fields the router reads (wrong type -> RouterError 400 naming the field), and what
  routing needs: ``stream``, ``batch`` (protocol.md 3.3: None for a scalar request, B for a
  batch of B), ``input_tokens``, ``return_logprob``, ``max_new_tokens``, ``model``.
* ``inject(body, fields)``: splice pre-encoded ``"k":v`` pairs before the final ``}`` of the
  client's bytes, forwarded unchanged apart from them (protocol.md 3.3 [REC]), never
  re-serialised. A key the client sent too comes last and wins with every JSON parser that
  keeps the last duplicate (Python's json, pydantic).
* ``bootstrap_values`` / ``bootstrap_fields`` / ``rank_field_bytes`` / ``draw_room``: the PD
  keys ``bootstrap_host``, ``bootstrap_port``, ``bootstrap_room`` (scalars, or lists of length
  B for batches) and the DP rank key, pre-encoded: a target's once, in its route
  (``bootstrap_values``, ``rank_field_bytes``); per request only the room is drawn
  (``bootstrap_fields``, called by ``PDRelay.attempt``, which adds the decode's rank keys).
  (The response side, prefill logprobs merged into the decode answer: ``logprobs``.)

Batch rules (protocol.md 3.3), per endpoint:

* ``/generate``: ``input_ids`` a list of lists, or ``text`` a list (accepted like
  mini_lb, rejected by the Rust routers) -> batch of ``len``; otherwise scalar,
  whatever ``sampling_params.n``.
* ``/v1/completions``: ``prompt`` an array of strings or of token lists -> batch
  of ``len`` (regardless of ``n``).  A flat array of ints is ONE tokenized prompt
  (OpenAI semantics; SGLang serves it as a single request), so it is scalar.
* ``/v1/chat/completions``: ``n > 1`` -> batch of ``n``; otherwise scalar.

Validation is deliberately shallow where depth costs per-token work: the shape
of ``input_ids`` is decided by its first element and each batch item must be a
list, but the individual ids are not type-checked (the worker validates them;
the router only needs their count).  JSON ``null`` for any field means "absent".
``sampling_params`` may be an object or, as SGLang accepts for batches, a list
of objects.

Input token estimate (``input_tokens``): exact ``len(input_ids)`` when ids are
given (summed over a batch).  For text we have no tokenizer, so
``estimate_tokens`` uses ``ceil(utf8_bytes / 4)``: byte-level BPE vocabularies of
current LLMs average close to 4 bytes per token on English prose and code, and
for CJK text (3 bytes per character) it gives 0.75 tokens per character, in the
range of Qwen/DeepSeek-style vocabularies.  For ASCII text the byte count is
``len(text)`` (no encode); only non-ASCII text pays one ``encode``.  Chat
messages add 4 tokens each for the template.  Measured against the GPT-2 BPE
(the only vocabulary available offline; ``python tests/bench/test_bench_body.py``),
2 KB chunks: English prose est/true 1.07 (mean |error| 9%), Markdown 0.89 (14%),
Python code 0.55 (45%) -- GPT-2 spends one token per indentation space, which
current vocabularies merge, so the code figure overstates the error for them.
smg's 1.3 x words rule measured 0.88 / 0.55 / 0.27 on the same chunks.  The
estimate only feeds the decode input-demand balance, where a consistent
relative measure matters more than the absolute count.
"""

from __future__ import annotations

import json
import json.scanner
from collections.abc import Callable
from functools import lru_cache
from typing import Any, Protocol

from fastroute.dataplane._jsonscan import Chat as _Chat
from fastroute.dataplane._jsonscan import Ids as _Ids
from fastroute.dataplane._splice import object_bounds, with_int
from fastroute.dataplane.fields import PICKERS as _PICKERS
from fastroute.dataplane.fields import Message as _Message
from fastroute.dataplane.idtext import ids_text
from fastroute.errors import CODE_BAD_REQUEST, RouterError

__all__ = [
    "ROOM_LIMIT",
    "MAX_N",
    "INT_LIMIT",
    "RequestMeta",
    "parse_request",
    "estimate_tokens",
    "inject",
    "splice_point",
    "draw_room",
    "rank_field_bytes",
    "bootstrap_values",
    "bootstrap_fields",
]

# Rooms are drawn from [0, ROOM_LIMIT).  SGLang expands a scalar room for n > 1
# to room, room+1, ..., room+n-1, so 2^16 of headroom keeps every derived room
# inside int64 (protocol.md 3.3 [REC]).
ROOM_LIMIT = (1 << 63) - (1 << 16)
# Rejection sampling from 63 random bits accepts with probability 1 - 2^-47; the
# bound only matters for a broken RNG, which then gets a modulo fallback.
_MAX_ROOM_TRIES = 8

GENERATE = "/generate"
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"

_CHAT_TOKENS_PER_MESSAGE = 4
# A chat batch is n rooms drawn and encoded by the router; n comes straight
# from the client, so it is bounded (list batches are bounded by the body size).
MAX_N = 1024


class _RandomBits(Protocol):
    def getrandbits(self, k: int, /) -> int: ...


def _bad(message: str) -> RouterError:
    return RouterError(400, CODE_BAD_REQUEST, message)


ROUTING_IDS_MAX = 8192


class RequestMeta:
    """What the router needs to know about one client request.

    ``obj`` is the parsed body (the proxy may read e.g. ``rid`` from it but must
    not mutate it for forwarding: the original bytes are forwarded). For the
    three inference endpoints it is built on first read, from ``body``: the
    request path reads only ``fields``, the top-level keys the router looks at
    (``READ_FIELDS``), decoded without the rest of the tree. Elsewhere ``fields``
    is the whole object.
    """

    __slots__ = (
        "_obj",
        "body",
        "fields",
        "stream",
        "batch",
        "input_tokens",
        "return_logprob",
        "max_new_tokens",
        "model",
        "path",
        "labels",
        "token_ids",
    )

    def __init__(
        self,
        obj: dict,
        stream: bool = False,
        batch: int | None = None,
        input_tokens: int = 0,
        return_logprob: bool = False,
        max_new_tokens: int | None = None,
        model: str | None = None,
        path: str = "",
        body: bytes | None = None,
    ) -> None:
        self._obj: Any = obj
        self.fields: Any = obj
        self.body = body
        self.stream = stream
        self.batch = batch
        self.input_tokens = input_tokens
        self.return_logprob = return_logprob
        self.max_new_tokens = max_new_tokens
        self.model = model
        self.path = path
        self.labels: Any = None  # the metrics' labels of the request (Telemetry.routed), or None
        self.token_ids: Any = None  # the prompt's ids from --tokenizer-path (tokenize.py)

    @property
    def obj(self) -> Any:
        """The whole parsed body (built on the first read when only ``fields`` were decoded)."""
        if self._obj is None and self.body is not None:
            try:
                self._obj = _loads(str(self.body, "utf-8"))
            except (ValueError, RecursionError):
                # Only bodies the fast decode took and json refuses: integers beyond Python's
                # digit limit, nesting at json's recursion limit (see _pick_fields).
                self._obj = {}
            self.body = None
            if self.fields is None:  # shed: the whole object stands for them (nothing to decode now)
                self.fields = self._obj
        return self._obj

    @obj.setter
    def obj(self, value: Any) -> None:
        # None drops the parse and the bytes it came from (a started response never retries).
        self._obj = value
        self.body = None
        if value is None:
            self.fields = None

    def shed(self) -> None:
        """Drop the decoded fields (the prompt, as large as the body) once a pick has read
        them: nothing reads them while the request waits. Only fields ``body`` can give back
        are dropped; a retry's pick under cache_aware decodes them again (``routing_text``)."""
        if self.body is not None:
            self.fields = None

    def routing_text(self) -> str | None:
        """Text for prefix-aware policies (cache_aware), computed on demand.

        The first prompt of a batch, the chat message contents joined by
        newlines, or None when the request only has token ids.
        """
        obj = self.fields
        if obj is None:
            # Shed after an earlier pick: the same decode of the same bytes (it took them once).
            obj = self.fields = _PICKERS[self.path].pick(self.body)  # type: ignore[arg-type]
        if self.path == CHAT:
            msgs, parts = obj.get("messages"), []
            if type(msgs) is _Chat:  # fields.py's scan: joined in one copy
                return msgs.routing_text()
            for msg in msgs or ():
                content = msg.content if isinstance(msg, _Message) else msg.get("content")
                if type(content) is str:
                    parts.append(content)
                elif type(content) is list:
                    for part in content:
                        if type(part) is dict and type(part.get("text")) is str:
                            parts.append(part["text"])
            return "\n".join(parts) if parts else None
        value = obj.get("prompt") if self.path == COMPLETIONS else obj.get("text")
        if value is None and self.path != COMPLETIONS:
            value = obj.get("input_ids")
        if type(value) is _Ids:  # fields.py's scan: the text from the body's bytes
            return value.text(ROUTING_IDS_MAX)
        if type(value) is list and value and type(value[0]) in (list, str):
            value = value[0]  # a batch: route by its first prompt
        if type(value) is list:
            # Token ids: only the first ROUTING_IDS_MAX (a prefix that long tells cached prompts apart).
            return ids_text(value, ROUTING_IDS_MAX)
        return value if type(value) is str else None

    def routing_ids(self) -> list | None:
        """Token ids for the KV-event prefix index: the router's tokenizer's, else /generate's
        ``input_ids`` (a batch's first), else None."""
        if self.token_ids is not None or self.path == CHAT or self.path == COMPLETIONS:
            return self.token_ids
        obj = self.fields
        if obj is None:
            obj = self.fields = _PICKERS[self.path].pick(self.body)  # type: ignore[arg-type]
        ids = obj.get("input_ids")
        if type(ids) is _Ids:
            ids = ids.tolist()
        ids = ids[0] if type(ids) is list and ids and type(ids[0]) is list else ids
        return ids if type(ids) is list and ids and type(ids[0]) is int else None

    def __repr__(self) -> str:
        return (
            f"RequestMeta(path={self.path!r}, stream={self.stream}, batch={self.batch}, "
            f"input_tokens={self.input_tokens}, return_logprob={self.return_logprob}, "
            f"max_new_tokens={self.max_new_tokens}, model={self.model!r})"
        )


def estimate_tokens(text: str) -> int:
    """ceil(utf8 bytes / 4); see the module docstring for why."""
    # str.isascii() is O(1) in CPython (a flag on the string object), so ASCII
    # text is estimated without touching its characters.
    n = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
    return (n + 3) >> 2


# Counts the router reads (token budgets, n) reach the compiled acquire as int64; JSON
# integers are unbounded, so they are range-checked here, where a bad one is a clear 400,
# never an OverflowError later. 2^62 leaves room for sums of a few counts in int64.
INT_LIMIT = 1 << 62


def _opt_int(obj: dict, key: str, where: str = "") -> int | None:
    value = obj.get(key)
    if value is None:
        return None
    # bool is a subclass of int; JSON true is not a count.
    if type(value) is int and 0 <= value < INT_LIMIT:
        return value
    raise _bad(f"'{where}{key}' must be an integer in [0, 2^62)")


def _batch_tokens(items: list, field: str, kind: type, count: Callable[[Any], int], shape: str) -> int:
    """The input tokens of a batch whose items are each a ``kind`` counted by ``count``; any
    other item is a 400 saying ``field`` must be ``shape``."""
    total = 0
    for item in items:
        if type(item) is not kind:
            raise _bad(f"'{field}' must be {shape}")
        total += count(item)
    return total


_TEXTS = "a string or a list of strings"
_ID_LISTS = "a list of token ids or a list of lists of token ids"


def _parse_generate(obj: dict, meta: RequestMeta) -> None:
    ids = obj.get("input_ids")
    text = obj.get("text")
    if type(ids) is _Ids:  # fields.py's scan: a flat list of ids, counted as it went
        meta.input_tokens = len(ids)
    elif ids is not None:
        if type(ids) is not list:
            raise _bad("'input_ids' must be a list of token ids or a list of lists of token ids")
        if ids and type(ids[0]) is list:
            meta.batch = len(ids)
            meta.input_tokens = _batch_tokens(ids, "input_ids", list, len, _ID_LISTS)
        else:
            if ids and type(ids[0]) is not int:
                raise _bad("'input_ids' must be a list of token ids or a list of lists of token ids")
            meta.input_tokens = len(ids)
    if text is not None:
        if type(text) is str:
            if ids is None:
                meta.input_tokens = estimate_tokens(text)
        elif type(text) is list:
            tokens = _batch_tokens(text, "text", str, estimate_tokens, _TEXTS)
            if ids is None:
                # input_ids, when also given, decides the shape (SGLang itself
                # rejects requests carrying both).
                meta.batch = len(text)
                meta.input_tokens = tokens
        else:
            raise _bad("'text' must be a string or a list of strings")

    sp = obj.get("sampling_params")
    if sp is not None:
        if type(sp) is dict:
            meta.max_new_tokens = _opt_int(sp, "max_new_tokens", "sampling_params.")
            _opt_int(sp, "n", "sampling_params.")
        elif type(sp) is list:
            # SGLang's per-item sampling params for a batch; the largest budget
            # is the one that bounds the request.
            best = None
            for item in sp:
                if type(item) is not dict:
                    raise _bad("'sampling_params' must be an object (or a list of objects for a batch)")
                m = _opt_int(item, "max_new_tokens", "sampling_params.")
                _opt_int(item, "n", "sampling_params.")
                if m is not None and (best is None or m > best):
                    best = m
            meta.max_new_tokens = best
        else:
            raise _bad("'sampling_params' must be an object")

    rl = obj.get("return_logprob")
    if rl is not None:
        if type(rl) is bool:
            meta.return_logprob = rl
        elif type(rl) is list:
            for flag in rl:
                if type(flag) is not bool:
                    raise _bad("'return_logprob' must be a boolean or a list of booleans")
            meta.return_logprob = True in rl
        else:
            raise _bad("'return_logprob' must be a boolean or a list of booleans")


def _openai_common(obj: dict, meta: RequestMeta) -> int | None:
    n = _opt_int(obj, "n")
    max_completion = _opt_int(obj, "max_completion_tokens")
    max_tokens = _opt_int(obj, "max_tokens")
    meta.max_new_tokens = max_completion if max_completion is not None else max_tokens
    rl = obj.get("return_logprob")
    if rl is not None:
        if type(rl) is not bool:
            raise _bad("'return_logprob' must be a boolean")
        meta.return_logprob = rl
    return n


def _parse_completions(obj: dict, meta: RequestMeta) -> None:
    _openai_common(obj, meta)
    prompt = obj.get("prompt")
    if prompt is None:
        return
    if type(prompt) is str:
        meta.input_tokens = estimate_tokens(prompt)
    elif type(prompt) is list:
        if not prompt:
            meta.batch = 0
            return
        first = type(prompt[0])
        if first is str:
            meta.batch = len(prompt)
            meta.input_tokens = _batch_tokens(prompt, "prompt", str, estimate_tokens, _TEXTS)
        elif first is list:
            meta.batch = len(prompt)
            meta.input_tokens = _batch_tokens(prompt, "prompt", list, len, _ID_LISTS)
        elif first is int:
            meta.input_tokens = len(prompt)  # one tokenized prompt
        else:
            raise _bad("'prompt' must be a string, a list of strings or a list of token ids")
    else:
        raise _bad("'prompt' must be a string, a list of strings or a list of token ids")


def _parse_chat(obj: dict, meta: RequestMeta) -> None:
    n = _openai_common(obj, meta)
    if n is not None and n > 1:
        if n > MAX_N:
            raise _bad(f"'n' must be at most {MAX_N}")
        meta.batch = n
    messages = obj.get("messages")
    if messages is None:
        return
    if type(messages) is _Chat:  # fields.py's scan: counted as it went
        chat = messages  # (typed in the compiled build: two C field reads)
        meta.input_tokens = chat.count * _CHAT_TOKENS_PER_MESSAGE + chat.tokens
        return
    if type(messages) is not list:
        raise _bad("'messages' must be a list")
    tokens = 0
    for msg in messages:
        if type(msg) is not dict and type(msg) is not _Message:  # (_Message: fields.py's)
            raise _bad("'messages' must be a list of objects")
        tokens += _CHAT_TOKENS_PER_MESSAGE
        content = msg.content if isinstance(msg, _Message) else msg.get("content")  # (no Python frame)
        if type(content) is str:
            tokens += estimate_tokens(content)
        elif type(content) is list:
            for part in content:
                if type(part) is dict:
                    text = part.get("text")
                    if type(text) is str:
                        tokens += estimate_tokens(text)
        elif content is not None:
            raise _bad("'messages[].content' must be a string or a list of content parts")
    meta.input_tokens = tokens


# json's own C scanner (what json.loads ends in), called directly: a body that is one object
# from its first to its last byte (what clients send) is parsed in one C call, without
# json.loads' three Python-level frames and two whitespace regex matches. Anything else
# (leading or trailing whitespace, extra data, a syntax error) goes through json.loads, which
# gives the same object, or the same error message, as before.
# (typeshed types make_scanner's argument as the scanner class itself; it takes a decoder.)
_scan_object = json.scanner.make_scanner(json.JSONDecoder())  # type: ignore[arg-type]


def _loads(text: str) -> object:
    if text.startswith("{") and text.endswith("}"):
        try:
            obj, end = _scan_object(text, 0)
        except (ValueError, StopIteration):
            return json.loads(text)
        if end == len(text):
            return obj
    return json.loads(text)


def _parse_full(body: bytes) -> dict:
    try:
        # Decoding ourselves (instead of json.loads(bytes)) pins the encoding to
        # UTF-8: json.loads would also accept UTF-16/32 and a BOM, and inject()
        # splices ASCII bytes, which is only correct for UTF-8 bodies.
        obj = _loads(str(body, "utf-8"))
    except UnicodeDecodeError:
        raise _bad("Request body is not valid UTF-8") from None
    except RecursionError:
        raise _bad("Request body is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, over-long integers
        raise _bad(f"Request body is not valid JSON: {exc}") from None
    if type(obj) is not dict:
        raise _bad("Request body must be a JSON object")
    return obj


def parse_request(path: str, body: bytes) -> RequestMeta:
    """Parse a client body once; raise RouterError(400) on anything malformed.

    ``path`` selects the batch rules (a query string, if any, is ignored).
    Other paths get only the generic fields (stream, model), and the whole
    object parsed. The three inference endpoints decode only the keys the
    router reads (``fields.READ_FIELDS`` into ``meta.fields``; ``meta.obj`` is
    parsed when first read); a body that decoder refuses takes the full parse,
    whose result or error is the answer.
    """
    if "?" in path:
        path = path.partition("?")[0]
    if type(body) is not bytes:
        body = bytes(body)
    picker = _PICKERS.get(path)
    obj = None
    if picker is not None:
        obj = picker.pick(body)
    if obj is None:
        obj = _parse_full(body)
        raw = None
    else:
        raw = body

    stream = obj.get("stream")
    if stream is None:
        stream = False
    elif type(stream) is not bool:
        raise _bad("'stream' must be a boolean")
    model = obj.get("model")
    if model is not None and type(model) is not str:
        raise _bad("'model' must be a string")

    meta = RequestMeta(obj, stream, None, 0, False, None, model, path, raw)
    if raw is not None:
        meta._obj = None  # the whole object: built from ``body`` if someone reads it
    if path == GENERATE:  # (branches, not a table: C calls in the compiled build)
        _parse_generate(obj, meta)
    elif path == CHAT:
        _parse_chat(obj, meta)
    elif path == COMPLETIONS:
        _parse_completions(obj, meta)
    return meta


# ---------------------------------------------------------------------------
# Injection


def _object_bounds(body: bytes | bytearray | memoryview) -> tuple[int, bool]:
    """Index of the top-level closing brace, and whether the object is empty.

    Raises RouterError(400) unless the bytes (modulo JSON whitespace) start with
    ``{`` and end with ``}``.  Assumes the body already parsed as JSON (parse_request).
    """
    try:
        return object_bounds(body)
    except ValueError:
        raise _bad("Request body must be a JSON object") from None


def splice_point(body: bytes) -> tuple[int, bytes]:
    """(end, separator): ``body[:end] + separator + fields + body[end:]`` is ``inject(body,
    fields)``. For a caller that frames several legs from one body (PD: one scan for both legs,
    the copy made by each leg's framing); ``separator`` is ``b","``, or ``b""`` for an empty
    object."""
    end, empty = _object_bounds(body)
    return end, (b"" if empty else b",")


def inject(body: bytes, fields: bytes) -> bytes:
    """Splice pre-encoded ``"k":v[,"k2":v2]`` pairs into the top-level object.

    One output allocation; the client bytes (including whitespace, key order,
    number formatting and unicode escapes) are preserved exactly.
    """
    if not fields:
        return bytes(body)
    end, empty = _object_bounds(body)
    view = memoryview(body)
    return b"".join((view[:end], fields if empty else b"," + fields, view[end:]))


# ---------------------------------------------------------------------------
# PD fields


def draw_room(rng: _RandomBits, prefill_dp_size: int = 1, prefill_rank: int | None = None) -> int:
    """A bootstrap room uniform in [0, ROOM_LIMIT).

    With ``prefill_rank`` p and ``prefill_dp_size`` N > 1 the room is moved to
    ``room - room % N + p`` so that a prefill using ``follow_bootstrap_room``
    places it on rank p and the decode derives the same rank (protocol.md 4.3);
    if that lands at or above ROOM_LIMIT (only possible in the last partial
    block of N), it steps back by N, which keeps ``room % N == p``.
    """
    getbits = rng.getrandbits
    for _try in range(_MAX_ROOM_TRIES):
        room = getbits(63)
        if 0 <= room < ROOM_LIMIT:
            break
    else:
        room %= ROOM_LIMIT
    if prefill_rank is not None and prefill_dp_size > 1:
        if not 0 <= prefill_rank < prefill_dp_size:
            raise ValueError(f"prefill_rank {prefill_rank} outside [0, {prefill_dp_size})")
        room += prefill_rank - room % prefill_dp_size
        if room >= ROOM_LIMIT:
            room -= prefill_dp_size
    return room


@lru_cache(maxsize=1024)
def bootstrap_values(host: str, port: int | None) -> tuple[bytes, bytes, bytes]:
    """Encoded ``bootstrap_host`` and ``bootstrap_port`` values of a prefill worker, and the
    three keys of one request up to its room's digits (cached: built once per target)."""
    # A bare IPv6 literal must be bracketed: SGLang builds http://host:port
    # from it (mini_lb does the same; the Rust routers keep the URL's brackets).
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    port_b = b"null" if port is None else str(int(port)).encode()
    host_b = json.dumps(host).encode()
    return host_b, port_b, b'"bootstrap_host":%b,"bootstrap_port":%b,"bootstrap_room":' % (host_b, port_b)


@lru_cache(maxsize=64)
def _field_key(field: str) -> bytes:
    return json.dumps(field).encode() + b":"


@lru_cache(maxsize=4096)
def rank_field_bytes(field: str, rank: int) -> bytes:
    """``"<field>":<rank>``, e.g. ``"data_parallel_rank":3`` for regular --dp-aware.

    Cached: (field, rank) pairs are few (one per target) and asked per request.
    """
    return _field_key(field) + str(int(rank)).encode()


def bootstrap_fields(
    batch: int | None,
    values: tuple[bytes, bytes, bytes],
    rng: _RandomBits,
    prefill_dp_size: int,
    prefill_rank: int | None,
) -> bytes:
    """The three bootstrap keys with a fresh room (or B distinct rooms for a batch of B).

    ``values`` is ``bootstrap_values(host, port)`` of the prefill, encoded once per target.
    """
    host_b, port_b, scalar = values
    if batch is None:
        return with_int(scalar, draw_room(rng, prefill_dp_size, prefill_rank))
    # Rooms of one batch must be distinct (each item is its own KV transfer);
    # a collision among 63-bit draws is astronomically rare but cheap to rule out.
    rooms: set[int] = set()
    order: list[int] = []
    while len(order) < batch:
        room = draw_room(rng, prefill_dp_size, prefill_rank)
        if room not in rooms:
            rooms.add(room)
            order.append(room)
    return b'"bootstrap_host":[%b],"bootstrap_port":[%b],"bootstrap_room":[%b]' % (
        b",".join([host_b] * batch),
        b",".join([port_b] * batch),
        b",".join([b"%d" % r for r in order]),
    )
