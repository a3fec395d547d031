"""Control plane pieces without sockets: the auth rule, the supervisor's control listener, the
reconcile-mismatch counter."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from fastroute.auth import authorized, bearer, matches
from fastroute.config import Config
from fastroute.control.follower import CONTROL_HEADER, VERSION_HEADER
from fastroute.control.metrics import RECONCILE_MISMATCH, Collector, Stats
from fastroute.core.table import TargetTable
from fastroute.runtime.supervisor import Supervisor


def test_auth_rule_is_constant_time_and_leaves_probes_open() -> None:
    key = bearer("k")
    assert key == b"Bearer k" and bearer(None) is None and bearer("") is None
    assert authorized(None, b"/workers", None)
    assert authorized(key, b"/readiness", None) and authorized(key, b"/v1/models", None)
    assert not authorized(key, b"/workers", None)
    assert not authorized(key, b"/workers/abc", b"Bearer x")
    assert authorized(key, b"/get_loads", b"Bearer k")
    assert matches(b"s", b"s") and not matches(b"s", None) and not matches(b"s", b"t")


class _Writer:
    def __init__(self) -> None:
        self.data = b""
        self.closed = False

    def write(self, b: bytes) -> None:
        self.data += b

    async def drain(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True


class _Registry:
    """Records the admin calls the control listener hands on (registry.admin.handle_admin)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str, bytes]] = []
        self.admin = self

    async def handle_admin(
        self, method: str, path: str, query: str, body: bytes, headers: Any
    ) -> tuple[int, bytes, bytes]:
        self.calls.append((method, path, query, body))
        return 202, b"{}", b"application/json"


def _control(head: bytes, body: bytes = b"", eof: bool = True) -> tuple[bytes, _Registry]:
    async def go() -> tuple[bytes, _Registry]:
        sup = Supervisor(Config(workers=2, max_payload_size=100))
        sup.registry = _Registry()  # type: ignore[assignment]
        sup.publish = lambda force=False: False  # type: ignore[method-assign]
        reader = asyncio.StreamReader()
        reader.feed_data(head + body)
        if eof:
            reader.feed_eof()
        w = _Writer()
        await asyncio.wait_for(sup._control_conn(reader, w), 5)  # type: ignore[arg-type]
        assert w.closed
        return w.data, sup.registry  # type: ignore[return-value]

    return asyncio.run(go())


def _head(secret: str | None, length: int, path: str = "/workers") -> bytes:
    lines = [f"POST {path}?x=1 HTTP/1.1", f"Content-Length: {length}"]
    if secret is not None:
        lines.append(f"{CONTROL_HEADER}: {secret}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_control_listener_checks_the_secret_before_reading_the_body() -> None:
    # A huge announced body that never arrives: the answer must not wait for it.
    out, reg = _control(_head("wrong", 10**9), eof=False)
    assert out.startswith(b"HTTP/1.1 403") and reg.calls == []
    out, reg = _control(_head(None, 3), b"abc")
    assert out.startswith(b"HTTP/1.1 403") and reg.calls == []


def test_control_listener_bounds_the_body_and_forwards_the_rest() -> None:
    # The head carries the supervisor's own per-run secret.
    async def go(length: int, body: bytes) -> tuple[bytes, _Registry]:
        sup = Supervisor(Config(workers=2, max_payload_size=100))
        sup.registry = _Registry()  # type: ignore[assignment]
        sup.publish = lambda force=False: False  # type: ignore[method-assign]
        reader = asyncio.StreamReader()
        reader.feed_data(_head(sup._secret, length) + body)
        reader.feed_eof()
        w = _Writer()
        await asyncio.wait_for(sup._control_conn(reader, w), 5)  # type: ignore[arg-type]
        return w.data, sup.registry  # type: ignore[return-value]

    out, reg = asyncio.run(go(101, b"x" * 101))
    assert out.startswith(b"HTTP/1.1 413") and reg.calls == []
    out, reg = asyncio.run(go(3, b"abc"))
    assert out.startswith(b"HTTP/1.1 202") and reg.calls == [("POST", "/workers", "x=1", b"abc")]
    assert f"{VERSION_HEADER}: 0".encode() in out


def test_reconcile_mismatches_are_their_own_counter_not_a_reclaim() -> None:
    stats = Stats()
    stats.reclaim(RECONCILE_MISMATCH)
    stats.reclaim(RECONCILE_MISMATCH)
    stats.reclaim("client_gone")
    with TargetTable(capacity=4) as table:
        reg = CollectorRegistry(auto_describe=False)
        reg.register(Collector(table, SimpleNamespace(target_info=[], _groups={}), [stats]))
        text = generate_latest(reg).decode()
    assert "fastroute_reconcile_mismatches_total 2.0" in text
    assert 'fastroute_leases_reclaimed_total{reason="client_gone"} 1.0' in text
    assert 'reconcile_mismatch"}' not in text
    assert stats.reclaimed == {RECONCILE_MISMATCH: 2, "client_gone": 1}  # scrape did not mutate
