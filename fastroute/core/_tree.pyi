"""Typed API of fastroute.core._tree: the cache_aware policy's shared prefix tree and pick."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

REASON_NONE: int
REASON_NO_TEXT: int
REASON_BALANCE: int
REASON_HIT: int
REASON_SMALLEST: int
REASON_LEAST: int

class TreeCorrupt(RuntimeError):
    """``PrefixTree.check`` found a broken structural invariant."""

class PrefixTree:
    """Radix tree of request text (UTF-8 bytes) shared by the targets of one group.

    ``array`` is the target table's int64 (rows, 24) array; it is read for eligibility
    (healthy, circuit) and in-flight counts, never written.  With the table's ``header`` a
    candidate list of 64 or more distinct rows, used twice running, is read through a load
    index fed by the header's feed instead of scanned per pick.
    """

    cache_threshold: float
    balance_abs_threshold: int
    balance_rel_threshold: float
    max_tree_size: int
    rank_slack: int
    @property
    def last_reason(self) -> int: ...
    @property
    def last_match(self) -> int:
        """Bytes matched by the last pick's longest eligible prefix."""
    @property
    def hits(self) -> int: ...
    @property
    def misses(self) -> int: ...
    @property
    def balanced(self) -> int: ...
    @property
    def evicted_bytes(self) -> int: ...
    @property
    def index_fallbacks(self) -> int:
        """Picks whose chosen row disagreed with the load index (corrected, then scanned)."""
    @property
    def indexed(self) -> bool:
        """Whether the current candidates are read through the load index (else scanned)."""
    @property
    def index_rebuilds(self) -> int:
        """Times the load index was built from the rows."""
    @property
    def node_count(self) -> int:
        """Live nodes, the root included."""
    @property
    def entry_count(self) -> int:
        """Live (node, target) holdings."""
    def __init__(
        self,
        array: np.ndarray,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_tree_size: int = 67108864,
        seed: int = 0,
        header: np.ndarray | None = None,
    ) -> None: ...
    def pick(self, text: str | bytes | None, targets: list[int]) -> int:
        """Chosen target row (text inserted under it), or -1 when none is eligible.
        ``targets`` is cached by identity: pass a new list when the set changes."""
    def choices(self, text: str | bytes | None, targets: list[int], scan: bool = False) -> tuple[int, list[int]]:
        """(reason, sorted targets) the next pick of this text may choose; draws and inserts
        nothing.  ``scan``: read the rows as the scan does even with a load index (tests)."""
    def kv_all_fit(self, targets: list[int], need: int) -> bool:
        """Whether every eligible row of ``targets`` has a known capacity with ``need`` tokens
        of KV free, from an index of their free KV (False also when that needs a scan)."""
    def kv_check(self, target: int, need: int) -> bool:
        """Whether ``target`` is eligible with ``need`` tokens free, read from its row (a
        disagreeing free-KV leaf is corrected)."""
    def match(self, text: str | bytes, targets: Sequence[int]) -> tuple[int, list[int]]:
        """(longest match in bytes, eligible targets holding it); inserts nothing."""
    def insert(self, text: str | bytes, target: int) -> None: ...
    def set_targets(self, targets: Sequence[int]) -> None:
        """Drop every target not listed; register the listed ones."""
    def drop(self, target: int) -> None: ...
    def evict(self, limit: int | None = None) -> int:
        """Evict every target down to limit bytes (default max_tree_size); bytes freed."""
    def size(self, target: int) -> int: ...
    def sizes(self) -> dict[int, int]: ...
    def clear(self) -> None: ...
    def check(self) -> dict[int, int]:
        """Check the structural invariants (TreeCorrupt on the first broken one, also under
        ``python -O``); {target: bytes} recomputed from the nodes."""
