"""``fastroute epp --workers 2`` behind a real Envoy: two picker processes over one target table
and ledger. Envoy's ext_proc streams take several connections (the printed bootstrap bounds
the streams per connection), the kernel spreads the connections over the two processes, and
every pick reads the one table: 64 held streams of a DP-8 worker land 8 per rank as with one
process, both processes take decisions, and every lease comes back when the streams end or a
picker process dies."""

from __future__ import annotations

import asyncio
import os
import re
import signal

from tests.integration.conftest import RawClient, call, post, run, workers
from tests.integration.envoy_harness import Gateway
from tests.integration.test_epp_envoy import DP_FLAGS, _eight_each, _open_64, _per_rank


def _two_streams_per_connection(text: str) -> str:
    # The printed bound is 8 streams a connection (8 connections for 64 streams); 2 makes 32
    # connections, so that all of them hashing to one process (2 ** -31) cannot fail the test.
    assert "max_concurrent_streams: 8" in text
    return text.replace("max_concurrent_streams: 8", "max_concurrent_streams: 2")


async def _per_process(g: Gateway, family: str) -> dict[str, float]:
    m = await g.metrics()
    out = {}
    for k, v in m.items():
        hit = re.match(family + r'\{process="(\d+)"\}', k)
        if hit:
            out[hit.group(1)] = v
    return out


def test_two_picker_processes_balance_as_one_and_both_decide() -> None:
    async def body() -> None:
        (w,) = await workers(1, dp_size=8)
        async with Gateway([w.url], *DP_FLAGS, "--workers", "2", edit=_two_streams_per_connection) as g:
            clients = await _open_64(g, w)
            assert _per_rank(w, w.inference()) == {r: 8 for r in range(8)}
            await g.until_in_flight(_eight_each(w), 10, "8 in flight per rank")
            held = await _per_process(g, "fastroute_proxy_process_in_flight_requests")
            picks = await _per_process(g, "fastroute_proxy_process_picks_total")
            assert sum(held.values()) == 64 and len(held) == 2, held
            assert all(v > 0 for v in picks.values()) and len(picks) == 2, picks  # both decided
            w.stream_gate.set()
            for c in clients:
                resp = await c.response(timeout=20)
                assert resp.body.endswith(b"data: [DONE]\n\n")
                c.close()
            await g.until_in_flight(lambda f: sum(f.values()) == 0, 10, "all released")

    run(body(), 120)


def test_a_picker_process_killed_gives_its_leases_back_and_is_replaced() -> None:
    async def body() -> None:
        (w,) = await workers(1, dp_size=8)
        async with Gateway([w.url], *DP_FLAGS, "--workers", "2", edit=_two_streams_per_connection) as g:
            clients: list[RawClient] = await _open_64(g, w)
            await g.until_in_flight(_eight_each(w), 10, "8 in flight per rank")
            pids = await _per_process(g, "fastroute_proxy_process_pid")
            held = await _per_process(g, "fastroute_proxy_process_in_flight_requests")
            victim = max(held, key=lambda k: held[k])
            os.kill(int(pids[victim]), signal.SIGKILL)
            # its streams are gone with it (Envoy fails them); the others stay booked
            await g.until_in_flight(lambda f: sum(f.values()) == 64 - held[victim], 15, "the dead one's reclaimed")
            w.stream_gate.set()
            for c in clients:
                c.close()
            await g.until_in_flight(lambda f: sum(f.values()) == 0, 15, "all released")
            # a replacement starts in the dead one's slot and reports ready
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 20
            while True:
                now_pids = await _per_process(g, "fastroute_proxy_process_pid")
                up = await _per_process(g, "fastroute_proxy_process_up")
                if now_pids.get(victim) not in (None, pids[victim]) and up.get(victim) == 1.0:
                    break
                assert loop.time() < deadline, (now_pids, up)
                await asyncio.sleep(0.1)
            w.stream_gate = None
            for i in range(4):
                r = await call(g.port, post("/generate", {"text": f"after {i}"}), timeout=20)
                assert r.status == 200, r.body

    run(body(), 120)
