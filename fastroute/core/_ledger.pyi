"""Typed API of fastroute.core._ledger: leases, the compiled picker and atomic cell access.

Arrays are the target table's int64 (rows, 16) array and its int64 header (8 cells); every entry
point checks the rows, columns and shapes it is given (IndexError / ValueError), since the
compiled code behind it runs without bounds checks.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

_Table = npt.NDArray[np.int64]
_Header = npt.NDArray[np.int64]

KINDS: dict[str, int]
"""Policy name -> compiled picker kind (every policy but cache_aware)."""

class Lease:
    """One booking of one target; ``release()`` undoes it exactly once."""

    @property
    def target(self) -> int: ...
    @property
    def tokens(self) -> int: ...
    @property
    def released(self) -> bool: ...
    def release(self) -> bool:
        """Undo the booking; True the first time, False (nothing done) afterwards."""
    def answered(self) -> bool:
        """The leg's answer ended: give the input tokens back now when the group counts them
        only until then (the request stays booked until release())."""

def book(tab: _Table, header: _Header, t: int, tokens: int, keep: Any = None) -> Lease:
    """Book target ``t`` directly; returns its Lease."""

def stress_book_release(tab: _Table, header: _Header, targets: npt.NDArray[np.int64], rounds: int, tokens: int) -> None:
    """Book then release every target ``rounds`` times without the GIL (multi-process tests)."""

class Cells:
    """Atomic access to one int64 (rows, cols) array, holding its buffer once."""

    @property
    def rows(self) -> int: ...
    @property
    def cols(self) -> int: ...
    def __init__(self, table_array: _Table, header_array: _Header | None = None) -> None:
        """With the table's header, every write is published to the pickers' load indexes."""
    def load(self, t: int, col: int) -> int: ...
    def store(self, t: int, col: int, v: int) -> None: ...
    def add(self, t: int, col: int, v: int) -> int:
        """Adds ``v``; returns the value after the addition (this caller's own result)."""
    def cas(self, t: int, col: int, expected: int, desired: int) -> bool:
        """Compare-and-swap: True if the cell held ``expected`` and now holds ``desired``."""
    def ok_closed(self, t: int) -> int:
        """A success on target ``t``: returns its circuit state; when closed, also ends a
        failure streak (table rows only)."""
    def first_where(self, col: int, value: int, start: int = 0) -> int:
        """The first row at or after ``start`` whose cell ``col`` holds ``value``, or -1."""
    def rows_where(self, col: int, value: int) -> list[int]:
        """Rows whose cell ``col`` holds ``value``."""

def store_polled(
    tab: _Table,
    t: int,
    running: int,
    waiting: int,
    tokens: int,
    max_tokens: int,
    at_ms: int,
    uncached: int = ...,
    kv_queue: int = ...,
    header: _Header | None = ...,
) -> None:
    """Store one poll of target ``t``; the poll time is written last.  With the table's
    ``header`` the row is published to the pickers' load indexes."""

def snapshot(tab: _Table, n: int) -> npt.NDArray[np.int64]:
    """Atomic-load copy of the first ``n`` rows (0 <= n <= rows)."""

def snapshot_cols(tab: _Table, n: int, cols: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
    """Atomic-load copy of the columns ``cols`` of the first ``n`` rows: (n, len(cols))."""

class NameIndex:
    """Target names (UTF-8, position i the i-th given; ValueError on a repeat) in one buffer
    (``utf8``, name i at ``utf8[at[i]:at[i + 1]]``) with a hash table of their positions, read
    by the sync's compiled code without a Python object per lookup."""

    utf8: bytes
    at: npt.NDArray[np.int64]
    def __init__(self, names: Iterable[bytes]) -> None: ...
    def find(self, name: bytes) -> int | None:
        """The position of ``name``, or None."""
    def __len__(self) -> int: ...

def sync_encode(
    tab: _Table,
    rows: npt.NDArray[np.int64],
    seen: npt.NDArray[np.int64],
    held: list[int],
    names: bytes,
    offsets: npt.NDArray[np.int64],
    out: npt.NDArray[np.uint8],
    every: bool,
) -> bytes | None:
    """The ``name\\trequests\\ttokens\\topen`` lines of the names (``rows[i]`` the one row of
    name i, ``names[offsets[i]:offsets[i + 1]]`` its UTF-8) whose requests, tokens or open
    circuit differ from ``seen[i]`` (updated in place; ``every``: of each nonzero name), written
    through ``out``; rows holding an others' estimate go to ``held``. None when ``out`` is
    shorter than ``len(names) + 64 * len(rows)`` bytes."""

def sync_decode(
    data: bytes,
    index: NameIndex,
    vals: npt.NDArray[np.int64],
    slot: int,
    mark: npt.NDArray[np.uint8],
    touched: list[int],
    add: bool,
    limit: int,
) -> tuple[int, int]:
    """Read a replica's ``name\\trequests\\ttokens\\topen`` lines into ``vals[index[name], slot]``
    (sum repeated names when ``add``, else the last wins); names first seen since ``mark`` was
    cleared are appended to ``touched``. Returns (good lines, skipped lines)."""

def sync_entries(
    reply: list[Any],
    start: int,
    seq: dict[bytes, int],
    slots: dict[bytes, int],
    whole: set[bytes],
    index: NameIndex,
    vals: npt.NDArray[np.int64],
    mark: npt.NDArray[np.uint8],
    touched: list[int],
    limit: int,
) -> tuple[list[int], int, Any]:
    """Apply the next entry (``reply[start:]``, (id, number, kind, value) each) of every peer in
    ``seq`` (not in ``whole``) holding a slot in ``slots``; entries numbered at most the last are
    passed over; the other entries (oversize, a gap, no slot) and all later ones of their peer
    are left: returns (their positions, skipped lines, a peer that sent some)."""

def sync_store(
    tab: _Table,
    header: _Header,
    vals: npt.NDArray[np.int64],
    slots: npt.NDArray[np.int64],
    names: npt.NDArray[np.int64],
    starts: npt.NDArray[np.int64],
    rows: npt.NDArray[np.int64],
    limit: int,
) -> None:
    """Store the others' sums of ``names`` over the peers' ``slots`` of ``vals`` (names, slots,
    3) into the others columns of their allocated rows ``rows[starts[n]:starts[n + 1]]``,
    publishing each row that changed to the pickers' load indexes (the table's ``header``)."""

class Picker:
    """A candidate set with its policy, compiled: ``acquire`` picks and books in one call.

    ``policy`` is a key of ``KINDS``; ``metric`` a load metric of fastroute.names; ``demand`` and
    ``kv_fit`` codes of fastroute.names.MODE_CODE.
    """

    tokens_until_answer: bool
    """Leases count their input tokens until ``Lease.answered()`` (a PD prefill leg)."""
    @property
    def demand(self) -> int: ...
    @property
    def weight(self) -> int: ...
    @property
    def shadow_agree(self) -> int: ...
    @property
    def shadow_disagree(self) -> int: ...
    @property
    def last_legacy(self) -> int:
        """Shadow demand: the policy's pick of the last request (-1 before the first)."""
    @property
    def last_demand(self) -> int:
        """Shadow demand: the demand-cost pick of the last request (-1 before the first)."""
    @property
    def kv_fit(self) -> int: ...
    @property
    def kv_reserve(self) -> int: ...
    @property
    def kv_agree(self) -> int: ...
    @property
    def kv_disagree(self) -> int: ...
    @property
    def kv_fallback(self) -> int: ...
    @property
    def coordinated_picks(self) -> int:
        """Picks planned with the synced replicas (``_policy.pick_coordinated``)."""
    @property
    def candidates(self) -> npt.NDArray[np.int64]:
        """A copy of the current candidate rows."""
    @property
    def index_rebuilds(self) -> int:
        """Times the load index was built from the rows (set, or fallen behind the feed)."""
    @property
    def coordinated_indexed(self) -> bool:
        """Whether the coordinated index is built (a synced pick over enough candidates)."""
    @property
    def coordinated_idle(self) -> bool | None:
        """The coordinated index's idle test (after reading the feed); None when not built."""
    @property
    def coordinated_rebuilds(self) -> int:
        """Times the coordinated index was built from the rows."""
    def coordinated_plan(
        self, tokens: int = 0, need: int = 0, n: int = 2, slot: int = 0, strict: bool = False
    ) -> tuple[int, list[int]] | None:
        """The synced replicas' plan from the coordinated index, as ``_policy.coordinated``;
        None when the picker keeps no such index."""
    @property
    def indexed(self) -> str | None:
        """The load index's key (least_requests, demand, kv_fit), or None: the picker scans."""
    def indexed_ties(self, need: int = 0) -> list[int] | None:
        """What the load index draws the next pick from, in candidate order: the tied minimum
        (KV fit: among the ranks where ``need`` fits, or the most free KV); None: no index."""
    def __init__(
        self,
        table_array: _Table,
        header_array: _Header,
        policy: str,
        metric: str = "tokens",
        demand: int = 0,
        weight: int = 0,
        seed: int | None = None,
        kv_fit: int = 0,
        kv_reserve: int = 0,
    ) -> None: ...
    def set_own_ledger(self, own_array: _Table | None, own_header: _Header | None = None) -> None:
        """Also book every lease in this process's private ledger (same shape as the table);
        with its header, count the feed uses of this picker's indexes there too."""
    @property
    def feed_uses(self) -> int:
        """Indexes this picker keeps (load, coordinated): each holds the header's feed on."""
    def set_candidates(self, cands: npt.ArrayLike) -> None: ...
    def set_ring(self, hashes: npt.ArrayLike, targets: npt.ArrayLike) -> None: ...
    def pick(self, tokens: int = 0, key: bytes | None = None, out_tokens: int = 0) -> int:
        """The target the policy chooses now (no booking), or -1."""
    def acquire(
        self, tokens: int = 0, key: bytes | None = None, text: object = None, out_tokens: int = 0
    ) -> Lease | None:
        """Pick and book in one call; None when no target is eligible.  ``text`` is ignored."""
    def book_target(self, t: int, tokens: int = 0) -> Lease:
        """Book a target chosen elsewhere (the cache_aware tree); returns its Lease."""

def mapped(obj: object) -> bool:
    """Whether an array's memory is still there (False once the mmap it views was closed)."""
