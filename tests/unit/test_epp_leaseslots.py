"""The shared lease rows of ``--epp-mode http --workers N`` (fastroute.epp.leaseslots), two
picker processes' views over real shared memory in one test process: a lease ends exactly once
whichever process ends it, a late or repeated call ends nothing, an earlier booking of a reused
row is not this one, and a dead process's rows end before its ledger is reclaimed."""

from __future__ import annotations

from typing import Any

import pytest

from fastroute.control.leases import reclaim
from fastroute.core import _ledger
from fastroute.core.table import TargetTable
from fastroute.epp import leaseslots


class _Both:
    """A booking's lease as a picker process holds it: the table and its own ledger row."""

    def __init__(self, table: TargetTable, ledger: TargetTable, t: int, tokens: int) -> None:
        self.target, self.tokens = t, tokens
        self._in_table = _ledger.book(table.array, table.header, t, tokens)
        self._in_ledger = _ledger.book(ledger.array, ledger.header, t, tokens)

    def release(self) -> bool:
        a = self._in_ledger.release()
        b = self._in_table.release()
        return bool(a and b)


class _Booking:
    def __init__(self, lease: Any) -> None:
        self.lease = lease
        self.closed = ""

    def close(self, reason: str) -> bool:
        if self.closed:
            return False
        self.closed = reason
        lease, self.lease = self.lease, None
        if lease is not None:
            lease.release()
        return True


@pytest.fixture
def two() -> Any:
    table = TargetTable(capacity=4)
    ledgers = [TargetTable(capacity=4), TargetTable(capacity=4)]
    shm = leaseslots.create(2)
    views = [leaseslots.LeaseSlots(shm.name, p, table, [x.name for x in ledgers]) for p in range(2)]
    yield table, ledgers, shm, views
    for x in [table, *ledgers]:
        x.close()
        x.unlink()
    shm.unlink()


def _counts(table: TargetTable, ledgers: list[TargetTable], t: int) -> tuple[int, ...]:
    return (table.in_flight(t), table.in_flight_tokens(t), *(x.in_flight(t) for x in ledgers))


def test_another_process_ends_a_lease_once_and_the_owner_then_gives_back_its_slot(two: Any) -> None:
    table, ledgers, _, (p0, p1) = two
    b = _Booking(_Both(table, ledgers[0], 2, 7))
    lease_id = p0.hold(b)
    assert lease_id is not None and lease_id.startswith(b"0.")
    assert _counts(table, ledgers, 2) == (1, 7, 1, 0)
    assert p1.end(lease_id.decode()) is True  # the response headers reached process 1
    assert _counts(table, ledgers, 2) == (0, 0, 0, 0)
    assert p1.end(lease_id.decode()) is False  # a repeated call ends nothing
    assert p0.collect() == 1 and b.closed == "response_headers"  # the owner's sweep notices
    assert p0.end(lease_id.decode()) is False and p0.collect() == 0
    assert _counts(table, ledgers, 2) == (0, 0, 0, 0) and table.underflows == 0


def test_the_silence_bound_and_a_late_call_end_a_lease_once(two: Any) -> None:
    table, ledgers, _, (p0, p1) = two
    b = _Booking(_Both(table, ledgers[0], 1, 3))
    lease_id = p0.hold(b)
    b.close("silent")  # the booking process's bound, first
    assert _counts(table, ledgers, 1) == (0, 0, 0, 0)
    assert p1.end(lease_id.decode()) is False  # the response headers come late
    assert p0.collect() == 0
    assert _counts(table, ledgers, 1) == (0, 0, 0, 0) and table.underflows == 0


