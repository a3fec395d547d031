"""Conversation traffic for the simulator: prompts that share prefixes, replayed open loop.

Owns the conversation trace and the open-loop client. The trace is shaped like a production
chat trace (multi-turn sessions whose prompts extend their earlier turns, a pool of shared system
prompts, mean input ~10-12k tokens, outputs of a few hundred tokens), built from 512-token
*blocks*: each block is 2,048 ASCII bytes derived from its id, so two prompts share a prefix in
the router's prefix tree and in a simulated prefill's block cache exactly when they share
leading blocks. Nothing is random at replay time; a trace is a function of its seed.

Arrivals are open loop (each request is sent at its time whatever the others do, as users and
batch jobs send), ``smooth`` (a Poisson process) or ``bursty``: every arrival time rounded down
to a grid of ``burst / rate`` seconds, so ``burst`` requests land together on average, as in a
trace whose timestamps are quantised or an RL rollout that submits a batch at once. Requests go
to the router replicas in turn (round robin over ``ports``), as one load generator spreads them.

Times in a trace are simulated seconds; the replay runs them ``time_scale`` times faster, like
the simulators.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass

from fastroute.sim.http import HttpConnection
from fastroute.sim.loadgen import LoadResult, ReqRecord, Target, TraceItem, _one, encode_request

BLOCK_TOKENS = 512
BLOCK_BYTES = 4 * BLOCK_TOKENS  # the router and the simulator both count 4 bytes per token


def block_text(block_id: int) -> str:
    """The 2,048 bytes of one block: its id in hex, repeated (distinct ids never collide)."""
    return ("%015x " % block_id) * (BLOCK_BYTES // 16)


@dataclass
class Arrival:
    t: float  # simulated seconds from the start of the replay
    item: TraceItem
    session: int


def conversation_trace(
    duration_s: float,
    rate: float,
    seed: int = 0,
    system_prompts: int = 16,
    system_blocks: tuple[int, int] = (2, 10),
    turns_mean: float = 3.0,
    user_blocks_mean: float = 6.0,
    output_mean: float = 343.0,
    think_mean_s: float = 20.0,
    max_blocks: int = 120,
    prehistory_s: float = 300.0,
) -> list[Arrival]:
    """Sessions arrive as a Poisson process at ``rate / turns_mean``; each has a system prompt
    from a shared pool, then turns (geometric count, mean ``turns_mean``) separated by
    exponential think times; turn k's prompt is turn k-1's prompt + its answer + a new user
    message (lognormal blocks). Sessions start from ``-prehistory_s`` so the replay begins in the
    steady state (later turns of earlier sessions included); returns the arrivals inside
    [0, ``duration_s``), sorted by time."""
    rng = random.Random(seed)
    next_id = [1]

    def new_blocks(n: int) -> list[int]:
        out = list(range(next_id[0], next_id[0] + n))
        next_id[0] += n
        return out

    pool = [new_blocks(rng.randint(*system_blocks)) for _ in range(system_prompts)]
    mu_user = math.log(user_blocks_mean) - 0.5**2 / 2
    mu_out = math.log(output_mean) - 0.6**2 / 2
    arrivals: list[Arrival] = []
    t = -prehistory_s
    session = 0
    session_rate = rate / turns_mean
    while True:
        t += rng.expovariate(session_rate)
        if t >= duration_s:
            break
        session += 1
        history = list(pool[rng.randrange(len(pool))])
        when = t
        while True:
            history += new_blocks(max(1, round(rng.lognormvariate(mu_user, 0.5))))
            if len(history) > max_blocks:
                break
            out = int(min(2000, max(16, rng.lognormvariate(mu_out, 0.6))))
            if when >= 0:
                text = "".join(block_text(b) for b in history)
                arrivals.append(Arrival(when, TraceItem(len(history) * BLOCK_TOKENS, out, text=text), session))
            if rng.random() < 1.0 / turns_mean:
                break
            history += new_blocks(max(1, math.ceil(out / BLOCK_TOKENS)))  # the answer joins the prompt
            when += rng.expovariate(1.0 / think_mean_s)
            if when >= duration_s:
                break
    arrivals.sort(key=lambda a: a.t)
    return arrivals


def burstify(arrivals: list[Arrival], rate: float, burst: float) -> list[Arrival]:
    """Round every arrival time down to a grid of ``burst / rate`` s (``burst`` <= 1: unchanged)."""
    if burst <= 1:
        return list(arrivals)
    grid = burst / rate
    return [Arrival(math.floor(a.t / grid) * grid, a.item, a.session) for a in arrivals]


async def run_open_loop(
    host: str,
    ports: tuple[int, ...],
    arrivals: list[Arrival],
    time_scale: float,
    warmup_s: float,
    duration_s: float,
    seed: int = 0,
    request_timeout_s: float = 600.0,
) -> LoadResult:
    """Send each arrival at ``t * time_scale`` wall seconds (request i to ``ports[i % n]``) until
    ``warmup_s + duration_s`` wall seconds; measure requests that start and end in the last
    ``duration_s``. Requests still open at the end are aborted, as a client that leaves."""
    loop = asyncio.get_running_loop()
    t_begin = loop.time()
    t_measure = t_begin + warmup_s
    t_end = t_measure + duration_s
    idle: dict[int, list[HttpConnection]] = {p: [] for p in ports}
    records: list[ReqRecord] = []
    rng = random.Random(seed ^ 0x0CEA)
    errors = 0
    tasks: set[asyncio.Task] = set()

    async def one(i: int, a: Arrival) -> None:
        nonlocal errors
        port = ports[i % len(ports)]
        conns = idle[port]
        conn = conns.pop() if conns else HttpConnection(host, port)
        rec = ReqRecord(loop.time(), a.item.input_tokens)
        records.append(rec)
        await _one(conn, None, Target(host, port), encode_request(a.item), rec, rng, request_timeout_s)
        if rec.ok:
            conns.append(conn)
        else:
            errors += 1
            conn.close()

    try:
        for i, a in enumerate(arrivals):
            at = t_begin + a.t * time_scale
            if at >= t_end:
                break
            delay = at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            task = loop.create_task(one(i, a))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        remaining = t_end - loop.time()
        if remaining > 0:
            await asyncio.sleep(remaining)
    finally:
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for conns in idle.values():
            for c in conns:
                c.close()
    t_stop = min(loop.time(), t_end)
    return LoadResult(0, t_stop - t_measure, records, (t_measure, t_stop), errors)
