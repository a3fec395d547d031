"""``fastroute epp --epp-mode http --workers N``: leases that any picker process can end.

In HTTP mode Envoy makes one POST per processing step (:mod:`fastroute.epp.httpmode`), each on
whatever connection of its pool is free, and the kernel spreads those connections over the picker
processes: the response-headers call that ends a request's lease may reach another process than
the one that booked it. So the booking process names the lease in the answer's dynamic metadata
(namespace :data:`NAMESPACE`, key :data:`KEY`: ``process.index.generation``) and the printed
bootstrap forwards that namespace back with the response headers (observed with Envoy 1.40's
``http_service``: the second POST carries it in ``metadata_context``; no client can set it).

The leases live in one shared-memory array (:func:`create`, made by the supervisor), a region of
:data:`SLOTS` rows per picker process: ``[state, target, tokens]``. ``state`` is
``2 * generation + 1`` while held and ``2 * generation`` once ended; a row's generation grows with
each booking, so a late or repeated call for an earlier booking of the row matches nothing. Ending a
lease is one compare-and-swap of ``state`` from held to ended: whoever wins (the response-headers
call in any process, the booking process's silence bound or safety net, its shutdown) subtracts the
booking from the table and from the booking process's ledger row, in the order
:class:`~fastroute.core._ledger.Lease` uses (own ledger first); the others do nothing. So a lease
ends exactly once and the per-process ledgers stay exact for the supervisor's reclaim.

Only the booking process allocates rows in its region, from a local free list; a row goes back to
it when the local booking is closed. A booking ended by another process keeps its admission slot
(``--max-concurrent-requests``, per process) until the booking process collects it
(:meth:`LeaseSlots.collect`): when a new request finds admission full, or at the next sweep
(at most ``SWEEP_EVERY`` later) for a request already queued. When a picker process dies the
supervisor ends every held row of its region (:func:`retire`) before subtracting its ledger, so
a late response-headers call for one of them finds nothing to release.
"""

from __future__ import annotations

import re
from multiprocessing import shared_memory
from typing import Any

import numpy as np

from fastroute.core._ledger import Cells
from fastroute.core.table import (
    COL_IN_FLIGHT,
    COL_IN_FLIGHT_TOKENS,
    HDR_UNDERFLOWS,
    NHDR,
    TargetTable,
    _attach_untracked,
)
from fastroute.epp.bootstrap import LEASE_NAMESPACE
from fastroute.epp.httpmode import _RESPONSE_HEADERS, HttpProcessor, _json
from fastroute.epp.service import immediate
from fastroute.errors import RouterError

NAMESPACE = LEASE_NAMESPACE  # dynamic metadata namespace the picker sets and Envoy forwards
KEY = "id"
SLOTS = 1 << 14  # lease rows per picker process: requests one process may hold at once
_STATE, _TARGET, _TOKENS = 0, 1, 2
# The lease's id in a response-headers call's forwarded metadata, found without a JSON parse.
_LEASE_ID = re.compile(rb'"%s"\s*:\s*\{\s*"%s"\s*:\s*"([0-9.]{5,40})"' % (re.escape(NAMESPACE.encode()), KEY.encode()))
_COLS = 4


def create(processes: int) -> shared_memory.SharedMemory:
    """The supervisor's shared lease rows for ``processes`` picker processes (all ended)."""
    shm = shared_memory.SharedMemory(create=True, size=processes * SLOTS * _COLS * 8)
    np.ndarray((processes * SLOTS, _COLS), np.int64, buffer=shm.buf)[:] = 0
    return shm


