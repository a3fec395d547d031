"""control.replica without a network: the payload format, the sums per target name, and what
the sync stores into the table's others columns (the Redis side is tested against a real
server in tests/integration/test_replicas.py)."""

from __future__ import annotations

import pytest

from fastroute.config import Config, ConfigError
from fastroute.control.replica import ReplicaSync, decode, default_replica_id, encode
from fastroute.core.table import (
    CIRCUIT_OPEN,
    COL_CIRCUIT,
    COL_IN_FLIGHT,
    COL_IN_FLIGHT_TOKENS,
    COL_ORDER_KEY,
    COL_OTHERS_EST,
    COL_OTHERS_EST_TOKENS,
    COL_OTHERS_IN_FLIGHT,
    COL_OTHERS_OPEN,
    COL_OTHERS_TOKENS,
    TargetTable,
)
from fastroute.names import target_name


def test_payload_round_trip_sums_per_name_and_skips_garbage():
    acc: dict[str, list[int]] = {}
    decode(encode({"http://a:1@0": (2, 300, False), "http://a:1@1": (0, 0, True)}), acc)
    decode(encode({"http://a:1@0": (1, 10, True)}) + b"bad line\nx\t1\t2\tz\n", acc)
    assert acc == {"http://a:1@0": [3, 310, 1], "http://a:1@1": [0, 0, 1]}


class _Reg:
    """The two registry members the sync reads."""

    def __init__(self, names: list[str]) -> None:
        self.target_info = [(None, i) for i in range(len(names))]
        self.names = names

    def target_name(self, t: int) -> str:
        return self.names[t]


@pytest.fixture
def tab():
    t = TargetTable(8)
    yield t
    t.unlink()


def test_local_counts_by_name_and_apply_writes_only_known_names(tab):
    names = [target_name("http://w:1", r) for r in range(3)]
    rows = [tab.alloc() for _ in names]
    sync = ReplicaSync("redis://127.0.0.1:1/0", "me", tab, _Reg(names), 0.02, 1.0)
    tab.cells.store(rows[0], COL_IN_FLIGHT, 2)
    tab.cells.store(rows[0], COL_IN_FLIGHT_TOKENS, 40)
    tab.cells.store(rows[2], COL_CIRCUIT, CIRCUIT_OPEN)
    tab.cells.store(rows[1], COL_OTHERS_IN_FLIGHT, 9)  # others' view is never republished
    assert sync.local_counts() == {names[0]: (2, 40, False), names[2]: (0, 0, True)}
    sync.apply({names[1]: [4, 80, 1], "http://elsewhere:1": [7, 7, 1]})
    got = [[tab.get(t, c) for c in (COL_OTHERS_IN_FLIGHT, COL_OTHERS_TOKENS, COL_OTHERS_OPEN)] for t in rows]
    assert got == [[0, 0, 0], [4, 80, 1], [0, 0, 0]]
    sync._clear()
    assert all(tab.get(t, COL_OTHERS_IN_FLIGHT) == 0 and tab.get(t, COL_OTHERS_OPEN) == 0 for t in rows)


def test_default_id_names_host_port_and_pid():
    host, port, pid = default_replica_id(8000).rsplit(":", 2)
    assert host and port == "8000" and int(pid) > 0


@pytest.mark.parametrize(
    "kw, flag",
    [
        (dict(replica_sync="http://r:6379"), "--replica-sync"),
        (dict(replica_sync="redis://r:6379/x"), "--replica-sync"),
        (dict(replica_sync="redis://r:6379", replica_sync_interval_ms=0), "--replica-sync-interval-ms"),
        (dict(replica_sync="redis://r:6379", replica_ttl_ms=15), "--replica-ttl-ms"),
        (dict(replica_sync="redis://r:6379", replica_id=" "), "--replica-id"),
    ],
)
def test_bad_replica_flags_name_the_flag(kw, flag):
    with pytest.raises(ConfigError) as exc:
        Config(worker_urls=["http://w:1"], **kw)
    assert exc.value.flag == flag


def test_good_replica_flags():
    c = Config(worker_urls=["http://w:1"], replica_sync="redis://r:6379/2")
    assert (c.replica_sync_interval_ms, c.replica_ttl_ms, c.replica_id) == (10, 3000, None)


def test_estimates_live_at_most_two_ticks_and_publications_replace_them(tab):
    names = [target_name("http://w:1", r) for r in range(2)]
    rows = [tab.alloc() for _ in names]
    sync = ReplicaSync("redis://127.0.0.1:1/0", "me", tab, _Reg(names), 0.02, 1.0)
    est = lambda: [tab.get(t, COL_OTHERS_EST) for t in rows]  # noqa: E731
    tab.set_replicas(3, 0)
    # the pickers expect the others to place 2 on rank 0 and 1 on rank 1 (100 tokens each)
    for t, n in zip(rows, (2, 1)):
        tab.cells.store(t, COL_OTHERS_EST, n)
        tab.cells.store(t, COL_OTHERS_EST_TOKENS, 100 * n)
    # a tick in the middle of the burst: one of rank 0's placements is published already
    sync.apply({names[0]: [1, 100, 0]})
    assert est() == [1, 1] and tab.get(rows[0], COL_OTHERS_EST_TOKENS) == 100
    assert tab.get(rows[0], COL_ORDER_KEY) > 0 and tab.get(rows[0], COL_ORDER_KEY) != tab.get(rows[1], COL_ORDER_KEY)
    # the next tick: nothing new published; what was kept last time goes now (two ticks at most)
    sync.apply({names[0]: [1, 100, 0]})
    assert est() == [0, 0] and tab.get(rows[1], COL_OTHERS_EST_TOKENS) == 0
    # a failed tick stops the planning and drops what is estimated
    tab.cells.store(rows[1], COL_OTHERS_EST, 4)
    sync._stop_coordinating()
    assert est() == [0, 0] and tab.replicas == (0, 0)
