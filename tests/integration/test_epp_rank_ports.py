"""``fastroute epp`` with a per-rank-port server (SGLang's Rust HTTP server layout) behind a
real Envoy: the picker names the picked rank's own port, so each request runs on the rank it
was placed on (a simulated server runs a request on the rank of the port it arrived at)."""

from __future__ import annotations

import asyncio
import json

from fastroute.sim.engine import SimParams
from fastroute.sim.http import fetch
from fastroute.sim.server import SimWorker
from tests.integration.conftest import RawClient, post, run
from tests.integration.envoy_harness import Gateway
from tests.integration.test_epp_envoy import _subset_hint

H = "127.0.0.1"


def test_each_request_goes_to_the_port_of_the_picked_rank() -> None:
    async def body() -> None:
        w = SimWorker("regular", SimParams(dp_size=4, time_scale=0.01), H, rank_ports=True)
        await w.start()
        try:
            # Rank 1's URL is enough: the picker finds the other rank ports, as the proxy does.
            async with Gateway([w.rank_url(1)], "--policy", "round_robin") as g:
                gen = json.dumps({"text": "hello", "sampling_params": {"max_new_tokens": 2}}).encode()
                for _ in range(8):
                    status, doc = await fetch(H, g.port, "POST", "/generate", gen)
                    assert status == 200, doc
                assert w.port_requests == [2, 2, 2, 2]
                assert w.decode is not None and w.decode.placed == [2, 2, 2, 2]
                # the picker releases a lease when Envoy closes the ext_proc stream, just after
                # the response: wait for it rather than race it
                flights = await g.until_in_flight(lambda f: set(f.values()) == {0.0}, 10, "leases released")
                assert len(flights) == 4 and set(flights.values()) == {0.0}
        finally:
            await w.stop()

    run(body(), 90)


def test_fallback_endpoints_refuse_a_rank_port_the_printed_cluster_lacks() -> None:
    async def body() -> None:
        w = SimWorker("regular", SimParams(dp_size=4, time_scale=0.01), H, rank_ports=True)
        await w.start()
        try:
            # --fallback-endpoints prints a cluster of the URLs' ports (rank 1's here): Envoy's
            # override_host would send a pick of another rank port anywhere in it, so such a
            # pick is refused (503, nothing booked) and only rank 1's are served.
            async with Gateway([w.rank_url(1)], "--policy", "round_robin", "--fallback-endpoints", "1") as g:
                gen = json.dumps({"text": "hello", "sampling_params": {"max_new_tokens": 2}}).encode()
                statuses = []
                for _ in range(8):
                    status, doc = await fetch(H, g.port, "POST", "/generate", gen)
                    statuses.append(status)
                    if status != 200:
                        assert b"endpoint_not_in_cluster" in (
                            doc if isinstance(doc, bytes) else json.dumps(doc).encode()
                        ), doc
                assert sorted(statuses) == [200, 200] + [503] * 6, statuses
                assert w.port_requests == [0, 2, 0, 0]
                await g.until_in_flight(lambda f: set(f.values()) == {0.0}, 10, "leases released")
        finally:
            await w.stop()

    run(body(), 90)


def test_a_subset_hint_confines_picks_to_the_listed_rank_ports() -> None:
    """The conformance suite's data-parallel case: one pod, several rank ports; the gateway's
    subset names some of them and traffic stays on those, spread over them, the others idle."""

    async def body() -> None:
        w = SimWorker("regular", SimParams(dp_size=4, time_scale=0.01), H, rank_ports=True)
        await w.start()
        try:
            allowed = [w.rank_url(0).removeprefix("http://"), w.rank_url(2).removeprefix("http://")]
            flags = ("--policy", "round_robin", "--fallback-endpoints", "1")
            async with Gateway([w.rank_url(r) for r in range(4)], *flags, edit=_subset_hint(allowed)) as g:
                gen = json.dumps({"text": "hello", "sampling_params": {"max_new_tokens": 2}}).encode()
                for _ in range(8):
                    status, doc = await fetch(H, g.port, "POST", "/generate", gen)
                    assert status == 200, doc
                assert w.port_requests == [4, 0, 4, 0]
                await g.until_in_flight(lambda f: set(f.values()) == {0.0}, 10, "leases released")
        finally:
            await w.stop()

    run(body(), 90)


def test_a_fallback_to_another_rank_port_moves_the_lease_to_that_rank() -> None:
    """Rank 1's port refuses; a stream picked there is served at the next endpoint of its list,
    rank 0's port (idle), which is also the server's own address: the served report must move
    the lease to rank 0, the rank of that port, not keep it on rank 1."""

    async def body() -> None:
        w = SimWorker("regular", SimParams(dp_size=4, time_scale=1.0), H, rank_ports=True)
        await w.start()
        try:
            urls = [w.rank_url(r) for r in range(4)]
            async with Gateway(urls, "--policy", "round_robin", "--fallback-endpoints", "1") as g:
                short = json.dumps({"text": "x", "sampling_params": {"max_new_tokens": 1}}).encode()
                status, doc = await fetch(H, g.port, "POST", "/generate", short)  # rank 0, done
                assert status == 200, doc
                await w.stop_rank(1)
                # streams: their response headers (and the served report) come at the start
                gen = json.dumps(
                    {"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
                )
                clients = []
                for _ in range(3):  # round robin: ranks 1, 2, 3; rank 1's served at rank 0, idle
                    c = await RawClient(g.port).connect()
                    c.send(post("/generate", gen.encode()))
                    clients.append(c)
                    await asyncio.sleep(0.2)
                await g.until_in_flight(lambda f: sum(f.values()) == 3, 10, "three booked")
                await until_moved(g)
                flights = await g.in_flight()
                by_rank = {urls.index(k): v for k, v in flights.items()}
                assert by_rank == {0: 1.0, 1: 0.0, 2: 1.0, 3: 1.0}, flights
                assert w.port_requests == [2, 0, 1, 1]
                for c in clients:
                    c.close()
                await g.until_in_flight(lambda f: sum(f.values()) == 0, 15, "released")
        finally:
            await w.stop()

    async def until_moved(g: Gateway) -> None:
        # the lease moves when the served report comes, with the answer's headers
        for _ in range(300):
            m = await g.metrics()
            if m.get("fastroute_epp_fallback_served_total", 0) >= 1:
                return
            await asyncio.sleep(0.05)
        raise AssertionError("no fallback was served")

    run(body(), 90)
