"""What an open admin API allows, bounded (issue 50, item 6), over real sockets and processes.

* a router whose admin API has no key refuses to start on an address others can reach unless
  ``--allow-open-admin`` says so (the refusal's one line is in test_startup_errors); with the
  flag, or with a key, it starts;
* ``fastroute sidecar`` keeps its worker-management routes closed (403, naming the flag) unless a
  key guards them or ``--allow-open-admin`` opens them, so nobody can make it call a host;
* one worker may take at most ``--max-targets-per-worker`` table rows: a worker reporting
  dp_size 1018 is refused with the reason and the next real worker still registers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

from fastroute.config import Config
from fastroute.epp.sidecar import SidecarServer
from tests.integration.conftest import DataWorker, Router, call, get, post, run, until, wait_port
from tests.integration.test_rank_port_addresses import _RankPort
from tests.integration.test_security import _free_port

H = "127.0.0.1"


def _router(*argv: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "fastroute", "--prometheus-host", H, "--prometheus-port", "0", *argv],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )


@pytest.mark.parametrize("extra", [["--allow-open-admin"], ["--api-key", "k1"]], ids=["flag", "key"])
def test_a_reachable_admin_api_starts_with_the_flag_or_a_key(extra: list[str]) -> None:
    port = _free_port()
    proc = _router("--host", "0.0.0.0", "--port", str(port), *extra)
    try:
        assert wait_port(port), proc.stderr.read().decode() if proc.poll() is not None and proc.stderr else ""
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(20)


class _Sidecar:
    """``fastroute sidecar``'s server in this loop, over a PD pair of data workers."""

    def __init__(self, p: DataWorker, d: DataWorker, **cfg: Any) -> None:
        self.server = SidecarServer(
            Config(
                host=H,
                port=0,
                pd_disaggregation=True,
                prefill=[(p.url, None)],
                decode=[d.url],
                policy="round_robin",
                worker_startup_check_interval=1,
                disable_health_check=True,
                prometheus_host=H,
                prometheus_port=0,
                **cfg,
            )
        )

    async def __aenter__(self) -> _Sidecar:
        await self.server.start()
        await until(self.server.registry.ready, 10.0, "workers registered")
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.server.stop(grace=0.5)


def _auth(raw: bytes, key: str) -> bytes:
    return raw.replace(b"\r\n", f"\r\nAuthorization: Bearer {key}\r\n".encode(), 1)


def test_the_sidecar_admin_api_is_closed_unless_asked() -> None:
    async def body() -> None:
        p, d = await DataWorker(role="prefill").start(), await DataWorker(role="decode").start()
        target = await DataWorker().start()  # a host someone would like the sidecar to call
        try:
            async with _Sidecar(p, d) as s:
                port = s.server.port
                for raw in (post("/workers", {"url": target.url}), post(f"/add_worker?url={target.url}", {})):
                    res = await call(port, raw)
                    assert res.status == 403, res.body
                    assert res.json["error"]["code"] == "admin_api_closed"
                    assert "--allow-open-admin" in res.json["error"]["message"]
                res = await call(port, get("/workers"))
                assert res.status == 403 and res.json["error"]["code"] == "admin_api_closed"
                assert [w.url for w in s.server.registry.workers] == [p.url, d.url]
                # The data path and probes are untouched.
                assert (await call(port, get("/readiness"))).status == 200
            assert target.connections == 0
            async with _Sidecar(p, d, api_key="k1") as s:
                port = s.server.port
                assert (await call(port, post("/workers", {"url": target.url}))).status == 401
                res = await call(port, _auth(post("/workers", {"url": target.url, "worker_type": "decode"}), "k1"))
                assert res.status == 202, res.body
            async with _Sidecar(p, d, allow_open_admin=True) as s:
                res = await call(s.server.port, post("/workers", {"url": target.url, "worker_type": "decode"}))
                assert res.status == 202, res.body
        finally:
            for w in (p, d, target):
                await w.stop()

    run(body(), 40.0)


def test_one_worker_cannot_fill_the_table() -> None:
    """Under --dp-aware a worker reporting dp_size 1018 would take 1,018 of the 1,024 rows: it is
    refused (default bound 256) with the reason, and the next worker registers."""

    async def body() -> None:
        good, huge = await DataWorker().start(), await DataWorker(dp_size=1018).start()
        nxt = await DataWorker(dp_size=8).start()
        try:
            async with Router(worker_urls=[good.url], dp_aware=True) as r:
                reg = r.server.registry
                res = await call(r.port, post("/workers", {"url": huge.url}))
                assert res.status == 202, res.body
                w = reg.get(res.json["worker_id"])
                assert w is not None
                await until(lambda: w.status == "failed", 10.0, "the registration refused")
                assert "--max-targets-per-worker" in (w.error or "") and "1018" in (w.error or ""), w.error
                res = await call(r.port, post("/workers", {"url": nxt.url}))
                assert res.status == 202, res.body
                w2 = reg.get(res.json["worker_id"])
                assert w2 is not None
                await until(lambda: w2.status == "ready", 10.0, "the next worker registered")
                assert len(w2.targets) == 8
                assert sum(1 for e in reg.target_info if e is not None) == 9
                res = await call(r.port, get(f"/workers/{w2.id}"))
                assert res.status == 200 and json.loads(res.body)["url"] == nxt.url
        finally:
            for x in (good, huge, nxt):
                await x.stop()

    run(body(), 40.0)


def test_a_per_rank_port_server_over_the_bound_is_refused() -> None:
    """Its rank ports are never asked: the reported count alone is over --max-targets-per-worker."""

    async def body() -> None:
        good = await DataWorker().start()
        huge = await _RankPort(0, {"dp_size": 1018}).start()
        try:
            async with Router(worker_urls=[good.url], max_targets_per_worker=16) as r:
                reg = r.server.registry
                res = await call(r.port, post("/workers", {"url": huge.url}))
                assert res.status == 202, res.body
                w = reg.get(res.json["worker_id"])
                assert w is not None
                await until(lambda: w.status == "failed", 10.0, "the registration refused")
                assert "--max-targets-per-worker" in (w.error or ""), w.error
                assert sum(1 for e in reg.target_info if e is not None) == 1
        finally:
            await good.stop()
            await huge.stop()

    run(body(), 40.0)
