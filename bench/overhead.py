"""Router overhead benchmark: latency added and throughput vs direct, a bare relay and the peers.

Owns one end-to-end run: writes an nginx config (fake SGLang workers with fixed answers) to a
temp dir and runs nginx in the foreground, starts every router as a subprocess against it
(direct = no router, ``bench/bare_relay.py``, fastroute, sglang-router, smg), then measures in
alternating rounds so that ratios taken within one run are meaningful on a noisy machine:

* added latency at concurrency 1 (p50/p99 minus direct) for a small JSON POST /generate and a
  small 16-event SSE stream, with a keep-alive TCP_NODELAY Python client;
* throughput with ``wrk -t1`` at 64 and 256 keep-alive connections, JSON and SSE, plus the CPU
  time the router process tree used (from /proc/PID/stat).

Output: a markdown table with medians over rounds and ratios, printed and written to
bench/out/overhead.md. Every process started here is stopped on exit, Ctrl-C or error.
Usage: ``python bench/overhead.py [--quick] [--duration S] [--rounds N] [--modes regular pd]``.
``--floor`` runs bench/floor.py instead: fastroute against the lean relay floor
(/work/shared/bench/lean_relay.py, bench/lean_pd_relay.py) and nginx on 0.1/2/48 KB chat and
/generate bodies and paced SSE streams.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
ROUTERS = ("direct", "bare", "fastroute", "fastroute-base", "fastroute-tls", "sglang-router", "smg")
# fastroute-base: the same fastroute command run from another checkout (--base-checkout), so a
# change can be measured against the commit before it in one run with alternated rounds.
# fastroute-tls: the same command serving HTTPS (--tls: a self-signed certificate made for the run).
# Router ports that speak HTTPS (the clients wrap their sockets; wrk gets an https:// URL).
TLS_PORTS: set[int] = set()
_CLIENT_TLS = ssl.create_default_context()
_CLIENT_TLS.check_hostname = False
_CLIENT_TLS.verify_mode = ssl.CERT_NONE  # the run's own self-signed certificate
PEER_VENVS = {"sglang-router": "/tmp/venv-sgr/bin/python", "smg": "/tmp/venv-smg/bin/python"}
PEER_MODULES = {"sglang-router": "sglang_router", "smg": "smg"}
MODEL = "bench-model"
DECODE_DP = 8
READY_TIMEOUT = 90.0

# Client request bodies (what wrk and the latency client send).
JSON_BODY = json.dumps(
    {"text": "hello world, benchmark prompt", "sampling_params": {"max_new_tokens": 8, "temperature": 0}},
    separators=(",", ":"),
)
SSE_BODY = json.dumps(
    {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 16, "stream": True},
    separators=(",", ":"),
)
JSON_PATH, SSE_PATH = "/generate", "/v1/chat/completions"


# ----------------------------------------------------------------------------- pure helpers

_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str) -> float:
    """wrk time string ('812.00us', '1.20ms', '2.00s', '1.00m') -> seconds."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*(us|ms|s|m|h)\s*", text)
    if not m:
        raise ValueError(f"not a wrk duration: {text!r}")
    return float(m.group(1)) * _TIME_UNITS[m.group(2)]


def parse_wrk(text: str) -> dict[str, Any]:
    """Parse wrk's text report (run with --latency) into numbers.

    Keys: requests, seconds, rps, non2xx, socket_errors, and p50/p75/p90/p99 in seconds when the
    latency distribution is present. Raises ValueError when the report has no Requests/sec line
    (wrk failed to run).
    """
    out: dict[str, Any] = {"non2xx": 0, "socket_errors": 0}
    m = re.search(r"^Requests/sec:\s*([0-9.]+)", text, re.M)
    if not m:
        raise ValueError("wrk report without Requests/sec")
    out["rps"] = float(m.group(1))
    m = re.search(r"^\s*(\d+) requests in ([0-9.]+\w+)", text, re.M)
    if m:
        out["requests"] = int(m.group(1))
        out["seconds"] = parse_duration(m.group(2))
    m = re.search(r"Non-2xx or 3xx responses:\s*(\d+)", text)
    if m:
        out["non2xx"] = int(m.group(1))
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    if m:
        out["socket_errors"] = sum(int(g) for g in m.groups())
    for pct, val in re.findall(r"^\s*(50|75|90|99)%\s+([0-9.]+\w+)\s*$", text, re.M):
        out[f"p{pct}"] = parse_duration(val)
    return out


