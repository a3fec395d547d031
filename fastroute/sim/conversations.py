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

Trace mode (``mooncake_arrivals``): rows shaped like Mooncake's FAST'25 conversation trace
(``FAST25-release/traces/conversation_trace.jsonl`` in kvcache-ai/Mooncake: JSON lines
``{"timestamp": ms, "input_length", "output_length", "hash_ids": [...]}``, one hash id per
512-token block, shared ids = a shared prefix), read from a copy (``read_mooncake_trace``) or
generated with its statistics (``mooncake_like_trace``: ~36.6% of blocks seen before, inputs of
~12k tokens on average, outputs of a few hundred). Each hash id becomes 512 token ids derived
from it alone (``block_token_ids``, a 32,000-token vocabulary), and a request is sent as
``/generate`` with ``input_ids`` and ``max_new_tokens`` = its output length; the ids are built
when the request is sent, so a long replay holds hash ids, not token lists.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

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
    hash_ids: tuple | None = None  # trace mode: the prompt's blocks, turned into input_ids when sent

    def request(self) -> TraceItem:
        """The request to send: ``item``, with its ``input_ids`` built from ``hash_ids`` if any."""
        if self.hash_ids is None:
            return self.item
        ids = block_token_ids(self.hash_ids, self.item.input_tokens)
        return TraceItem(self.item.input_tokens, self.item.output_tokens, input_ids=ids)


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


VOCAB = 32_000
_MASK = np.uint64(0xFFFFFFFFFFFFFFFF)


def block_token_ids(hash_ids: tuple | list, input_length: int) -> list[int]:
    """The first ``input_length`` token ids of a prompt made of ``hash_ids`` blocks: block h's
    512 ids are a SplitMix64 of (h, position) mod ``VOCAB``, so equal ids give equal blocks and
    distinct ids distinct ones."""
    h = np.asarray(hash_ids, dtype=np.uint64)[:, None]
    j = np.arange(BLOCK_TOKENS, dtype=np.uint64)[None, :]
    with np.errstate(over="ignore"):
        x = (h << np.uint64(20)) ^ j
        x = (x + np.uint64(0x9E3779B97F4A7C15)) & _MASK
        x = ((x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)) & _MASK
        x = ((x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)) & _MASK
        x ^= x >> np.uint64(31)
    return (x % np.uint64(VOCAB)).astype(np.int64).ravel()[:input_length].tolist()


def read_mooncake_trace(path: str) -> list[dict]:
    """The rows of a Mooncake trace file (JSON lines, gzipped if it ends in .gz); a row without
    the four keys is an error."""
    rows = []
    with gzip.open(path, "rt") if path.endswith(".gz") else open(path) as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not {"timestamp", "input_length", "output_length", "hash_ids"} <= set(row):
                raise ValueError(f"{path}:{n}: not a Mooncake trace row")
            rows.append(row)
    return rows


def mooncake_like_trace(
    n: int,
    rate: float,
    seed: int = 0,
    p_continue: float = 0.28,
    system_prompts: int = 32,
    system_blocks: tuple[int, int] = (1, 6),
    first_blocks_mean: float = 18.0,
    turn_blocks_mean: float = 8.0,
    output_mean: float = 343.0,
    max_blocks: int = 128,
    live_sessions: int = 200,
) -> list[dict]:
    """``n`` rows with the statistics of Mooncake's conversation trace, arriving as a Poisson
    process at ``rate`` per second: a request continues one of the ``live_sessions`` latest
    conversations with probability ``p_continue`` (its prompt extends that conversation's last
    prompt by new blocks), else it starts one (a shared system prompt, then new blocks). The
    defaults give ~36.6% of blocks already seen by an earlier request and ~12k input tokens on
    average (``block_reuse``)."""
    rng = random.Random(seed)
    next_id = [0]

    def new_blocks(mean: float) -> list[int]:
        k = max(1, round(rng.lognormvariate(math.log(mean) - 0.32, 0.8)))
        next_id[0] += k
        return list(range(next_id[0] - k, next_id[0]))

    pool: list[list[int]] = []
    for _ in range(system_prompts):
        k = rng.randint(*system_blocks)
        next_id[0] += k
        pool.append(list(range(next_id[0] - k, next_id[0])))
    sessions: list[list[int]] = []
    rows = []
    t = 0.0
    mu_out = math.log(output_mean) - 0.6**2 / 2
    for _ in range(n):
        t += rng.expovariate(rate)
        ids: list[int] | None = None
        if sessions and rng.random() < p_continue:
            k = rng.randrange(len(sessions))
            ids = sessions[k] + new_blocks(turn_blocks_mean)
            if len(ids) > max_blocks:
                sessions.pop(k)
                ids = None
            else:
                sessions[k] = ids
        if ids is None:
            ids = list(rng.choice(pool)) + new_blocks(first_blocks_mean)
            sessions.append(ids)
            if len(sessions) > live_sessions:
                sessions.pop(0)
        length = (len(ids) - 1) * BLOCK_TOKENS + rng.randint(1, BLOCK_TOKENS)
        out = int(min(2000, max(1, rng.lognormvariate(mu_out, 0.6))))
        rows.append({"timestamp": int(t * 1000), "input_length": length, "output_length": out, "hash_ids": ids})
    return rows


