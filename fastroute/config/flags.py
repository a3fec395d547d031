"""The rule and the inventory of flags fastroute accepts but does not implement as the peers do.

The rule (fail closed): every accepted flag works as the peer's does, or it is one that cannot
change who gets in, where requests go, or whether the router becomes ready. Such a flag is
``inert``: accepted, with one warning naming it at start-up. A flag that would change any of
those and is not implemented is ``refused``: start-up fails with a one-line message naming it.
A few peer flags ask for what fastroute already does; they are ``implemented`` here (accepted
silently) because they have no field of their own in :class:`fastroute.config.Config`.

``TABLE`` is the one inventory: the CLI builds its compatibility flags from it, the config
applies it, and docs/flags.md's table is generated from it (``python -m fastroute.config.flags``; a
test checks the page against it). Flags fastroute implements with a field of their own are not listed.

Pure Python with no imports from the rest of fastroute, like :mod:`fastroute.names`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

INERT, REFUSED, IMPLEMENTED = "inert", "refused", "implemented"
STATUSES: tuple[str, ...] = (IMPLEMENTED, INERT, REFUSED)


def _zero(values: Sequence[str]) -> bool:
    """A numeric value of 0: the peer's mechanism is off, which is what fastroute does."""
    try:
        return bool(values) and all(float(v) == 0.0 for v in values)
    except ValueError:
        return False


def _at_least_one(values: Sequence[str]) -> bool:
    """A KV-usage threshold of 1.0 or more: the peer's gate never fires."""
    try:
        return bool(values) and all(float(v) >= 1.0 for v in values)
    except ValueError:
        return False


def _non_positive(values: Sequence[str]) -> bool:
    try:
        return bool(values) and all(float(v) <= 0.0 for v in values)
    except ValueError:
        return False


def _one_of(*accepted: str) -> Callable[[Sequence[str]], bool]:
    def check(values: Sequence[str]) -> bool:
        return bool(values) and all(v.strip().lower() in accepted for v in values)

    check.__doc__ = "one of " + ", ".join(accepted)
    return check


@dataclass(frozen=True)
class Flag:
    """One row: ``name`` is a flag, or a family prefix ending in '-' (``--jwt-``)."""

    name: str
    status: str
    reason: str
    # For a refused flag: values that ask for what fastroute already does (then it starts).
    neutral: Callable[[Sequence[str]], bool] | None = None
    # True when the flag is a real fastroute flag (a Config field) whose effect is pending.
    parsed: bool = False

    @property
    def family(self) -> bool:
        return self.name.endswith("-")

    def accepts(self, values: Sequence[str]) -> bool:
        """Whether these values let the router start."""
        if self.status != REFUSED:
            return True
        return self.neutral is not None and self.neutral(values)


_DISCOVERY_EXTRA = (
    "smg's discovery reads it to annotate workers; fastroute's discovery does not, and routing never uses it"
)
_NO_MEDIA = "fastroute forwards multimodal requests as they are and never fetches or processes media"
_NO_HISTORY = (
    "storage of conversations/responses; fastroute serves no Responses or Conversations API, so nothing is stored"
)
_NO_TOKENIZER = (
    "fastroute forwards text and never parses model output (it tokenizes prompts only with --tokenizer-path)"
)

