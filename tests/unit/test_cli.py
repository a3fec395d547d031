"""Command line and Config: peer defaults, aliases, env fallbacks, validation, dispatch."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from fastroute import log
from fastroute.config import Config, ConfigError, cli, config_from_args
from fastroute.config.cli import IGNORED_FLAGS, build_parser, main, parse_args, parse_namespace
from fastroute.config.settings import ENV_DECODE_REQUEST_WEIGHT, ENV_P2C_LOAD_METRIC, SUPPORTED_POLICIES

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_P2C_LOAD_METRIC, raising=False)
    monkeypatch.delenv(ENV_DECODE_REQUEST_WEIGHT, raising=False)


@pytest.fixture
def restore_root_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
            h.close()
    root.setLevel(level)


def pd(*extra: str) -> list[str]:
    return ["--pd-disaggregation", *extra]


def fails(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Parse argv expecting an argparse-style exit 2; return stderr."""
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


# ---------------------------------------------------------------- defaults (protocol.md 9.1)

PEER_DEFAULTS = {
    "host": "0.0.0.0",
    "port": 30000,
    "worker_urls": [],
    "pd_disaggregation": False,
    "prefill": [],
    "decode": [],
    "policy": "cache_aware",
    "prefill_policy": "cache_aware",
    "decode_policy": "cache_aware",
    "dp_aware": False,
    "api_key": None,
    "worker_startup_timeout_secs": 1800,
    "worker_startup_check_interval": 30,
    "request_timeout_secs": 1800,
    "max_concurrent_requests": -1,
    "queue_size": 100,
    "queue_timeout_secs": 60,
    "rate_limit_tokens_per_second": None,
    "max_payload_size": 536870912,
    "retry_max_retries": 5,
    "retry_initial_backoff_ms": 50,
    "retry_max_backoff_ms": 30000,
    "retry_backoff_multiplier": 1.5,
    "retry_jitter_factor": 0.2,
    "disable_retries": False,
    "cb_failure_threshold": 10,
    "cb_success_threshold": 3,
    "cb_timeout_duration_secs": 60,
    "cb_window_duration_secs": 120,
    "disable_circuit_breaker": False,
    "health_failure_threshold": 3,
    "health_success_threshold": 2,
    "health_check_timeout_secs": 5,
    "health_check_interval_secs": 60,
    "health_check_endpoint": "/health",
    "disable_health_check": False,
    "prometheus_host": "0.0.0.0",
    "prometheus_port": 29000,
    "prometheus_duration_buckets": [
        0.001,
        0.005,
        0.01,
        0.025,
        0.05,
        0.1,
        0.25,
        0.5,
        1,
        2.5,
        5,
        10,
        15,
        30,
        45,
        60,
        90,
        120,
        180,
        240,
    ],
    "request_id_headers": ["x-request-id", "x-correlation-id", "x-trace-id", "request-id"],
    "log_level": "info",
    "log_dir": None,
    "cors_allowed_origins": [],
    "shutdown_grace_period_secs": 180,
    "cache_threshold": 0.3,
    "balance_abs_threshold": 64,
    "balance_rel_threshold": 1.5,
    "eviction_interval_secs": 60,
    "max_tree_size": 67108864,
    # smg additions / fastroute extensions
    "p2c_load_metric": "tokens",
    "load_monitor_interval": 1.0,
    "disable_load_monitoring": False,
    "routing_key_headers": [],
    "decode_input_demand": "off",
    "decode_request_weight": 0,
    "dp_rank_field": None,
    "seed": None,
    "workers": 1,
    "decode_kv_fit": "off",
    "decode_kv_reserve_tokens": 0,
}


@pytest.mark.parametrize("name", sorted(PEER_DEFAULTS))
def test_default_matches_peer(name: str) -> None:
    config = parse_args([])
    assert getattr(config, name) == PEER_DEFAULTS[name]


def test_empty_command_line_equals_default_config() -> None:
    assert parse_args([]) == Config()


