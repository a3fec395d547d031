"""The simulated engines' own DP balancing (``--load-balance-method``) over real loopback sockets:
where a request lands when the router names no rank, for each method, on the prefill and the
decode; the routed rank overriding it; the booking at dispatch and the 20 ms refresh; and the
method in /server_info, also from the worker CLI."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

from fastroute.sim.engine import SimParams
from fastroute.sim.http import HttpConnection, fetch
from fastroute.sim.server import SimWorker
from tests.integration.test_sim import H, gen_body, get_json, run, until

# A prefill that holds every request: 1 token/s, so even 10 tokens compute for 10 s.
HOLD_PREFILL = dict(dp_size=8, time_scale=1.0, prefill_tokens_per_s=1.0)


async def loads(w: SimWorker) -> list[int]:
    """Requests running or waiting per rank, from /v1/loads."""
    st, body = await get_json(w.port, "/v1/loads")
    assert st == 200
    return [e["num_running_reqs"] + e["num_waiting_reqs"] for e in body["loads"]]


class Holder:
    """Requests sent and left open (each on its own connection); ``close`` drops them all."""

    def __init__(self, w: SimWorker) -> None:
        self.w = w
        self.tasks: list[asyncio.Task] = []
        self.conns: list[HttpConnection] = []

    async def send(self, body: bytes) -> list[int]:
        """Send one request and wait until the engine has placed it; returns the loads after."""
        before = sum(await loads(self.w))
        conn = HttpConnection(H, self.w.port)
        self.conns.append(conn)
        self.tasks.append(asyncio.ensure_future(conn.request("POST", "/generate", body)))
        for _ in range(2000):
            now = await loads(self.w)
            if sum(now) > before:
                return now
            await asyncio.sleep(0.005)
        raise AssertionError("request never placed")

    async def close(self) -> None:
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for c in self.conns:
            c.close()


def held_spread(method: str, room: int = 3) -> list[int]:
    """8 requests with the same room and no rank to a prefill that holds them: loads per rank."""

    async def scenario() -> list[int]:
        w = SimWorker("prefill", SimParams(load_balance_method=method, **HOLD_PREFILL))
        await w.start()
        h = Holder(w)
        try:
            for _ in range(8):
                out = await h.send(gen_body(10, 1, bootstrap_room=room))
            return out
        finally:
            await h.close()
            await w.stop()

    return run(scenario())


def test_total_requests_spreads_held_requests_the_default_follows_the_room() -> None:
    assert held_spread("total_requests") == [1] * 8
    assert held_spread("total_tokens") == [1] * 8
    assert held_spread("auto") == [0, 0, 0, 8, 0, 0, 0, 0]  # room 3: all on rank 3
    assert held_spread("follow_bootstrap_room", room=13) == [0, 0, 0, 0, 0, 8, 0, 0]


def test_round_robin_cycles_whatever_the_room() -> None:
    async def scenario() -> None:
        for method, want in (("round_robin", [2] * 8), ("auto", [0, 0, 0, 0, 0, 16, 0, 0])):
            w = SimWorker("prefill", SimParams(dp_size=8, time_scale=0.01, load_balance_method=method))
            await w.start()
            try:
                conn = HttpConnection(H, w.port)
                for _ in range(16):
                    st, _, _ = await conn.request("POST", "/generate", gen_body(10, 1, bootstrap_room=21))
                    assert st == 200
                conn.close()
                st, stats = await get_json(w.port, "/sim/stats")
                assert stats["dispatch"]["placed"] == want, method
            finally:
                await w.stop()

    run(scenario())


def test_total_tokens_weighs_inputs_total_requests_counts_requests() -> None:
    """One 50k-token request, then 8 of 1k: the 8th small one goes to the next-lightest rank by
    tokens (rank 1) under total_tokens, to rank 0 (one request like the others) under
    total_requests."""

    async def scenario(method: str) -> list[int]:
        w = SimWorker("prefill", SimParams(load_balance_method=method, **HOLD_PREFILL))
        await w.start()
        h = Holder(w)
        try:
            await h.send(gen_body(50_000, 1, bootstrap_room=0))
            for _ in range(8):
                out = await h.send(gen_body(1_000, 1, bootstrap_room=0))
            return out
        finally:
            await h.close()
            await w.stop()

    assert run(scenario("total_tokens")) == [1, 2, 1, 1, 1, 1, 1, 1]
    assert run(scenario("total_requests")) == [2, 1, 1, 1, 1, 1, 1, 1]


def test_routed_rank_overrides_the_engines_balancing() -> None:
    async def scenario() -> None:
        for role in ("prefill", "decode"):
            p = SimParams(load_balance_method="total_requests", **HOLD_PREFILL)
            w = SimWorker(role, p)
            await w.start()
            h = Holder(w)
            try:
                room = {"bootstrap_room": 0} if role == "prefill" else {}  # a decode would wait for it
                for _ in range(8):
                    await h.send(gen_body(10, 100_000, **room))
                for _ in range(3):
                    out = await h.send(gen_body(10, 100_000, routed_dp_rank=5, **room))
                assert out == [1, 1, 1, 1, 1, 4, 1, 1], role
                st, _ = await fetch(H, w.port, "POST", "/generate", gen_body(10, 1, routed_dp_rank=8))
                assert st == 400
            finally:
                await h.close()
                await w.stop()

    run(scenario(), timeout=60)


def test_decode_refreshes_its_budget_at_most_every_refresh_window() -> None:
    """Rank 1 gets 4 routed requests (not booked). Inside the refresh window the controller
    still sees rank 1 empty and sends the next request there; with a short window it reads the
    ranks' published snapshots and keeps 8 more requests off rank 1."""

    async def scenario(refresh_ms: float) -> tuple[list[int], int]:
        p = SimParams(
            dp_size=8,
            time_scale=1.0,
            load_balance_method="total_requests",
            lb_refresh_ms=refresh_ms,
            load_snapshot_interval=1,
        )
        w = SimWorker("decode", p)
        await w.start()
        h = Holder(w)
        try:
            assert (await h.send(gen_body(10, 100_000)))[0] == 1  # first dispatch: rank 0
            for _ in range(4):
                await h.send(gen_body(10, 100_000, routed_dp_rank=1))
            steps = w.decode.steps
            await until(lambda: w.decode.steps >= steps + 3, what="snapshots published")
            for _ in range(8 if refresh_ms < 1000 else 1):
                out = await h.send(gen_body(10, 100_000))
            st, stats = await get_json(w.port, "/sim/stats")
            return out, stats["dispatch"]["refreshes"]
        finally:
            await h.close()
            await w.stop()

    stale, n_stale = run(scenario(60_000.0))  # window 60 s: the budget of the first dispatch
    assert n_stale == 1
    assert stale == [1, 5, 0, 0, 0, 0, 0, 0]
    fresh, n_fresh = run(scenario(20.0))
    assert n_fresh >= 2
    assert fresh[1] == 4 and sum(fresh) == 13 and max(fresh[:1] + fresh[2:]) == 2


def test_server_info_reports_the_method_and_the_worker_cli_takes_it() -> None:
    async def scenario() -> None:
        for role, method, want in (
            ("prefill", "auto", "follow_bootstrap_room"),
            ("decode", "auto", "round_robin"),
            ("decode", "total_tokens", "total_tokens"),
        ):
            w = SimWorker(role, SimParams(dp_size=2, load_balance_method=method))
            await w.start()
            try:
                st, info = await get_json(w.port, "/server_info")
                assert st == 200 and info["load_balance_method"] == want
            finally:
                await w.stop()

    run(scenario())
    with __import__("socket").socket() as s:
        s.bind((H, 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fastroute.sim.worker",
            "--role",
            "decode",
            "--port",
            str(port),
            "--dp-size",
            "2",
            "--load-balance-method",
            "total_requests",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        assert b"listening" in proc.stdout.readline()

        async def info() -> dict:
            st, body = await fetch(H, port, "GET", "/server_info")
            assert st == 200
            return json.loads(body)

        assert run(info())["load_balance_method"] == "total_requests"
    finally:
        proc.terminate()
        proc.wait(10)