def parse_proc_stat(text: str) -> tuple[int, int]:
    """/proc/PID/stat line -> (ppid, utime+stime+cutime+cstime in clock ticks).

    The command name (field 2) may contain spaces and parentheses, so split after the last ')'.
    cutime/cstime cover reaped children, so CPU of short-lived helpers is not lost.
    """
    rest = text[text.rindex(")") + 2 :].split()
    # rest[0] is field 3 (state); ppid is field 4, utime..cstime are fields 14..17.
    return int(rest[1]), sum(int(x) for x in rest[11:15])


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile of an already sorted sequence (q in 0..100)."""
    if not sorted_values:
        raise ValueError("no values")
    # Rank ceil(q% of n), 1-based; clamped so q=0 gives the minimum.
    k = max(0, min(len(sorted_values) - 1, math.ceil(q / 100.0 * len(sorted_values)) - 1))
    return sorted_values[k]


def median(values: Iterable[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def nginx_quote(text: str) -> str:
    """Make text safe inside a single-quoted nginx string (``$`` would start a variable)."""
    if "$" in text:
        raise ValueError("nginx fixed bodies must not contain '$'")
    return text.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")


# Metric rows of the table: (key, label, kind). kind "lat" = lower is better (us), "thr" =
# higher is better (req/s), "cpu" = router CPU microseconds per request (lower is better).
ROWS = (
    ("json_c1_p50", "JSON c=1 p50 latency (us)", "lat"),
    ("json_c1_add_p50", "JSON c=1 **added** p50 (us)", "lat"),
    ("json_c1_add_p99", "JSON c=1 **added** p99 (us)", "lat"),
    ("sse_c1_p50", "SSE c=1 p50 stream time (us)", "lat"),
    ("sse_c1_add_p50", "SSE c=1 **added** p50 (us)", "lat"),
    ("sse_c1_add_p99", "SSE c=1 **added** p99 (us)", "lat"),
    ("json_c64_rps", "JSON c=64 req/s", "thr"),
    ("json_c256_rps", "JSON c=256 req/s", "thr"),
    ("sse_c64_rps", "SSE c=64 req/s", "thr"),
    ("sse_c256_rps", "SSE c=256 req/s", "thr"),
    ("json_c256_p99", "JSON c=256 p99 latency (us)", "lat"),
    ("json_c256_cpu", "router CPU per req, JSON c=256 (us)", "cpu"),
    ("sse_c256_cpu", "router CPU per req, SSE c=256 (us)", "cpu"),
    ("errors", "errors (non-2xx + socket), all runs", "err"),
)
RATIOS = (
    ("smg", "fastroute/smg"),
    ("sglang-router", "fastroute/sglang-router"),
    ("bare", "fastroute/bare"),
    ("fastroute-base", "fastroute/base"),
    ("fastroute-tls", "fastroute/tls"),
)


def _fmt(v: float | None, kind: str) -> str:
    if v is None:
        return "-"
    if kind == "err":
        return str(int(v))
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.1f}"


def summarize(raw: dict[str, dict[str, list[float | None]]]) -> dict[str, dict[str, float | None]]:
    """Per router, per metric: median over rounds (errors are summed, not medianed)."""
    out: dict[str, dict[str, float | None]] = {}
    for router, metrics in raw.items():
        out[router] = {}
        for key, vals in metrics.items():
            if key == "errors":
                present = [v for v in vals if v is not None]
                out[router][key] = float(sum(present)) if present else None
            else:
                out[router][key] = median(vals)
    return out


def build_table(mode: str, med: dict[str, dict[str, float | None]], routers: Sequence[str]) -> str:
    """Markdown table for one mode: absolute medians per router, then fastroute ratios.

    Ratios are fastroute / peer of the same row: above 1 is better for req/s, below 1 is better
    for latency and CPU rows. A ratio is left empty when either side is missing or not positive
    (an added latency at or below zero has no meaningful ratio).
    """
    cols = [r for r in routers if r in med]
    # The base-checkout column exists only in runs that measured one.
    ratios = [(peer, label) for peer, label in RATIOS if peer not in ("fastroute-base", "fastroute-tls") or peer in med]
    head = ["metric", *cols, *(label for peer, label in ratios)]
    lines = [f"### mode: {mode}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    fr = med.get("fastroute", {})
    for key, label, kind in ROWS:
        cells = [label]
        for r in cols:
            v = med[r].get(key)
            if r == "direct" and ("_add_" in key or key.endswith("_cpu")):
                v = None
            cells.append(_fmt(v, kind))
        for peer, _ in ratios:
            a, b = fr.get(key), med.get(peer, {}).get(key)
            if kind == "err" or a is None or b is None or a <= 0 or b <= 0:
                cells.append("")
            else:
                cells.append(f"{a / b:.2f}x")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def check_bars(mode: str, med: dict[str, dict[str, float | None]]) -> list[str]:
    """The issue's orientation bars, as PASS/FAIL/n.a. lines."""
    fr, smg, bare = med.get("fastroute", {}), med.get("smg", {}), med.get("bare", {})

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b is not None and b > 0 else None

    out = []
    for key in ("json_c256_rps", "sse_c256_rps"):
        for peer, want, data in (("smg", 2.0, smg), ("bare", 0.6, bare)):
            r = ratio(fr.get(key), data.get(key))
            verdict = "n.a." if r is None else ("PASS" if r >= want else "FAIL")
            shown = "-" if r is None else f"{r:.2f}x"
            out.append(f"- {mode} {key}: fastroute/{peer} = {shown} (bar >= {want}x): {verdict}")
    for key in ("json_c1_add_p50", "sse_c1_add_p50"):
        a, b = fr.get(key), smg.get(key)
        if a is None or b is None:
            out.append(f"- {mode} {key}: n.a.")
        else:
            verdict = "PASS" if a <= 0.5 * b else "FAIL"
            out.append(f"- {mode} {key}: fastroute {a:.0f} us vs smg {b:.0f} us (bar <= half of smg): {verdict}")
    return out