def test_explicit_values_override_defaults() -> None:
    c = parse_args(
        [
            "--host",
            "::1",
            "--port",
            "0",
            "--retry-max-retries",
            "2",
            "--cache-threshold",
            "0.5",
            "--disable-retries",
            "--api-key",
            "k",
            "--request-id-headers",
            "X-Req",
            "--prometheus-duration-buckets",
            "2",
            "0.5",
            "--log-level",
            "WARN",
        ]
    )
    assert (c.host, c.port, c.retry_max_retries, c.cache_threshold) == ("::1", 0, 2, 0.5)
    assert c.disable_retries and c.max_attempts == 1 and c.api_key == "k"
    assert c.request_id_headers == ["x-req"]  # lower-cased once, matched case-insensitively
    assert c.prometheus_duration_buckets == [0.5, 2.0]
    assert c.log_level == "warning"


# ---------------------------------------------------------------- aliases


@pytest.mark.parametrize(
    "flag",
    [
        "--power-of-two-load-metric",
        "--p2c-load-metric",
        "--router-power-of-two-load-metric",
        "--router-p2c-load-metric",
    ],
)
@pytest.mark.parametrize(
    "value,expected", [("tokens", "tokens"), ("requests", "requests"), ("least_requests", "least_requests")]
)
def test_p2c_metric_spellings(flag: str, value: str, expected: str) -> None:
    assert parse_args([flag, value]).p2c_load_metric == expected


def test_router_prefixed_routing_flags() -> None:
    c = parse_args(
        [
            "--router-pd-disaggregation",
            "--router-policy",
            "round_robin",
            "--router-decode-policy",
            "power_of_two",
            "--router-prefill",
            "http://p1:1",
            "8998",
            "--prefill",
            "http://p2:2",
            "--router-decode",
            "http://d1:3",
            "--decode",
            "http://d2:4",
            "--router-dp-aware",
            "--router-balance-abs-threshold",
            "7",
            "--router-decode-input-demand",
            "on",
            "--router-decode-request-weight",
            "3",
        ]
    )
    assert c.pd_disaggregation and c.dp_aware
    assert (c.policy, c.prefill_policy, c.decode_policy) == ("round_robin", "round_robin", "power_of_two")
    assert c.prefill == [("http://p1:1", 8998), ("http://p2:2", None)]
    assert c.decode == ["http://d1:3", "http://d2:4"]
    assert c.balance_abs_threshold == 7
    assert (c.decode_input_demand, c.decode_request_weight) == ("on", 3)


def test_every_prefixable_flag_has_router_alias() -> None:
    parser = build_parser()
    known = {s for a in parser._actions for s in a.option_strings}
    visible = [
        s
        for a in parser._actions
        if a.help != "==SUPPRESS=="
        for s in a.option_strings
        if s.startswith("--") and s not in ("--help", "--version", "--host", "--port", "--worker-urls")
    ]
    assert len(visible) > 60
    missing = [s for s in visible if "--router-" + s[2:] not in known]
    assert missing == []


@pytest.mark.parametrize(
    "flag,value", [("--router-host", "h"), ("--router-port", "1"), ("--router-worker-urls", "http://a")]
)
def test_host_port_worker_urls_are_never_prefixed(flag, value, capsys) -> None:
    assert "unrecognized arguments" in fails([flag, value], capsys)


# ---------------------------------------------------------------- environment


def test_p2c_env_used_without_flag(monkeypatch) -> None:
    monkeypatch.setenv(ENV_P2C_LOAD_METRIC, "least_requests")
    assert parse_args([]).p2c_load_metric == "least_requests"
    monkeypatch.setenv(ENV_P2C_LOAD_METRIC, "Expected_Wait")
    assert parse_args([]).p2c_load_metric == "tokens"


def test_p2c_flag_beats_env(monkeypatch) -> None:
    monkeypatch.setenv(ENV_P2C_LOAD_METRIC, "least_requests")
    assert parse_args(["--p2c-load-metric", "requests"]).p2c_load_metric == "requests"


