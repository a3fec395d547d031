"""fastroute.launch_router: sglang-router 0.3.2's RouterArgs/launch_router API over fastroute's CLI."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from fastroute.config import cli
from fastroute.launch_router import RouterArgs, parse_router_args


def test_default_router_args_mean_the_default_config() -> None:
    assert RouterArgs().to_argv() == []
    assert cli.parse_args(RouterArgs().to_argv()) == cli.parse_args([])


def test_fields_become_flags_with_the_same_meaning() -> None:
    args = RouterArgs(
        pd_disaggregation=True,
        prefill_urls=[("http://p:1", 8998), ("http://p:2", None)],
        decode_urls=["http://d:1"],
        policy="power_of_two",
        dp_aware=True,
        host="127.0.0.1",
        port=31000,
        request_timeout_secs=30,
        cors_allowed_origins=["*"],
    )
    cfg = cli.parse_args(args.to_argv())
    assert cfg.pd_disaggregation and cfg.dp_aware and cfg.policy == "power_of_two"
    assert [tuple(p) for p in cfg.prefill] == [("http://p:1", 8998), ("http://p:2", None)]
    assert list(cfg.decode) == ["http://d:1"]
    assert (cfg.host, cfg.port, cfg.request_timeout_secs) == ("127.0.0.1", 31000, 30)


def test_round_trip_through_a_command_line() -> None:
    argv = [
        "--worker-urls",
        "http://a:1",
        "http://b:2",
        "--policy",
        "round_robin",
        "--dp-aware",
        "--max-concurrent-requests",
        "8",
    ]
    args = parse_router_args(argv)
    assert args.worker_urls == ["http://a:1", "http://b:2"] and args.policy == "round_robin"
    assert args.dp_aware and args.max_concurrent_requests == 8
    assert cli.parse_args(args.to_argv()) == cli.parse_args(argv)


def test_namespace_from_sglang_shaped_parser() -> None:
    ns = argparse.Namespace(
        worker_urls=["http://w:1"],
        policy="random",
        prefill=[["http://p:1", "9000"]],
        decode=[["http://d:1"]],
        pd_disaggregation=True,
        worker_startup_timeout_secs=5,
    )
    args = RouterArgs.from_cli_args(ns)
    assert args.prefill_urls == [("http://p:1", 9000)] and args.decode_urls == ["http://d:1"]
    assert args.worker_startup_timeout_secs == 5


def test_every_0_3_2_field_is_present() -> None:
    names = {f.name for f in dataclasses.fields(RouterArgs)}
    for name in (
        "worker_urls",
        "prefill_urls",
        "decode_urls",
        "policy",
        "max_idle_secs",
        "assignment_mode",
        "service_discovery",
        "bootstrap_port_annotation",
        "control_plane_api_keys",
        "jwt_role_mapping",
        "server_cert_path",
        "ca_cert_paths",
        "rate_limit_tokens_per_second",
    ):
        assert name in names


def test_refused_fields_fail_like_their_flags(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(RouterArgs(jwt_issuer="https://auth.example.com", jwt_audience="x").to_argv())
    assert exc.value.code != 0


# sglang-router 0.3.2's add_cli_args, as read from its wheel: option -> (dest, default).
_SGR_PREFIXED = {
    "--worker-urls": ("worker_urls", []),
    "--router-policy": ("router_policy", "cache_aware"),
    "--router-prefill": ("router_prefill", None),
    "--router-decode": ("router_decode", None),
    "--router-prometheus-port": ("router_prometheus_port", 29000),
    "--router-prometheus-host": ("router_prometheus_host", "0.0.0.0"),
    "--router-log-level": ("router_log_level", "info"),
    "--router-selector": ("router_selector", {}),
    "--router-tls-cert-path": ("router_tls_cert_path", None),
    "--router-control-plane-api-keys": ("router_control_plane_api_keys", []),
    "--router-dp-aware": ("router_dp_aware", False),
    "--router-max-tree-size": ("router_max_tree_size", 2**26),
}


def _options(**kw: bool) -> dict[str, tuple[str, object]]:
    parser = argparse.ArgumentParser()
    RouterArgs.add_cli_args(parser, **kw)
    return {a.option_strings[0]: (a.dest, a.default) for a in parser._actions if a.dest != "help"}


def test_add_cli_args_with_and_without_the_router_prefix() -> None:
    prefixed = _options(use_router_prefix=True, exclude_host_port=True)
    for option, want in _SGR_PREFIXED.items():
        assert prefixed[option] == want, option
    assert "--host" not in prefixed and "--port" not in prefixed
    assert not any(o.startswith("--router-router") for o in prefixed)
    plain = _options()
    assert plain["--host"] == ("host", "0.0.0.0") and plain["--port"] == ("port", 30000)
    assert plain["--policy"] == ("policy", "cache_aware") and "--router-policy" not in plain
    # one flag per field (bootstrap_port_annotation has none in sglang-router either)
    assert len(plain) == len(dataclasses.fields(RouterArgs)) - 1


def test_from_cli_args_reads_the_prefixed_namespace() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=1234)  # the launcher's own
    RouterArgs.add_cli_args(parser, use_router_prefix=True, exclude_host_port=True)
    ns = parser.parse_args(
        [
            "--router-pd-disaggregation",
            "--router-prefill",
            "http://p:1",
            "8998",
            "--router-prefill",
            "http://p:2",
            "--router-decode",
            "http://d:1",
            "--router-policy",
            "round_robin",
            "--router-selector",
            "app=x",
            "tier!=cpu",
            "--router-control-plane-api-keys",
            "k1:ops:ADMIN:se:cret",
        ]
    )
    args = RouterArgs.from_cli_args(ns, use_router_prefix=True)
    assert args.prefill_urls == [("http://p:1", 8998), ("http://p:2", None)]
    assert args.decode_urls == ["http://d:1"] and args.policy == "round_robin" and args.port == 1234
    assert args.selector == ["app=x", "tier!=cpu"]  # set-based form kept for fastroute
    assert args.control_plane_api_keys == [("k1", "ops", "se:cret", "admin")]
    cfg = cli.parse_args(args.to_argv())
    assert cfg.policy == "round_robin" and cfg.port == 1234
    assert list(cfg.control_plane_api_keys) == ["k1:ops:admin:se:cret"]


def test_an_attribute_that_is_not_a_field_raises_type_error() -> None:
    from fastroute.launch_router import launch_router

    args = RouterArgs(worker_urls=["http://w:1"])
    args.router_policy = "round_robin"  # type: ignore[attr-defined]
    with pytest.raises(TypeError, match="'router_policy' \\(the field is 'policy'"):
        launch_router(args)  # refused before anything starts
    with pytest.raises(TypeError):
        RouterArgs(router_policy="x")  # type: ignore[call-arg]


def test_key_tuples_in_sglang_order_and_no_secret_in_errors(capsys: pytest.CaptureFixture) -> None:
    args = RouterArgs(control_plane_api_keys=[("k1", "svc", "TOPSECRET", "admin")])
    assert args.to_argv() == ["--control-plane-api-keys", "k1:svc:admin:TOPSECRET"]
    # a tuple in the wrong order puts the key where the role goes: refused, key not shown
    wrong = RouterArgs(control_plane_api_keys=[("k1", "svc", "admin", "TOPSECRET")])
    with pytest.raises(SystemExit):
        cli.parse_args(wrong.to_argv())
    err = capsys.readouterr().err
    assert "role" in err and "TOPSECRET" not in err
    with pytest.raises(TypeError, match="entry 1"):
        RouterArgs(control_plane_api_keys=[("k1", "TOPSECRET")]).to_argv()


def test_scalar_values_stay_values_even_when_they_start_with_a_dash() -> None:
    cfg = cli.parse_args(RouterArgs(api_key="--not-a-flag").to_argv())
    assert cfg.api_key == "--not-a-flag"


def test_compat_install_answers_sglang_router_imports() -> None:
    import sys
    import types

    from fastroute import compat, launch_router

    saved = {k: sys.modules.pop(k) for k in list(sys.modules) if k.startswith("sglang_router")}
    try:
        sys.modules["sglang_router"] = types.ModuleType("sglang_router")  # the real one
        with pytest.raises(RuntimeError, match="imported before"):
            compat.install()
        del sys.modules["sglang_router"]
        compat.install()
        compat.install()  # idempotent
        from sglang_router.launch_router import RouterArgs as Theirs  # noqa: N813
        from sglang_router.router_args import RouterArgs as Args2

        assert Theirs is Args2 is launch_router.RouterArgs
    finally:
        for k in [k for k in sys.modules if k.startswith("sglang_router")]:
            del sys.modules[k]
        sys.modules.update(saved)