# ----------------------------------------------------------------------------- processes


def free_port() -> int:
    """An ephemeral loopback port that was free a moment ago (small race accepted)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Procs:
    """Processes started by this run. Each gets its own session so stop() can end its whole
    group (router helpers included) by the id we got at start, and nothing else."""

    def __init__(self, logdir: Path) -> None:
        self.logdir = logdir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(
        self, name: str, argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> subprocess.Popen[bytes]:
        # The child keeps its own copy of the log's descriptor; this process closes its copy.
        with open(self.logdir / f"{name}.log", "wb") as log:
            p = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=cwd,
                start_new_session=True,
            )
        self.procs[name] = p
        return p

    def log_tail(self, name: str, lines: int = 25) -> str:
        try:
            text = (self.logdir / f"{name}.log").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, name: str) -> None:
        p = self.procs.pop(name, None)
        if p is None:
            return
        if p.poll() is None:
            for sig, wait in ((signal.SIGTERM, 8.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    p.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        # Members of the group that outlived the leader (session id == pid we started).
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def stop_all(self) -> None:
        for name in list(self.procs)[::-1]:
            self.stop(name)


def tree_cpu_ticks(pid: int) -> int:
    """CPU ticks used so far by ``pid`` and all its live descendants."""
    stats: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stats[int(entry)] = parse_proc_stat(f.read())
            except (OSError, ValueError):
                continue
    total, frontier = 0, [pid]
    while frontier:
        cur = frontier.pop()
        if cur in stats:
            total += stats[cur][1]
        frontier.extend(p for p, (ppid, _) in stats.items() if ppid == cur)
    return total


CLK_TCK = os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------- latency client


class HttpConn:
    """Minimal blocking HTTP/1.1 keep-alive client with TCP_NODELAY: one request at a time,
    Content-Length and chunked bodies. Same code for every router, so its cost cancels out in
    "added" latency."""

    def __init__(self, port: int, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if port in TLS_PORTS:
            self.sock = _CLIENT_TLS.wrap_socket(self.sock, server_hostname="127.0.0.1")
        self.buf = b""

    def close(self) -> None:
        self.sock.close()

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("connection closed by peer")
        self.buf += data

    def _line(self) -> bytes:
        while b"\r\n" not in self.buf:
            self._fill()
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def _take(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        out, self.buf = self.buf[:n], self.buf[n:]
        return out

    def request(self, raw: bytes) -> tuple[int, bytes]:
        self.sock.sendall(raw)
        while b"\r\n\r\n" not in self.buf:
            self._fill()
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        hdrs = {}
        for ln in lines[1:]:
            k, _, v = ln.partition(b":")
            hdrs[k.strip().lower()] = v.strip()
        if hdrs.get(b"transfer-encoding", b"").lower() == b"chunked":
            parts = []
            while True:
                size = int(self._line().split(b";")[0], 16)
                if size == 0:
                    while self._line():  # trailers end with an empty line
                        pass
                    break
                parts.append(self._take(size))
                self._take(2)
            return status, b"".join(parts)
        if b"content-length" in hdrs:
            return status, self._take(int(hdrs[b"content-length"]))
        raise ConnectionError("response without length framing (close-delimited)")


def raw_request(method: str, path: str, body: str = "") -> bytes:
    b = body.encode()
    return (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(b)}\r\n\r\n"
    ).encode() + b


def measure_c1(port: int, raw: bytes, n: int, budget: float = 1e9) -> tuple[float, float, int]:
    """Up to n sequential requests on one keep-alive connection, stopping early after ``budget``
    seconds (a router adding 44 ms per stream would otherwise take minutes)
    -> (p50 s, p99 s, failures)."""
    conn = HttpConn(port)
    times: list[float] = []
    fails = 0
    stop = time.monotonic() + budget
    try:
        for _ in range(n):
            if time.monotonic() > stop:
                break
            t0 = time.perf_counter()
            status, _ = conn.request(raw)
            times.append(time.perf_counter() - t0)
            fails += status != 200
    finally:
        conn.close()
    times.sort()
    return percentile(times, 50), percentile(times, 99), fails


def wait_ready(port: int, proc: subprocess.Popen[bytes] | None, timeout: float = READY_TIMEOUT) -> str | None:
    """Poll a JSON and an SSE test POST until both answer 200. Returns None or an error text."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            return f"process exited with code {proc.returncode}"
        try:
            conn = HttpConn(port, timeout=5.0)
            try:
                s1, b1 = conn.request(raw_request("POST", JSON_PATH, JSON_BODY))
                s2, b2 = conn.request(raw_request("POST", SSE_PATH, SSE_BODY))
            finally:
                conn.close()
            if s1 == 200 and s2 == 200 and b"[DONE]" in b2:
                return None
            last = f"JSON {s1} {b1[:200]!r} / SSE {s2} {b2[:200]!r}"
        except (OSError, ValueError, IndexError) as e:
            last = repr(e)
        time.sleep(0.3)
    return f"not ready after {timeout:.0f}s: {last}"


