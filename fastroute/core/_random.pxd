# The kernels' random numbers: splitmix64 with explicit state (per process or per group, seedable),
# and the reservoir step every "ties at random" loop uses.  Inline here, once, so _policy, _ledger
# and _tree each compile their own copy instead of calling through a function pointer.
# fastroute.core.reference.Rng reproduces this stream bit for bit.
from libc.stdint cimport int64_t, uint64_t


cdef inline uint64_t mix64(uint64_t z) noexcept nogil:
    # The splitmix64 finaliser (also spreads the FNV hash of ring keys).
    z = (z ^ (z >> 30)) * <uint64_t>0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * <uint64_t>0x94D049BB133111EB
    return z ^ (z >> 31)


cdef inline uint64_t rng_next(uint64_t *state) noexcept nogil:       # state: INOUT
    state[0] += <uint64_t>0x9E3779B97F4A7C15
    return mix64(state[0])


cdef inline uint64_t rng_below(uint64_t *state, uint64_t n) noexcept nogil:   # state: INOUT
    # Multiply-shift on the top 32 bits: unbiased enough for n < 2^32 (bias < n / 2^32).
    return ((rng_next(state) >> 32) * n) >> 32


cdef inline bint reservoir_step(uint64_t *state, int64_t *ties) noexcept nogil:  # both INOUT
    # One more candidate tied with the current best: it takes over with probability 1/ties, so
    # each of N tied candidates ends up chosen with probability 1/N (Envoy's full-scan rule).
    # The _policy kernels start a new best with ties = 1 and no draw; _tree's loops call this for
    # the first candidate too (rng_below(1) is 0 but consumes a draw).  The twins mirror both.
    ties[0] += 1
    return rng_below(state, <uint64_t>ties[0]) == 0
