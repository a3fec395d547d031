"""Data-path test harness: a recording fake SGLang worker and an in-process router.

``DataWorker`` is a real loopback HTTP/1.1 server (asyncio + httptools) that
answers the registration/monitor endpoints (/health, /server_info with dp_size,
/model_info, /v1/loads, /v1/models) and the inference paths. Every inference
request is recorded (path, headers, raw body). Requests can be held open until
the test releases an explicit gate (``hold()`` / ``release()``), responses can be
streamed as SSE, fail with a status, or the worker can die mid-stream.

``Router`` starts ``fastroute.runtime.server.Server`` on an ephemeral port inside the
test's event loop and waits until the registry is ready. ``RawClient`` speaks
raw HTTP/1.1 over a socket so tests can assert on exact bytes, keep-alive and
pipelining. Every wait is bounded (``until``), no test sleeps and hopes.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httptools
import uvloop

from fastroute.config import Config
from fastroute.runtime.server import Server

INFERENCE = ("/generate", "/v1/completions", "/v1/chat/completions")


def run(coro: Awaitable[Any], timeout: float = 30.0) -> Any:
    """Run one async test body on uvloop with a hard timeout."""

    async def bounded() -> Any:
        return await asyncio.wait_for(coro, timeout)

    return uvloop.run(bounded())


def wait_port(port: int, timeout: float = 20.0, poll: float = 0.05) -> bool:
    """Block until something accepts TCP connections on 127.0.0.1:``port`` (a router started as a
    subprocess); False if nothing did within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), 0.2).close()
            return True
        except OSError:
            time.sleep(poll)
    return False


