"""``fastroute epp --epp-mode http --workers 2`` behind a real Envoy 1.40.

Envoy's HTTP ext_proc client makes one POST per processing step on whatever connection of its
pool is free, and the kernel spreads those connections over the two picker processes: the
response-headers call that ends a lease often reaches the process that did not book it. The
picker names the lease in its answer's metadata, Envoy forwards that namespace back with the
response headers, and either process ends the lease through the shared lease rows
(:mod:`fastroute.epp.leaseslots`). 64 requests held by a DP-8 server with a port per rank land
8 per rank, both processes decide, and every count (per rank, per process) goes back to 0 at
the answers, after client resets and after Envoy is killed, with no release applied twice
(``fastroute_lease_underflows`` stays 0)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal

from fastroute.sim.params import SimParams
from fastroute.sim.server import SimWorker
from tests.integration.conftest import RawClient, call, post, run, workers
from tests.integration.envoy_harness import Gateway

H = "127.0.0.1"
SILENT = 5  # --silent-stream-timeout-secs of the client-reset test
FLAGS = ("--epp-mode", "http", "--policy", "power_of_two", "--p2c-load-metric", "least_requests", "--workers", "2")


async def _per_process(g: Gateway, family: str) -> dict[str, float]:
    out = {}
    for k, v in (await g.metrics()).items():
        hit = re.match(family + r'\{process="(\d+)"\}', k)
        if hit:
            out[hit.group(1)] = v
    return out


def _reclaimed(m: dict[str, float], reason: str) -> float:
    return sum(v for k, v in m.items() if k.startswith("fastroute_leases_reclaimed_total") and f'"{reason}"' in k)


async def _until_reclaimed(g: Gateway, reason: str, n: int) -> None:
    """The picker processes report their counters to the supervisor every second or so."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 10
    while (got := _reclaimed(await g.metrics(), reason)) != n:
        assert loop.time() < deadline, f"{reason} reclaims: {got}, expected {n}"
        await asyncio.sleep(0.1)


async def _open_64(g: Gateway, w: SimWorker, new_tokens: int) -> list[RawClient]:
    clients = []
    for i in range(64):
        c = await RawClient(g.port).connect()
        c.send(post("/generate", {"text": f"h{i}", "sampling_params": {"max_new_tokens": new_tokens}}))
        clients.append(c)
    await g.until_in_flight(lambda f: len(f) == 8 and set(f.values()) == {8.0}, 20, "8 in flight per rank")
    held = await _per_process(g, "fastroute_proxy_process_in_flight_requests")  # (the ledgers: live)
    assert sum(held.values()) == 64 and len(held) == 2, held
    picks = await _per_process(g, "fastroute_proxy_process_picks_total")
    assert len(picks) == 2 and all(v > 0 for v in picks.values()), picks  # both processes decided
    # Booked at the pick, the requests may still be on their way from Envoy to the worker (a
    # loaded CI machine saw 1 of 64 arrived when all were booked).
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 20
    while sum(w.port_requests) < 64 and loop.time() < deadline:
        await asyncio.sleep(0.05)
    assert w.port_requests == [8] * 8  # each request ran on the port of the rank it was booked on
    return clients


async def _all_back(g: Gateway, what: str) -> dict[str, float]:
    await g.until_in_flight(lambda f: sum(f.values()) == 0, 20, what)
    held = await _per_process(g, "fastroute_proxy_process_in_flight_requests")
    assert set(held.values()) == {0.0}, held  # each process's ledger is exact
    m = await g.metrics()
    assert m["fastroute_lease_underflows_total"] == 0  # no lease ended twice
    return m


def test_two_http_pickers_book_8_per_rank_and_release_at_the_answers() -> None:
    async def body() -> None:
        # ~100 decode steps of 8 requests per rank: seconds of running, then the answers
        w = SimWorker("regular", SimParams(dp_size=8, time_scale=2.0), H, rank_ports=True)
        await w.start()
        try:
            async with Gateway([w.rank_url(0)], *FLAGS) as g:
                clients = await _open_64(g, w, 100)
                for c in clients:
                    resp = await c.response(timeout=60)
                    assert resp.status == 200, resp.body
                    assert json.loads(resp.body)["meta_info"]["completion_tokens"] == 100
                    c.close()
                m = await _all_back(g, "released at the answers")
                # by the response-headers calls, whichever process got them: not by the bound
                assert _reclaimed(m, "silent") == 0 and _reclaimed(m, "process_exit") == 0
        finally:
            await w.stop()

    run(body(), 120)


