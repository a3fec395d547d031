"""Peer flags that used to map silently onto something else now refuse by name
(or, where they cannot change routing, start with one warning saying why)."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

from fastroute.config.cli import parse_args, parse_namespace

REPO = Path(__file__).resolve().parents[2]


def _refused(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_router_selector_is_not_the_worker_selector(capsys) -> None:
    err = _refused(capsys, ["--service-discovery", "--selector", "app=sglang", "--router-selector", "app=router"])
    assert "argument --router-selector: not supported by fastroute" in err
    assert "HA mesh" in err and "--selector" in err
    # It never lands in the worker selector (it used to, as a --router- spelling).
    ns = parse_namespace(["--router-selector", "app=router"])
    assert ns.selector == [] and ("--router-selector", ["app=router"]) in ns.ignored_flags


@pytest.mark.parametrize("flag", ["--backend", "--router-backend"])
@pytest.mark.parametrize("value", ["openai", "anthropic", "vllm"])
def test_non_sglang_backend_is_refused(capsys, flag: str, value: str) -> None:
    err = _refused(capsys, [flag, value])
    assert "argument --backend: not supported by fastroute" in err and "SGLang" in err


def test_only_the_sglang_backend_starts(capsys) -> None:
    assert parse_args(["--backend", "sglang"]).policy == "cache_aware"
    assert "argument --backend" in _refused(capsys, ["--backend", "tokenspeed"])


def test_backend_openai_refused_by_the_real_command() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "fastroute", "--backend", "openai", "--worker-urls", "https://api.openai.com"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "argument --backend: not supported by fastroute" in out.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["--policy", "power_of_two"],
        ["--router-policy", "power_of_two"],
        ["--pd-disaggregation", "--policy", "random", "--decode-policy", "power_of_two"],
    ],
)
def test_expected_wait_with_power_of_two_is_refused_with_the_reason(capsys, argv) -> None:
    err = _refused(capsys, argv + ["--power-of-two-load-metric", "expected_wait"])
    assert "argument --power-of-two-load-metric:" in err
    assert "gen_throughput" in err and "does not substitute" in err


def test_expected_wait_unread_by_any_leg_warns_and_changes_nothing(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="fastroute.config"):
        c = parse_args(["--policy", "round_robin", "--power-of-two-load-metric", "expected_wait"])
    assert c.p2c_load_metric == "tokens"
    assert [r for r in caplog.records if "expected_wait" in r.getMessage()]


def test_expected_wait_is_no_longer_a_tokens_alias() -> None:
    from fastroute.config import Config

    with pytest.raises(ValueError, match="expected_wait"):
        Config(policy="power_of_two", p2c_load_metric="expected_wait")


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["--policy", "manual", "--workers", "2"], "--policy"),
        (["--router-policy", "manual", "--workers", "3"], "--policy"),
        (
            ["--pd-disaggregation", "--policy", "random", "--decode-policy", "manual", "--workers", "2"],
            "--decode-policy",
        ),
    ],
)
def test_manual_with_several_processes_is_refused(capsys, argv, flag) -> None:
    err = _refused(capsys, argv)
    assert f"argument {flag}: the manual policy's routing-key table is kept per proxy process" in err


def test_manual_with_workers_auto_on_two_cpus_is_refused(capsys, monkeypatch) -> None:
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert "routing-key table" in _refused(capsys, ["--policy", "manual", "--workers", "auto"])


def test_manual_starts_with_one_process_only(capsys) -> None:
    assert parse_args(["--policy", "manual", "--workers", "1"]).policy == "manual"
    assert "routing-key table" in _refused(capsys, ["--policy", "manual", "--workers", "4"])


def test_cb_window_warns_once_and_is_still_validated(caplog, capsys) -> None:
    with caplog.at_level(logging.WARNING, logger="fastroute.config"):
        c = parse_args(["--cb-window-duration-secs", "30"])
    assert c.cb_window_duration_secs == 30
    lines = [r.getMessage() for r in caplog.records if "--cb-window-duration-secs" in r.getMessage()]
    assert len(lines) == 1 and "consecutive failures" in lines[0]
    assert "argument --cb-window-duration-secs" in _refused(capsys, ["--cb-window-duration-secs", "0"])


def test_readme_first_example_is_a_real_smg_line_and_the_same_fastroute_line() -> None:
    """The README's "before" command uses only flags smg 1.13 has, and the "after" line is the
    same arguments, which fastroute parses (an earlier README used --p2c-load-metric, which smg lacks)."""
    from tests.unit.test_flags import SMG_1_13_FLAGS

    block = (REPO / "README.md").read_text().split("```", 2)[1]
    before, after = block.split("# becomes")
    before_args = before.replace("\\\n", " ").split()
    after_args = after.replace("\\\n", " ").split()
    assert before_args[:3] == ["python", "-m", "smg.launch_router"]
    assert after_args[0] == "fastroute" and after_args[1:] == before_args[3:]
    for token in before_args[3:]:
        if token.startswith("--"):
            assert token in SMG_1_13_FLAGS, token
    c = parse_args(after_args[1:])
    assert (c.policy, c.p2c_load_metric, c.dp_aware) == ("power_of_two", "least_requests", True)


def test_expected_wait_from_the_environment_is_judged_like_the_flag(capsys, monkeypatch) -> None:
    monkeypatch.setenv("SGLANG_ROUTER_P2C_LOAD_METRIC", "expected_wait")
    err = _refused(capsys, ["--policy", "power_of_two"])
    assert "argument SGLANG_ROUTER_P2C_LOAD_METRIC:" in err and "gen_throughput" in err
    assert parse_args(["--policy", "random"]).p2c_load_metric == "tokens"
    monkeypatch.setenv("SGLANG_ROUTER_P2C_LOAD_METRIC", "requests")
    assert parse_args(["--policy", "power_of_two"]).p2c_load_metric == "requests"