def test_p2c_env_unknown_value_warns_and_uses_tokens(monkeypatch, caplog) -> None:
    monkeypatch.setenv(ENV_P2C_LOAD_METRIC, "bogus")
    with caplog.at_level(logging.WARNING):
        assert parse_args([]).p2c_load_metric == "tokens"
    assert any(ENV_P2C_LOAD_METRIC in r.getMessage() for r in caplog.records)


def test_weight_env_and_flag_precedence(monkeypatch, capsys) -> None:
    monkeypatch.setenv(ENV_DECODE_REQUEST_WEIGHT, "4096")
    assert parse_args(["--decode-input-demand", "on"]).decode_request_weight == 4096
    assert parse_args(["--decode-input-demand", "shadow", "--decode-request-weight", "7"]).decode_request_weight == 7
    # The env weight obeys the same rule as the flag: demand off rejects it.
    assert "--decode-input-demand" in fails([], capsys)
    monkeypatch.setenv(ENV_DECODE_REQUEST_WEIGHT, "many")
    assert ENV_DECODE_REQUEST_WEIGHT in fails(["--decode-input-demand", "on"], capsys)


def test_config_from_args_takes_an_explicit_environment() -> None:
    ns = parse_namespace([])
    env = {ENV_P2C_LOAD_METRIC: "requests"}
    assert config_from_args(ns, environ=env).p2c_load_metric == "requests"


# ---------------------------------------------------------------- --prefill parsing


@pytest.mark.parametrize(
    "tokens,expected",
    [
        (["http://p:1", "8998"], ("http://p:1", 8998)),
        (["http://p:1", "none"], ("http://p:1", None)),
        (["http://p:1", "NoNe"], ("http://p:1", None)),
        (["http://p:1"], ("http://p:1", None)),
        (["http://p:1/"], ("http://p:1", None)),
    ],
)
def test_prefill_port_forms(tokens, expected) -> None:
    assert parse_args(pd("--prefill", *tokens)).prefill == [expected]


@pytest.mark.parametrize(
    "tokens", [["http://p:1", "abc"], ["http://p:1", "1.5"], ["http://p:1", "70000"], ["http://p:1", "1", "2"]]
)
def test_prefill_bad_port_names_the_flag(tokens, capsys) -> None:
    err = fails(pd("--prefill", *tokens), capsys)
    assert "argument --prefill" in err


def test_decode_takes_exactly_one_url(capsys) -> None:
    assert parse_args(pd("--decode", "http://d:1")).decode == ["http://d:1"]
    assert "unrecognized arguments" in fails(pd("--decode", "http://d:1", "http://d:2"), capsys)


def test_pd_mode_may_start_without_workers() -> None:
    c = parse_args(pd())
    assert c.pd_disaggregation and c.prefill == [] and c.decode == []


@pytest.mark.parametrize(
    "argv,flag",
    [
        (pd("--worker-urls", "http://w:1"), "--worker-urls"),
        (["--worker-urls", "w:1"], "--worker-urls"),
        (["--worker-urls", "ftp://w:1"], "--worker-urls"),
        (pd("--prefill", "grpc://p:1"), "--prefill"),
        (pd("--decode", "localhost:8000"), "--decode"),
        (pd("--decode", "http://d:1", "--decode", "http://d:1"), "--decode"),
        (pd("--prefill", "http://x:1", "--decode", "http://x:1"), "--decode"),
        (["--prefill", "http://p:1"], "--prefill"),
        (["--decode", "http://d:1"], "--decode"),
        (["--worker-urls", "http://w:notaport"], "--worker-urls"),
        (["--worker-urls", "https://w:notaport"], "--worker-urls"),
    ],
)
def test_worker_url_validation(argv, flag, capsys) -> None:
    assert f"argument {flag}" in fails(argv, capsys)