def _rows(shm: shared_memory.SharedMemory) -> tuple[np.ndarray, Cells]:
    arr = np.ndarray((shm.size // (_COLS * 8), _COLS), np.int64, buffer=shm.buf)
    return arr, Cells(arr)


def retire(shm: shared_memory.SharedMemory, process: int) -> int:
    """End every held row of a dead picker process's region (the supervisor, before it
    subtracts that process's ledger) -> how many were held."""
    arr, cells = _rows(shm)
    n = 0
    base = process * SLOTS
    for i in np.flatnonzero(arr[base : base + SLOTS, _STATE] & 1).tolist():
        while True:
            state = cells.load(base + i, _STATE)
            if not state & 1 or cells.cas(base + i, _STATE, state, state - 1):
                break
        n += 1
    del arr
    return n


def _take(cells: Cells, t: int, col: int, v: int) -> bool:
    """Subtract ``v`` from a cell unless it would go below zero (False: nothing applied)."""
    while True:
        cur = cells.load(t, col)
        if cur < v:
            return False
        if cells.cas(t, col, cur, cur - v):
            return True


class _SlotLease:
    """What a booking holds in place of its :class:`~fastroute.core._ledger.Lease`: ``release()``
    ends the lease only if this process wins the row's compare-and-swap."""

    __slots__ = ("_owner", "_index", "_gen", "_lease", "target")

    def __init__(self, owner: LeaseSlots, index: int, gen: int, lease: Any) -> None:
        self._owner = owner
        self._index = index
        self._gen = gen
        self._lease = lease
        self.target = lease.target

    def release(self) -> bool:
        lease, self._lease = self._lease, None
        if lease is None:
            return False
        owner = self._owner
        won = owner._cells.cas(owner._base + self._index, _STATE, 2 * self._gen + 1, 2 * self._gen)
        owner._mine.pop(self._index, None)
        owner._free.append(self._index)
        # Lost: another process ended it (table and this ledger already subtracted).
        return bool(lease.release()) if won else False

    @property
    def ended(self) -> bool:
        owner = self._owner
        return owner._cells.load(owner._base + self._index, _STATE) != 2 * self._gen + 1


class LeaseSlots:
    """One picker process's view of the shared lease rows (see module docstring)."""

    def __init__(self, name: str, process: int, table: TargetTable, ledgers: list[str]) -> None:
        self._shm = _attach_untracked(name)
        self._arr, self._cells = _rows(self._shm)
        self._process = process
        self._base = process * SLOTS
        self._table = table
        self._header = Cells(table.header.reshape(1, NHDR))
        self._ledgers = [TargetTable.attach(x) for x in ledgers]
        self._free = list(range(SLOTS - 1, -1, -1))
        self._mine: dict[int, Any] = {}  # row index -> the booking holding it

    def hold(self, booking: Any) -> bytes | None:
        """Put ``booking``'s lease in a row of this process -> the lease's id for the
        metadata; None when all rows are taken (the caller refuses the request)."""
        if not self._free:
            self.collect()  # rows whose lease another process ended come back first
            if not self._free:
                return None
        i = self._free.pop()
        lease = booking.lease
        row = self._base + i
        gen = (self._cells.load(row, _STATE) >> 1) + 1
        self._cells.store(row, _TARGET, int(lease.target))
        self._cells.store(row, _TOKENS, int(lease.tokens))
        self._cells.store(row, _STATE, 2 * gen + 1)  # held: from now on any process may end it
        booking.lease = _SlotLease(self, i, gen, lease)
        self._mine[i] = booking
        return b"%d.%d.%d" % (self._process, i, gen)

    def end(self, lease_id: Any) -> bool:
        """End the lease a response-headers call names, whichever process booked it; True
        when this call ended it (False: malformed, unknown, or ended already)."""
        try:
            process, i, gen = (int(x) for x in str(lease_id).split("."))
        except ValueError:
            return False
        if not (0 <= process < len(self._ledgers) and 0 <= i < SLOTS and gen > 0):
            return False
        if process == self._process:
            booking = self._mine.get(i)
            if booking is None or booking.lease is None or booking.lease._gen != gen:
                return False
            held = not booking.lease.ended
            booking.close("response_headers")
            return held
        row = process * SLOTS + i
        if not self._cells.cas(row, _STATE, 2 * gen + 1, 2 * gen):
            return False
        target = self._cells.load(row, _TARGET)
        tokens = self._cells.load(row, _TOKENS)
        ledger = self._ledgers[process].cells
        table = self._table.cells
        # Lease.release's order: the booking process's ledger, then the table. A ledger that no
        # longer holds it was reclaimed (its process died): the supervisor gave that whole
        # ledger back to the table then, so the table is not touched again. A table count found
        # at zero is not applied (nor its tokens) and is counted as an underflow.
        if not _take(ledger, target, COL_IN_FLIGHT, 1):
            return True
        _take(ledger, target, COL_IN_FLIGHT_TOKENS, tokens)
        if not _take(table, target, COL_IN_FLIGHT, 1) or not _take(table, target, COL_IN_FLIGHT_TOKENS, tokens):
            self._header.add(0, HDR_UNDERFLOWS, 1)
        return True

    def collect(self) -> int:
        """Close this process's bookings whose lease another process ended (their admission
        slots and rows come back) -> how many."""
        done = [b for b in self._mine.values() if b.lease is not None and b.lease.ended]
        for b in done:
            b.close("response_headers")
        return len(done)

    def close(self) -> None:
        """End this process's leases (shutdown). The mappings stay until the process exits: a
        call still arriving on an open connection finds them."""
        for b in list(self._mine.values()):
            b.close("shutdown")


class SharedHttpProcessor(HttpProcessor):
    """The ``--epp-mode http`` listener of one picker process of ``--workers N``: the lease
    rides in the answer's metadata and comes back with the response headers, wherever they
    arrive (see module docstring)."""

    def __init__(self, decider: Any, slots: LeaseSlots) -> None:
        super().__init__(decider)
        self._slots = slots

    def _hold(self, rid: str, booking: Any, pick: Any) -> bytes:
        lease_id = self._slots.hold(booking)
        if lease_id is None:
            booking.close("refused")
            err = RouterError(503, "lease_rows_full", f"this picker process holds {SLOTS} requests already")
            return _json(immediate(err))
        answer = self._routed(pick)  # ...,"dynamic_metadata":{"envoy.lb":{...}}}
        return answer[:-2] + b',"%s":{"%s":"%s"}}}' % (NAMESPACE.encode(), KEY.encode(), lease_id)

    def _released(self, rid: str, body: bytes) -> bytes | None:
        hit = _LEASE_ID.search(body)
        if hit is None:
            return None  # parsed instead (_other)
        self._slots.end(hit.group(1).decode())
        return _RESPONSE_HEADERS

    def _other(self, rid: str, doc: dict[str, Any]) -> bytes:
        if "response_headers" in doc:
            ns = doc.get("metadata_context", {}).get("filter_metadata", {}).get(NAMESPACE)
            if isinstance(ns, dict) and KEY in ns:
                self._slots.end(ns[KEY])
            return _RESPONSE_HEADERS
        return b"{}"

    def forget_closed(self) -> None:
        self._slots.collect()

    def _freed(self) -> bool:
        # A lease another process ended keeps its admission slot until collected: at the
        # sweep, or here, when a new request finds admission full.
        return self._slots.collect() > 0

    async def stop(self) -> None:
        await super().stop()
        self._slots.close()
