"""The rule and the inventory (fastroute.config.flags): every smg 1.13 flag either starts the router or
refuses by name; refused flags accept only their neutral values; docs/flags.md carries the table."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fastroute.config import flags
from fastroute.config.cli import build_parser, parse_args

REPO = Path(__file__).resolve().parents[2]

# Every option string of smg 1.13.0's router CLI (smg/router_args.py of the wheel).
SMG_1_13_FLAGS = (
    "--host",
    "--port",
    "--worker-urls",
    "--upstream-http2",
    "--upstream-pool-idle-timeout-secs",
    "--health-check-port",
    "--policy",
    "--encode-policy",
    "--prefill-policy",
    "--decode-policy",
    "--cache-threshold",
    "--cache-match-threshold",
    "--prefix-token-count",
    "--prefix-hash-load-factor",
    "--prefix-hash-balance-abs-threshold",
    "--least-load-kv-pressure-weight",
    "--least-load-default-throughput",
    "--least-load-mean-prefill-tokens",
    "--least-load-max-waiting-requests",
    "--power-of-two-load-metric",
    "--balance-abs-threshold",
    "--spill-abs-threshold",
    "--balance-rel-threshold",
    "--spill-rel-threshold",
    "--balance-token-usage-threshold",
    "--overload-token-usage-threshold",
    "--worker-overload-waiting-requests",
    "--worker-overload-token-usage",
    "--worker-overload-protection",
    "--disable-worker-overload-protection",
    "--worker-overload-shed",
    "--kv-index",
    "--worker-stall-secs",
    "--worker-wedge-secs",
    "--worker-stale-secs",
    "--worker-warmup-secs",
    "--worker-warmup-share",
    "--worker-warmup-blocks",
    "--worker-warmup-thin-ratio",
    "--worker-warmup-divert-every",
    "--selection-policy",
    "--selection-accounting-ttl-ms",
    "--overlap-decay",
    "--selection-temperature",
    "--bucket-adjust-interval-secs",
    "--eviction-interval-secs",
    "--max-tree-size",
    "--block-size",
    "--cache-boundaries",
    "--cache-index",
    "--cache-ttl-secs",
    "--max-idle-secs",
    "--sticky-key-idle-secs",
    "--assignment-mode",
    "--max-payload-size",
    "--max-buffered-request-bytes",
    "--pd-admission-wait-secs",
    "--stream-body-stall-timeout-secs",
    "--sse-keepalive-secs",
    "--dp-aware",
    "--routing-key-override",
    "--sticky-sessions",
    "--routing-key-headers",
    "--dp-minimum-tokens-scheduler",
    "--enable-igw",
    "--enable-rl",
    "--rl-control-timeout-secs",
    "--rl-fanout-concurrency",
    "--pd-disaggregation",
    "--epd-disaggregation",
    "--encode",
    "--prefill",
    "--decode",
    "--prefill-max-inflight-requests-per-worker",
    "--prefill-queue-size",
    "--prefill-queue-timeout-secs",
    "--worker-startup-timeout-secs",
    "--worker-startup-delay",
    "--worker-startup-check-interval",
    "--job-queue-capacity",
    "--job-queue-concurrency",
    "--load-monitor-interval",
    "--disable-load-monitoring",
    "--multimodal-tensor-transport",
    "--multimodal-shm-min-bytes",
    "--multimodal-max-inflight-bytes",
    "--mm-per-request-image-limit",
    "--mm-processing",
    "--mm-pixel-cache-mb",
    "--mm-pixel-rdma",
    "--mm-allowed-media-domains",
    "--mm-allow-private-media-hosts",
    "--rdma-listen-ip",
    "--rdma-slot-ttl-s",
    "--log-mm-timing",
    "--log-dir",
    "--log-level",
    "--log-json",
    "--service-discovery",
    "--discovery-provider",
    "--discovery-file",
    "--discovery-check-interval-secs",
    "--selector",
    "--service-discovery-port",
    "--service-discovery-namespace",
    "--kv-connector-annotation",
    "--kv-engine-id-annotation",
    "--encode-selector",
    "--prefill-selector",
    "--decode-selector",
    "--router-selector",
    "--model-id-from",
    "--model-alias",
    "--prometheus-port",
    "--prometheus-host",
    "--prometheus-duration-buckets",
    "--jemalloc-prof-dir",
    "--request-id-headers",
    "--storage-context-headers",
    "--request-timeout-secs",
    "--shutdown-grace-period-secs",
    "--header-read-timeout-secs",
    "--idle-connection-timeout-secs",
    "--trust-tenant-header",
    "--tenant-header-name",
    "--cors-allowed-origins",
    "--max-concurrent-requests",
    "--queue-size",
    "--queue-timeout-secs",
    "--rate-limit-tokens-per-second",
    "--max-background-responses",
    "--priority-scheduler-enabled",
    "--priority-scheduler-default-max-class",
    "--priority-scheduler-config",
    "--priority-scheduler-tenant-metric-top-n",
    "--tenant-rate-limit-enabled",
    "--tenant-rate-limit-config",
    "--retry-max-retries",
    "--retry-initial-backoff-ms",
    "--retry-max-backoff-ms",
    "--retry-backoff-multiplier",
    "--retry-jitter-factor",
    "--disable-retries",
    "--cb-failure-threshold",
    "--cb-success-threshold",
    "--cb-timeout-duration-secs",
    "--cb-window-duration-secs",
    "--disable-circuit-breaker",
    "--health-failure-threshold",
    "--health-success-threshold",
    "--health-check-timeout-secs",
    "--health-check-interval-secs",
    "--health-check-endpoint",
    "--disable-health-check",
    "--remove-unhealthy-workers",
    "--no-remove-unhealthy-workers",
    "--worker-auto-recovery",
    "--no-worker-auto-recovery",
    "--model-path",
    "--model",
    "--tokenizer-path",
    "--chat-template",
    "--disable-tokenizer-autoload",
    "--parser",
    "--tokenizer-cache-enable-l0",
    "--tokenizer-cache-l0-max-entries",
    "--tokenizer-cache-enable-l1",
    "--tokenizer-cache-l0-max-memory",
    "--tokenizer-cache-l1-max-memory",
    "--reasoning-parser",
    "--tool-call-parser",
    "--mcp-config-path",
    "--backend",
    "--zmq-engine-count",
    "--enable-wasm",
    "--storage-hook-wasm-path",
    "--history-backend",
    "--history-memory-max-responses",
    "--history-memory-max-items",
    "--history-memory-retention-secs",
    "--oracle-wallet-path",
    "--oracle-tns-alias",
    "--oracle-connect-descriptor",
    "--oracle-username",
    "--oracle-password",
    "--oracle-external-auth",
    "--oracle-pool-min",
    "--oracle-pool-max",
    "--oracle-pool-timeout-secs",
    "--postgres-db-url",
    "--postgres-pool-max",
    "--postgres-op-timeout-secs",
    "--redis-url",
    "--redis-pool-max",
    "--redis-retention-days",
    "--redis-op-timeout-secs",
    "--schema-config",
    "--client-cert-path",
    "--client-key-path",
    "--ca-cert-paths",
    "--tls-cert-path",
    "--tls-key-path",
    "--enable-trace",
    "--otlp-traces-endpoint",
    "--api-key",
    "--tenant-api-key",
    "--control-plane-api-keys",
    "--control-plane-audit-enabled",
    "--jwt-issuer",
    "--jwt-audience",
    "--jwt-jwks-uri",
    "--jwt-role-mapping",
    "--enable-mesh",
    "--mesh-server-name",
    "--mesh-host",
    "--mesh-advertise-host",
    "--mesh-port",
    "--mesh-peer-urls",
    "--mesh-tls-ca-cert",
    "--mesh-tls-cert",
    "--mesh-tls-key",
)

_STORE_TRUE = {
    "--upstream-http2",
    "--worker-overload-protection",
    "--disable-worker-overload-protection",
    "--worker-overload-shed",
    "--dp-aware",
    "--routing-key-override",
    "--sticky-sessions",
    "--dp-minimum-tokens-scheduler",
    "--enable-igw",
    "--enable-rl",
    "--pd-disaggregation",
    "--epd-disaggregation",
    "--disable-load-monitoring",
    "--mm-pixel-rdma",
    "--mm-allow-private-media-hosts",
    "--log-mm-timing",
    "--log-json",
    "--service-discovery",
    "--trust-tenant-header",
    "--priority-scheduler-enabled",
    "--tenant-rate-limit-enabled",
    "--disable-retries",
    "--disable-circuit-breaker",
    "--disable-health-check",
    "--remove-unhealthy-workers",
    "--no-remove-unhealthy-workers",
    "--worker-auto-recovery",
    "--no-worker-auto-recovery",
    "--disable-tokenizer-autoload",
    "--tokenizer-cache-enable-l0",
    "--tokenizer-cache-enable-l1",
    "--enable-wasm",
    "--oracle-external-auth",
    "--enable-trace",
    "--control-plane-audit-enabled",
    "--enable-mesh",
}
# Flags whose plain value would fail fastroute's own validation, with one it accepts.
_VALUES = {
    "--host": "127.0.0.1",
    "--port": "1",
    "--worker-urls": "http://w:1",
    "--upstream-pool-idle-timeout-secs": "0",
    "--health-check-port": "2",
    "--policy": "random",
    "--prefill-policy": "random",
    "--decode-policy": "random",
    "--cache-threshold": "0.4",
    "--cache-match-threshold": "0.4",
    "--power-of-two-load-metric": "requests",
    "--balance-abs-threshold": "3",
    "--spill-abs-threshold": "3",
    "--balance-rel-threshold": "1.2",
    "--spill-rel-threshold": "1.2",
    "--log-level": "info",
    "--prefill": "http://p:1",
    "--decode": "http://d:1",
    "--load-monitor-interval": "1",
    "--prometheus-duration-buckets": "1",
    "--health-check-endpoint": "/health",
    "--control-plane-api-keys": "a:b:admin:k",
    "--cors-allowed-origins": "*",
    "--request-id-headers": "x-id",
    "--routing-key-headers": "x-key",
    "--retry-jitter-factor": "0.1",
    "--retry-backoff-multiplier": "2",
    "--tls-cert-path": None,
    "--tls-key-path": None,
}


def _line(flag: str) -> list[str]:
    if flag in ("--tls-cert-path", "--tls-key-path"):
        return ["--tls-cert-path", "c.pem", "--tls-key-path", "k.pem"]
    if flag in ("--prefill", "--decode"):
        return ["--pd-disaggregation", flag, _VALUES[flag]]
    if flag in _STORE_TRUE:
        return [flag]
    return [flag, _VALUES.get(flag, "5")]


@pytest.mark.parametrize("flag", SMG_1_13_FLAGS)
def test_every_smg_flag_starts_or_refuses_by_name(flag: str, capsys, monkeypatch) -> None:
    monkeypatch.delenv("CONTROL_PLANE_API_KEYS", raising=False)
    try:
        parse_args(_line(flag))
    except SystemExit as exc:
        err = capsys.readouterr().err
        assert exc.code == 2
        assert "unrecognized arguments" not in err, err
        row = flags.lookup(flag)
        if row is None:
            # A flag fastroute implements with a setting of its own may still be refused for a
            # value or a missing companion (e.g. --service-discovery without a selector): the
            # message names the flag at fault.
            assert re.search(r"argument --[\w-]+: ", err), err
            return
        assert row.status == flags.REFUSED, err
        assert f"argument {flag}: not supported by fastroute" in err, err


def test_refused_flags_name_themselves_and_neutral_values_start(capsys) -> None:
    for row in flags.TABLE:
        if row.status != flags.REFUSED or row.family or row.parsed:
            continue
        with pytest.raises(SystemExit):
            parse_args([row.name, "0.5"] if row.neutral else [row.name])
        assert f"argument {row.name}: not supported by fastroute" in capsys.readouterr().err
    neutral = {
        "--worker-warmup-secs": "0",
        "--selection-temperature": "0.0",
        "--overlap-decay": "0",
        "--cache-index": "tree",
        "--selection-policy": "cache-aware-default",
        "--balance-token-usage-threshold": "1.0",
        "--worker-overload-token-usage": "1",
        "--prefill-max-inflight-requests-per-worker": "-1",
        "--worker-stall-secs": "0",
    }
    for flag, value in neutral.items():
        parse_args([flag, value])
    # Implemented since the inventory was written: no longer refused.
    assert parse_args(["--rate-limit-tokens-per-second", "100"]).rate_limit_tokens_per_second == 100


def test_inert_flags_warn_once_with_the_reason(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="fastroute.config"):
        parse_args(
            [
                "--upstream-http2",
                "--router-upstream-http2",
                "--jemalloc-prof-dir",
                "x",
                "--remove-unhealthy-workers",
                "--disable-worker-overload-protection",
            ]
        )
    lines = [r.getMessage() for r in caplog.records]
    assert [line.split()[0] for line in lines] == [
        "--upstream-http2",
        "--jemalloc-prof-dir",
        "--remove-unhealthy-workers",
    ]
    assert all("(" in line and line.endswith(")") for line in lines)


def test_aliases_of_fastroute_flags() -> None:
    c = parse_args(
        ["--cache-match-threshold", "0.4", "--spill-abs-threshold", "9", "--spill-rel-threshold", "2.5", "--log-json"]
    )
    assert (c.cache_threshold, c.balance_abs_threshold, c.balance_rel_threshold, c.log_json) == (0.4, 9, 2.5, True)


def test_table_is_consistent() -> None:
    names = [f.name for f in flags.TABLE]
    assert len(names) == len(set(names))
    assert all(f.status in flags.STATUSES and f.reason for f in flags.TABLE)
    # Every named row is a flag the parser knows (families are stripped before argparse).
    own = {s for a in build_parser()._actions for s in a.option_strings}
    for f in flags.TABLE:
        if not f.family and not f.parsed:
            assert f.name in own


def test_docs_carry_the_generated_table() -> None:
    page = (REPO / "docs" / "flags.md").read_text()
    assert flags.markdown() in page, "regenerate with: python -m fastroute.config.flags"


def test_help_calls_no_refused_or_security_flag_ignored() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "fastroute", "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    ).stdout
    assert "accepted and ignored" not in out
    refused = out.split("Refused (not implemented):", 1)[1]
    assert "ignored" not in refused
    for flag in (
        "--tls-cert-path",
        "--control-plane-api-keys",
        "--health-check-port",
        "--jwt-*",
        "--service-discovery",
    ):
        assert flag in out


def test_settings_without_their_companion_warn_once(caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="fastroute.config"):
        parse_args(["--assignment-mode", "min_load", "--replica-id", "r1", "--policy", "random"])
    lines = [r.getMessage() for r in caplog.records]
    assert any(
        line.startswith("--assignment-mode is accepted and ignored") and "--policy manual" in line for line in lines
    ), lines
    assert any(line.startswith("--replica-id is accepted and ignored") for line in lines), lines
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="fastroute.config"):
        parse_args(["--assignment-mode", "min_load", "--policy", "manual"])
    assert not [r for r in caplog.records if "--assignment-mode" in r.getMessage()]