@pytest.mark.parametrize(
    "url",
    ["http://169.254.169.254", "http://[fe80::1]:8000", "http://w:1/\nforged", "http://w:0", "http://" + "a" * 254],
)
def test_worker_url_strict_rules_on_the_command_line(url: str, capsys) -> None:
    assert "argument --worker-urls" in fails(["--worker-urls", url], capsys)


def test_max_manual_keys_flag(capsys) -> None:
    assert parse_args(["--policy", "manual", "--max-manual-keys", "10"]).max_manual_keys == 10
    assert parse_args([]).max_manual_keys == 1_000_000
    assert "argument --max-manual-keys" in fails(["--max-manual-keys", "0"], capsys)
    assert "--max-manual-keys" in build_parser().format_help()


def test_allow_link_local_workers_flag(capsys) -> None:
    c = parse_args(["--allow-link-local-workers", "--worker-urls", "http://169.254.1.1:8000"])
    assert c.allow_link_local_workers and c.worker_urls == ["http://169.254.1.1:8000"]
    assert "--allow-link-local-workers" in fails(["--worker-urls", "http://169.254.1.1:8000"], capsys)
    assert "--allow-link-local-workers" in build_parser().format_help()


def test_igw_flags() -> None:
    c = parse_args(["--enable-igw", "--model-alias", "small=qwen-0.5b", "big=llama-70b"])
    assert c.enable_igw and c.model_alias == ["small=qwen-0.5b", "big=llama-70b"]
    assert not parse_args([]).enable_igw


def test_model_alias_needs_igw_and_the_form(capsys) -> None:
    assert "requires --enable-igw" in fails(["--model-alias", "a=b"], capsys)
    assert "ALIAS=MODEL" in fails(["--enable-igw", "--model-alias", "ab"], capsys)


def test_https_workers_and_tls_flags() -> None:
    c = parse_args(
        [
            "--worker-urls",
            "https://w:443",
            "--ca-cert-paths",
            "/ca1.pem",
            "/ca2.pem",
            "--client-cert-path",
            "/c.pem",
            "--client-key-path",
            "/k.pem",
        ]
    )
    assert c.worker_urls == ["https://w:443"]
    assert (c.ca_cert_paths, c.client_cert_path, c.client_key_path) == (["/ca1.pem", "/ca2.pem"], "/c.pem", "/k.pem")


# ---------------------------------------------------------------- policies


@pytest.mark.parametrize("policy", SUPPORTED_POLICIES)
def test_supported_policies_start(policy: str) -> None:
    c = parse_args(pd("--policy", policy))
    assert c.policy == c.prefill_policy == c.decode_policy == policy


@pytest.mark.parametrize(
    "flag,policy",
    [
        ("--policy", "prefix_hash"),
        ("--policy", "least_load"),
        ("--policy", "passthrough"),
        ("--decode-policy", "prefix_hash"),
        ("--prefill-policy", "bucket"),
        ("--router-prefill-policy", "least_load"),
    ],
)
def test_unsupported_policy_is_a_clear_startup_error(flag, policy, capsys) -> None:
    err = fails(pd(flag, policy), capsys)
    canonical = flag.replace("--router-", "--")
    assert f"argument {canonical}" in err
    assert policy in err and "not implemented by fastroute" in err
    for name in SUPPORTED_POLICIES:
        assert name in err


def test_bucket_only_for_prefill(capsys) -> None:
    assert "invalid choice" in fails(pd("--decode-policy", "bucket"), capsys)


def test_bucket_refusal_explains_why(capsys) -> None:
    err = fails(pd("--prefill-policy", "bucket"), capsys)
    assert "--bucket-adjust-interval-secs" in err and "cache_aware" in err


def test_manual_policy_flags() -> None:
    c = parse_args(
        pd(
            "--policy",
            "manual",
            "--assignment-mode",
            "min_group",
            "--max-idle-secs",
            "60",
            "--routing-key-headers",
            "X-Session",
        )
    )
    assert (c.policy, c.assignment_mode, c.max_idle_secs) == ("manual", "min_group", 60)
    assert c.routing_key_headers == ["x-session"]
    assert parse_args(pd("--policy", "manual")).assignment_mode == "random"


