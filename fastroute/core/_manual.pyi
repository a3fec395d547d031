"""Typed API of fastroute.core._manual: the ``manual`` policy's routing-key table.

``tab`` is the target table's int64 (rows, 16) array (read only) and ``cands`` the group's
int64 candidate rows.  ``mode`` is a code of fastroute.names.ASSIGNMENT_MODE_CODE (random,
min_load, min_group).  Times are monotonic seconds.  A pick returns a target row, or -1 when no
candidate is eligible (healthy, circuit not open).  fastroute.core.reference.ManualKeys is the
NumPy/Python twin.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

_Table = npt.NDArray[np.int64]
_Rows = npt.NDArray[np.int64]

class KeyTable:
    mode: int
    max_idle: float
    sweep_every: float
    count: int
    reassigned: int
    max_keys: int
    evicted: int
    capacity: int
    def __init__(self, rows: int, mode: int, max_idle: float, sweep_every: float, seed: int, max_keys: int = 0) -> None:
        """``rows``: the table's row count; keys idle over ``max_idle`` s (<= 0: never) are
        dropped by a sweep run from a pick at most every ``sweep_every`` s; past ``max_keys``
        stored keys (0: no bound) the least recently used eighth is evicted."""
    def pick(self, tab: _Table, cands: _Rows, key: bytes | None, now: float) -> int:
        """The target for ``key`` at ``now`` (None: keyless, placed by the mode, not stored);
        arguments checked (ValueError / IndexError)."""
    def bind(self, tab: _Table, cands: _Rows) -> None:
        """Fix the table and candidates of ``pick_bound`` (checked once) and sweep out keys whose
        target is not in ``cands``."""
    def pick_bound(self, key: bytes | None) -> int:
        """``pick`` over the bound table and candidates at the monotonic clock (per request)."""
    def sweep(self, cands: _Rows, now: float) -> None:
        """Drop idle keys and keys whose target is not in ``cands``."""
    def owner_of(self, key: bytes) -> int:
        """The target ``key`` is assigned to, or -1."""
    def keys_of(self, t: int) -> int:
        """How many keys target ``t`` holds."""
