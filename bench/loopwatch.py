"""Run the router with a probe that measures its event loop's stalls in CPU time.

``python bench/loopwatch.py OUT.json -m fastroute ARGS...``: a timer callback every 1 ms on the
router's loop records the CPU time the process's main thread spent between two of its runs; an
interval that used more than 3 ms of CPU is a stall caused by the router's own work (waiting
for a core does not count, so the measure holds on a busy machine where wall-clock latency does
not). Full collections of the garbage collector are timed the same way. At exit it writes
``{"stalls": [[t, cpu_ms], ...], "gen2": [[t, cpu_ms], ...]}`` to OUT.json, ``t`` the
system-wide ``time.monotonic()`` (comparable with the benchmark's own clock). Used by ``bench/fleet_scale.py --stalls``.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import json
import os
import runpy
import sys
import time

STALL_MS = 3.0
_stalls: list[list[float]] = []
_gen2: list[list[float]] = []
_gc_started = [0.0]


def _on_gc(phase: str, info: dict) -> None:
    if info.get("generation") != 2:
        return
    if phase == "start":
        _gc_started[0] = time.thread_time()
    else:
        _gen2.append([round(time.monotonic(), 3), round((time.thread_time() - _gc_started[0]) * 1000, 2)])


def _start_probe() -> None:
    loop = asyncio.get_running_loop()
    last = [time.thread_time()]

    def beat() -> None:
        now = time.thread_time()
        cpu_ms = (now - last[0]) * 1000
        if cpu_ms > STALL_MS:
            _stalls.append([round(time.monotonic(), 3), round(cpu_ms, 2)])
        last[0] = time.thread_time()
        loop.call_later(0.001, beat)

    loop.call_later(0.001, beat)


def main() -> None:
    out = sys.argv[1]
    if sys.argv[2] != "-m":
        raise SystemExit("usage: loopwatch.py OUT.json -m MODULE ARGS...")
    module = sys.argv[3]
    sys.argv = [module, *sys.argv[4:]]
    sys.path.insert(0, os.getcwd())
    gc.callbacks.append(_on_gc)

    import fastroute.runtime.server as server

    start = server.Server.start

    async def probe_and_start(self: server.Server) -> None:  # from the router's first step
        _start_probe()
        await start(self)

    server.Server.start = probe_and_start  # type: ignore[method-assign]

    def dump() -> None:
        with open(out, "w") as f:
            json.dump({"stalls": _stalls, "gen2": _gen2}, f)

    atexit.register(dump)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
