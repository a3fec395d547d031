"""Pure parts of bench/memory.py: the client's stream check, the slow backend's answers and the
table. No sockets, no processes, no real runs."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "memory.py"
_spec = importlib.util.spec_from_file_location("bench_memory", _PATH)
assert _spec is not None and _spec.loader is not None
mem = importlib.util.module_from_spec(_spec)
sys.modules["bench_memory"] = mem
_spec.loader.exec_module(mem)


class _Transport:
    def __init__(self) -> None:
        self.out = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.out += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def _stream() -> Any:
    loop = asyncio.new_event_loop()
    s = mem._Stream(b"POST / HTTP/1.1\r\n\r\n", loop.create_future())
    s.connection_made(_Transport())
    return s, loop


def test_stream_counts_events_split_across_reads() -> None:
    s, loop = _stream()
    try:
        assert s.transport.out.startswith(b"POST")
        s.data_received(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n1a\r\nda")
        assert s.status == 200 and s.events == 0 and not s.first.done()
        s.data_received(b'ta: {"x":1}\n\n\r\n')  # "data: " straddles the two reads
        assert s.events == 1 and s.first.done()
        s.data_received(b"10\r\ndata: {}\n\n\r\n10\r\ndata: {}\n\n\r\n")
        assert s.events == 3
        mem._check([s], "test")
    finally:
        loop.close()


def test_check_fails_loudly_on_a_bad_status_or_a_stream_closed_early() -> None:
    bad, loop = _stream()
    cut, loop2 = _stream()
    try:
        bad.data_received(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 0\r\n\r\n")
        assert bad.error == "status 503" and bad.first.done()
        cut.connection_lost(None)
        with pytest.raises(SystemExit, match="2 of 2 streams failed"):
            mem._check([bad, cut], "test")
    finally:
        loop.close()
        loop2.close()


def _feed(proto: Any, data: bytes) -> bytes:
    t = _Transport()
    proto.connection_made(t)
    proto.data_received(data)
    return t.out


def test_backend_answers_registration_and_streams_slowly() -> None:
    streams: set[Any] = set()
    info = _feed(mem._Backend(mem._answers(), streams), b"GET /server_info HTTP/1.1\r\nHost: x\r\n\r\n")
    head, _, body = info.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and json.loads(body)["dp_size"] == 1
    missing = _feed(mem._Backend(mem._answers(), streams), b"GET /nope HTTP/1.1\r\n\r\n")
    assert missing.startswith(b"HTTP/1.1 404")
    proto = mem._Backend(mem._answers(), streams)
    out = _feed(proto, b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: 2\r\n\r\n{}")
    assert out.startswith(b"HTTP/1.1 200") and b"text/event-stream" in out
    assert out.count(b"data: ") == 1 and streams == {proto}  # the rest comes from the timer
    proto.connection_lost(None)
    assert not streams


def test_table_rows() -> None:
    row = {
        "n": 5000,
        "idle": 47_000,
        "held": 80_000,
        "peak": 81_000,
        "after": 81_500,
        "per_stream": (81_000 - 47_000) * 1024 / 5000,
    }
    lines = mem.table([row]).splitlines()
    assert lines[0].startswith("| streams |") and len(lines) == 3
    assert lines[2] == "| 5,000 | 45.9 | 78.1 | 79.1 | 6.8 | 79.6 |"
