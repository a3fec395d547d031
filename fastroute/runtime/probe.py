"""``--health-check-port``: /health, /liveness and /readiness on a listener of their own.

Kubernetes probes must keep getting answers while the proxy's event loop is saturated, or the
kubelet restarts a router that is merely busy. So the probe listener runs in a daemon thread with
its own event loop; it reads readiness through a callable that only looks at state the router
already keeps (the registry's cached readiness), so it never blocks on the proxy's loop.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable

log = logging.getLogger("fastroute.probe")

_OK = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: 2\r\nconnection: close\r\n\r\nOK"
_READY = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 19\r\n"
    b'connection: close\r\n\r\n{"status": "ready"}'
)
_NOT_READY_BODY = (
    b'{"error":{"type":"server_error","code":"service_unavailable",'
    b'"message":"No healthy workers available","param":null}}'
)
_NOT_READY = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%b" % (len(_NOT_READY_BODY), _NOT_READY_BODY)
)
_NOT_FOUND = b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
_HEAD_LIMIT = 8192


class ProbeServer:
    """Serves the three probe paths on ``host:port`` from a thread of its own."""

    def __init__(self, host: str, port: int, ready: Callable[[], bool]) -> None:
        self.host = host
        self.port = port
        self.ready = ready
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None

    def bind(self) -> None:
        """Bind now (in the caller's thread) so a port clash fails start-up, not the thread."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self.port))
            sock.listen(128)
        except OSError:
            sock.close()
            raise
        sock.setblocking(False)
        self._sock = sock
        self.port = sock.getsockname()[1]

    def start(self) -> None:
        if self._sock is None:
            self.bind()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,), name="fastroute-probe", daemon=True)
        self._thread.start()
        started.wait(5)
        log.info("health probes on http://%s:%d (/health, /liveness, /readiness)", self.host, self.port)

    def _run(self, started: threading.Event) -> None:
        loop = self._loop = asyncio.new_event_loop()
        try:
            server = loop.run_until_complete(asyncio.start_server(self._serve, sock=self._sock))
            started.set()
            loop.run_forever()
            server.close()
            loop.run_until_complete(server.wait_closed())
        finally:
            started.set()
            loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5.0)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError, ConnectionError):
            writer.close()
            return
        line = head[: min(len(head), _HEAD_LIMIT)].split(b"\r\n", 1)[0].split()
        path = line[1].split(b"?", 1)[0] if len(line) >= 2 else b""
        if path in (b"/health", b"/liveness"):
            out = _OK
        elif path == b"/readiness":
            try:
                ok = bool(self.ready())
            except Exception:  # readiness must answer, never crash the probe thread
                log.exception("readiness check failed")
                ok = False
            out = _READY if ok else _NOT_READY
        else:
            out = _NOT_FOUND
        if line and line[0] == b"HEAD":
            out = out.split(b"\r\n\r\n", 1)[0] + b"\r\n\r\n"
        writer.write(out)
        try:
            await writer.drain()
        except ConnectionError:
            pass
        writer.close()

    def stop(self) -> None:
        loop = self._loop
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(2)
        self._thread = None