def test_two_http_pickers_release_after_client_resets_and_envoy_killed() -> None:
    async def body() -> None:
        # 400 tokens hold a request ~17 s, past the silent bound. The bound must leave time to
        # open all 64 and see them held (a lease ends 5-6 s after its pick, at the once-a-second
        # sweep): 1 s made the test fail on a loaded machine, the first leases ending before the
        # last were booked.
        w = SimWorker("regular", SimParams(dp_size=8, time_scale=1.0), H, rank_ports=True)
        await w.start()
        try:
            async with Gateway([w.rank_url(0)], *FLAGS, "--silent-stream-timeout-secs", str(SILENT)) as g:
                clients = await _open_64(g, w, 400)
                for c in clients:
                    c.close()  # Envoy tells the pickers nothing: the booking process's bound ends them
                await _all_back(g, "released after the client resets")
                await _until_reclaimed(g, "silent", 64)
                w.port_requests = [0] * 8
                clients = await _open_64(g, w, 400)
                g.kill_envoy()
                assert g.envoy is not None
                await g.envoy.wait()
                await _all_back(g, "released after Envoy's death")
                await _until_reclaimed(g, "silent", 128)
                for c in clients:
                    c.close()
        finally:
            await w.stop()

    run(body(), 150)


def test_a_killed_http_picker_process_gives_its_leases_back_once() -> None:
    """The supervisor ends a dead process's lease rows before subtracting its ledger: the
    response headers that later name those leases (reaching the survivor or the replacement)
    release nothing a second time."""

    async def body() -> None:
        w = SimWorker("regular", SimParams(dp_size=8, time_scale=2.0), H, rank_ports=True)
        await w.start()
        try:
            async with Gateway([w.rank_url(0)], *FLAGS) as g:
                clients = await _open_64(g, w, 100)
                pids = await _per_process(g, "fastroute_proxy_process_pid")
                held = await _per_process(g, "fastroute_proxy_process_in_flight_requests")
                victim = max(held, key=lambda k: held[k])
                os.kill(int(pids[victim]), signal.SIGKILL)
                await g.until_in_flight(lambda f: sum(f.values()) == 64 - held[victim], 15, "the dead one's reclaimed")
                for c in clients:  # the requests were routed already: they all complete
                    resp = await c.response(timeout=60)
                    assert resp.status == 200, resp.body
                    c.close()
                await _all_back(g, "the survivor's released at the answers")
                await _until_reclaimed(g, "process_exit", held[victim])
        finally:
            await w.stop()

    run(body(), 120)


def test_an_admission_slot_comes_back_when_another_process_ends_the_lease() -> None:
    """--max-concurrent-requests 16 per process, no queue, and never more than 16 requests at
    once in all: no process is ever legitimately full. A request ended by the other process's
    response-headers call must not keep its booking process's slot, or the requests there are
    shed (429) once such slots pile up, until that process's sweep."""

    async def body() -> None:
        (w,) = await workers(1)
        flags = (*FLAGS, "--max-concurrent-requests", "16", "--queue-size", "0")
        async with Gateway([w.url], *flags) as g:

            async def loop(k: int) -> list[int]:
                out = []
                for i in range(12):
                    r = await call(g.port, post("/generate", {"text": f"a{k}.{i}"}), timeout=10)
                    out.append(r.status)
                return out

            statuses = [s for got in await asyncio.gather(*(loop(k) for k in range(16))) for s in got]
            assert statuses == [200] * len(statuses), sorted(statuses)
            picks = await _per_process(g, "fastroute_proxy_process_picks_total")
            assert len(picks) == 2 and all(v > 0 for v in picks.values()), picks
            await _all_back(g, "all released")

    run(body(), 90)