# ---------------------------------------------------------------- fastroute extensions


@pytest.mark.parametrize("demand", ["shadow", "on"])
def test_weight_accepted_with_demand(demand: str) -> None:
    c = parse_args(["--decode-input-demand", demand, "--decode-request-weight", "8192"])
    assert (c.decode_input_demand, c.decode_request_weight) == (demand, 8192)


def test_weight_rejected_without_demand(capsys) -> None:
    err = fails(["--decode-request-weight", "8"], capsys)
    assert "--decode-request-weight" in err and "--decode-input-demand" in err
    assert parse_args(["--decode-request-weight", "0"]).decode_request_weight == 0


def test_negative_weight_rejected(capsys) -> None:
    err = fails(["--decode-input-demand", "on", "--decode-request-weight", "-1"], capsys)
    assert "argument --decode-request-weight" in err


def test_workers_number_and_auto(capsys) -> None:
    assert parse_args(["--workers", "3"]).workers == 3
    assert parse_args(["--workers", "auto"]).workers == (os.cpu_count() or 1)
    assert "argument --workers" in fails(["--workers", "0"], capsys)
    assert "argument --workers" in fails(["--workers", "many"], capsys)


def test_rank_field_by_mode_and_override() -> None:
    assert Config().rank_field("regular") == "data_parallel_rank"
    assert Config().rank_field("decode") == "routed_dp_rank"
    c = parse_args(["--dp-rank-field", "data_parallel_rank"])
    assert c.rank_field("decode") == c.rank_field("regular") == "data_parallel_rank"


def test_misc_extension_values(capsys) -> None:
    c = parse_args(
        [
            "--seed",
            "42",
            "--decode-kv-fit",
            "shadow",
            "--decode-kv-reserve-tokens",
            "512",
            "--load-monitor-interval",
            "0.1",
            "--disable-load-monitoring",
            "--routing-key-headers",
            "X-Session-Id",
        ]
    )
    assert (c.seed, c.decode_kv_fit, c.decode_kv_reserve_tokens) == (42, "shadow", 512)
    assert c.load_monitor_interval == 0.1 and c.disable_load_monitoring
    assert c.routing_key_headers == ["x-session-id"]
    assert "argument --load-monitor-interval" in fails(["--load-monitor-interval", "0.05"], capsys)
    assert "argument --seed" in fails(["--seed", "-3"], capsys)
    assert "argument --decode-kv-reserve-tokens" in fails(["--decode-kv-reserve-tokens", "-1"], capsys)


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--port", "70000"], "--port"),
        (["--port", "x"], "--port"),
        (["--prometheus-port", "-1"], "--prometheus-port"),
        (["--retry-jitter-factor", "1.5"], "--retry-jitter-factor"),
        (["--retry-backoff-multiplier", "0.5"], "--retry-backoff-multiplier"),
        (["--cache-threshold", "2"], "--cache-threshold"),
        (["--health-check-endpoint", "health"], "--health-check-endpoint"),
        (["--cb-failure-threshold", "0"], "--cb-failure-threshold"),
        (["--queue-size", "-1"], "--queue-size"),
        (["--max-concurrent-requests", "-2"], "--max-concurrent-requests"),
        (["--log-level", "verbose"], "--log-level"),
        (["--request-id-headers", "bad header"], "--request-id-headers"),
    ],
)
def test_bad_values_name_the_flag(argv, flag, capsys) -> None:
    assert f"argument {flag}" in fails(argv, capsys)


def test_hand_built_config_is_validated() -> None:
    with pytest.raises(ConfigError) as exc:
        Config(pd_disaggregation=True, worker_urls=["http://w:1"])
    assert exc.value.flag == "--worker-urls"
    c = Config(policy="random", decode_policy="power_of_two")
    assert (c.prefill_policy, c.decode_policy) == ("random", "power_of_two")


# ---------------------------------------------------------------- ignored flags


def _ignored_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "ignored by fastroute" in r.getMessage()]


