"""The router's shared vocabulary, defined once: policy names (fastroute's and the peers'), load
metrics, demand and KV-fit modes, circuit states, target names, the DP rank body fields, log
levels, discovery providers and the environment variables the config reads.

Pure Python with no imports of its own, so every ring (config, core, data plane, control plane)
can use it without pulling anything else in. The compiled kernels take the integer codes below.
"""

from __future__ import annotations

POLICIES: tuple[str, ...] = ("random", "round_robin", "cache_aware", "power_of_two", "consistent_hashing", "manual")

# --assignment-mode of the manual policy (how a new routing key is placed); the code is what
# the compiled KeyTable takes.
ASSIGNMENT_MODES: tuple[str, ...] = ("random", "min_load", "min_group")
ASSIGNMENT_MODE_CODE: dict[str, int] = {name: i for i, name in enumerate(ASSIGNMENT_MODES)}

# power_of_two load metrics; the integer code is what the compiled Picker takes.
LOAD_METRICS: tuple[str, ...] = ("tokens", "requests", "least_requests")
LOAD_METRIC_CODE: dict[str, int] = {name: i for i, name in enumerate(LOAD_METRICS)}
# No aliases: smg's `expected_wait` is another score, not a spelling of `tokens`; it parses
# and is refused at start-up (fastroute.config.checks.EXPECTED_WAIT_REFUSAL says why).
LOAD_METRIC_ALIASES: dict[str, str] = {}
REFUSED_LOAD_METRICS: tuple[str, ...] = ("expected_wait",)

# --decode-input-demand and --decode-kv-fit share these modes and codes.
MODES: tuple[str, ...] = ("off", "shadow", "on")
# --kv-events: subscribe where a worker advertises its publishers, or never.
KV_EVENTS_MODES: tuple[str, ...] = ("auto", "off")
MODE_CODE: dict[str, int] = {name: i for i, name in enumerate(MODES)}

# Circuit states as stored in the table's COL_CIRCUIT cell (the kernels skip OPEN).
CIRCUIT_CLOSED, CIRCUIT_OPEN, CIRCUIT_HALF_OPEN = 0, 1, 2
CIRCUIT_STATE_NAMES: dict[int, str] = {CIRCUIT_CLOSED: "closed", CIRCUIT_OPEN: "open", CIRCUIT_HALF_OPEN: "half_open"}


def target_name(url: str, rank: int | None) -> str:
    """A target's name: the worker URL, or ``url@rank`` for one DP rank under --dp-aware."""
    return url if rank is None else f"{url}@{rank}"


def label_value(s: str) -> str:
    """``s`` as a metric label value that always encodes as UTF-8: a code point UTF-8 cannot
    carry (a lone surrogate, from a JSON ``\\ud800`` escape in a request's "model" or a
    worker's served_model_name) is written as its ``\\uXXXX`` escape instead, so one such value
    can never make every later scrape fail."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return s.encode("utf-8", "backslashreplace").decode("utf-8")


# Every policy name the peers' CLIs accept (sglang-router 0.3.2 + smg 1.13.0), so that any
# existing command line parses; only POLICIES actually run. The rest are rejected at
# start-up by name rather than silently remapped to something with different behaviour.
ALL_POLICIES: tuple[str, ...] = (
    "random",
    "round_robin",
    "cache_aware",
    "power_of_two",
    "manual",
    "consistent_hashing",
    "prefix_hash",
    "least_load",
    "passthrough",
)
PREFILL_ONLY_POLICIES: tuple[str, ...] = ("bucket",)
DP_RANK_FIELDS: tuple[str, ...] = ("routed_dp_rank", "data_parallel_rank")
# Stored as Python logging level names; `warn` (the peers' spelling) is normalised to `warning`.
LOG_LEVELS: tuple[str, ...] = ("debug", "info", "warning", "error", "critical")
# Where --service-discovery finds workers.
DISCOVERY_PROVIDERS: tuple[str, ...] = ("kubernetes", "file")

# Environment variables read when the matching flag is not given.
ENV_P2C_LOAD_METRIC = "SGLANG_ROUTER_P2C_LOAD_METRIC"
ENV_DECODE_REQUEST_WEIGHT = "FASTROUTE_DECODE_REQUEST_WEIGHT"
ENV_CONTROL_PLANE_API_KEYS = "CONTROL_PLANE_API_KEYS"

# The policies --speed-aware places beside (stateless ones: the speed pick replaces theirs).
SPEED_POLICIES = ("power_of_two", "random", "round_robin")
