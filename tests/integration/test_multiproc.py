"""``--workers 2``: a supervisor and two proxy processes over one shared target table.

The router runs as real processes (``python -m fastroute --workers 2``) on loopback; the fake
SGLang workers run in the test's event loop so requests can be held open.  Connections are
spread over the two proxy processes by the kernel (SO_REUSEPORT), so tests that need both
processes keep opening connections until the per-process metrics show that each one picked.
"""

from __future__ import annotations

import asyncio
import glob
import os
import re
import signal
import socket
import sys
from typing import Any

from tests.integration.conftest import RawClient, call, get, post, run, until, workers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _segments(pid: int) -> list[str]:
    return glob.glob(f"/dev/shm/fastroute-{pid}-*")


class MultiRouter:
    """``python -m fastroute --workers N`` as a subprocess, with metric and admin helpers."""

    def __init__(self, *args: str, processes: int = 2) -> None:
        self.port = _free_port()
        self.mport = _free_port()
        self.args = [
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(self.mport),
            "--workers",
            str(processes),
            "--worker-startup-check-interval",
            "1",
            "--disable-health-check",
            "--shutdown-grace-period-secs",
            "2",
            "--log-level",
            "warning",
            *args,
        ]
        self.n = processes
        self.proc: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> MultiRouter:
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "fastroute", *self.args, env={**os.environ, "PYTHONPATH": os.getcwd()}
        )
        await self.until_metric(
            lambda m: sum(v for _, v in m.get("fastroute_proxy_process_up", [])) == self.n,
            20.0,
            "every proxy process up with a ready view",
        )
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.proc is not None and self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()

    async def stop(self) -> int:
        """SIGTERM -> the exit status (drain included)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return await asyncio.wait_for(self.proc.wait(), 20)

    async def metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        """Scrape /metrics -> {sample name: [(labels, value)]}."""
        r, w = await asyncio.open_connection("127.0.0.1", self.mport)
        try:
            w.write(b"GET /metrics HTTP/1.1\r\nHost: m\r\n\r\n")
            raw = await asyncio.wait_for(r.read(), 5)
        finally:
            w.close()
        text = raw.split(b"\r\n\r\n", 1)[1].decode()
        out: dict[str, list[tuple[dict[str, str], float]]] = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            m = re.match(r"^([a-zA-Z_:][\w:]*)(?:\{(.*)\})? (\S+)$", line)
            if m is None:
                continue
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
            out.setdefault(m.group(1), []).append((labels, float(m.group(3))))
        return out

    async def until_metric(self, cond: Any, timeout: float, what: str) -> dict:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        last: dict = {}
        while loop.time() < deadline:
            try:
                last = await self.metrics()
                if cond(last):
                    return last
            except (OSError, IndexError, asyncio.TimeoutError):
                pass
            await asyncio.sleep(0.05)
        raise AssertionError(
            f"timed out waiting for {what}; last metrics: "
            f"{ {k: v for k, v in last.items() if k.startswith('fastroute_proxy')} }"
        )


def per_process(m: dict, name: str) -> dict[str, float]:
    return {labels["process"]: v for labels, v in m.get(name, [])}


def value(m: dict, name: str, **want: str) -> float:
    return sum(v for labels, v in m.get(name, []) if all(labels.get(k) == x for k, x in want.items()))


def views_current(m: dict) -> bool:
    """Every proxy process reported the supervisor's current worker snapshot."""
    v = per_process(m, "fastroute_proxy_process_snapshot_version")
    sup = v.pop("supervisor", None)
    return sup is not None and len(v) == 2 and all(x == sup for x in v.values())


async def get_loads(port: int) -> dict:
    res = await call(port, get("/get_loads"))
    assert res.status == 200, res.body
    return res.json


