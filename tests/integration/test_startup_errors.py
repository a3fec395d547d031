"""Every start-up refusal is one line on stderr, like smg's: ``fastroute: error: ...``, or
with ``--log-json`` one JSON object like every other line; never a traceback or a usage block.
Each case runs the real ``python -m fastroute`` (``--workers 2`` for the port clash too)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

# case -> (extra argv, what the one line must name, exit status); "{busy}" is a port in use.
CASES = {
    "port_in_use": (["--port", "{busy}"], "already in use (--port", 1),
    "port_in_use_workers_2": (["--port", "{busy}", "--workers", "2"], "already in use (--port", 1),
    "probe_port_in_use": (["--health-check-port", "{busy}"], "(--health-check-port", 1),
    "argparse_bad_int": (["--port", "x"], "argument --port: invalid int value", 2),
    "argparse_unknown_flag": (["--no-such-flag", "1"], "unrecognized arguments: --no-such-flag", 2),
    "missing_ca_cert_file": (
        ["--worker-urls", "https://127.0.0.1:1", "--ca-cert-paths", "/nonexistent/ca.pem"],
        "--ca-cert-paths /nonexistent/ca.pem",
        1,
    ),
    "missing_tls_cert": (
        ["--tls-cert-path", "/nonexistent/c.pem", "--tls-key-path", "/nonexistent/k.pem"],
        "--tls-cert-path /nonexistent/c.pem",
        1,
    ),
    "refused_flag": (["--jwt-issuer", "https://idp"], "argument --jwt-issuer", 2),
    "config_error": (["--decode-request-weight", "3"], "--decode-request-weight", 2),
    # No key on an address others reach: refused, naming the flag that opens it (issue 50).
    "open_admin": (["--host", "0.0.0.0"], "argument --allow-open-admin: the worker admin API on 0.0.0.0", 2),
}


@pytest.fixture(scope="module")
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def _start(argv: list[str]) -> subprocess.CompletedProcess:
    base = [
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        "0",
        "--log-level",
        "warning",
    ]
    return subprocess.run(
        [sys.executable, "-m", "fastroute", *base, *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )


# Text lines that were one line already (tests/unit/test_startup.py and others cover them).
_TEXT_BEFORE = {"port_in_use", "port_in_use_workers_2", "probe_port_in_use", "missing_tls_cert"}
_PARAMS = [
    pytest.param(c, j, id=f"{c}-{'json' if j else 'text'}")
    for c in sorted(CASES)
    for j in (False, True)
    if j or c not in _TEXT_BEFORE
]


@pytest.mark.parametrize("case, json_lines", _PARAMS)
def test_a_start_up_refusal_is_one_line(case: str, json_lines: bool, busy_port: int) -> None:
    extra, needle, status = CASES[case]
    argv = [a.replace("{busy}", str(busy_port)) for a in extra]
    out = _start(argv + (["--log-json"] if json_lines else []))
    assert out.returncode == status, out.stderr
    lines = out.stderr.splitlines()
    assert "Traceback" not in out.stderr and not any(line.startswith("usage:") for line in lines)
    if json_lines:
        docs = [json.loads(line) for line in lines]  # every line is one JSON object
        errors = [d for d in docs if d["level"] == "ERROR"]
        assert len(errors) == 1, out.stderr
        assert errors[0]["event"] == "startup_error" and needle in errors[0]["message"]
    else:
        errors = [line for line in lines if line.startswith("fastroute: error: ")]
        assert len(errors) == 1 and needle in errors[0], out.stderr
        assert [line for line in lines if "ERROR" in line or "error" in line.lower()] == errors
