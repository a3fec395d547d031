"""What a real ``python -m fastroute`` says at start about power_of_two's load metric (issue 50,
item 8): fastroute's default (tokens) is not smg's (expected_wait), said once; an invalid
``$SGLANG_ROUTER_P2C_LOAD_METRIC`` is not credited in the banner; the variable set under a
policy that never reads it is said once."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from fastroute.names import ENV_P2C_LOAD_METRIC

BANNER_END = "/metrics"  # the banner's last line (indented, it continues the block) names it


def _start_log(argv: list[str], env_metric: str | None) -> str:
    """The stderr of a router started with ``argv`` up to the end of its banner."""
    env = {k: v for k, v in os.environ.items() if k != ENV_P2C_LOAD_METRIC}
    env["PYTHONPATH"] = os.getcwd()
    if env_metric is not None:
        env[ENV_P2C_LOAD_METRIC] = env_metric
    cmd = [sys.executable, "-m", "fastroute", "--host", "127.0.0.1", "--port", "0"]
    cmd += ["--prometheus-host", "127.0.0.1", "--prometheus-port", "0", *argv]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines: list[str] = []
    deadline = time.monotonic() + 30
    try:
        assert proc.stderr is not None
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
            if line.startswith("  ") and BANNER_END in line:
                break
    finally:
        proc.terminate()
        proc.wait(20)
    text = "".join(lines)
    assert BANNER_END in text, text
    return text


def test_power_of_two_on_the_default_metric_says_so_once() -> None:
    text = _start_log(["--policy", "power_of_two"], None)
    assert text.count("smg's is expected_wait") == 1, text
    assert "load metric tokens (from default)" in text, text


def test_an_explicit_metric_needs_no_such_warning() -> None:
    text = _start_log(["--policy", "power_of_two", "--p2c-load-metric", "least_requests"], None)
    assert "expected_wait" not in text, text
    assert "load metric least_requests (from flag)" in text, text


def test_an_invalid_environment_metric_is_not_credited() -> None:
    text = _start_log(["--policy", "power_of_two"], "bogus")
    assert "load metric tokens (from default)" in text, text
    assert f"(from {ENV_P2C_LOAD_METRIC})" not in text, text
    assert text.count(f"{ENV_P2C_LOAD_METRIC}='bogus' is not one of") == 1, text


@pytest.mark.parametrize("policy", ["round_robin", "cache_aware"])
def test_the_environment_metric_under_another_policy_is_said_once(policy: str) -> None:
    text = _start_log(["--policy", policy], "least_requests")
    assert text.count(f"{ENV_P2C_LOAD_METRIC} is set and ignored") == 1, text


def test_a_valid_environment_metric_is_credited() -> None:
    text = _start_log(["--policy", "power_of_two"], "least_requests")
    assert f"load metric least_requests (from {ENV_P2C_LOAD_METRIC})" in text, text
    assert "is set and ignored" not in text and "smg's is expected_wait" not in text, text
