"""The balance benchmark's envoy+epp front (fastroute.sim.gateway): the picker, the sidecar and
the printed bootstrap are given the same workers and rank flags, so the rank names the picker
books are the ones the sidecar serves."""

from __future__ import annotations

from fastroute.epp.options import split
from fastroute.sim.balance import gateway_cells
from fastroute.sim.gateway import GatewayFront

PD = ["--pd-disaggregation", "--prefill", "http://127.0.0.1:1", "2", "--decode", "http://127.0.0.1:3"]
POLICY = ["--policy", "power_of_two", "--p2c-load-metric", "least_requests"]


def _after(cmd: list[str], word: str) -> list[str]:
    return cmd[cmd.index(word) + 1 :]


def test_picker_sidecar_and_bootstrap_agree() -> None:
    g = GatewayFront("python3", PD, POLICY, 8080, 9090, "/tmp/x")
    epp_opts, epp_rest = split(_after(g.epp, "epp"))
    print_opts, print_rest = split(_after(g.print_cmd, "epp"))
    assert epp_opts.sidecar_port == print_opts.sidecar_port == g.sidecar_port
    assert epp_opts.grpc_port == print_opts.grpc_port == g.grpc_port
    assert print_opts.print_config and print_opts.listen_port == 8080
    side = _after(g.sidecar, "sidecar")
    assert side[side.index("--port") + 1] == str(g.sidecar_port)
    for cmd in (epp_rest, print_rest, side):
        assert any(cmd[i : i + len(PD)] == PD for i in range(len(cmd))), cmd
        assert "--dp-aware" in cmd
    assert epp_rest[-len(POLICY) :] == POLICY  # the policy is the picker's alone
    assert "--policy" not in side
    assert "--dp-aware" not in _after(GatewayFront("python3", PD, POLICY, 1, 2, "/tmp/x", dp_aware=False).epp, "epp")


def test_every_gateway_policy_runs_through_both_fronts() -> None:
    cells = gateway_cells()
    by_args: dict[tuple[str, ...], set[str]] = {}
    for c in cells:
        by_args.setdefault(tuple(c.args), set()).add(c.router)
    assert by_args and all(routers == {"fastroute", "envoy+epp"} for routers in by_args.values())
