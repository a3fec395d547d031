"""Peak RSS of fastroute relaying N concurrent /generate SSE streams from aiohttp peers.

The shape of ``python bench/memory.py --shape generate`` (or this file directly): an **aiohttp
worker** (this file again with ``--worker``: SGLang's discovery answers from bench/overhead.py,
and ``POST /generate`` streaming ``--events`` events ``data: {...}\\n\\n``, ``--gap`` seconds apart,
then ``data: [DONE]\\n\\n``), a fresh ``python -m fastroute --worker-urls <worker> --policy
power_of_two --p2c-load-metric requests``, and an **aiohttp client** that starts N requests at
once, each ``{"text": <~--text-bytes distinct text>, "sampling_params": {...}, "stream": true}``
and reads each stream to its ``[DONE]``. Reported: the router's idle RSS, its peak RSS (VmHWM)
and RSS when the streams are done, per-stream growth, and how many streams completed (every
one must: any other outcome exits non-zero). Output printed and written to
bench/out/memory_generate.md.

Usage: ``python bench/memory_generate.py [--streams 5000] [--events 10] [--gap 0.5]
[--text-bytes 2048] [-- extra fastroute flags]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from memory import proc_kb, raise_nofile, wait_ready  # noqa: E402
from overhead import Procs, free_port, worker_bodies  # noqa: E402

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "routers",
    "relay",
    "long",
    "prompts",
]


# ----------------------------------------------------------------------------- worker


def worker_main(port: int, events: int, gap: float) -> None:
    from aiohttp import web

    b = worker_bodies("regular", 1, None)
    fixed = {
        "/health": "",
        "/health_generate": "",
        "/flush_cache": "",
        "/server_info": b["SERVER_INFO"],
        "/get_server_info": b["SERVER_INFO"],
        "/model_info": b["MODEL_INFO"],
        "/get_model_info": b["MODEL_INFO"],
        "/v1/models": b["MODELS"],
        "/v1/loads": b["LOADS"],
        "/get_load": b["GET_LOAD"],
    }
    chunks = []
    for i in range(events):
        ev = {
            "text": f" tok{i}",
            "output_ids": [i],
            "meta_info": {
                "id": "membench",
                "finish_reason": None if i < events - 1 else {"type": "length", "length": events},
                "prompt_tokens": 512,
                "completion_tokens": i + 1,
            },
        }
        chunks.append(b"data: " + json.dumps(ev, separators=(",", ":")).encode() + b"\n\n")

    async def get(request: Any) -> Any:
        body = fixed.get(request.path)
        if body is None:
            return web.Response(status=404)
        return web.Response(text=body, content_type="application/json")

    async def generate(request: Any) -> Any:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for c in chunks:  # one event per write, as SGLang streams
            await asyncio.sleep(gap)
            await resp.write(c)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    app = web.Application(client_max_size=1 << 24)
    app.router.add_post("/generate", generate)
    app.router.add_get("/{tail:.*}", get)
    web.run_app(app, host="127.0.0.1", port=port, backlog=8192, print=None, access_log=None, handle_signals=True)


# ----------------------------------------------------------------------------- client


async def one(session: Any, url: str, body: bytes, out: list[int]) -> None:
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        if r.status != 200:
            out[1] += 1
            await r.read()
            return
        data = await r.read()
        out[2] += data.count(b"data: ")
        if data.rstrip().endswith(b"data: [DONE]"):
            out[0] += 1
        else:
            out[1] += 1


async def clients(n: int, port: int, text_bytes: int, timeout: float) -> tuple[list[int], float]:
    import aiohttp

    rng = random.Random(5)
    bodies = []
    for i in range(n):
        words, size = [str(i)], 0
        while size < text_bytes:
            w = rng.choice(WORDS)
            words.append(w)
            size += len(w) + 1
        bodies.append(
            json.dumps(
                {"text": " ".join(words), "stream": True, "sampling_params": {"max_new_tokens": 10, "temperature": 0}}
            ).encode()
        )
    out = [0, 0, 0]  # complete, failed, events
    conn = aiohttp.TCPConnector(limit=0, force_close=False)
    to = aiohttp.ClientTimeout(total=timeout)
    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=conn, timeout=to) as session:
        url = f"http://127.0.0.1:{port}/generate"
        res = await asyncio.gather(*(one(session, url, b, out) for b in bodies), return_exceptions=True)
    out[1] += sum(1 for r in res if isinstance(r, BaseException))
    return out, time.monotonic() - t0


async def sample(pid: int, stop: asyncio.Event, into: list[int]) -> None:
    while not stop.is_set():
        try:
            into.append(proc_kb(pid, "VmRSS"))
        except (OSError, KeyError):
            return
        await asyncio.sleep(0.25)


async def run(args: argparse.Namespace) -> str:
    raise_nofile(2 * args.streams + 512)
    procs = Procs(Path(os.environ.get("TMPDIR", "/tmp")))
    wport = free_port()
    try:
        procs.start(
            "memgen-worker",
            [sys.executable, __file__, "--worker", str(wport), "--events", str(args.events), "--gap", str(args.gap)],
        )
        port, prom = free_port(), free_port()
        argv = [
            sys.executable,
            "-m",
            "fastroute",
            "--worker-urls",
            f"http://127.0.0.1:{wport}",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-port",
            str(prom),
            "--policy",
            "power_of_two",
            "--p2c-load-metric",
            "requests",
            *args.router_args,
        ]
        env = dict(os.environ, PYTHONPATH=str(args.checkout))
        proc = procs.start("memgen-router", argv, env=env, cwd=args.checkout)
        await asyncio.to_thread(wait_ready, port, proc)
        await asyncio.sleep(1.0)
        idle = proc_kb(proc.pid, "VmRSS")
        rss: list[int] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample(proc.pid, stop, rss))
        out, took = await clients(args.streams, port, args.text_bytes, timeout=60 + args.events * args.gap * 4)
        stop.set()
        await sampler
        peak = proc_kb(proc.pid, "VmHWM")
        after = proc_kb(proc.pid, "VmRSS")
        alive = proc.poll() is None
    finally:
        procs.stop_all()
    complete, failed, events = out
    lines = [
        "# Memory: concurrent /generate SSE streams (aiohttp client and worker)",
        "",
        f"Command: `{' '.join([sys.executable, *sys.argv])}`",
        "",
        f"fastroute: `{' '.join(argv[3:])}`",
        "",
        f"{args.streams} requests started at once, ~{args.text_bytes} B distinct `text` "
        f"each, {args.events} events {args.gap} s apart per stream.",
        "",
        "| streams | complete | failed | events | idle RSS MB | peak RSS MB | "
        "max sampled RSS MB | RSS after MB | (peak-idle)/stream KB | wall s |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| {args.streams} | {complete} | {failed} | {events} | {idle / 1024:.1f} | "
        f"{peak / 1024:.1f} | {max(rss, default=0) / 1024:.1f} | {after / 1024:.1f} | "
        f"{(peak - idle) / args.streams:.1f} | {took:.1f} |",
        "",
    ]
    if not alive:
        lines.append("router exited during the run")
    report = "\n".join(lines)
    if complete != args.streams or not alive:
        print(report)
        raise SystemExit(f"{args.streams - complete} streams did not complete")
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="generate", help=argparse.SUPPRESS)
    ap.add_argument("--streams", type=int, default=5000)
    ap.add_argument("--events", type=int, default=10)
    ap.add_argument("--gap", type=float, default=0.5)
    ap.add_argument("--text-bytes", type=int, default=2048)
    ap.add_argument("--out", type=Path, default=HERE / "out" / "memory_generate.md")
    ap.add_argument("--checkout", type=Path, default=REPO, help="fastroute checkout to run (extensions built in place)")
    ap.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("router_args", nargs="*", help="extra fastroute flags (after --)")
    args = ap.parse_args(argv)
    if args.worker is not None:
        raise_nofile(12000)
        worker_main(args.worker, args.events, args.gap)
        return 0
    report = asyncio.run(run(args))
    print(report)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(report + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
