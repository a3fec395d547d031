"""The replica sync's wake connection (the SUBSCRIBE on ``fastroute:{replicas}:wake``) dropped
by the network without a reset is noticed: a replica whose wake connection goes silent (a TCP
proxy between it and a real redis-server stops forwarding that one connection, as a NAT or
load balancer forgetting an idle flow would) pings it, finds no answer, subscribes again on a
new connection and sees a peer's change long before its next heartbeat; the first loss is one
WARNING."""

from __future__ import annotations

import asyncio
import logging

from fastroute.core.table import COL_IN_FLIGHT, COL_OTHERS_IN_FLIGHT
from tests.integration.conftest import run, until
from tests.integration.redis_fixture import redis_server  # noqa: F401  (the fixture)
from tests.integration.sync_replicas import Replica

N = 8


class SilencingProxy:
    """A loopback TCP proxy to Redis that can silence the subscribed connections it carries:
    their bytes are read and dropped both ways, the sockets stay open (no FIN, no RST)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.subscribers: list[dict] = []  # per connection that sent SUBSCRIBE: {"silent": bool}
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self._server.sockets[0].getsockname()[1]

    def silence_subscribers(self) -> int:
        n = 0
        for c in self.subscribers:
            if not c["silent"]:
                c["silent"] = True
                n += 1
        return n

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection("127.0.0.1", self.port)
        conn = {"silent": False}

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter, upstream: bool) -> None:
            try:
                while data := await src.read(65536):
                    if upstream and b"SUBSCRIBE" in data.upper() and conn not in self.subscribers:
                        self.subscribers.append(conn)
                    if conn["silent"]:
                        continue  # lost in the network
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        for t in (pump(reader, up_w, True), pump(up_r, writer, False)):
            task = asyncio.get_running_loop().create_task(t)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for t in list(self._tasks):
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


def _replica(url: str, rid: str, interval: float, ttl: float) -> Replica:
    return Replica(url, rid, interval, ttl, N, "10.4.0")


def test_a_silently_dropped_wake_connection_is_replaced_and_wakes_resume(redis_server, caplog):  # noqa: F811
    async def body():
        interval = 0.25
        # ttl 30 s: quiet heartbeats up to 10 s apart, so only a wake explains a view within 4 s
        proxy = SilencingProxy(redis_server.port)
        proxy_url = f"redis://127.0.0.1:{await proxy.start()}/0"
        a = _replica(redis_server.url, "a", interval, 30.0)
        b = _replica(proxy_url, "b", interval, 30.0)  # b reads its wakes through the proxy
        loop = asyncio.get_running_loop()
        try:
            for r in (a, b):
                r.sync.start()
            await until(lambda: a.sync.peers == 1 and b.sync.peers == 1, 5, "two replicas synced")
            for value in (5, 2):  # twice: the second loss is noticed as well, and not warned again
                await until(lambda: b.sync._pace.listening and len(proxy.subscribers) > 0, 5, "b subscribed")
                # b just had a heartbeat and the next one is at least 5 s away
                await until(lambda: b.sync._pace._next - loop.time() >= 5.0, 30, "b quiet")
                assert proxy.silence_subscribers() == 1  # b's wake connection: gone without a word
                a.table.cells.store(3, COL_IN_FLIGHT, value)
                await until(lambda v=value: b.table.get(3, COL_OTHERS_IN_FLIGHT) == v, 4.0, f"b sees {value}")
            assert len(proxy.subscribers) == 3  # subscribed anew after each loss
            assert b.sync.up and b.sync.errors == 0  # the ticks' own connection was never touched
        finally:
            await a.close()
            await b.close()
            await proxy.close()

    with caplog.at_level(logging.INFO, logger="fastroute.replica"):
        run(body(), 60)
    silent = [r for r in caplog.records if "went silent" in r.getMessage()]
    assert [r.levelno for r in silent] == [logging.WARNING]
