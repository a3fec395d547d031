"""A replica-sync participant for the tests that run several against a real redis-server: its
own table of ``n`` allocated rows and a ReplicaSync naming them as a registry would."""

from __future__ import annotations

from fastroute.control.replica import ReplicaSync
from fastroute.core.table import TargetTable


class Targets:
    """A registry's naming of rows (what the sync reads of it): DP-8 servers on ``net``."""

    def __init__(self, n: int, net: str) -> None:
        self.target_info = [("w", r) for r in range(n)]
        self.background = None
        self.net = net

    def target_name(self, t: int) -> str:
        return f"http://{self.net}.{t // 8}:30000@{t % 8}"


class Replica:
    def __init__(self, url: str, rid: str, interval: float, ttl: float, n: int, net: str) -> None:
        self.table = TargetTable(n)
        for _ in range(n):
            self.table.alloc()
        self.sync = ReplicaSync(url, rid, self.table, Targets(n, net), interval, ttl)

    async def close(self) -> None:
        await self.sync.stop()
        self.table.close()
        self.table.unlink()
