"""Where one router process spends its CPU per request: cProfile under a wrk load.

Starts the same nginx fake workers as ``bench/overhead.py``, runs one fastroute process under
cProfile (regular or PD, with the overhead benchmark's command line), drives it with wrk (JSON
or SSE, 256 connections) and prints the functions that used the most own time, in microseconds
per request, grouped as a table. cProfile adds its own cost to every Python call (so the sum is
well above the unprofiled CPU per request); read the table for shares and call counts, and
measure speed with ``bench/overhead.py``. Functions of compiled modules (the core, and the data
plane's classes when built) are invisible to cProfile: their time shows as their callers' own
time; ``--perf`` sees them, by shared object.

Usage: ``python bench/profile.py --mode regular --kind json [--seconds 5] [--top 25]``
"""

from __future__ import annotations

import argparse
import os
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import overhead as ov  # noqa: E402  (the benchmark's backends and helpers, one definition)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("regular", "pd"), default="regular")
    ap.add_argument("--kind", choices=("json", "sse"), default="json")
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--connections", type=int, default=256)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument(
        "--perf",
        action="store_true",
        help="no cProfile: sample the router with `perf record` instead and print the "
        "share of CPU per shared object (kernel, interpreter, uvloop, httptools, "
        "fastroute's compiled modules)",
    )
    ap.add_argument(
        "--strace", action="store_true", help="count the router's system calls per request (strace -c) instead"
    )
    ap.add_argument(
        "--router",
        choices=("fastroute", "bare", "lean"),
        default="fastroute",
        help="bare: sample bench/bare_relay.py instead (with --perf), for comparison; "
        "lean: the floor, /work/shared/bench/lean_relay.py (bench/lean_pd_relay.py with --mode pd)",
    )
    bodies = ap.add_mutually_exclusive_group()
    bodies.add_argument(
        "--chat-bytes",
        type=int,
        default=None,
        help="send distinct ~N byte chat bodies (bench/floor.py's) instead of the fixed small ones",
    )
    bodies.add_argument(
        "--gen-bytes",
        type=int,
        default=None,
        help="send distinct ~N byte /generate bodies (bench/floor.py's) instead of the fixed small ones",
    )
    ap.add_argument(
        "--checkout", type=Path, default=ov.REPO, help="fastroute checkout to profile (extensions built in place)"
    )
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="fastroute-profile-"))
    be = ov.Backends.fresh()
    procs = ov.Procs(tmp)
    try:
        procs.start("nginx", ["nginx", "-c", str(ov.write_nginx(tmp, be)), "-p", str(tmp)])
        import floor

        if a.router == "lean":
            fr = next(r for r in floor.routers(a.mode, be, {}, tmp, "profile", "nginx") if r.name == "lean")
        else:
            fr = next(r for r in ov.router_commands(a.mode, be, {}) if r.name == a.router)
        out = tmp / "prof.out"
        argv = (
            [sys.executable, *fr.argv[1:]]
            if a.perf or a.strace
            else [sys.executable, "-m", "cProfile", "-o", str(out), *fr.argv[1:]]
        )
        env = dict(os.environ, PYTHONPATH=str(a.checkout))
        p = procs.start("fastroute", argv, env, cwd=a.checkout)
        err = ov.wait_ready(fr.port, p)
        if err:
            print(err, procs.log_tail("fastroute"))
            return 1
        path, body = (ov.JSON_PATH, ov.JSON_BODY) if a.kind == "json" else (ov.SSE_PATH, ov.SSE_BODY)
        if a.chat_bytes:
            path = ov.SSE_PATH
            lua = floor.write_lua(
                tmp, "chat", path, floor.variants(floor.chat_obj, a.chat_bytes, a.kind == "sse", a.chat_bytes)
            )
        elif a.gen_bytes:
            path = ov.JSON_PATH
            lua = floor.write_lua(
                tmp, "gen", path, floor.variants(floor.generate_obj, a.gen_bytes, a.kind == "sse", a.gen_bytes)
            )
        else:
            lua = ov.write_lua(tmp, a.kind, path, body)
        s = ov.Settings(duration=a.seconds, rounds=1, modes=[a.mode], lat_json=0, lat_sse=0)
        warm = ov.run_wrk(s, fr.port, lua, 64, 1)  # warm-up (its requests are profiled too)
        if a.strace:
            rec = subprocess.Popen(
                ["strace", "-c", "-f", "-p", str(p.pid)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            time.sleep(0.5)
            res = ov.run_wrk(s, fr.port, lua, a.connections, a.seconds)
            rec.send_signal(signal.SIGINT)
            text = rec.communicate(timeout=30)[0]
            n = res["requests"]
            print(
                f"### {a.router} {a.mode} {a.kind} c={a.connections}: {n:,} requests; "
                "system calls per request (strace -c)\n"
            )
            for line in text.splitlines():
                f = line.split()
                if len(f) >= 5 and f[3].isdigit():
                    print(f"  {f[-1]:20s} {int(f[3]) / n:6.2f}")
            return 0
        if a.perf:
            data = tmp / "perf.data"
            rec = subprocess.Popen(
                [
                    "perf",
                    "record",
                    "-q",
                    "-F",
                    "2000",
                    "-o",
                    str(data),
                    "-p",
                    str(p.pid),
                    "--",
                    "sleep",
                    str(a.seconds),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            res = ov.run_wrk(s, fr.port, lua, a.connections, a.seconds)
            rec.wait(a.seconds + 30)
            print(
                f"### {a.mode} {a.kind} c={a.connections}: {res['rps']:,.0f} req/s; "
                f"perf samples by shared object, then by symbol\n"
            )
            for sort in ("dso", "dso,sym"):
                rep = subprocess.run(
                    [
                        "perf",
                        "report",
                        "-i",
                        str(data),
                        "--stdio",
                        "--no-children",
                        "-g",
                        "none",
                        "--sort",
                        sort,
                        "--percent-limit",
                        "0.7",
                    ],
                    capture_output=True,
                    text=True,
                ).stdout
                print("\n".join(x for x in rep.splitlines() if x and not x.startswith("#")))
                print()
            return 0
        res = ov.run_wrk(s, fr.port, lua, a.connections, a.seconds)
        n = warm["requests"] + res["requests"]
        p.send_signal(signal.SIGINT)
        p.wait(30)
        for _ in range(50):
            if out.exists():
                break
            time.sleep(0.1)
        st = pstats.Stats(str(out))
        rows = sorted(st.stats.items(), key=lambda kv: -kv[1][2])  # type: ignore[attr-defined]
        total = sum(v[2] for _, v in rows)
        print(
            f"### {a.mode} {a.kind} c={a.connections}: {n:,} requests, "
            f"{total / n * 1e6:.1f} us/request of profiled own time\n"
        )
        print("| function | calls/req | own us/req | share |")
        print("|---|---|---|---|")
        for (file, line, name), (_cc, nc, tt, _ct, _callers) in rows[: a.top]:
            short = file.replace(str(a.checkout) + "/", "").replace(sys.prefix, "<py>")
            if "site-packages/" in short:
                short = short.split("site-packages/")[1]
            print(f"| {short}:{line} {name} | {nc / n:.2f} | {tt / n * 1e6:.2f} | {tt / total:.1%} |")
        return 0
    finally:
        procs.stop_all()


if __name__ == "__main__":
    sys.exit(main())
