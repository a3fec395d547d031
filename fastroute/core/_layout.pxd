# Column layout of the shared target table, mirrored by fastroute/core/table.py:
# tests/unit/test_table.py checks every constant of this file against table.py and
# _policy.layout(), in both directions.
# One row per target, 16 int64 cells = 128 bytes = two cache lines, so processes updating neighbouring
# targets never share a line.
from libc.stdint cimport int64_t
from fastroute.core._atomic cimport fr_load_i64

cdef enum:
    COL_IN_FLIGHT = 0            # requests booked and not yet released (router-side, live)
    COL_IN_FLIGHT_TOKENS = 1     # sum of the input tokens of those requests
    COL_POLLED_RUNNING = 2       # last /v1/loads num_running_reqs
    COL_POLLED_WAITING = 3       # last /v1/loads num_waiting_reqs
    COL_POLLED_TOKENS = 4        # last /v1/loads num_used_tokens (/get_load num_tokens)
    COL_POLLED_AT = 5            # ms since the epoch of that poll; -1 = never polled or unknown
    COL_HEALTHY = 6              # 1 healthy, 0 not
    COL_PICKS = 7                # picks total (monotonic)
    COL_CIRCUIT = 8              # a CIRCUIT_* state (below)
    COL_POLLED_MAX_TOKENS = 9    # max_total_num_tokens of the rank, -1 unknown
    COL_ALLOCATED = 10           # row in use
    COL_TOKENS_AT_POLL = 11      # in-flight tokens when the last poll landed (KV deltas since poll)
    COL_CB_FAILS = 12            # circuit breaker: consecutive failures (all processes together)
    COL_CB_OKS = 13              # circuit breaker: successes since the circuit went half-open
    COL_CB_OPENED_AT = 14        # circuit breaker: monotonic clock in microseconds when it last opened
    NCOLS = 16

cdef enum:
    HDR_MAGIC = 0
    HDR_CAPACITY = 1
    HDR_UNDERFLOWS = 2           # releases that found the counter at zero (a bug signal)
    HDR_GENERATION = 3           # bumped when the target set changes
    NHDR = 8

# Values of COL_CIRCUIT (fastroute.names spells the same codes for the Python side).
cdef enum:
    CIRCUIT_CLOSED = 0
    CIRCUIT_OPEN = 1
    CIRCUIT_HALF_OPEN = 2


cdef inline bint row_eligible(const int64_t *row) noexcept nogil:
    # The one eligibility rule of every kernel and the prefix tree: healthy, and circuit not open
    # (half-open may take a probe).  Inline here so no module calls it through a function pointer.
    return fr_load_i64(&row[COL_HEALTHY]) == 1 and fr_load_i64(&row[COL_CIRCUIT]) != CIRCUIT_OPEN
