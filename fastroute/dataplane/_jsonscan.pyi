"""Typed API of fastroute.dataplane._jsonscan: the structural scan of a request body's top-level
keys (the fast path of fields.FieldPicker.pick; see the module docstring for what it leaves
undecided)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

def scan_fields(
    body: bytes,
    keys: tuple[bytes, ...],
    names: tuple[str, ...],
    messages_at: int = -1,
    message: Callable[[Any], Any] | None = None,
) -> dict[str, Any] | None: ...

class Chat:
    """A chat body's messages when every content is absent, null or a plain ASCII string."""

    @property
    def count(self) -> int: ...
    @property
    def tokens(self) -> int: ...
    def __len__(self) -> int: ...
    def routing_text(self) -> str | None: ...
