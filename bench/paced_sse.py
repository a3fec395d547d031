"""A fake SGLang worker that paces its SSE streams like a real one: one event per write.

uvloop + httptools, callbacks only (so its own cost stays small next to the router's). A POST
whose body has ``"stream":true`` gets ``--events`` chunks ``data: {...}\\n\\n``, each written
alone ``--gap-ms`` (a uniform range) after the previous, then ``data: [DONE]\\n\\n``; any other
POST gets the fixed /generate JSON answer. GETs get the same fixed discovery answers as the
nginx workers of bench/overhead.py (server_info, model_info, loads, ...), so every router
registers it the same way. ``--role prefill`` answers streams at once (a PD prefill's answer is
not what the client waits for).

Usage: ``python bench/paced_sse.py PORT [--role regular|prefill|decode] [--dp-size N]
[--bootstrap-port P] [--events 10] [--gap-ms 20 50]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path

import httptools
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import MODEL, worker_bodies  # noqa: E402

_JSON_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
_SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
    b"transfer-encoding: chunked\r\n\r\n"
)


def sse_events(n: int) -> list[bytes]:
    """n chat-completion chunks then [DONE], each already framed as one HTTP chunk."""
    out = []
    for i in range(n):
        chunk = {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": MODEL,
            "choices": [
                {"index": 0, "delta": {"content": f" tok{i}"}, "finish_reason": "length" if i == n - 1 else None}
            ],
        }
        ev = b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"
        out.append(b"%x\r\n%s\r\n" % (len(ev), ev))
    done = b"data: [DONE]\n\n"
    out.append(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
    return out


class Worker(asyncio.Protocol):
    answers: dict[bytes, bytes] = {}
    events: list[bytes] = []
    gap: tuple[float, float] = (0.02, 0.05)
    pace = True

    def connection_made(self, t: asyncio.BaseTransport) -> None:
        self.t = t
        self.p = httptools.HttpRequestParser(self)
        self.url = b""
        self.body: list[bytes] = []
        self.q: list[tuple[bytes, bytes]] = []
        self.busy = False

    def data_received(self, d: bytes) -> None:
        try:
            self.p.feed_data(d)
        except httptools.HttpParserError:
            self.t.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.busy = True  # stop any pending event chain

    def on_url(self, u: bytes) -> None:
        self.url += u

    def on_body(self, b: bytes) -> None:
        self.body.append(b)

    def on_message_complete(self) -> None:
        req = (self.p.get_method(), b"".join(self.body), self.url)
        self.url, self.body = b"", []
        self.q.append(req)  # type: ignore[arg-type]
        if not self.busy:
            self.next()

    def next(self) -> None:
        if not self.q:
            return
        method, body, url = self.q.pop(0)  # type: ignore[misc]
        path = url.split(b"?", 1)[0]
        if method == b"POST" and (b'"stream":true' in body or b'"stream": true' in body):
            self.busy = True
            self.t.write(_SSE_HEAD)  # type: ignore[attr-defined]
            if not self.pace:
                self.t.writelines(self.events)  # type: ignore[attr-defined]
                self.busy = False
                self.next()
                return
            self.i = 0
            asyncio.get_event_loop().call_later(random.uniform(*self.gap), self.tick)
            return
        ans = self.answers.get(path, b"{}") if method == b"GET" else self.answers[b"/generate"]
        self.t.write(_JSON_HEAD % len(ans) + ans)  # type: ignore[attr-defined]
        self.next()

    def tick(self) -> None:
        if self.t.is_closing():  # type: ignore[attr-defined]
            return
        self.t.write(self.events[self.i])  # type: ignore[attr-defined]
        self.i += 1
        if self.i < len(self.events):
            asyncio.get_event_loop().call_later(random.uniform(*self.gap), self.tick)
        else:
            self.busy = False
            self.next()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("port", type=int)
    ap.add_argument("--role", choices=("regular", "prefill", "decode"), default="regular")
    ap.add_argument("--dp-size", type=int, default=1)
    ap.add_argument("--bootstrap-port", type=int, default=None)
    ap.add_argument("--events", type=int, default=10)
    ap.add_argument("--gap-ms", type=float, nargs=2, default=(20.0, 50.0))
    a = ap.parse_args()
    bodies = worker_bodies(a.role, a.dp_size, a.bootstrap_port)
    paths = {
        "/server_info": "SERVER_INFO",
        "/get_server_info": "SERVER_INFO",
        "/model_info": "MODEL_INFO",
        "/get_model_info": "MODEL_INFO",
        "/v1/models": "MODELS",
        "/v1/loads": "LOADS",
        "/get_load": "GET_LOAD",
        "/generate": "GENERATE",
    }
    Worker.answers = {p.encode(): bodies[k].encode() for p, k in paths.items()}
    for p in ("/health", "/health_generate", "/flush_cache", "/metrics"):
        Worker.answers[p.encode()] = b""
    Worker.events = sse_events(a.events)
    Worker.gap = (a.gap_ms[0] / 1000, a.gap_ms[1] / 1000)
    Worker.pace = a.role != "prefill"
    uvloop.install()
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    loop.run_until_complete(loop.create_server(Worker, "127.0.0.1", a.port, backlog=4096))
    loop.run_forever()


if __name__ == "__main__":
    main()