TABLE: tuple[Flag, ...] = (
    # ---- security and availability (never ignored: that would leave the router open) ---------
    Flag("--jwt-", REFUSED, "JWT/OIDC authentication is not implemented; ignoring it would leave the admin API open"),
    Flag(
        "--encode-selector",
        REFUSED,
        "encoder (EPD) workers are not supported; discovered encode pods would never be used",
    ),
    Flag("--kv-connector-annotation", INERT, _DISCOVERY_EXTRA),
    Flag("--kv-engine-id-annotation", INERT, _DISCOVERY_EXTRA),
    Flag("--model-id-from", INERT, _DISCOVERY_EXTRA),
    Flag("--enable-mesh", REFUSED, "multi-router HA coordination is not implemented"),
    Flag(
        "--router-selector",
        REFUSED,
        "smg selects the router pods of its HA mesh with it, which "
        "is not implemented (it is not a --router- spelling of --selector: give the worker pod "
        "selector as --selector)",
    ),
    Flag("--mesh-", INERT, "only used by --enable-mesh, which is refused"),
    Flag("--enable-wasm", REFUSED, "WASM middleware is not implemented; it may decide who gets in"),
    Flag("--storage-hook-wasm-path", INERT, _NO_HISTORY),
    # ---- routing ------------------------------------------------------------------------------
    Flag(
        "--routing-key-override",
        REFUSED,
        "sticky sessions are not implemented; use --policy "
        "consistent_hashing with X-SMG-Routing-Key or --routing-key-headers",
    ),
    Flag(
        "--sticky-sessions",
        REFUSED,
        "sticky sessions are not implemented; use --policy "
        "consistent_hashing with X-SMG-Routing-Key or --routing-key-headers",
    ),
    Flag(
        "--dp-minimum-tokens-scheduler",
        REFUSED,
        "the minimum-tokens DP scheduler is not implemented; use --dp-aware with --decode-input-demand on",
    ),
    Flag("--epd-disaggregation", REFUSED, "encode/prefill/decode disaggregation is not implemented"),
    Flag("--encode", REFUSED, "encode workers (EPD mode) are not implemented"),
    Flag("--encode-policy", INERT, "policy of encode workers (EPD mode), which is refused"),
    Flag("--bucket-adjust-interval-secs", INERT, "only used by the bucket policy, which is refused"),
    Flag("--prefix-token-count", INERT, "only used by the prefix_hash policy, which is refused"),
    Flag("--prefix-hash-", INERT, "only used by the prefix_hash policy, which is refused"),
    Flag("--least-load-", INERT, "only used by the least_load policy, which is refused"),
    Flag(
        "--balance-token-usage-threshold",
        REFUSED,
        "KV-usage spread gate of cache_aware is not implemented (a value >= 1.0, off, is accepted)",
        neutral=_at_least_one,
    ),
    Flag(
        "--overload-token-usage-threshold",
        REFUSED,
        "KV-usage ceiling of cache_aware is not implemented (a value >= 1.0, off, is accepted)",
        neutral=_at_least_one,
    ),
    Flag(
        "--selection-policy",
        REFUSED,
        "only the cache-aware-default selection exists in fastroute",
        neutral=_one_of("cache-aware-default"),
    ),
    Flag(
        "--selection-accounting-ttl-ms",
        REFUSED,
        "optimistic cache_aware bookings are not implemented (0, off, is accepted)",
        neutral=_zero,
    ),
    Flag(
        "--overlap-decay", REFUSED, "cache_aware overlap decay is not implemented (0, off, is accepted)", neutral=_zero
    ),
    Flag(
        "--selection-temperature",
        REFUSED,
        "cache_aware softmax selection is not implemented (0, exact argmax, is accepted)",
        neutral=_zero,
    ),
    Flag("--cache-index", REFUSED, "only the prefix tree index exists in fastroute", neutral=_one_of("tree")),
    Flag("--cache-boundaries", INERT, "only used by --cache-index hash, which is refused"),
    Flag("--cache-ttl-secs", INERT, "fastroute's prefix tree ages by --eviction-interval-secs and --max-tree-size"),
    Flag(
        "--kv-index",
        INERT,
        "the data structure of smg's event-driven KV index (positional or chain); fastroute has one "
        "exact index of the engine's KV events (--kv-events)",
    ),
    Flag(
        "--cb-window-duration-secs",
        INERT,
        "smg checks it is at least 1 and its circuit "
        "breaker never reads it (it counts consecutive failures); fastroute does the same",
        parsed=True,
    ),
    # ---- worker health (smg 1.13) -------------------------------------------------------------
    Flag(
        "--disable-worker-overload-protection",
        IMPLEMENTED,
        "both overload thresholds off (--worker-overload-waiting-requests 0, "
        "--worker-overload-token-usage 1.0): no rank is left out, held or shed for its waiting "
        "queue or KV usage",
    ),
    Flag(
        "--worker-overload-protection",
        REFUSED,
        "leaving overloaded workers out of routing is "
        "implemented only with --priority-scheduler-enabled or --worker-overload-shed (smg does it "
        "by default); give --disable-worker-overload-protection to start without it",
    ),
    Flag(
        "--worker-stall-secs",
        REFUSED,
        "contact-age exclusion is not implemented; fastroute "
        "excludes failing workers by --cb-* and --health-* (0 is accepted)",
        neutral=_zero,
    ),
    Flag(
        "--worker-wedge-secs",
        REFUSED,
        "progress-based exclusion is not implemented; fastroute "
        "excludes failing workers by --cb-* and --health-* (0 is accepted)",
        neutral=_zero,
    ),
    Flag(
        "--worker-stale-secs", REFUSED, "KV-event staleness exclusion is not implemented (0 is accepted)", neutral=_zero
    ),
    Flag(
        "--worker-warmup-",
        REFUSED,
        "the cache_aware warm-up slice is not implemented (0, off, is accepted)",
        neutral=_zero,
    ),
    Flag(
        "--remove-unhealthy-workers",
        INERT,
        "fastroute keeps an unhealthy worker registered, out "
        "of routing, and re-admits it after --health-success-threshold good probes: the recovery "
        "this flag exists for",
    ),
    Flag(
        "--worker-auto-recovery",
        INERT,
        "fastroute keeps an unhealthy worker registered, out of "
        "routing, and re-admits it after --health-success-threshold good probes",
    ),
    Flag("--no-remove-unhealthy-workers", IMPLEMENTED, "fastroute keeps unhealthy workers registered"),
    Flag("--no-worker-auto-recovery", IMPLEMENTED, "fastroute keeps unhealthy workers registered"),
    Flag(
        "--worker-startup-delay",
        INERT,
        "fastroute probes a new worker until "
        "--worker-startup-timeout-secs; an earlier first probe only fails and is retried",
    ),
    # ---- admission ----------------------------------------------------------------------------
    Flag(
        "--prefill-max-inflight-requests-per-worker",
        REFUSED,
        "PD prefill admission is not implemented (a value <= 0, off, is accepted)",
        neutral=_non_positive,
    ),
    Flag(
        "--prefill-queue-size", INERT, "only used with --prefill-max-inflight-requests-per-worker > 0, which is refused"
    ),
    Flag(
        "--prefill-queue-timeout-secs",
        INERT,
        "only used with --prefill-max-inflight-requests-per-worker > 0, which is refused",
    ),
    Flag("--pd-admission-wait-secs", REFUSED, "the PD decode running-window gate is not implemented"),
    Flag("--max-background-responses", INERT, "the Responses API is not served by fastroute"),
    Flag(
        "--max-buffered-request-bytes",
        INERT,
        "fastroute reads a whole request body (bounded by "
        "--max-payload-size) before it routes, so every request stays retryable",
    ),
    Flag(
        "--stream-body-stall-timeout-secs",
        INERT,
        "fastroute reads a whole request body before it routes and never streams it to a worker",
    ),
    Flag("--job-queue-", INERT, "fastroute registers workers as tasks without a bounded job queue"),
    # ---- transport, observability and features fastroute does not have ----------------------
    Flag("--upstream-http2", INERT, "fastroute speaks HTTP/1.1 to workers; same workers, same requests"),
    Flag("--mini-lb", INERT, "fastroute replaces mini_lb (same PD request semantics)"),
    Flag("--jemalloc-prof-dir", INERT, "a heap-profiling route of smg's Rust build"),
    Flag("--enable-rl", INERT, "the /v1/rl control routes are not served (404)"),
    Flag("--rl-", INERT, "only used with --enable-rl"),
    Flag("--storage-context-headers", INERT, _NO_HISTORY),
    Flag("--history-backend", INERT, _NO_HISTORY),
    Flag("--history-memory-", INERT, _NO_HISTORY),
    Flag("--oracle-", INERT, _NO_HISTORY),
    Flag("--postgres-", INERT, _NO_HISTORY),
    Flag("--redis-", INERT, _NO_HISTORY),
    Flag("--schema-config", INERT, _NO_HISTORY),
    Flag("--mcp-config-path", INERT, "MCP tools are not served by fastroute"),
    Flag("--model", INERT, _NO_TOKENIZER),
    Flag("--parser", INERT, _NO_TOKENIZER),
    Flag("--reasoning-parser", INERT, _NO_TOKENIZER),
    Flag("--tool-call-parser", INERT, _NO_TOKENIZER),
    Flag(
        "--disable-tokenizer-autoload",
        IMPLEMENTED,
        "fastroute loads a tokenizer only from --tokenizer-path or --model-path, never on its own",
    ),
    Flag(
        "--backend",
        REFUSED,
        "fastroute routes to SGLang workers only; an openai, anthropic, "
        "vllm or tokenspeed backend is out of scope (sglang is accepted)",
        neutral=_one_of("sglang"),
    ),
    Flag("--zmq-engine-count", INERT, "fastroute has no ZMQ workers"),
    Flag("--multimodal-", INERT, _NO_MEDIA),
    Flag("--mm-", INERT, _NO_MEDIA),
    Flag("--rdma-", INERT, _NO_MEDIA),
    Flag("--log-mm-timing", INERT, _NO_MEDIA),
)