def test_ignored_flags_warn_once_each_and_swallow_values(caplog) -> None:
    # --enable-igw and --jwt-issuer left this list: they could change who gets in, so they are refused (tests below).
    argv = [
        "--mini-lb",
        "--selector",
        "app=sglang",
        "tier=gpu",
        "--redis-url",
        "redis://r:6379",
        "--oracle-pool-min",
        "-1",
        "--policy",
        "random",
    ]
    with caplog.at_level(logging.WARNING, logger="fastroute.config"):
        c = parse_args(argv)
    assert c.policy == "random"
    lines = _ignored_lines(caplog)
    flags = [line.split()[0] for line in lines]
    assert flags == [
        "--mini-lb",
        "--selector",
        "--redis-url",
        "--oracle-pool-min",
    ]


@pytest.mark.parametrize("flag", IGNORED_FLAGS)
def test_each_ignored_flag_is_accepted_with_one_warning(flag: str, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="fastroute.config"):
        parse_args([flag, "v", "--router-" + flag[2:]])
    # One line naming the flag; the reason follows in parentheses (fastroute.config.flags.TABLE).
    assert [line.split(" (", 1)[0] for line in _ignored_lines(caplog)] == [
        f"{flag} is accepted for compatibility and ignored by fastroute"
    ]


def test_no_warning_without_ignored_flags(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        parse_args(pd("--prefill", "http://p:1", "--decode", "http://d:1"))
    assert caplog.records == []


def test_unknown_flag_is_still_an_error(capsys) -> None:
    assert "unrecognized arguments: --no-such-flag" in fails(["--no-such-flag"], capsys)


# ---------------------------------------------------------------- main / dispatch / help


def test_main_runs_server_with_config(monkeypatch, restore_root_logging, tmp_path) -> None:
    seen: list[Config] = []
    monkeypatch.setattr(cli, "run", lambda config, factory: seen.append(config) or 0)
    log_dir = tmp_path / "logs"
    rc = main(["--port", "0", "--log-level", "warn", "--log-dir", str(log_dir), "--upstream-http2"])
    assert rc == 0 and len(seen) == 1 and seen[0].port == 0
    assert logging.getLogger().level == logging.WARNING
    # The ignored-flag warning went through the configured handlers into the log file.
    for h in logging.getLogger().handlers:
        h.flush()
    text = (log_dir / "fastroute.log").read_text()
    assert "WARNING" in text and "fastroute.config" in text and "--upstream-http2" in text


def test_main_accepts_launch_subcommand(monkeypatch, restore_root_logging) -> None:
    seen: list[Config] = []
    monkeypatch.setattr(cli, "run", lambda config, factory: seen.append(config))
    main(["launch", "--policy", "round_robin"])
    assert seen[0].policy == "round_robin"


def test_main_dispatches_demo(monkeypatch) -> None:
    got: list[list[str]] = []
    demo = types.ModuleType("fastroute.sim.demo")
    demo.main = lambda argv: got.append(list(argv)) or 5  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "fastroute.sim.demo", demo)
    assert main(["demo", "--policy", "x", "--anything"]) == 5
    assert got == [["--policy", "x", "--anything"]]


def test_main_bad_config_exits_2_before_server(monkeypatch, restore_root_logging, capsys):
    monkeypatch.setattr(cli, "run", lambda config, factory: pytest.fail("server must not start"))
    with pytest.raises(SystemExit) as exc:
        main(["--policy", "prefix_hash"])
    assert exc.value.code == 2
    assert "argument --policy" in capsys.readouterr().err


def test_configure_logging_keeps_foreign_handlers(restore_root_logging) -> None:
    root = logging.getLogger()
    foreign = logging.NullHandler()
    root.addHandler(foreign)
    log.configure_logging("debug")
    log.configure_logging("error")
    ours = [h for h in root.handlers if getattr(h, "_fastroute_handler", False)]
    assert foreign in root.handlers and len(ours) == 1
    assert root.level == logging.ERROR
    root.removeHandler(foreign)