# ----------------------------------------------------------------------------- backends


def worker_bodies(role: str, dp_size: int, bootstrap_port: int | None) -> dict[str, str]:
    """Fixed answers of one fake SGLang worker, in SGLang's JSON shapes."""

    def dump(obj: Any) -> str:
        return json.dumps(obj, separators=(",", ":"))

    server_info = {
        "model_path": f"/models/{MODEL}",
        "served_model_name": MODEL,
        "tokenizer_path": f"/models/{MODEL}",
        "tp_size": 1,
        "dp_size": dp_size,
        "load_balance_method": "follow_bootstrap_room" if role == "prefill" else "round_robin",
        "disaggregation_mode": role if role != "regular" else "null",
        "disaggregation_bootstrap_port": bootstrap_port,
        "enable_dp_attention": dp_size > 1,
        "max_running_requests": 256,
        "max_total_num_tokens": 100000,
        "version": "0.5.0",
        "internal_states": [{"dp_rank": r} for r in range(dp_size)],
    }
    model_info = {
        "model_path": f"/models/{MODEL}",
        "tokenizer_path": f"/models/{MODEL}",
        "is_generation": True,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
    }
    models = {
        "object": "list",
        "data": [
            {"id": MODEL, "object": "model", "created": 0, "owned_by": "sglang", "root": MODEL, "max_model_len": 4096}
        ],
    }
    ranks = [
        {
            "dp_rank": r,
            "timestamp": 1795958836.2,
            "num_running_reqs": 1,
            "num_waiting_reqs": 0,
            "num_total_reqs": 1,
            "num_used_tokens": 100,
            "max_total_num_tokens": 100000,
            "token_usage": 0.001,
            "gen_throughput": 10.0,
            "cache_hit_rate": 0.0,
            "utilization": 0.0,
            "max_running_requests": 256,
        }
        for r in range(dp_size)
    ]
    loads = {
        "timestamp": "2026-11-29T13:27:16+00:00",
        "version": "0.5.0",
        "dp_rank_count": dp_size,
        "loads": ranks,
        "aggregate": {
            "total_running_reqs": dp_size,
            "total_waiting_reqs": 0,
            "total_reqs": dp_size,
            "total_used_tokens": 100 * dp_size,
            "avg_token_usage": 0.001,
            "avg_throughput": 10.0,
            "avg_utilization": 0.0,
        },
    }
    get_load = [{"dp_rank": r, "num_reqs": 1, "num_waiting_reqs": 0, "num_tokens": 100} for r in range(dp_size)]
    generate = {
        "text": " the quick brown fox jumps over it",
        "output_ids": [1, 2, 3, 4, 5, 6, 7, 8],
        "meta_info": {
            "id": "0123456789abcdef",
            "finish_reason": {"type": "length", "length": 8},
            "prompt_tokens": 7,
            "completion_tokens": 8,
            "cached_tokens": 0,
            "e2e_latency": 0.01,
        },
    }
    events = []
    for i in range(16):
        chunk = {
            "id": "chatcmpl-bench",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": MODEL,
            "choices": [{"index": 0, "delta": {"content": f" tok{i}"}, "finish_reason": "length" if i == 15 else None}],
        }
        events.append(f"data: {dump(chunk)}\n\n")
    events.append("data: [DONE]\n\n")
    return {
        "SERVER_INFO": dump(server_info),
        "MODEL_INFO": dump(model_info),
        "MODELS": dump(models),
        "LOADS": dump(loads),
        "GET_LOAD": dump(get_load),
        "GENERATE": dump(generate),
        "SSE": "".join(events),
    }


def fill(template: str, values: dict[str, str]) -> str:
    for k, v in values.items():
        template = template.replace(f"@{k}@", v)
    if re.search(r"@[A-Z_]+@", template):
        raise ValueError(f"unfilled placeholder in nginx template: {re.search(r'@[A-Z_]+@', template)}")
    return template


@dataclass
class Backends:
    regular: list[int]
    prefill: int
    decode: int
    bootstrap: int

    @classmethod
    def fresh(cls) -> Backends:
        """Two regular workers, a prefill, a decode and a bootstrap port, each a free port."""
        return cls([free_port(), free_port()], free_port(), free_port(), free_port())


