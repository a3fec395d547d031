"""fastroute.launch_router: sglang-router 0.3.2's RouterArgs/launch_router API over fastroute's CLI."""
from __future__ import annotations

import argparse
import dataclasses

import pytest

from fastroute import cli
from fastroute.launch_router import RouterArgs, parse_router_args


def test_default_router_args_mean_the_default_config() -> None:
    assert RouterArgs().to_argv() == []
    assert cli.parse_args(RouterArgs().to_argv()) == cli.parse_args([])


def test_fields_become_flags_with_the_same_meaning() -> None:
    args = RouterArgs(pd_disaggregation=True, prefill_urls=[("http://p:1", 8998), ("http://p:2", None)],
                      decode_urls=["http://d:1"], policy="power_of_two", dp_aware=True,
                      host="127.0.0.1", port=31000, request_timeout_secs=30, cors_allowed_origins=["*"])
    cfg = cli.parse_args(args.to_argv())
    assert cfg.pd_disaggregation and cfg.dp_aware and cfg.policy == "power_of_two"
    assert [tuple(p) for p in cfg.prefill] == [("http://p:1", 8998), ("http://p:2", None)]
    assert list(cfg.decode) == ["http://d:1"]
    assert (cfg.host, cfg.port, cfg.request_timeout_secs) == ("127.0.0.1", 31000, 30)


def test_round_trip_through_a_command_line() -> None:
    argv = ["--worker-urls", "http://a:1", "http://b:2", "--policy", "round_robin", "--dp-aware",
            "--max-concurrent-requests", "8"]
    args = parse_router_args(argv)
    assert args.worker_urls == ["http://a:1", "http://b:2"] and args.policy == "round_robin"
    assert args.dp_aware and args.max_concurrent_requests == 8
    assert cli.parse_args(args.to_argv()) == cli.parse_args(argv)


def test_namespace_from_sglang_shaped_parser() -> None:
    ns = argparse.Namespace(worker_urls=["http://w:1"], policy="random", prefill=[["http://p:1", "9000"]],
                            decode=[["http://d:1"]], pd_disaggregation=True, worker_startup_timeout_secs=5)
    args = RouterArgs.from_cli_args(ns)
    assert args.prefill_urls == [("http://p:1", 9000)] and args.decode_urls == ["http://d:1"]
    assert args.worker_startup_timeout_secs == 5


def test_every_0_3_2_field_is_present() -> None:
    names = {f.name for f in dataclasses.fields(RouterArgs)}
    for name in ("worker_urls", "prefill_urls", "decode_urls", "policy", "max_idle_secs", "assignment_mode",
                 "service_discovery", "bootstrap_port_annotation", "control_plane_api_keys", "jwt_role_mapping",
                 "server_cert_path", "ca_cert_paths", "rate_limit_tokens_per_second"):
        assert name in names


def test_refused_fields_fail_like_their_flags(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(RouterArgs(jwt_issuer="https://auth.example.com", jwt_audience="x").to_argv())
    assert exc.value.code != 0
