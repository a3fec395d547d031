"""Stand-ins for the routing layer in proxy tests that use a mock transport (no sockets, no
compiled table): one copy, so a change to Group.acquire's signature is made once."""
from __future__ import annotations


class StubLease:
    """Counts its releases; ``release()`` is True only the first time, like the real Lease."""

    def __init__(self, target: int = 0) -> None:
        self.target = target
        self.tokens = 0
        self.releases = 0

    def release(self) -> bool:
        self.releases += 1
        return self.releases == 1


class StubGroup:
    """Always picks ``target``; keeps the leases it handed out when ``record`` (tests check
    them), not in benchmarks (memory would grow with the rounds)."""

    policy = "round_robin"

    def __init__(self, target: int = 0, record: bool = True) -> None:
        self.target = target
        self.record = record
        self.leases: list[StubLease] = []

    def acquire(self, tokens: int = 0, key: bytes | None = None, meta: object = None,
                out_tokens: int = 0) -> StubLease:
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