def block_reuse(rows: list[dict]) -> float:
    """The share of the rows' blocks that an earlier row already had (Mooncake's 36.6%)."""
    seen: set[int] = set()
    reused = total = 0
    for row in rows:
        ids = row["hash_ids"]
        total += len(ids)
        reused += sum(1 for h in ids if h in seen)
        seen.update(ids)
    return reused / total if total else 0.0


def working_set_tokens(rows: list[dict]) -> int:
    """Tokens of the distinct blocks of ``rows`` (what a cache holding all of them would hold)."""
    return BLOCK_TOKENS * len({h for row in rows for h in row["hash_ids"]})


def mooncake_arrivals(rows: list[dict], rate: float | None = None, duration_s: float | None = None) -> list[Arrival]:
    """Trace rows as arrivals (from the first row's timestamp; with ``rate``, times stretched so
    the trace arrives at ``rate`` per second on average), those before ``duration_s``."""
    if not rows:
        return []
    t0 = rows[0]["timestamp"] / 1000.0
    span = rows[-1]["timestamp"] / 1000.0 - t0
    stretch = (len(rows) - 1) / span / rate if rate and span > 0 and len(rows) > 1 else 1.0
    out = []
    for i, row in enumerate(rows):
        t = (row["timestamp"] / 1000.0 - t0) * stretch
        if duration_s is not None and t >= duration_s:
            break
        item = TraceItem(int(row["input_length"]), max(1, int(row["output_length"])))
        out.append(Arrival(t, item, i, tuple(row["hash_ids"])))
    return out


def chat_body(item: TraceItem) -> bytes:
    """A streamed chat completion whose one user message is the item's text."""
    msgs = [{"role": "user", "content": item.text or ""}]
    return json.dumps({"messages": msgs, "max_tokens": item.output_tokens, "stream": True}).encode()


def burstify(arrivals: list[Arrival], rate: float, burst: float) -> list[Arrival]:
    """Round every arrival time down to a grid of ``burst / rate`` s (``burst`` <= 1: unchanged)."""
    if burst <= 1:
        return list(arrivals)
    grid = burst / rate
    return [Arrival(math.floor(a.t / grid) * grid, a.item, a.session, a.hash_ids) for a in arrivals]


async def run_open_loop(
    host: str,
    ports: tuple[int, ...],
    arrivals: list[Arrival],
    time_scale: float,
    warmup_s: float,
    duration_s: float,
    seed: int = 0,
    request_timeout_s: float = 600.0,
    chat: bool = False,
    headers_of: Callable[[int], dict[str, str] | None] | None = None,
) -> LoadResult:
    """Send each arrival at ``t * time_scale`` wall seconds (request i to ``ports[i % n]``) until
    ``warmup_s + duration_s`` wall seconds; measure requests that start and end in the last
    ``duration_s``. Requests still open at the end are aborted, as a client that leaves.
    ``chat``: each prompt is sent as the user message of a streamed chat completion;
    ``headers_of(i)``: extra headers of request i (e.g. latency targets), or None."""
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
        item = a.request()
        extra = headers_of(i) if headers_of is not None else None
        rec.headers = extra
        if chat:
            target, body = Target(host, port, path="/v1/chat/completions", headers=extra), chat_body(item)
        else:
            target, body = Target(host, port, headers=extra), encode_request(item)
        await _one(conn, None, target, body, rec, rng, request_timeout_s)
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
