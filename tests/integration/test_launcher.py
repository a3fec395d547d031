"""An RL launcher (slime / miles style) that cannot change its ``sglang_router`` import starts
fastroute through ``python -m fastroute.compat``: argparse with the router prefix,
``RouterArgs.from_cli_args``, ``multiprocessing.Process(target=launch_router)``, workers added
with ``POST /workers`` under a control-plane key given as sglang-router's tuple, SIGTERM."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request

SECRET = "s3cret-launcher-key-0042"

LAUNCHER = textwrap.dedent("""
    import argparse, json, multiprocessing, sys, time, urllib.error, urllib.request
    from sglang_router.launch_router import RouterArgs, launch_router   # unchanged import

    def http(method, url, body=None, headers=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method,
                                     headers={"Content-Type": "application/json", **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except OSError:
            return None, ""

    def until(check, what):
        deadline = time.time() + 60
        while not check():
            assert time.time() < deadline, what
            time.sleep(0.05)

    def main():
        parser = argparse.ArgumentParser()
        parser.add_argument("--sglang-router-ip", default="127.0.0.1")
        parser.add_argument("--sglang-router-port", type=int, required=True)
        parser.add_argument("--engine-urls", nargs="+", required=True)
        parser.add_argument("--admin-key", required=True)
        RouterArgs.add_cli_args(parser, use_router_prefix=True, exclude_host_port=True)
        args = parser.parse_args()
        router_args = RouterArgs.from_cli_args(args, use_router_prefix=True)
        router_args.host = args.sglang_router_ip
        router_args.port = args.sglang_router_port
        print(json.dumps({"keys": router_args.control_plane_api_keys,
                          "policy": router_args.policy}), flush=True)
        proc = multiprocessing.Process(target=launch_router, args=(router_args,))
        proc.start()
        base = f"http://{router_args.host}:{router_args.port}"
        until(lambda: http("GET", base + "/health")[0] == 200 or not proc.is_alive(), "router up")
        assert proc.is_alive(), "router exited"
        auth = {"Authorization": "Bearer " + args.admin_key}
        added = [http("POST", base + "/workers", {"url": u}, auth)[0] for u in args.engine_urls]
        unauth = http("POST", base + "/workers", {"url": args.engine_urls[0]})[0]
        def all_ready():
            status, body = http("GET", base + "/workers", headers=auth)
            listed = json.loads(body)["workers"] if status == 200 else []
            return len(listed) == len(added) and all(w["status"] == "ready" for w in listed)
        until(all_ready, "workers ready")
        gens = [http("POST", base + "/generate",
                     {"text": f"q{i}", "sampling_params": {"max_new_tokens": 2}})[0] for i in range(8)]
        proc.terminate()                      # SIGTERM, as the launchers stop their router
        proc.join(60)
        print(json.dumps({"added": added, "unauth": unauth, "gens": gens,
                          "exitcode": proc.exitcode}), flush=True)

    if __name__ == "__main__":
        main()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str) -> tuple[int | None, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return r.status, r.read()
    except OSError:
        return None, b""


def _sim(port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fastroute.sim.worker",
            "--role",
            "regular",
            "--port",
            str(port),
            "--max-new-tokens",
            "2",
            "--step-base-ms",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def test_slime_style_launcher_runs_fastroute_through_the_sglang_router_import(tmp_path) -> None:
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    ports = [_free_port(), _free_port()]
    sims = [_sim(p) for p in ports]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    try:
        deadline = time.time() + 30
        while not all(_get(p, "/health")[0] == 200 for p in ports):
            assert time.time() < deadline, "sim workers did not come up"
            time.sleep(0.05)
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "fastroute.compat",
                str(script),
                "--sglang-router-port",
                str(_free_port()),
                "--engine-urls",
                *(f"http://127.0.0.1:{p}" for p in ports),
                "--admin-key",
                SECRET,
                "--router-policy",
                "round_robin",
                "--router-prometheus-port",
                "0",
                "--router-control-plane-api-keys",
                f"k1:trainer:admin:{SECRET}",
                "--router-worker-startup-check-interval",
                "1",
                "--router-shutdown-grace-period-secs",
                "5",
                "--router-log-level",
                "info",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=150,
        )
        # round robin over the two worker processes: each served its share of the 8
        served = [json.loads(_get(p, "/sim/stats")[1])["requests"] for p in ports]
    finally:
        for s in sims:
            s.terminate()
            s.wait(10)
    assert out.returncode == 0, out.stderr[-3000:]
    first, result = (json.loads(line) for line in out.stdout.splitlines()[-2:])
    # sglang-router's tuple layout: (id, name, key, role)
    assert first == {"keys": [["k1", "trainer", SECRET, "admin"]], "policy": "round_robin"}
    assert all(200 <= s < 300 for s in result["added"]), result
    assert result["unauth"] == 401
    assert result["gens"] == [200] * 8 and served == [4, 4]
    assert result["exitcode"] == 0  # SIGTERM drained and ended the router cleanly
    assert SECRET not in out.stderr  # never in a log line
    assert "Traceback" not in out.stderr


# sglang's own launchers stop the router they started like this: SIGTERM, one second, SIGKILL.
ONE_SECOND_LAUNCHER = textwrap.dedent("""
    import json, multiprocessing, socket, sys, time
    from fastroute.launch_router import RouterArgs, launch_router

    def main():
        port, metrics = int(sys.argv[1]), int(sys.argv[2])
        args = RouterArgs(host="127.0.0.1", port=port, prometheus_host="127.0.0.1", prometheus_port=metrics)
        proc = multiprocessing.Process(target=launch_router, args=(args,))
        proc.start()
        deadline = time.time() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                break
            except OSError:
                assert proc.is_alive() and time.time() < deadline, "router up"
                time.sleep(0.05)
        time.sleep(0.2)  # idle: nothing in flight, no connection open
        proc.terminate()
        proc.join(1)
        killed = proc.is_alive()
        if killed:
            proc.kill()
            proc.join()
        print(json.dumps({"killed": killed, "exitcode": proc.exitcode}), flush=True)

    if __name__ == "__main__":
        main()
""")


def test_an_idle_router_stops_within_the_launchers_second(tmp_path) -> None:
    """An idle router (no request, no connection) ends at once on SIGTERM: the launcher's
    one-second join sees it gone, never SIGKILLs it, and its shared table is unlinked (no
    ``leaked shared_memory`` warning from the resource tracker)."""
    script = tmp_path / "one_second.py"
    script.write_text(ONE_SECOND_LAUNCHER)
    out = subprocess.run(
        [sys.executable, str(script), str(_free_port()), str(_free_port())],
        env={**os.environ, "PYTHONPATH": os.getcwd()},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result == {"killed": False, "exitcode": 0}, (result, out.stderr[-3000:])
    assert "leaked shared_memory" not in out.stderr, out.stderr[-3000:]
