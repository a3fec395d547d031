"""/generate latency with a 2.9 MB live peer entry in Redis (it must be skipped, not
parsed on the request path).

``PYTHONPATH=. python3 bench/replica_oversize.py``: one router with --replica-sync to a real
redis-server and a fake 8-rank worker; 300 sequential requests without, then with, a forged
live peer entry of 2.9 MB. Prints {case: (p50 ms, peers, sync errors, max ms)}. Before the
size cap every 25 ms tick decoded the entry on the loop (max ~70 ms); now Redis sends only its
length and the entry is skipped."""

import asyncio
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import redis

from fastroute.control.replica import BEAT_KEY, LOAD_KEY
from fastroute.sim.redisproc import RedisProcess
from tests.integration.conftest import Router, call, post, workers


async def main():
    with RedisProcess() as rp:
        (w,) = await workers(1, dp_size=8)
        c = redis.Redis.from_url(rp.url)
        async with Router(
            worker_urls=[w.url], dp_aware=True, replica_sync=rp.url, replica_id="B", replica_sync_interval_ms=25
        ) as r:
            names = r.server.registry.find(w.url).names
            out = {}
            for label, big in (("no entry", False), ("2.9 MB entry", True)):
                if big:
                    sec, usec = c.time()
                    c.zadd(BEAT_KEY, {"big": sec * 1000 + usec // 1000 + 600_000})
                    line = f"{names[0]}\t1\t1\t0\n".encode()
                    c.hset(LOAD_KEY, "big", line * (2_900_000 // len(line)))
                    await asyncio.sleep(0.5)
                ts = []
                for _ in range(300):
                    t = time.perf_counter()
                    assert (await call(r.port, post("/generate", {"text": "x"}))).status == 200
                    ts.append(time.perf_counter() - t)
                out[label] = (
                    round(statistics.median(ts) * 1000, 2),
                    r.server.replica.peers,
                    r.server.replica.errors,
                    round(max(ts) * 1000, 1),
                )
            print(out)
        await w.stop()


asyncio.run(main())
