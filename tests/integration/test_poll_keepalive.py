"""Load polls reuse one kept-alive connection per worker (issue 52: a new TCP connection per poll
and worker was most of what a poll cost the request loop), survive the worker closing it while
idle, and let go of a removed worker's connection."""

from __future__ import annotations

import asyncio

from fakeworker import FakeWorker, Plane, make_config, run, wait_until

from fastroute.core.table import COL_POLLED_AT, COL_POLLED_RUNNING

LOADS = [{"num_running_reqs": 3, "num_waiting_reqs": 0, "num_used_tokens": 10}, {"num_running_reqs": 5}]


class CountingProxy:
    """A real TCP relay in front of a worker: counts the connections whose first request is a
    load poll, can drop the open ones (a server's keep-alive idle timeout)."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.accepted = 0
        self.open: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = await reader.read(65536)
        if first.startswith(b"GET /v1/loads"):  # (registration, dp_size re-reads: not pooled)
            self.accepted += 1
            self.open.add(writer)
        ur, uw = await asyncio.open_connection("127.0.0.1", self.upstream_port)
        uw.write(first)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        try:
            await asyncio.gather(pipe(reader, uw), pipe(ur, writer))
        finally:
            self.open.discard(writer)

    def drop(self) -> None:
        for w in list(self.open):
            w.close()

    async def stop(self) -> None:
        self.drop()
        self._server.close()
        await self._server.wait_closed()


def test_polls_reuse_one_connection_and_replace_a_closed_one():
    async def body():
        fw = await FakeWorker(dp_size=2, loads=LOADS).start()
        proxy = CountingProxy(fw.port)
        url = await proxy.start()
        try:
            async with Plane(make_config(dp_aware=True)) as p:
                w = p.registry.add_worker(url, "regular")
                assert await p.registry.wait_registered(w), w.error
                before, polls = proxy.accepted, fw.count("/v1/loads")
                for _ in range(3):
                    await p.monitor.poll_once()
                assert fw.count("/v1/loads") == polls + 3
                assert proxy.accepted == before + 1  # three polls, one connection
                assert [p.table.get(t, COL_POLLED_RUNNING) for t in w.targets] == [3, 5]

                # The worker closes the idle connection: the next poll still reads the loads.
                proxy.drop()
                await wait_until(lambda: not proxy.open)
                p.table.mark_unpolled(w.targets[0])
                await p.monitor.poll_once()
                assert p.table.get(w.targets[0], COL_POLLED_AT) >= 0
                assert proxy.accepted == before + 2
                assert (url, "failed") not in p.monitor.polls

                # A removed worker's kept connection is closed at the next poll round.
                assert len(proxy.open) == 1
                p.registry.remove_worker(w)
                await p.monitor.poll_once()
                await wait_until(lambda: not proxy.open)
        finally:
            await proxy.stop()
            await fw.stop()

    run(body)


def test_a_monitor_stopping_closes_its_kept_connections():
    async def body():
        fw = await FakeWorker(dp_size=1, loads=LOADS[:1]).start()
        proxy = CountingProxy(fw.port)
        url = await proxy.start()
        try:
            async with Plane(make_config()) as p:
                w = p.registry.add_worker(url, "regular")
                assert await p.registry.wait_registered(w), w.error
                await p.monitor.poll_once()
                assert len(proxy.open) == 1
                await p.monitor.stop()
                await wait_until(lambda: not proxy.open)
        finally:
            await proxy.stop()
            await fw.stop()

    run(body)
