"""Every router flag under ``fastroute epp`` and what it does there: the table docs/epp.md shows
and a test holds to the parser (tests/unit/test_epp_unit.py)."""

from __future__ import annotations

from fastroute.epp.options import FLOW_FLAGS, INERT_FLAGS

# Every router flag under fastroute epp, and what it does there (docs/epp.md has the table; a
# test holds it to the parser): "picker" works as in the proxy, in the picker; "envoy" works
# through the printed bootstrap (pass it to --print-envoy-config too); "inert" is accepted with
# one warning (it cannot change who gets in, where requests go or readiness; the PD selectors
# are refused, as in the proxy, beside --service-discovery outside PD mode; the PD policy flags
# and --dp-rank-field warn only in the mode where they do nothing); "refused" stops the start
# naming it (the flags of retries and circuits only when not at their default). PD
# (--pd-disaggregation, --prefill, --decode) needs --sidecar-port.
WORKS, ENVOY, INERT, REFUSED = "picker", "envoy", "inert", "refused"
AUDIT: dict[str, str] = {
    **{
        f: WORKS
        for f in (
            "--host",
            "--worker-urls",
            "--api-key",
            "--dp-aware",
            "--worker-startup-timeout-secs",
            "--worker-startup-check-interval",
            "--shutdown-grace-period-secs",
            "--allow-link-local-workers",
            "--max-targets-per-worker",
            "--max-targets",
            "--health-check-port",
            "--policy",
            "--p2c-load-metric",
            "--replica-sync",
            "--replica-id",
            "--replica-sync-interval-ms",
            "--replica-ttl-ms",
            "--load-monitor-interval",
            "--disable-load-monitoring",
            "--routing-key-headers",
            "--assignment-mode",
            "--max-idle-secs",
            "--max-manual-keys",
            "--cache-threshold",
            "--balance-abs-threshold",
            "--balance-rel-threshold",
            "--eviction-interval-secs",
            "--max-tree-size",
            "--disable-retries",
            "--disable-circuit-breaker",
            "--health-failure-threshold",
            "--health-success-threshold",
            "--health-check-timeout-secs",
            "--health-check-interval-secs",
            "--health-check-endpoint",
            "--disable-health-check",
            "--max-concurrent-requests",
            "--queue-size",
            "--rate-limit-tokens-per-second",
            "--prometheus-host",
            "--prometheus-port",
            "--log-level",
            "--log-json",
            "--log-dir",
            "--decode-input-demand",
            "--decode-request-weight",
            "--seed",
            "--workers",
            "--decode-kv-fit",
            "--cache-aware-rank-slack",
            "--decode-kv-reserve-tokens",
            "--kv-events",
            "--kv-events-endpoint",
            "--block-size",
            "--kv-events-stale-secs",
            "--kv-index-max-blocks",
            "--service-discovery",
            "--selector",
            "--service-discovery-port",
            "--service-discovery-namespace",
            "--discovery-provider",
            "--discovery-file",
            "--discovery-check-interval-secs",
            "--pd-disaggregation",
            "--prefill",
            "--decode",
        )
    },
    **{
        f: ENVOY
        for f in (
            "--request-timeout-secs",
            "--max-payload-size",
            "--queue-timeout-secs",
            "--header-read-timeout-secs",
            "--idle-connection-timeout-secs",
            "--upstream-pool-idle-timeout-secs",
            "--body-read-timeout-secs",
        )
    },
    **{
        f: INERT
        for f in (
            *(flag for _, flag, _ in INERT_FLAGS),
            "--cb-window-duration-secs",
            "--prefill-selector",
            "--decode-selector",
        )
    },
    **{
        f: REFUSED
        for f in (
            "--cors-allowed-origins",
            "--tls-cert-path",
            "--tls-key-path",
            "--tls-min-version",
            "--enable-igw",
            "--model-alias",
            "--prefill-input-demand",
            "--speed-aware",
            "--speed-slo-unmet",
            *(flag for _, flag in FLOW_FLAGS),
            "--tokenizer-path",
            "--model-path",
            "--chat-template",
            "--tokenize-timeout-ms",
            "--tokenizer-cache-enable-l0",
            "--tokenizer-cache-l0-max-entries",
            "--tokenizer-cache-l0-max-memory",
            "--tokenizer-cache-enable-l1",
            "--tokenizer-cache-l1-max-memory",
            "--retry-max-retries",
            "--retry-initial-backoff-ms",
            "--retry-max-backoff-ms",
            "--retry-backoff-multiplier",
            "--retry-jitter-factor",
            "--cb-failure-threshold",
            "--cb-success-threshold",
            "--cb-timeout-duration-secs",
        )
    },
}
