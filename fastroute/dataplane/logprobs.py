"""Response side of PD: the prefill's input logprobs merged into the decode's answer.

With ``return_logprob`` the prefill computes the input-token logprobs and the
decode only the output ones; the client expects both, so the prefill's
``meta_info.input_token_logprobs`` are prepended to the decode's (protocol.md
3.5), for a JSON answer (``merge_logprobs_json``, whole bodies) and for an SSE
stream (``SSELogprobMerger``, event by event as decode bytes arrive). Only
documents that change are re-encoded; everything else is relayed byte for byte.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["merge_logprobs_json", "SSELogprobMerger"]

_compact = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def _prefill_logprobs(obj: Any) -> list | None:
    if type(obj) is dict:
        meta = obj.get("meta_info")
        if type(meta) is dict:
            lp = meta.get("input_token_logprobs")
            if type(lp) is list:
                return lp
    return None


def _prepend(prefill_lp: list, obj: Any) -> bool:
    """Prepend prefill logprobs to obj.meta_info.input_token_logprobs in place."""
    if type(obj) is not dict:
        return False
    meta = obj.get("meta_info")
    if type(meta) is not dict or "input_token_logprobs" not in meta:
        return False
    cur = meta["input_token_logprobs"]
    if cur is None:
        cur = []
    elif type(cur) is not list:
        return False
    meta["input_token_logprobs"] = prefill_lp + cur
    return True


def merge_logprobs_json(prefill: bytes, decode: bytes) -> bytes:
    """Decode JSON with the prefill's input_token_logprobs prepended.

    Batch responses (JSON lists) are merged item by item.  If either body is
    not the expected shape, the decode body is returned unchanged (the client
    still gets the decode's answer; logprobs are best effort).
    """
    try:
        p = json.loads(prefill)
        d = json.loads(decode)
    except (ValueError, RecursionError, TypeError):
        return decode
    changed = False
    if type(d) is list:
        if type(p) is list:
            for p_item, d_item in zip(p, d):
                lp = _prefill_logprobs(p_item)
                if lp is not None and _prepend(lp, d_item):
                    changed = True
    else:
        lp = _prefill_logprobs(p)
        if lp is not None:
            changed = _prepend(lp, d)
    return _compact(d).encode() if changed else decode


def _event_json(event: bytes) -> Any:
    """The JSON object of a ``data: {...}`` SSE event, or None."""
    if not event.startswith(b"data:"):
        return None
    payload = event[5:].strip()
    if not payload.startswith(b"{"):
        return None
    try:
        return json.loads(payload)
    except (ValueError, RecursionError):
        return None


class SSELogprobMerger:
    """mini_lb-style streaming merge of prefill input logprobs into decode events.

    Use only when the request has ``return_logprob: true``.  Feed the prefill
    SSE body with ``feed_prefill`` (whole or in chunks) before relaying decode
    bytes; then pass every decode chunk through ``transform`` and send what it
    returns; at decode EOF send ``flush()``.

    The first prefill event carrying ``meta_info.input_token_logprobs`` for each
    ``index`` supplies that index's prefix (mini_lb uses the very first event for
    everything; that is the fallback for indexes the prefill did not report).
    Decode events are split on the blank line (``\\n\\n``, SGLang's framing);
    partial events are held until complete.  Events that need no change are
    relayed byte for byte; only events whose ``meta_info`` has
    ``input_token_logprobs`` are re-encoded as ``data: <json>\\n\\n``.
    """

    __slots__ = ("_pbuf", "_first", "_by_index", "_buf", "_scan")

    def __init__(self) -> None:
        self._pbuf = bytearray()
        self._first: list | None = None
        self._by_index: dict[int, list] = {}
        self._buf = bytearray()
        self._scan = 0

    @property
    def ready(self) -> bool:
        """True once some prefill input logprobs are known."""
        return self._first is not None

    def feed_prefill(self, data: bytes) -> None:
        buf = self._pbuf
        buf += data
        start = 0
        while True:
            i = buf.find(b"\n\n", start)
            if i < 0:
                break
            self._prefill_event(bytes(buf[start:i]))
            start = i + 2
        del buf[:start]
        # A non-streaming prefill answer (one JSON document, no SSE framing).
        if buf[:1] == b"{" and self._first is None:
            try:
                obj = json.loads(buf)
            except (ValueError, RecursionError):
                return
            self._record(obj)
            buf.clear()

    def _prefill_event(self, event: bytes) -> None:
        obj = _event_json(event)
        if obj is not None:
            self._record(obj)

    def _record(self, obj: Any) -> None:
        lp = _prefill_logprobs(obj)
        if lp is None:
            return
        index = obj.get("index", 0)
        if type(index) is not int:
            index = 0
        if self._first is None:
            self._first = lp
        self._by_index.setdefault(index, lp)

    def _decode_event(self, event: bytes) -> bytes:
        obj = _event_json(event)
        if type(obj) is not dict:
            return event
        index = obj.get("index", 0)
        lp = self._by_index.get(index) if type(index) is int else None
        if lp is None:
            lp = self._first
        if lp is None or not _prepend(lp, obj):
            return event
        return b"data: " + _compact(obj).encode() + b"\n\n"

    def transform(self, chunk: bytes) -> bytes:
        """Complete decode events of ``chunk`` (plus held bytes), merged."""
        buf = self._buf
        if not buf and self._first is None:
            return bytes(chunk)  # nothing to merge: pure passthrough
        buf += chunk
        out = []
        start = 0
        # Resume the separator search where the previous call stopped (minus
        # one byte for a "\n\n" split across chunks): no quadratic rescans of
        # a large event delivered in small chunks.
        scan = self._scan
        while True:
            i = buf.find(b"\n\n", scan)
            if i < 0:
                break
            end = i + 2
            out.append(self._decode_event(bytes(buf[start:end])))
            start = scan = end
        del buf[:start]
        self._scan = max(len(buf) - 1, 0)
        return b"".join(out)

    def flush(self) -> bytes:
        """Whatever is held at decode EOF (an unterminated last event), merged if possible."""
        buf = self._buf
        if not buf:
            return b""
        rest = bytes(buf)
        buf.clear()
        self._scan = 0
        if self._first is None:
            return rest
        # An unterminated last event; if it is merged it comes back terminated.
        return self._decode_event(rest)