def write_nginx(tmp: Path, be: Backends) -> Path:
    """Render bench/nginx/*.in into tmp/nginx.conf: two regular workers, a prefill, a decode with
    dp_size 8, and a listener on the prefill's bootstrap port."""
    worker_t = (HERE / "nginx" / "worker.conf.in").read_text()
    blocks = []
    for port, role, dp, bport in [
        *[(p, "regular", 1, None) for p in be.regular],
        (be.prefill, "prefill", 1, be.bootstrap),
        (be.decode, "decode", DECODE_DP, None),
    ]:
        bodies = {k: nginx_quote(v) for k, v in worker_bodies(role, dp, bport).items()}
        blocks.append(fill(worker_t, {"PORT": str(port), "ROLE": role, "DP_SIZE": str(dp), **bodies}))
    blocks.append(fill((HERE / "nginx" / "bootstrap.conf.in").read_text(), {"PORT": str(be.bootstrap)}))
    conf = fill((HERE / "nginx" / "nginx.conf.in").read_text(), {"PREFIX": str(tmp), "SERVERS": "\n".join(blocks)})
    path = tmp / "nginx.conf"
    path.write_text(conf)
    return path


def write_lua(tmp: Path, name: str, path: str, body: str) -> Path:
    lua = tmp / f"{name}.lua"
    lua.write_text(
        f'wrk.method = "POST"\nwrk.path = "{path}"\n'
        f'wrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = [[{body}]]\n"
    )
    return lua


# ----------------------------------------------------------------------------- routers


@dataclass
class Router:
    name: str
    port: int
    argv: list[str] | None  # None: direct (no process)
    env: dict[str, str] | None = None
    proc: subprocess.Popen[bytes] | None = None
    note: str = ""
    cwd: Path = REPO  # `python -m fastroute` imports the package of its working directory


def router_commands(
    mode: str,
    be: Backends,
    pythons: dict[str, str | None],
    base: Path | None = None,
    tls: tuple[Path, Path] | None = None,
) -> list[Router]:
    """Command lines of every router for one mode; peers absent from ``pythons`` are skipped."""
    reg = [f"http://127.0.0.1:{p}" for p in be.regular]
    pre, dec = f"http://127.0.0.1:{be.prefill}", f"http://127.0.0.1:{be.decode}"
    out: list[Router] = []
    direct_port = be.regular[0] if mode == "regular" else be.decode
    out.append(Router("direct", direct_port, None, note="no router: client -> nginx (PD: decode worker only, one leg)"))
    p = free_port()
    bare = [sys.executable, str(HERE / "bare_relay.py"), "--port", str(p)]
    bare += ["--upstream", *reg] if mode == "regular" else ["--upstream", dec, "--prefill", pre]
    out.append(Router("bare", p, bare))
    common = ["--host", "127.0.0.1", "--worker-startup-check-interval", "1"]
    p, q = free_port(), free_port()
    fr = [
        sys.executable,
        "-m",
        "fastroute",
        "--port",
        str(p),
        "--prometheus-port",
        str(q),
        *common,
        "--log-level",
        "warning",
    ]
    if mode == "regular":
        fr += ["--worker-urls", *reg, "--policy", "power_of_two", "--p2c-load-metric", "requests"]
    else:
        fr += [
            "--pd-disaggregation",
            "--prefill",
            pre,
            str(be.bootstrap),
            "--decode",
            dec,
            "--policy",
            "power_of_two",
            "--p2c-load-metric",
            "least_requests",
            "--dp-aware",
        ]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out.append(Router("fastroute", p, fr, env))
    if base is not None:
        p2, q2 = free_port(), free_port()
        fr2 = [*fr[:4], str(p2), fr[5], str(q2), *fr[7:]]
        out.append(
            Router(
                "fastroute-base",
                p2,
                fr2,
                dict(os.environ, PYTHONPATH=str(base)),
                note=f"the same command from {base}",
                cwd=base,
            )
        )
    if tls is not None:
        p3, q3 = free_port(), free_port()
        fr3 = [*fr[:4], str(p3), fr[5], str(q3), *fr[7:], "--tls-cert-path", str(tls[0]), "--tls-key-path", str(tls[1])]
        TLS_PORTS.add(p3)
        out.append(Router("fastroute-tls", p3, fr3, env, note="the same command serving HTTPS"))
    for name in ("sglang-router", "smg"):
        py = pythons.get(name)
        if not py:
            continue
        p, q = free_port(), free_port()
        argv = [
            py,
            "-m",
            f"{PEER_MODULES[name]}.launch_router",
            "--port",
            str(p),
            "--prometheus-port",
            str(q),
            *common,
            "--log-level",
            "warn",
        ]
        penv = dict(os.environ)
        note = ""
        if mode == "regular":
            argv += ["--worker-urls", *reg, "--policy", "power_of_two"]
        else:
            argv += [
                "--pd-disaggregation",
                "--prefill",
                pre,
                str(be.bootstrap),
                "--decode",
                dec,
                "--policy",
                "power_of_two",
            ]
        if name == "smg":
            argv += ["--power-of-two-load-metric", "requests" if mode == "regular" else "least_requests"]
            if mode == "pd":
                argv.append("--dp-aware")
        else:
            # sglang-router 0.3.2 has no load-metric flag; this env var is its documented knob
            # (harmless if ignored). Its PD --dp-aware sends traffic to "http://host:port@rank"
            # parsed as host "rank" (protocol.md 4.2), so PD runs without --dp-aware.
            penv["SGLANG_ROUTER_P2C_LOAD_METRIC"] = "requests"
            if mode == "pd":
                note = "no --dp-aware (broken in sglang-router 0.3.2 PD mode, protocol.md 4.2)"
        out.append(Router(name, p, argv, penv, note=note))
    return out


