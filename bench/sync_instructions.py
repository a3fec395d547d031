"""Instructions of one replica-sync tick, counted by valgrind: old vs new without the noise.

``bench/fleet_scale.py --only sync`` times a tick in CPU time, which moves by tens of percent
between runs on a shared machine. This counts it: the measured process (under ``valgrind
--tool=callgrind``) holds replica 0 of ``--replicas`` over ``--targets`` targets, as in
fleet_scale's sync section (every target busy everywhere, 5% of every replica's targets change
their in-flight count between two ticks); the other replicas, and the churn of replica 0's table
(shared memory), run in a helper process valgrind does not trace, stepped through a pipe before
each tick of replica 0. Two runs with ``--n1`` and ``--n2`` ticks give (Ir at n2 - Ir at n1) /
(n2 - n1): user-space instructions of one tick (encode, the script call's client side with
hiredis's parsing, decoding the peers' changes, storing the sums), start-up and the first
(whole) read excluded; the kernel's socket work and Redis's are not counted. The cyclic
collector is off in the measured process (its passes land at different ticks per version).

Usage: ``python bench/sync_instructions.py [--checkout DIR ...] [--targets 512 4096]
[--replicas 8] [--n1 10] [--n2 40]`` (each checkout built in place; default: this one).
Needs valgrind and a redis-server (fastroute.sim.redisproc).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fastroute.sim.redisproc import RedisProcess  # noqa: E402

# The target names and loads of bench/fleet_scale.py's sync section.
_COMMON = r"""
import sys
import numpy as np
from fastroute.core.table import TargetTable

class Targets:
    def __init__(self, n):
        self.target_info = [("w", r) for r in range(n)]
        self._names = [f"http://10.0.{r // 8 // 250}.{r // 8 % 250}:30000@{r % 8}" for r in range(n)]
        self.background = None
    def target_name(self, t):
        return self._names[t]

def busy_table(n, i):
    tab = TargetTable(n)
    for _ in range(n):
        t = tab.alloc()
        tab.cells.store(t, 0, 1 + (t + i) % 3)
        tab.cells.store(t, 1, 1000 * (1 + t % 5))
    return tab
"""

# Not traced: replicas 1..k-1, and every replica's churn (replica 0's through its shared table).
_HELPER = (
    _COMMON
    + r"""
import asyncio
from fastroute.control.replica import ReplicaSync
url, n, k, own = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]

async def main():
    tables = [TargetTable.attach(own)] + [busy_table(n, i) for i in range(1, k)]
    syncs = [ReplicaSync(url, f"r{i}", tables[i], Targets(n), 0.01, 5.0) for i in range(1, k)]
    rs = np.random.default_rng(1)
    moved = max(1, int(0.05 * n))
    first = True
    while sys.stdin.readline():
        if not first:
            for tab in tables:
                for t in rs.choice(n, moved, replace=False).tolist():
                    tab.cells.store(t, 0, int(rs.integers(0, 4)))
        first = False
        for s in syncs:
            await s.tick()
        sys.stdout.write("ok\n")
        sys.stdout.flush()
    for s in syncs:
        await s.client.aclose()
    for tab in tables[1:]:
        tab.close()
        tab.unlink()
    tables[0].close()

asyncio.run(main())
"""
)

# Traced: replica 0's ticks.
_CHILD = (
    _COMMON
    + r"""
import gc, subprocess
import uvloop
from fastroute.control.replica import ReplicaSync
url, n, k, ticks, helper_src = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
tab = busy_table(n, 0)
helper = subprocess.Popen([sys.executable, "-c", helper_src, url, str(n), str(k), tab.name],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE)

def step():
    helper.stdin.write(b"go\n")
    helper.stdin.flush()
    assert helper.stdout.readline() == b"ok\n"

async def main():
    sync = ReplicaSync(url, "r0", tab, Targets(n), 0.01, 5.0)
    step()
    assert await sync.tick() == k - 1
    gc.collect()
    gc.disable()
    for _ in range(ticks):
        step()
        assert await sync.tick() == k - 1
    await sync.client.aclose()

uvloop.run(main())
helper.stdin.close()
assert helper.wait() == 0
tab.close()
tab.unlink()
"""
)


def count(checkout: Path, n: int, k: int, ticks: int) -> int:
    """Instructions callgrind counted for one process running ``ticks`` ticks of replica 0."""
    with tempfile.TemporaryDirectory() as tmp, RedisProcess() as rp:
        # one BLAS thread: idle OpenBLAS workers spin, and valgrind would count their spinning
        env = dict(os.environ, PYTHONPATH=str(checkout), PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1")
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={tmp}/out", sys.executable, "-c", _CHILD]
        cmd += [rp.url, str(n), str(k), str(ticks), _HELPER]
        res = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True, timeout=1800)
        if res.returncode != 0:
            raise SystemExit(f"{checkout} n={n} k={k} ticks={ticks} failed:\n{res.stderr[-3000:]}")
        m = re.search(r"Collected\s*:\s*(\d+)", res.stderr)
        if m is None:
            raise SystemExit(f"no instruction count in valgrind's output:\n{res.stderr[-2000:]}")
        return int(m.group(1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkout", action="append", type=Path, help="a built checkout (repeat; default: this one)")
    ap.add_argument("--targets", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--n1", type=int, default=10, help="ticks in the first run (start-up baseline)")
    ap.add_argument("--n2", type=int, default=40, help="ticks in the second run")
    a = ap.parse_args(argv)
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind not found (Debian: apt-get install valgrind)")
    checkouts = [c.resolve() for c in (a.checkout or [REPO])]
    print(f"| targets x replicas | {' | '.join(str(c) for c in checkouts)} |")
    print("|---" * (len(checkouts) + 1) + "|")
    for n in a.targets:
        per = []
        for c in checkouts:
            n1, n2 = count(c, n, a.replicas, a.n1), count(c, n, a.replicas, a.n2)
            per.append((n2 - n1) / (a.n2 - a.n1))
        print(f"| {n:,} x {a.replicas} | {' | '.join(f'{p:,.0f}' for p in per)} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
