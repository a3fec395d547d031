"""Pure helpers of bench/overhead.py: wrk report parsing, /proc stat parsing, percentiles, the
markdown table and bars, nginx template rendering. No sockets, no processes, no real runs."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "overhead.py"
_spec = importlib.util.spec_from_file_location("bench_overhead", _PATH)
assert _spec is not None and _spec.loader is not None
ov = importlib.util.module_from_spec(_spec)
sys.modules["bench_overhead"] = ov  # dataclasses resolve annotations through sys.modules
_spec.loader.exec_module(ov)

WRK_FULL = """Running 8s test @ http://127.0.0.1:40000
  1 threads and 256 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency    15.21ms    3.10ms 212.40ms   91.00%
    Req/Sec    16.90k     1.02k   18.20k    80.00%
  Latency Distribution
     50%   14.80ms
     75%  812.00us
     90%    1.50s
     99%    2.00m
  134512 requests in 8.00s, 51.30MB read
  Socket errors: connect 0, read 3, write 1, timeout 2
  Non-2xx or 3xx responses: 7
Requests/sec:  16813.42
Transfer/sec:      6.41MB
"""

WRK_CLEAN = """Running 2s test @ http://127.0.0.1:40000
  1 threads and 64 connections
  Latency Distribution
     50%  500.00us
     75%  600.00us
     90%  700.00us
     99%    1.00ms
  2000 requests in 2.00s, 1.00MB read
