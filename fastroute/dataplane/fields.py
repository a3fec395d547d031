"""The fields of a request body the router reads, decoded without the rest of the tree.

A pick needs a handful of top-level keys (model, stream, the token budgets, n, return_logprob,
the prompt or messages for the input length and the routing text, the DP rank keys PD refuses).
``FieldPicker.pick`` reads exactly those, into the same values json gives, or answers None so
that body.py takes its full json parse, whose result or 400 error stands. Two readers; the first
that decides answers:

* the structural scan (:mod:`fastroute.dataplane._jsonscan`): ASCII bodies, string bytes skipped
  16 per step, a chat body's plain-string messages as one ``Chat``. ``parse_request`` on 48 KB
  bodies: /generate 4.1 us, chat 5.0 us, where the msgspec decode below took 16.3 and 33.5 us.
* msgspec's typed decode of just those keys (every other key skipped in C), for what the scan
  leaves undecided (non-ASCII bytes, surrogate escapes, NaN...). Measured in
  bench/field_extract.py against json's C scanner building the whole tree: 0.2-0.75x the time.

msgspec scans a string one byte at a time whether it builds it, skips it or keeps it as
``msgspec.Raw`` (measured and not taken: docs/floor.md); the scan's SIMD loop is what made
skipping a prompt cheap.
"""

from __future__ import annotations

import sys
from typing import Any

import msgspec

from fastroute.dataplane._jsonscan import FieldScan

__all__ = ["READ_FIELDS", "PICKERS", "FieldPicker", "Message"]

_COMMON = ("model", "stream", "routed_dp_rank", "data_parallel_rank")
# Per endpoint (body.py's GENERATE, COMPLETIONS and CHAT paths), what body.py's parsers, the PD
# rank check and RequestMeta.routing_text read.
READ_FIELDS: dict[str, tuple[str, ...]] = {
    "/generate": (*_COMMON, "text", "input_ids", "sampling_params", "return_logprob"),
    "/v1/completions": (*_COMMON, "prompt", "n", "max_tokens", "max_completion_tokens", "return_logprob"),
    "/v1/chat/completions": (*_COMMON, "messages", "n", "max_tokens", "max_completion_tokens", "return_logprob"),
}


class Message(msgspec.Struct, gc=False):
    """One chat message as the router reads it: its ``content`` only (the role and any other key
    are skipped); body.py reads ``content`` as an attribute. Not tracked by the garbage
    collector: decoded JSON holds no cycles, and a long conversation decoded as dicts was a GC
    pass every few requests."""

    content: Any = None


# Fields decoded to a type narrower than Any; a body where one has another shape is refused by
# the decoder and takes the full parse (whose answer, e.g. a 400, stands).
_TYPED: dict[str, Any] = {"messages": list[Message] | None | msgspec.UnsetType}


def _decoder(names: tuple[str, ...]) -> Any:
    # Any-typed fields decode to the values json gives (dict, list, str, int, float, bool, None);
    # UNSET tells an absent key from a null one, as ``key in obj`` does.
    struct = msgspec.defstruct("Fields", [(n, _TYPED.get(n, Any), msgspec.UNSET) for n in names])
    return msgspec.json.Decoder(struct)


_UNSET = msgspec.UNSET
_GENERIC = msgspec.json.Decoder()
# json refuses integers of more than this many digits (Python's int limit; 0: none).
_DIGITS = sys.get_int_max_str_digits() if hasattr(sys, "get_int_max_str_digits") else 0


def _long_digit_run(body: bytes) -> bool:
    """Whether ``body`` may hold a run of more than _DIGITS digits (a number json refuses).

    A run of L >= _DIGITS + 1 digits contains a whole aligned block of (_DIGITS + 2) // 2 bytes,
    so testing one byte per block (and, for a digit, the block) finds every such run; a block
    of digits inside a string only sends the body to the full parse, which is never wrong.
    """
    limit = _DIGITS
    n = len(body)
    if not limit or n <= limit:
        return False
    block = (limit + 2) // 2
    for start in range(0, n - block + 1, block):
        c = body[start]
        if 48 <= c <= 57 and body[start : start + block].isdigit():
            return True
    return False


class FieldPicker:
    """One endpoint's decoder of READ_FIELDS."""

    __slots__ = ("decoder", "names", "scanner")

    def __init__(self, names: tuple[str, ...]) -> None:
        self.decoder = _decoder(names)
        self.names = names
        self.scanner = FieldScan(names)

    def pick(self, body: bytes) -> dict | None:
        """The ``names`` present in the body, as json would decode them; None: take the full parse.

        None for every body json might decode differently or refuse: malformed JSON, NaN/Infinity
        and out-of-range floats, escaped lone surrogates, a top level that is not an object, and
        bytes that are not UTF-8 and integers over Python's digit limit (both checked here: the
        decoder skips other keys without converting them). A body with non-ASCII bytes is
        decoded whole (the generic decoder validates UTF-8 as it goes): the answer is then
        the whole object. One limit of json is not mirrored:
        nesting within a few levels of json's recursion limit in a key the router does not read
        is forwarded (the worker judges it) where the full parse answered 400.

        First the structural scan (``_jsonscan.FieldScan``: ASCII bodies, strings skipped 16
        bytes per step); what it does not decide takes the msgspec decoders.
        """
        out = self.scanner.scan(body)
        if out is not None:
            return out
        if _long_digit_run(body):
            return None
        if not body.isascii():
            # The fields-only decoder does not validate skipped strings, the generic one
            # validates every string as it builds it: for a body with non-ASCII bytes that is
            # cheaper than a separate UTF-8 pass, and it gives the whole object.
            try:
                whole = _GENERIC.decode(body)
            except (msgspec.DecodeError, RecursionError, ValueError):
                return None
            return whole if type(whole) is dict else None
        try:
            picked = self.decoder.decode(body)
        except (msgspec.DecodeError, RecursionError, ValueError):
            return None
        out = {}
        for name in self.names:
            value = getattr(picked, name)
            if value is not _UNSET:
                out[name] = value
        return out


PICKERS: dict[str, FieldPicker] = {p: FieldPicker(names) for p, names in READ_FIELDS.items()}