async def until(cond: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    """Poll ``cond`` until true; fail the test after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.005)


async def refuses(port: int) -> bool:
    """Nothing accepts TCP connections on 127.0.0.1:``port`` any more (a router that closed)."""
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return True
    writer.close()
    return False


@dataclass
class Rec:
    method: str
    path: str
    headers: dict[str, str]
    raw_headers: list[tuple[bytes, bytes]]
    body: bytes
    conn_id: int

    @property
    def json(self) -> Any:
        return json.loads(self.body)


class DataWorker:
    """Fake SGLang worker (see module docstring). Knobs are plain attributes."""

    paths: tuple[str, ...] = INFERENCE  # paths answered like inference (subclasses add routes)

    def __init__(self, dp_size: int = 1, role: str = "regular") -> None:
        self.dp_size = dp_size
        self.role = role
        self.port = 0
        self.requests: list[Rec] = []
        self.gate: asyncio.Event | None = None  # hold inference requests before the head
        self.stream_gate: asyncio.Event | None = None  # hold SSE streams after the first event
        self.head_gate: asyncio.Event | None = None  # hold SSE streams after the head (prefill)
        self.held = 0
        self.status = 200
        self.error_body = b'{"error": {"message": "worker said no"}}'
        self.error_headers = b""  # extra header lines of an error answer
        self.events = 3
        self.die_after: int | None = None  # abort the connection after this many SSE events
        self.input_logprobs: list = [[-1.0, 11, None], [-2.0, 12, None]]
        self.connections = 0
        self.aborted = 0  # client side vanished while we were answering
        self.sse_chunked = True
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[_WorkerConn] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def name(self) -> str:
        return f"{self.role}:{self.port}"

    async def start(self) -> DataWorker:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(lambda: _WorkerConn(self), "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for c in list(self._conns):
                c.transport.abort()
            self._server = None

    def hold(self) -> None:
        self.gate = asyncio.Event()

    def release(self) -> None:
        if self.gate is not None:
            self.gate.set()
            self.gate = None

    def inference(self) -> list[Rec]:
        return [r for r in self.requests if r.path in INFERENCE]

    # -- responses ----------------------------------------------------------------
    def control(self, path: str) -> tuple[int, bytes] | None:
        if path == "/health" or path == "/health_generate":
            return 200, b""
        if path in ("/server_info", "/get_server_info"):
            info = {
                "model_path": "/models/fake-model",
                "dp_size": self.dp_size,
                "tp_size": 1,
                "max_total_num_tokens": 100000,
                "disaggregation_mode": "null" if self.role == "regular" else self.role,
            }
            return 200, json.dumps(info).encode()
        if path in ("/model_info", "/get_model_info"):
            return 200, b'{"model_path": "/models/fake-model", "is_generation": true}'
        if path == "/v1/loads":
            loads = [
                {
                    "dp_rank": r,
                    "num_running_reqs": 0,
                    "num_waiting_reqs": 0,
                    "num_total_reqs": 0,
                    "num_used_tokens": 0,
                    "max_total_num_tokens": 100000,
                }
                for r in range(self.dp_size)
            ]
            return 200, json.dumps({"dp_rank_count": self.dp_size, "loads": loads}).encode()
        if path == "/v1/models":
            return 200, b'{"object": "list", "data": [{"id": "fake-model", "object": "model"}]}'
        return None

    def sse_event(self, i: int, obj: dict) -> bytes:
        ev: dict[str, Any] = {"text": f" tok{i} {self.name}", "index": 0, "meta_info": {"id": "x"}}
        if obj.get("return_logprob"):
            ev["meta_info"]["input_token_logprobs"] = self.input_logprobs
        return b"data: " + json.dumps(ev).encode() + b"\n\n"

    def json_body(self, obj: dict) -> bytes:
        doc: dict[str, Any] = {"text": f"hello from {self.name}", "meta_info": {"id": "x"}}
        if obj.get("return_logprob"):
            doc["meta_info"]["input_token_logprobs"] = self.input_logprobs
        if "messages" in obj:  # OpenAI chat shape, for the openai client
            doc = {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "created": 0,
                "model": "fake-model",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": f"hi from {self.name}"},
                        "finish_reason": "stop",
                    }
                ],
            }
        return json.dumps(doc).encode()

    def chat_chunk(self, i: int) -> bytes:
        doc = {
            "id": "chatcmpl-1",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": "fake-model",
            "choices": [{"index": 0, "delta": {"content": f"t{i} "}, "finish_reason": None}],
        }
        return b"data: " + json.dumps(doc).encode() + b"\n\n"


class _WorkerConn(asyncio.Protocol):
    _ids = 0

    def __init__(self, w: DataWorker) -> None:
        self.w = w
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        _WorkerConn._ids += 1
        self.id = _WorkerConn._ids
        self.busy = False
        self.lost = False
        self._reset()

    def _reset(self) -> None:
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.w.connections += 1
        self.w._conns.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.w._conns.discard(self)
        if self.busy:
            self.w.aborted += 1

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
            self.transport.close()

    def on_message_begin(self) -> None:
        self._reset()

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        u = httptools.parse_url(self._url)
        rec = Rec(
            self.parser.get_method().decode(),
            u.path.decode(),
            {k.decode().lower(): v.decode() for k, v in self._headers},
            list(self._headers),
            b"".join(self._body),
            self.id,
        )
        self.w.requests.append(rec)
        self.busy = True
        asyncio.get_running_loop().create_task(self._respond(rec, self.parser.should_keep_alive()))

    def _write(self, data: bytes) -> bool:
        if self.lost:
            return False
        self.transport.write(data)
        return True

    async def _respond(self, rec: Rec, keep: bool) -> None:
        w = self.w
        ctl = w.control(rec.path)
        if ctl is not None:
            status, body = ctl
            self._write(
                b"HTTP/1.1 %d X\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
                % (status, len(body), body)
            )
            self.busy = False
            return
        if rec.path not in w.paths:
            self._write(b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\n\r\n")
            self.busy = False
            return
        gate = w.gate
        if gate is not None:
            w.held += 1
            try:
                await gate.wait()
            finally:
                w.held -= 1
        if self.lost:
            return
        obj = json.loads(rec.body) if rec.body else {}
        if w.status != 200:
            body = w.error_body
            self._write(
                b"HTTP/1.1 %d Err\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                b"%b\r\n%b" % (w.status, len(body), w.error_headers, body)
            )
            self.busy = False
            return
        if obj.get("stream"):
            await self._stream(rec, obj)
        else:
            body = w.json_body(obj)
            self._write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nserver: fake\r\n"
                b"content-length: %d\r\n\r\n%b" % (len(body), body)
            )
        self.busy = False
        if not keep and not self.lost:
            self.transport.close()

    async def _stream(self, rec: Rec, obj: dict) -> None:
        w = self.w
        chat = rec.path == "/v1/chat/completions" and "messages" in obj
        self._write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            + (b"transfer-encoding: chunked\r\n" if w.sse_chunked else b"connection: close\r\n")
            + b"\r\n"
        )
        if w.head_gate is not None:  # SGLang sends its head, then the first event after prefill
            w.held += 1
            try:
                await w.head_gate.wait()
            finally:
                w.held -= 1
            if self.lost:
                return
        for i in range(w.events):
            ev = w.chat_chunk(i) if chat else w.sse_event(i, obj)
            if not self._write(b"%x\r\n%b\r\n" % (len(ev), ev) if w.sse_chunked else ev):
                return
            await asyncio.sleep(0)  # separate writes -> separate chunks on the wire
            if w.die_after is not None and i + 1 >= w.die_after:
                self.transport.abort()
                return
            if i == 0 and w.stream_gate is not None:
                w.held += 1
                try:
                    await w.stream_gate.wait()
                finally:
                    w.held -= 1
                if self.lost:
                    return
        done = b"data: [DONE]\n\n"
        if w.sse_chunked:
            self._write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(done), done))
        else:
            self._write(done)
            self.transport.close()


# ------------------------------------------------------------------------------ router


class Router:
    """fastroute Server in this event loop on an ephemeral port, plus helpers."""

    def __init__(self, **cfg: Any) -> None:
        cfg.setdefault("host", "127.0.0.1")
        cfg.setdefault("port", 0)
        cfg.setdefault("policy", "round_robin")
        cfg.setdefault("worker_startup_check_interval", 1)
        cfg.setdefault("disable_health_check", True)
        cfg.setdefault("shutdown_grace_period_secs", 1)
        cfg.setdefault("prometheus_host", "127.0.0.1")
        cfg.setdefault("prometheus_port", 0)
        self.config = Config(**cfg)
        self.server = Server(self.config)

    async def __aenter__(self) -> Router:
        await self.server.start()
        await until(self.server.registry.ready, 10.0, "workers registered")
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.server.stop(grace=0.5)

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def in_flight(self, worker: DataWorker) -> int:
        """Sum of the router's in-flight counters over the worker's targets."""
        w = self.server.registry.find(worker.url)
        return sum(self.server.table.in_flight(t) for t in w.targets)

    def rank_in_flight(self, worker: DataWorker) -> list[int]:
        w = self.server.registry.find(worker.url)
        return [self.server.table.in_flight(t) for t in w.targets]


async def workers(n: int, **kw: Any) -> list[DataWorker]:
    return [await DataWorker(**kw).start() for _ in range(n)]


# ------------------------------------------------------------------------------ raw client


class Response:
    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.chunks: list[bytes] = []
        self.done = False
        self.chunked = False

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    @property
    def json(self) -> Any:
        return json.loads(self.body)


class _RespParser:
    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.responses: list[Response] = []
        self.cur: Response | None = None

    def on_message_begin(self) -> None:
        self.cur = Response()
        self.responses.append(self.cur)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.cur.headers[name.decode().lower()] = value.decode()  # type: ignore[union-attr]

    def on_headers_complete(self) -> None:
        self.cur.status = self.parser.get_status_code()  # type: ignore[union-attr]
        self.cur.chunked = "chunked" in self.cur.headers.get("transfer-encoding", "")  # type: ignore[union-attr]

    def on_body(self, body: bytes) -> None:
        self.cur.chunks.append(body)  # type: ignore[union-attr]

    def on_message_complete(self) -> None:
        self.cur.done = True  # type: ignore[union-attr]


class RawClient:
    """Raw HTTP/1.1 over one TCP connection (keep-alive, pipelining, exact bytes)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None
        self.p = _RespParser()
        self.raw = bytearray()
        self.eof = False

    async def connect(self) -> RawClient:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        return self

    def send(self, data: bytes) -> None:
        self.writer.write(data)  # type: ignore[union-attr]

    async def _read_some(self) -> None:
        data = await self.reader.read(65536)  # type: ignore[union-attr]
        if not data:
            self.eof = True
            raise EOFError("connection closed by the router")
        self.raw += data
        self.p.parser.feed_data(data)

    async def response(self, index: int | None = None, timeout: float = 5.0) -> Response:
        """Wait until response ``index`` (default: the next unfinished one) is complete."""

        async def wait() -> Response:
            i = index if index is not None else sum(1 for r in self.p.responses if r.done)
            while not (len(self.p.responses) > i and self.p.responses[i].done):
                await self._read_some()
            return self.p.responses[i]

        return await asyncio.wait_for(wait(), timeout)

    async def head(self, timeout: float = 5.0) -> Response:
        async def wait() -> Response:
            while not (self.p.responses and self.p.responses[-1].status):
                await self._read_some()
            return self.p.responses[-1]

        return await asyncio.wait_for(wait(), timeout)

    async def until_body(self, needle: bytes, timeout: float = 5.0) -> Response:
        async def wait() -> Response:
            while not (self.p.responses and needle in self.p.responses[-1].body):
                await self._read_some()
            return self.p.responses[-1]

        return await asyncio.wait_for(wait(), timeout)

    async def closed(self, timeout: float = 5.0) -> bool:
        """Read until EOF; True if the router closed the connection."""

        async def wait() -> bool:
            try:
                while True:
                    await self._read_some()
            except (EOFError, ConnectionError):
                return True
            except httptools.HttpParserError:
                return True

        return await asyncio.wait_for(wait(), timeout)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.transport.abort()


def post(path: str, obj: Any, headers: dict[str, str] | None = None, keep_alive: bool = True) -> bytes:
    body = json.dumps(obj).encode() if not isinstance(obj, bytes) else obj
    h = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    conn = "" if keep_alive else "Connection: close\r\n"
    return (
        f"POST {path} HTTP/1.1\r\nHost: router\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{h}{conn}\r\n"
    ).encode() + body


def get(path: str, headers: dict[str, str] | None = None) -> bytes:
    h = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    return f"GET {path} HTTP/1.1\r\nHost: router\r\n{h}\r\n".encode()


async def call(port: int, data: bytes, timeout: float = 5.0) -> Response:
    """One request on a fresh connection."""
    c = await RawClient(port).connect()
    try:
        c.send(data)
        return await c.response(timeout=timeout)
    finally:
        c.close()
