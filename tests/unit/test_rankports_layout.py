"""The per-rank-port layout read from /server_info (fastroute.control.rankports): what counts as
a per-rank-port server, the numbers that cannot be a layout, and finding the other ports."""

from __future__ import annotations

import asyncio
import json

import pytest

from fastroute.control.rankports import RankLayoutError, find_rank_ports, layout_of, with_port


def _info(**di) -> dict:
    return {"dp_size": di.get("dp_size", 1), "deployment_info": di}


def test_a_server_without_a_rank_in_deployment_info_is_classic() -> None:
    assert layout_of({"dp_size": 8}) is None
    assert layout_of({"deployment_info": {"dp_size": 8}}) is None
    assert layout_of({"deployment_info": "not json"}) is None
    assert layout_of({"deployment_info": [1, 2]}) is None


def test_layout_of_one_rank_port() -> None:
    lay = layout_of(_info(dp_size=8, dp_rank=3, disaggregation_bootstrap_port=30000))
    assert (lay.dp_size, lay.dp_rank, lay.count, lay.first, lay.local) == (8, 3, 8, 0, 3)
    assert lay.bootstrap_port == 30000
    # deployment_info as a JSON string (how the Rust server is handed it)
    lay = layout_of({"deployment_info": json.dumps({"dp_size": 4, "dp_rank": 0})})
    assert (lay.count, lay.local, lay.bootstrap_port) == (4, 0, None)


def test_layout_on_the_second_node_of_two() -> None:
    lay = layout_of(_info(dp_size=16, dp_rank=10, nnodes=2, node_rank=1))
    assert (lay.count, lay.first, lay.local) == (8, 8, 2)


@pytest.mark.parametrize(
    "di",
    [
        {"dp_size": 4, "dp_rank": 4},
        {"dp_size": 4, "dp_rank": -1},
        {"dp_size": 0, "dp_rank": 0},
        {"dp_size": "8", "dp_rank": 1},
        {"dp_size": 8, "dp_rank": True},
        {"dp_rank": 1},
        {"dp_size": 6, "dp_rank": 1, "nnodes": 4},
        {"dp_size": 8, "dp_rank": 1, "nnodes": 2, "node_rank": 1},
    ],
)
def test_numbers_that_cannot_be_a_layout_are_refused(di: dict) -> None:
    with pytest.raises(RankLayoutError):
        layout_of({"deployment_info": di})


def test_with_port_keeps_scheme_host_and_path() -> None:
    assert with_port("http://h:30002", 30000) == "http://h:30000"
    assert with_port("https://[::1]:8443/x", 8444) == "https://[::1]:8444/x"
    assert with_port("http://h", 81) == "http://h:81"


def _ports(answers: dict[str, dict | None]):
    async def get_info(url: str):
        return answers.get(url)

    return get_info


def test_find_rank_ports_from_any_rank() -> None:
    ans = {f"http://h:{30000 + i}": _info(dp_size=4, dp_rank=i) for i in range(4)}
    lay = layout_of(ans["http://h:30002"])
    urls, ids = asyncio.run(find_rank_ports("http://h:30002", 30002, lay, _ports(ans)))
    assert urls == [f"http://h:{30000 + i}" for i in range(4)] and ids == [0, 1, 2, 3]


def test_a_port_reporting_another_rank_is_retried_not_accepted() -> None:
    ans = {f"http://h:{30000 + i}": _info(dp_size=4, dp_rank=i) for i in range(4)}
    ans["http://h:30001"] = _info(dp_size=4, dp_rank=3)
    ans["http://h:30003"] = {"dp_size": 4}
    lay = layout_of(ans["http://h:30000"])
    with pytest.raises(LookupError, match="30001.*dp_rank 3 of dp_size 4; expected dp_rank 1"):
        asyncio.run(find_rank_ports("http://h:30000", 30000, lay, _ports(ans)))


def test_rank_ports_outside_the_port_range_are_refused() -> None:
    lay = layout_of(_info(dp_size=8, dp_rank=5))
    with pytest.raises(RankLayoutError, match="1..65535"):
        asyncio.run(find_rank_ports("http://h:3", 3, lay, _ports({})))
    lay = layout_of(_info(dp_size=8, dp_rank=0))
    with pytest.raises(RankLayoutError, match="1..65535"):
        asyncio.run(find_rank_ports("http://h:65530", 65530, lay, _ports({})))
