# Column layout of the shared target table, mirrored by fastroute/core/table.py:
# tests/unit/test_table.py checks every constant of this file against table.py and
# _policy.layout(), in both directions.
# One row per target, 24 int64 cells = 192 bytes = three cache lines, so processes updating
# neighbouring targets never share a line.  Cells 15..17 are the other router replicas' view
# (fastroute.control.replica writes them off the request path; zero without --replica-sync);
# 18..20 the replicas' coordination (estimated placements of the others since the last sync,
# the shared tie-break order); 21..22 what the last poll said of queued work; 23 the rank's
# max_running_requests (flow control's capacity).
from libc.stdint cimport int64_t, INT64_MIN
from fastroute.core._atomic cimport fr_load_i64, fr_add_i64, fr_store_i64

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
    COL_TOKENS_AT_POLL = 11      # in-flight tokens (all replicas) when the last poll landed
    COL_CB_FAILS = 12            # circuit breaker: consecutive failures (all processes together)
    COL_CB_OKS = 13              # circuit breaker: successes since the circuit went half-open
    COL_CB_OPENED_AT = 14        # circuit breaker: monotonic clock in microseconds when it last opened
    COL_OTHERS_OPEN = 15         # 1: another live replica has this target's circuit open (same line
                                 # as COL_CIRCUIT, so the eligibility check reads no extra line)
    COL_OTHERS_IN_FLIGHT = 16    # requests the other live replicas have in flight here (last published)
    COL_OTHERS_TOKENS = 17       # input tokens of those requests
    COL_OTHERS_EST = 18          # requests the other replicas are estimated to have placed here
                                 # since the last sync (the picker adds them; the sync zeroes them)
    COL_OTHERS_EST_TOKENS = 19   # input tokens of those estimated requests
    COL_ORDER_KEY = 20           # tie-break order every replica shares: hash of the target name
    COL_POLLED_UNCACHED = 21     # last /v1/loads num_waiting_uncached_tokens of a prefill; -1 unknown
    COL_POLLED_KV_QUEUE = 22     # last /v1/loads decode prealloc + retracted queue requests
    COL_POLLED_MAX_RUNNING = 23  # last /v1/loads max_running_requests; 0 unknown (flow control)
    NCOLS = 24

cdef enum:
    HDR_MAGIC = 0
    HDR_CAPACITY = 1
    HDR_UNDERFLOWS = 2           # releases that found the counter at zero (a bug signal)
    HDR_GENERATION = 3           # bumped when the target set changes
    HDR_REPLICAS = 4             # live router replicas, this one included (0 or 1: alone)
    HDR_REPLICA_SLOT = 5         # this replica's place among them (sorted replica ids)
    HDR_SYNC_TICKS = 6           # successful sync ticks (a picker sees a new view when it moves)
    HDR_FEED_ON = 7              # indexes kept by pickers (every process): writers publish while > 0
    HDR_FEED_AT = 8              # rows published so far: the next feed position (own cache line)
    HDR_FEED = 16                # the feed: a ring of HDR_FEED_SLOTS cells, (position << bits) | row
    HDR_FEED_SLOTS = 4096        # a power of two
    HDR_FEED_ROW_BITS = 24       # a row id's bits in a feed cell (--max-targets <= 2^24)
    NHDR = 4112                  # HDR_FEED + HDR_FEED_SLOTS

# Values of COL_CIRCUIT (fastroute.names spells the same codes for the Python side).
cdef enum:
    CIRCUIT_CLOSED = 0
    CIRCUIT_OPEN = 1
    CIRCUIT_HALF_OPEN = 2


cdef inline bint row_eligible(const int64_t *row) noexcept nogil:
    # The one eligibility rule of every kernel and the prefix tree: healthy, circuit not open here
    # (half-open may take a probe) and not open at another replica.  Inline here so no module
    # calls it through a function pointer.
    return (fr_load_i64(&row[COL_HEALTHY]) == 1 and fr_load_i64(&row[COL_CIRCUIT]) != CIRCUIT_OPEN
            and fr_load_i64(&row[COL_OTHERS_OPEN]) == 0)


cdef inline int64_t row_requests(const int64_t *row) noexcept nogil:
    # Requests in flight on a target across all replicas: this host's exact count plus the
    # other replicas' last published one (zero without --replica-sync).
    return (fr_load_i64(&row[COL_IN_FLIGHT]) + fr_load_i64(&row[COL_OTHERS_IN_FLIGHT])
            + fr_load_i64(&row[COL_OTHERS_EST]))


cdef inline int64_t row_tokens(const int64_t *row) noexcept nogil:
    # Input tokens in flight on a target across all replicas (as row_requests).
    return (fr_load_i64(&row[COL_IN_FLIGHT_TOKENS]) + fr_load_i64(&row[COL_OTHERS_TOKENS])
            + fr_load_i64(&row[COL_OTHERS_EST_TOKENS]))


