"""``fastroute epp`` with a per-rank-port server (SGLang's Rust HTTP server layout) behind a
real Envoy: the picker names the picked rank's own port, so each request runs on the rank it
was placed on (a simulated server runs a request on the rank of the port it arrived at)."""

from __future__ import annotations

import json

from fastroute.sim.engine import SimParams
from fastroute.sim.http import fetch
from fastroute.sim.server import SimWorker
from tests.integration.conftest import run
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
