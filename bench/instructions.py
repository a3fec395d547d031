"""Instructions per request on the router's own path, counted by valgrind: old vs new, no noise.

On a shared machine wall-clock and CPU-time benchmarks of one code change swing by tens of
percent between rounds (other tenants, frequency, caches), so a few percent cannot be told from
noise. An instruction count can: valgrind's callgrind executes the process on a synthetic CPU
and counts every instruction, the same on every run. This runs the in-process request rounds of
tests/bench/test_bench_proxy.py (client bytes in, the worker's answer played to the leg: what
the data path costs on top of the kernel's socket work, which no restructure of ours changes)
under ``valgrind --tool=callgrind`` for each checkout, twice with different request counts, and
reports (Ir at N2 - Ir at N1) / (N2 - N1): the instructions of one request, start-up excluded.
The cyclic garbage collector is off in the measured process: when its passes run depends on
allocation counts since start-up, which differ between versions for reasons that have nothing to
do with the request path, and they made the same version's count move by 10% between runs.

Usage: ``python bench/instructions.py --checkout /path/old --checkout /path/new`` (each a
checkout with its extensions built in place; default: this one). Needs valgrind (Debian
``valgrind``). Scenarios: json (regular JSON, metrics off), json-metrics (metrics on), sse (a
regular stream of 8 events), pd-sse (PD, dp-aware, 8 decode events).
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
SCENARIOS = ("json", "json-metrics", "sse", "pd-sse")

# Runs inside the measured process, from the checkout (cwd): the rounds of that checkout's own
# tests/bench/test_bench_proxy.py, so each version is driven through its own API.
_CHILD = r"""
import sys
from tests.bench import test_bench_proxy as B
from tests.stubs import StubConn

scenario, n = sys.argv[1], int(sys.argv[2])

def setup(metrics, **cfg):
    # Metrics on: where _setup takes ``metrics`` (the connection takes the telemetry when it is
    # made), else the App that holds the data path gets the Stats after the fact.
    import inspect
    if "metrics" in inspect.signature(B._setup).parameters:
        return B._setup(metrics=metrics, **cfg)
    proto, pool, loop = B._setup(**cfg)
    if metrics:
        from fastroute.control.metrics import Stats
        d = getattr(proto, "dispatch", None)
        (d.owner if d is not None else proto.app).stats = Stats()
    return proto, pool, loop

def stream(leg):  # the worker's 8 SSE events, one read each, then [DONE] and the end
    for _ in range(8):
        leg.up_body(B.EVENT)
        leg.up_flush()
    leg.up_body(b"data: [DONE]\n\n")
    leg.up_done()

if scenario == "pd-sse":
    proto, pool, loop = B._setup(pd_disaggregation=True, prefill=[("http://127.0.0.1:9", 8998)],
                                 decode=["http://127.0.0.1:10"], dp_aware=True)
    legs = []
    def send(request, leg, *rest):
        leg.conn = StubConn()
        legs.append(leg)
    pool.send = send
    def one():
        legs.clear()
        proto.data_received(B.SSE_REQ)
        p, d = legs
        p.up_head(200, B.SSE_HEAD)
        d.up_head(200, B.SSE_HEAD)
        p.up_body(B.EVENT)
        p.up_done()
        stream(d)
else:
    proto, pool, loop = setup(scenario == "json-metrics", worker_urls=["http://127.0.0.1:9"])
    if scenario == "sse":
        def one():
            proto.data_received(B.SSE_REQ)
            leg = pool.last
            leg.up_head(200, B.SSE_HEAD)
            stream(leg)
    else:
        def one():
            B._json_round(proto, pool)
import gc
gc.disable()  # the collector's passes land at different requests in each version: counted apart
for _ in range(n):
    one()
assert not proto.busy
"""


def count(checkout: Path, scenario: str, n: int) -> int:
    """Instructions callgrind counted for one child process running ``n`` requests."""
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, PYTHONPATH=str(checkout), PYTHONHASHSEED="0")
        cmd = [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={tmp}/out",
            sys.executable,
            "-c",
            _CHILD,
            scenario,
            str(n),
        ]
        res = subprocess.run(cmd, cwd=checkout, env=env, capture_output=True, text=True, timeout=1800)
        if res.returncode != 0:
            raise SystemExit(f"{checkout} {scenario} n={n} failed:\n{res.stderr[-3000:]}")
        m = re.search(r"Collected\s*:\s*(\d+)", res.stderr)
        if m is None:
            raise SystemExit(f"no instruction count in valgrind's output:\n{res.stderr[-2000:]}")
        return int(m.group(1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkout", action="append", type=Path, help="a built checkout (repeat; default: this one)")
    ap.add_argument("--scenarios", nargs="+", choices=SCENARIOS, default=list(SCENARIOS))
    ap.add_argument("--n1", type=int, default=500, help="requests in the first run (start-up baseline)")
    ap.add_argument("--n2", type=int, default=3500, help="requests in the second run")
    a = ap.parse_args(argv)
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind not found (Debian: apt-get install valgrind)")
    checkouts = [c.resolve() for c in (a.checkout or [REPO])]
    rows: dict[str, list[float]] = {}
    for scenario in a.scenarios:
        for c in checkouts:
            per = (count(c, scenario, a.n2) - count(c, scenario, a.n1)) / (a.n2 - a.n1)
            rows.setdefault(scenario, []).append(per)
            print(f"{scenario:13s} {c}: {per:,.0f} instructions per request", flush=True)
    head = "| scenario | " + " | ".join(str(c) for c in checkouts)
    if len(checkouts) == 2:
        head += " | last/first"
    print("\n" + head + " |")
    print("|---" * (len(checkouts) + 1 + (len(checkouts) == 2)) + "|")
    for scenario, vals in rows.items():
        line = f"| {scenario} | " + " | ".join(f"{v:,.0f}" for v in vals)
        if len(vals) == 2:
            line += f" | {vals[1] / vals[0]:.3f}x"
        print(line + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
