"""RequestTelemetry's end-of-response event against the response count and duration it stands for,
and the labels ``routed`` keeps on the request."""

from __future__ import annotations

import pytest

from fastroute.control.metrics import Stats
from fastroute.dataplane._clock import monotonic
from fastroute.dataplane.body import RequestMeta
from fastroute.dataplane.routes import ENDPOINT_LABEL
from fastroute.dataplane.telemetry import NULL_TELEMETRY, PathLabels, RequestTelemetry


def _counts(stats: Stats) -> tuple[dict, dict, dict]:
    durations = {k: h.count for k, h in stats.router_duration.items()}
    return dict(stats.http_responses), durations, dict(stats.router_errors)


@pytest.mark.parametrize("status", [200, 201, 204, 404, 499, 503, 599])
@pytest.mark.parametrize("path", [b"/generate", b"/v1/chat/completions", b"/v1/completions"])
@pytest.mark.parametrize("through_routed", [True, False])
def test_done_counts_what_response_and_duration_count(status: int, path: bytes, through_routed: bool) -> None:
    started = monotonic()
    separate, combined = Stats(), Stats()
    a, b = RequestTelemetry(separate, "pd"), RequestTelemetry(combined, "pd")
    meta = RequestMeta({}, model="m1", path=path.decode())
    if through_routed:
        meta.labels = b.routed(path, meta)
        assert isinstance(meta.labels, PathLabels)
        a.routed(path, RequestMeta({}, model="m1"))
    a.response(status, "", path)
    if 200 <= status < 300:  # the duration histogram of (backend, endpoint, model)
        separate.observe(separate.router_duration, ("pd", ENDPOINT_LABEL[path], "m1"), 0.0)
    b.done(status, path, meta, started)
    assert _counts(combined) == _counts(separate)
    responses, durations, _ = _counts(combined)
    assert sum(responses.values()) == 1
    assert sum(durations.values()) == (1 if 200 <= status < 300 else 0)


def test_labels_past_the_model_bound_still_count_once() -> None:
    stats = Stats()
    tel = RequestTelemetry(stats, "regular")
    metas = [RequestMeta({}, model=f"m{i}") for i in range(80)]
    for meta in metas:
        meta.labels = tel.routed(b"/generate", meta)
        tel.done(200, b"/generate", meta, monotonic())
    assert stats.http_responses == {("200", "", "/generate"): 80}
    assert sum(h.count for h in stats.router_duration.values()) == 80
    assert ("regular", "generate", "other") in stats.router_duration


def test_metrics_off_keeps_no_labels() -> None:
    meta = RequestMeta({}, model="m1")
    assert NULL_TELEMETRY.routed(b"/generate", meta) is None
    NULL_TELEMETRY.done(200, b"/generate", meta, monotonic())  # nothing to count, nothing raised


@pytest.mark.parametrize("through_routed", [True, False])
def test_ttft_is_counted_under_the_request_model(through_routed: bool) -> None:
    stats = Stats()
    tel = RequestTelemetry(stats, "pd")
    meta = RequestMeta({}, model="m2")
    if through_routed:
        meta.labels = tel.routed(b"/v1/chat/completions", meta)
    tel.ttft(b"/v1/chat/completions", meta, monotonic())
    assert {k: h.count for k, h in stats.pd_ttft.items()} == {"m2": 1}
