"""The target table: one row of int64 counters per target, in shared memory.

A *target* is a worker, or one DP rank of a worker under ``--dp-aware``.  The supervisor creates
the table; proxy processes attach it by name, so every pick sees every process's bookings.  Rows
are 24 cells (192 bytes, three cache lines).  Every read and write of a shared cell goes through the
compiled atomics (``fastroute.core._ledger``); the NumPy view is handed to compiled code only.

Layout constants mirror ``fastroute/core/_layout.pxd``; ``tests/unit/test_table.py`` checks that
every constant exists on both sides with the same value.
"""

from __future__ import annotations

import os
import time
from multiprocessing import resource_tracker, shared_memory

import numpy as np

from fastroute.core import _ledger

# The values of COL_CIRCUIT, re-exported beside the column they describe.
from fastroute.names import CIRCUIT_CLOSED, CIRCUIT_HALF_OPEN, CIRCUIT_OPEN  # noqa: F401

COL_IN_FLIGHT = 0
COL_IN_FLIGHT_TOKENS = 1
COL_POLLED_RUNNING = 2
COL_POLLED_WAITING = 3
COL_POLLED_TOKENS = 4
COL_POLLED_AT = 5
COL_HEALTHY = 6
COL_PICKS = 7
COL_CIRCUIT = 8
COL_POLLED_MAX_TOKENS = 9
COL_ALLOCATED = 10
COL_TOKENS_AT_POLL = 11
COL_CB_FAILS = 12  # breaker cells (fastroute.core.breaker): consecutive failures,
COL_CB_OKS = 13  # successes since half-open,
COL_CB_OPENED_AT = 14  # monotonic microseconds of the last opening
COL_OTHERS_OPEN = 15  # the other router replicas' view (fastroute.control.replica):
COL_OTHERS_IN_FLIGHT = 16  # circuit open at one of them, their requests and input tokens
COL_OTHERS_TOKENS = 17  # in flight here; zero without --replica-sync
COL_OTHERS_EST = 18  # coordination of synced replicas: the others' estimated
COL_OTHERS_EST_TOKENS = 19  # placements since the last sync (requests, input tokens) and
COL_ORDER_KEY = 20  # the tie-break order they share (hash of the target name)
COL_POLLED_UNCACHED = 21  # a prefill's polled uncached tokens waiting (-1 unknown)
COL_POLLED_KV_QUEUE = 22  # a decode's polled prealloc + retracted queue requests
COL_POLLED_MAX_RUNNING = 23  # a rank's polled max_running_requests, 0 unknown (flow control)
NCOLS = 24

HDR_MAGIC = 0
HDR_CAPACITY = 1
HDR_UNDERFLOWS = 2
HDR_GENERATION = 3
HDR_REPLICAS = 4  # live synced replicas, this one included (0/1: alone)
HDR_REPLICA_SLOT = 5  # this replica's place among them
HDR_SYNC_TICKS = 6  # successful sync ticks
HDR_FEED_ON = 7  # indexes pickers keep (core/_index.pxd, _coindex.pxd): writers publish while > 0
HDR_FEED_AT = 8  # rows published so far
HDR_FEED = 16  # the feed ring of rows published: (position << HDR_FEED_ROW_BITS) | row
HDR_FEED_SLOTS = 4096
HDR_FEED_ROW_BITS = 24
NHDR = HDR_FEED + HDR_FEED_SLOTS

MAGIC = 0x66726F7574653032  # "frout02" in ASCII (02: the header holds the load index feed)

# Rows of a table by default (--max-targets): 1,000 servers of 8 DP ranks each, with room.
DEFAULT_CAPACITY = 8192
SHM_DIR = "/dev/shm"  # where POSIX shared memory lives on Linux


def table_bytes(capacity: int) -> int:
    """Bytes of one table segment of ``capacity`` rows (header included)."""
    return (NHDR + capacity * NCOLS) * 8


def shm_available() -> int | None:
    """Bytes free for shared memory segments now, or None where that cannot be told."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


class TableMemoryError(MemoryError):
    """The shared memory a table needs cannot be had (the message says how much)."""


def _attach_untracked(name: str) -> shared_memory.SharedMemory:
    """Map an existing segment without registering it with this process's resource tracker.

    Only the creator owns the table: its tracker registration is the safety net that removes the
    segment if the creator is killed.  Python < 3.13 registers attached segments too, so an
    attaching process would unlink the table when it exits — and unregistering afterwards is
    wrong for processes started by multiprocessing, which share the creator's tracker."""
    try:
        return shared_memory.SharedMemory(name=name, create=False, track=False)  # type: ignore[call-arg]  # 3.13+
    except TypeError:
        pass
    register = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None
    try:
        return shared_memory.SharedMemory(name=name, create=False)
    finally:
        resource_tracker.register = register


