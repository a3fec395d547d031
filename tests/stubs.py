"""Stand-ins for the routing layer in proxy tests that use a mock transport (no sockets, no
compiled table): one copy, so a change to Group.acquire's signature is made once."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from fastroute.dataplane.app import App
from fastroute.dataplane.upstream import Pool
from fastroute.dataplane.upstreams import Upstreams


class PoolStandIn(Pool):
    """Base of the tests' pools that record what is sent instead of connecting: a Pool by type,
    since routes and connections hold a typed one in the compiled build. Subclasses override
    ``send`` (and whatever else they watch); the pool's own loop is never called."""

    def __init__(self) -> None:
        super().__init__("127.0.0.1", 9, 3.0, SimpleNamespace())


class StubLease:
    """Counts its releases; ``release()`` is True only the first time, like the real Lease."""

    def __init__(self, target: int = 0) -> None:
        self.target = target
        self.tokens = 0
        self.releases = 0

    def release(self) -> bool:
        self.releases += 1
        return self.releases == 1

    def answered(self) -> bool:
        """A stub books no tokens: nothing to give back (as a real Lease without them)."""
        return False


class StubGroup:
    """Always picks ``target``; keeps the leases it handed out when ``record`` (tests check
    them), not in benchmarks (memory would grow with the rounds)."""

    policy = "round_robin"

    def __init__(self, target: int = 0, record: bool = True) -> None:
        self.target = target
        self.targets = [target]  # what the routes are built for (Upstreams.targets_changed)
        self.record = record
        self.leases: list[StubLease] = []

    def acquire(self, tokens: int = 0, key: bytes | None = None, meta: object = None, out_tokens: int = 0) -> StubLease:
        lease = StubLease(self.target)
        if self.record:
            self.leases.append(lease)
        return lease


class StubMeta:
    """The request as ``Group.acquire`` sees it: only ``routing_text()`` (read by cache_aware)."""

    __slots__ = ("text",)

    def __init__(self, text: str | None) -> None:
        self.text = text

    def routing_text(self) -> str | None:
        return self.text


class StubTransport(asyncio.Transport):
    """A client transport that never blocks: counts the bytes written (``n``) and, when
    ``record``, keeps each write (``out``)."""

    def __init__(self, record: bool = False) -> None:
        super().__init__()
        self.n = 0
        self.record = record
        self.out: list[bytes] = []

    def write(self, data: Any) -> None:
        self.n += len(data)
        if self.record:
            self.out.append(bytes(data))

    def close(self) -> None:
        pass

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class StubConn:
    """An upstream connection a leg can pause, resume and abort (all no-ops)."""

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass

    def abort(self) -> None:
        pass


class StubPool(PoolStandIn):
    """A worker's pool that keeps every leg the App sends through it (``legs``), each given a
    StubConn, for the test to play the worker's answers to."""

    authority = b"127.0.0.1:9"
    auth = b""

    def __init__(self) -> None:
        super().__init__()
        self.legs: list[Any] = []

    def send(self, request: bytes, leg: Any, fresh: bool = False, body: bytes | None = None) -> StubConn:
        leg.conn = StubConn()
        self.legs.append(leg)
        return leg.conn


class StubRegistry:
    """One worker as targets 0 (whole) and 1 (DP rank 3); regular and prefill pick target 0,
    decode target 1."""

    def __init__(self, record: bool = True) -> None:
        w = SimpleNamespace(
            url="http://127.0.0.1:9", host="127.0.0.1", port=9, api_key=None, bootstrap_port=8998, dp_size=1
        )
        self.target_info = [(w, None), (w, 3)]
        self.groups = {"regular": StubGroup(0, record), "prefill": StubGroup(0, record), "decode": StubGroup(1, record)}

    def ready(self) -> bool:
        return True

    def group(self, role: str) -> StubGroup:
        return self.groups[role]

    def add_listener(self, callback: Any) -> None:
        """Its targets never change: nothing to announce."""


class StandInUpstreams(Upstreams):
    """The real Upstreams (groups, routes, outcomes, retries) with every route sending through
    one stand-in pool instead of connecting."""

    def __init__(self, config: Any, registry: Any, loop: Any, pool: Pool, **kw: Any) -> None:
        self.stand_in = pool
        super().__init__(config, registry, loop, **kw)

    def pool_for(self, worker: Any, port: int | None = None) -> Pool:
        return self.stand_in


def stand_in_app(config: Any, registry: Any, loop: Any, pool: Pool, **kw: Any) -> App:
    """An App whose routes all send through ``pool`` (a PoolStandIn that records)."""
    return App(config, registry, loop, upstreams=StandInUpstreams(config, registry, loop, pool), **kw)
