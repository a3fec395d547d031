"""The data plane against its floor: fastroute / lean relay on realistic bodies and paced streams.

Run through ``python bench/overhead.py --floor`` (or this file directly; same arguments). The floor
is ``/work/shared/bench/lean_relay.py`` (regular) and ``bench/lean_pd_relay.py`` (PD: both legs at
once, the decode's answer relayed): the leanest uvloop+httptools relays, no body parsing. Rows:

* JSON at 256 connections (wrk -t1) on chat and /generate bodies of ~0.1, 2 and 48 KB; every
  request body is distinct (64 variants, each with the request counter spliced into its prompt,
  as real users' prompts differ), against nginx workers with fixed answers;
* paced SSE at 256 connections: ``bench/paced_sse.py`` workers write one event per write, 20-50
  ms apart, SGLang's framing ``data: {...}\\n\\n`` ... ``data: [DONE]\\n\\n`` (2 KB chat bodies,
  ``"stream":true``). Throughput there is bounded by the pacing, so the router CPU per request
  is the row that tells routers apart;
* added p50 at concurrency 1 (router minus direct) on the 2 KB chat JSON body, the routers taking
  turns in blocks of 25 requests within each round (``c1_interleaved``);
* router CPU microseconds per request (process tree, /proc) for every wrk row.

Columns: direct (latency only), lean (the floor), fastroute, fastroute-base (the same command
from ``--base-checkout DIR``, for before/after in one run), bare (bench/bare_relay.py), nginx (a
reverse proxy, 1 worker, upstream keep-alive, no buffering: the C reference; regular only) and
smg when importable. Rounds alternate the router order; cells are medians over rounds. Output:
markdown, printed and written to bench/out/floor.md.
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import overhead as ov  # noqa: E402

LEAN = Path("/work/shared/bench/lean_relay.py")
VARIANTS = 64
SIZES = (100, 2048, 48 * 1024)
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
    "count",
    "tokens",
    "and",
    "caches",
    "remember",
    "prefixes",
    "of",
    "long",
    "prompts",
]


# ----------------------------------------------------------------------------- bodies


def prose(rng: random.Random, size: int) -> str:
    out, n = [], 0
    while n < size:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


MARK = "\x00COUNTER\x00"  # where the per-request counter goes (json-escaped in the dump)


def chat_obj(rng: random.Random, size: int, stream: bool) -> dict[str, Any]:
    """An OpenAI chat body of ~size bytes: a system prompt and alternating turns (~600 B each)."""
    turns = max(1, size // 600)
    per = max(8, (size - 140) // (turns + 1) - 40)
    msgs = [{"role": "system", "content": MARK + prose(rng, per)}]
    for i in range(turns):
        msgs.append({"role": "user" if i % 2 == 0 else "assistant", "content": prose(rng, per)})
    return {"model": ov.MODEL, "messages": msgs, "max_tokens": 16, "stream": stream, "temperature": 0.7}


def generate_obj(rng: random.Random, size: int, stream: bool) -> dict[str, Any]:
    return {
        "text": MARK + prose(rng, max(8, size - 110)),
        "sampling_params": {"max_new_tokens": 16, "temperature": 0.7},
        "stream": stream,
    }


def variants(
    make: Callable[[random.Random, int, bool], dict[str, Any]], size: int, stream: bool, seed: int
) -> list[tuple[str, str]]:
    """VARIANTS (pre, post) pairs: a request body is ``pre + str(counter) + post``."""
    rng = random.Random(seed)
    out = []
    for _ in range(VARIANTS):
        text = json.dumps(make(rng, size, stream), separators=(",", ":"), ensure_ascii=False)
        pre, _, post = text.partition(json.dumps(MARK)[1:-1])
        out.append((pre, post))
    return out


def write_lua(tmp: Path, name: str, path: str, parts: list[tuple[str, str]]) -> Path:
    """A wrk script sending distinct bodies: variant (n mod 64) with the counter n spliced in."""

    def q(s: str) -> str:
        if "]==]" in s:
            raise ValueError("body would end the Lua long string")
        return "[==[" + s + "]==]"

    lines = [
        'wrk.method = "POST"',
        f'wrk.path = "{path}"',
        'wrk.headers["Content-Type"] = "application/json"',
        "local pre = {" + ",\n".join(q(a) for a, _ in parts) + "}",
        "local post = {" + ",\n".join(q(b) for _, b in parts) + "}",
        "local n = 0",
        "request = function()",
        "  n = n + 1",
        f"  local i = n % {len(parts)} + 1",
        "  return wrk.format(nil, nil, nil, pre[i] .. n .. post[i])",
        "end",
    ]
    lua = tmp / f"{name}.lua"
    lua.write_text("\n".join(lines) + "\n")
    return lua


# ----------------------------------------------------------------------------- processes

NGINX_PROXY = """daemon off;
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 8192; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
    keepalive_requests 100000000;
    keepalive_timeout 300s;
    tcp_nodelay on;
    upstream workers {{
{servers}
        keepalive 1024;
        keepalive_requests 100000000;
    }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        client_body_buffer_size 128k;
        location / {{
            proxy_pass http://workers;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


def nginx_proxy(tmp: Path, name: str, port: int, upstreams: list[int], nginx: str) -> list[str]:
    prefix = tmp / name
    prefix.mkdir(exist_ok=True)
    servers = "\n".join(f"        server 127.0.0.1:{p};" for p in upstreams)
    conf = prefix / "nginx.conf"
    conf.write_text(NGINX_PROXY.format(prefix=prefix, servers=servers, port=port))
    return [nginx, "-c", str(conf), "-p", str(prefix), "-e", str(prefix / "error.log")]


def routers(
    mode: str,
    be: ov.Backends,
    pythons: dict[str, str | None],
    tmp: Path,
    tag: str,
    nginx: str,
    base_checkout: Path | None = None,
) -> list[ov.Router]:
    """direct, lean, fastroute, [fastroute-base], bare, [nginx], [smg] for one mode and one
    backend set."""
    base = {r.name: r for r in ov.router_commands(mode, be, pythons, base_checkout)}
    out = [base["direct"]]
    p = ov.free_port()
    if mode == "regular":
        lean = [sys.executable, str(LEAN), str(p), *(f"http://127.0.0.1:{q}" for q in be.regular)]
    else:
        lean = [
            sys.executable,
            str(HERE / "lean_pd_relay.py"),
            str(p),
            f"http://127.0.0.1:{be.prefill}",
            str(be.bootstrap),
            f"http://127.0.0.1:{be.decode}",
        ]
    out.append(ov.Router("lean", p, lean))
    out.append(base["fastroute"])
    if "fastroute-base" in base:
        out.append(base["fastroute-base"])
    out.append(base["bare"])
    if mode == "regular":
        p = ov.free_port()
        out.append(ov.Router("nginx", p, nginx_proxy(tmp, f"proxy-{tag}", p, be.regular, nginx)))
    if "smg" in base:
        out.append(base["smg"])
    return out


# ----------------------------------------------------------------------------- measurement


C1_BLOCK = 25  # requests in a row to one router before the next takes its turn


def c1_interleaved(ports: dict[str, int], raws: list[bytes], n: int) -> dict[str, float]:
    """p50 (s) of n sequential requests per router, each on one keep-alive connection, cycling
    raws. The routers take turns in blocks of C1_BLOCK requests (the order rotating every
    cycle), so a drift of the machine's speed during the measurement reaches every router
    alike instead of whichever one was measured at the time."""
    conns = {name: ov.HttpConn(port) for name, port in ports.items()}
    times: dict[str, list[float]] = {name: [] for name in ports}
    names = list(ports)
    try:
        for cycle, start in enumerate(range(0, n, C1_BLOCK)):
            k = cycle % len(names)
            for name in names[k:] + names[:k]:
                conn = conns[name]
                for i in range(start, min(n, start + C1_BLOCK)):
                    t0 = time.perf_counter()
                    status, _ = conn.request(raws[i % len(raws)])
                    times[name].append(time.perf_counter() - t0)
                    if status != 200:
                        raise ValueError(f"{name}: status {status}")
    finally:
        for conn in conns.values():
            conn.close()
    return {name: statistics.median(ts) for name, ts in times.items()}


def raws_of(path: str, parts: list[tuple[str, str]]) -> list[bytes]:
    return [ov.raw_request("POST", path, a + str(i) + b) for i, (a, b) in enumerate(parts)]


def run_phase(
    s: ov.Settings,
    mode: str,
    be: ov.Backends,
    pythons: dict[str, str | None],
    procs: ov.Procs,
    tmp: Path,
    tag: str,
    nginx: str,
    loads: list[tuple[str, Path]],
    lat: list[bytes] | None,
    sink: dict[str, Any],
    commands: list[str],
    notes: list[str],
) -> None:
    rs = routers(mode, be, pythons, tmp, tag, nginx, s.base)
    live = []
    for r in rs:
        if r.argv is not None:
            r.proc = procs.start(f"{tag}-{r.name}", r.argv, r.env, cwd=r.cwd)
            commands.append(f"[{tag}] {r.name}: " + shlex.join(r.argv))
    for r in rs:
        err = ov.wait_ready(r.port, r.proc)
        if err is not None:
            notes.append(f"{tag}/{r.name} NOT MEASURED: {err}")
            print(f"  {tag}/{r.name}: {err}\n{procs.log_tail(f'{tag}-{r.name}')}", flush=True)
            procs.stop(f"{tag}-{r.name}")
            continue
        if r.name != "direct" or lat is not None:
            for _, lua in loads[:1]:
                ov.run_wrk(s, r.port, lua, 64, 1)  # warm-up
        live.append(r)
    for rnd in range(s.rounds):
        rest = [r for r in live if r.name != "direct"]
        k = rnd % max(1, len(rest))
        order = [r for r in live if r.name == "direct"] + rest[k:] + rest[:k]
        print(f"  [{tag}] round {rnd + 1}/{s.rounds}: " + ", ".join(r.name for r in order), flush=True)
        if lat is not None:
            ports = {r.name: r.port for r in order}
            c1_interleaved(ports, lat, 4 * C1_BLOCK)  # warm-up
            p50s = c1_interleaved(ports, lat, s.lat_json)
            for name, p50 in p50s.items():
                cell = sink.setdefault(name, {})
                cell.setdefault("c1_p50", []).append(p50 * 1e6)
                if "direct" in p50s and name != "direct":
                    cell.setdefault("c1_add_p50", []).append((p50 - p50s["direct"]) * 1e6)
        for r in order:
            cell = sink.setdefault(r.name, {})
            if r.name == "direct":
                continue
            for name, lua in loads:
                pid = r.proc.pid if r.proc is not None else None
                t0 = ov.tree_cpu_ticks(pid) if pid else 0
                res = ov.run_wrk(s, r.port, lua, 256, s.duration)
                t1 = ov.tree_cpu_ticks(pid) if pid else 0
                errs = res["non2xx"] + res["socket_errors"]
                cpu = (t1 - t0) / ov.CLK_TCK / res["requests"] * 1e6 if res.get("requests") else None
                cell.setdefault(f"{name}_rps", []).append(res["rps"])
                cell.setdefault(f"{name}_cpu", []).append(cpu)
                cell.setdefault("errors", []).append(errs)
                print(
                    f"    {r.name:10s} {name:14s} {res['rps']:9.0f} req/s errors={errs}"
                    + (f" cpu={cpu:.0f}us/req" if cpu is not None else ""),
                    flush=True,
                )
    for r in rs:
        if r.proc is not None:
            procs.stop(f"{tag}-{r.name}")


def table(mode: str, sink: dict[str, Any], rows: list[str]) -> str:
    cols = [c for c in ("direct", "lean", "fastroute", "fastroute-base", "bare", "nginx", "smg") if c in sink]
    peers = [c for c in ("lean", "fastroute-base", "nginx", "smg", "bare") if c in sink]
    head = ["metric", *cols, *(f"fastroute/{p}" for p in peers)]
    out = [f"### mode: {mode}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def med(router: str, key: str) -> float | None:
        vals = [v for v in sink.get(router, {}).get(key, []) if v is not None]
        return statistics.median(vals) if vals else None

    labels = {"c1_p50": "c=1 p50, 2 KB chat JSON (us)", "c1_add_p50": "c=1 **added** p50, 2 KB chat JSON (us)"}
    keys = ["c1_p50", "c1_add_p50"] + [f"{r}_rps" for r in rows] + [f"{r}_cpu" for r in rows]
    for key in keys:
        if key.endswith("_rps"):
            label = f"{key[:-4]} c=256 req/s"
        elif key.endswith("_cpu"):
            label = f"{key[:-4]} router CPU/req (us)"
        else:
            label = labels[key]
        vals = {c: med(c, key) for c in cols}
        if all(v is None for v in vals.values()):
            continue
        cells = [label] + ["-" if vals[c] is None else f"{vals[c]:,.1f}" for c in cols]
        for p in peers:
            a, b = vals.get("fastroute"), vals.get(p)
            if key == "c1_add_p50":
                cells.append("" if a is None or b is None else f"{a - b:+.0f} us")
            else:
                cells.append("" if not a or not b or a <= 0 or b <= 0 else f"{a / b:.2f}x")
        out.append("| " + " | ".join(cells) + " |")
    errs = {c: sum(sink[c].get("errors", [])) for c in cols}
    out.append("| errors (all runs) | " + " | ".join(str(errs[c]) for c in cols) + " |" + " |" * len(peers))
    return "\n".join(out) + "\n"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="fastroute against the lean relay floor")
    ap.add_argument("--floor", action="store_true", help="(accepted: overhead.py passes it on)")
    ap.add_argument("--duration", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--modes", nargs="+", choices=("regular", "pd"), default=["regular", "pd"])
    ap.add_argument("--latency-requests", type=int, default=2000)
    ap.add_argument("--smg-python", default=None)
    ap.add_argument(
        "--base-checkout",
        default=None,
        metavar="DIR",
        help="also run fastroute from DIR (built in place) as fastroute-base",
    )
    ap.add_argument("--skip-peers", action="store_true")
    ap.add_argument("--skip-sse", action="store_true", help="skip the paced SSE phase (quicker JSON-only runs)")
    ap.add_argument(
        "--sizes", nargs="+", type=int, default=list(SIZES), help="body sizes in bytes (default 100 2048 49152)"
    )
    ap.add_argument("--out", default=str(HERE / "out" / "floor.md"))
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    cmdline = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv)
    nginx, wrk = shutil.which("nginx") or "/usr/sbin/nginx", shutil.which("wrk") or "wrk"
    s = ov.Settings(
        duration=args.duration,
        rounds=args.rounds,
        modes=args.modes,
        lat_json=args.latency_requests,
        lat_sse=0,
        wrk=wrk,
        base=Path(args.base_checkout).resolve() if args.base_checkout else None,
    )
    pythons: dict[str, str | None] = {}
    if not args.skip_peers:
        pythons["smg"], info = ov.detect_peer("smg", args.smg_python)
        print(info, flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="fastroute-floor-"))
    procs = ov.Procs(tmp)
    commands: list[str] = []
    notes: list[str] = []
    results: dict[str, tuple[dict[str, Any], list[str]]] = {}

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, on_term)
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        be = ov.Backends(
            regular=[ov.free_port(), ov.free_port()],
            prefill=ov.free_port(),
            decode=ov.free_port(),
            bootstrap=ov.free_port(),
        )
        conf = ov.write_nginx(tmp, be)
        procs.start("nginx", [nginx, "-c", str(conf), "-p", str(tmp), "-e", str(tmp / "error.log")])
        commands.append("backends: " + shlex.join([nginx, "-c", str(conf), "-p", str(tmp)]))
        paced = ov.Backends(
            regular=[ov.free_port(), ov.free_port()],
            prefill=ov.free_port(),
            decode=ov.free_port(),
            bootstrap=be.bootstrap,
        )
        script = str(HERE / "paced_sse.py")
        for i, port in enumerate(paced.regular):
            procs.start(f"paced-{i}", [sys.executable, script, str(port)])
        procs.start(
            "paced-prefill",
            [sys.executable, script, str(paced.prefill), "--role", "prefill", "--bootstrap-port", str(be.bootstrap)],
        )
        procs.start(
            "paced-decode",
            [sys.executable, script, str(paced.decode), "--role", "decode", "--dp-size", str(ov.DECODE_DP)],
        )
        commands.append(
            f"paced backends: {sys.executable} {script} PORT [--role prefill|decode] (10 events, 20-50 ms apart)"
        )
        for port in (*be.regular, be.prefill, be.decode, *paced.regular, paced.prefill, paced.decode):
            err = ov.wait_ready(port, None, timeout=20)
            if err:
                raise RuntimeError(f"backend {port} not serving: {err}")
        json_loads: list[tuple[str, Path]] = []
        for kind, path, make in (("chat", ov.SSE_PATH, chat_obj), ("gen", ov.JSON_PATH, generate_obj)):
            for size in args.sizes:
                label = f"{kind}-{size / 1024:g}KB" if size >= 1024 else f"{kind}-{size}B"
                json_loads.append((label, write_lua(tmp, label, path, variants(make, size, False, size))))
        chat2 = variants(chat_obj, 2048, False, 7)
        lat = raws_of(ov.SSE_PATH, chat2)
        sse = [("sse-paced-2KB", write_lua(tmp, "sse", ov.SSE_PATH, variants(chat_obj, 2048, True, 9)))]
        for mode in args.modes:
            sink: dict[str, Any] = {}
            print(f"mode {mode}: JSON against nginx workers", flush=True)
            run_phase(s, mode, be, pythons, procs, tmp, f"{mode}-json", nginx, json_loads, lat, sink, commands, notes)
            if not args.skip_sse:
                print(f"mode {mode}: paced SSE", flush=True)
                run_phase(s, mode, paced, pythons, procs, tmp, f"{mode}-sse", nginx, sse, None, sink, commands, notes)
            results[mode] = (sink, [n for n, _ in json_loads] + ([] if args.skip_sse else [n for n, _ in sse]))
    except KeyboardInterrupt:
        print("interrupted: stopping every process started by this run", file=sys.stderr)
        return 130
    finally:
        procs.stop_all()
        signal.signal(signal.SIGTERM, old)
        signal.signal(signal.SIGINT, old_int)
    parts = [
        "# fastroute against the lean relay floor",
        "",
        f"Command: `{cmdline}`",
        "",
        f"wrk -t1 -c256, {s.duration} s per run, {s.rounds} alternated rounds (medians); "
        f"c=1: {s.lat_json} sequential requests, 64 distinct bodies. "
        f"Bodies distinct per request (counter spliced into the prompt). Machine: "
        f"{ov.os.cpu_count()} CPUs, Python {sys.version.split()[0]}.",
        "",
    ]
    for mode, (sink, rows) in results.items():
        parts.append(table(mode, sink, rows))
    parts += ["Command lines:", "", "```", *commands, "```", ""]
    if notes:
        parts += ["Notes:", "", *(f"- {n}" for n in notes), ""]
    report = "\n".join(parts)
    print(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    print(f"written to {out}; logs in {tmp}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