_BY_NAME: dict[str, Flag] = {f.name: f for f in TABLE if not f.family}
FAMILIES: tuple[Flag, ...] = tuple(f for f in TABLE if f.family)
FAMILY_PREFIXES: tuple[str, ...] = tuple(f.name for f in FAMILIES)
# Compatibility flags the parser must know by name (real fastroute flags have their own).
COMPAT_NAMES: tuple[str, ...] = tuple(f.name for f in TABLE if not f.family and not f.parsed)
PARSED_NAMES: frozenset[str] = frozenset(f.name for f in TABLE if f.parsed)


def row_of(flag: str) -> Flag:
    """The row of a flag the inventory lists (its COMPAT_NAMES); KeyError for any other."""
    row = lookup(flag)
    if row is None:
        raise KeyError(flag)
    return row


def lookup(flag: str) -> Flag | None:
    """The row governing ``flag`` (canonical spelling, no ``--router-`` prefix)."""
    row = _BY_NAME.get(flag)
    if row is not None:
        return row
    for fam in FAMILIES:
        if flag.startswith(fam.name):
            return fam
    return None


class RefusedFlag(ValueError):
    """A refused flag on the command line; the message names it and says why."""

    def __init__(self, flag: str, reason: str) -> None:
        self.flag = flag
        super().__init__(f"argument {flag}: not supported by fastroute: {reason}")


def apply(given: Sequence[tuple[str, Sequence[str]]]) -> list[str]:
    """Judge the table's flags found on a command line (``(flag, values)`` in order).

    Raises :class:`RefusedFlag` for the first refused one; returns one warning per distinct inert
    flag, in order of appearance."""
    warnings: list[str] = []
    seen: set[str] = set()
    for flag, values in given:
        row = lookup(flag)
        if row is None:
            continue
        if not row.accepts(values):
            raise RefusedFlag(flag, row.reason)
        if row.status == INERT and flag not in seen:
            seen.add(flag)
            warnings.append(f"{flag} is accepted for compatibility and ignored by fastroute ({row.reason})")
    return warnings


def markdown() -> str:
    """The inventory table of docs/flags.md, generated from ``TABLE``."""
    lines = ["| flag | status | why |", "|---|---|---|"]
    for f in sorted(TABLE, key=lambda r: (STATUSES.index(r.status), r.name)):
        name = f"`{f.name}*`" if f.family else f"`{f.name}`"
        lines.append(f"| {name} | {f.status} | {f.reason} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
