"""The ``--speed-aware`` series (fits in ``fastroute.core.speed``), collected at scrape time:

* ``fastroute_server_step_seconds{worker}``: a decode server's fitted step at its busiest rank's
  in-flight requests now;
* ``fastroute_server_step_base_seconds{worker}`` and ``fastroute_server_step_per_request_seconds{worker}``:
  the fitted line ``a + b n``;
* ``fastroute_server_step_samples{worker}``: step samples taken, and
  ``fastroute_server_step_regime_changes{worker}``: times the fit saw a change of speed and
  forgot its history;
* ``fastroute_prefill_tokens_per_second{target}``: a prefill rank's measured rate;
* ``fastroute_speed_aware_decisions{result}``: speed-aware picks that agreed or disagreed with
  the policy's (shadow), or were left to it (fallback), decode and prefill;
* ``fastroute_slo_requests{class,result}``: requests carrying a TTFT or TPOT target (``class``)
  placed on a rank predicted to meet it, placed best effort, refused, and, for streams, measured
  to have met or missed it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


def speed_families(book: Any) -> Iterator[Any]:
    if book is None:
        return
    rep = book.report()
    step = GaugeMetricFamily(
        "fastroute_server_step_seconds",
        "Fitted decode step of the server at its busiest rank's in-flight requests",
        labels=["worker"],
    )
    base = GaugeMetricFamily("fastroute_server_step_base_seconds", "Fitted step at no request (a)", labels=["worker"])
    per = GaugeMetricFamily(
        "fastroute_server_step_per_request_seconds",
        "Fitted step per request of the busiest rank (b)",
        labels=["worker"],
    )
    samples = CounterMetricFamily("fastroute_server_step_samples", "Step samples taken", labels=["worker"])
    shifts = CounterMetricFamily(
        "fastroute_server_step_regime_changes", "Changes of speed the fit followed", labels=["worker"]
    )
    for url, s in rep["decode_servers"].items():
        samples.add_metric([url], float(s["samples"]))
        shifts.add_metric([url], float(s["regime_changes"]))
        if s["step_seconds"] is not None:
            step.add_metric([url], s["step_seconds"])
            base.add_metric([url], s["base_seconds"])
            per.add_metric([url], s["per_request_seconds"])
    rate = GaugeMetricFamily(
        "fastroute_prefill_tokens_per_second", "Measured prefill rate of the rank", labels=["target"]
    )
    for name, r in rep["prefill_ranks"].items():
        if r["tokens_per_second"] is not None:
            rate.add_metric([name], r["tokens_per_second"])
    dec = CounterMetricFamily(
        "fastroute_speed_aware_decisions", "Speed-aware picks: agree/disagree (shadow), fallback", labels=["result"]
    )
    for k, v in rep["placements"].items():
        dec.add_metric([k], float(v))
    slo = CounterMetricFamily(
        "fastroute_slo_requests",
        "Requests with a latency target: placed, best_effort, refused, met, missed",
        labels=["class", "result"],
    )
    for cls, results in rep["slo"].items():
        for result, n in results.items():
            slo.add_metric([cls, result], float(n))
    yield from (step, base, per, samples, shifts, rate, dec, slo)
