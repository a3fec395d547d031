"""Typed API of fastroute.core._policy: the policy kernels' Python wrappers (tests and the
differential comparison with fastroute.core.reference), the ring hash and the compiled layout.

Every wrapper takes the target table's int64 (rows, 16) array, read only, and int64 candidate
rows; it checks the table width and every row it is given (IndexError / ValueError) before the
unchecked kernel runs.  ``state`` is the RNG state, a numpy uint64 array of shape (1,), advanced
in place exactly as ``reference.Rng`` advances.  A kernel returns a target row, or -1 when no
candidate is eligible (healthy, circuit not open).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

_Table = npt.NDArray[np.int64]
_Rows = npt.NDArray[np.int64]
_State = npt.NDArray[np.uint64]

def round_robin(tab: _Table, cands: _Rows, cursor: npt.NDArray[np.int64]) -> int:
    """Next eligible candidate from ``cursor[0]`` on; advances the cursor (shape (1,), >= 0)."""

def random_pick(tab: _Table, cands: _Rows, state: _State) -> int: ...
def power_of_two(tab: _Table, cands: _Rows, metric: int, state: _State) -> int:
    """``metric`` is a code of fastroute.names.LOAD_METRIC_CODE."""

def demand(tab: _Table, cands: _Rows, tokens: int, weight: int, state: _State) -> int:
    """Least in-flight tokens + ``tokens`` + ``weight`` x requests held."""

def kv_fit(tab: _Table, cands: _Rows, tokens: int, need: int, use_demand: bool, weight: int, state: _State) -> int:
    """The pick among ranks where ``need`` more KV tokens fit; -2 when no rank's capacity is
    known."""

def coordinated(
    tab: _Table,
    cands: _Rows,
    tokens: int,
    need: int,
    use_demand: bool,
    weight: int,
    kv: bool,
    n: int,
    slot: int,
    strict: bool = ...,
) -> tuple[int, list[int]]:
    """Synced replicas: (this replica's pick, the plan of the next ``n`` placements)."""

def narrow(
    tab: _Table, cands: _Rows, tokens: int, need: int, kv_mode: int, demand_mode: int, weight: int
) -> tuple[list[int] | None, list[int] | None, list[int] | None, bool]:
    """cache_aware's candidate filter, KV fit then demand: (the candidates the tree chooses
    among or None for all, the KV-fit set or None, the demand ties or None, no capacity known)."""

def free_kv(tab: _Table, t: int) -> int | None:
    """Estimated free KV tokens of target t, or None when its capacity is unknown."""

def ring_lookup(tab: _Table, ring_hash: npt.NDArray[np.uint64], ring_target: _Rows, key: int) -> int:
    """First eligible target clockwise from ``key`` on the sorted ring."""

def hash64(data: bytes) -> int:
    """64-bit hash of a byte string (ring positions and routing keys)."""

def layout() -> dict[str, int]:
    """Every constant of _layout.pxd and _policy.pxd as compiled: COL_*, NCOLS, HDR_*, NHDR,
    CIRCUIT_*, METRIC_* and MODE_*."""