def test_help_lists_groups_and_defaults() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fastroute", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    for group in (
        "Worker configuration",
        "Routing policy",
        "PD disaggregation",
        "Retries",
        "Circuit breaker",
        "Health checks",
        "Admission/Rate limiting",
        "Prometheus",
        "Logging",
        "fastroute extensions",
        "Ignored for compatibility",
    ):
        assert f"{group}:" in out
    assert "--p2c-load-metric" in out and "default: 30000" in out
    # The --router- aliases work but stay out of the help listing.
    assert "--router-decode-policy" not in out and "--router-mini-lb" not in out


def test_config_survives_pickling_for_proxy_processes() -> None:
    import pickle

    c = parse_args(pd("--prefill", "http://p:1", "9", "--decode", "http://d:1", "--seed", "1"))
    assert pickle.loads(pickle.dumps(c)) == c


def test_cli_parse_args_builds_the_config() -> None:
    # config.parse_args is gone (it only made a cli -> config -> cli cycle); the CLI's is the one.
    assert parse_args(["--port", "1", "--router-policy", "random"]) == Config(port=1, policy="random")


@pytest.mark.parametrize("workers, expected", [("1", "Server"), ("2", "Supervisor")])
def test_main_picks_one_process_or_a_supervisor(monkeypatch, restore_root_logging, workers, expected) -> None:
    seen: list[str] = []
    monkeypatch.setattr(cli, "run", lambda config, factory: seen.append(factory.__name__) or 0)
    assert main(["--workers", workers]) == 0
    assert seen == [expected]


@pytest.mark.parametrize(
    "argv, needs",
    [
        (["--chat-template", "/t.jinja"], "--tokenizer-path or --model-path"),
        (["--tokenize-timeout-ms", "10"], "--tokenizer-path or --model-path"),
        (["--tokenizer-cache-enable-l1"], "--tokenizer-path or --model-path"),
        (["--tokenizer-cache-l0-max-entries", "5"], "--tokenizer-cache-enable-l0"),
        (["--tokenizer-cache-l1-max-memory", "1000"], "--tokenizer-cache-enable-l1"),
        (["--block-size", "64"], "--kv-events-endpoint"),
        (["--kv-events", "off", "--kv-index-max-blocks", "10"], "--kv-events auto"),
        (["--priority-scheduler-config", "/s.yaml"], "--priority-scheduler-enabled"),
        (["--priority-scheduler-default-max-class", "bulk"], "--priority-scheduler-enabled"),
        (["--tenant-rate-limit-config", "/r.yaml"], "--tenant-rate-limit-enabled"),
        (["--trust-tenant-header"], "a flow-control flag"),
        (["--tenant-header-name", "x-team"], "a flow-control flag"),
    ],
)
def test_a_tokenizer_or_kv_event_setting_without_its_feature_warns_once(argv: list[str], needs: str, caplog) -> None:
    flag = [a for a in argv if a.startswith("--")][-1]
    with caplog.at_level(logging.WARNING, logger="fastroute.config"):
        parse_args(["--worker-urls", "http://127.0.0.1:1", *argv])
    said = [r.getMessage() for r in caplog.records if "is accepted and ignored" in r.getMessage()]
    assert said == [f"{flag} is accepted and ignored by fastroute (only used with {needs})"]


def test_speed_aware_pd_with_a_prefill_policy_it_cannot_place_beside_warns_once(caplog) -> None:
    argv = ["--pd-disaggregation", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"]
    argv += ["--decode-policy", "power_of_two", "--speed-aware", "on"]
    with caplog.at_level(logging.WARNING, logger="fastroute.config"):
        parse_args(argv)
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("--speed-aware places")]
    assert len(said) == 1 and "the cache_aware prefill policy" in said[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fastroute.config"):
        parse_args([*argv, "--prefill-policy", "power_of_two"])
    assert not [r for r in caplog.records if r.getMessage().startswith("--speed-aware places")]
