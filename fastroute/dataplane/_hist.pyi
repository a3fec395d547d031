"""Typed API of fastroute.dataplane._hist: the compiled histogram of the request path's metrics."""

from __future__ import annotations

from collections.abc import Iterable

class Hist:
    bounds: tuple[float, ...]
    counts: list[int]
    sum: float
    def __init__(self, bounds: Iterable[float] | None = None) -> None: ...
    def observe(self, v: float) -> None: ...
    def buckets(self) -> list[tuple[str, int]]: ...
    @property
    def count(self) -> int: ...