def test_a_reused_row_is_not_its_earlier_booking(two: Any) -> None:
    table, ledgers, _, (p0, p1) = two
    first = _Booking(_Both(table, ledgers[0], 0, 0))
    old_id = p0.hold(first).decode()
    first.close("response_headers")
    second = _Booking(_Both(table, ledgers[0], 0, 0))
    new_id = p0.hold(second).decode()
    assert new_id.rsplit(".", 1)[0] == old_id.rsplit(".", 1)[0]  # the same row, a new generation
    assert p1.end(old_id) is False and table.in_flight(0) == 1  # the earlier one's call: nothing
    for bad in ("", "x", "0.1", "9.0.1", "0.-1.1", "0.0.0", f"0.{leaseslots.SLOTS}.1"):
        assert p1.end(bad) is False
    assert p1.end(new_id) is True and table.in_flight(0) == 0


def test_a_dead_process_rows_end_before_its_ledger_is_reclaimed(two: Any) -> None:
    table, ledgers, shm, (p0, p1) = two
    held = [_Booking(_Both(table, ledgers[0], 3, 5)) for _ in range(3)]
    ids = [p0.hold(b).decode() for b in held]
    other = _Booking(_Both(table, ledgers[1], 3, 5))
    p1.hold(other)
    assert _counts(table, ledgers, 3) == (4, 20, 3, 1)
    assert leaseslots.retire(shm, 0) == 3  # process 0 died: the supervisor
    assert reclaim(table, ledgers[0]) == (3, 15)
    for lease_id in ids:  # its requests' response headers reach the survivor
        assert p1.end(lease_id) is False
    assert _counts(table, ledgers, 3) == (1, 5, 0, 1) and table.underflows == 0
    other.close("response_headers")
    assert _counts(table, ledgers, 3) == (0, 0, 0, 0)


def test_a_release_racing_the_reclaim_of_a_dead_process_subtracts_the_table_once(two: Any) -> None:
    """Process 1 wins the row of process 0's lease; before it subtracts, process 0 dies and the
    supervisor gives its whole ledger (this lease included) back to the table. Process 1 then
    finds the ledger empty and leaves the table alone: subtracting it again would take process
    1's own request off the count."""
    table, ledgers, _, (p0, p1) = two
    lease_id = p0.hold(_Booking(_Both(table, ledgers[0], 2, 4))).decode()
    mine = _Booking(_Both(table, ledgers[1], 2, 6))
    p1.hold(mine)
    assert _counts(table, ledgers, 2) == (2, 10, 1, 1)
    assert reclaim(table, ledgers[0]) == (1, 4)  # the supervisor, between the CAS and the subtraction
    assert p1.end(lease_id) is True
    assert _counts(table, ledgers, 2) == (1, 6, 0, 1) and table.underflows == 0
    mine.close("response_headers")
    assert _counts(table, ledgers, 2) == (0, 0, 0, 0)


def test_a_full_process_takes_back_rows_another_process_ended_before_refusing(two: Any) -> None:
    table, ledgers, _, (p0, p1) = two
    ids = [p0.hold(_Booking(_Both(table, ledgers[0], 1, 0))) for _ in range(leaseslots.SLOTS)]
    assert all(i is not None for i in ids)
    assert p1.end(ids[0].decode()) is True  # its response headers reached the other process
    late = _Booking(_Both(table, ledgers[0], 1, 0))
    assert p0.hold(late) is not None  # the ended lease's row, not 503 lease_rows_full
    assert p0.hold(_Booking(_Both(table, ledgers[0], 1, 0))) is None  # truly full now


def test_every_http_mode_bootstrap_carries_the_lease_namespace_back() -> None:
    """A bootstrap printed without --workers still brings the lease id back: a picker then run
    with --workers N would otherwise hold every lease until the silence bound."""
    from fastroute.epp.bootstrap import LEASE_NAMESPACE, envoy_bootstrap

    for processes in (1, 2):
        printed = envoy_bootstrap(9002, 8080, processes=processes, mode="http")
        assert printed.count(LEASE_NAMESPACE) == 2, processes  # received and forwarded
    assert LEASE_NAMESPACE not in envoy_bootstrap(9002, 8080, processes=2)  # gRPC mode: no lease ids
