"""What applying the engines' KV events and loads costs the router, per batch, over real ZMQ.

``python bench/kv_apply_cost.py [--batches 3000] [--blocks 24] [--block-size 512]``

A publisher in its own process sends SGLang 0.5.23's frames on real PUB sockets: stored chains
of ``--blocks`` blocks of ``--block-size`` token ids (a Mooncake request of ~12k tokens is 24
blocks of 512), each with the eviction of an older chain, and a LoadStat per batch, as fast as it
can. The router's own subscriber (fastroute.control.kvevents, one rank) applies them to its index
and table in this process. Printed: this process's CPU (its ZMQ I/O thread included) per KV
batch + LoadStat, and what that is at a given event rate.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import msgspec  # noqa: E402
import uvloop  # noqa: E402
import zmq  # noqa: E402

from fastroute.control.kvevents import KvEvents, RankStream  # noqa: E402
from fastroute.core.kvindex import KvIndex  # noqa: E402
from fastroute.core.table import TargetTable  # noqa: E402

enc = msgspec.msgpack.Encoder()


def batches(n: int, blocks: int, bs: int) -> list[bytes]:
    out = []
    for i in range(n):
        hashes = [i * 1000 + k for k in range(blocks)]
        tokens = [(i * 7919 + k) % 32000 for k in range(blocks * bs)]
        ev = [
            {
                "type": "BlockStored",
                "block_hashes": hashes,
                "parent_block_hash": None,
                "token_ids": tokens,
                "block_size": bs,
                "lora_id": None,
                "medium": "GPU",
            }
        ]
        if i >= 50:  # keep the index at ~50 chains: evict the one stored 50 batches ago
            ev.insert(0, {"type": "BlockRemoved", "block_hashes": [(i - 50) * 1000 + k for k in range(blocks)]})
        out.append(enc.encode([time.time(), ev, 0]))
    return out


def publish(port: int, lport: int, n: int, blocks: int, bs: int, start: float) -> None:
    """The publisher, in its own process (its CPU is not the router's)."""
    payloads = batches(n, blocks, bs)
    stat = enc.encode(["LoadStat", 1, 3, 12_000, 1_500_000, 0, 30_000, 42_000, 256, 0, 0])
    ctx = zmq.Context()
    pub, lpub = ctx.socket(zmq.PUB), ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    lpub.setsockopt(zmq.SNDHWM, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")
    lpub.bind(f"tcp://127.0.0.1:{lport}")
    time.sleep(max(0.0, start - time.time()))
    for seq, p in enumerate(payloads):
        pub.send_multipart([b"", seq.to_bytes(8, "big"), p])
        lpub.send_multipart([b"load", seq.to_bytes(8, "big"), stat])
    time.sleep(2.0)
    ctx.destroy(linger=0)


async def run(ns: argparse.Namespace) -> None:
    import multiprocessing
    import socket

    ports = []
    for _ in range(2):
        with socket.socket() as sk:
            sk.bind(("127.0.0.1", 0))
            ports.append(sk.getsockname()[1])
    start = time.time() + 1.5 + ns.batches * ns.blocks * ns.block_size / 2e6  # the payloads are built first
    proc = multiprocessing.get_context("spawn").Process(
        target=publish, args=(ports[0], ports[1], ns.batches, ns.blocks, ns.block_size, start)
    )
    proc.start()
    table = TargetTable(capacity=8)
    t = table.alloc()
    index = KvIndex()
    kv = KvEvents(table, index, stale_secs=60.0)
    s = RankStream(
        "http://w", 0, t, f"tcp://127.0.0.1:{ports[0]}", None, f"tcp://127.0.0.1:{ports[1]}", ns.block_size, True
    )
    kv.streams[("w", 0)] = s
    index.attach(t, ns.block_size)
    tasks = [
        asyncio.ensure_future(kv._supervise(s, kv._kv_stream, "")),
        asyncio.ensure_future(kv._supervise(s, kv._load_stream, "load")),
    ]
    await asyncio.sleep(max(0.0, start - time.time() - 0.2))
    c0, w0 = time.process_time(), time.monotonic()
    deadline = time.monotonic() + 120
    while (s.batches < ns.batches or s.loads < ns.batches) and time.monotonic() < deadline:
        await asyncio.sleep(0.005)
    cpu, wall = time.process_time() - c0, time.monotonic() - w0
    held = index.blocks(t)
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await kv.stop()
    proc.join(10)
    per = cpu / max(1, s.batches) * 1e6
    print(
        f"{s.batches} KV batches ({ns.blocks} blocks of {ns.block_size} tokens stored, and from the 51st on "
        f"as many evicted) and {s.loads} LoadStats applied in {wall:.1f} s; index {held} blocks; "
        f"malformed {s.malformed}, gaps {s.gaps}"
    )
    print(f"router process CPU per (KV batch + LoadStat): {per:.0f} us")
    for rate in ns.rates:
        print(f"  at {rate:g} batches/s: {per * rate / 1e6 * 100:.1f}% of a core")
    table.close()
    table.unlink()


def main() -> int:
    ap = argparse.ArgumentParser(prog="python bench/kv_apply_cost.py", description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=3000)
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--rates", type=float, nargs="+", default=[30.0, 100.0, 1000.0])
    uvloop.run(run(ap.parse_args()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
