# Policy kernels: pure functions over the target table (filter -> score -> pick), no booking.
# Each returns a target row id, or -1 when no candidate is eligible (healthy, circuit not open).
# The table is read-only here (const): booking is the ledger's job.  Shared inline helpers (the
# eligibility rule, the RNG, the reservoir step) live in _layout.pxd and _random.pxd.
from libc.stdint cimport int64_t, uint64_t

# Load-metric codes of pick_p2c (fastroute.names.LOAD_METRIC_CODE spells the same codes).
cdef enum:
    METRIC_TOKENS = 0
    METRIC_REQUESTS = 1
    METRIC_LEAST_REQUESTS = 2

# Demand and KV-fit mode codes of the Picker (fastroute.names.MODE_CODE spells the same codes).
cdef enum:
    MODE_OFF = 0
    MODE_SHADOW = 1
    MODE_ON = 2

cdef uint64_t hash_bytes(const unsigned char *data,          # IN
                         Py_ssize_t n) noexcept nogil

cdef int64_t pick_round_robin(const int64_t[:, ::1] tab,    # IN (shared)
                              const int64_t[::1] cands,     # IN
                              int64_t *cursor) noexcept nogil   # INOUT
cdef int64_t pick_random(const int64_t[:, ::1] tab,         # IN (shared)
                         const int64_t[::1] cands,          # IN
                         uint64_t *rng) noexcept nogil      # INOUT
cdef int64_t pick_p2c(const int64_t[:, ::1] tab,            # IN (shared)
                      const int64_t[::1] cands,             # IN
                      int metric,                           # IN: METRIC_*
                      uint64_t *rng) noexcept nogil         # INOUT
cdef int64_t pick_demand(const int64_t[:, ::1] tab,         # IN (shared)
                         const int64_t[::1] cands,          # IN
                         int64_t tokens, int64_t weight,    # IN
                         uint64_t *rng) noexcept nogil      # INOUT
cdef int64_t pick_ring(const int64_t[:, ::1] tab,           # IN (shared)
                       const uint64_t[::1] ring_hash,       # IN, sorted
                       const int64_t[::1] ring_target,      # IN, same length
                       uint64_t key) noexcept nogil         # IN
cdef int64_t kv_free(const int64_t[:, ::1] tab,             # IN (shared)
                     int64_t t) noexcept nogil              # IN
cdef int64_t pick_kv_fit(const int64_t[:, ::1] tab,         # IN (shared)
                         const int64_t[::1] cands,          # IN
                         int64_t tokens, int64_t need,      # IN
                         bint use_demand, int64_t weight,   # IN
                         uint64_t *rng) noexcept nogil      # INOUT
cdef int64_t pick_coordinated(const int64_t[:, ::1] tab,    # IN (shared)
                              const int64_t[::1] cands,     # IN
                              int64_t tokens, int64_t need, # IN
                              bint use_demand, int64_t weight, bint kv,  # IN
                              int64_t n, int64_t slot,      # IN: replicas, this one's place
                              bint strict,                  # IN: a later pick of a burst
                              int64_t *extra,               # SCRATCH: 2 x candidates
                              int64_t *picks) noexcept nogil  # OUT: 2n + 1 (see .pyx)
