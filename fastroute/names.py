"""The router's shared vocabulary, defined once: policy names, load metrics, demand and KV-fit
modes, circuit states and target names.

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
# and is refused at start-up (fastroute.checks.EXPECTED_WAIT_REFUSAL says why).
LOAD_METRIC_ALIASES: dict[str, str] = {}
REFUSED_LOAD_METRICS: tuple[str, ...] = ("expected_wait",)

# --decode-input-demand and --decode-kv-fit share these modes and codes.
MODES: tuple[str, ...] = ("off", "shadow", "on")
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
