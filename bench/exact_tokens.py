"""What exact tokens cost (``--tokenizer-path``): the router with and without its tokenizer, in
one run, on chat traffic.

``python bench/exact_tokens.py [--requests 300] [--rounds 3]``

A byte-level BPE tokenizer of 32,000 tokens is trained here on the Python standard library's
sources (a real tokenizer of realistic size; nothing is fetched), with ChatML's special tokens
and template. A simulated regular worker (DP 8) answers; the router runs cache_aware with
decode input demand on (a reader of token counts, so the tokenizer is used) and KV events off,
once without and once with ``--tokenizer-path`` (and the L1 cache), in alternating rounds.

Rows: 2 KB and 48 KB chat bodies (each request distinct), and a 12-turn conversation (each
turn's prompt extends the last; L1 serves the earlier turns). Each row: the router's CPU per
request (/proc, the whole process) and the client's latency p50 / p99 at concurrency 1, off and
on, medians over the rounds. Then the event loop's longest stall while 100 concurrent 48 KB
prompts are tokenized: a probe sends GET /readiness every 2 ms during the burst and its longest
answer is reported, beside the same burst without the tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import uvloop  # noqa: E402

from fastroute.sim.balance import RouterProcess, _free_port  # noqa: E402
from fastroute.sim.engine import SimParams  # noqa: E402
from fastroute.sim.http import HttpConnection  # noqa: E402
from fastroute.sim.tokenizer import train as train_tokenizer  # noqa: E402
from fastroute.sim.worker import SimWorker  # noqa: E402

WORDS = [
    "the",
    "router",
    "places",
    "each",
    "request",
    "on",
    "the",
    "rank",
    "whose",
    "cache",
    "holds",
    "its",
    "prefix",
    "and",
    "whose",
    "queue",
    "is",
    "short",
]


def text(n_bytes: int, rng: random.Random) -> str:
    out: list[str] = []
    size = 0
    while size < n_bytes:
        w = rng.choice(WORDS) + str(rng.randrange(1000))
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_bytes]


def chat_bodies(kind: str, n: int, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    if kind == "conversation":
        bodies = []
        while len(bodies) < n:
            msgs = [{"role": "system", "content": text(600, rng)}]
            for _ in range(12):
                msgs.append({"role": "user", "content": text(400, rng)})
                bodies.append(json.dumps({"messages": msgs, "max_tokens": 4}).encode())
                msgs.append({"role": "assistant", "content": text(300, rng)})
        return bodies[:n]
    size = 2048 if kind == "2KB" else 49152
    return [
        json.dumps({"messages": [{"role": "user", "content": text(size - 60, rng)}], "max_tokens": 4}).encode()
        for _ in range(n)
    ]


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        f = fh.read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


async def serial(port: int, bodies: list[bytes]) -> list[float]:
    conn = HttpConnection("127.0.0.1", port)
    lat = []
    try:
        for b in bodies:
            t = time.perf_counter()
            status, _, _ = await conn.request("POST", "/v1/chat/completions", b, {"Content-Type": "application/json"})
            lat.append((time.perf_counter() - t) * 1e6)
            if status != 200:
                raise RuntimeError(f"status {status}")
    finally:
        conn.close()
    return lat


async def burst_stall(port: int, bodies: list[bytes]) -> float:
    """The longest /readiness answer (us) while ``bodies`` are sent at once."""
    longest = 0.0
    stop = asyncio.Event()

    async def probe() -> None:
        nonlocal longest
        conn = HttpConnection("127.0.0.1", port)
        try:
            while not stop.is_set():
                t = time.perf_counter()
                await conn.request("GET", "/readiness", b"")
                longest = max(longest, (time.perf_counter() - t) * 1e6)
                await asyncio.sleep(0.002)
        finally:
            conn.close()

    async def one(b: bytes) -> None:
        conn = HttpConnection("127.0.0.1", port)
        try:
            await conn.request("POST", "/v1/chat/completions", b, {"Content-Type": "application/json"})
        finally:
            conn.close()

    p = asyncio.ensure_future(probe())
    await asyncio.sleep(0.05)
    await asyncio.gather(*(one(b) for b in bodies))
    stop.set()
    await p
    return longest


async def run(ns: argparse.Namespace) -> None:
    tok_dir = train_tokenizer(ns.tokenizer_dir)
    os.makedirs(ns.out, exist_ok=True)
    w = SimWorker("regular", SimParams(dp_size=8, time_scale=0.001))
    await w.start()
    base = ["--worker-urls", w.url, "--dp-aware", "--policy", "cache_aware", "--decode-input-demand", "on"]
    base += ["--kv-events", "off", "--host", "127.0.0.1", "--log-level", "warn"]
    modes = {"off": [], "on": ["--tokenizer-path", tok_dir, "--tokenizer-cache-enable-l1"]}
    results: dict[tuple[str, str], list[tuple[float, float, float]]] = {}
    stalls: dict[str, list[float]] = {"off": [], "on": []}
    try:
        for rnd in range(ns.rounds):
            for mode in ("off", "on") if rnd % 2 == 0 else ("on", "off"):
                port, prom = _free_port(), _free_port()
                cmd = [sys.executable, "-m", "fastroute", "--port", str(port), "--prometheus-port", str(prom)]
                rp = RouterProcess(cmd + base + modes[mode], port, os.path.join(ns.out, f"tok_{mode}.log"))
                await rp.start()
                try:
                    assert rp.proc is not None
                    for kind in ("2KB", "48KB", "conversation"):
                        bodies = chat_bodies(kind, ns.requests, seed=rnd)
                        await serial(port, bodies[:10])  # warm the connection
                        c0 = cpu_seconds(rp.proc.pid)
                        lat = await serial(port, bodies)
                        cpu = (cpu_seconds(rp.proc.pid) - c0) / len(bodies) * 1e6
                        q = statistics.quantiles(lat, n=100)
                        results.setdefault((kind, mode), []).append((cpu, q[49], q[98]))
                    stalls[mode].append(await burst_stall(port, chat_bodies("48KB", 100, seed=100 + rnd)))
                finally:
                    await rp.stop()
    finally:
        await w.stop()
    med = statistics.median
    lines = [
        "| body | router CPU us / request, off / on | latency p50 us, off / on | latency p99 us, off / on |",
        "|---|---|---|---|",
    ]
    for kind in ("2KB", "48KB", "conversation"):
        off, on = results[(kind, "off")], results[(kind, "on")]
        cols = [f"{med(x[i] for x in off):.0f} / {med(x[i] for x in on):.0f}" for i in range(3)]
        lines.append(f"| {kind} | " + " | ".join(cols) + " |")
    lines.append("")
    lines.append(
        f"Longest /readiness answer during 100 concurrent 48 KB chat prompts: off {med(stalls['off']) / 1000:.1f} ms, "
        f"on {med(stalls['on']) / 1000:.1f} ms (medians of {ns.rounds} rounds)."
    )
    out = "\n".join(lines) + "\n"
    os.makedirs(ns.out, exist_ok=True)
    with open(os.path.join(ns.out, "tokenize.md"), "w") as fh:
        fh.write(out)
    print(out)


def main() -> int:
    ap = argparse.ArgumentParser(prog="python bench/exact_tokens.py", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=300, help="requests per row and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokenizer-dir", default=os.path.join(tempfile.gettempdir(), "fastroute-bench-tokenizer"))
    ap.add_argument("--out", default="bench/out/tokenize")
    uvloop.run(run(ap.parse_args()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