def detect_peer(name: str, given: str | None) -> tuple[str | None, str]:
    """Python interpreter that can import the peer's module, or None with the reason."""
    candidates = [given] if given else [PEER_VENVS[name], sys.executable]
    for py in candidates:
        if not py or not os.path.exists(py):
            continue
        r = subprocess.run([py, "-c", f"import {PEER_MODULES[name]}.launch_router"], capture_output=True, timeout=60)
        if r.returncode == 0:
            ver = subprocess.run([py, "-m", "pip", "show", name], capture_output=True, text=True, timeout=60).stdout
            m = re.search(r"^Version: (\S+)", ver, re.M)
            return py, f"{name} {m.group(1) if m else '?'} via {py}"
    return None, f"{name} skipped: not importable from {candidates}"


# ----------------------------------------------------------------------------- measurement


@dataclass
class Settings:
    duration: int
    rounds: int
    modes: list[str]
    lat_json: int
    lat_sse: int
    connections: tuple[int, ...] = (64, 256)
    wrk: str = "wrk"
    base: Path | None = None
    tls: tuple[Path, Path] | None = None  # (cert, key) of fastroute-tls


def run_wrk(s: Settings, port: int, lua: Path, conns: int, seconds: int) -> dict[str, Any]:
    scheme = "https" if port in TLS_PORTS else "http"
    argv = [
        s.wrk,
        "-t1",
        f"-c{conns}",
        f"-d{seconds}s",
        "--timeout",
        "10s",
        "--latency",
        "-s",
        str(lua),
        f"{scheme}://127.0.0.1:{port}",
    ]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60)
    return parse_wrk(r.stdout)