class TargetTable:
    """Shared-memory table of targets (see module docstring)."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, name: str | None = None, create: bool = True) -> None:
        if create:
            if capacity < 1:
                raise ValueError("capacity must be >= 1")
            size = table_bytes(capacity)
            # A tmpfs segment is sized without being backed: writing pages past what the
            # mount has free would kill the process with SIGBUS, so ask first.
            free = shm_available()
            if free is not None and size > free:
                raise TableMemoryError(
                    f"a table of {capacity} targets needs {size} bytes of shared memory; {SHM_DIR} has {free} free"
                )
            if name is None:
                name = f"fastroute-{os.getpid()}-{os.urandom(4).hex()}"
            try:
                self._shm = shared_memory.SharedMemory(name=name, create=True, size=size)
            except OSError as exc:
                raise TableMemoryError(
                    f"a table of {capacity} targets ({size} bytes of shared memory) cannot be created: {exc}"
                ) from None
        else:
            if name is None:
                raise ValueError("attaching needs the table's name")
            self._shm = _attach_untracked(name)
            hdr = np.ndarray((min(NHDR, self._shm.size // 8),), np.int64, buffer=self._shm.buf)
            if hdr.shape[0] < NHDR or int(hdr[HDR_MAGIC]) != MAGIC:
                del hdr
                self._shm.close()
                raise ValueError(f"shared memory {name!r} is not a fastroute target table")
            capacity = int(hdr[HDR_CAPACITY])
            del hdr
        self.name: str = self._shm.name
        self.capacity = capacity
        self.owner = create
        self._free_from = 0  # no free row below this one (alloc's search starts here)
        self.header = np.ndarray((NHDR,), dtype=np.int64, buffer=self._shm.buf)
        # Atomic accessors holding the buffers once (no buffer setup per call).
        self._hcells = _ledger.Cells(self.header.reshape(1, NHDR))
        self.array = np.ndarray((capacity, NCOLS), dtype=np.int64, buffer=self._shm.buf, offset=NHDR * 8)
        # Writes through it are published to the pickers' load indexes (the header's feed).
        self.cells = _ledger.Cells(self.array, self.header)
        if create:
            self.array[:] = 0
            self.array[:, COL_POLLED_AT] = -1
            self.array[:, COL_POLLED_MAX_TOKENS] = -1
            self.header[:] = 0
            self.header[HDR_FEED:] = -1  # no notice written yet at any position of the feed
            self.header[HDR_CAPACITY] = capacity
            self.header[HDR_MAGIC] = MAGIC

    @classmethod
    def attach(cls, name: str) -> TargetTable:
        return cls(name=name, create=False)

    # ---- rows (control plane: the supervisor allocates, never the hot path) ----------------------
    def alloc(self) -> int:
        """The lowest free row, reset: healthy, nothing in flight, never polled.  The search is
        compiled and starts past the rows known taken, so filling a table of N rows costs O(N)
        loads, not O(N^2) Python calls."""
        t = self.cells.first_where(COL_ALLOCATED, 0, self._free_from)
        if t < 0:
            raise RuntimeError(f"target table full ({self.capacity} targets; raise --max-targets)")
        for c in range(NCOLS):
            self.cells.store(t, c, 0)
        self.cells.store(t, COL_POLLED_AT, -1)
        self.cells.store(t, COL_POLLED_MAX_TOKENS, -1)
        self.cells.store(t, COL_HEALTHY, 1)
        self.cells.store(t, COL_ALLOCATED, 1)
        self._free_from = t + 1
        self.bump_generation()
        return t

    def free(self, t: int) -> None:
        self.cells.store(t, COL_HEALTHY, 0)
        self.cells.store(t, COL_ALLOCATED, 0)
        self._free_from = min(self._free_from, t)
        self.bump_generation()

    # ---- writers ------------------------------------------------------------------------------
    def set_polled(
        self,
        t: int,
        running: int,
        waiting: int,
        tokens: int,
        max_tokens: int = -1,
        uncached: int = -1,
        kv_queue: int = 0,
    ) -> None:
        _ledger.store_polled(
            self.array,
            t,
            int(running),
            int(waiting),
            int(tokens),
            int(max_tokens),
            int(time.time() * 1000),
            int(uncached),
            int(kv_queue),
            self.header,
        )

    def set_kv_queue(self, t: int, kv_queue: int) -> None:
        """Only the polled decode KV queue of ``t`` (its other loads are pushed by the engine)."""
        self.cells.store(t, COL_POLLED_KV_QUEUE, int(kv_queue))

    def rank_load(self, t: int) -> tuple[int, int, int, int, int, int, int]:
        """What flow control's saturation gate reads of ``t`` (the data plane imports no core
        module): (healthy, polled at or -1, waiting, used tokens, max tokens, uncached tokens,
        max_running_requests)."""
        c = self.cells
        return (
            c.load(t, COL_HEALTHY),
            c.load(t, COL_POLLED_AT),
            c.load(t, COL_POLLED_WAITING),
            c.load(t, COL_POLLED_TOKENS),
            c.load(t, COL_POLLED_MAX_TOKENS),
            c.load(t, COL_POLLED_UNCACHED),
            c.load(t, COL_POLLED_MAX_RUNNING),
        )

    def set_max_running(self, t: int, n: int) -> None:
        """The running-batch limit ``t`` reports (0: unknown); flow control's capacity."""
        self.cells.store(t, COL_POLLED_MAX_RUNNING, int(n))

    def mark_unpolled(self, t: int) -> None:
        """The last poll failed or had no entry for this target: its load is unknown, not zero."""
        self.cells.store(t, COL_POLLED_AT, -1)

    def set_healthy(self, t: int, ok: bool) -> None:
        self.cells.store(t, COL_HEALTHY, 1 if ok else 0)

    def set_replicas(self, n: int, slot: int) -> None:
        """Synced replicas live (this one included) and this one's place among them; n <= 1
        turns the coordinated pick off."""
        self._hcells.store(0, HDR_REPLICAS, int(n))
        self._hcells.store(0, HDR_REPLICA_SLOT, int(slot))

    @property
    def feed_uses(self) -> int:
        """Load indexes kept over this table (HDR_FEED_ON): writers publish rows while > 0."""
        return self._hcells.load(0, HDR_FEED_ON)

    def give_back_feed_uses(self, n: int) -> None:
        """Subtract ``n`` feed uses a dead process's pickers held (its ledger's count)."""
        self._hcells.add(0, HDR_FEED_ON, -int(n))

    def count_sync_tick(self) -> None:
        self._hcells.add(0, HDR_SYNC_TICKS, 1)

    @property
    def replicas(self) -> tuple[int, int]:
        return self._hcells.load(0, HDR_REPLICAS), self._hcells.load(0, HDR_REPLICA_SLOT)

    def bump_generation(self) -> None:
        """Tell every attached process the target set changed (they poll the generation)."""
        self._hcells.add(0, HDR_GENERATION, 1)

    def set_circuit(self, t: int, state: int) -> None:
        self.cells.store(t, COL_CIRCUIT, int(state))

    # ---- readers ------------------------------------------------------------------------------
    def get(self, t: int, col: int) -> int:
        return self.cells.load(t, col)

    def in_flight(self, t: int) -> int:
        return self.cells.load(t, COL_IN_FLIGHT)

    def in_flight_tokens(self, t: int) -> int:
        return self.cells.load(t, COL_IN_FLIGHT_TOKENS)

    def snapshot(self, n: int | None = None) -> np.ndarray:
        return _ledger.snapshot(self.array, self.capacity if n is None else n)

    @property
    def underflows(self) -> int:
        return self._hcells.load(0, HDR_UNDERFLOWS)

    @property
    def generation(self) -> int:
        return self._hcells.load(0, HDR_GENERATION)

    # ---- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Drop this process's mapping.  Compiled pickers may still hold views; then the mapping
        stays until they are gone (the segment itself is removed by unlink())."""
        self.array = None
        self.header = None
        self.cells = None  # type: ignore[assignment]
        self._hcells = None  # type: ignore[assignment]  # closed: no reader is left
        try:
            self._shm.close()
        except BufferError:
            pass

    def unlink(self) -> None:
        """Remove the segment name (creator only); idempotent."""
        try:
            self._shm.unlink()
        except FileNotFoundError:
            pass

    def __enter__(self) -> TargetTable:
        return self

    def __exit__(self, *exc) -> None:
        if self.owner:
            self.unlink()
        self.close()
