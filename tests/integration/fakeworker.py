"""A recording fake SGLang worker for the control-plane tests.

Real loopback HTTP server (the simulator's ``fastroute.sim.http.HttpServer``, so the httptools
server loop is written once) that runs inside the test's event loop. It serves the control
endpoints a router talks to (/health, /server_info, /get_server_info, /model_info,
/get_model_info, /v1/loads, /get_load, /flush_cache, /metrics, /health_generate, /v1/models) and
records every request (method, path, query, headers, body) so tests can assert on wire behaviour.
Knobs are plain attributes that tests flip at any time.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from fastroute.sim.http import HttpServer, Request, Responder


@dataclass
class Recorded:
    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes


@dataclass
class FakeWorker:
    dp_size: int = 1
    # Per-rank loads: list index = rank; keys num_running_reqs, num_waiting_reqs, num_used_tokens;
    # any other key (e.g. num_waiting_uncached_tokens, disaggregation) is sent as it is.
    loads: list[dict[str, Any]] = field(default_factory=list)
    # "v1" -> /v1/loads works; "get_load" -> /v1/loads 404s, /get_load works; "none" -> both 404;
    # "error" -> /v1/loads answers 500.
    load_mode: str = "v1"
    server_info_404: bool = False  # /server_info 404 -> router must use /get_server_info
    model_info_404: bool = False
    omit_dp_size: bool = False
    served_model_name: str | None = None
    model_path: str = "/models/org/Fake-Model-7B"
    health_status: int = 200
    health_delay: float = 0.0
    health_generate_status: int = 200
    flush_status: int = 200
    metrics_text: str = "# HELP fake_gauge A gauge\n# TYPE fake_gauge gauge\nfake_gauge 1\n"
    requests: list[Recorded] = field(default_factory=list)
    port: int = 0
    _http: HttpServer | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> FakeWorker:
        self._http = HttpServer(self._serve, "127.0.0.1", 0)
        await self._http.start()
        self.port = self._http.port
        return self

    async def stop(self) -> None:
        # Also closes open keep-alive connections, so a stopped worker is gone for pooled
        # clients too, as a killed SGLang server would be.
        if self._http is not None:
            await self._http.stop()
            self._http = None

    async def _serve(self, req: Request, resp: Responder) -> None:
        """Record the request as it arrived, then answer it through ``handle``."""
        rec = Recorded(
            method=req.method,
            path=req.path,
            query=req.query,
            headers={k.decode("latin-1"): v.decode("latin-1") for k, v in req.headers.items()},
            body=req.body,
        )
        self.requests.append(rec)
        status, body, ctype = await self.handle(rec)
        resp.send(status, body, ctype.encode())

    def paths(self) -> list[str]:
        return [r.path for r in self.requests]

    def count(self, path: str) -> int:
        return sum(1 for r in self.requests if r.path == path)

    def rank_loads(self) -> list[dict[str, int]]:
        out = []
        for r in range(self.dp_size):
            d = self.loads[r] if r < len(self.loads) else {}
            out.append(
                {
                    "num_running_reqs": d.get("num_running_reqs", 0),
                    "num_waiting_reqs": d.get("num_waiting_reqs", 0),
                    "num_used_tokens": d.get("num_used_tokens", 0),
                }
            )
        return out

    # ---- routing -------------------------------------------------------------------------
    async def handle(self, rec: Recorded) -> tuple[int, bytes, str]:
        p = rec.path
        if p == "/health":
            if self.health_delay:
                await asyncio.sleep(self.health_delay)
            return self.health_status, b"", "text/plain"
        if p == "/health_generate":
            return self.health_generate_status, b"", "text/plain"
        if p in ("/server_info", "/get_server_info"):
            if p == "/server_info" and self.server_info_404:
                return 404, b'{"detail":"Not Found"}', "application/json"
            info: dict[str, Any] = {
                "model_path": self.model_path,
                "tp_size": 1,
                "max_total_num_tokens": 100000,
                "internal_states": [{"rank": r, "avg_spec_accept_length": 1.0} for r in range(self.dp_size)],
                "version": "0.0-fake",
            }
            if self.served_model_name:
                info["served_model_name"] = self.served_model_name
            if not self.omit_dp_size:
                info["dp_size"] = self.dp_size
            return 200, json.dumps(info).encode(), "application/json"
        if p in ("/model_info", "/get_model_info"):
            if p == "/model_info" and self.model_info_404:
                return 404, b'{"detail":"Not Found"}', "application/json"
            info = {"model_path": self.model_path, "is_generation": True, "model_type": "fake"}
            return 200, json.dumps(info).encode(), "application/json"
        if p == "/v1/loads":
            if self.load_mode == "error":
                return 500, b"boom", "text/plain"
            if self.load_mode != "v1":
                return 404, b'{"detail":"Not Found"}', "application/json"
            loads = []
            for r, d in enumerate(self.rank_loads()):
                loads.append(
                    {
                        "dp_rank": r,
                        "num_running_reqs": d["num_running_reqs"],
                        "num_waiting_reqs": d["num_waiting_reqs"],
                        "num_total_reqs": d["num_running_reqs"] + d["num_waiting_reqs"],
                        "num_used_tokens": d["num_used_tokens"],
                        "max_total_num_tokens": 100000,
                        "token_usage": d["num_used_tokens"] / 100000,
                        **(self.loads[r] if r < len(self.loads) else {}),
                    }
                )
            doc = {"timestamp": "2026-01-01T00:00:00+00:00", "dp_rank_count": self.dp_size, "loads": loads}
            return 200, json.dumps(doc).encode(), "application/json"
        if p == "/get_load":
            if self.load_mode not in ("get_load",):
                return 404, b'{"detail":"Not Found"}', "application/json"
            arr = [
                {
                    "dp_rank": r,
                    "num_reqs": d["num_running_reqs"] + d["num_waiting_reqs"],
                    "num_waiting_reqs": d["num_waiting_reqs"],
                    "num_tokens": d["num_used_tokens"],
                }
                for r, d in enumerate(self.rank_loads())
            ]
            return 200, json.dumps(arr).encode(), "application/json"
        if p == "/flush_cache":
            return self.flush_status, b"Cache flushed." if self.flush_status == 200 else b"busy", "text/plain"
        if p == "/metrics":
            return 200, self.metrics_text.encode(), "text/plain; version=0.0.4"
        if p == "/v1/models":
            name = self.served_model_name or self.model_path
            return (
                200,
                json.dumps({"object": "list", "data": [{"id": name, "object": "model"}]}).encode(),
                "application/json",
            )
        return 404, b'{"detail":"Not Found"}', "application/json"


# ---- shared helpers for the control-plane tests ---------------------------------------------------
# Timing knobs the tests shrink below what Config validation allows for real deployments; they are
# set after construction so Config's CLI-level validation stays untouched.
FAST_TIMING = {
    "worker_startup_check_interval": 0.02,
    "worker_startup_timeout_secs": 5.0,
    "health_check_timeout_secs": 1.0,
    "health_check_interval_secs": 0.05,
    "load_monitor_interval": 0.1,
}


def make_config(**overrides: Any) -> Any:
    """A real fastroute Config (round_robin unless given) with fast control-plane timing."""
    from fastroute.config import Config

    timing = {**FAST_TIMING, **{k: overrides.pop(k) for k in list(overrides) if k in FAST_TIMING}}
    overrides.setdefault("policy", "round_robin")
    cfg = Config(**overrides)
    for k, v in timing.items():
        setattr(cfg, k, v)
    return cfg


def run(fn: Any, timeout: float = 30.0) -> Any:
    """Run ``await fn()`` in a fresh event loop, bounded by ``timeout`` seconds."""
    return asyncio.run(asyncio.wait_for(fn(), timeout))


async def wait_until(pred: Any, timeout: float = 5.0, step: float = 0.01) -> None:
    """Poll ``pred()`` until true; fail (AssertionError) after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        if loop.time() > end:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(step)


