# Policy kernels: pure functions over the target table (filter -> score -> pick), no booking.
# Each returns a target row id, or -1 when no candidate is eligible (healthy, circuit not open).
from libc.stdint cimport int64_t, uint64_t

cdef enum:
    METRIC_TOKENS = 0
    METRIC_REQUESTS = 1
    METRIC_LEAST_REQUESTS = 2

cdef uint64_t rng_next(uint64_t *state) noexcept nogil
cdef uint64_t rng_below(uint64_t *state, uint64_t n) noexcept nogil
cdef uint64_t hash_bytes(const unsigned char *data, Py_ssize_t n) noexcept nogil
cdef bint eligible(int64_t[:, ::1] tab, int64_t t) noexcept nogil

cdef int64_t pick_round_robin(int64_t[:, ::1] tab,          # IN (shared)
                              const int64_t[::1] cands,     # IN
                              int64_t *cursor) noexcept nogil   # INOUT
cdef int64_t pick_random(int64_t[:, ::1] tab, const int64_t[::1] cands,
                         uint64_t *rng) noexcept nogil
cdef int64_t pick_p2c(int64_t[:, ::1] tab, const int64_t[::1] cands, int metric,
                      uint64_t *rng) noexcept nogil
cdef int64_t pick_demand(int64_t[:, ::1] tab, const int64_t[::1] cands, int64_t tokens,
                         int64_t weight, uint64_t *rng) noexcept nogil
cdef int64_t pick_ring(int64_t[:, ::1] tab, const uint64_t[::1] ring_hash,
                       const int64_t[::1] ring_target, uint64_t key) noexcept nogil
cdef int64_t kv_free(int64_t[:, ::1] tab, int64_t t) noexcept nogil
cdef int64_t pick_kv_fit(int64_t[:, ::1] tab, const int64_t[::1] cands, int64_t tokens,
                         int64_t need, bint use_demand, int64_t weight,
                         uint64_t *rng) noexcept nogil