Requests/sec:   1000.00
Transfer/sec:    512.00KB
"""


def test_parse_wrk_full_report() -> None:
    r = ov.parse_wrk(WRK_FULL)
    assert r["rps"] == pytest.approx(16813.42)
    assert r["requests"] == 134512 and r["seconds"] == pytest.approx(8.0)
    assert r["non2xx"] == 7 and r["socket_errors"] == 6
    assert r["p50"] == pytest.approx(0.0148)
    assert r["p75"] == pytest.approx(812e-6)
    assert r["p90"] == pytest.approx(1.5)
    assert r["p99"] == pytest.approx(120.0)


def test_parse_wrk_without_error_lines_counts_zero() -> None:
    r = ov.parse_wrk(WRK_CLEAN)
    assert (r["non2xx"], r["socket_errors"], r["requests"]) == (0, 0, 2000)
    assert r["p99"] == pytest.approx(1e-3)


@pytest.mark.parametrize("text", ["", "unable to connect to 127.0.0.1:1 Connection refused\n"])
def test_parse_wrk_rejects_failed_run(text: str) -> None:
    with pytest.raises(ValueError):
        ov.parse_wrk(text)


def test_parse_duration_rejects_garbage() -> None:
    assert ov.parse_duration("3.00s") == 3.0
    with pytest.raises(ValueError):
        ov.parse_duration("3 parsecs")


def test_parse_proc_stat_with_odd_command_name() -> None:
    # comm with spaces and a ')' must not shift the fields; ticks = utime+stime+cutime+cstime.
    fields = ["S", "42"] + ["0"] * 9 + ["100", "20", "3", "4"] + ["0"] * 30
    line = "1234 (smg worker) x) " + " ".join(fields)
    assert ov.parse_proc_stat(line) == (42, 127)


def test_percentile_nearest_rank() -> None:
    vals = sorted(float(i) for i in range(1, 101))
    assert ov.percentile(vals, 50) == 50.0
    assert ov.percentile(vals, 99) == 99.0
    assert ov.percentile(vals, 100) == 100.0
    assert ov.percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        ov.percentile([], 50)


def test_summarize_medians_and_summed_errors() -> None:
    med = ov.summarize({"fastroute": {"json_c256_rps": [3.0, 1.0, 2.0, None], "errors": [1.0, 0.0, 2.0]}})
    assert med["fastroute"] == {"json_c256_rps": 2.0, "errors": 3.0}


def _med() -> dict[str, dict[str, float | None]]:
    return {
        "direct": {"json_c256_rps": 100000.0, "json_c1_add_p50": 0.0, "json_c256_cpu": 5.0},
        "bare": {"json_c256_rps": 20000.0, "json_c1_add_p50": 40.0, "sse_c256_rps": 10000.0},
        "fastroute": {
            "json_c256_rps": 16000.0,
            "json_c1_add_p50": 30.0,
            "sse_c256_rps": 9000.0,
            "sse_c1_add_p50": -3.0,
            "errors": 0.0,
        },
        "smg": {
            "json_c256_rps": 4000.0,
            "json_c1_add_p50": 300.0,
            "sse_c256_rps": 5000.0,
            "sse_c1_add_p50": 200.0,
            "errors": 5.0,
        },
    }


def _row(table: str, label: str) -> list[str]:
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == label:
            return cells
    raise AssertionError(f"row {label!r} missing in\n{table}")


def test_build_table_values_and_ratios() -> None:
    table = ov.build_table("regular", _med(), ov.ROUTERS)
    head = _row(table, "metric")
    # sglang-router has no results: no column, and its ratio cells stay empty.
    assert head == [
        "metric",
        "direct",
        "bare",
        "fastroute",
        "smg",
        "fastroute/smg",
        "fastroute/sglang-router",
        "fastroute/bare",
    ]
    assert _row(table, "JSON c=256 req/s") == [
        "JSON c=256 req/s",
        "100,000",
        "20,000",
        "16,000",
        "4,000",
        "4.00x",
        "",
        "0.80x",
    ]
    added = _row(table, "JSON c=1 **added** p50 (us)")
    assert added[1] == "-"  # direct has no added latency of its own
    assert added[3] == "30.0" and added[5] == "0.10x" and added[7] == "0.75x"
    # A non-positive added latency has no meaningful ratio.
    assert _row(table, "SSE c=1 **added** p50 (us)")[5] == ""
    assert _row(table, "router CPU per req, JSON c=256 (us)")[1] == "-"
    assert _row(table, "errors (non-2xx + socket), all runs")[4] == "5"
    assert table.startswith("### mode: regular")


def test_check_bars_verdicts() -> None:
    bars = "\n".join(ov.check_bars("pd", _med()))
    assert re.search(r"json_c256_rps: fastroute/smg = 4.00x .*PASS", bars)
    assert re.search(r"json_c256_rps: fastroute/bare = 0.80x .*PASS", bars)
    assert re.search(r"sse_c256_rps: fastroute/smg = 1.80x .*FAIL", bars)
    assert re.search(r"json_c1_add_p50: fastroute 30 us vs smg 300 us .*PASS", bars)
    missing = ov.check_bars("pd", {"fastroute": {}})
    assert all("n.a." in line for line in missing)


def test_nginx_quote() -> None:
    assert ov.nginx_quote("a'b\\c\nd") == "a\\'b\\\\c\\nd"
    with pytest.raises(ValueError):
        ov.nginx_quote("costs $5")


def test_worker_bodies_shapes() -> None:
    b = ov.worker_bodies("decode", 8, None)
    info = json.loads(b["SERVER_INFO"])
    assert info["dp_size"] == 8 and info["served_model_name"] == ov.MODEL
    loads = json.loads(b["LOADS"])
    assert [x["dp_rank"] for x in loads["loads"]] == list(range(8))
    assert loads["dp_rank_count"] == 8
    assert len(json.loads(b["GET_LOAD"])) == 8
    assert 150 <= len(b["GENERATE"]) <= 300
    events = b["SSE"].split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert len(events) == 18 and all(e.startswith("data: {") for e in events[:16])


def test_write_nginx_fills_every_placeholder(tmp_path: Path) -> None:
    be = ov.Backends(regular=[20001, 20002], prefill=20003, decode=20004, bootstrap=20005)
    text = ov.write_nginx(tmp_path, be).read_text()
    assert not re.search(r"@[A-Z_]+@", text)
    for port in (20001, 20002, 20003, 20004, 20005):
        assert f"listen 127.0.0.1:{port}" in text
    assert f"pid {tmp_path}/nginx.pid;" in text and "daemon off;" in text
    with pytest.raises(ValueError):
        ov.fill("x @MISSING@", {})


def test_base_checkout_column_only_when_measured() -> None:
    med = _med()
    med["fastroute-base"] = dict(med["fastroute"], json_c256_rps=20_000.0)
    table = ov.build_table("regular", med, ov.ROUTERS)
    head = _row(table, "metric")
    assert head[-1] == "fastroute/base" and "fastroute-base" in head
    assert _row(table, "JSON c=256 req/s")[-1] == "0.80x"
    assert "fastroute/base" not in ov.build_table("regular", _med(), ov.ROUTERS)
