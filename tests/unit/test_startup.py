"""The start-up banner, the security posture warning, the port-in-use line and --log-json's
formatter (fastroute.runtime.startup, fastroute.log)."""

from __future__ import annotations

import errno
import json
import logging

from fastroute.config import Config
from fastroute.log import JsonFormatter
from fastroute.runtime.startup import banner, bind_error, posture_warnings


def test_banner_names_mode_policies_sources_and_scheme() -> None:
    c = Config(
        pd_disaggregation=True,
        prefill=[("http://p:1", None)],
        decode=["http://d:1"],
        decode_policy="power_of_two",
        p2c_load_metric="requests",
        load_metric_source="flag",
        decode_input_demand="shadow",
        decode_request_weight=4,
        decode_kv_fit="on",
        decode_kv_reserve_tokens=64,
        tls_cert_path="c",
        tls_key_path="k",
        host="10.0.0.1",
    )
    text = banner(c, 8443, 4)
    assert text.startswith("fastroute ") and "https://10.0.0.1:8443 (4 proxy processes)" in text
    assert "mode: PD disaggregation" in text and "prefill policy: cache_aware" in text
    assert "decode policy: power_of_two, load metric requests (from flag)" in text
    assert "decode input demand: shadow, W=4" in text and "KV fit: on, reserve 64" in text


def test_posture_warns_only_when_reachable_and_open() -> None:
    assert len(posture_warnings(Config(host="0.0.0.0"))) == 2
    assert posture_warnings(Config(host="127.0.0.1", prometheus_host="127.0.0.1")) == []
    keyed = posture_warnings(Config(host="0.0.0.0", api_key="k", prometheus_host="::1"))
    assert keyed == []
    (line,) = posture_warnings(Config(host="0.0.0.0", prometheus_host="127.0.0.1"))
    assert "register a worker and receive users' prompts" in line


def test_port_in_use_is_one_line_naming_the_flag() -> None:
    exc = bind_error("--prometheus-port", "0.0.0.0", 29000, OSError(errno.EADDRINUSE, "in use"))
    assert str(exc).startswith("port 29000 is already in use (--prometheus-port")
    assert "\n" not in str(exc)


def test_json_formatter_carries_extra_fields() -> None:
    rec = logging.LogRecord("fastroute.workers", logging.INFO, "f", 1, "hello %s", ("x",), None)
    rec.outcome = "denied"
    doc = json.loads(JsonFormatter().format(rec))
    assert doc["message"] == "hello x" and doc["level"] == "INFO" and doc["outcome"] == "denied"
    assert doc["logger"] == "fastroute.workers" and isinstance(doc["pid"], int) and doc["time"]


def test_zero_pool_idle_timeout_stays_zero() -> None:
    assert Config(upstream_pool_idle_timeout_secs=0).upstream_pool_idle_timeout_secs == 0.0