cdef inline int64_t row_pending(const int64_t *row) noexcept nogil:
    # The input tokens a demand cost charges a target with: those in flight, or, where the
    # last poll of a prefill said how many uncached tokens were waiting, that figure moved by
    # what the router booked and released since (as kv_free moves the polled KV use).
    cdef int64_t live = row_tokens(row)
    cdef int64_t polled = fr_load_i64(&row[COL_POLLED_UNCACHED])
    cdef int64_t est
    if polled < 0 or fr_load_i64(&row[COL_POLLED_AT]) < 0:
        return live
    est = polled + live - fr_load_i64(&row[COL_TOKENS_AT_POLL])
    return est if est > 0 else 0


cdef inline void feed_publish(int64_t *header, int64_t t) noexcept nogil:
    # Tell the pickers' load indexes (_index.pxd) that row t changed a cell their key reads.
    # Called after the write; every caller's write is a read-modify-write (a full barrier), so
    # a picker that turns the feed on and then reads the rows sees the write or its notice.
    cdef int64_t i
    if fr_load_i64(&header[HDR_FEED_ON]) == 0:
        return
    i = fr_add_i64(&header[HDR_FEED_AT], 1)
    fr_store_i64(&header[HDR_FEED + (i & (HDR_FEED_SLOTS - 1))],
                 ((i & ((<int64_t>1 << (63 - HDR_FEED_ROW_BITS)) - 1)) << HDR_FEED_ROW_BITS) | t)


cdef inline int64_t plan_level(int64_t cost, bint fits, int64_t free) noexcept nogil:
    # A coordinated placement's level (_policy.pick_coordinated, _coindex.coord_plan): its cost
    # where the need fits, else below every fitting level by its free KV (more free, lower).
    return cost if fits else (<int64_t>1 << 62) - free


cdef inline int64_t plan_place(int64_t *picks, int64_t n, int64_t slot, bint strict) noexcept nogil:
    # This replica's place among the n placements of a plan (picks[0..n) rows, picks[n..2n)
    # levels): ``slot`` when strict, else slot modulo the placements as good as the first.
    # Written to picks[2n]; returns its row.
    cdef int64_t s, ties = 0
    for s in range(n):
        if picks[n + s] == picks[n]:
            ties += 1
    picks[2 * n] = slot if strict else slot % ties
    return picks[picks[2 * n]]


cdef inline int64_t feed_row(const int64_t *header, int64_t i, int64_t *hole) noexcept nogil:
    # A reader's (an index's drain) notice i: the row it names, or -1 when its cell is not
    # written yet (a writer between its two steps, or one that died there); the first such i
    # is kept in ``hole``, from which feed_next re-reads.
    cdef int64_t v = fr_load_i64(&header[HDR_FEED + (i & (HDR_FEED_SLOTS - 1))])
    if (v >> HDR_FEED_ROW_BITS) != (i & ((<int64_t>1 << (63 - HDR_FEED_ROW_BITS)) - 1)):
        if hole[0] < 0:
            hole[0] = i
        return -1
    return v & ((<int64_t>1 << HDR_FEED_ROW_BITS) - 1)


cdef inline bint feed_next(int64_t end, int64_t hole, int64_t *pos) noexcept nogil:
    # After reading the notices up to ``end``: where the next drain starts (a notice not written
    # yet is read again then, with everything after it: re-reading a row is harmless); True
    # when the reader must rebuild instead (the ring moved half its length past that notice).
    if hole < 0:
        pos[0] = end
        return False
    if end - hole > HDR_FEED_SLOTS // 2:
        return True
    pos[0] = hole
    return False


cdef inline int64_t row_kv_free(const int64_t *row) noexcept nogil:
    # Estimated free KV tokens of a rank now, or INT64_MIN when its capacity is unknown.
    # The poll says what the engine had allocated then; since then the router booked and
    # released input tokens on this rank, so used ~= polled used + (in-flight tokens now - at the
    # poll).  Requests still in prefill or in the prealloc queue hold no KV in the engine yet but
    # will, so the rank is never credited with less than all its in-flight input tokens.  "The
    # router" is every replica: in-flight tokens are this host's plus the other replicas' last
    # published ones, and the poll stamps that same sum (``_ledger.store_polled``).  A rank whose
    # last poll had requests in the decode prealloc or retracted queue was out of KV then,
    # whatever its count says: it is credited with none free (0 at most).
    cdef int64_t cap = fr_load_i64(&row[COL_POLLED_MAX_TOKENS])
    cdef int64_t used, live
    if cap <= 0 or fr_load_i64(&row[COL_POLLED_AT]) < 0:
        return INT64_MIN
    live = row_tokens(row)
    used = fr_load_i64(&row[COL_POLLED_TOKENS]) + live - fr_load_i64(&row[COL_TOKENS_AT_POLL])
    if used < live:
        used = live
    if fr_load_i64(&row[COL_POLLED_KV_QUEUE]) > 0 and used < cap:
        used = cap
    return cap - used