def test_least_requests_balances_ranks_across_both_processes() -> None:
    async def body() -> None:
        (w,) = await workers(1, dp_size=4)
        w.hold()
        async with MultiRouter(
            "--worker-urls", w.url, "--dp-aware", "--policy", "power_of_two", "--p2c-load-metric", "least_requests"
        ) as r:
            clients: list[RawClient] = []
            held = 0
            # One request at a time, each on a new connection (the kernel picks the process),
            # until both processes hold some and the count is a multiple of the 4 ranks.
            while True:
                c = await RawClient(r.port).connect()
                c.send(post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 4}}))
                clients.append(c)
                held += 1
                await until(lambda: w.held == held, 5.0, f"{held} requests held at the worker")
                if held >= 8 and held % 4 == 0:
                    m = await r.metrics()
                    inflight = per_process(m, "fastroute_proxy_process_in_flight_requests")
                    if len(inflight) == 2 and min(inflight.values()) > 0:
                        break
                assert held < 64, "connections never reached both proxy processes"
            loads = await get_loads(r.port)
            ranks = [e["in_flight_requests"] for e in loads["loads"]]
            assert ranks == [held // 4] * 4, ranks
            assert loads["aggregate"]["total_in_flight_requests"] == held
            m = await r.metrics()
            inflight = per_process(m, "fastroute_proxy_process_in_flight_requests")
            assert sum(inflight.values()) == held and min(inflight.values()) > 0, inflight
            picks = per_process(m, "fastroute_proxy_process_picks_total")
            assert min(picks.values()) > 0 and sum(picks.values()) == held, picks
            # Each rank's bookings as the ranks' requests at the worker saw them: the rank field
            # the router injected matches the counts.
            seen = [0] * 4
            for rec in w.inference():
                seen[rec.json["data_parallel_rank"]] += 1
            assert seen == [held // 4] * 4, seen
            w.release()
            for c in clients:
                res = await c.response(timeout=5)
                assert res.status == 200
                c.close()
            loads = await get_loads(r.port)
            assert loads["aggregate"]["total_in_flight_requests"] == 0
            # Statistics of both processes are merged by the supervisor's /metrics.
            m = await r.until_metric(
                lambda m: value(m, "smg_router_requests_total", endpoint="generate") == held,
                5.0,
                "routed requests of both processes in /metrics",
            )
            assert value(m, "fastroute_lease_underflows_total") == 0
            pid = r.proc.pid
            assert _segments(pid), "the shared table should exist while running"
            assert await r.stop() == 0
            assert _segments(pid) == []
        await w.stop()

    run(body(), timeout=60)


def test_sigkill_of_a_proxy_process_mid_stream_reclaims_its_leases() -> None:
    async def body() -> None:
        (w,) = await workers(1, dp_size=2)
        w.stream_gate = asyncio.Event()
        async with MultiRouter(
            "--worker-urls", w.url, "--dp-aware", "--policy", "power_of_two", "--p2c-load-metric", "least_requests"
        ) as r:
            clients: list[RawClient] = []
            while True:
                c = await RawClient(r.port).connect()
                c.send(post("/generate", {"text": "x", "stream": True}))
                await c.until_body(b"data:", 5.0)  # the stream is open mid-response
                clients.append(c)
                m = await r.metrics()
                inflight = per_process(m, "fastroute_proxy_process_in_flight_requests")
                if len(clients) >= 4 and len(inflight) == 2 and min(inflight.values()) > 0:
                    break
                assert len(clients) < 64, "connections never reached both proxy processes"
            pids = per_process(m, "fastroute_proxy_process_pid")
            victim_held = inflight["0"]
            survivor_held = inflight["1"]
            os.kill(int(pids["0"]), signal.SIGKILL)
            m = await r.until_metric(
                lambda m: (
                    per_process(m, "fastroute_proxy_process_restarts_total").get("0") == 1
                    and per_process(m, "fastroute_proxy_process_up").get("0") == 1
                ),
                15.0,
                "process 0 restarted",
            )
            assert per_process(m, "fastroute_proxy_process_pid")["0"] != pids["0"]
            assert value(m, "fastroute_leases_reclaimed_total", reason="process_exit") == victim_held
            # Only the survivor's streams are still booked; nothing of the dead process remains.
            loads = await get_loads(r.port)
            assert loads["aggregate"]["total_in_flight_requests"] == survivor_held
            assert per_process(m, "fastroute_proxy_process_in_flight_requests") == {"0": 0.0, "1": float(survivor_held)}
            w.stream_gate.set()
            done = 0
            for c in clients:
                try:
                    await c.until_body(b"[DONE]", 5.0)
                    done += 1
                except (EOFError, ConnectionError):
                    pass  # a stream of the killed process
                c.close()
            assert done == survivor_held
            loads = await get_loads(r.port)
            assert loads["aggregate"]["total_in_flight_requests"] == 0
            m = await r.metrics()
            assert value(m, "fastroute_lease_underflows_total") == 0
            # The restarted process serves.
            res = await call(r.port, post("/generate", {"text": "y"}))
            assert res.status == 200
            pid = r.proc.pid
            assert await r.stop() == 0
            assert _segments(pid) == []
        await w.stop()

    run(body(), timeout=60)


def test_worker_added_through_any_process_reaches_both() -> None:
    async def body() -> None:
        a, b = await workers(2)
        async with MultiRouter("--worker-urls", a.url, "--policy", "round_robin") as r:
            c = await RawClient(r.port).connect()
            c.send(post("/workers", {"url": b.url}))
            res = await c.response()
            assert res.status == 202, res.body
            wid_b = res.json["worker_id"]
            # The process that took the POST knows the worker at once (same connection) ...
            c.send(get(f"/workers/{wid_b}"))
            res = await c.response()
            assert res.status == 200 and res.json["url"] == b.url
            c.close()
            ida = None
            for _ in range(200):
                res = await call(r.port, get("/workers"))
                doc = res.json
                if all(x["status"] == "ready" for x in doc["workers"]) and doc["total"] == 2:
                    ida = next(x["id"] for x in doc["workers"] if x["url"] == a.url)
                    break
                await asyncio.sleep(0.02)
            assert ida is not None, "worker b never became ready"
            # ... and once it is ready, removing a leaves b as the only target of every process:
            # requests through both processes land on b.
            res = await RawClient(r.port).connect()
            res.send(b"DELETE /workers/" + ida.encode() + b" HTTP/1.1\r\nHost: r\r\n\r\n")
            assert (await res.response()).status == 202
            res.close()
            await r.until_metric(views_current, 5.0, "every process applied the removal")
            before_a = len(a.inference())
            start = per_process(await r.metrics(), "fastroute_proxy_process_picks_total")
            sent = 0
            while True:
                res = await call(r.port, post("/generate", {"text": "z"}))
                assert res.status == 200
                sent += 1
                picks = per_process(await r.metrics(), "fastroute_proxy_process_picks_total")
                if all(picks[p] > start[p] for p in start):
                    break
                assert sent < 64, "connections never reached both proxy processes"
            # Both processes picked after applying the snapshot without a: all went to b.
            assert len(a.inference()) == before_a
            pid = r.proc.pid
            assert await r.stop() == 0
            assert _segments(pid) == []
        await a.stop()
        await b.stop()

    run(body(), timeout=60)


# ---- the pieces without sockets (reclaim arithmetic, stats merge, snapshot apply) ----------------


def test_reclaim_subtracts_exactly_the_dead_process_ledger() -> None:
    from fastroute.control.leases import reclaim
    from fastroute.core.routing import Router
    from fastroute.core.table import TargetTable

    with TargetTable(capacity=8) as table, TargetTable(capacity=8) as la, TargetTable(capacity=8) as lb:
        rows = [table.alloc() for _ in range(3)]
        ga = Router(table, seed=1).group(rows, "round_robin")
        gb = Router(table, seed=2).group(rows, "round_robin")
        ga.track_in(la)
        gb.track_in(lb)
        acq_a, acq_b = ga.acquire, gb.acquire
        held_a = [acq_a(10) for _ in range(5)]
        held_b = [acq_b(7) for _ in range(4)]
        held_a[0].release()  # released leases are not reclaimed
        assert held_a[0].release() is False  # and release stays idempotent
        reqs, toks = reclaim(table, la)  # process a "died" holding 4 leases
        assert (reqs, toks) == (4, 40)
        assert sum(table.in_flight(t) for t in rows) == 4
        assert sum(table.in_flight_tokens(t) for t in rows) == 28
        assert la.snapshot()[:, :2].sum() == 0
        assert reclaim(table, la) == (0, 0)  # idempotent
        for lease in held_b:
            lease.release()
        assert sum(table.in_flight(t) for t in rows) == 0
        assert table.underflows == 0
        del ga, gb, held_a, held_b, acq_a, acq_b


def test_merge_stats_adds_counters_and_histograms_not_gauges() -> None:
    from fastroute.control.metrics import Stats, merge_stats

    a, b = Stats(), Stats()
    a.count(a.http_requests, ("POST", "/generate"), 3)
    b.count(b.http_requests, ("POST", "/generate"), 2)
    b.count(b.reclaimed, "process_exit", 5)
    b.duration("regular", "/generate", 0.2)
    b.pick_seconds.observe(1e-5)
    b.connections_active = 7
    merge_stats(a, b)
    merge_stats(a, b)
    assert a.http_requests == {("POST", "/generate"): 7}
    assert a.reclaimed == {"process_exit": 10}
    assert a.router_duration[("regular", "/generate")].count == 2
    assert a.pick_seconds.count == 2
    assert a.connections_active == 0


def test_follower_applies_snapshots_and_forgets_removed_workers() -> None:
    from fastroute.config import Config
    from fastroute.control.follower import FollowerRegistry
    from fastroute.core.routing import Router
    from fastroute.core.table import TargetTable

    cfg = Config(worker_urls=[], policy="round_robin", dp_aware=True)
    with TargetTable(capacity=8) as table, TargetTable(capacity=8) as ledger:
        reg = FollowerRegistry(
            cfg, table, Router(table, seed=3, config=cfg), ledger, "/nonexistent", "http://127.0.0.1:1", "s"
        )
        assert not reg.ready()

        def worker(url: str, wid: str, targets: list[int], status: str = "ready") -> dict:
            return {
                "url": url,
                "role": "regular",
                "id": wid,
                "host": "127.0.0.1",
                "port": 1,
                "bootstrap_port": None,
                "dp_size": len(targets),
                "targets": targets,
                "names": [f"{url}@{i}" for i in range(len(targets))],
                "model_id": "m",
                "server_info": {},
                "model_info": {},
                "healthy": True,
                "status": status,
                "priority": 50,
                "cost": 1.0,
                "labels": {},
                "api_key": None,
                "requested_model_id": None,
                "error": None,
                "server_info_path": "/server_info",
                "model_info_path": "/model_info",
            }

        rows = [table.alloc() for _ in range(3)]
        reg.apply(
            {
                "version": 1,
                "workers": [
                    worker("http://a:1", "a", rows[:2]),
                    worker("http://b:1", "b", [rows[2]]),
                    worker("http://c:1", "c", [], status="pending"),
                ],
            }
        )
        assert reg.ready() and reg.version == 1
        assert reg.group("regular").targets == rows
        wa = reg.target_info[rows[1]][0]
        assert reg.target_info[rows[1]] == (wa, 1) and reg.target_info[rows[2]][1] is None
        lease = reg.group("regular").acquire(5)
        assert ledger.in_flight(lease.target) == 1 and table.in_flight(lease.target) == 1
        lease.release()
        assert ledger.in_flight(lease.target) == 0 and table.in_flight(lease.target) == 0
        wb = reg.target_info[rows[2]][0]
        reg.apply({"version": 2, "workers": [worker("http://a:1", "a", rows[:2])]})
        assert reg.group("regular").targets == rows[:2]
        assert reg.find("http://a:1") is wa  # identity kept across snapshots
        assert reg.find("http://b:1") is None
        # b's row still resolves until the supervisor frees it (a late lookup of a lease) ...
        assert reg.target_info[rows[2]] == (wb, None)
        table.free(rows[2])
        reg.apply({"version": 3, "workers": [worker("http://a:1", "a", rows[:2])]})
        assert reg.target_info[rows[2]] is None  # ... and not after
        reg.apply({"version": 4, "workers": []})
        assert not reg.ready() and reg.group("regular").acquire(1) is None
        del reg, lease


def test_sigterm_drains_everywhere_and_finishes_in_flight() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        w.hold()
        async with MultiRouter("--worker-urls", w.url, "--policy", "round_robin") as r:
            clients = []
            for i in range(4):
                c = await RawClient(r.port).connect()
                c.send(post("/generate", {"text": "x"}))
                clients.append(c)
                await until(lambda: w.held == i + 1, 5.0, "request held")
            pid = r.proc.pid
            r.proc.send_signal(signal.SIGTERM)

            async def readiness() -> int | None:
                try:
                    return (await call(r.port, get("/readiness"), timeout=5)).status
                except OSError:
                    return None

            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            # every proxy process answers 503 (20 fresh connections in a row), none refuses
            while [await readiness() for _ in range(20)] != [503] * 20:
                assert loop.time() < deadline, "a proxy process stayed ready after SIGTERM"
                await asyncio.sleep(0.02)
            assert r.proc.returncode is None  # still draining the held requests
            w.release()
            for c in clients:
                res = await c.response(timeout=5)
                assert res.status == 200
                c.close()
            assert await asyncio.wait_for(r.proc.wait(), 15) == 0
            assert _segments(pid) == []
        await w.stop()

    run(body(), timeout=60)


def test_killed_supervisor_takes_its_proxy_processes_and_segments_along() -> None:
    async def body() -> None:
        (w,) = await workers(1)
        async with MultiRouter("--worker-urls", w.url, "--policy", "round_robin") as r:
            m = await r.metrics()
            children = [int(v) for v in per_process(m, "fastroute_proxy_process_pid").values()]
            assert len(children) == 2
            pid = r.proc.pid
            r.proc.kill()
            await r.proc.wait()

            def gone() -> bool:
                alive = []
                for c in children:
                    try:
                        with open(f"/proc/{c}/stat") as f:
                            alive.append(f.read().split(") ", 1)[1][0] != "Z")
                    except OSError:
                        alive.append(False)
                return not any(alive) and not _segments(pid)

            await until(gone, 10.0, "proxy processes exited and shared memory removed")
        await w.stop()

    run(body(), timeout=60)


def test_pd_mode_balances_decode_ranks_across_both_processes() -> None:
    async def body() -> None:
        (p,) = await workers(1, role="prefill")
        (d,) = await workers(1, role="decode", dp_size=2)
        d.hold()
        async with MultiRouter(
            "--pd-disaggregation",
            "--prefill",
            p.url,
            "8998",
            "--decode",
            d.url,
            "--dp-aware",
            "--policy",
            "power_of_two",
            "--p2c-load-metric",
            "least_requests",
        ) as r:
            clients: list[RawClient] = []
            while True:
                c = await RawClient(r.port).connect()
                c.send(post("/generate", {"text": "x"}))
                clients.append(c)
                n = len(clients)
                await until(lambda: d.held == n, 5.0, f"{n} decode legs held")
                if n >= 4 and n % 2 == 0:
                    inflight = per_process(await r.metrics(), "fastroute_proxy_process_in_flight_requests")
                    # Two leases (prefill + decode) per request, booked by the process that took it.
                    if len(inflight) == 2 and min(inflight.values()) > 0:
                        assert sum(inflight.values()) == 2 * n
                        break
                assert n < 64, "connections never reached both proxy processes"
            loads = await get_loads(r.port)
            decode = [e["in_flight_requests"] for e in loads["loads"] if e["worker_type"] == "decode"]
            assert decode == [n // 2, n // 2], decode
            ranks = sorted(rec.json["routed_dp_rank"] for rec in d.inference())
            assert ranks == [0] * (n // 2) + [1] * (n // 2)
            d.release()
            for c in clients:
                assert (await c.response(timeout=5)).status == 200
                c.close()
            loads = await get_loads(r.port)
            assert loads["aggregate"]["total_in_flight_requests"] == 0
            pid = r.proc.pid
            assert await r.stop() == 0
            assert _segments(pid) == []
        await p.stop()
        await d.stop()

    run(body(), timeout=60)