def measure_router(
    s: Settings, r: Router, luas: dict[str, Path], direct: dict[str, float], sink: dict[str, list[float | None]]
) -> None:
    """One round of every measurement for one router; appends to ``sink`` per metric key."""
    errors = 0
    for kind, path, body, n in (("json", JSON_PATH, JSON_BODY, s.lat_json), ("sse", SSE_PATH, SSE_BODY, s.lat_sse)):
        raw = raw_request("POST", path, body)
        measure_c1(r.port, raw, max(20, n // 20), budget=1.0)  # warm-up, fresh connection
        p50, p99, fails = measure_c1(r.port, raw, n, budget=max(5.0, s.duration))
        errors += fails
        sink.setdefault(f"{kind}_c1_p50", []).append(p50 * 1e6)
        sink.setdefault(f"{kind}_c1_p99", []).append(p99 * 1e6)
        if r.name == "direct":
            direct[f"{kind}_p50"], direct[f"{kind}_p99"] = p50, p99
        add50 = (p50 - direct[f"{kind}_p50"]) * 1e6 if f"{kind}_p50" in direct else None
        add99 = (p99 - direct[f"{kind}_p99"]) * 1e6 if f"{kind}_p99" in direct else None
        sink.setdefault(f"{kind}_c1_add_p50", []).append(add50)
        sink.setdefault(f"{kind}_c1_add_p99", []).append(add99)
    for kind in ("json", "sse"):
        for c in s.connections:
            pid = r.proc.pid if r.proc is not None else None
            t0 = tree_cpu_ticks(pid) if pid else 0
            res = run_wrk(s, r.port, luas[kind], c, s.duration)
            t1 = tree_cpu_ticks(pid) if pid else 0
            errors += res["non2xx"] + res["socket_errors"]
            sink.setdefault(f"{kind}_c{c}_rps", []).append(res["rps"])
            sink.setdefault(f"{kind}_c{c}_p99", []).append(res.get("p99", 0.0) * 1e6)
            cpu = None
            if pid and res.get("requests"):
                cpu = (t1 - t0) / CLK_TCK / res["requests"] * 1e6
            sink.setdefault(f"{kind}_c{c}_cpu", []).append(cpu)
            print(
                f"    {r.name:14s} {kind:4s} c={c:<3d} {res['rps']:9.0f} req/s"
                f"  errors={res['non2xx'] + res['socket_errors']}"
                + (f"  cpu={cpu:.0f}us/req" if cpu is not None else ""),
                flush=True,
            )
    sink.setdefault("errors", []).append(float(errors))


def run_mode(
    s: Settings,
    mode: str,
    be: Backends,
    pythons: dict[str, str | None],
    procs: Procs,
    luas: dict[str, Path],
    notes: list[str],
    commands: list[str],
) -> dict[str, dict[str, list[float | None]]]:
    routers = router_commands(mode, be, pythons, s.base, s.tls)
    live: list[Router] = []
    for r in routers:
        if r.argv is not None:
            r.proc = procs.start(f"{mode}-{r.name}", r.argv, r.env, cwd=r.cwd)
            commands.append(f"[{mode}] {r.name}: " + shlex.join(r.argv))
        else:
            commands.append(f"[{mode}] direct: client -> http://127.0.0.1:{r.port}")
        if r.note:
            notes.append(f"{mode}/{r.name}: {r.note}")
    for r in routers:
        err = wait_ready(r.port, r.proc)
        if err is not None:
            notes.append(f"{mode}/{r.name} NOT MEASURED: {err}\n```\n{procs.log_tail(f'{mode}-{r.name}')}\n```")
            print(f"  {r.name}: {err}", flush=True)
            procs.stop(f"{mode}-{r.name}")
            continue
        # Warm-up: connection pools, code paths, the router's first load polls.
        run_wrk(s, r.port, luas["json"], 64, 1)
        run_wrk(s, r.port, luas["sse"], 64, 1)
        live.append(r)
    raw: dict[str, dict[str, list[float | None]]] = {r.name: {} for r in live}
    for rnd in range(s.rounds):
        # Rotate the order each round so slow drift of the machine is spread over routers;
        # direct always goes first so the added latency subtracts a same-round baseline.
        rest = [r for r in live if r.name != "direct"]
        k = rnd % max(1, len(rest))
        order = [r for r in live if r.name == "direct"] + rest[k:] + rest[:k]
        print(f"  [{mode}] round {rnd + 1}/{s.rounds}: " + ", ".join(r.name for r in order), flush=True)
        direct: dict[str, float] = {}
        for r in order:
            if r.proc is not None and r.proc.poll() is not None:
                notes.append(
                    f"{mode}/{r.name} died (exit {r.proc.returncode}) in round "
                    f"{rnd + 1}\n```\n{procs.log_tail(f'{mode}-{r.name}')}\n```"
                )
                continue
            try:
                measure_router(s, r, luas, direct, raw[r.name])
            except (OSError, ValueError, subprocess.TimeoutExpired) as e:
                notes.append(
                    f"{mode}/{r.name} round {rnd + 1} failed: {e!r}\n```\n{procs.log_tail(f'{mode}-{r.name}')}\n```"
                )
    for r in routers:
        if r.proc is not None:
            procs.stop(f"{mode}-{r.name}")
    return raw


def make_cert(tmp: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (the clients do not verify it)."""
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="Router overhead benchmark (see module docstring).")
    ap.add_argument("--duration", type=int, default=10, help="seconds per wrk run (default 10)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    ap.add_argument("--modes", nargs="+", choices=("regular", "pd"), default=["regular", "pd"])
    ap.add_argument(
        "--latency-requests", type=int, default=3000, help="sequential JSON requests per c=1 latency run (SSE: half)"
    )
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 s wrk runs, 1 round, 300 latency requests")
    ap.add_argument(
        "--sglang-router-python",
        default=None,
        help=f"python with sglang_router (default: {PEER_VENVS['sglang-router']})",
    )
    ap.add_argument("--smg-python", default=None, help=f"python with smg (default: {PEER_VENVS['smg']})")
    ap.add_argument("--skip-peers", action="store_true", help="measure without the peers")
    ap.add_argument(
        "--tls",
        action="store_true",
        help="also measure fastroute serving HTTPS (self-signed, made with openssl) as fastroute-tls",
    )
    ap.add_argument(
        "--base-checkout",
        default=None,
        metavar="DIR",
        help="also measure fastroute from DIR (a checkout with its extensions built in "
        "place, e.g. a git worktree of the previous commit) as fastroute-base",
    )
    ap.add_argument("--out", default=str(HERE / "out" / "overhead.md"))
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    if "--floor" in (sys.argv[1:] if argv is None else argv):
        # The floor run (bench/floor.py): fastroute against the lean relays on real body sizes.
        import floor

        return floor.main(argv)
    args = parse_args(argv)
    cmdline = shlex.join([sys.executable, *sys.argv]) if argv is None else shlex.join(argv)
    s = Settings(
        duration=args.duration,
        rounds=args.rounds,
        modes=args.modes,
        lat_json=args.latency_requests,
        lat_sse=max(1, args.latency_requests // 2),
        base=Path(args.base_checkout).resolve() if args.base_checkout else None,
    )
    if args.quick:
        s.duration, s.rounds, s.lat_json, s.lat_sse = 2, 1, 300, 150
    nginx, wrk = shutil.which("nginx") or "/usr/sbin/nginx", shutil.which("wrk")
    if not os.path.exists(nginx) or not wrk:
        print("needs nginx and wrk: apt-get update && apt-get install -y nginx wrk", file=sys.stderr)
        return 2
    s.wrk = wrk
    notes: list[str] = []
    pythons: dict[str, str | None] = {}
    versions: list[str] = []
    if not args.skip_peers:
        for name, given in (("sglang-router", args.sglang_router_python), ("smg", args.smg_python)):
            pythons[name], info = detect_peer(name, given)
            (versions if pythons[name] else notes).append(info)
    tmp = Path(tempfile.mkdtemp(prefix="fastroute-overhead-"))
    if args.tls:
        s.tls = make_cert(tmp)
    procs = Procs(tmp)
    commands: list[str] = []
    results: dict[str, dict[str, dict[str, list[float | None]]]] = {}

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    # SIGTERM and SIGINT both unwind through the finally below. SIGINT is installed explicitly
    # because a shell starting us in the background hands it down as "ignored".
    old = signal.signal(signal.SIGTERM, on_term)
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        be = Backends(
            regular=[free_port(), free_port()], prefill=free_port(), decode=free_port(), bootstrap=free_port()
        )
        conf = write_nginx(tmp, be)
        procs.start("nginx", [nginx, "-c", str(conf), "-p", str(tmp), "-e", str(tmp / "error.log")])
        commands.append("nginx: " + shlex.join([nginx, "-c", str(conf), "-p", str(tmp)]))
        for port in (*be.regular, be.prefill, be.decode):
            err = wait_ready(port, procs.procs["nginx"], timeout=20)
            if err:
                raise RuntimeError(f"nginx not serving on {port}: {err}\n{procs.log_tail('nginx')}")
        luas = {"json": write_lua(tmp, "json", JSON_PATH, JSON_BODY), "sse": write_lua(tmp, "sse", SSE_PATH, SSE_BODY)}
        for mode in s.modes:
            print(f"mode {mode}", flush=True)
            results[mode] = run_mode(s, mode, be, pythons, procs, luas, notes, commands)
    except KeyboardInterrupt:
        print("interrupted: stopping every process started by this run", file=sys.stderr)
        return 130
    finally:
        procs.stop_all()
        signal.signal(signal.SIGTERM, old)
        signal.signal(signal.SIGINT, old_int)
    report = render_report(cmdline, s, results, versions, notes, commands, tmp)
    print(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report)
    print(f"written to {out}; logs in {tmp}")
    return 0


def render_report(
    cmdline: str,
    s: Settings,
    results: dict[str, dict[str, dict[str, list[float | None]]]],
    versions: list[str],
    notes: list[str],
    commands: list[str],
    tmp: Path,
) -> str:
    parts = [
        "# Router overhead benchmark",
        "",
        f"Command: `{cmdline}`",
        "",
        f"Settings: wrk -t1, {s.duration} s per run, connections {list(s.connections)}, "
        f"{s.rounds} round(s) (medians over rounds), c=1 latency: {s.lat_json} JSON / "
        f"{s.lat_sse} SSE sequential requests (or {max(5.0, s.duration):.0f} s, whichever "
        f"ends first) on one keep-alive TCP_NODELAY connection. "
        f"Machine: {os.cpu_count()} CPUs, Python {sys.version.split()[0]}.",
        "",
        "Backends: one nginx (1 worker process) with fixed answers; JSON = POST /generate "
        "(~250 B answer), SSE = POST /v1/chat/completions with a static 16-event body + "
        "`data: [DONE]` sent chunked (nginx cannot pace chunks, so the whole stream is "
        "available at once). Regular mode: 2 workers; PD mode: 1 prefill (dp 1) + 1 decode "
        "(dp_size 8). Added latency = router minus direct in the same round. Ratios are "
        "fastroute / other: > 1 is better for req/s, < 1 is better for latency and CPU.",
        "",
    ]
    if versions:
        parts += ["Peers: " + "; ".join(versions), ""]
    for mode, raw in results.items():
        med = summarize(raw)
        parts.append(build_table(mode, med, ROUTERS))
        parts += ["Bars (from the issue):", *check_bars(mode, med), ""]
        parts += [f"Per-round req/s at c=256 ({mode}):", ""]
        for router in ROUTERS:
            if router in raw:
                rounds = {
                    k: ", ".join(f"{v:,.0f}" for v in raw[router].get(k, []) if v is not None)
                    for k in ("json_c256_rps", "sse_c256_rps")
                }
                parts.append(f"- {router}: JSON [{rounds['json_c256_rps']}], SSE [{rounds['sse_c256_rps']}]")
        parts.append("")
    parts += ["Command lines:", "", "```", *commands, "```", ""]
    if notes:
        parts += ["Notes:", "", *(f"- {n}" for n in notes), ""]
    parts.append(f"Router logs: {tmp}")
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