class Plane:
    """Real table + router + registry + monitor (monitor loops not started) for one test."""

    def __init__(self, config: Any, capacity: int = 64) -> None:
        self.config = config
        self.capacity = capacity

    async def __aenter__(self) -> Plane:
        from fastroute.control.monitor import Monitor
        from fastroute.control.registry import Registry
        from fastroute.core.routing import Router
        from fastroute.core.table import TargetTable

        self.table = TargetTable(capacity=self.capacity)
        self.router = Router(self.table, seed=7)
        self.registry = Registry(self.config, self.table, self.router)
        self.monitor = Monitor(self.config, self.registry, self.table)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.monitor.stop()
        await self.registry.stop()
        self.table.close()
        self.table.unlink()

    async def add(self, fw: FakeWorker, role: str = "regular", **kw: Any) -> Any:
        w = self.registry.add_worker(fw.url, role, **kw)
        assert await self.registry.wait_registered(w), w.error
        return w

    async def admin(self, method: str, path: str, body: Any = b"", headers: Any = None) -> tuple[int, Any, bytes]:
        """handle_admin with the query split off; JSON answers are decoded."""
        path, _, query = path.partition("?")
        if not isinstance(body, bytes):
            body = json.dumps(body).encode()
        status, out, ctype = await self.registry.admin.handle_admin(method, path, query, body, headers or [])
        if ctype.startswith(b"application/json"):
            return status, json.loads(out), ctype
        return status, out, ctype
