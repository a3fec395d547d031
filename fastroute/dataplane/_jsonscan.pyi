"""Typed API of fastroute.dataplane._jsonscan: the structural scan of a request body's top-level
keys (the fast path of fields.FieldPicker.pick; see the module docstring for what it leaves
undecided)."""

from __future__ import annotations

from typing import Any

class FieldScan:
    """The scan of one endpoint's read keys (fields.READ_FIELDS)."""

    names: tuple[str, ...]
    keys: tuple[bytes, ...]
    messages_at: int
    ids_at: int
    def __init__(self, names: tuple[str, ...]) -> None: ...
    def scan(self, body: bytes) -> dict[str, Any] | None: ...

class Chat:
    """A chat body's messages when every content is absent, null or a plain ASCII string."""

    @property
    def count(self) -> int: ...
    @property
    def tokens(self) -> int: ...
    def routing_text(self) -> str | None: ...

class Ids:
    """/generate's input_ids when a flat array of non-negative integers: kept as its bytes."""

    @property
    def count(self) -> int: ...
    def __len__(self) -> int: ...
    def tolist(self) -> list[int]: ...
    def text(self, limit: int) -> str | None: ...

def use_avx2(on: bool) -> bool: ...
